// The engine's OpenAI-style sampling features against Hugging Face transformers.
// tests/golden/sampling-<preset>.json is written by tools/hf_sampling_reference.py from the
// same seeded checkpoint, with transformers' logits processors and warpers (repetition
// penalty, min_new_tokens, temperature, top-k, top-p, min-p), OpenAI's frequency and presence
// penalties and logit_bias written out in torch, and the SplitMix64 draw written out in
// Python: nothing of dxs's sampler. Here we regenerate the checkpoint, check it is
// byte-identical (fingerprint), run every case through LocalEngine::GenerateBatch and
// require identical tokens and finish reasons; log-probabilities (of the raw logits) of
// each output token, of its top 5 alternatives and of the named ids within 1e-4; the same
// top 5 ids in the same order, except where the reference itself has two log-probabilities
// within 1e-5 (a tie that float rounding may break either way); and prompt log-probabilities
// (first position, every scored position, the distribution after the prompt) likewise.
// Each case alone and all cases in one batch, each with the whole prompt in one step and in
// 5-token chunks (prompt scoring across chunk boundaries), and each case alone token by
// token (every scored position a one-row prefill chunk).
#include <algorithm>
#include <cmath>
#include <fstream>
#include <set>

#include "gtest/gtest.h"
#include "model/engine.h"
#include "nlohmann/json.hpp"
#include "tests/model/test_util.h"

namespace dxs {
namespace {

using nlohmann::json;
using testing::TempDir;

constexpr double kLogprobTolerance = 1e-4;
constexpr double kTie = 1e-5;  // reference log-probabilities this close may swap places

struct GoldenCase {
  std::string name;
  GenerationRequest request;
  json expected;
};

struct Golden {
  std::string fingerprint;
  std::vector<GoldenCase> cases;
};

GenerationRequest RequestOf(const json& c) {
  GenerationRequest r;
  r.prompt = c.at("prompt_ids").get<std::vector<int32_t>>();
  r.max_new_tokens = c.at("max_new_tokens").get<int64_t>();
  r.min_new_tokens = c.at("min_new_tokens").get<int64_t>();
  r.stop_token_ids = c.at("stop_token_ids").get<std::vector<int32_t>>();
  r.ignore_eos = c.at("ignore_eos").get<bool>();
  r.logprobs = c.at("logprobs").get<bool>();
  r.top_logprobs = c.at("top_logprobs").get<int32_t>();
  r.logprob_token_ids = c.at("logprob_token_ids").get<std::vector<int32_t>>();
  r.prompt_logprobs_start = c.at("prompt_logprobs_start").get<int64_t>();
  const json& s = c.at("sampling");
  SamplingParams& p = r.sampling;
  p.temperature = s.at("temperature").get<float>();
  p.top_p = s.at("top_p").get<float>();
  p.top_k = s.at("top_k").get<int32_t>();
  p.seed = s.at("seed").get<uint64_t>();
  p.min_p = s.at("min_p").get<float>();
  p.repetition_penalty = s.at("repetition_penalty").get<float>();
  p.frequency_penalty = s.at("frequency_penalty").get<float>();
  p.presence_penalty = s.at("presence_penalty").get<float>();
  for (const json& b : s.at("logit_bias")) {
    p.logit_bias.push_back({b.at(0).get<int32_t>(), b.at(1).get<float>()});
  }
  return r;
}

Golden ReadGolden(const std::string& preset) {
  const std::string path = testing::SourceDir() + "/tests/golden/sampling-" + preset + ".json";
  std::ifstream f(path);
  EXPECT_TRUE(f.good()) << "missing " << path;
  json j = json::parse(f);
  Golden g;
  g.fingerprint = j.at("fingerprint").get<std::string>();
  for (const json& c : j.at("cases")) {
    g.cases.push_back({c.at("name").get<std::string>(), RequestOf(c), c.at("expected")});
  }
  return g;
}

FinishReason ReasonOf(const std::string& s) {
  if (s == "eos") return FinishReason::kEos;
  if (s == "stop") return FinishReason::kStopToken;
  return FinishReason::kLength;
}

// The top alternatives against the reference's: log-probabilities place by place (they are
// sorted, so ties don't matter), and ids place by place unless the reference's log-probability
// there is within kTie of another of its top 5 (then that one's id may stand here) or of its
// 6th (then an id outside its top 5 may).
void ExpectTopMatches(const std::vector<std::pair<int32_t, float>>& top, const json& want_top,
                      double want_sixth) {
  ASSERT_EQ(top.size(), want_top.size());
  std::vector<int32_t> want_ids;
  std::vector<double> want_lps;
  for (const json& t : want_top) {
    want_ids.push_back(t.at(0).get<int32_t>());
    want_lps.push_back(t.at(1).get<double>());
  }
  std::set<int32_t> seen;
  for (size_t k = 0; k < top.size(); ++k) {
    SCOPED_TRACE(::testing::Message() << "alternative " << k);
    EXPECT_TRUE(seen.insert(top[k].first).second) << "id " << top[k].first << " twice";
    EXPECT_NEAR(top[k].second, want_lps[k], kLogprobTolerance);
    if (top[k].first == want_ids[k]) continue;
    bool allowed = false;
    for (size_t m = 0; m < want_ids.size(); ++m) {
      allowed |= want_ids[m] == top[k].first && std::fabs(want_lps[m] - want_lps[k]) <= kTie;
    }
    const bool outside =
        std::find(want_ids.begin(), want_ids.end(), top[k].first) == want_ids.end();
    allowed |= outside && std::fabs(want_sixth - want_lps[k]) <= kTie;
    EXPECT_TRUE(allowed) << "id " << top[k].first << " where the reference has " << want_ids[k]
                         << " (log-probability " << want_lps[k] << ", no tie)";
  }
}

void ExpectLogprobsMatch(const TokenLogprobs& got, const json& want) {
  EXPECT_EQ(got.token, want.at("token").get<int32_t>());
  if (got.token >= 0) {
    EXPECT_NEAR(got.logprob, want.at("logprob").get<double>(), kLogprobTolerance);
  }
  ExpectTopMatches(got.top, want.at("top"), want.at("sixth").get<double>());
  const std::vector<double> named = want.at("named").get<std::vector<double>>();
  ASSERT_EQ(got.named.size(), named.size());
  for (size_t i = 0; i < named.size(); ++i) {
    EXPECT_NEAR(got.named[i], named[i], kLogprobTolerance) << "named id " << i;
  }
}

void ExpectMatches(const GenerationResult& got, const json& want) {
  EXPECT_EQ(got.tokens, want.at("tokens").get<std::vector<int32_t>>());
  EXPECT_EQ(got.finish_reason, ReasonOf(want.at("finish_reason").get<std::string>()))
      << FinishReasonName(got.finish_reason);
  const json& lps = want.at("logprobs");
  ASSERT_EQ(got.logprobs.size(), lps.size());
  for (size_t i = 0; i < lps.size(); ++i) {
    SCOPED_TRACE(::testing::Message() << "output position " << i);
    ExpectLogprobsMatch(got.logprobs[i], lps[i]);
  }
  const json& prompt = want.at("prompt_logprobs");
  ASSERT_EQ(got.prompt_logprobs.has_value(), !prompt.is_null());
  if (prompt.is_null()) return;
  EXPECT_EQ(got.prompt_logprobs->first_position, prompt.at("first_position").get<int64_t>());
  const json& positions = prompt.at("positions");
  ASSERT_EQ(got.prompt_logprobs->positions.size(), positions.size());
  for (size_t i = 0; i < positions.size(); ++i) {
    SCOPED_TRACE(::testing::Message()
                 << "prompt position " << got.prompt_logprobs->first_position + i);
    ExpectLogprobsMatch(got.prompt_logprobs->positions[i], positions[i]);
  }
  SCOPED_TRACE("after the prompt");
  ExpectLogprobsMatch(got.prompt_logprobs->next, prompt.at("next"));
}

class SamplingGoldenTest : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    golden_ = ReadGolden(GetParam());
    ASSERT_FALSE(golden_.cases.empty());
    model_dir_ = testing::WritePreset(tmp_, GetParam());
    auto fp = CheckpointFingerprint(model_dir_);
    ASSERT_TRUE(fp.ok()) << fp.status();
    ASSERT_EQ(*fp, golden_.fingerprint)
        << "the checkpoint generator changed; rerun tools/hf_sampling_reference.py";
  }

  void CheckAgainstReference(int64_t prefill_chunk, bool batched) {
    EngineOptions options;
    options.prefill_chunk_tokens = prefill_chunk;
    auto engine = LocalEngine::Load(model_dir_, options);
    ASSERT_TRUE(engine.ok()) << engine.status();
    std::vector<GenerationRequest> requests;
    for (const GoldenCase& c : golden_.cases) requests.push_back(c.request);
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
    ASSERT_EQ(results.size(), golden_.cases.size());
    for (size_t i = 0; i < golden_.cases.size(); ++i) {
      SCOPED_TRACE(::testing::Message() << "case " << golden_.cases[i].name);
      ExpectMatches(results[i], golden_.cases[i].expected);
    }
  }

  TempDir tmp_;
  std::string model_dir_;
  Golden golden_;
};

TEST_P(SamplingGoldenTest, EachAlone) { CheckAgainstReference(0, false); }
TEST_P(SamplingGoldenTest, Batched) { CheckAgainstReference(0, true); }
TEST_P(SamplingGoldenTest, ChunkedPrefill) { CheckAgainstReference(5, false); }
TEST_P(SamplingGoldenTest, TokenByTokenPrefill) { CheckAgainstReference(1, false); }
TEST_P(SamplingGoldenTest, ChunkedPrefillBatched) { CheckAgainstReference(5, true); }

// Named after the binary, so that `ctest -R sampling_golden` selects these.
INSTANTIATE_TEST_SUITE_P(sampling_golden, SamplingGoldenTest, ::testing::Values("default", "odd"),
                         [](const auto& info) { return info.param; });

}  // namespace
}  // namespace dxs
