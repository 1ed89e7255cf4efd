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
// division, values divided by it and rounded to e4m3, nearest even, saturating. A warp per
// (row, 128-channel group) (fp8_quantize.cuh), 8 a block; a row's expert is found by a
// binary search of the offsets. Rows past offsets[E] (a counted round's unused capacity) are
// not written.
#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include <climits>
#include <cstdint>

#include "kernels/cuda/elem_type.cuh"
#include "kernels/cuda/fp8_quantize.cuh"
#include "kernels/cuda/launch.cuh"
#include "kernels/cuda/ops.cuh"

namespace dxs::cuda {
namespace {

constexpr int kGroup = kFp8GroupValues;

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

constexpr int kQuantizeWarps = 8;  // a warp per (row, 128-channel group)

// The (row, group) this warp quantizes and the row's expert; false past the rows in groups.
struct GroupUnit {
  int64_t row = 0;
  int group = 0;
  int expert = -1;
};
__device__ __forceinline__ bool UnitOfWarp(int64_t num_rows, int groups, const int32_t* offsets,
                                           int num_experts, GroupUnit* u) {
  const int64_t unit = static_cast<int64_t>(blockIdx.x) * kQuantizeWarps + threadIdx.x / 32;
  if (unit >= num_rows * groups) return false;
  u->row = unit / groups;
  u->group = static_cast<int>(unit % groups);
  u->expert = ExpertOfRow(offsets, num_experts, u->row);
  return u->expert >= 0;
}

// Where expert e's block puts the scale of (row, group): M-major from offsets[e] * groups on.
__device__ __forceinline__ float* ScaleOf(float* sfa, const int32_t* offsets, const GroupUnit& u,
                                          int groups) {
  const int64_t begin = offsets[u.expert], count = offsets[u.expert + 1] - begin;
  return sfa + begin * groups + u.group * count + (u.row - begin);
}

template <typename T>
__global__ void QuantizeGroupedFp8Kernel(const T* xs, const int32_t* rows, int64_t x_rows, int k,
                                         int64_t num_rows, const int32_t* offsets, int num_experts,
                                         uint8_t* out, float* sfa) {
  PdlWait();
  const int groups = k / kGroup;
  GroupUnit u;
  if (!UnitOfWarp(num_rows, groups, offsets, num_experts, &u)) return;
  const int lane = static_cast<int>(threadIdx.x % 32);
  const int64_t src = rows != nullptr ? rows[u.row] : u.row;
  const int64_t j = static_cast<int64_t>(u.group) * kGroup + lane * kFp8ValuesPerLane;
  float v[kFp8ValuesPerLane];
#pragma unroll
  for (int i = 0; i < kFp8ValuesPerLane; ++i) {
    v[i] = src >= 0 && src < x_rows ? ToFloat(xs[src * k + j + i]) : 0.f;
  }
  const float scale = QuantizeGroupOfWarp(v, reinterpret_cast<uint32_t*>(out + u.row * k + j));
  if (lane == 0) *ScaleOf(sfa, offsets, u, groups) = scale;
}

__global__ void SiluMulQuantizeGroupedFp8Kernel(const __nv_bfloat16* gu, int inter,
                                                int64_t num_rows, const int32_t* offsets,
                                                int num_experts, uint8_t* out, float* sfa) {
  PdlWait();
  const int groups = inter / kGroup;
  GroupUnit u;
  if (!UnitOfWarp(num_rows, groups, offsets, num_experts, &u)) return;
  const int lane = static_cast<int>(threadIdx.x % 32);
  const int64_t j = static_cast<int64_t>(u.group) * kGroup + lane * kFp8ValuesPerLane;
  const __nv_bfloat16* g = gu + u.row * 2 * inter + j;
  float v[kFp8ValuesPerLane];
#pragma unroll
  for (int i = 0; i < kFp8ValuesPerLane; ++i) {
    const float gate = __bfloat162float(g[i]), up = __bfloat162float(g[inter + i]);
    v[i] = __bfloat162float(__float2bfloat16(gate / (1.f + expf(-gate)) * up));
  }
  const float scale = QuantizeGroupOfWarp(v, reinterpret_cast<uint32_t*>(out + u.row * inter + j));
  if (lane == 0) *ScaleOf(sfa, offsets, u, groups) = scale;
}

__global__ void TransposeBlockScalesKernel(const float* src, int64_t n_blocks, int64_t k_blocks,
                                           int64_t stride, float* dst) {
  PdlWait();
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n_blocks * k_blocks) return;
  const int64_t kb = i / n_blocks, nb = i % n_blocks;
  dst[i] = src[nb * stride + kb];
}

__global__ void WriteOneGroupKernel(int32_t* offsets, int32_t rows) {
  PdlWait();
  if (threadIdx.x == 0) {
    offsets[0] = 0;
    offsets[1] = rows;
  }
}

}  // namespace

cudaError_t LaunchWriteOneGroup(int32_t* offsets, int64_t rows, cudaStream_t stream) {
  if (offsets == nullptr || rows < 0 || rows > INT32_MAX) return cudaErrorInvalidValue;
  return LaunchKernel(WriteOneGroupKernel, 1, 32, 0, stream, offsets, static_cast<int32_t>(rows));
}

cudaError_t LaunchQuantizeGroupedFp8(const void* xs, ElemType x_type, int64_t x_rows,
                                     const int32_t* rows, int64_t num_rows, int64_t k,
                                     const int32_t* offsets, int64_t num_experts, uint8_t* out,
                                     float* sfa, cudaStream_t stream) {
  if (num_rows < 0 || num_rows > INT32_MAX || x_rows < 0 || k <= 0 || k % kGroup != 0 ||
      k > INT32_MAX || num_rows * (k / kGroup) / kQuantizeWarps >= INT32_MAX || num_experts <= 0 ||
      num_experts > INT32_MAX) {
    return cudaErrorInvalidValue;
  }
  if (num_rows == 0) return cudaSuccess;
  if (xs == nullptr || offsets == nullptr || out == nullptr || sfa == nullptr) {
    return cudaErrorInvalidValue;
  }
  const unsigned blocks =
      static_cast<unsigned>((num_rows * (k / kGroup) + kQuantizeWarps - 1) / kQuantizeWarps);
  return DispatchFloat(x_type, [&](auto tag) {
    using T = typename decltype(tag)::type;
    return LaunchKernel(QuantizeGroupedFp8Kernel<T>, blocks, kQuantizeWarps * 32, 0, stream,
                        static_cast<const T*>(xs), rows, x_rows, static_cast<int>(k), num_rows,
                        offsets, static_cast<int>(num_experts), out, sfa);
  });
}

cudaError_t LaunchSiluMulQuantizeGroupedFp8(const void* gate_up, int64_t num_rows, int64_t inter,
                                            const int32_t* offsets, int64_t num_experts,
                                            uint8_t* out, float* sfa, cudaStream_t stream) {
  if (num_rows < 0 || num_rows > INT32_MAX || inter <= 0 || inter % kGroup != 0 ||
      inter > INT32_MAX / 2 || num_rows * (inter / kGroup) / kQuantizeWarps >= INT32_MAX ||
      num_experts <= 0 || num_experts > INT32_MAX) {
    return cudaErrorInvalidValue;
  }
  if (num_rows == 0) return cudaSuccess;
  if (gate_up == nullptr || offsets == nullptr || out == nullptr || sfa == nullptr) {
    return cudaErrorInvalidValue;
  }
  const unsigned blocks =
      static_cast<unsigned>((num_rows * (inter / kGroup) + kQuantizeWarps - 1) / kQuantizeWarps);
  return LaunchKernel(SiluMulQuantizeGroupedFp8Kernel, blocks, kQuantizeWarps * 32, 0, stream,
                      static_cast<const __nv_bfloat16*>(gate_up), static_cast<int>(inter), num_rows,
                      offsets, static_cast<int>(num_experts), out, sfa);
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
