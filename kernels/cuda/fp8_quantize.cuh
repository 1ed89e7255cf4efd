// One 128-value group quantized by one warp, each lane holding 4 consecutive values: the FP8
// recipe's per-token, per-128-channel activation quantization (the arithmetic of the FP8
// dispatch records, fp8_rows.cu: scale max(amax, 1e-4) / 448 by one IEEE division, values
// divided by it and rounded to e4m3, nearest even, saturating). A warp a group keeps the amax
// in shuffles (no shared memory, no block barrier), so the passes over a prefill's rows run
// as a few large blocks rather than one small block per group.
#pragma once

#include <cuda_fp8.h>

#include <cstdint>

namespace dxs::cuda {

inline constexpr int kFp8GroupValues = 128;
inline constexpr int kFp8ValuesPerLane = kFp8GroupValues / 32;

// The lane's 4 values as 4 e4m3 bytes (value i in byte i) and, returned, the group's scale.
__device__ __forceinline__ float QuantizeGroupOfWarp(const float v[kFp8ValuesPerLane],
                                                     uint32_t* packed) {
  float amax = 0.f;
#pragma unroll
  for (int i = 0; i < kFp8ValuesPerLane; ++i) amax = fmaxf(amax, fabsf(v[i]));
  for (int offset = 16; offset > 0; offset /= 2) {
    amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, offset));
  }
  const float scale = __fdiv_rn(fmaxf(amax, 1e-4f), 448.0f);
  uint32_t out = 0;
#pragma unroll
  for (int i = 0; i < kFp8ValuesPerLane; ++i) {
    const uint32_t byte = __nv_cvt_float_to_fp8(__fdiv_rn(v[i], scale), __NV_SATFINITE, __NV_E4M3);
    out |= byte << (8 * i);
  }
  *packed = out;
  return scale;
}

// The same quantization with a 128-value group over 16 lanes of 8 consecutive values each
// (lanes 0-15 one group, 16-31 the next), so a lane moves 16 bytes of bf16 at once: the
// amax of the same 128 values, the same division and rounding, so the same bytes and scale.
// Every lane of the warp takes part in the shuffles.
inline constexpr int kFp8ValuesPerHalfLane = kFp8GroupValues / 16;
__device__ __forceinline__ float QuantizeGroupOfHalfWarp(const float v[kFp8ValuesPerHalfLane],
                                                         uint2* packed) {
  float amax = 0.f;
#pragma unroll
  for (int i = 0; i < kFp8ValuesPerHalfLane; ++i) amax = fmaxf(amax, fabsf(v[i]));
  for (int offset = 8; offset > 0; offset /= 2) {
    amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, offset));
  }
  const float scale = __fdiv_rn(fmaxf(amax, 1e-4f), 448.0f);
  uint32_t out[2] = {0, 0};
#pragma unroll
  for (int i = 0; i < kFp8ValuesPerHalfLane; ++i) {
    const uint32_t byte = __nv_cvt_float_to_fp8(__fdiv_rn(v[i], scale), __NV_SATFINITE, __NV_E4M3);
    out[i / 4] |= byte << (8 * (i % 4));
  }
  *packed = make_uint2(out[0], out[1]);
  return scale;
}

}  // namespace dxs::cuda
