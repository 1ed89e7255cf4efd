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
// Quantization is the FP8 records' (fp8_rows.cu, fp8_quantize.cuh): scale max(amax, 1e-4) /
// 448 by one IEEE division, values divided by it (rounded as IEEE division rounds) and rounded
// to e4m3, nearest even, saturating. A warp per row, 8 a block, half a warp per 128-channel
// group (fp8_quantize.cuh's QuantizeGroupOfHalfWarp); a row's expert is found by a binary
// search of the offsets. Rows past offsets[E] (a counted round's unused capacity) are not
// written.
#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include <climits>
#include <cstdint>

#include "kernels/cuda/elem_type.cuh"
#include "kernels/cuda/fp8_quantize.cuh"
#include "kernels/cuda/launch.cuh"
#include "kernels/cuda/ops.cuh"
#include "kernels/cuda/row_norm.cuh"

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

constexpr int kQuantizeWarps = 8;                   // a warp per row, 8 rows a block
constexpr int kLaneValues = kFp8ValuesPerHalfLane;  // 16 lanes a group, 2 groups a warp step
// Warp steps whose loads are in flight together. Two, not four: four held 80 and 91 registers
// a thread (the input and silu passes), two hold 48 and 56, and the SM's extra warps keep
// more loads in flight than the deeper steps did (H100, 16384 tokens: 352 -> 270 us and
// 344 -> 218 us, docs/results/fp8.md).
constexpr int kQuantizeSteps = 2;

// One row quantized by one warp (QuantizeGroupOfHalfWarp: 2 groups a step, kQuantizeSteps
// steps' loads issued before any is used, so a warp keeps 1 KiB of bf16 in flight): e4m3 into
// out_row, each group's scale into the row's expert's M-major block. load(col, v) widens the
// row's 8 values from column col. The row's expert is found once; a row past offsets[E]
// writes nothing. Why a row a warp: a warp per (row, group), each waiting on its own binary
// search and 256 bytes, moved the 16384-token FFN's input at about a quarter of the copy rate.
template <typename LoadOf>
__device__ __forceinline__ void QuantizeRowOfWarp(int64_t row, int k, const int32_t* offsets,
                                                  int num_experts, uint8_t* out_row, float* sfa,
                                                  LoadOf load) {
  const int expert = ExpertOfRow(offsets, num_experts, row);
  if (expert < 0) return;  // the whole warp: one row
  const int lane = static_cast<int>(threadIdx.x % 32), half = lane / 16;
  const int groups = k / kGroup;
  const int64_t begin = offsets[expert], count = offsets[expert + 1] - begin;
  float* scales = sfa + begin * groups + (row - begin);  // group g's at scales[g * count]
  for (int g0 = 0; g0 < groups; g0 += 2 * kQuantizeSteps) {
    float v[kQuantizeSteps][kLaneValues];
#pragma unroll
    for (int s = 0; s < kQuantizeSteps; ++s) {
      const int g = g0 + 2 * s + half;
      if (g < groups) {
        load(g * kGroup + (lane % 16) * kLaneValues, v[s]);
      } else {
#pragma unroll
        for (int i = 0; i < kLaneValues; ++i) v[s][i] = 0.f;
      }
    }
#pragma unroll
    for (int s = 0; s < kQuantizeSteps; ++s) {
      const int g = g0 + 2 * s + half;
      if (g0 + 2 * s >= groups) break;  // uniform: the step's first group is past the row
      uint2 packed;
      const float scale = QuantizeGroupOfHalfWarp(v[s], &packed);
      if (g < groups) {
        *reinterpret_cast<uint2*>(out_row + g * kGroup + (lane % 16) * kLaneValues) = packed;
        if (lane % 16 == 0) scales[g * count] = scale;
      }
    }
  }
}

// 8 values of T from p: one or two 16-byte loads where p is aligned (kVec), else one at a time.
template <typename T, bool kVec>
__device__ __forceinline__ void LoadValues(const T* p, float (&v)[kLaneValues]) {
  if constexpr (kVec) {
    row_norm::LoadFloats<T, kLaneValues>(p, v);
  } else {
#pragma unroll
    for (int i = 0; i < kLaneValues; ++i) v[i] = ToFloat(p[i]);
  }
}

template <typename T, bool kVec>
__global__ void QuantizeGroupedFp8Kernel(const T* xs, const int32_t* rows, int64_t x_rows, int k,
                                         int64_t num_rows, const int32_t* offsets, int num_experts,
                                         uint8_t* out, float* sfa) {
  PdlWait();
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kQuantizeWarps + threadIdx.x / 32;
  if (row >= num_rows) return;
  const int64_t src = rows != nullptr ? rows[row] : row;
  const bool inside = src >= 0 && src < x_rows;
  const T* x = xs + (inside ? src : 0) * k;
  QuantizeRowOfWarp(row, k, offsets, num_experts, out + row * k, sfa,
                    [&](int col, float(&v)[kLaneValues]) {
                      if (inside) {
                        LoadValues<T, kVec>(x + col, v);
                      } else {
#pragma unroll
                        for (int i = 0; i < kLaneValues; ++i) v[i] = 0.f;
                      }
                    });
}

template <bool kVec>
__global__ void SiluMulQuantizeGroupedFp8Kernel(const __nv_bfloat16* gu, int inter,
                                                int64_t num_rows, const int32_t* offsets,
                                                int num_experts, uint8_t* out, float* sfa) {
  PdlWait();
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kQuantizeWarps + threadIdx.x / 32;
  if (row >= num_rows) return;
  const __nv_bfloat16* g = gu + row * 2 * inter;
  QuantizeRowOfWarp(
      row, inter, offsets, num_experts, out + row * inter, sfa,
      [&](int col, float(&v)[kLaneValues]) {
        float gate[kLaneValues], up[kLaneValues];
        LoadValues<__nv_bfloat16, kVec>(g + col, gate);
        LoadValues<__nv_bfloat16, kVec>(g + inter + col, up);
#pragma unroll
        for (int i = 0; i < kLaneValues; ++i) {
          v[i] = __bfloat162float(__float2bfloat16(gate[i] / (1.f + expf(-gate[i])) * up[i]));
        }
      });
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
      k > INT32_MAX || num_rows / kQuantizeWarps >= INT32_MAX || num_experts <= 0 ||
      num_experts > INT32_MAX) {
    return cudaErrorInvalidValue;
  }
  if (num_rows == 0) return cudaSuccess;
  if (xs == nullptr || offsets == nullptr || out == nullptr || sfa == nullptr) {
    return cudaErrorInvalidValue;
  }
  const unsigned blocks = static_cast<unsigned>((num_rows + kQuantizeWarps - 1) / kQuantizeWarps);
  const bool vec = Aligned16(xs) && reinterpret_cast<uintptr_t>(out) % 8 == 0;
  return DispatchFloat(x_type, [&](auto tag) {
    using T = typename decltype(tag)::type;
    const T* x = static_cast<const T*>(xs);
    if (vec) {
      return LaunchKernel(QuantizeGroupedFp8Kernel<T, true>, blocks, kQuantizeWarps * 32, 0, stream,
                          x, rows, x_rows, static_cast<int>(k), num_rows, offsets,
                          static_cast<int>(num_experts), out, sfa);
    }
    return LaunchKernel(QuantizeGroupedFp8Kernel<T, false>, blocks, kQuantizeWarps * 32, 0, stream,
                        x, rows, x_rows, static_cast<int>(k), num_rows, offsets,
                        static_cast<int>(num_experts), out, sfa);
  });
}

cudaError_t LaunchSiluMulQuantizeGroupedFp8(const void* gate_up, int64_t num_rows, int64_t inter,
                                            const int32_t* offsets, int64_t num_experts,
                                            uint8_t* out, float* sfa, cudaStream_t stream) {
  if (num_rows < 0 || num_rows > INT32_MAX || inter <= 0 || inter % kGroup != 0 ||
      inter > INT32_MAX / 2 || num_rows / kQuantizeWarps >= INT32_MAX || num_experts <= 0 ||
      num_experts > INT32_MAX) {
    return cudaErrorInvalidValue;
  }
  if (num_rows == 0) return cudaSuccess;
  if (gate_up == nullptr || offsets == nullptr || out == nullptr || sfa == nullptr) {
    return cudaErrorInvalidValue;
  }
  const unsigned blocks = static_cast<unsigned>((num_rows + kQuantizeWarps - 1) / kQuantizeWarps);
  const bool vec = Aligned16(gate_up) && reinterpret_cast<uintptr_t>(out) % 8 == 0;
  const auto* gu = static_cast<const __nv_bfloat16*>(gate_up);
  if (vec) {
    return LaunchKernel(SiluMulQuantizeGroupedFp8Kernel<true>, blocks, kQuantizeWarps * 32, 0,
                        stream, gu, static_cast<int>(inter), num_rows, offsets,
                        static_cast<int>(num_experts), out, sfa);
  }
  return LaunchKernel(SiluMulQuantizeGroupedFp8Kernel<false>, blocks, kQuantizeWarps * 32, 0,
                      stream, gu, static_cast<int>(inter), num_rows, offsets,
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
