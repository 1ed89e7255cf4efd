// FP8 dispatch records (--wire-dtype fp8; the layout in kernels/moe_compute.h): a row of
// `hidden` values leaves as ceil(hidden / 128) float32 scales then `hidden` float8_e4m3fn
// values, each group's scale max(amax, 1e-4) / 448. The arithmetic is the CPU backend's
// (cpu_moe_ops.cc), so the records are bit-identical to it: the group's amax, the scale by
// one IEEE division, each value divided by it (IEEE, not the fast reciprocal) and rounded to
// the nearest e4m3fn value, ties to even, saturating at +-448.
//
// One block per (row, 128-value group), one thread per value: a group's amax is a
// four-warp reduction. Decode-sized dispatches are a few rows, prefill a few thousand; either
// way the kernel is a single pass over the rows, bound by memory.
#include <cuda_fp8.h>

#include "kernels/cuda/elem_type.cuh"
#include "kernels/cuda/launch.cuh"
#include "kernels/cuda/ops.cuh"

namespace dxs::cuda {
namespace {

constexpr int kGroup = 128;  // kFp8GroupSize (kernels/moe_compute.h)
constexpr float kE4m3Max = 448.0f;

__host__ __device__ inline int64_t Groups(int64_t hidden) { return (hidden + kGroup - 1) / kGroup; }
__host__ __device__ inline int64_t RecordBytes(int64_t hidden) {
  return 4 * Groups(hidden) + hidden;
}

template <typename T>
__global__ void QuantizeRowsFp8Kernel(const T* src, const int32_t* rows, int64_t src_rows,
                                      int hidden, uint8_t* records) {
  PdlWait();
  const int64_t i = blockIdx.x;
  const int g = static_cast<int>(blockIdx.y);
  const int j = g * kGroup + static_cast<int>(threadIdx.x);
  const int32_t r = rows[i];
  // A row outside the source (the host checked what it could): its record stays as it was.
  if (r < 0 || r >= src_rows) return;
  const float v = j < hidden ? ToFloat(src[static_cast<int64_t>(r) * hidden + j]) : 0.f;
  float amax = fabsf(v);
  for (int offset = 16; offset > 0; offset /= 2) {
    amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, offset));
  }
  __shared__ float warp_max[kGroup / 32];
  if (threadIdx.x % 32 == 0) warp_max[threadIdx.x / 32] = amax;
  __syncthreads();
  amax = fmaxf(fmaxf(warp_max[0], warp_max[1]), fmaxf(warp_max[2], warp_max[3]));
  const float scale = __fdiv_rn(fmaxf(amax, 1e-4f), kE4m3Max);
  uint8_t* record = records + i * RecordBytes(hidden);
  if (threadIdx.x == 0) reinterpret_cast<float*>(record)[g] = scale;
  if (j < hidden) {
    record[4 * Groups(hidden) + j] =
        static_cast<uint8_t>(__nv_cvt_float_to_fp8(__fdiv_rn(v, scale), __NV_SATFINITE, __NV_E4M3));
  }
}

template <typename T>
__global__ void DequantizeRowsFp8Kernel(const uint8_t* records, int hidden, T* dst) {
  PdlWait();
  const int64_t i = blockIdx.x;
  const int g = static_cast<int>(blockIdx.y);
  const int j = g * kGroup + static_cast<int>(threadIdx.x);
  if (j >= hidden) return;
  const uint8_t* record = records + i * RecordBytes(hidden);
  const float scale = reinterpret_cast<const float*>(record)[g];
  const __half_raw h = __nv_cvt_fp8_to_halfraw(
      static_cast<__nv_fp8_storage_t>(record[4 * Groups(hidden) + j]), __NV_E4M3);
  dst[i * hidden + j] = FromFloat<T>(__half2float(__half(h)) * scale);
}

}  // namespace

cudaError_t LaunchQuantizeRowsFp8(const void* src, ElemType src_type, int64_t src_rows,
                                  const int32_t* rows, int64_t n, int64_t hidden, void* records,
                                  cudaStream_t stream) {
  if (n < 0 || n > INT32_MAX || hidden <= 0 || hidden % 4 != 0 || hidden > INT32_MAX ||
      Groups(hidden) > 65535 || src_rows < 0) {
    return cudaErrorInvalidValue;
  }
  if (n == 0) return cudaSuccess;
  if (src == nullptr || rows == nullptr || records == nullptr) return cudaErrorInvalidValue;
  const dim3 grid(static_cast<unsigned>(n), static_cast<unsigned>(Groups(hidden)));
  return DispatchFloat(src_type, [&](auto tag) {
    using T = typename decltype(tag)::type;
    LaunchKernel(QuantizeRowsFp8Kernel<T>, grid, kGroup, 0, stream, static_cast<const T*>(src),
                 rows, src_rows, static_cast<int>(hidden), static_cast<uint8_t*>(records));
    return cudaGetLastError();
  });
}

cudaError_t LaunchDequantizeRowsFp8(const void* records, int64_t n, int64_t hidden, void* dst,
                                    ElemType dst_type, cudaStream_t stream) {
  if (n < 0 || n > INT32_MAX || hidden <= 0 || hidden % 4 != 0 || hidden > INT32_MAX ||
      Groups(hidden) > 65535) {
    return cudaErrorInvalidValue;
  }
  if (n == 0) return cudaSuccess;
  if (records == nullptr || dst == nullptr) return cudaErrorInvalidValue;
  const dim3 grid(static_cast<unsigned>(n), static_cast<unsigned>(Groups(hidden)));
  return DispatchFloat(dst_type, [&](auto tag) {
    using T = typename decltype(tag)::type;
    LaunchKernel(DequantizeRowsFp8Kernel<T>, grid, kGroup, 0, stream,
                 static_cast<const uint8_t*>(records), static_cast<int>(hidden),
                 static_cast<T*>(dst));
    return cudaGetLastError();
  });
}

}  // namespace dxs::cuda
