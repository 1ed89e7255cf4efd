// ExpertShard on rows in the bf16 wire dtype: an expert worker computes straight from the
// rows as they arrived and answers in the wire dtype. The answer must be the float32
// computation on the same (bf16-exact) rows, rounded once.
#include "model/expert_shard.h"

#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "common/dtype.h"
#include "expert_service/expert_compute.h"
#include "gtest/gtest.h"
#include "kernels/backend.h"
#include "kernels/tensor.h"

namespace dxs {
namespace {

constexpr int kHidden = 32, kInter = 16, kExperts = 4, kTopK = 2;

class ExpertShardBf16Test : public ::testing::Test {
 protected:
  void SetUp() override {
    backend_ = MakeCpuBackend();
    config_.hidden_size = kHidden;
    config_.moe_intermediate_size = kInter;
    config_.num_experts = kExperts;
    config_.num_experts_per_tok = kTopK;
    config_.num_hidden_layers = 1;
    ExpertWeightMap weights;
    for (int e = 0; e < kExperts; ++e) {
      ExpertWeights& w = weights[{0, e}];
      const Tensor gate = *backend_->Upload(Random(kInter * kHidden, 0.2f), {kInter, kHidden});
      const Tensor up = *backend_->Upload(Random(kInter * kHidden, 0.2f), {kInter, kHidden});
      w.gate_up_proj = *PackGateUp(gate, up, backend_.get());
      w.down_proj = *backend_->Upload(Random(kHidden * kInter, 0.2f), {kHidden, kInter});
    }
    shard_ = std::make_unique<ExpertShard>(config_, std::move(weights), backend_.get());
    compute_ = std::make_unique<ShardCompute>(shard_.get());
  }

  std::vector<float> Random(size_t n, float scale) {
    std::uniform_real_distribution<float> dist(-scale, scale);
    std::vector<float> v(n);
    for (float& f : v) f = dist(rng_);
    return v;
  }

  RoutedPairs Route(int64_t rows) {
    RoutedPairs pairs;
    for (int64_t r = 0; r < rows; ++r) {
      if (r % 5 == 3) continue;  // a row no expert of this shard was picked for
      const int first = static_cast<int>(rng_() % kExperts);
      pairs.Add(static_cast<int32_t>(r), first, 0.6f);
      pairs.Add(static_cast<int32_t>(r), (first + 1) % kExperts, 0.4f);
    }
    return pairs;
  }

  std::mt19937 rng_{7};
  std::unique_ptr<Backend> backend_;
  ModelConfig config_;
  std::unique_ptr<ExpertShard> shard_;
  std::unique_ptr<ShardCompute> compute_;  // the expert worker's view
};

TEST_F(ExpertShardBf16Test, Bf16RowsGiveTheFloat32AnswerRoundedOnce) {
  for (int64_t rows : {0, 1, 7, 40}) {
    const std::vector<float> values = Random(static_cast<size_t>(rows) * kHidden, 2.f);
    Tensor x16 = AllocateHostTensor(DType::kBF16, {rows, kHidden});
    NarrowFromFloat32(DType::kBF16, values.data(), values.size(), x16.raw());
    std::vector<float> exact(values.size());
    WidenToFloat32(DType::kBF16, x16.raw(), exact.size(), exact.data());
    const RoutedPairTensors pairs = *UploadRoutedPairs(Route(rows), backend_.get());

    Tensor x32 = *backend_->Upload(exact, {rows, kHidden});
    Tensor out32 = *backend_->Allocate({rows, kHidden});
    ASSERT_TRUE(compute_->Forward(0, x32, pairs, &out32).ok());
    Tensor out16 = AllocateHostTensor(DType::kBF16, {rows, kHidden});
    std::memset(out16.raw(), 0xff, static_cast<size_t>(rows) * kHidden * 2);  // NaNs
    absl::Status s = compute_->Forward(0, x16, pairs, &out16);
    ASSERT_TRUE(s.ok()) << s;

    const uint16_t* got = static_cast<const uint16_t*>(out16.raw());
    bool any_nonzero = false;
    for (int64_t i = 0; i < rows * kHidden; ++i) {
      ASSERT_EQ(got[i], FloatToBf16(out32.f32()[i])) << "rows " << rows << " element " << i;
      any_nonzero |= out32.f32()[i] != 0.f;
    }
    EXPECT_EQ(any_nonzero, rows > 0);
    // A row without pairs is zero.
    if (rows > 3) EXPECT_EQ(got[3 * kHidden], 0);
  }
}

// Live rebalancing: experts added to a shard compute as in a shard built with them, and
// KeepOnly frees the rest (a pair for a freed expert is refused, not computed).
TEST_F(ExpertShardBf16Test, AddedExpertsComputeAndKeepOnlyFrees) {
  ExpertWeightMap all;
  for (int e = 0; e < kExperts; ++e) {
    ExpertWeights& w = all[{0, e}];
    const Tensor gate = *backend_->Upload(Random(kInter * kHidden, 0.2f), {kInter, kHidden});
    const Tensor up = *backend_->Upload(Random(kInter * kHidden, 0.2f), {kInter, kHidden});
    w.gate_up_proj = *PackGateUp(gate, up, backend_.get());
    w.down_proj = *backend_->Upload(Random(kHidden * kInter, 0.2f), {kHidden, kInter});
  }
  ExpertWeightMap low, high;
  for (const auto& [key, w] : all) (key.second < 2 ? low : high).emplace(key, w);
  ExpertShard full(config_, all, backend_.get());
  ExpertShard partial(config_, low, backend_.get());
  EXPECT_TRUE(partial.Holds(0, 1));
  EXPECT_FALSE(partial.Holds(0, 2));
  partial.AddExperts(high);
  for (int e = 0; e < kExperts; ++e) EXPECT_TRUE(partial.Holds(0, e)) << e;

  const int64_t rows = 9;
  const Tensor x = *backend_->Upload(Random(rows * kHidden, 2.f), {rows, kHidden});
  const RoutedPairTensors pairs = *UploadRoutedPairs(Route(rows), backend_.get());
  ShardCompute full_compute(&full), partial_compute(&partial);
  Tensor want = *backend_->Allocate({rows, kHidden});
  Tensor got = *backend_->Allocate({rows, kHidden});
  ASSERT_TRUE(full_compute.Forward(0, x, pairs, &want).ok());
  ASSERT_TRUE(partial_compute.Forward(0, x, pairs, &got).ok());
  for (int64_t i = 0; i < rows * kHidden; ++i) ASSERT_EQ(got.f32()[i], want.f32()[i]) << i;

  partial.KeepOnly({2, 3});
  EXPECT_FALSE(partial.Holds(0, 0));
  EXPECT_TRUE(partial.Holds(0, 3));
  EXPECT_FALSE(partial_compute.Forward(0, x, pairs, &got).ok());
}

}  // namespace
}  // namespace dxs
