// The single-process engine against Hugging Face transformers' Qwen3MoeForCausalLM.
// tests/golden/<preset>.json is written by tools/hf_reference.py from the same seeded
// checkpoint; here we regenerate the checkpoint, check it is byte-identical (fingerprint),
// and require identical greedy tokens and first-position logits within 1e-4 relative,
// for whole-prompt prefill, chunked prefill, token-by-token prefill and batched requests.
// A preset X-fp8 is X written with block-scaled FP8 weights (`gen-model --fp8`); its reference
// is transformers on those weights dequantized in float32 (tools/fp8_checkpoint.py), which
// is what dxs's CPU path computes, so the same bound holds (measured about 1e-6).
#include <algorithm>
#include <cmath>
#include <fstream>

#include "absl/strings/strip.h"
#include "gtest/gtest.h"
#include "model/engine.h"
#include "nlohmann/json.hpp"
#include "tests/model/test_util.h"

namespace dxs {
namespace {

using testing::RelativeError;
using testing::TempDir;

struct GoldenCase {
  std::vector<int32_t> prompt;
  int64_t max_new_tokens;
  std::vector<int32_t> tokens;
  std::vector<float> first_logits;
};

struct Golden {
  std::string fingerprint;
  std::vector<GoldenCase> cases;
};

Golden ReadGolden(const std::string& preset) {
  const std::string path = testing::SourceDir() + "/tests/golden/" + preset + ".json";
  std::ifstream f(path);
  EXPECT_TRUE(f.good()) << "missing " << path;
  nlohmann::json j = nlohmann::json::parse(f);
  Golden g;
  g.fingerprint = j.at("fingerprint").get<std::string>();
  for (const auto& c : j.at("cases")) {
    g.cases.push_back({c.at("prompt_ids").get<std::vector<int32_t>>(),
                       c.at("max_new_tokens").get<int64_t>(),
                       c.at("tokens").get<std::vector<int32_t>>(),
                       c.at("first_logits").get<std::vector<float>>()});
  }
  return g;
}

class GoldenTest : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    golden_ = ReadGolden(GetParam());
    ASSERT_FALSE(golden_.cases.empty());
    absl::string_view preset = GetParam();
    const bool fp8 = absl::ConsumeSuffix(&preset, "-fp8");
    model_dir_ = testing::WritePreset(tmp_, std::string(preset), 0, fp8);
    auto fp = CheckpointFingerprint(model_dir_);
    ASSERT_TRUE(fp.ok()) << fp.status();
    ASSERT_EQ(*fp, golden_.fingerprint)
        << "the checkpoint generator changed; rerun tools/hf_reference.py";
  }

  void CheckAgainstReference(int64_t prefill_chunk, bool batched) {
    EngineOptions options;
    options.prefill_chunk_tokens = prefill_chunk;
    auto engine = LocalEngine::Load(model_dir_, options);
    ASSERT_TRUE(engine.ok()) << engine.status();
    std::vector<GenerationRequest> requests;
    for (const GoldenCase& c : golden_.cases) {
      GenerationRequest r;
      r.prompt = c.prompt;
      r.max_new_tokens = c.max_new_tokens;
      requests.push_back(r);
    }
    std::vector<GenerationResult> results;
    if (batched) {
      auto out = (*engine)->GenerateBatch(requests);
      ASSERT_TRUE(out.ok()) << out.status();
      results = *out;
    } else {
      for (const GenerationRequest& r : requests) {
        auto out = (*engine)->GenerateBatch({r});
        ASSERT_TRUE(out.ok()) << out.status();
        results.push_back(out->front());
      }
    }
    for (size_t i = 0; i < golden_.cases.size(); ++i) {
      const GoldenCase& c = golden_.cases[i];
      SCOPED_TRACE(::testing::Message() << "prompt of " << c.prompt.size() << " tokens");
      EXPECT_EQ(results[i].tokens, c.tokens);
      ASSERT_EQ(results[i].first_logits.size(), c.first_logits.size());
      EXPECT_LT(RelativeError(results[i].first_logits, c.first_logits), 1e-4);
    }
  }

  TempDir tmp_;
  std::string model_dir_;
  Golden golden_;
};

TEST_P(GoldenTest, WholePromptPrefillThenDecode) { CheckAgainstReference(0, false); }
TEST_P(GoldenTest, TokenByTokenPrefill) { CheckAgainstReference(1, false); }
TEST_P(GoldenTest, ChunkedPrefill) { CheckAgainstReference(3, false); }
TEST_P(GoldenTest, BatchedRequests) { CheckAgainstReference(5, true); }

INSTANTIATE_TEST_SUITE_P(Presets, GoldenTest,
                         ::testing::Values("default", "odd", "bf16-sharded", "default-fp8",
                                           "odd-fp8", "bf16-sharded-fp8"),
                         [](const auto& info) {
                           std::string n = info.param;
                           std::replace(n.begin(), n.end(), '-', '_');
                           return n;
                         });

}  // namespace
}  // namespace dxs
