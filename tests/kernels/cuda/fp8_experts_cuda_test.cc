// The grouped SwiGLU FFN of block-scaled FP8 experts on the CUDA backend against the FFN
// computed here in double from the same FP8 weights and scales. Two paths:
// - the GEMM path (GroupedSwiGluFp8: kernels/cuda/moe_fp8.cu and grouped_gemm_fp8_sm90.cuh),
//   with the activations quantized per row and 128 channels exactly as the backend's passes
//   do (the FP8 recipe: x before gate_up, silu * up, rounded to bf16, before down);
// - the decode-sized GEMVs (gemv.cu: up to kGemvMaxPairs sorted pairs, and RoutedSwiGlu's one
//   or two tokens), whose activations stay bf16: the weights dequantized, nothing else.
// Experts packed by PackGateUp (the scales stacked with the rows), rows gathered by index, an
// expert without rows, experts of one and of several M tiles, and the counted form (capacity
// past the count: those rows of y untouched). Skips without a GPU or the FP8 grouped GEMM
// (sm_90).
#include <algorithm>
#include <cmath>
#include <cstring>
#include <map>
#include <random>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/backend.h"
#include "kernels/make_backend.h"
#include "model/random_checkpoint.h"
#include "model/weights.h"
#include "tests/common/scoped_env.h"
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
    {
      // The same device without the GEMVs: decode-sized batches take the GEMM path too.
      testing::ScopedEnv no_gemv("DXS_CUDA_GEMV", "off");
      absl::StatusOr<std::unique_ptr<Backend>> gemm_only = MakeBackend("cuda");
      ASSERT_TRUE(gemm_only.ok()) << gemm_only.status();
      gemm_only_ = std::move(*gemm_only);
    }
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

  // y for sorted entry p: x = xs[rows[p]] through expert e; the activations quantized (the
  // GEMM path) or not (the GEMVs).
  std::vector<double> Reference(int64_t e, int64_t row, bool quantized) const {
    std::vector<float> x(xs_.begin() + row * kHidden, xs_.begin() + (row + 1) * kHidden);
    if (quantized) x = testing::QuantizedGroups(x);
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
    const std::vector<float> hq = quantized ? testing::QuantizedGroups(h) : h;
    std::vector<double> y(kHidden, 0.0);
    for (int64_t j = 0; j < kHidden; ++j) {
      for (int64_t i = 0; i < kInter; ++i) y[j] += hq[i] * down_[e].At(j, i);
    }
    return y;
  }

  std::vector<const Tensor*> GateUp() const {
    std::vector<const Tensor*> out;
    for (const Tensor& t : gate_up_t_) out.push_back(&t);
    return out;
  }
  std::vector<const Tensor*> Down() const {
    std::vector<const Tensor*> out;
    for (const Tensor& t : down_t_) out.push_back(&t);
    return out;
  }

  std::unique_ptr<Backend> gpu_, gemm_only_;
  std::vector<HostWeight> gate_, up_, down_;
  std::vector<Tensor> gate_up_t_, down_t_;
  std::vector<float> xs_;
};

TEST_F(Fp8ExpertsTest, GroupedSwiGluEqualsTheFp8Recipe) {
  const std::vector<const Tensor*> gate_up = GateUp(), down = Down();
  // Sorted entries over experts 0, 2, 3 (expert 1 has none), rows gathered by index: 24 (one
  // M tile an expert; the GEMVs on the default backend, counted too), 37 (past the FP8 GEMVs'
  // pairs: the GEMMs everywhere), 128 (32 rows an expert on average, the most that takes the
  // 64-row ping-pong tiles; expert 0's 70 rows are two of them, the last partial) and 600
  // (the 128-row cooperative tiles, several an expert, the last partial).
  for (const bool gemvs : {true, false}) {
    Backend* b = gemvs ? gpu_.get() : gemm_only_.get();
    Tensor xs = *b->Allocate({kTokens, kHidden}, DType::kBF16);
    ASSERT_TRUE(b->CopyFromHost(xs_.data(), DType::kF32, &xs).ok());
    for (const std::vector<int32_t>& offsets :
         {std::vector<int32_t>{0, 8, 8, 18, 24}, std::vector<int32_t>{0, 10, 10, 30, 37},
          std::vector<int32_t>{0, 70, 70, 100, 128}, std::vector<int32_t>{0, 250, 250, 530, 600}}) {
      const int32_t entries = offsets.back();
      std::vector<int32_t> rows(entries);
      for (int32_t p = 0; p < entries; ++p) rows[p] = (p * 7) % kTokens;
      Tensor off = *b->Allocate({kExperts + 1}, DType::kI32);
      ASSERT_TRUE(b->CopyFromHost(offsets.data(), DType::kI32, &off).ok());
      // y in f32, and in bf16 as the model's steps have it (the down GEMM's bf16 C: the
      // ping-pong tiles up to 32 rows an expert; f32 C has the cooperative ones only).
      for (const auto& [counted, y_dtype] :
           {std::pair{false, DType::kF32}, std::pair{true, DType::kF32},
            std::pair{false, DType::kBF16}, std::pair{true, DType::kBF16}}) {
        const bool bf16_y = y_dtype == DType::kBF16;
        const int64_t capacity = counted ? entries + 8 : entries;
        // kGemvMaxPairsFp8 (kernels/cuda/ops.cuh) is 32.
        const bool gemv_path = gemvs && capacity <= 32;
        SCOPED_TRACE(::testing::Message()
                     << entries << " entries" << (counted ? ", counted" : "")
                     << (gemv_path ? ", GEMVs" : ", GEMMs") << (bf16_y ? ", bf16 y" : ", f32 y"));
        std::vector<int32_t> cap_rows = rows;
        cap_rows.resize(capacity, 0);
        Tensor rows_t = *b->Allocate({capacity}, DType::kI32);
        ASSERT_TRUE(b->CopyFromHost(cap_rows.data(), DType::kI32, &rows_t).ok());
        Tensor y = *b->Allocate({capacity, kHidden}, y_dtype);
        ASSERT_TRUE(b->Fill(&y, 1280.f).ok());  // exact in bf16 too
        const absl::Status s = counted ? b->GroupedSwiGluCounted(xs, rows_t, off, gate_up, down, &y)
                                       : b->GroupedSwiGlu(xs, &rows_t, off, gate_up, down, &y);
        ASSERT_TRUE(s.ok()) << s;
        std::vector<float> got(capacity * kHidden);
        ASSERT_TRUE(b->CopyToHost(y, DType::kF32, got.data()).ok());
        // One reference per distinct source row and expert.
        std::map<std::pair<int64_t, int32_t>, std::vector<double>> refs;
        double diff = 0, ref = 1e-30;
        for (int64_t e = 0; e < kExperts; ++e) {
          for (int32_t p = offsets[e]; p < offsets[e + 1]; ++p) {
            auto it = refs.find({e, rows[p]});
            if (it == refs.end()) {
              it =
                  refs.emplace(std::make_pair(e, rows[p]), Reference(e, rows[p], !gemv_path)).first;
            }
            const std::vector<double>& want = it->second;
            for (int64_t j = 0; j < kHidden; ++j) {
              ASSERT_TRUE(std::isfinite(got[p * kHidden + j])) << "entry " << p;
              diff = std::max(diff, std::fabs(got[p * kHidden + j] - want[j]));
              ref = std::max(ref, std::fabs(want[j]));
            }
          }
        }
        // GEMM path: float32 accumulation, plus the rare e4m3 rounding that a 1-ulp bf16
        // difference in gate or up tips. GEMVs: float32 sums and the rare 1-ulp bf16 flip of
        // gate, up or act (2^-8 of one of 128 terms). Both far below what a wrong scale or
        // layout gives (whole scale ratios), or a quantized activation where none should be
        // (e4m3's 2^-4). A bf16 y adds its own rounding: at most 2^-9 of a value, so 2^-8 of
        // the largest leaves room for it.
        const double bound = (gemv_path ? 2e-3 : 1e-2) + (bf16_y ? 1.0 / 256 : 0.0);
        EXPECT_LT(diff / ref, bound) << "max error " << diff << " of " << ref;
        for (int64_t p = entries; p < capacity; ++p) {
          EXPECT_EQ(got[p * kHidden], 1280.f) << "entry " << p << " past the count was written";
        }
      }
    }
  }
}

// RoutedSwiGlu (one or two tokens straight from their routing) on FP8 experts: the sorted
// GEMV path's bits (SortPairsByExpert, GroupedSwiGlu, ScaleSumRows), the experts' counts, and
// the recipe without quantized activations.
TEST_F(Fp8ExpertsTest, RoutedSwiGluEqualsTheSortedPath) {
  Backend* b = gpu_.get();
  const std::vector<const Tensor*> gate_up = GateUp(), down = Down();
  Tensor xs = *b->Allocate({kTokens, kHidden}, DType::kBF16);
  ASSERT_TRUE(b->CopyFromHost(xs_.data(), DType::kF32, &xs).ok());
  for (const int64_t tokens : {1, 2}) {
    SCOPED_TRACE(::testing::Message() << tokens << " tokens");
    const int64_t top_k = 3, pairs = tokens * top_k;
    ASSERT_TRUE(b->TakesRoutedSwiGlu(tokens, top_k));
    // Unsorted, distinct experts a token.
    constexpr int32_t kRoutes[2][3] = {{3, 1, 2}, {0, 3, 1}};
    std::vector<int32_t> ids(pairs), rows(pairs);
    std::vector<float> scales(pairs);
    std::vector<int64_t> want_counts(kExperts, 0);
    for (int64_t t = 0; t < tokens; ++t) {
      for (int64_t j = 0; j < top_k; ++j) {
        ids[t * top_k + j] = kRoutes[t][j];
        rows[t * top_k + j] = static_cast<int32_t>(t);
        scales[t * top_k + j] = 0.25f + 0.125f * static_cast<float>(j + t);
        ++want_counts[ids[t * top_k + j]];
      }
    }
    Tensor x = xs.Rows(0, tokens);
    Tensor ids_t = *b->UploadIndices(ids);
    Tensor scales_t = *b->Allocate({tokens, top_k}, DType::kF32);
    ASSERT_TRUE(b->CopyFromHost(scales.data(), DType::kF32, &scales_t).ok());
    Tensor counts = *b->Zeros({kExperts}, DType::kI64);
    Tensor fused = *b->Allocate({tokens, kHidden}, DType::kF32);
    ASSERT_TRUE(b->Fill(&fused, 1234.f).ok());
    const absl::Status st = b->RoutedSwiGlu(x, ids_t.Reshape({tokens, top_k}), scales_t, gate_up,
                                            down, &counts, &fused);
    ASSERT_TRUE(st.ok()) << st;
    std::vector<int64_t> got_counts(kExperts, -1);
    ASSERT_TRUE(b->CopyToHost(counts, DType::kI64, got_counts.data()).ok());
    EXPECT_EQ(got_counts, want_counts);
    std::vector<float> got(tokens * kHidden);
    ASSERT_TRUE(b->CopyToHost(fused, DType::kF32, got.data()).ok());

    // The sorted path on the same backend (its GEMVs at this size).
    Tensor order = *b->Allocate({pairs}, DType::kI32);
    Tensor offsets = *b->Allocate({kExperts + 1}, DType::kI32);
    Tensor sorted_rows = *b->Allocate({pairs}, DType::kI32);
    Tensor sorted_scales = *b->Allocate({pairs}, DType::kF32);
    const Tensor rows_t = *b->UploadIndices(rows);
    const Tensor flat_scales = scales_t.Reshape({pairs});
    ASSERT_TRUE(b->SortPairsByExpert(ids_t, kExperts, &order, &offsets,
                                     {{&rows_t, &sorted_rows}, {&flat_scales, &sorted_scales}})
                    .ok());
    absl::StatusOr<Tensor> y = b->Allocate({pairs, kHidden});  // the activation dtype
    ASSERT_TRUE(y.ok());
    ASSERT_TRUE(b->GroupedSwiGlu(x, &sorted_rows, offsets, gate_up, down, &*y).ok());
    Tensor sorted = *b->Allocate({tokens, kHidden}, DType::kF32);
    ASSERT_TRUE(b->ScaleSumRows(*y, sorted_scales, sorted_rows, &sorted).ok());
    std::vector<float> want_bits(tokens * kHidden);
    ASSERT_TRUE(b->CopyToHost(sorted, DType::kF32, want_bits.data()).ok());
    EXPECT_EQ(std::memcmp(got.data(), want_bits.data(), got.size() * sizeof(float)), 0);

    // The recipe: each pair's expert output rounded to the activation dtype (bf16), weighted.
    const bool bf16_y = y->dtype() == DType::kBF16;
    double diff = 0, ref = 1e-30;
    for (int64_t t = 0; t < tokens; ++t) {
      std::vector<double> want(kHidden, 0.0);
      for (int64_t j = 0; j < top_k; ++j) {
        const std::vector<double> ye = Reference(ids[t * top_k + j], t, /*quantized=*/false);
        for (int64_t c = 0; c < kHidden; ++c) {
          want[c] += scales[t * top_k + j] * (bf16_y ? RoundBf16(ye[c]) : ye[c]);
        }
      }
      for (int64_t c = 0; c < kHidden; ++c) {
        diff = std::max(diff, std::fabs(got[t * kHidden + c] - want[c]));
        ref = std::max(ref, std::fabs(want[c]));
      }
    }
    EXPECT_LT(diff / ref, 2e-3) << "max error " << diff << " of " << ref;
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
