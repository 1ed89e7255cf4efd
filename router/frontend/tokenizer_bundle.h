// The model directory's tokenizer files as the gateway protocol's GetTokenizer serves them: a
// zip archive with the files at its root, and the SHA-256 of the whole archive (lowercase
// hex), which the gateway checks (smg-grpc-proto common.proto, GetTokenizerChunk).
#pragma once

#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace dxs {

struct TokenizerBundle {
  std::string zip;                 // the archive's bytes
  std::string sha256;              // of `zip`, 64 lowercase hex digits
  std::vector<std::string> files;  // what it holds, in archive order
};

// The files a tokenizer is built from, in the order they are archived; those the directory
// has go in (tokenizer.json, or vocab.json + merges.txt, is required; config.json and
// generation_config.json give the gateway the EOS ids).
inline constexpr const char* kTokenizerBundleFiles[] = {"tokenizer.json",
                                                        "tokenizer_config.json",
                                                        "special_tokens_map.json",
                                                        "generation_config.json",
                                                        "config.json",
                                                        "vocab.json",
                                                        "merges.txt",
                                                        "chat_template.jinja",
                                                        "chat_template.json",
                                                        "added_tokens.json",
                                                        "tokenizer.model"};

// NOT_FOUND naming the directory when it has no tokenizer (no tokenizer.json, vocab.json or
// tokenizer.model).
absl::StatusOr<TokenizerBundle> MakeTokenizerBundle(const std::string& model_dir);

}  // namespace dxs
