// The lane-level pieces of gemv.cu's bf16 GEMVs (16-byte weight streams, the dot of a lane's
// 8 elements, the warp's fixed xor tree), shared with the decode router's fused kernel
// (route_decode.cu) so that it computes the router logits as LaunchGemvBf16 does, bit for bit.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace dxs::cuda {

// Warps sharing a feature group in LaunchGemvsBf16 for `groups` feature groups (kGemvFeatures
// outputs each) of k inputs: 1, 2 or 4 (gemv.cu's GemvKSplit).
int GemvKSplitOf(int64_t groups, int64_t k);

namespace gemv_lanes {

constexpr int kChunk = 8;         // elements a lane loads at once (16 bytes of bf16)
constexpr int kGemvFeatures = 2;  // output features a dense GEMV warp

// The 8 bf16 of 16 bytes, widened.
__device__ __forceinline__ void WidenBf16x8(const uint4& raw, float out[kChunk]) {
  const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&raw);
#pragma unroll
  for (int i = 0; i < kChunk / 2; ++i) {
    const float2 f = __bfloat1622float2(h[i]);
    out[2 * i] = f.x;
    out[2 * i + 1] = f.y;
  }
}

// 16 bytes of bf16 weights, streamed (read once: no L1 allocation). volatile: without it
// the compiler took the asm for a pure function of its operands and hoisted it out of the
// bounds checks around it (`c < hidden` in MoeGateUpKernel's loop), so lanes past the end
// of a row read past the weights' allocation (compute-sanitizer memcheck over
// cuda_engine_test: 16-byte reads just after a 32 KiB expert). A load may not run where its
// guard is false.
__device__ __forceinline__ uint4 LoadWeightsRaw(const __nv_bfloat16* p) {
  uint4 raw;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(raw.x), "=r"(raw.y), "=r"(raw.z), "=r"(raw.w)
               : "l"(p));
  return raw;
}

// The same, widened to 8 floats.
__device__ __forceinline__ void LoadWeights8(const __nv_bfloat16* p, float out[kChunk]) {
  WidenBf16x8(LoadWeightsRaw(p), out);
}

// 8 activations as float, by one 16-byte load: the copy into `raw` is what makes it one
// (WidenBf16x8 reading the pairs through a reference to global memory compiled to four 4-byte
// loads).
__device__ __forceinline__ void LoadRow8(const __nv_bfloat16* p, float out[kChunk]) {
  const uint4 raw = *reinterpret_cast<const uint4*>(p);
  WidenBf16x8(raw, out);
}
__device__ __forceinline__ void LoadRow8(const float* p, float out[kChunk]) {
  const float4 a = *reinterpret_cast<const float4*>(p);
  const float4 b = *reinterpret_cast<const float4*>(p + 4);
  out[0] = a.x, out[1] = a.y, out[2] = a.z, out[3] = a.w;
  out[4] = b.x, out[5] = b.y, out[6] = b.z, out[7] = b.w;
}

__device__ __forceinline__ float WarpSum(float v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}

__device__ __forceinline__ float Dot8(const float a[kChunk], const float b[kChunk]) {
  float s = 0.f;
#pragma unroll
  for (int i = 0; i < kChunk; ++i) s = fmaf(a[i], b[i], s);
  return s;
}

// A dense GEMV warp's pass over its feature pair's weights (row[f]: the offset of feature f's
// row in w): the kEarly slices it requested before PdlWait (early), then the rest, from
// element c0 in steps of stride; acc[f][r] += the dot of each 8-element chunk with row r of
// the activations, which x_of(r, c, xv) widens into xv. The order every bf16 dense GEMV sums
// in (GemvKernel, the fused router), so their bits agree.
template <int M, int kEarly, typename XOf>
__device__ __forceinline__ void StreamFeaturePair(const __nv_bfloat16* w,
                                                  const int64_t (&row)[kGemvFeatures],
                                                  const uint4 (&early)[kEarly][kGemvFeatures],
                                                  int c0, int stride, int k, int m, XOf x_of,
                                                  float (&acc)[kGemvFeatures][M]) {
  auto accumulate = [&](int c, const float(&wv)[kGemvFeatures][kChunk]) {
#pragma unroll
    for (int r = 0; r < M; ++r) {
      if (r < m) {
        float xv[kChunk];
        x_of(r, c, xv);
#pragma unroll
        for (int f = 0; f < kGemvFeatures; ++f) acc[f][r] += Dot8(wv[f], xv);
      }
    }
  };
#pragma unroll
  for (int i = 0; i < kEarly; ++i) {
    const int c = c0 + i * stride;
    if (c < k) {
      float wv[kGemvFeatures][kChunk];
#pragma unroll
      for (int f = 0; f < kGemvFeatures; ++f) WidenBf16x8(early[i][f], wv[f]);
      accumulate(c, wv);
    }
  }
#pragma unroll 2
  for (int c = c0 + kEarly * stride; c < k; c += stride) {
    float wv[kGemvFeatures][kChunk];
#pragma unroll
    for (int f = 0; f < kGemvFeatures; ++f) LoadWeights8(w + row[f] + c, wv[f]);
    accumulate(c, wv);
  }
}

}  // namespace gemv_lanes
}  // namespace dxs::cuda
