// Tokenizer files for the random checkpoints (dxs gen-model), so that Hugging Face
// `tokenizers`, transformers and the SMG gateway can turn text into the model's ids.
//
// tokenizer.json is a byte-level BPE (GPT-2's byte-to-unicode map, ByteLevel
// pre-tokenizer, decoder and post-processor, no normaliser) of exactly vocab_size entries,
// so every id the model can produce decodes and every UTF-8 text round-trips. Special
// tokens sit at fixed ids: the first eos id is "<|im_end|>", further eos ids
// "<|eos_ID|>", the bos id "<|endoftext|>"; "<|im_start|>", "<think>" and "</think>"
// (added but not special, as in Qwen3) take the lowest free ids, then the 256 byte
// symbols, then deterministic merges (common ASCII letter pairs, with and without the 'Ġ'
// space prefix, then longer ones built from earlier merges) fill the rest.
// tokenizer_config.json carries a Qwen3-style chat template; generation_config.json the
// bos, eos and pad ids.
//
// None of these files enters CheckpointFingerprint or the model identity: adding them to
// an existing checkpoint changes neither.
#pragma once

#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/model_config.h"

namespace dxs {

inline constexpr char kTokenizerFile[] = "tokenizer.json";
inline constexpr char kTokenizerConfigFile[] = "tokenizer_config.json";
inline constexpr char kGenerationConfigFile[] = "generation_config.json";

// The three files' texts, as WriteTokenizerFiles writes them. INVALID_ARGUMENT if the
// config does not validate or its vocabulary cannot hold the special tokens and the 256
// byte symbols.
struct TokenizerFiles {
  std::string tokenizer_json;
  std::string tokenizer_config_json;
  std::string generation_config_json;
};
absl::StatusOr<TokenizerFiles> MakeTokenizerFiles(const ModelConfig& config);

// Writes the three files into `dir` (which must exist), replacing any there.
absl::Status WriteTokenizerFiles(const ModelConfig& config, const std::string& dir);

// True when `dir` holds all three files.
bool HasTokenizerFiles(const std::string& dir);

}  // namespace dxs
