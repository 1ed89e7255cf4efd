// The host sampler: seeded draws pinned token for token (the k-th sample of a request uses
// SplitMix64 output k of its seed), and the greedy limits of top-k and top-p.
#include "model/sampler.h"

#include <cmath>
#include <cstdint>
#include <set>
#include <string>
#include <vector>

#include "gtest/gtest.h"

namespace dxs {
namespace {

std::vector<float> Row(int64_t vocab) {
  std::vector<float> row(vocab);
  for (int64_t i = 0; i < vocab; ++i) row[i] = 3.f * std::sin(0.7f * static_cast<float>(i));
  return row;
}

std::vector<int32_t> Draws(const SamplingParams& p, int n) {
  const std::vector<float> row = Row(64);
  Sampler s(p);
  std::vector<int32_t> out;
  for (int i = 0; i < n; ++i) out.push_back(s.Sample(row.data(), 64, i));
  return out;
}

// Draw k computed on its own is output k of the sequential generator.
TEST(SamplerTest, CounterDrawsAreTheSequentialStream) {
  for (uint64_t seed : {uint64_t{0}, uint64_t{1234}, ~uint64_t{0}}) {
    SplitMix64 rng(seed);
    for (uint64_t k = 0; k < 100; ++k) {
      const uint64_t next = rng.Next();
      EXPECT_EQ(SplitMix64At(seed, k), next);
      EXPECT_EQ(SamplingUniform(seed, k), SplitMix64Unit(next));
    }
  }
}

TEST(SamplerTest, SeededDrawsArePinned) {
  EXPECT_EQ(Draws({1.0f, 1.0f, 0, 1}, 16),
            (std::vector<int32_t>{21, 55, 36, 2, 2, 46, 10, 12, 20, 37, 2, 30, 3, 12, 2, 38}));
  EXPECT_EQ(Draws({0.7f, 0.9f, 0, 42}, 16),
            (std::vector<int32_t>{30, 47, 29, 29, 56, 57, 38, 39, 29, 3, 38, 11, 2, 2, 12, 38}));
  EXPECT_EQ(Draws({1.5f, 1.0f, 8, 7}, 16),
            (std::vector<int32_t>{29, 56, 3, 20, 29, 47, 29, 38, 47, 29, 56, 3, 3, 2, 2, 20}));
  EXPECT_EQ(Draws({1.0f, 0.6f, 20, 1234}, 16),
            (std::vector<int32_t>{2, 20, 47, 38, 2, 11, 20, 47, 29, 2, 56, 38, 2, 20, 12, 12}));
}

TEST(SamplerTest, TopKOneAndTinyTopPAreGreedy) {
  const std::vector<float> row = Row(64);
  const int32_t greedy = Argmax(row.data(), 64);
  Sampler top_k({1.3f, 1.0f, 1, 5});
  Sampler top_p({1.3f, 1e-6f, 0, 5});
  for (int i = 0; i < 32; ++i) {
    EXPECT_EQ(top_k.Sample(row.data(), 64, i), greedy);
    EXPECT_EQ(top_p.Sample(row.data(), 64, i), greedy);
  }
}

// Each adjustment on its own, then together in their order: bias, repetition (divide a
// positive logit, multiply a negative one), frequency times the count, presence once.
TEST(SamplerTest, LogitAdjustmentsApplyInVllmsOrder) {
  SamplingParams p;
  p.repetition_penalty = 2.f;
  p.frequency_penalty = 0.5f;
  p.presence_penalty = 0.25f;
  std::vector<float> row = {4.f, -4.f, 1.f, 3.f, 7.f};
  const std::vector<LogitAdjustment> adjust = {
      {0, 0, 0.f, kAdjustSeen},     // seen in the prompt: 4 / 2
      {1, 2, 0.f, kAdjustSeen},     // generated twice: -4 * 2 - 0.5 * 2 - 0.25
      {2, 0, 3.f, 0},               // bias only: 1 + 3
      {3, 1, -5.f, kAdjustSeen},    // bias, then the penalties: (3 - 5) * 2 - 0.5 - 0.25
      {4, 3, 9.f, kAdjustBanned}};  // banned wins over everything
  ApplyLogitAdjustments(p, adjust.data(), adjust.size(), row.data());
  EXPECT_FLOAT_EQ(row[0], 2.f);
  EXPECT_FLOAT_EQ(row[1], -9.25f);
  EXPECT_FLOAT_EQ(row[2], 4.f);
  EXPECT_FLOAT_EQ(row[3], -4.75f);
  EXPECT_EQ(row[4], -INFINITY);
}

// min_p 1 keeps only the most likely token (greedy); a tiny min_p keeps everything (the
// same tokens as without it); in between, every sampled token clears the threshold.
TEST(SamplerTest, MinPKeepsTokensAboveItsShareOfTheTop) {
  const std::vector<float> row = Row(64);
  const int32_t greedy = Argmax(row.data(), 64);
  SamplingParams all{1.1f, 1.f, 0, 9};
  SamplingParams tiny = all, one = all, mid = all;
  tiny.min_p = 1e-30f;
  one.min_p = 1.f;
  mid.min_p = 0.3f;
  Sampler s_all(all), s_tiny(tiny), s_one(one), s_mid(mid);
  const float top = row[greedy] / all.temperature;
  std::set<int32_t> mid_tokens;
  for (int i = 0; i < 200; ++i) {
    EXPECT_EQ(s_tiny.Sample(row.data(), 64, i), s_all.Sample(row.data(), 64, i));
    EXPECT_EQ(s_one.Sample(row.data(), 64, i), greedy);
    const int32_t t = s_mid.Sample(row.data(), 64, i);
    EXPECT_GE(std::exp(static_cast<double>(row[t] / all.temperature - top)), 0.3) << t;
    mid_tokens.insert(t);
  }
  EXPECT_GT(mid_tokens.size(), 1u);  // it still samples
}

// log_softmax of the row: the probabilities sum to 1, the top list is sorted with ties by
// lower id, and the chosen and named ids read the same values.
TEST(SamplerTest, RowLogprobsAreTheLogSoftmax) {
  std::vector<float> row = Row(64);
  row[10] = row[11] = 5.f;  // a tie at the top
  TokenLogprobs lp;
  RowLogprobs(row.data(), 64, 11, 5, {10, 0, 63}, &lp);
  double total = 0;
  for (int i = 0; i < 64; ++i) {
    TokenLogprobs one;
    RowLogprobs(row.data(), 64, i, 0, {}, &one);
    total += std::exp(static_cast<double>(one.logprob));
  }
  EXPECT_NEAR(total, 1.0, 1e-6);
  ASSERT_EQ(lp.top.size(), 5u);
  EXPECT_EQ(lp.top[0].first, 10);
  EXPECT_EQ(lp.top[1].first, 11);
  for (size_t i = 1; i < lp.top.size(); ++i) EXPECT_GE(lp.top[i - 1].second, lp.top[i].second);
  EXPECT_EQ(lp.token, 11);
  EXPECT_FLOAT_EQ(lp.logprob, lp.top[1].second);
  ASSERT_EQ(lp.named.size(), 3u);
  EXPECT_FLOAT_EQ(lp.named[0], lp.top[0].second);
  EXPECT_NEAR(lp.named[2] - lp.named[1], row[63] - row[0], 1e-5);
}

TEST(SamplerTest, OutOfDomainValuesNameTheirField) {
  const float nan = std::nanf(""), inf = INFINITY;
  struct Case {
    const char* field;
    void (*set)(SamplingParams&, float);
    std::vector<float> bad;
  };
  const std::vector<Case> cases = {
      {"min_p", [](SamplingParams& p, float v) { p.min_p = v; }, {-0.1f, 1.5f, nan}},
      {"repetition_penalty",
       [](SamplingParams& p, float v) { p.repetition_penalty = v; },
       {0.f, -1.f, nan, inf}},
      {"frequency_penalty",
       [](SamplingParams& p, float v) { p.frequency_penalty = v; },
       {-2.5f, 2.5f, nan, inf}},
      {"presence_penalty",
       [](SamplingParams& p, float v) { p.presence_penalty = v; },
       {-2.5f, 2.5f, nan, -inf}}};
  for (const Case& c : cases) {
    for (float v : c.bad) {
      SamplingParams p;
      c.set(p, v);
      const absl::Status s = ValidateSamplingParams(p);
      EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << c.field << " " << v;
      EXPECT_NE(s.message().find(c.field), std::string::npos) << s;
    }
  }
  SamplingParams p;
  p.logit_bias = {{3, 1.f}, {5, 2.f}, {3, -1.f}};
  EXPECT_NE(ValidateLogitBias(p, 10).message().find("more than once"), std::string::npos);
  p.logit_bias = {{10, 1.f}};
  EXPECT_EQ(ValidateLogitBias(p, 10).code(), absl::StatusCode::kInvalidArgument);
  p.logit_bias = {{2, 100.5f}};
  EXPECT_EQ(ValidateLogitBias(p, 10).code(), absl::StatusCode::kInvalidArgument);
  p.logit_bias = {{2, nan}};
  EXPECT_EQ(ValidateLogitBias(p, 10).code(), absl::StatusCode::kInvalidArgument);
  p.logit_bias = {{2, -100.f}, {9, 100.f}};
  EXPECT_TRUE(ValidateLogitBias(p, 10).ok());
}

}  // namespace
}  // namespace dxs
