// Linear of a block-scaled FP8 weight on the CUDA backend (kernels/cuda/fp8_linear.{cc,cu})
// against the product computed here in double from the same FP8 values and scales:
// - decode-sized x (the GEMV, activations bf16): y = x . (fp8 * block scale), so the only
//   error is float32 accumulation order and y's rounding;
// - larger x, and every x with DXS_CUDA_GEMV=off (CUTLASS's blockwise FP8 GEMM and cuBLASLt's
//   block-scaled FP8 matmul, DXS_CUDA_FP8_GEMM): the
//   activations quantized per token and 128 channels exactly as the backend's quantizer
//   does (the arithmetic of the FP8 dispatch records, re-done here), so again only the
//   accumulation and y's rounding differ. A wrong scale layout (a transposed or misstrided
//   scale, a scale of the wrong block) moves results by whole scale ratios, far past the
//   bounds.
// Skips without a GPU or where the backend keeps no FP8 weights (before sm_90).
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
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

using Fp8Weight = testing::HostFp8Weight;

// A random weight quantized as the official checkpoints are; rows of different magnitude, so
// that the blocks' scales differ.
Fp8Weight MakeWeight(int64_t n, int64_t k, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> dist(0.f, 1.f);
  std::vector<float> w(n * k);
  for (int64_t r = 0; r < n; ++r) {
    const float row_scale = std::ldexp(1.f, static_cast<int>(r % 7) - 3);
    for (int64_t c = 0; c < k; ++c) w[r * k + c] = row_scale * (1 + (c / 128) % 3) * dist(rng);
  }
  return testing::QuantizeHostFp8Weight(w, n, k);
}

std::vector<float> RandomBf16(int64_t count, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> dist(0.f, 1.f);
  std::vector<float> v(count);
  for (float& x : v) x = Bf16ToFloat(FloatToBf16(dist(rng)));
  return v;
}

std::vector<double> Reference(const std::vector<float>& x, int64_t m, const Fp8Weight& w) {
  std::vector<double> y(m * w.n, 0.0);
  for (int64_t r = 0; r < m; ++r) {
    for (int64_t f = 0; f < w.n; ++f) {
      double acc = 0;
      for (int64_t c = 0; c < w.k; ++c) acc += static_cast<double>(x[r * w.k + c]) * w.At(f, c);
      y[r * w.n + f] = acc;
    }
  }
  return y;
}

// max |got - want| / max |want|.
double RelError(const std::vector<float>& got, const std::vector<double>& want) {
  double diff = 0, ref = 1e-30;
  for (size_t i = 0; i < want.size(); ++i) {
    if (!std::isfinite(got[i])) return INFINITY;
    diff = std::max(diff, std::fabs(got[i] - want[i]));
    ref = std::max(ref, std::fabs(want[i]));
  }
  return diff / ref;
}

class Fp8LinearTest : public ::testing::Test {
 protected:
  void SetUp() override {
    absl::StatusOr<std::unique_ptr<Backend>> gpu = MakeBackend("cuda");
    if (!gpu.ok()) GTEST_SKIP() << "no GPU here: " << gpu.status().message();
    if (!(*gpu)->capabilities().fp8_block_weights) {
      GTEST_SKIP() << "this GPU keeps no FP8 weights (cuBLASLt's block-scaled FP8 is sm_90+)";
    }
    gpu_ = std::move(*gpu);
  }

  // y = x w^T on `b` with y in `y_dtype`, back on the host.
  std::vector<float> Run(Backend* b, const Fp8Weight& w, const std::vector<float>& x, int64_t m,
                         DType y_dtype) {
    absl::StatusOr<Tensor> wt =
        MakeBlockScaledWeight(w.bytes.data(), w.scales.data(), {w.n, w.k}, b);
    EXPECT_TRUE(wt.ok()) << wt.status();
    if (!wt.ok()) return {};
    EXPECT_EQ(wt->dtype(), DType::kF8E4M3);
    EXPECT_NE(wt->block_scales(), nullptr);
    absl::StatusOr<Tensor> xt = b->Allocate({m, w.k}, DType::kBF16);
    EXPECT_TRUE(xt.ok() && b->CopyFromHost(x.data(), DType::kF32, &*xt).ok());
    absl::StatusOr<Tensor> yt = b->Allocate({m, w.n}, y_dtype);
    EXPECT_TRUE(yt.ok() && b->Fill(&*yt, NAN).ok());
    const absl::Status s = b->Linear(*xt, *wt, nullptr, &*yt);
    EXPECT_TRUE(s.ok()) << s;
    std::vector<float> y(m * w.n);
    EXPECT_TRUE(b->CopyToHost(*yt, DType::kF32, y.data()).ok());
    return y;
  }

  // Three FP8 weights sharing k (a layer's q, k and v in small), on `b`.
  void MakeQkv(uint32_t seed, Backend* b, std::vector<Fp8Weight>* hw, std::vector<Tensor>* wt) {
    const int64_t k = 512;
    *hw = {MakeWeight(384, k, seed), MakeWeight(128, k, seed + 1), MakeWeight(256, k, seed + 2)};
    for (const Fp8Weight& w : *hw) {
      absl::StatusOr<Tensor> t =
          MakeBlockScaledWeight(w.bytes.data(), w.scales.data(), {w.n, w.k}, b);
      ASSERT_TRUE(t.ok()) << t.status();
      wt->push_back(*t);
    }
  }

  // LinearsEqualEachLinear on one backend.
  void LinearsEqualEachLinearOn(Backend* be);

  // A CUDA backend made with `env` set (the backend reads its switches when it is made).
  static absl::StatusOr<std::unique_ptr<Backend>> BackendWith(
      std::initializer_list<std::pair<const char*, const char*>> env) {
    std::vector<std::unique_ptr<testing::ScopedEnv>> set;
    for (const auto& [name, value] : env) {
      set.push_back(std::make_unique<testing::ScopedEnv>(name, value));
    }
    return MakeBackend("cuda");
  }

  std::unique_ptr<Backend> gpu_;
};

// (n, k) with k / 128 = 4, 6 (scales padded to a stride of 8) and 16; m through the GEMV's
// row counts, past them, and odd counts that pad to a multiple of 4 for cuBLASLt.
TEST_F(Fp8LinearTest, EqualsTheProductOfTheFp8ValuesAndScales) {
  // The GEMM paths for every m: backends made with the GEMVs off, one per FP8 GEMM
  // (CUTLASS's blockwise grouped kernel where built, and cuBLASLt's).
  std::vector<std::unique_ptr<Backend>> gemm_only;
  for (const char* gemm : {"cutlass", "cublaslt"}) {
    absl::StatusOr<std::unique_ptr<Backend>> b =
        BackendWith({{"DXS_CUDA_GEMV", "off"}, {"DXS_CUDA_FP8_GEMM", gemm}});
    if (!b.ok() && std::string(gemm) == "cutlass") continue;  // no CUTLASS in this build
    ASSERT_TRUE(b.ok()) << gemm << ": " << b.status();
    gemm_only.push_back(std::move(*b));
  }
  struct Shape {
    int64_t n, k;
  };
  uint32_t seed = 1;
  for (const Shape& s : {Shape{256, 512}, Shape{384, 768}, Shape{512, 2048}}) {
    const Fp8Weight w = MakeWeight(s.n, s.k, seed++);
    for (int64_t m : {1, 2, 3, 8, 9, 13, 64, 130}) {
      SCOPED_TRACE(::testing::Message() << "n " << s.n << " k " << s.k << " m " << m);
      const std::vector<float> x = RandomBf16(m * s.k, seed++);
      const std::vector<double> exact = Reference(x, m, w);
      const std::vector<double> quantized = Reference(testing::QuantizedGroups(x), m, w);
      // The GEMV (m <= 8) keeps x as it is; cuBLASLt takes x quantized.
      const std::vector<double>& want = m <= 8 ? exact : quantized;
      // f32 out: the accumulation's error only (the GEMV's float32 lanes; cuBLASLt's FP8
      // tensor-core sums, promoted to float32 per 128-channel block, are coarser). bf16 out:
      // plus one rounding (2^-9 relative).
      const double f32_bound = m <= 8 ? 1e-4 : 2e-3;
      EXPECT_LT(RelError(Run(gpu_.get(), w, x, m, DType::kF32), want), f32_bound);
      EXPECT_LT(RelError(Run(gpu_.get(), w, x, m, DType::kBF16), want), f32_bound + 4e-3);
      for (const auto& b : gemm_only) {
        EXPECT_LT(RelError(Run(b.get(), w, x, m, DType::kF32), quantized), 2e-3);
        // And the quantization of x itself is small beside the product (the FP8 recipe's
        // error): what separates the two paths.
        EXPECT_LT(RelError(Run(b.get(), w, x, m, DType::kBF16), exact), 0.08);
      }
    }
  }
}

// A view of whole 128-row blocks (PackGateUp's halves, a weight's rows) keeps its scales:
// its product is those rows of the whole weight's.
TEST_F(Fp8LinearTest, RowsOfWholeBlocksKeepTheirScales) {
  const Fp8Weight w = MakeWeight(384, 256, 7);
  absl::StatusOr<Tensor> wt =
      MakeBlockScaledWeight(w.bytes.data(), w.scales.data(), {w.n, w.k}, gpu_.get());
  ASSERT_TRUE(wt.ok()) << wt.status();
  const Tensor middle = wt->Rows(128, 128);
  ASSERT_NE(middle.block_scales(), nullptr);
  EXPECT_EQ(middle.block_scales()->rows(), 1);
  const int64_t m = 3;
  const std::vector<float> x = RandomBf16(m * w.k, 8);
  Tensor xt = *gpu_->Allocate({m, w.k}, DType::kBF16);
  ASSERT_TRUE(gpu_->CopyFromHost(x.data(), DType::kF32, &xt).ok());
  Tensor whole = *gpu_->Allocate({m, w.n}, DType::kF32),
         part = *gpu_->Allocate({m, 128}, DType::kF32);
  ASSERT_TRUE(gpu_->Linear(xt, *wt, nullptr, &whole).ok());
  ASSERT_TRUE(gpu_->Linear(xt, middle, nullptr, &part).ok());
  std::vector<float> a(m * w.n), b(m * 128);
  ASSERT_TRUE(gpu_->CopyToHost(whole, DType::kF32, a.data()).ok());
  ASSERT_TRUE(gpu_->CopyToHost(part, DType::kF32, b.data()).ok());
  for (int64_t r = 0; r < m; ++r) {
    for (int64_t c = 0; c < 128; ++c) EXPECT_EQ(b[r * 128 + c], a[r * w.n + 128 + c]);
  }
}

// Linears of FP8 weights sharing x (q, k and v of a decode step): one GEMV launch up to
// kGemvMaxRows rows, each output bit for bit what Linear gives it alone (the same warp per
// feature, lane order and tree); past them, one quantization of x for the three and a
// cuBLASLt matmul each, again the bits of each Linear alone (the same quantized x and plan).
TEST_F(Fp8LinearTest, LinearsEqualEachLinear) {
  // On the default backend (k and v on side streams past the GEMV) and on one without them.
  absl::StatusOr<std::unique_ptr<Backend>> one_stream =
      BackendWith({{"DXS_CUDA_FP8_SIDE_STREAMS", "off"}});
  ASSERT_TRUE(one_stream.ok()) << one_stream.status();
  for (Backend* b : {gpu_.get(), one_stream->get()}) {
    SCOPED_TRACE(b == gpu_.get() ? "side streams" : "DXS_CUDA_FP8_SIDE_STREAMS=off");
    LinearsEqualEachLinearOn(b);
  }
}

void Fp8LinearTest::LinearsEqualEachLinearOn(Backend* be) {
  std::vector<Fp8Weight> hw;
  std::vector<Tensor> wt;
  ASSERT_NO_FATAL_FAILURE(MakeQkv(21, be, &hw, &wt));
  const int64_t k = hw[0].k;
  for (int64_t m : {1, 5, 8, 9, 64}) {
    for (DType y_dtype : {DType::kF32, DType::kBF16}) {
      SCOPED_TRACE(::testing::Message() << "m " << m << " y " << DTypeName(y_dtype));
      const std::vector<float> x = RandomBf16(m * k, 30 + m);
      Tensor xt = *be->Allocate({m, k}, DType::kBF16);
      ASSERT_TRUE(be->CopyFromHost(x.data(), DType::kF32, &xt).ok());
      std::vector<Tensor> together, alone;
      for (const Fp8Weight& w : hw) {
        together.push_back(*be->Allocate({m, w.n}, y_dtype));
        alone.push_back(*be->Allocate({m, w.n}, y_dtype));
        ASSERT_TRUE(be->Fill(&together.back(), NAN).ok());
      }
      const absl::Status s =
          be->Linears(xt, {&wt[0], &wt[1], &wt[2]}, {&together[0], &together[1], &together[2]});
      ASSERT_TRUE(s.ok()) << s;
      for (size_t i = 0; i < hw.size(); ++i) {
        ASSERT_TRUE(be->Linear(xt, wt[i], nullptr, &alone[i]).ok());
        std::vector<float> a(m * hw[i].n), b(m * hw[i].n);
        ASSERT_TRUE(be->CopyToHost(together[i], DType::kF32, a.data()).ok());
        ASSERT_TRUE(be->CopyToHost(alone[i], DType::kF32, b.data()).ok());
        EXPECT_EQ(std::memcmp(a.data(), b.data(), a.size() * sizeof(float)), 0) << "output " << i;
        if (m <= 8) {
          EXPECT_LT(RelError(a, Reference(x, m, hw[i])), y_dtype == DType::kF32 ? 1e-4 : 4.1e-3)
              << "output " << i;
        }
      }
    }
  }
}

// The GEMV computes 1, 2 or 4 features a warp (DXS_CUDA_GEMV_FP8_FEATURES; auto chooses by
// the row count): each feature's sum runs in the same order whichever, so Linear and Linears
// give the same bits at every count and row count, within the f32 bound of the exact product.
TEST_F(Fp8LinearTest, GemvFeatureCountsGiveTheSameBits) {
  std::vector<std::unique_ptr<Backend>> backends;
  for (const char* features : {"1", "2", "4"}) {
    absl::StatusOr<std::unique_ptr<Backend>> b =
        BackendWith({{"DXS_CUDA_GEMV_FP8_FEATURES", features}});
    ASSERT_TRUE(b.ok()) << features << ": " << b.status();
    backends.push_back(std::move(*b));
  }
  backends.push_back(std::move(gpu_));  // auto
  std::vector<std::vector<Fp8Weight>> hw(backends.size());
  std::vector<std::vector<Tensor>> wt(backends.size());
  for (size_t i = 0; i < backends.size(); ++i) {
    ASSERT_NO_FATAL_FAILURE(MakeQkv(71, backends[i].get(), &hw[i], &wt[i]));
  }
  const int64_t k = hw[0][0].k;
  for (int64_t m = 1; m <= 8; ++m) {
    const std::vector<float> x = RandomBf16(m * k, 80 + m);
    // outputs[i][o]: backend i's output o, from Linears (three in one launch) then Linear.
    std::vector<std::vector<std::vector<float>>> outputs(backends.size());
    for (size_t i = 0; i < backends.size(); ++i) {
      Backend* be = backends[i].get();
      Tensor xt = *be->Allocate({m, k}, DType::kBF16);
      ASSERT_TRUE(be->CopyFromHost(x.data(), DType::kF32, &xt).ok());
      std::vector<Tensor> ys;
      for (const Fp8Weight& w : hw[i]) {
        ys.push_back(*be->Allocate({m, w.n}, DType::kF32));
        ASSERT_TRUE(be->Fill(&ys.back(), NAN).ok());
      }
      ASSERT_TRUE(
          be->Linears(xt, {&wt[i][0], &wt[i][1], &wt[i][2]}, {&ys[0], &ys[1], &ys[2]}).ok());
      for (size_t o = 0; o < ys.size(); ++o) {
        outputs[i].emplace_back(m * hw[i][o].n);
        ASSERT_TRUE(be->CopyToHost(ys[o], DType::kF32, outputs[i].back().data()).ok());
      }
      Tensor alone = *be->Allocate({m, hw[i][1].n}, DType::kF32);
      ASSERT_TRUE(be->Linear(xt, wt[i][1], nullptr, &alone).ok());
      outputs[i].emplace_back(m * hw[i][1].n);
      ASSERT_TRUE(be->CopyToHost(alone, DType::kF32, outputs[i].back().data()).ok());
    }
    for (size_t o = 0; o < outputs[0].size(); ++o) {
      SCOPED_TRACE(::testing::Message() << "m " << m << " output " << o);
      const Fp8Weight& w = hw[0][o < 3 ? o : 1];
      EXPECT_LT(RelError(outputs[0][o], Reference(x, m, w)), 1e-4);
      for (size_t i = 1; i < backends.size(); ++i) {
        EXPECT_EQ(std::memcmp(outputs[i][o].data(), outputs[0][o].data(),
                              outputs[0][o].size() * sizeof(float)),
                  0)
            << "backend " << i << " (1, 2, 4, auto) against one feature a warp";
      }
    }
  }
}

// Past the GEMV, Linears runs k and v on side streams beside q (CudaBackend::fp8_side_): in
// a recorded graph those are parallel branches joined back before anything after. Replayed
// on new x in place, each output equals its Linear alone bit for bit; 37 rows pad to 40,
// so the side streams' results also go through a scratch copy.
TEST_F(Fp8LinearTest, LinearsInAGraphEqualEachLinear) {
  if (!gpu_->SupportsGraphs()) GTEST_SKIP() << "no graphs on this backend";
  std::vector<Fp8Weight> hw;
  std::vector<Tensor> wt;
  ASSERT_NO_FATAL_FAILURE(MakeQkv(41, gpu_.get(), &hw, &wt));
  const int64_t k = hw[0].k;
  for (int64_t m : {37, 64}) {
    SCOPED_TRACE(::testing::Message() << "m " << m);
    Tensor xt = *gpu_->Allocate({m, k}, DType::kBF16);
    const std::vector<float> x0 = RandomBf16(m * k, 50 + m);
    ASSERT_TRUE(gpu_->CopyFromHost(x0.data(), DType::kF32, &xt).ok());
    std::vector<Tensor> ys;
    for (const Fp8Weight& w : hw) ys.push_back(*gpu_->Allocate({m, w.n}, DType::kBF16));
    Tensor eager;
    absl::StatusOr<CapturedGraph> graph = gpu_->CaptureGraph(
        [&]() -> absl::StatusOr<Tensor> {
          absl::Status s = gpu_->Linears(xt, {&wt[0], &wt[1], &wt[2]}, {&ys[0], &ys[1], &ys[2]});
          if (!s.ok()) return s;
          return ys[0];
        },
        &eager);
    ASSERT_TRUE(graph.ok()) << graph.status();
    for (int replay = 0; replay < 2; ++replay) {
      SCOPED_TRACE(::testing::Message() << "replay " << replay);
      const std::vector<float> x = RandomBf16(m * k, 60 + 10 * replay + m);
      ASSERT_TRUE(gpu_->CopyFromHost(x.data(), DType::kF32, &xt).ok());
      for (Tensor& y : ys) ASSERT_TRUE(gpu_->Fill(&y, NAN).ok());
      ASSERT_TRUE(gpu_->Replay(graph->graph.get()).ok());
      for (size_t i = 0; i < hw.size(); ++i) {
        Tensor alone = *gpu_->Allocate({m, hw[i].n}, DType::kBF16);
        ASSERT_TRUE(gpu_->Linear(xt, wt[i], nullptr, &alone).ok());
        std::vector<float> a(m * hw[i].n), b(m * hw[i].n);
        ASSERT_TRUE(gpu_->CopyToHost(ys[i], DType::kF32, a.data()).ok());
        ASSERT_TRUE(gpu_->CopyToHost(alone, DType::kF32, b.data()).ok());
        EXPECT_EQ(std::memcmp(a.data(), b.data(), a.size() * sizeof(float)), 0) << "output " << i;
        // And the product of x quantized as the recipe does, to y's bf16 rounding (as above).
        EXPECT_LT(RelError(a, Reference(testing::QuantizedGroups(x), m, hw[i])), 2e-3 + 4e-3)
            << "output " << i;
      }
    }
  }
}

TEST_F(Fp8LinearTest, MalformedCallsAreClearErrors) {
  const Fp8Weight w = MakeWeight(128, 256, 9);
  Tensor wt = *MakeBlockScaledWeight(w.bytes.data(), w.scales.data(), {w.n, w.k}, gpu_.get());
  Tensor x = *gpu_->Allocate({2, 256}, DType::kBF16);
  ASSERT_TRUE(gpu_->Fill(&x, 0.5f).ok());
  Tensor y = *gpu_->Allocate({2, 128}, DType::kBF16);
  // An FP8 weight without its scales.
  Tensor bare = *gpu_->Allocate({128, 256}, DType::kF8E4M3);
  EXPECT_EQ(gpu_->Linear(x, bare, nullptr, &y).code(), absl::StatusCode::kInvalidArgument);
  // Scales of another shape.
  Tensor wrong = bare.WithBlockScales(*gpu_->Allocate({1, 2}, DType::kF32));
  EXPECT_EQ(gpu_->Linear(x, wrong, nullptr, &y).code(), absl::StatusCode::kInvalidArgument);
  // x's width against the weight's.
  Tensor narrow = *gpu_->Allocate({2, 128}, DType::kBF16);
  EXPECT_EQ(gpu_->Linear(narrow, wt, nullptr, &y).code(), absl::StatusCode::kInvalidArgument);
  // A bias.
  Tensor bias = *gpu_->Allocate({128}, DType::kBF16);
  EXPECT_EQ(gpu_->Linear(x, wt, &bias, &y).code(), absl::StatusCode::kUnimplemented);
  // Not a whole number of blocks.
  std::vector<uint8_t> bytes(100 * 256, 0x38);
  std::vector<float> scales(2, 1.f);
  EXPECT_EQ(
      MakeBlockScaledWeight(bytes.data(), scales.data(), {100, 256}, gpu_.get()).status().code(),
      absl::StatusCode::kFailedPrecondition);
  // Zero rows: nothing to do.
  Tensor none = *gpu_->Allocate({0, 256}, DType::kBF16),
         none_y = *gpu_->Allocate({0, 128}, DType::kBF16);
  EXPECT_TRUE(gpu_->Linear(none, wt, nullptr, &none_y).ok());
  // And the CPU keeps no FP8 weights: MakeBlockScaledWeight refuses there.
  std::unique_ptr<Backend> cpu = MakeCpuBackend();
  EXPECT_FALSE(cpu->capabilities().fp8_block_weights);
  EXPECT_EQ(
      MakeBlockScaledWeight(w.bytes.data(), w.scales.data(), {w.n, w.k}, cpu.get()).status().code(),
      absl::StatusCode::kFailedPrecondition);
}

}  // namespace
}  // namespace dxs
