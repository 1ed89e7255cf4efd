// Router top-k softmax kernel. See topk_softmax.cuh for the contract.
//
// One warp per token (topk_softmax_warp.cuh, shared with the decode router's fused kernel).
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <climits>
#include <cstdint>

#include "kernels/cuda/launch.cuh"
#include "kernels/cuda/topk_softmax.cuh"
#include "kernels/cuda/topk_softmax_warp.cuh"

namespace dxs {
namespace {

using cuda::LaunchKernel;
using cuda::PdlWait;

constexpr int kWarpSize = 32;
constexpr int kWarpsPerBlock = 4;

__device__ __forceinline__ float LoadLogit(const float* p) { return __ldg(p); }
__device__ __forceinline__ float LoadLogit(const __nv_bfloat16* p) { return __bfloat162float(*p); }

template <int kSlots, typename T>
__global__ void __launch_bounds__(kWarpSize* kWarpsPerBlock)
    TopKSoftmaxKernel(const T* __restrict__ logits, int64_t num_tokens, int num_experts, int top_k,
                      bool normalize, int32_t* __restrict__ ids, float* __restrict__ weights) {
  PdlWait();
  const int64_t token = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + threadIdx.x / kWarpSize;
  if (token >= num_tokens) return;  // the whole warp leaves together
  const T* row = logits + token * num_experts;
  cuda::TopKSoftmaxWarp<kSlots>([row](int e) { return LoadLogit(row + e); }, num_experts, top_k,
                                normalize, ids + token * top_k, weights + token * top_k);
}

template <typename T>
cudaError_t Launch(const T* logits, int64_t num_tokens, int64_t num_experts, int64_t top_k,
                   bool normalize, int32_t* ids, float* weights, cudaStream_t stream) {
  if (num_tokens < 0 || num_experts <= 0 || num_experts > kTopKSoftmaxMaxExperts || top_k <= 0 ||
      top_k > num_experts || top_k > kTopKSoftmaxMaxTopK) {
    return cudaErrorInvalidValue;
  }
  if (num_tokens == 0) return cudaSuccess;  // empty batch: no launch, no CUDA call at all
  if (logits == nullptr || ids == nullptr || weights == nullptr) return cudaErrorInvalidValue;
  const int64_t num_blocks = (num_tokens + kWarpsPerBlock - 1) / kWarpsPerBlock;
  if (num_blocks > INT_MAX) return cudaErrorInvalidValue;  // gridDim.x limit
  const dim3 grid(static_cast<unsigned>(num_blocks));
  const dim3 block(kWarpSize * kWarpsPerBlock);
  const int experts = static_cast<int>(num_experts);
  const int k = static_cast<int>(top_k);
  const int64_t slots = (num_experts + kWarpSize - 1) / kWarpSize;
  if (slots <= 1) {
    LaunchKernel(TopKSoftmaxKernel<1, T>, grid, block, 0, stream, logits, num_tokens, experts, k,
                 normalize, ids, weights);
  } else if (slots <= 2) {
    LaunchKernel(TopKSoftmaxKernel<2, T>, grid, block, 0, stream, logits, num_tokens, experts, k,
                 normalize, ids, weights);
  } else if (slots <= 4) {
    LaunchKernel(TopKSoftmaxKernel<4, T>, grid, block, 0, stream, logits, num_tokens, experts, k,
                 normalize, ids, weights);
  } else if (slots <= 8) {
    LaunchKernel(TopKSoftmaxKernel<8, T>, grid, block, 0, stream, logits, num_tokens, experts, k,
                 normalize, ids, weights);
  } else {
    LaunchKernel(TopKSoftmaxKernel<16, T>, grid, block, 0, stream, logits, num_tokens, experts, k,
                 normalize, ids, weights);
  }
  return cudaGetLastError();
}

}  // namespace

cudaError_t LaunchTopKSoftmax(const float* logits, int64_t num_tokens, int64_t num_experts,
                              int64_t top_k, bool normalize, int32_t* ids, float* weights,
                              cudaStream_t stream) {
  return Launch(logits, num_tokens, num_experts, top_k, normalize, ids, weights, stream);
}

cudaError_t LaunchTopKSoftmaxBf16(const __nv_bfloat16* logits, int64_t num_tokens,
                                  int64_t num_experts, int64_t top_k, bool normalize, int32_t* ids,
                                  float* weights, cudaStream_t stream) {
  return Launch(logits, num_tokens, num_experts, top_k, normalize, ids, weights, stream);
}

}  // namespace dxs
