// Sampling on the GPU: greedy (argmax) per row, so that only the chosen ids come back.
#include <cuda_runtime_api.h>

#include <cstdint>

#include "kernels/cuda/ops.cuh"

namespace dxs::cuda {
namespace {

constexpr int kThreads = 512;

// Whether (v, i) beats (best, best_i): larger, or equal and earlier. NaN never beats and
// is never beaten here; the caller handles a NaN at index 0.
__device__ bool Better(float v, int64_t i, float best, int64_t best_i) {
  return v > best || (v == best && i < best_i);
}

__global__ void ArgmaxRowsKernel(const float* __restrict__ logits, int64_t vocab,
                                 int32_t* __restrict__ ids) {
  const float* row = logits + blockIdx.x * vocab;
  // The host scan keeps index 0 when row[0] is NaN (nothing compares greater).
  if (isnan(row[0])) {
    if (threadIdx.x == 0) ids[blockIdx.x] = 0;
    return;
  }
  float best = -INFINITY;
  int64_t best_i = vocab;  // none yet
  for (int64_t j = threadIdx.x; j < vocab; j += blockDim.x) {
    const float v = row[j];
    if (!isnan(v) && (best_i == vocab || Better(v, j, best, best_i))) {
      best = v;
      best_i = j;
    }
  }
  // Warp then block reduction in a fixed shape: the result does not depend on timing.
  for (int offset = 16; offset > 0; offset >>= 1) {
    const float v = __shfl_down_sync(0xffffffffu, best, offset);
    const int64_t i = __shfl_down_sync(0xffffffffu, best_i, offset);
    if (i != vocab && (best_i == vocab || Better(v, i, best, best_i))) {
      best = v;
      best_i = i;
    }
  }
  __shared__ float warp_best[kThreads / 32];
  __shared__ int64_t warp_index[kThreads / 32];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  if (lane == 0) {
    warp_best[warp] = best;
    warp_index[warp] = best_i;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    float b = warp_best[0];
    int64_t bi = warp_index[0];
    for (int w = 1; w < kThreads / 32; ++w) {
      if (warp_index[w] != vocab && (bi == vocab || Better(warp_best[w], warp_index[w], b, bi))) {
        b = warp_best[w];
        bi = warp_index[w];
      }
    }
    // A row of NaNs after a number at 0 keeps 0, as the host scan does.
    ids[blockIdx.x] = static_cast<int32_t>(bi == vocab ? 0 : bi);
  }
}

}  // namespace

cudaError_t LaunchArgmaxRows(const float* logits, int64_t n, int64_t vocab, int32_t* ids,
                             cudaStream_t stream) {
  if (n < 0 || vocab <= 0 || n > 2147483647 || vocab > 2147483647) return cudaErrorInvalidValue;
  if (n == 0) return cudaSuccess;
  if (logits == nullptr || ids == nullptr) return cudaErrorInvalidValue;
  ArgmaxRowsKernel<<<static_cast<unsigned>(n), kThreads, 0, stream>>>(logits, vocab, ids);
  return cudaGetLastError();
}

}  // namespace dxs::cuda
