// The decode router's fused kernel (kernels/cuda/route_decode.cu): host-side guards (run
// everywhere, no device needed) and, on a GPU, the same bits as the three kernels it stands
// for (LaunchAddRmsNorm, LaunchGemvBf16 into float32 logits, LaunchTopKSoftmax) on seeded
// random inputs, launch after launch (its last-block counter must come back to zero).
// Without a device the GPU cases skip.
#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/cuda/ops.cuh"
#include "kernels/cuda/topk_softmax.cuh"
#include "tests/kernels/cuda/cuda_test_util.h"

namespace dxs::cuda {
namespace {

// A distinct, aligned, never dereferenced pointer: the guards fire before any launch.
template <typename T>
T* Fake(uintptr_t slot) {
  return reinterpret_cast<T*>(slot * 256);
}

cudaError_t LaunchWith(int64_t m, int64_t hidden, int64_t experts, int64_t top_k,
                       const void* x = Fake<void>(1), const void* router = Fake<void>(2)) {
  return LaunchResidualNormRoute(x, Fake<float>(3), Fake<void>(4), 1e-6f, m, hidden, router,
                                 experts, top_k, true, Fake<void>(5), Fake<float>(6),
                                 Fake<int32_t>(7), Fake<float>(8), Fake<unsigned>(9), nullptr);
}

TEST(RouteDecodeCudaGuard, ZeroRowsIsOkWithoutLaunching) {
  EXPECT_EQ(LaunchResidualNormRoute(nullptr, nullptr, nullptr, 1e-6f, 0, 2048, nullptr, 128, 8,
                                    true, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr),
            cudaSuccess);
}

TEST(RouteDecodeCudaGuard, ShapesItCannotTakeAreInvalidValue) {
  EXPECT_EQ(LaunchWith(kGemvMaxRows + 1, 2048, 128, 8), cudaErrorInvalidValue);  // rows
  EXPECT_EQ(LaunchWith(-1, 2048, 128, 8), cudaErrorInvalidValue);
  EXPECT_EQ(LaunchWith(1, 2047, 128, 8), cudaErrorInvalidValue);  // hidden % 8
  EXPECT_EQ(LaunchWith(1, 0, 128, 8), cudaErrorInvalidValue);
  EXPECT_EQ(LaunchWith(1, 2048, 0, 1), cudaErrorInvalidValue);  // experts
  EXPECT_EQ(LaunchWith(1, 2048, kTopKSoftmaxMaxExperts + 1, 8), cudaErrorInvalidValue);
  EXPECT_EQ(LaunchWith(1, 2048, 128, 0), cudaErrorInvalidValue);  // top_k
  EXPECT_EQ(LaunchWith(1, 2048, 4, 5), cudaErrorInvalidValue);
  EXPECT_EQ(LaunchWith(1, 2048, 128, kTopKSoftmaxMaxTopK + 1), cudaErrorInvalidValue);
  EXPECT_EQ(LaunchWith(1, 2048, 128, 8, nullptr), cudaErrorInvalidValue);  // null x
  // Misaligned: the 16-byte loads need every row pointer aligned.
  EXPECT_EQ(LaunchWith(1, 2048, 128, 8, reinterpret_cast<const char*>(Fake<void>(1)) + 2),
            cudaErrorInvalidValue);
  EXPECT_EQ(
      LaunchWith(1, 2048, 128, 8, Fake<void>(1), reinterpret_cast<const char*>(Fake<void>(2)) + 8),
      cudaErrorInvalidValue);
}

// ---- On a GPU ----

std::vector<__nv_bfloat16> Bf16Random(size_t n, uint32_t seed, float lo, float hi) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> dist(lo, hi);
  std::vector<__nv_bfloat16> v(n);
  for (auto& e : v) e = __float2bfloat16(dist(rng));
  return v;
}

template <typename T>
T* ToDevice(const std::vector<T>& host) {
  T* p = nullptr;
  EXPECT_EQ(cudaMalloc(reinterpret_cast<void**>(&p), host.size() * sizeof(T)), cudaSuccess);
  EXPECT_EQ(cudaMemcpy(p, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice),
            cudaSuccess);
  return p;
}

template <typename T>
std::vector<T> ToHost(const T* p, size_t n) {
  std::vector<T> host(n);
  EXPECT_EQ(cudaMemcpy(host.data(), p, n * sizeof(T), cudaMemcpyDeviceToHost), cudaSuccess);
  return host;
}

template <typename T>
bool SameBytes(const std::vector<T>& a, const std::vector<T>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0;
}

struct Shape {
  int64_t m, hidden, experts, top_k;
  bool normalize;
};

TEST(RouteDecodeCuda, IsTheNormTheRouterGemvAndTheTopKBitForBit) {
  SKIP_WITHOUT_GPU();
  cudaStream_t stream = nullptr;
  ASSERT_CUDA_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  unsigned* counter = nullptr;
  ASSERT_CUDA_OK(cudaMalloc(reinterpret_cast<void**>(&counter), sizeof(unsigned)));
  ASSERT_CUDA_OK(cudaMemset(counter, 0, sizeof(unsigned)));
  // Qwen3-30B-A3B's router (2048 x 128, top-8) at every row count the GEMV takes, a
  // normalize-off case, more experts than four slots a lane (kSlots 16), few and odd shapes
  // (a tail feature pair, no k split).
  const std::vector<Shape> shapes = {{1, 2048, 128, 8, true}, {2, 2048, 128, 8, false},
                                     {3, 2048, 128, 8, true}, {4, 2048, 128, 8, true},
                                     {5, 2048, 128, 8, true}, {8, 2048, 128, 8, true},
                                     {1, 4096, 256, 8, true}, {6, 512, 160, 6, true},
                                     {2, 256, 7, 2, true},    {1, 64, 3, 3, false}};
  for (const Shape& s : shapes) {
    SCOPED_TRACE(::testing::Message() << s.m << " rows, hidden " << s.hidden << ", " << s.experts
                                      << " experts, top-" << s.top_k);
    const uint32_t seed = static_cast<uint32_t>(s.m * 131 + s.hidden + s.experts);
    const std::vector<__nv_bfloat16> x = Bf16Random(s.m * s.hidden, seed, -2.f, 2.f);
    const std::vector<__nv_bfloat16> norm_w = Bf16Random(s.hidden, seed + 1, 0.5f, 1.5f);
    const std::vector<__nv_bfloat16> router =
        Bf16Random(s.experts * s.hidden, seed + 2, -0.1f, 0.1f);
    std::vector<float> residual(s.m * s.hidden);
    std::mt19937 rng(seed + 3);
    std::uniform_real_distribution<float> dist(-3.f, 3.f);
    for (float& v : residual) v = dist(rng);

    __nv_bfloat16* d_x = ToDevice(x);
    __nv_bfloat16* d_norm_w = ToDevice(norm_w);
    __nv_bfloat16* d_router = ToDevice(router);
    // The three kernels, one after another.
    float* d_res_want = ToDevice(residual);
    __nv_bfloat16* d_normed_want = ToDevice(std::vector<__nv_bfloat16>(s.m * s.hidden));
    float* d_logits_want = ToDevice(std::vector<float>(s.m * s.experts));
    int32_t* d_ids_want = ToDevice(std::vector<int32_t>(s.m * s.top_k, -1));
    float* d_weights_want = ToDevice(std::vector<float>(s.m * s.top_k));
    ASSERT_CUDA_OK(LaunchAddRmsNorm(d_x, ElemType::kBF16, d_res_want, d_norm_w, ElemType::kBF16,
                                    1e-6f, s.m, s.hidden, d_normed_want, ElemType::kBF16, stream));
    ASSERT_CUDA_OK(LaunchGemvBf16(d_normed_want, ElemType::kBF16, s.m, d_router, s.experts,
                                  s.hidden, d_logits_want, ElemType::kF32, stream));
    ASSERT_CUDA_OK(LaunchTopKSoftmax(d_logits_want, s.m, s.experts, s.top_k, s.normalize,
                                     d_ids_want, d_weights_want, stream));
    ASSERT_CUDA_OK(cudaStreamSynchronize(stream));
    const std::vector<float> res_want = ToHost(d_res_want, residual.size());
    const std::vector<__nv_bfloat16> normed_want = ToHost(d_normed_want, x.size());
    const std::vector<int32_t> ids_want = ToHost(d_ids_want, s.m * s.top_k);
    const std::vector<float> weights_want = ToHost(d_weights_want, s.m * s.top_k);
    // The fused kernel, three launches in a row from the same residual (its counter is
    // left at zero by each, so the next one's last block is found again).
    for (int launch = 0; launch < 3; ++launch) {
      SCOPED_TRACE(::testing::Message() << "launch " << launch);
      float* d_res = ToDevice(residual);
      __nv_bfloat16* d_normed = ToDevice(std::vector<__nv_bfloat16>(s.m * s.hidden));
      float* d_logits = ToDevice(std::vector<float>(s.m * s.experts));
      int32_t* d_ids = ToDevice(std::vector<int32_t>(s.m * s.top_k, -1));
      float* d_weights = ToDevice(std::vector<float>(s.m * s.top_k));
      ASSERT_CUDA_OK(LaunchResidualNormRoute(d_x, d_res, d_norm_w, 1e-6f, s.m, s.hidden, d_router,
                                             s.experts, s.top_k, s.normalize, d_normed, d_logits,
                                             d_ids, d_weights, counter, stream));
      ASSERT_CUDA_OK(cudaStreamSynchronize(stream));
      EXPECT_TRUE(SameBytes(ToHost(d_res, residual.size()), res_want));
      EXPECT_TRUE(SameBytes(ToHost(d_normed, x.size()), normed_want));
      EXPECT_TRUE(
          SameBytes(ToHost(d_logits, s.m * s.experts), ToHost(d_logits_want, s.m * s.experts)));
      EXPECT_EQ(ToHost(d_ids, s.m * s.top_k), ids_want);
      EXPECT_TRUE(SameBytes(ToHost(d_weights, s.m * s.top_k), weights_want));
      EXPECT_EQ(ToHost(counter, 1)[0], 0u);
      for (void* p :
           {static_cast<void*>(d_res), static_cast<void*>(d_normed), static_cast<void*>(d_logits),
            static_cast<void*>(d_ids), static_cast<void*>(d_weights)}) {
        ASSERT_CUDA_OK(cudaFree(p));
      }
    }
    for (void* p : {static_cast<void*>(d_x), static_cast<void*>(d_norm_w),
                    static_cast<void*>(d_router), static_cast<void*>(d_res_want),
                    static_cast<void*>(d_normed_want), static_cast<void*>(d_logits_want),
                    static_cast<void*>(d_ids_want), static_cast<void*>(d_weights_want)}) {
      ASSERT_CUDA_OK(cudaFree(p));
    }
  }
  ASSERT_CUDA_OK(cudaFree(counter));
  ASSERT_CUDA_OK(cudaStreamDestroy(stream));
}

}  // namespace
}  // namespace dxs::cuda
