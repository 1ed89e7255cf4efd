// One 128-value group quantized by a warp (4 consecutive values a lane) or half a warp (8): the
// FP8 recipe's per-token, per-128-channel activation quantization (the arithmetic of the FP8
// dispatch records, fp8_rows.cu, of FP8 Linear's and of the experts' passes, one definition:
// scale max(amax, 1e-4) / 448 by one IEEE division, values divided by it and rounded to e4m3,
// nearest even, saturating). The amax stays in shuffles (no shared memory, no block barrier),
// so the passes over a prefill's rows run as a few large blocks. The values' quotients are
// the IEEE division's bits without a division each (QuantizeGroup): with a division per value
// the experts' input pass ran at 1.5 TB/s on an H100, with the reciprocal and its remainder
// step at 2.2 TB/s (docs/results/fp8.md).
#pragma once

#include <cuda_fp8.h>

#include <cstdint>

namespace dxs::cuda {

inline constexpr int kFp8GroupValues = 128;
inline constexpr int kFp8ValuesPerLane = kFp8GroupValues / 32;

// One 128-value group quantized by kLanes lanes of consecutive values (128 / kLanes each),
// every lane of the warp taking part in the shuffles: with kLanes 16, lanes 0-15 and 16-31
// quantize two groups at once. Value i of the lane goes to byte i % 4 of packed[i / 4]; the
// group's scale is returned.
template <int kLanes>
__device__ __forceinline__ float QuantizeGroup(const float (&v)[kFp8GroupValues / kLanes],
                                               uint32_t (&packed)[kFp8GroupValues / kLanes / 4]) {
  constexpr int kValues = kFp8GroupValues / kLanes;
  float amax = 0.f;
#pragma unroll
  for (int i = 0; i < kValues; ++i) amax = fmaxf(amax, fabsf(v[i]));
  for (int offset = kLanes / 2; offset > 0; offset /= 2) {
    amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, offset));
  }
  const float scale = __fdiv_rn(fmaxf(amax, 1e-4f), 448.0f);
  // v / scale, rounded as IEEE division rounds, without a division per value: the quotient
  // from the rounded reciprocal, then one remainder step (Markstein's: with the reciprocal
  // rounded to nearest, q + r / scale rounded once is the correctly rounded quotient; the
  // remainder fma is exact). The scale is at least 1e-4 / 448, so nothing here overflows or
  // loses the remainder to underflow where the e4m3 result is not 0 anyway; the sign is the
  // value's (a -0 stays -0). Fp8QuantizeCuda checks the bits against the host's division.
  const float inv = __frcp_rn(scale);
#pragma unroll
  for (int j = 0; j < kValues / 4; ++j) packed[j] = 0;
  float quotient[kValues];
#pragma unroll
  for (int i = 0; i < kValues; ++i) {
    const float q = __fmul_rn(v[i], inv);
    const float r = __fmaf_rn(-q, scale, v[i]);
    quotient[i] = copysignf(__fmaf_rn(r, inv, q), v[i]);
  }
  // Two values a conversion (the hardware's e4m3x2 convert), the first into the low byte.
#pragma unroll
  for (int i = 0; i < kValues; i += 2) {
    const uint32_t two = __nv_cvt_float2_to_fp8x2(make_float2(quotient[i], quotient[i + 1]),
                                                  __NV_SATFINITE, __NV_E4M3);
    packed[i / 4] |= two << (8 * (i % 4));
  }
  return scale;
}

// A warp a group, 4 values a lane: the lane's 4 e4m3 bytes into *packed.
__device__ __forceinline__ float QuantizeGroupOfWarp(const float (&v)[kFp8ValuesPerLane],
                                                     uint32_t* packed) {
  uint32_t out[1];
  const float scale = QuantizeGroup<32>(v, out);
  *packed = out[0];
  return scale;
}

// Half a warp a group, 8 values a lane, so a lane moves 16 bytes of bf16 at once.
inline constexpr int kFp8ValuesPerHalfLane = kFp8GroupValues / 16;
__device__ __forceinline__ float QuantizeGroupOfHalfWarp(const float (&v)[kFp8ValuesPerHalfLane],
                                                         uint2* packed) {
  uint32_t out[2];
  const float scale = QuantizeGroup<16>(v, out);
  *packed = make_uint2(out[0], out[1]);
  return scale;
}

}  // namespace dxs::cuda
