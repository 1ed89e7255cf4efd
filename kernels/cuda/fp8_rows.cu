// FP8 dispatch records (--wire-dtype fp8; the layout in kernels/moe_compute.h): a row of
// `hidden` values leaves as ceil(hidden / 128) float32 scales then `hidden` float8_e4m3fn
// values, each group's scale max(amax, 1e-4) / 448. The arithmetic is the CPU backend's
// (cpu_moe_ops.cc), so the records are bit-identical to it: the group's amax, the scale by
// one IEEE division, each value divided by it (IEEE, not the fast reciprocal) and rounded to
// the nearest e4m3fn value, ties to even, saturating at +-448.
//
// Quantization: a warp per (row, 128-value group), 4 values a lane (fp8_quantize.cuh, the
// same arithmetic as the FP8 GEMMs' activation passes), 8 warps a block; a partial last group
// reads zeros past the row, as the CPU's amax does. Dequantization: a thread per 4 values.
// Both are a single pass over the rows, bound by memory, for a decode step's few rows as for a
// prefill's thousands.
#include <cuda_fp8.h>

#include "kernels/cuda/elem_type.cuh"
#include "kernels/cuda/fp8_quantize.cuh"
#include "kernels/cuda/launch.cuh"
#include "kernels/cuda/ops.cuh"

namespace dxs::cuda {
namespace {

constexpr int kGroup = kFp8GroupValues;  // kFp8GroupSize (kernels/moe_compute.h)

__host__ __device__ inline int64_t Groups(int64_t hidden) { return (hidden + kGroup - 1) / kGroup; }
__host__ __device__ inline int64_t RecordBytes(int64_t hidden) {
  return 4 * Groups(hidden) + hidden;
}

constexpr int kQuantizeWarps = 8;        // a warp per (row, group)
constexpr int kDequantizeThreads = 256;  // a thread per 4 values

template <typename T>
__global__ void QuantizeRowsFp8Kernel(const T* src, const int32_t* rows, int64_t n,
                                      int64_t src_rows, int hidden, uint8_t* records) {
  PdlWait();
  const int64_t groups = Groups(hidden);
  const int64_t unit = static_cast<int64_t>(blockIdx.x) * kQuantizeWarps + threadIdx.x / 32;
  if (unit >= n * groups) return;
  const int64_t i = unit / groups;
  const int g = static_cast<int>(unit % groups);
  const int32_t r = rows[i];
  // A row outside the source (the host checked what it could): its record stays as it was.
  // The whole warp leaves together (one row), so the group's shuffles see every lane.
  if (r < 0 || r >= src_rows) return;
  const int lane = static_cast<int>(threadIdx.x % 32);
  const int j = g * kGroup + lane * kFp8ValuesPerLane;
  const bool inside = j < hidden;  // hidden % 4 == 0: a lane's 4 values are all in or all out
  float v[kFp8ValuesPerLane];
#pragma unroll
  for (int k = 0; k < kFp8ValuesPerLane; ++k) {
    v[k] = inside ? ToFloat(src[static_cast<int64_t>(r) * hidden + j + k]) : 0.f;
  }
  uint32_t packed;
  const float scale = QuantizeGroupOfWarp(v, &packed);
  uint8_t* record = records + i * RecordBytes(hidden);
  if (lane == 0) reinterpret_cast<float*>(record)[g] = scale;
  // 4-byte aligned: records are 4 * groups + hidden bytes, hidden % 4 == 0.
  if (inside) *reinterpret_cast<uint32_t*>(record + 4 * groups + j) = packed;
}

template <typename T>
__global__ void DequantizeRowsFp8Kernel(const uint8_t* records, int64_t n, int hidden, T* dst) {
  PdlWait();
  const int64_t quads = hidden / 4;
  const int64_t q = static_cast<int64_t>(blockIdx.x) * kDequantizeThreads + threadIdx.x;
  if (q >= n * quads) return;
  const int64_t i = q / quads;
  const int j = static_cast<int>(q % quads) * 4;
  const uint8_t* record = records + i * RecordBytes(hidden);
  const float scale = reinterpret_cast<const float*>(record)[j / kGroup];
  const uint32_t packed = *reinterpret_cast<const uint32_t*>(record + 4 * Groups(hidden) + j);
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    const __half_raw h = __nv_cvt_fp8_to_halfraw(
        static_cast<__nv_fp8_storage_t>((packed >> (8 * k)) & 0xFFu), __NV_E4M3);
    dst[i * hidden + j + k] = FromFloat<T>(__half2float(__half(h)) * scale);
  }
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
  const int64_t blocks = (n * Groups(hidden) + kQuantizeWarps - 1) / kQuantizeWarps;
  if (blocks > INT32_MAX) return cudaErrorInvalidValue;
  return DispatchFloat(src_type, [&](auto tag) {
    using T = typename decltype(tag)::type;
    LaunchKernel(QuantizeRowsFp8Kernel<T>, dim3(static_cast<unsigned>(blocks)), kQuantizeWarps * 32,
                 0, stream, static_cast<const T*>(src), rows, n, src_rows, static_cast<int>(hidden),
                 static_cast<uint8_t*>(records));
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
  const int64_t blocks = (n * (hidden / 4) + kDequantizeThreads - 1) / kDequantizeThreads;
  if (blocks > INT32_MAX) return cudaErrorInvalidValue;
  return DispatchFloat(dst_type, [&](auto tag) {
    using T = typename decltype(tag)::type;
    LaunchKernel(DequantizeRowsFp8Kernel<T>, dim3(static_cast<unsigned>(blocks)),
                 kDequantizeThreads, 0, stream, static_cast<const uint8_t*>(records), n,
                 static_cast<int>(hidden), static_cast<T*>(dst));
    return cudaGetLastError();
  });
}

}  // namespace dxs::cuda
