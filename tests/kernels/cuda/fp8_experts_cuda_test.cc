// The grouped SwiGLU FFN of block-scaled FP8 experts on the CUDA backend (GroupedSwiGluFp8:
// kernels/cuda/moe_fp8.cu and grouped_gemm_fp8_sm90.cuh) against the FFN computed here in
// double from the same FP8 weights and scales, with the activations quantized per row and 128
// channels exactly as the backend's passes do (the FP8 recipe: x before gate_up, silu * up,
// rounded to bf16, before down). Experts packed by PackGateUp (the scales stacked with the
// rows), rows gathered by index, an expert without rows, experts of one and of several M
// tiles, and the counted form (capacity past the count: those rows of y untouched). Skips without a
// GPU or the FP8 grouped GEMM (sm_90).
#include <cmath>
#include <map>
#include <random>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/backend.h"
#include "kernels/make_backend.h"
#include "model/random_checkpoint.h"
#include "model/weights.h"
#include "tests/kernels/cuda/fp8_test_util.h"

namespace dxs {
namespace {

using HostWeight = testing::HostFp8Weight;

HostWeight RandomWeight(int64_t n, int64_t k, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> dist(0.f, 1.f / std::sqrt(static_cast<float>(k)));
  std::vector<float> w(n * k);
  for (int64_t i = 0; i < n * k; ++i) w[i] = dist(rng) * (1 + (i / k / 128) % 3);
  return testing::QuantizeHostFp8Weight(w, n, k);
}

float RoundBf16(double v) { return Bf16ToFloat(FloatToBf16(static_cast<float>(v))); }

class Fp8ExpertsTest : public ::testing::Test {
 protected:
  static constexpr int64_t kHidden = 256, kInter = 128, kExperts = 4, kTokens = 20;

  void SetUp() override {
    absl::StatusOr<std::unique_ptr<Backend>> gpu = MakeBackend("cuda");
    if (!gpu.ok()) GTEST_SKIP() << "no GPU here: " << gpu.status().message();
    if (!(*gpu)->capabilities().fp8_expert_weights) {
      GTEST_SKIP() << "no FP8 grouped GEMM here (CUTLASS's SM90 kernels)";
    }
    gpu_ = std::move(*gpu);
    for (int64_t e = 0; e < kExperts; ++e) {
      gate_.push_back(RandomWeight(kInter, kHidden, 100 + e));
      up_.push_back(RandomWeight(kInter, kHidden, 200 + e));
      down_.push_back(RandomWeight(kHidden, kInter, 300 + e));
      auto put = [&](const HostWeight& w) {
        absl::StatusOr<Tensor> t =
            MakeBlockScaledWeight(w.bytes.data(), w.scales.data(), {w.n, w.k}, gpu_.get());
        EXPECT_TRUE(t.ok()) << t.status();
        return *t;
      };
      absl::StatusOr<Tensor> packed = PackGateUp(put(gate_[e]), put(up_[e]), gpu_.get());
      ASSERT_TRUE(packed.ok()) << packed.status();
      ASSERT_NE(packed->block_scales(), nullptr);
      gate_up_t_.push_back(*packed);
      down_t_.push_back(put(down_[e]));
    }
    std::mt19937 rng(5);
    std::normal_distribution<float> dist(0.f, 1.f);
    xs_.resize(kTokens * kHidden);
    for (float& v : xs_) v = RoundBf16(dist(rng));
  }

  // y for sorted entry p: x = xs[rows[p]] through expert e.
  std::vector<double> Reference(int64_t e, int64_t row) const {
    const std::vector<float> x = testing::QuantizedGroups(
        std::vector<float>(xs_.begin() + row * kHidden, xs_.begin() + (row + 1) * kHidden));
    std::vector<float> h(kInter);
    for (int64_t i = 0; i < kInter; ++i) {
      double g = 0, u = 0;
      for (int64_t c = 0; c < kHidden; ++c) {
        g += x[c] * gate_[e].At(i, c);
        u += x[c] * up_[e].At(i, c);
      }
      const float gb = RoundBf16(g), ub = RoundBf16(u);
      h[i] = RoundBf16(gb / (1.0 + std::exp(-static_cast<double>(gb))) * ub);
    }
    const std::vector<float> hq = testing::QuantizedGroups(h);
    std::vector<double> y(kHidden, 0.0);
    for (int64_t j = 0; j < kHidden; ++j) {
      for (int64_t i = 0; i < kInter; ++i) y[j] += hq[i] * down_[e].At(j, i);
    }
    return y;
  }

  std::unique_ptr<Backend> gpu_;
  std::vector<HostWeight> gate_, up_, down_;
  std::vector<Tensor> gate_up_t_, down_t_;
  std::vector<float> xs_;
};

TEST_F(Fp8ExpertsTest, GroupedSwiGluEqualsTheFp8Recipe) {
  std::vector<const Tensor*> gate_up, down;
  for (int64_t e = 0; e < kExperts; ++e) {
    gate_up.push_back(&gate_up_t_[e]);
    down.push_back(&down_t_[e]);
  }
  Tensor xs = *gpu_->Allocate({kTokens, kHidden}, DType::kBF16);
  ASSERT_TRUE(gpu_->CopyFromHost(xs_.data(), DType::kF32, &xs).ok());
  // Sorted entries over experts 0, 2, 3 (expert 1 has none), rows gathered by index: 37 (one
  // M tile an expert), and 600 (several, the last partial).
  for (const std::vector<int32_t>& offsets :
       {std::vector<int32_t>{0, 10, 10, 30, 37}, std::vector<int32_t>{0, 250, 250, 530, 600}}) {
    const int32_t entries = offsets.back();
    std::vector<int32_t> rows(entries);
    for (int32_t p = 0; p < entries; ++p) rows[p] = (p * 7) % kTokens;
    Tensor off = *gpu_->Allocate({kExperts + 1}, DType::kI32);
    ASSERT_TRUE(gpu_->CopyFromHost(offsets.data(), DType::kI32, &off).ok());
    for (const bool counted : {false, true}) {
      SCOPED_TRACE(::testing::Message() << entries << " entries" << (counted ? ", counted" : ""));
      const int64_t capacity = counted ? entries + 8 : entries;
      std::vector<int32_t> cap_rows = rows;
      cap_rows.resize(capacity, 0);
      Tensor rows_t = *gpu_->Allocate({capacity}, DType::kI32);
      ASSERT_TRUE(gpu_->CopyFromHost(cap_rows.data(), DType::kI32, &rows_t).ok());
      Tensor y = *gpu_->Allocate({capacity, kHidden}, DType::kF32);
      ASSERT_TRUE(gpu_->Fill(&y, 1234.f).ok());
      const absl::Status s = counted
                                 ? gpu_->GroupedSwiGluCounted(xs, rows_t, off, gate_up, down, &y)
                                 : gpu_->GroupedSwiGlu(xs, &rows_t, off, gate_up, down, &y);
      ASSERT_TRUE(s.ok()) << s;
      std::vector<float> got(capacity * kHidden);
      ASSERT_TRUE(gpu_->CopyToHost(y, DType::kF32, got.data()).ok());
      // One reference per distinct source row and expert.
      std::map<std::pair<int64_t, int32_t>, std::vector<double>> refs;
      double diff = 0, ref = 1e-30;
      for (int64_t e = 0; e < kExperts; ++e) {
        for (int32_t p = offsets[e]; p < offsets[e + 1]; ++p) {
          auto it = refs.find({e, rows[p]});
          if (it == refs.end())
            it = refs.emplace(std::make_pair(e, rows[p]), Reference(e, rows[p])).first;
          const std::vector<double>& want = it->second;
          for (int64_t j = 0; j < kHidden; ++j) {
            ASSERT_TRUE(std::isfinite(got[p * kHidden + j])) << "entry " << p;
            diff = std::max(diff, std::fabs(got[p * kHidden + j] - want[j]));
            ref = std::max(ref, std::fabs(want[j]));
          }
        }
      }
      // float32 accumulation, plus the rare e4m3 rounding that a 1-ulp bf16 difference in
      // gate or up tips: far below what a wrong scale or layout gives (whole scale ratios).
      EXPECT_LT(diff / ref, 1e-2) << "max error " << diff << " of " << ref;
      for (int64_t p = entries; p < capacity; ++p) {
        EXPECT_EQ(got[p * kHidden], 1234.f) << "entry " << p << " past the count was written";
      }
    }
  }
}

// Experts mixing FP8 and bf16 weights, or FP8 without scales, are refused.
TEST_F(Fp8ExpertsTest, MixedOrUnscaledExpertsAreInvalid) {
  Tensor bf16 = *gpu_->Allocate({2 * kInter, kHidden}, DType::kBF16);
  Tensor bf16_down = *gpu_->Allocate({kHidden, kInter}, DType::kBF16);
  Tensor bare = *gpu_->Allocate({2 * kInter, kHidden}, DType::kF8E4M3);
  std::vector<const Tensor*> gate_up = {&gate_up_t_[0], &bf16}, down = {&down_t_[0], &bf16_down};
  Tensor xs = *gpu_->Allocate({2, kHidden}, DType::kBF16);
  ASSERT_TRUE(gpu_->Fill(&xs, 0.5f).ok());
  const std::vector<int32_t> offsets = {0, 1, 2};
  Tensor off = *gpu_->Allocate({3}, DType::kI32);
  ASSERT_TRUE(gpu_->CopyFromHost(offsets.data(), DType::kI32, &off).ok());
  Tensor y = *gpu_->Allocate({2, kHidden}, DType::kF32);
  EXPECT_EQ(gpu_->GroupedSwiGlu(xs, nullptr, off, gate_up, down, &y).code(),
            absl::StatusCode::kInvalidArgument);
  std::vector<const Tensor*> unscaled = {&gate_up_t_[0], &bare};
  std::vector<const Tensor*> down2 = {&down_t_[0], &down_t_[1]};
  EXPECT_EQ(gpu_->GroupedSwiGlu(xs, nullptr, off, unscaled, down2, &y).code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace dxs
