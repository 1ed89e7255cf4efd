// Dense CUDA kernels of kernels/cuda/ops.cuh: conversion, fill, RMS norm, embedding, rope,
// SiLU-mul, add and row gathers. The CPU backend (kernels/cpu_backend.cc) is the reference:
// each kernel follows its arithmetic in f32 and rounds once on the store.
//
// Layouts:
// - Elementwise ops (Convert, Fill, SiluMul, Add) are grid-stride loops, one element per
//   thread per step. Outputs may alias inputs element for element (in-place use): every
//   element is read and then written by one thread, so no pointer is __restrict__.
// - RmsNorm: a warp per row up to kWarpRowMaxCols columns (Qwen3's per-head q/k norms of
//   128), else a block per row (hidden rows of 2048). Two passes over the row: the sum of
//   squares, reduced in a fixed tree, then the scaled store (the row is in L1 by then).
// - Rope: one thread per (token, head, i < head_dim / 2), rotating the pair (i, i + half).
//   inv_freq is computed on the host with the CPU backend's expression and passed by value,
//   so both backends use the same bits.
// - GatherRows / Embedding: a warp per row; 16-byte copies when the types are equal and the
//   rows are 16-byte aligned, else converting element by element; rows narrower than a
//   warp are gathered one element per thread.
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <cstring>

#include "kernels/cuda/elem_type.cuh"
#include "kernels/cuda/ops.cuh"

namespace dxs::cuda {
namespace {

constexpr int kThreads = 256;  // elementwise and row kernels
constexpr int kWarpSize = 32;
constexpr int kWarpsPerBlock = kThreads / kWarpSize;
constexpr unsigned kFullMask = 0xffffffffu;
constexpr int64_t kWarpRowMaxCols = 1024;
constexpr int64_t kRopeMaxHeadDim = 512;

__device__ __forceinline__ int64_t GlobalThread() {
  return static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
}
__device__ __forceinline__ int64_t GridThreads() {
  return static_cast<int64_t>(gridDim.x) * blockDim.x;
}

// The same value in every lane: a butterfly of commutative adds, fixed order.
__device__ __forceinline__ float WarpSum(float v) {
#pragma unroll
  for (int offset = kWarpSize / 2; offset > 0; offset /= 2) {
    v += __shfl_xor_sync(kFullMask, v, offset);
  }
  return v;
}

// ---- Convert, Fill ----

template <typename Src, typename Dst>
__global__ void ConvertKernel(const Src* src, Dst* dst, int64_t n) {
  for (int64_t i = GlobalThread(); i < n; i += GridThreads()) {
    dst[i] = ConvertElem<Src, Dst>(src[i]);
  }
}

template <typename T>
__global__ void FillKernel(T* __restrict__ dst, int64_t n, float value) {
  const T v = FromFloat<T>(value);
  for (int64_t i = GlobalThread(); i < n; i += GridThreads()) dst[i] = v;
}

// ---- RmsNorm ----

// y = w * (x * inv), the CPU backend's order of operations.
template <typename X, typename W, typename Y>
__device__ __forceinline__ void StoreNormalized(const X* in, const W* w, Y* out, int64_t i,
                                                float inv) {
  out[i] = FromFloat<Y>(ToFloat(w[i]) * (ToFloat(in[i]) * inv));
}

__device__ __forceinline__ float InvRms(float sum_sq, int64_t cols, float eps) {
  return 1.f / sqrtf(sum_sq / static_cast<float>(cols) + eps);
}

// x and y may be the same rows: every element is read and then written by one thread, after
// the row's sum is complete.
template <typename X, typename W, typename Y>
__global__ void __launch_bounds__(kThreads)
    RmsNormWarpKernel(const X* x, const W* __restrict__ w, float eps, int64_t rows, int cols,
                      Y* y) {
  const int lane = threadIdx.x % kWarpSize;
  const int64_t num_warps = static_cast<int64_t>(gridDim.x) * kWarpsPerBlock;
  for (int64_t row = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + threadIdx.x / kWarpSize;
       row < rows; row += num_warps) {  // uniform across the warp
    const X* in = x + row * cols;
    Y* out = y + row * cols;
    float sum_sq = 0.f;
    for (int i = lane; i < cols; i += kWarpSize) {
      const float v = ToFloat(in[i]);
      sum_sq += v * v;
    }
    const float inv = InvRms(WarpSum(sum_sq), cols, eps);
    for (int i = lane; i < cols; i += kWarpSize) StoreNormalized(in, w, out, i, inv);
  }
}

template <typename X, typename W, typename Y>
__global__ void __launch_bounds__(kThreads)
    RmsNormBlockKernel(const X* x, const W* __restrict__ w, float eps, int64_t rows, int64_t cols,
                       Y* y) {
  __shared__ float warp_sums[kWarpsPerBlock];
  __shared__ float row_inv;
  const int lane = threadIdx.x % kWarpSize, warp = threadIdx.x / kWarpSize;
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    const X* in = x + row * cols;
    Y* out = y + row * cols;
    float sum_sq = 0.f;
    for (int64_t i = threadIdx.x; i < cols; i += kThreads) {
      const float v = ToFloat(in[i]);
      sum_sq += v * v;
    }
    sum_sq = WarpSum(sum_sq);
    if (lane == 0) warp_sums[warp] = sum_sq;
    __syncthreads();
    if (threadIdx.x == 0) {
      float total = 0.f;
      for (int i = 0; i < kWarpsPerBlock; ++i) total += warp_sums[i];
      row_inv = InvRms(total, cols, eps);
    }
    __syncthreads();
    // The next row writes warp_sums and row_inv only after its first barrier, which every
    // thread reaches after reading them here: no third barrier is needed.
    const float inv = row_inv;
    for (int64_t i = threadIdx.x; i < cols; i += kThreads) StoreNormalized(in, w, out, i, inv);
  }
}

// ---- Rope ----

struct RopeInvFreq {
  float v[kRopeMaxHeadDim / 2];
};

template <typename T>
__global__ void RopeKernel(T* __restrict__ x, const int32_t* __restrict__ positions, int64_t tokens,
                           int64_t heads, int64_t half, int64_t head_dim, RopeInvFreq inv_freq) {
  const int64_t total = tokens * heads * half;
  for (int64_t idx = GlobalThread(); idx < total; idx += GridThreads()) {
    const int64_t i = idx % half, token_head = idx / half, token = token_head / heads;
    T* v = x + token_head * head_dim;
    const float angle = static_cast<float>(positions[token]) * inv_freq.v[i];
    float sin_v, cos_v;
    sincosf(angle, &sin_v, &cos_v);
    const float a = ToFloat(v[i]), b = ToFloat(v[i + half]);
    v[i] = FromFloat<T>(a * cos_v - b * sin_v);
    v[i + half] = FromFloat<T>(b * cos_v + a * sin_v);
  }
}

// ---- SiluMul, Add ----

template <typename G, typename U, typename O>
__global__ void SiluMulKernel(const G* gate, const U* up, O* out, int64_t n) {
  for (int64_t i = GlobalThread(); i < n; i += GridThreads()) {
    const float g = ToFloat(gate[i]);
    out[i] = FromFloat<O>(g / (1.f + expf(-g)) * ToFloat(up[i]));
  }
}

// out[r, j] = silu(gu[r, j]) * gu[r, inter + j]: the grouped FFN's gate_up rows, gate half
// first. kVec consecutive elements a thread (16-byte loads and stores of bf16 when inter
// allows), so the pass runs at copy speed.
template <typename T, typename O, int kVec>
__global__ void SiluMulPackedKernel(const T* gu, O* out, int64_t rows, int64_t inter) {
  const int64_t chunks = inter / kVec, total = rows * chunks;
  for (int64_t idx = GlobalThread(); idx < total; idx += GridThreads()) {
    const int64_t r = idx / chunks, j = (idx - r * chunks) * kVec;
    const T* g = gu + r * 2 * inter + j;
    struct alignas(sizeof(T) * kVec) InVec {
      T v[kVec];
    };
    struct alignas(sizeof(O) * kVec) OutVec {
      O v[kVec];
    };
    const InVec gv = *reinterpret_cast<const InVec*>(g);
    const InVec uv = *reinterpret_cast<const InVec*>(g + inter);
    OutVec ov;
#pragma unroll
    for (int i = 0; i < kVec; ++i) {
      const float a = ToFloat(gv.v[i]);
      ov.v[i] = FromFloat<O>(a / (1.f + expf(-a)) * ToFloat(uv.v[i]));
    }
    *reinterpret_cast<OutVec*>(out + r * inter + j) = ov;
  }
}

template <typename X, typename Y>
__global__ void AddKernel(const X* x, Y* inout, int64_t n) {
  for (int64_t i = GlobalThread(); i < n; i += GridThreads()) {
    inout[i] = FromFloat<Y>(ToFloat(inout[i]) + ToFloat(x[i]));
  }
}

// ---- GatherRows ----

__device__ __forceinline__ bool RowInRange(int32_t r, int64_t src_rows) {
  return r >= 0 && r < src_rows;
}

// Equal types, rows of `units` 16-byte units: a warp per row.
__global__ void __launch_bounds__(kThreads)
    GatherRowsVecKernel(const uint4* __restrict__ src, int64_t src_rows,
                        const int32_t* __restrict__ rows, int64_t n, int64_t units,
                        uint4* __restrict__ dst) {
  const int lane = threadIdx.x % kWarpSize;
  const int64_t num_warps = static_cast<int64_t>(gridDim.x) * kWarpsPerBlock;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + threadIdx.x / kWarpSize;
       i < n; i += num_warps) {
    const int32_t r = rows[i];
    uint4* out = dst + i * units;
    if (!RowInRange(r, src_rows)) {
      for (int64_t u = lane; u < units; u += kWarpSize) out[u] = make_uint4(0, 0, 0, 0);
      continue;
    }
    const uint4* in = src + static_cast<int64_t>(r) * units;
    for (int64_t u = lane; u < units; u += kWarpSize) out[u] = in[u];
  }
}

// Any allowed pair of types: a warp per row, element by element.
template <typename Src, typename Dst>
__global__ void __launch_bounds__(kThreads)
    GatherRowsWarpKernel(const Src* __restrict__ src, int64_t src_rows,
                         const int32_t* __restrict__ rows, int64_t n, int64_t cols,
                         Dst* __restrict__ dst) {
  const int lane = threadIdx.x % kWarpSize;
  const int64_t num_warps = static_cast<int64_t>(gridDim.x) * kWarpsPerBlock;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + threadIdx.x / kWarpSize;
       i < n; i += num_warps) {
    const int32_t r = rows[i];
    Dst* out = dst + i * cols;
    if (!RowInRange(r, src_rows)) {
      for (int64_t j = lane; j < cols; j += kWarpSize) out[j] = FromFloat<Dst>(0.f);
      continue;
    }
    const Src* in = src + static_cast<int64_t>(r) * cols;
    for (int64_t j = lane; j < cols; j += kWarpSize) out[j] = ConvertElem<Src, Dst>(in[j]);
  }
}

// Rows narrower than a warp (down to the one-element rows of 1-d index tensors).
template <typename Src, typename Dst>
__global__ void GatherRowsFlatKernel(const Src* __restrict__ src, int64_t src_rows,
                                     const int32_t* __restrict__ rows, int64_t n, int64_t cols,
                                     Dst* __restrict__ dst) {
  const int64_t total = n * cols;
  for (int64_t idx = GlobalThread(); idx < total; idx += GridThreads()) {
    const int64_t i = idx / cols, j = idx - i * cols;
    const int32_t r = rows[i];
    dst[idx] = RowInRange(r, src_rows)
                   ? ConvertElem<Src, Dst>(src[static_cast<int64_t>(r) * cols + j])
                   : FromFloat<Dst>(0.f);
  }
}

cudaError_t GatherRowsImpl(const void* src, ElemType src_type, int64_t src_rows,
                           const int32_t* rows, int64_t n, int64_t cols, void* dst,
                           ElemType dst_type, cudaStream_t stream) {
  if (!IsKnown(src_type) || !IsKnown(dst_type) || src_rows < 0 || n < 0 || cols < 0) {
    return cudaErrorInvalidValue;
  }
  if (src_type != dst_type && !(IsFloating(src_type) && IsFloating(dst_type))) {
    return cudaErrorInvalidValue;
  }
  if (n == 0 || cols == 0) return cudaSuccess;
  if (rows == nullptr || dst == nullptr || (src == nullptr && src_rows > 0)) {
    return cudaErrorInvalidValue;
  }
  const size_t row_bytes = static_cast<size_t>(cols) * ElemSize(src_type);
  if (src_type == dst_type && row_bytes % 16 == 0 && Aligned16(src) && Aligned16(dst)) {
    GatherRowsVecKernel<<<GridBlocks(n, kWarpsPerBlock), kThreads, 0, stream>>>(
        static_cast<const uint4*>(src), src_rows, rows, n, static_cast<int64_t>(row_bytes / 16),
        static_cast<uint4*>(dst));
    return cudaGetLastError();
  }
  return DispatchConversion(src_type, dst_type, [&](auto s, auto d) {
    using Src = typename decltype(s)::type;
    using Dst = typename decltype(d)::type;
    const Src* in = static_cast<const Src*>(src);
    Dst* out = static_cast<Dst*>(dst);
    if (cols < kWarpSize) {
      GatherRowsFlatKernel<<<GridBlocks(n * cols, kThreads), kThreads, 0, stream>>>(
          in, src_rows, rows, n, cols, out);
    } else {
      GatherRowsWarpKernel<<<GridBlocks(n, kWarpsPerBlock), kThreads, 0, stream>>>(
          in, src_rows, rows, n, cols, out);
    }
    return cudaGetLastError();
  });
}

}  // namespace

cudaError_t LaunchConvert(const void* src, ElemType src_type, void* dst, ElemType dst_type,
                          int64_t n, cudaStream_t stream) {
  if (!IsKnown(src_type) || !IsKnown(dst_type) || n < 0) return cudaErrorInvalidValue;
  if (src_type != dst_type && !(IsFloating(src_type) && IsFloating(dst_type))) {
    return cudaErrorInvalidValue;
  }
  if (n == 0) return cudaSuccess;
  if (src == nullptr || dst == nullptr) return cudaErrorInvalidValue;
  if (src_type == dst_type) {
    if (src == dst) return cudaSuccess;
    return cudaMemcpyAsync(dst, src, static_cast<size_t>(n) * ElemSize(src_type),
                           cudaMemcpyDeviceToDevice, stream);
  }
  return DispatchConversion(src_type, dst_type, [&](auto s, auto d) {
    using Src = typename decltype(s)::type;
    using Dst = typename decltype(d)::type;
    ConvertKernel<<<GridBlocks(n, kThreads), kThreads, 0, stream>>>(static_cast<const Src*>(src),
                                                                    static_cast<Dst*>(dst), n);
    return cudaGetLastError();
  });
}

cudaError_t LaunchFill(void* dst, ElemType type, int64_t n, float value, cudaStream_t stream) {
  if (!IsKnown(type) || n < 0) return cudaErrorInvalidValue;
  if (n == 0) return cudaSuccess;
  if (dst == nullptr) return cudaErrorInvalidValue;
  if (value == 0.f && !std::signbit(value)) {  // +0 is all-zero bits in every type
    return cudaMemsetAsync(dst, 0, static_cast<size_t>(n) * ElemSize(type), stream);
  }
  const unsigned blocks = GridBlocks(n, kThreads);
  switch (type) {
    case ElemType::kI32:
      FillKernel<<<blocks, kThreads, 0, stream>>>(static_cast<int32_t*>(dst), n, value);
      return cudaGetLastError();
    case ElemType::kI64:
      FillKernel<<<blocks, kThreads, 0, stream>>>(static_cast<int64_t*>(dst), n, value);
      return cudaGetLastError();
    default:
      return DispatchFloat(type, [&](auto t) {
        using T = typename decltype(t)::type;
        FillKernel<<<blocks, kThreads, 0, stream>>>(static_cast<T*>(dst), n, value);
        return cudaGetLastError();
      });
  }
}

cudaError_t LaunchRmsNorm(const void* x, ElemType x_type, const void* weight, ElemType w_type,
                          float eps, int64_t rows, int64_t cols, void* y, ElemType y_type,
                          cudaStream_t stream) {
  if (!IsFloating(x_type) || !IsFloating(w_type) || !IsFloating(y_type) || rows < 0 || cols <= 0 ||
      cols > INT32_MAX) {
    return cudaErrorInvalidValue;
  }
  if (rows == 0) return cudaSuccess;
  if (x == nullptr || weight == nullptr || y == nullptr) return cudaErrorInvalidValue;
  return DispatchFloat(x_type, [&](auto xt) {
    return DispatchFloat(w_type, [&](auto wt) {
      return DispatchFloat(y_type, [&](auto yt) {
        using X = typename decltype(xt)::type;
        using W = typename decltype(wt)::type;
        using Y = typename decltype(yt)::type;
        const X* in = static_cast<const X*>(x);
        const W* w = static_cast<const W*>(weight);
        Y* out = static_cast<Y*>(y);
        if (cols <= kWarpRowMaxCols) {
          RmsNormWarpKernel<<<GridBlocks(rows, kWarpsPerBlock), kThreads, 0, stream>>>(
              in, w, eps, rows, static_cast<int>(cols), out);
        } else {
          RmsNormBlockKernel<<<GridBlocks(rows, 1), kThreads, 0, stream>>>(in, w, eps, rows, cols,
                                                                           out);
        }
        return cudaGetLastError();
      });
    });
  });
}

cudaError_t LaunchEmbedding(const void* table, ElemType table_type, int64_t table_rows,
                            const int32_t* ids, int64_t n, int64_t cols, void* y, ElemType y_type,
                            cudaStream_t stream) {
  if (!IsFloating(table_type) || !IsFloating(y_type)) return cudaErrorInvalidValue;
  return GatherRowsImpl(table, table_type, table_rows, ids, n, cols, y, y_type, stream);
}

cudaError_t LaunchRope(void* x, ElemType type, const int32_t* positions, int64_t tokens,
                       int64_t heads, int64_t head_dim, float theta, cudaStream_t stream) {
  if (!IsFloating(type) || tokens < 0 || heads < 0 || head_dim <= 0 || head_dim > kRopeMaxHeadDim) {
    return cudaErrorInvalidValue;
  }
  const int64_t half = head_dim / 2;
  if (tokens == 0 || heads == 0 || half == 0) return cudaSuccess;
  if (x == nullptr || positions == nullptr) return cudaErrorInvalidValue;
  // The CPU backend's expression (kernels/cpu_backend.cc), evaluated on the host.
  RopeInvFreq inv_freq{};
  for (int64_t i = 0; i < half; ++i) {
    inv_freq.v[i] = 1.f / std::pow(theta, static_cast<float>(2 * i) / static_cast<float>(head_dim));
  }
  return DispatchFloat(type, [&](auto t) {
    using T = typename decltype(t)::type;
    RopeKernel<<<GridBlocks(tokens * heads * half, kThreads), kThreads, 0, stream>>>(
        static_cast<T*>(x), positions, tokens, heads, half, head_dim, inv_freq);
    return cudaGetLastError();
  });
}

cudaError_t LaunchSiluMul(const void* gate, ElemType gate_type, const void* up, ElemType up_type,
                          void* out, ElemType out_type, int64_t n, cudaStream_t stream) {
  if (!IsFloating(gate_type) || !IsFloating(up_type) || !IsFloating(out_type) || n < 0) {
    return cudaErrorInvalidValue;
  }
  if (n == 0) return cudaSuccess;
  if (gate == nullptr || up == nullptr || out == nullptr) return cudaErrorInvalidValue;
  return DispatchFloat(gate_type, [&](auto gt) {
    return DispatchFloat(up_type, [&](auto ut) {
      return DispatchFloat(out_type, [&](auto ot) {
        using G = typename decltype(gt)::type;
        using U = typename decltype(ut)::type;
        using O = typename decltype(ot)::type;
        SiluMulKernel<<<GridBlocks(n, kThreads), kThreads, 0, stream>>>(
            static_cast<const G*>(gate), static_cast<const U*>(up), static_cast<O*>(out), n);
        return cudaGetLastError();
      });
    });
  });
}

cudaError_t LaunchSiluMulPacked(const void* gate_up, ElemType in_type, int64_t rows, int64_t inter,
                                void* out, ElemType out_type, cudaStream_t stream) {
  if (!IsFloating(in_type) || !IsFloating(out_type) || rows < 0 || inter < 0) {
    return cudaErrorInvalidValue;
  }
  if (rows == 0 || inter == 0) return cudaSuccess;
  if (gate_up == nullptr || out == nullptr) return cudaErrorInvalidValue;
  return DispatchFloat(in_type, [&](auto it) {
    return DispatchFloat(out_type, [&](auto ot) {
      using T = typename decltype(it)::type;
      using O = typename decltype(ot)::type;
      const auto* in = static_cast<const T*>(gate_up);
      auto* o = static_cast<O*>(out);
      const bool aligned =
          reinterpret_cast<uintptr_t>(in) % 16 == 0 && reinterpret_cast<uintptr_t>(o) % 16 == 0;
      if (sizeof(T) == 2 && sizeof(O) == 2 && inter % 8 == 0 && aligned) {
        SiluMulPackedKernel<T, O, 8>
            <<<GridBlocks(rows * inter / 8, kThreads), kThreads, 0, stream>>>(in, o, rows, inter);
      } else {
        SiluMulPackedKernel<T, O, 1>
            <<<GridBlocks(rows * inter, kThreads), kThreads, 0, stream>>>(in, o, rows, inter);
      }
      return cudaGetLastError();
    });
  });
}

cudaError_t LaunchAdd(const void* x, ElemType x_type, void* inout, ElemType inout_type, int64_t n,
                      cudaStream_t stream) {
  if (!IsFloating(x_type) || !IsFloating(inout_type) || n < 0) return cudaErrorInvalidValue;
  if (n == 0) return cudaSuccess;
  if (x == nullptr || inout == nullptr) return cudaErrorInvalidValue;
  return DispatchFloat(x_type, [&](auto xt) {
    return DispatchFloat(inout_type, [&](auto yt) {
      using X = typename decltype(xt)::type;
      using Y = typename decltype(yt)::type;
      AddKernel<<<GridBlocks(n, kThreads), kThreads, 0, stream>>>(static_cast<const X*>(x),
                                                                  static_cast<Y*>(inout), n);
      return cudaGetLastError();
    });
  });
}

cudaError_t LaunchGatherRows(const void* src, ElemType src_type, int64_t src_rows,
                             const int32_t* rows, int64_t n, int64_t cols, void* dst,
                             ElemType dst_type, cudaStream_t stream) {
  return GatherRowsImpl(src, src_type, src_rows, rows, n, cols, dst, dst_type, stream);
}

}  // namespace dxs::cuda
