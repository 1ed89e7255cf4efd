// The host sampler: seeded draws pinned token for token (the k-th sample of a request uses
// SplitMix64 output k of its seed), and the greedy limits of top-k and top-p.
#include "model/sampler.h"

#include <cmath>
#include <cstdint>
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

}  // namespace
}  // namespace dxs
