// Seeded uniform fills (random checkpoints made on the GPU with the host's exact values)
// and the per-expert load counters.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>

#include "common/splitmix64.h"
#include "kernels/cuda/launch.cuh"
#include "kernels/cuda/ops.cuh"

namespace dxs::cuda {
namespace {

__device__ float RoundTo(ElemType type, float v) {
  switch (type) {
    case ElemType::kBF16:
      return __bfloat162float(__float2bfloat16_rn(v));
    case ElemType::kF16:
      return __half2float(__float2half_rn(v));
    default:
      return v;
  }
}

__global__ void FillUniformKernel(void* dst, ElemType dst_type, int64_t n, uint64_t seed,
                                  double mean, double half_width, ElemType values_type) {
  PdlWait();
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const uint64_t bits = SplitMix64Mix(seed + static_cast<uint64_t>(i + 1) * kSplitMix64Gamma);
    const double u = static_cast<double>(bits >> 11) * 0x1.0p-53;
    // The same two roundings as the host: double to float, then to the stored dtype.
    const float v = RoundTo(values_type, static_cast<float>(mean + (2.0 * u - 1.0) * half_width));
    switch (dst_type) {
      case ElemType::kBF16:
        static_cast<__nv_bfloat16*>(dst)[i] = __float2bfloat16_rn(v);
        break;
      case ElemType::kF16:
        static_cast<__half*>(dst)[i] = __float2half_rn(v);
        break;
      default:
        static_cast<float*>(dst)[i] = v;
    }
  }
}

bool IsFloat(ElemType t) {
  return t == ElemType::kF32 || t == ElemType::kBF16 || t == ElemType::kF16;
}

}  // namespace

cudaError_t LaunchFillUniform(void* dst, ElemType dst_type, int64_t n, uint64_t seed, double mean,
                              double half_width, ElemType values_type, cudaStream_t stream) {
  if (n < 0 || !IsFloat(dst_type) || !IsFloat(values_type)) return cudaErrorInvalidValue;
  if (n == 0) return cudaSuccess;
  if (dst == nullptr) return cudaErrorInvalidValue;
  constexpr int kThreads = 256;
  const int64_t blocks = std::min<int64_t>((n + kThreads - 1) / kThreads, 65536);
  LaunchKernel(FillUniformKernel, static_cast<unsigned>(blocks), kThreads, 0, stream, dst, dst_type,
               n, seed, mean, half_width, values_type);
  return cudaGetLastError();
}

namespace {

__global__ void AccumulateCountsKernel(const int32_t* offsets, int64_t n, int64_t* counts) {
  PdlWait();
  for (int64_t e = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; e < n;
       e += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    counts[e] += offsets[e + 1] - offsets[e];
  }
}

}  // namespace

cudaError_t LaunchAccumulateCounts(const int32_t* offsets, int64_t n, int64_t* counts,
                                   cudaStream_t stream) {
  if (n < 0) return cudaErrorInvalidValue;
  if (n == 0) return cudaSuccess;
  if (offsets == nullptr || counts == nullptr) return cudaErrorInvalidValue;
  const int64_t blocks = std::min<int64_t>((n + 255) / 256, 1024);
  LaunchKernel(AccumulateCountsKernel, static_cast<unsigned>(blocks), 256, 0, stream, offsets, n,
               counts);
  return cudaGetLastError();
}

}  // namespace dxs::cuda
