// The block-per-row residual RMS norm's arithmetic (dense_ops.cu's ResidualNormKernel), as
// device functions, so that the decode router's fused kernel (route_decode.cu) computes the
// same normed values bit for bit: thread t of kThreads takes the row's kVec-column chunks t,
// t + kThreads, ...; the squares are summed per thread in that order, then in a fixed warp
// tree, then warp by warp by thread 0. A normed value is w * (v * inv), rounded once into the
// output's type.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/cuda/elem_type.cuh"

namespace dxs::cuda::row_norm {

constexpr int kThreads = 256;  // a row's block
constexpr int kWarps = kThreads / 32;

// kN elements of T as one unit of 16-byte loads and stores (fewer when kN * sizeof(T) is
// smaller; then aligned to its size).
template <typename T, int kN>
struct alignas(sizeof(T) * kN >= 16 ? 16 : sizeof(T) * kN) Pack {
  T v[kN];
};

template <typename T, int kN>
__device__ __forceinline__ void LoadFloats(const T* p, float (&out)[kN]) {
  const Pack<T, kN> pack = *reinterpret_cast<const Pack<T, kN>*>(p);
#pragma unroll
  for (int j = 0; j < kN; ++j) out[j] = ToFloat(pack.v[j]);
}

template <typename T, int kN>
__device__ __forceinline__ void StoreFloats(T* p, const float (&in)[kN]) {
  Pack<T, kN> pack;
#pragma unroll
  for (int j = 0; j < kN; ++j) pack.v[j] = FromFloat<T>(in[j]);
  *reinterpret_cast<Pack<T, kN>*>(p) = pack;
}

__device__ __forceinline__ float InvRms(float sum_sq, int64_t cols, float eps) {
  return 1.f / sqrtf(sum_sq / static_cast<float>(cols) + eps);
}

// The same value in every lane: a butterfly of commutative adds, fixed order.
__device__ __forceinline__ float WarpSum(float v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}

// This thread's sum of squares of the row in (kAdd: of residual + in; with kStore the sum is
// written back to the residual row).
template <typename X, int kVec, bool kAdd, bool kStore>
__device__ __forceinline__ float RowSquares(const X* in, float* res, int64_t cols) {
  const int64_t chunks = cols / kVec;
  float sum_sq = 0.f;
  for (int64_t c = threadIdx.x; c < chunks; c += kThreads) {
    float v[kVec];
    LoadFloats<X, kVec>(in + c * kVec, v);
    if constexpr (kAdd) {
      float r[kVec];
      LoadFloats<float, kVec>(res + c * kVec, r);
#pragma unroll
      for (int j = 0; j < kVec; ++j) v[j] = r[j] + v[j];
      if constexpr (kStore) StoreFloats<float, kVec>(res + c * kVec, v);
    }
#pragma unroll
    for (int j = 0; j < kVec; ++j) sum_sq += v[j] * v[j];
  }
  return sum_sq;
}

// The row's 1 / rms from every thread's RowSquares, in every thread. warp_sums (kWarps) and
// row_inv are the block's shared memory; a later row's first barrier orders its writes of
// them after this row's reads.
__device__ __forceinline__ float BlockInvRms(float sum_sq, int64_t cols, float eps,
                                             float* warp_sums, float* row_inv) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  sum_sq = WarpSum(sum_sq);
  if (lane == 0) warp_sums[warp] = sum_sq;
  __syncthreads();
  if (threadIdx.x == 0) {
    float total = 0.f;
    for (int i = 0; i < kWarps; ++i) total += warp_sums[i];
    *row_inv = InvRms(total, cols, eps);
  }
  __syncthreads();
  return *row_inv;
}

// This thread's first chunk of the norm weight (chunk threadIdx.x), loaded before the kernel
// waits for its predecessor: the weight is immutable, and a cold line loaded only after the
// row's sum is an HBM round trip on the chain of a decode layer (one block a row).
template <int kVec>
struct EarlyWeights {
  float v[kVec];  // loaded where threadIdx.x < cols / kVec: StoreNormedRow's first chunk
};

template <typename W, int kVec>
__device__ __forceinline__ EarlyWeights<kVec> LoadEarlyWeights(const W* w, int64_t cols) {
  EarlyWeights<kVec> early;
  if (threadIdx.x < cols / kVec) LoadFloats<W, kVec>(w + threadIdx.x * kVec, early.v);
  return early;
}

// out = w * (row * inv) into Y, the row being the residual row RowSquares<kStore> wrote
// (kAdd) or in. `early`, when given, holds this thread's first chunk of w (the same values).
template <typename X, typename W, typename Y, int kVec, bool kAdd>
__device__ __forceinline__ void StoreNormedRow(const X* in, const float* res,
                                               const W* __restrict__ w, float inv, int64_t cols,
                                               Y* out, const EarlyWeights<kVec>* early = nullptr) {
  const int64_t chunks = cols / kVec;
  for (int64_t c = threadIdx.x; c < chunks; c += kThreads) {
    float v[kVec], wv[kVec];
    if constexpr (kAdd) {
      LoadFloats<float, kVec>(res + c * kVec, v);
    } else {
      LoadFloats<X, kVec>(in + c * kVec, v);
    }
    if (early != nullptr && c == threadIdx.x) {  // the first chunk, which it holds
#pragma unroll
      for (int j = 0; j < kVec; ++j) wv[j] = early->v[j];
    } else {
      LoadFloats<W, kVec>(w + c * kVec, wv);
    }
#pragma unroll
    for (int j = 0; j < kVec; ++j) v[j] = wv[j] * (v[j] * inv);
    StoreFloats<Y, kVec>(out + c * kVec, v);
  }
}

// Columns [col, col + kVec) of the normed row of residual + in, as StoreNormedRow<kAdd> stores
// them into Y and a reader widens them back, without writing anything (the residual row is
// the one before the add).
template <typename X, typename W, typename Y, int kVec>
__device__ __forceinline__ void NormedChunk(const X* in, const float* res, const W* w, float inv,
                                            int64_t col, float (&out)[kVec]) {
  float v[kVec], r[kVec], wv[kVec];
  LoadFloats<X, kVec>(in + col, v);
  LoadFloats<float, kVec>(res + col, r);
#pragma unroll
  for (int j = 0; j < kVec; ++j) v[j] = r[j] + v[j];
  LoadFloats<W, kVec>(w + col, wv);
#pragma unroll
  for (int j = 0; j < kVec; ++j) out[j] = ToFloat(FromFloat<Y>(wv[j] * (v[j] * inv)));
}

}  // namespace dxs::cuda::row_norm
