// The FP8 grouped expert FFN's activation passes (the GEMMs are grouped_gemm_fp8_sm90.cuh):
//
// - LaunchQuantizeGroupedFp8: the FFN's input rows in expert order (gathered by `rows` when
//   given, as the bf16 path's gather), quantized per row and 128 channels, into the GEMM's A
//   and its scales in the per-expert M-major blocks the CUTLASS mainloop reads.
// - LaunchSiluMulQuantizeGroupedFp8: silu(gate) * up of the gate_up GEMM's bf16 rows, rounded
//   to bf16 as the bf16 path rounds it (SiluMulPacked), then quantized the same way: the down
//   GEMM's A, with no bf16 intermediate written.
// - LaunchTransposeBlockScales: a weight's [n / 128, stride] scales (Tensor::block_scales)
//   into the N-major [k / 128, n / 128] block the mainloop reads for B.
//
// Quantization is the FP8 records' (fp8_rows.cu): scale max(amax, 1e-4) / 448 by one IEEE
// division, values divided by it and rounded to e4m3, nearest even, saturating. One block of
// 128 threads per (row, 128-channel group); a row's expert is found by a binary search of
// the offsets. Rows past offsets[E] (a counted round's unused capacity) are not written.
#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include <climits>
#include <cstdint>

#include "kernels/cuda/elem_type.cuh"
#include "kernels/cuda/launch.cuh"
#include "kernels/cuda/ops.cuh"

namespace dxs::cuda {
namespace {

constexpr int kGroup = 128;
constexpr float kE4m3Max = 448.0f;

// The expert whose rows hold p (offsets[e] <= p < offsets[e + 1]), or -1.
__device__ __forceinline__ int ExpertOfRow(const int32_t* offsets, int num_experts, int64_t p) {
  if (p < offsets[0] || p >= offsets[num_experts]) return -1;
  int lo = 0, hi = num_experts;  // offsets[lo] <= p < offsets[hi]
  while (hi - lo > 1) {
    const int mid = (lo + hi) / 2;
    if (offsets[mid] <= p) {
      lo = mid;
    } else {
      hi = mid;
    }
  }
  return lo;
}

// v's group (this block's 128 threads) quantized: writes the value and, from thread 0, the
// scale at *scale_at.
__device__ __forceinline__ void QuantizeGroup(float v, uint8_t* value_at, float* scale_at) {
  float amax = fabsf(v);
  for (int offset = 16; offset > 0; offset /= 2) {
    amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, offset));
  }
  __shared__ float warp_max[kGroup / 32];
  if (threadIdx.x % 32 == 0) warp_max[threadIdx.x / 32] = amax;
  __syncthreads();
  amax = fmaxf(fmaxf(warp_max[0], warp_max[1]), fmaxf(warp_max[2], warp_max[3]));
  const float scale = __fdiv_rn(fmaxf(amax, 1e-4f), kE4m3Max);
  if (threadIdx.x == 0) *scale_at = scale;
  *value_at =
      static_cast<uint8_t>(__nv_cvt_float_to_fp8(__fdiv_rn(v, scale), __NV_SATFINITE, __NV_E4M3));
}

template <typename T>
__global__ void QuantizeGroupedFp8Kernel(const T* xs, const int32_t* rows, int64_t x_rows, int k,
                                         const int32_t* offsets, int num_experts, uint8_t* out,
                                         float* sfa) {
  PdlWait();
  const int64_t p = blockIdx.x;
  const int g = static_cast<int>(blockIdx.y);
  const int e = ExpertOfRow(offsets, num_experts, p);
  if (e < 0) return;
  const int64_t src = rows != nullptr ? rows[p] : p;
  const int j = g * kGroup + static_cast<int>(threadIdx.x);
  const float v = src >= 0 && src < x_rows ? ToFloat(xs[src * k + j]) : 0.f;
  const int64_t begin = offsets[e], count = offsets[e + 1] - begin;
  QuantizeGroup(v, out + p * k + j, sfa + begin * (k / kGroup) + g * count + (p - begin));
}

__global__ void SiluMulQuantizeGroupedFp8Kernel(const __nv_bfloat16* gu, int inter,
                                                const int32_t* offsets, int num_experts,
                                                uint8_t* out, float* sfa) {
  PdlWait();
  const int64_t p = blockIdx.x;
  const int g = static_cast<int>(blockIdx.y);
  const int e = ExpertOfRow(offsets, num_experts, p);
  if (e < 0) return;
  const int j = g * kGroup + static_cast<int>(threadIdx.x);
  const float gate = __bfloat162float(gu[p * 2 * inter + j]);
  const float up = __bfloat162float(gu[p * 2 * inter + inter + j]);
  const float v = __bfloat162float(__float2bfloat16(gate / (1.f + expf(-gate)) * up));
  const int64_t begin = offsets[e], count = offsets[e + 1] - begin;
  QuantizeGroup(v, out + p * inter + j, sfa + begin * (inter / kGroup) + g * count + (p - begin));
}

__global__ void TransposeBlockScalesKernel(const float* src, int64_t n_blocks, int64_t k_blocks,
                                           int64_t stride, float* dst) {
  PdlWait();
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n_blocks * k_blocks) return;
  const int64_t kb = i / n_blocks, nb = i % n_blocks;
  dst[i] = src[nb * stride + kb];
}

}  // namespace

cudaError_t LaunchQuantizeGroupedFp8(const void* xs, ElemType x_type, int64_t x_rows,
                                     const int32_t* rows, int64_t num_rows, int64_t k,
                                     const int32_t* offsets, int64_t num_experts, uint8_t* out,
                                     float* sfa, cudaStream_t stream) {
  if (num_rows < 0 || num_rows > INT32_MAX || x_rows < 0 || k <= 0 || k % kGroup != 0 ||
      k > INT32_MAX || k / kGroup > 65535 || num_experts <= 0 || num_experts > INT32_MAX) {
    return cudaErrorInvalidValue;
  }
  if (num_rows == 0) return cudaSuccess;
  if (xs == nullptr || offsets == nullptr || out == nullptr || sfa == nullptr) {
    return cudaErrorInvalidValue;
  }
  const dim3 grid(static_cast<unsigned>(num_rows), static_cast<unsigned>(k / kGroup));
  return DispatchFloat(x_type, [&](auto tag) {
    using T = typename decltype(tag)::type;
    return LaunchKernel(QuantizeGroupedFp8Kernel<T>, grid, kGroup, 0, stream,
                        static_cast<const T*>(xs), rows, x_rows, static_cast<int>(k), offsets,
                        static_cast<int>(num_experts), out, sfa);
  });
}

cudaError_t LaunchSiluMulQuantizeGroupedFp8(const void* gate_up, int64_t num_rows, int64_t inter,
                                            const int32_t* offsets, int64_t num_experts,
                                            uint8_t* out, float* sfa, cudaStream_t stream) {
  if (num_rows < 0 || num_rows > INT32_MAX || inter <= 0 || inter % kGroup != 0 ||
      inter > INT32_MAX / 2 || inter / kGroup > 65535 || num_experts <= 0 ||
      num_experts > INT32_MAX) {
    return cudaErrorInvalidValue;
  }
  if (num_rows == 0) return cudaSuccess;
  if (gate_up == nullptr || offsets == nullptr || out == nullptr || sfa == nullptr) {
    return cudaErrorInvalidValue;
  }
  const dim3 grid(static_cast<unsigned>(num_rows), static_cast<unsigned>(inter / kGroup));
  return LaunchKernel(SiluMulQuantizeGroupedFp8Kernel, grid, kGroup, 0, stream,
                      static_cast<const __nv_bfloat16*>(gate_up), static_cast<int>(inter), offsets,
                      static_cast<int>(num_experts), out, sfa);
}

cudaError_t LaunchTransposeBlockScales(const float* src, int64_t n_blocks, int64_t k_blocks,
                                       int64_t stride, float* dst, cudaStream_t stream) {
  if (n_blocks < 0 || k_blocks < 0 || stride < k_blocks || n_blocks * k_blocks > INT32_MAX) {
    return cudaErrorInvalidValue;
  }
  const int64_t total = n_blocks * k_blocks;
  if (total == 0) return cudaSuccess;
  if (src == nullptr || dst == nullptr) return cudaErrorInvalidValue;
  constexpr int kThreads = 256;
  return LaunchKernel(TransposeBlockScalesKernel,
                      static_cast<unsigned>((total + kThreads - 1) / kThreads), kThreads, 0, stream,
                      src, n_blocks, k_blocks, stride, dst);
}

}  // namespace dxs::cuda
