// The router of a decode step's MoE layer in one kernel (LaunchResidualNormRoute): the
// attention's residual add and the post-attention RMS norm, the router GEMV into float32
// logits and the top-k softmax, for up to kGemvMaxRows tokens. That is LaunchAddRmsNorm,
// LaunchGemvBf16 and LaunchTopKSoftmax one after another, bit for bit, in one launch instead
// of three: a decode layer is a chain of short dependent kernels, and each boundary costs a
// launch and a ramp even under programmatic dependent launch.
//
// Every block computes each row's 1 / rms with the norm kernel's thread partition and trees
// (row_norm.cuh), then its warps' router features as gemv.cu's GemvKernel does (ksplit warps
// a feature pair, each lane's 8-element chunks in the same order, gemv_lanes.cuh), the
// activations being the normed values made on the fly from the residual, the input and the
// norm weight, rounded to bf16 as the norm kernel stores them. The logits go to global memory;
// the last block to finish (a counter the caller keeps zeroed; that block resets it for the
// next launch or graph replay) writes the residual and normed rows and runs the top-k, a warp
// per token (topk_softmax_warp.cuh). Only that block writes the residual: every other block
// has read it by then (its reads precede its __threadfence and the counter's increment).
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <climits>
#include <cstdint>
#include <type_traits>

#include "kernels/cuda/elem_type.cuh"
#include "kernels/cuda/gemv_lanes.cuh"
#include "kernels/cuda/launch.cuh"
#include "kernels/cuda/ops.cuh"
#include "kernels/cuda/row_norm.cuh"
#include "kernels/cuda/topk_softmax.cuh"
#include "kernels/cuda/topk_softmax_warp.cuh"

namespace dxs::cuda {
namespace {

using gemv_lanes::kChunk;
using gemv_lanes::kGemvFeatures;
using gemv_lanes::LoadWeightsRaw;

constexpr int kThreads = row_norm::kThreads;
constexpr int kWarps = row_norm::kWarps;  // one token a warp in the top-k
constexpr int kEarly = 2;                 // router slices a warp requests before PdlWait
static_assert(kGemvMaxRows <= kWarps, "the last block's top-k takes a warp a token");

using Bf16 = __nv_bfloat16;

template <int M, int kSlots>
__global__ void __launch_bounds__(kThreads)
    ResidualNormRouteKernel(const Bf16* __restrict__ x, float* residual,
                            const Bf16* __restrict__ norm_w, float eps, int m, int hidden,
                            const Bf16* __restrict__ router, int num_experts, int ksplit, int top_k,
                            bool normalize, Bf16* normed, float* logits, int32_t* ids,
                            float* weights, unsigned* counter) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int sub = warp % ksplit;
  const int feature0 =
      (static_cast<int>(blockIdx.x) * (kWarps / ksplit) + warp / ksplit) * kGemvFeatures;
  const bool active = feature0 < num_experts;
  const int c0 = (sub * 32 + lane) * kChunk, stride = ksplit * 32 * kChunk;
  int64_t row[kGemvFeatures];
#pragma unroll
  for (int f = 0; f < kGemvFeatures; ++f) {
    row[f] = static_cast<int64_t>(min(feature0 + f, num_experts - 1)) * hidden;
  }
  // pdl-early: the router's weights are the model's, never written by a kernel, so the first
  // kEarly slices are requested before waiting for the previous kernel (PdlWait). Nothing
  // else is read or written before the wait.
  uint4 early[kEarly][kGemvFeatures];
#pragma unroll
  for (int i = 0; i < kEarly; ++i) {
#pragma unroll
    for (int f = 0; f < kGemvFeatures; ++f) {
      if (active && c0 + i * stride < hidden) {
        early[i][f] = LoadWeightsRaw(router + row[f] + c0 + i * stride);
      }
    }
  }
  PdlWait();
  __shared__ float warp_sums[kWarps];
  __shared__ float row_inv;
  float inv[M];
#pragma unroll
  for (int r = 0; r < M; ++r) {
    inv[r] = 0.f;
    if (r < m) {  // uniform across the block (BlockInvRms has barriers)
      const int64_t at = static_cast<int64_t>(r) * hidden;
      inv[r] = row_norm::BlockInvRms(
          row_norm::RowSquares<Bf16, kChunk, true, false>(x + at, residual + at, hidden), hidden,
          eps, warp_sums, &row_inv);
    }
  }

  float acc[kGemvFeatures][M];
#pragma unroll
  for (int f = 0; f < kGemvFeatures; ++f) {
#pragma unroll
    for (int r = 0; r < M; ++r) acc[f][r] = 0.f;
  }
  if (active) {
    gemv_lanes::StreamFeaturePair<M, kEarly>(
        router, row, early, c0, stride, hidden, m,
        [&](int r, int c, float(&xv)[kChunk]) {
          const int64_t at = static_cast<int64_t>(r) * hidden;
          row_norm::NormedChunk<Bf16, Bf16, Bf16, kChunk>(x + at, residual + at, norm_w, inv[r], c,
                                                          xv);
        },
        acc);
  }
  __shared__ float partial[kWarps][kGemvFeatures][M];
#pragma unroll
  for (int f = 0; f < kGemvFeatures; ++f) {
#pragma unroll
    for (int r = 0; r < M; ++r) {
      const float s = gemv_lanes::WarpSum(acc[f][r]);
      if (lane == 0) partial[warp][f][r] = s;
    }
  }
  __syncthreads();
  if (active && sub == 0 && lane < kGemvFeatures * M) {
    const int f = lane / M, r = lane % M;
    if (r < m && feature0 + f < num_experts) {
      float s = partial[warp][f][r];
      for (int j = 1; j < ksplit; ++j) s += partial[warp + j][f][r];
      logits[static_cast<int64_t>(r) * num_experts + feature0 + f] = s;
    }
  }

  // The last block to get here has every block's logits.
  __threadfence();
  __syncthreads();
  __shared__ bool last;
  if (threadIdx.x == 0) last = atomicAdd(counter, 1u) == gridDim.x - 1;
  __syncthreads();
  if (!last) return;
  __threadfence();
#pragma unroll
  for (int r = 0; r < M; ++r) {
    if (r < m) {
      const int64_t at = static_cast<int64_t>(r) * hidden;
      (void)row_norm::RowSquares<Bf16, kChunk, true, true>(x + at, residual + at, hidden);
      row_norm::StoreNormedRow<Bf16, Bf16, Bf16, kChunk, true>(x + at, residual + at, norm_w,
                                                               inv[r], hidden, normed + at);
    }
  }
  if (warp < m) {
    const float* token_logits = logits + static_cast<int64_t>(warp) * num_experts;
    TopKSoftmaxWarp<kSlots>([token_logits](int e) { return __ldcg(token_logits + e); }, num_experts,
                            top_k, normalize, ids + warp * top_k, weights + warp * top_k);
  }
  if (threadIdx.x == 0) *counter = 0;
}

}  // namespace

cudaError_t LaunchResidualNormRoute(const void* x, float* residual, const void* norm_weight,
                                    float eps, int64_t m, int64_t hidden, const void* router,
                                    int64_t num_experts, int64_t top_k, bool normalize,
                                    void* normed, float* logits, int32_t* ids, float* weights,
                                    unsigned* counter, cudaStream_t stream) {
  if (m < 0 || m > kGemvMaxRows || hidden <= 0 || hidden % kChunk != 0 || hidden > INT32_MAX ||
      num_experts <= 0 || num_experts > kTopKSoftmaxMaxExperts || top_k <= 0 ||
      top_k > num_experts || top_k > kTopKSoftmaxMaxTopK) {
    return cudaErrorInvalidValue;
  }
  if (m == 0) return cudaSuccess;
  if (x == nullptr || residual == nullptr || norm_weight == nullptr || router == nullptr ||
      normed == nullptr || logits == nullptr || ids == nullptr || weights == nullptr ||
      counter == nullptr || !Aligned16(x) || !Aligned16(residual) || !Aligned16(norm_weight) ||
      !Aligned16(router) || !Aligned16(normed)) {
    return cudaErrorInvalidValue;
  }
  const int64_t groups = (num_experts + kGemvFeatures - 1) / kGemvFeatures;
  const int ksplit = GemvKSplitOf(groups, hidden);
  const int64_t per_block = kWarps / ksplit;
  const unsigned blocks = static_cast<unsigned>((groups + per_block - 1) / per_block);
  auto launch = [&](auto rows, auto slots) {
    constexpr int kRows = decltype(rows)::value;
    constexpr int kSlots = decltype(slots)::value;
    LaunchKernel(ResidualNormRouteKernel<kRows, kSlots>, blocks, kThreads, 0, stream,
                 static_cast<const Bf16*>(x), residual, static_cast<const Bf16*>(norm_weight), eps,
                 static_cast<int>(m), static_cast<int>(hidden), static_cast<const Bf16*>(router),
                 static_cast<int>(num_experts), ksplit, static_cast<int>(top_k), normalize,
                 static_cast<Bf16*>(normed), logits, ids, weights, counter);
    return cudaGetLastError();
  };
  auto by_rows = [&](auto slots) {
    if (m == 1) return launch(std::integral_constant<int, 1>{}, slots);
    if (m == 2) return launch(std::integral_constant<int, 2>{}, slots);
    if (m <= 4) return launch(std::integral_constant<int, 4>{}, slots);
    return launch(std::integral_constant<int, kGemvMaxRows>{}, slots);
  };
  if (num_experts <= 4 * 32) return by_rows(std::integral_constant<int, 4>{});
  return by_rows(std::integral_constant<int, kTopKSoftmaxMaxExperts / 32>{});
}

}  // namespace dxs::cuda
