// The tokenizer files of every preset: exactly vocab_size ids, the special tokens at their
// ids, every merge valid and in an order that builds it; the fingerprint ignores them.
#include "model/tokenizer_files.h"

#include <unistd.h>

#include <filesystem>
#include <map>
#include <set>
#include <string>

#include "gtest/gtest.h"
#include "model/random_checkpoint.h"
#include "nlohmann/json.hpp"

namespace dxs {
namespace {

using nlohmann::json;

class TokenizerFilesTest : public ::testing::TestWithParam<std::string> {};

TEST_P(TokenizerFilesTest, VocabSpecialsAndMerges) {
  absl::StatusOr<CheckpointPreset> preset = GetPreset(GetParam());
  ASSERT_TRUE(preset.ok()) << preset.status();
  const ModelConfig& c = preset->config;
  absl::StatusOr<TokenizerFiles> files = MakeTokenizerFiles(c);
  ASSERT_TRUE(files.ok()) << files.status();
  const json tok = json::parse(files->tokenizer_json);

  // Exactly vocab_size entries, ids 0..vocab_size-1 each once.
  const json& vocab = tok.at("model").at("vocab");
  ASSERT_EQ(static_cast<int64_t>(vocab.size()), c.vocab_size);
  std::vector<std::string> by_id(c.vocab_size);
  for (const auto& [token, id_json] : vocab.items()) {
    const int64_t id = id_json.get<int64_t>();
    ASSERT_GE(id, 0);
    ASSERT_LT(id, c.vocab_size);
    ASSERT_TRUE(by_id[id].empty()) << "id " << id << " twice";
    by_id[id] = token;
  }

  // The special tokens, at their ids, in the model's vocabulary as well.
  std::map<std::string, std::pair<int64_t, bool>> added;
  for (const json& t : tok.at("added_tokens")) {
    added[t.at("content").get<std::string>()] = {t.at("id").get<int64_t>(),
                                                 t.at("special").get<bool>()};
    EXPECT_EQ(by_id[t.at("id").get<int64_t>()], t.at("content").get<std::string>());
  }
  EXPECT_EQ(added.at("<|im_end|>"), std::make_pair(c.eos_token_ids[0], true));
  for (size_t i = 1; i < c.eos_token_ids.size(); ++i) {
    const int64_t id = c.eos_token_ids[i];
    EXPECT_EQ(added.at("<|eos_" + std::to_string(id) + "|>"), std::make_pair(id, true));
  }
  EXPECT_EQ(added.at("<|endoftext|>"), std::make_pair(c.bos_token_id, true));
  EXPECT_TRUE(added.at("<|im_start|>").second);
  EXPECT_FALSE(added.at("<think>").second);
  EXPECT_FALSE(added.at("</think>").second);
  EXPECT_EQ(added.size(), c.eos_token_ids.size() + 4);
  // The three free-standing ones take the lowest free ids.
  std::set<int64_t> fixed(c.eos_token_ids.begin(), c.eos_token_ids.end());
  fixed.insert(c.bos_token_id);
  int64_t expect = 0;
  for (const char* name : {"<|im_start|>", "<think>", "</think>"}) {
    while (fixed.count(expect)) ++expect;
    EXPECT_EQ(added.at(name).first, expect++) << name;
  }

  EXPECT_EQ(tok.at("pre_tokenizer").at("type"), "ByteLevel");
  EXPECT_EQ(tok.at("pre_tokenizer").at("add_prefix_space"), false);
  EXPECT_EQ(tok.at("pre_tokenizer").at("use_regex"), true);
  EXPECT_EQ(tok.at("decoder").at("type"), "ByteLevel");
  EXPECT_EQ(tok.at("model").at("type"), "BPE");

  // 256 one-character byte symbols; with the added tokens they are what merges start from.
  std::set<std::string> built;
  for (const auto& [content, id] : added) built.insert(content);
  int num_single = 0;
  for (const std::string& t : by_id) {
    const bool one_char = t.size() == 1 || (t.size() == 2 && (t[0] & 0xE0) == 0xC0);
    if (one_char) {
      ++num_single;
      built.insert(t);
    }
  }
  EXPECT_EQ(num_single, 256);

  // Every merge: both parts already built (a byte symbol or an earlier merge's result), the
  // result a vocabulary entry not built before.
  const json& merges = tok.at("model").at("merges");
  EXPECT_EQ(static_cast<int64_t>(merges.size()),
            c.vocab_size - 256 - static_cast<int64_t>(added.size()));
  for (size_t r = 0; r < merges.size(); ++r) {
    const std::string m = merges[r].get<std::string>();
    const size_t space = m.find(' ');
    ASSERT_NE(space, std::string::npos) << m;
    ASSERT_EQ(m.find(' ', space + 1), std::string::npos) << m;
    const std::string a = m.substr(0, space), b = m.substr(space + 1);
    ASSERT_TRUE(built.count(a)) << "merge " << r << " " << m << ": left part not built yet";
    ASSERT_TRUE(built.count(b)) << "merge " << r << " " << m << ": right part not built yet";
    ASSERT_TRUE(vocab.contains(a + b)) << "merge " << r << " " << m;
    ASSERT_TRUE(built.insert(a + b).second) << "merge " << r << " " << m << ": result repeats";
  }
  EXPECT_EQ(static_cast<int64_t>(built.size()), c.vocab_size);

  const json cfg = json::parse(files->tokenizer_config_json);
  EXPECT_EQ(cfg.at("eos_token"), "<|im_end|>");
  EXPECT_EQ(cfg.at("pad_token"), "<|endoftext|>");
  EXPECT_EQ(cfg.at("tokenizer_class"), "Qwen2Tokenizer");
  EXPECT_EQ(cfg.at("model_max_length"), c.max_position_embeddings);
  EXPECT_EQ(cfg.at("added_tokens_decoder").size(), added.size());
  for (const auto& [content, id] : added) {
    EXPECT_EQ(cfg.at("added_tokens_decoder").at(std::to_string(id.first)).at("content"), content);
  }
  EXPECT_NE(cfg.at("chat_template").get<std::string>().find("add_generation_prompt"),
            std::string::npos);

  const json gen = json::parse(files->generation_config_json);
  EXPECT_EQ(gen.at("bos_token_id"), c.bos_token_id);
  EXPECT_EQ(gen.at("eos_token_id").get<std::vector<int64_t>>(), c.eos_token_ids);
  EXPECT_EQ(gen.at("pad_token_id"), c.bos_token_id);

  // Deterministic.
  absl::StatusOr<TokenizerFiles> again = MakeTokenizerFiles(c);
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(again->tokenizer_json, files->tokenizer_json);
}

INSTANTIATE_TEST_SUITE_P(Presets, TokenizerFilesTest, ::testing::ValuesIn(PresetNames()),
                         [](const auto& info) {
                           std::string n = info.param;
                           for (char& ch : n) {
                             if (ch == '-') ch = '_';
                           }
                           return n;
                         });

TEST(TokenizerFiles, TooSmallVocabularyIsAnError) {
  absl::StatusOr<CheckpointPreset> preset = GetPreset("default");
  ASSERT_TRUE(preset.ok());
  preset->config.vocab_size = 200;
  EXPECT_EQ(MakeTokenizerFiles(preset->config).status().code(), absl::StatusCode::kInvalidArgument);
}

// The checkpoint writers add the files; the fingerprint does not see them, so checkpoints
// written before them keep their fingerprint.
TEST(TokenizerFiles, WrittenWithCheckpointsAndOutsideTheFingerprint) {
  const std::string root =
      ::testing::TempDir() + "/tokenizer_files_test." + std::to_string(::getpid());
  std::filesystem::remove_all(root);
  absl::StatusOr<CheckpointPreset> preset = GetPreset("default");
  ASSERT_TRUE(preset.ok());
  for (const bool in_place : {false, true}) {
    const std::string dir = root + (in_place ? "/in_place" : "/disk");
    ASSERT_TRUE(
        (in_place ? WriteInPlaceCheckpoint(*preset, dir) : WriteRandomCheckpoint(*preset, dir))
            .ok());
    EXPECT_TRUE(HasTokenizerFiles(dir));
    absl::StatusOr<std::string> with = CheckpointFingerprint(dir);
    ASSERT_TRUE(with.ok());
    for (const char* name : {kTokenizerFile, kTokenizerConfigFile, kGenerationConfigFile}) {
      std::filesystem::remove(dir + "/" + name);
    }
    EXPECT_FALSE(HasTokenizerFiles(dir));
    EXPECT_EQ(*CheckpointFingerprint(dir), *with);
  }
  std::filesystem::remove_all(root);
}

}  // namespace
}  // namespace dxs
