// Dense CUDA kernels of kernels/cuda/ops.cuh: conversion, fill, RMS norm, embedding, rope,
// SiLU-mul, add and row gathers. The CPU backend (kernels/cpu_backend.cc) is the reference:
// each kernel follows its arithmetic in f32 and rounds once on the store.
//
// Layouts:
// - Elementwise ops (Convert, Fill, SiluMul, Add) are grid-stride loops, one element per
//   thread per step. Outputs may alias inputs element for element (in-place use): every
//   element is read and then written by one thread, so no pointer is __restrict__.
// - RmsNorm: a warp per row up to kWarpRowMaxCols columns, else a block per row (hidden rows
//   of 2048), 16-byte loads where the rows allow. Two passes over the row: the sum of
//   squares, reduced in a fixed tree, then the scaled store (the row is in L1 by then).
//   AddRmsNorm is the block kernel with the residual add in its first pass.
// - Rope and QkNormRope: one kernel, a group of lanes per (token, head) row, each lane
//   rotating its own pairs (i, i + half) from 16-byte loads of both halves; QkNormRope first
//   normalises the row (its sum of squares reduced over the group by shuffles). q's and k's
//   heads are rows of one launch. inv_freq is computed on the host with the CPU backend's
//   expression and staged in shared memory, so both backends use the same bits.
// - GatherRows / Embedding: a warp per row; 16-byte copies when the types are equal and the
//   rows are 16-byte aligned, else converting element by element; rows narrower than a
//   warp are gathered one element per thread.
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <cstring>

#include "kernels/cuda/elem_type.cuh"
#include "kernels/cuda/launch.cuh"
#include "kernels/cuda/ops.cuh"
#include "kernels/cuda/row_norm.cuh"

namespace dxs::cuda {
namespace {

constexpr int kThreads = 256;  // elementwise and row kernels
constexpr int kWarpSize = 32;
constexpr int kWarpsPerBlock = kThreads / kWarpSize;
constexpr unsigned kFullMask = 0xffffffffu;
constexpr int64_t kWarpRowMaxCols = 1024;
constexpr int64_t kRopeMaxHeadDim = 512;
constexpr int kNormVec = 8;  // the block norms' columns per thread step (16 bytes of bf16)

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
  PdlWait();
  for (int64_t i = GlobalThread(); i < n; i += GridThreads()) {
    dst[i] = ConvertElem<Src, Dst>(src[i]);
  }
}

template <typename T>
__global__ void FillKernel(T* __restrict__ dst, int64_t n, float value) {
  PdlWait();
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

using row_norm::InvRms;

// x and y may be the same rows: every element is read and then written by one thread, after
// the row's sum is complete.
template <typename X, typename W, typename Y>
__global__ void __launch_bounds__(kThreads)
    RmsNormWarpKernel(const X* x, const W* __restrict__ w, float eps, int64_t rows, int cols,
                      Y* y) {
  PdlWait();
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

// ---- Vector access (row_norm.cuh) ----

using row_norm::LoadFloats;
using row_norm::StoreFloats;

// ---- Residual add + RmsNorm ----

// A block per row, kVec consecutive columns a thread per step: with kAdd, residual += x and
// the norm is of the new residual row (written back in float32); else the norm is of x.
// Two passes: the sum of squares (reduced in a fixed tree), then the scaled store, reading
// back the row the same thread wrote (or read). y may be x (every element is read and then
// written by one thread, after the row's sum is complete).
template <typename X, typename W, typename Y, int kVec, bool kAdd>
__global__ void __launch_bounds__(kThreads)
    ResidualNormKernel(const X* x, float* residual, const W* __restrict__ w, float eps,
                       int64_t rows, int64_t cols, Y* y, bool trigger_early) {
  static_assert(kThreads == row_norm::kThreads, "row_norm.cuh's block is this kernel's");
  // pdl-early: only lets the next kernel be scheduled (launch.cuh's PdlTrigger, with
  // DXS_CUDA_NORM_EARLY_TRIGGER=on); only the immutable weight is read before the wait.
  if (trigger_early) PdlTrigger();
  const row_norm::EarlyWeights<kVec> early = row_norm::LoadEarlyWeights<W, kVec>(w, cols);
  PdlWait();
  __shared__ float warp_sums[row_norm::kWarps];
  __shared__ float row_inv;
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    const X* in = x + row * cols;
    float* res = kAdd ? residual + row * cols : nullptr;
    const float inv = row_norm::BlockInvRms(
        row_norm::RowSquares<X, kVec, kAdd, kAdd>(in, res, cols), cols, eps, warp_sums, &row_inv);
    row_norm::StoreNormedRow<X, W, Y, kVec, kAdd>(in, res, w, inv, cols, y + row * cols, &early);
  }
}

// ---- Rope, and the per-head norms with it ----

struct RopeInvFreq {
  float v[kRopeMaxHeadDim / 2];
};

// NormRopeKernel's optional KV cache write (QkNormRope with the KV write): slots set, each
// token's rotated k heads also go to its slot of k_cache, and its v rows (k_heads more rows a
// token, copied as they are) to its slot of v_cache; a negative slot stores nothing. The
// caches have k's type and rows of k_heads * head_dim.
template <typename T>
struct KvCacheWrite {
  const T* v = nullptr;
  T* k_cache = nullptr;
  T* v_cache = nullptr;
  const int64_t* slots = nullptr;
};

// A group of `lanes` lanes (a power of two dividing the warp) per head row of head_dim
// elements, half = head_dim / 2 (an odd last element is left as it is): lane l holds kVec elements
// of each half, the pairs (i, i + half) of i = (c * lanes + l) * kVec + j for c < kChunks, so it
// rotates its own elements. With `norm`, the row is first RMS-normalised (the sum of squares
// reduced over the group) and scaled by its head's weight, kept in float32 for the rotation (the
// unfused pair rounds in between). Rows are q's heads of each token, then k's. inv_freq comes to
// shared memory once a block; every lane of a warp runs the same loop trips (shuffles need them
// all). With cache.slots set, the KV cache write of KvCacheWrite above.
template <typename T, typename W, int kVec, int kChunks>
__global__ void __launch_bounds__(kThreads)
    NormRopeKernel(T* q, T* k, const W* __restrict__ q_w, const W* __restrict__ k_w,
                   const int32_t* __restrict__ positions, int32_t tokens, int32_t q_heads,
                   int32_t k_heads, int32_t head_dim, int lanes, bool norm, float eps,
                   RopeInvFreq inv_freq, KvCacheWrite<T> cache) {
  // pdl-early: this lane's elements of the immutable q and k norm weights, which a row would
  // otherwise load only after its sum (a cold line at batch 1: an HBM round trip on the chain).
  const int32_t half = head_dim / 2;
  float qwa[kChunks][kVec], qwb[kChunks][kVec], kwa[kChunks][kVec], kwb[kChunks][kVec];
#pragma unroll
  for (int c = 0; c < kChunks; ++c) {
    const int i0 = (c * lanes + static_cast<int>(threadIdx.x % lanes)) * kVec;
    if (norm && i0 < half && q_w != nullptr) {
      LoadFloats<W, kVec>(q_w + i0, qwa[c]);
      LoadFloats<W, kVec>(q_w + i0 + half, qwb[c]);
    }
    if (norm && i0 < half && k_w != nullptr) {
      LoadFloats<W, kVec>(k_w + i0, kwa[c]);
      LoadFloats<W, kVec>(k_w + i0 + half, kwb[c]);
    }
  }
  PdlWait();
  __shared__ float s_inv_freq[kRopeMaxHeadDim / 2];
  for (int i = threadIdx.x; i < half; i += kThreads) s_inv_freq[i] = inv_freq.v[i];
  __syncthreads();
  const bool write_cache = cache.slots != nullptr;
  const int32_t heads = q_heads + k_heads + (write_cache ? k_heads : 0);
  const int64_t rows = static_cast<int64_t>(tokens) * heads;
  const int groups_per_warp = kWarpSize / lanes;
  const int lane = threadIdx.x % lanes, group = (threadIdx.x % kWarpSize) / lanes;
  const int64_t warp_id = GlobalThread() / kWarpSize;
  const int64_t step = GridThreads() / kWarpSize * groups_per_warp;
  for (int64_t base = warp_id * groups_per_warp; base < rows; base += step) {  // warp-uniform
    const int64_t row = base + group;
    const bool valid = row < rows;
    const int32_t token = valid ? static_cast<int32_t>(row / heads) : 0;
    const int32_t h = valid ? static_cast<int32_t>(row - static_cast<int64_t>(token) * heads) : 0;
    const bool is_q = h < q_heads;
    const bool is_v = h >= q_heads + k_heads;  // a v row to cache (write_cache only)
    const int32_t kv_head = is_q ? 0 : is_v ? h - q_heads - k_heads : h - q_heads;
    const int64_t kv_row = (static_cast<int64_t>(token) * k_heads + kv_head) * head_dim;
    // The q or k row rotated in place (null for a v row), and where the row is read.
    T* inplace = is_q   ? q + (static_cast<int64_t>(token) * q_heads + h) * head_dim
                 : is_v ? nullptr
                        : k + kv_row;
    const T* src = is_v ? cache.v + kv_row : inplace;
    // Where this row goes in the cache (k and v rows of a token with a slot), else null.
    T* cached = nullptr;
    if (write_cache && valid && !is_q) {
      const int64_t slot = cache.slots[token];
      if (slot >= 0) {
        cached = (is_v ? cache.v_cache : cache.k_cache) + (slot * k_heads + kv_head) * head_dim;
      }
    }
    float a[kChunks][kVec], b[kChunks][kVec];
    float sum_sq = 0.f;
#pragma unroll
    for (int c = 0; c < kChunks; ++c) {
      const int i0 = (c * lanes + lane) * kVec;
      const bool here = valid && i0 < half;  // i0 + kVec <= half when kVec > 1
      if (here) {
        LoadFloats<T, kVec>(src + i0, a[c]);
        LoadFloats<T, kVec>(src + i0 + half, b[c]);
      } else {
#pragma unroll
        for (int j = 0; j < kVec; ++j) a[c][j] = b[c][j] = 0.f;
      }
#pragma unroll
      for (int j = 0; j < kVec; ++j) sum_sq += a[c][j] * a[c][j] + b[c][j] * b[c][j];
    }
    float inv = 1.f;
    if (norm) {
      for (int offset = lanes / 2; offset > 0; offset /= 2) {
        sum_sq += __shfl_xor_sync(kFullMask, sum_sq, offset);
      }
      inv = InvRms(sum_sq, head_dim, eps);
    }
    if (!valid) continue;
    if (is_v) {  // copied to the cache as it is
      if (cached == nullptr) continue;
#pragma unroll
      for (int c = 0; c < kChunks; ++c) {
        const int i0 = (c * lanes + lane) * kVec;
        if (i0 >= half) continue;
        StoreFloats<T, kVec>(cached + i0, a[c]);
        StoreFloats<T, kVec>(cached + i0 + half, b[c]);
      }
      continue;
    }
    const float pos = static_cast<float>(positions[token]);
#pragma unroll
    for (int c = 0; c < kChunks; ++c) {
      const int i0 = (c * lanes + lane) * kVec;
      if (i0 >= half) continue;
      if (norm) {
        float wa[kVec], wb[kVec];
#pragma unroll
        for (int j = 0; j < kVec; ++j) {
          wa[j] = is_q ? qwa[c][j] : kwa[c][j];
          wb[j] = is_q ? qwb[c][j] : kwb[c][j];
        }
#pragma unroll
        for (int j = 0; j < kVec; ++j) {
          a[c][j] = wa[j] * (a[c][j] * inv);
          b[c][j] = wb[j] * (b[c][j] * inv);
        }
      }
      float ra[kVec], rb[kVec];
#pragma unroll
      for (int j = 0; j < kVec; ++j) {
        float sin_v, cos_v;
        sincosf(pos * s_inv_freq[i0 + j], &sin_v, &cos_v);
        ra[j] = a[c][j] * cos_v - b[c][j] * sin_v;
        rb[j] = b[c][j] * cos_v + a[c][j] * sin_v;
      }
      StoreFloats<T, kVec>(inplace + i0, ra);
      StoreFloats<T, kVec>(inplace + i0 + half, rb);
      if (cached != nullptr) {
        StoreFloats<T, kVec>(cached + i0, ra);
        StoreFloats<T, kVec>(cached + i0 + half, rb);
      }
    }
  }
}

// ---- SiluMul, Add ----

template <typename G, typename U, typename O>
__global__ void SiluMulKernel(const G* gate, const U* up, O* out, int64_t n) {
  PdlWait();
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
  PdlWait();
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
  PdlWait();
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
  PdlWait();
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
  PdlWait();
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
  PdlWait();
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
    LaunchKernel(GatherRowsVecKernel, GridBlocks(n, kWarpsPerBlock), kThreads, 0, stream,
                 static_cast<const uint4*>(src), src_rows, rows, n,
                 static_cast<int64_t>(row_bytes / 16), static_cast<uint4*>(dst));
    return cudaGetLastError();
  }
  return DispatchConversion(src_type, dst_type, [&](auto s, auto d) {
    using Src = typename decltype(s)::type;
    using Dst = typename decltype(d)::type;
    const Src* in = static_cast<const Src*>(src);
    Dst* out = static_cast<Dst*>(dst);
    if (cols < kWarpSize) {
      LaunchKernel(GatherRowsFlatKernel<Src, Dst>, GridBlocks(n * cols, kThreads), kThreads, 0,
                   stream, in, src_rows, rows, n, cols, out);
    } else {
      LaunchKernel(GatherRowsWarpKernel<Src, Dst>, GridBlocks(n, kWarpsPerBlock), kThreads, 0,
                   stream, in, src_rows, rows, n, cols, out);
    }
    return cudaGetLastError();
  });
}

// ResidualNormKernel (kAdd: the norm of residual += x; else of x) in 16-byte steps where
// the columns and every pointer allow, else one element at a time.
template <bool kAdd, typename X, typename W, typename Y>
cudaError_t LaunchResidualNorm(const X* in, float* residual, const W* w, float eps, int64_t rows,
                               int64_t cols, Y* out, cudaStream_t stream) {
  const bool vec = cols % kNormVec == 0 && Aligned16(in) && Aligned16(w) && Aligned16(out) &&
                   (!kAdd || Aligned16(residual));
  if (vec) {
    LaunchKernel(ResidualNormKernel<X, W, Y, kNormVec, kAdd>, GridBlocks(rows, 1), kThreads, 0,
                 stream, in, residual, w, eps, rows, cols, out, NormEarlyTrigger());
  } else {
    LaunchKernel(ResidualNormKernel<X, W, Y, 1, kAdd>, GridBlocks(rows, 1), kThreads, 0, stream, in,
                 residual, w, eps, rows, cols, out, NormEarlyTrigger());
  }
  return cudaGetLastError();
}

// Rope (norm false: k and the weights unused) and QkNormRope: the vector path when each
// half of a head row is a power-of-two number (at most a warp) of 16-byte units and every
// pointer is 16-byte aligned, else one element per lane per step.
cudaError_t NormRopeImpl(void* q, void* k, ElemType type, const void* q_weight,
                         const void* k_weight, ElemType w_type, bool norm, float eps,
                         const int32_t* positions, int64_t tokens, int64_t q_heads, int64_t k_heads,
                         int64_t head_dim, float theta, cudaStream_t stream,
                         const KvCacheWrite<void>& cache = {}) {
  if (!IsFloating(type) || !IsFloating(w_type) || tokens < 0 || tokens > INT32_MAX || q_heads < 0 ||
      k_heads < 0 || q_heads + 2 * k_heads > INT32_MAX || head_dim <= 0 ||
      head_dim > kRopeMaxHeadDim || (norm && head_dim % 2 != 0)) {
    return cudaErrorInvalidValue;
  }
  const int64_t half = head_dim / 2;
  if (tokens == 0 || q_heads + k_heads == 0 || half == 0) return cudaSuccess;
  if (positions == nullptr || (q_heads > 0 && q == nullptr) || (k_heads > 0 && k == nullptr) ||
      (cache.slots != nullptr && (k_heads == 0 || cache.v == nullptr || cache.k_cache == nullptr ||
                                  cache.v_cache == nullptr))) {
    return cudaErrorInvalidValue;
  }
  // The CPU backend's expression (kernels/cpu_backend.cc), evaluated on the host.
  RopeInvFreq inv_freq{};
  for (int64_t i = 0; i < half; ++i) {
    inv_freq.v[i] = 1.f / std::pow(theta, static_cast<float>(2 * i) / static_cast<float>(head_dim));
  }
  const bool write_cache = cache.slots != nullptr;
  const int64_t rows = tokens * (q_heads + k_heads + (write_cache ? k_heads : 0));
  return DispatchFloat(type, [&](auto t) {
    return DispatchFloat(w_type, [&](auto wt) {
      using T = typename decltype(t)::type;
      using W = typename decltype(wt)::type;
      constexpr int kVec = 16 / sizeof(T);
      T* qp = static_cast<T*>(q);
      T* kp = static_cast<T*>(k);
      const W* qw = static_cast<const W*>(q_weight);
      const W* kw = static_cast<const W*>(k_weight);
      KvCacheWrite<T> typed;
      typed.v = static_cast<const T*>(cache.v);
      typed.k_cache = static_cast<T*>(cache.k_cache);
      typed.v_cache = static_cast<T*>(cache.v_cache);
      typed.slots = cache.slots;
      const int64_t units = half / kVec;
      const bool aligned =
          Aligned16(qp) && Aligned16(kp) && (!norm || (Aligned16(qw) && Aligned16(kw))) &&
          (!write_cache ||
           (Aligned16(typed.v) && Aligned16(typed.k_cache) && Aligned16(typed.v_cache)));
      const int32_t n = static_cast<int32_t>(tokens), hq = static_cast<int32_t>(q_heads),
                    hk = static_cast<int32_t>(k_heads), d = static_cast<int32_t>(head_dim);
      if (head_dim % (2 * kVec) == 0 && units <= kWarpSize && (units & (units - 1)) == 0 &&
          aligned) {
        const int lanes = static_cast<int>(units);
        LaunchKernel(NormRopeKernel<T, W, kVec, 1>, GridBlocks(rows * lanes, kThreads), kThreads, 0,
                     stream, qp, kp, qw, kw, positions, n, hq, hk, d, lanes, norm, eps, inv_freq,
                     typed);
      } else {
        constexpr int kChunks = kRopeMaxHeadDim / 2 / kWarpSize;
        LaunchKernel(NormRopeKernel<T, W, 1, kChunks>, GridBlocks(rows * kWarpSize, kThreads),
                     kThreads, 0, stream, qp, kp, qw, kw, positions, n, hq, hk, d, kWarpSize, norm,
                     eps, inv_freq, typed);
      }
      return cudaGetLastError();
    });
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
    LaunchKernel(ConvertKernel<Src, Dst>, GridBlocks(n, kThreads), kThreads, 0, stream,
                 static_cast<const Src*>(src), static_cast<Dst*>(dst), n);
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
      LaunchKernel(FillKernel<int32_t>, blocks, kThreads, 0, stream, static_cast<int32_t*>(dst), n,
                   value);
      return cudaGetLastError();
    case ElemType::kI64:
      LaunchKernel(FillKernel<int64_t>, blocks, kThreads, 0, stream, static_cast<int64_t*>(dst), n,
                   value);
      return cudaGetLastError();
    default:
      return DispatchFloat(type, [&](auto t) {
        using T = typename decltype(t)::type;
        LaunchKernel(FillKernel<T>, blocks, kThreads, 0, stream, static_cast<T*>(dst), n, value);
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
          LaunchKernel(RmsNormWarpKernel<X, W, Y>, GridBlocks(rows, kWarpsPerBlock), kThreads, 0,
                       stream, in, w, eps, rows, static_cast<int>(cols), out);
          return cudaGetLastError();
        }
        return LaunchResidualNorm<false>(in, nullptr, w, eps, rows, cols, out, stream);
      });
    });
  });
}

cudaError_t LaunchAddRmsNorm(const void* x, ElemType x_type, float* residual, const void* weight,
                             ElemType w_type, float eps, int64_t rows, int64_t cols, void* y,
                             ElemType y_type, cudaStream_t stream) {
  if (!IsFloating(x_type) || !IsFloating(w_type) || !IsFloating(y_type) || rows < 0 || cols <= 0) {
    return cudaErrorInvalidValue;
  }
  if (rows == 0) return cudaSuccess;
  if (x == nullptr || residual == nullptr || weight == nullptr || y == nullptr) {
    return cudaErrorInvalidValue;
  }
  return DispatchFloat(x_type, [&](auto xt) {
    return DispatchFloat(w_type, [&](auto wt) {
      return DispatchFloat(y_type, [&](auto yt) {
        using X = typename decltype(xt)::type;
        using W = typename decltype(wt)::type;
        using Y = typename decltype(yt)::type;
        const X* in = static_cast<const X*>(x);
        const W* w = static_cast<const W*>(weight);
        Y* out = static_cast<Y*>(y);
        return LaunchResidualNorm<true>(in, residual, w, eps, rows, cols, out, stream);
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
  return NormRopeImpl(x, nullptr, type, nullptr, nullptr, type, /*norm=*/false, 0.f, positions,
                      tokens, heads, 0, head_dim, theta, stream);
}

cudaError_t LaunchQkNormRope(void* q, void* k, ElemType type, const void* q_weight,
                             const void* k_weight, ElemType w_type, const int32_t* positions,
                             int64_t tokens, int64_t q_heads, int64_t k_heads, int64_t head_dim,
                             float eps, float theta, cudaStream_t stream) {
  if (q_weight == nullptr || k_weight == nullptr) {
    return tokens > 0 && head_dim >= 2 && q_heads + k_heads > 0 ? cudaErrorInvalidValue
                                                                : cudaSuccess;
  }
  return NormRopeImpl(q, k, type, q_weight, k_weight, w_type, /*norm=*/true, eps, positions, tokens,
                      q_heads, k_heads, head_dim, theta, stream);
}

cudaError_t LaunchQkNormRopeWriteKv(void* q, void* k, const void* v, ElemType type,
                                    const void* q_weight, const void* k_weight, ElemType w_type,
                                    const int32_t* positions, int64_t tokens, int64_t q_heads,
                                    int64_t k_heads, int64_t head_dim, float eps, float theta,
                                    const int64_t* slot_mapping, void* k_cache, void* v_cache,
                                    cudaStream_t stream) {
  if (tokens > 0 && head_dim >= 2 &&
      (q_weight == nullptr || k_weight == nullptr || slot_mapping == nullptr)) {
    return cudaErrorInvalidValue;
  }
  KvCacheWrite<void> cache;
  cache.v = v;
  cache.k_cache = k_cache;
  cache.v_cache = v_cache;
  cache.slots = slot_mapping;
  return NormRopeImpl(q, k, type, q_weight, k_weight, w_type, /*norm=*/true, eps, positions, tokens,
                      q_heads, k_heads, head_dim, theta, stream, cache);
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
        LaunchKernel(SiluMulKernel<G, U, O>, GridBlocks(n, kThreads), kThreads, 0, stream,
                     static_cast<const G*>(gate), static_cast<const U*>(up), static_cast<O*>(out),
                     n);
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
        LaunchKernel(SiluMulPackedKernel<T, O, 8>, GridBlocks(rows * inter / 8, kThreads), kThreads,
                     0, stream, in, o, rows, inter);
      } else {
        LaunchKernel(SiluMulPackedKernel<T, O, 1>, GridBlocks(rows * inter, kThreads), kThreads, 0,
                     stream, in, o, rows, inter);
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
      LaunchKernel(AddKernel<X, Y>, GridBlocks(n, kThreads), kThreads, 0, stream,
                   static_cast<const X*>(x), static_cast<Y*>(inout), n);
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
