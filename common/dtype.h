// Element types that checkpoints and the wire may carry, and conversions to float32.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string_view>

#include "absl/status/statusor.h"

namespace dxs {

// Floating types are what checkpoints and the wire carry; the integer types are index
// tensors on a backend (token ids, routing ids, block tables), never converted to float.
// kF8E4M3 (float8_e4m3fn) is a storage type of block-scaled FP8 checkpoints only: it is
// widened and narrowed like the floating types, but no backend tensor holds it (the loader
// dequantizes it with its block scales, common/safetensors.h), so IsFloatDType is false.
enum class DType { kF32, kF16, kBF16, kI32, kI64, kF8E4M3 };

inline bool IsFloatDType(DType dtype) {
  return dtype == DType::kF32 || dtype == DType::kF16 || dtype == DType::kBF16;
}

// Bytes per element.
size_t DTypeSize(DType dtype);
// Safetensors spelling: "F32", "F16", "BF16", "I32", "I64", "F8_E4M3".
std::string_view DTypeName(DType dtype);
// The types checkpoints hold: the floating types and F8_E4M3.
absl::StatusOr<DType> ParseDType(std::string_view name);

inline float Bf16ToFloat(uint16_t v) {
  uint32_t bits = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

// Round to nearest even, as torch does; NaN stays NaN.
inline uint16_t FloatToBf16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof(bits));
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x40);
  uint32_t rounding = 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>((bits + rounding) >> 16);
}

float Fp16ToFloat(uint16_t v);
uint16_t FloatToFp16(float f);

// float8_e4m3fn (torch.float8_e4m3fn): 1 sign, 4 exponent (bias 7), 3 mantissa bits; no
// infinities, 0x7f and 0xff are NaN, the largest finite value is 448.
float Fp8E4m3ToFloat(uint8_t v);
// Round to nearest even; NaN stays NaN; finite values beyond +-448 (and infinities)
// saturate to +-448, as FP8 quantizers clamp before the cast.
uint8_t FloatToFp8E4m3(float f);
inline constexpr float kFp8E4m3Max = 448.0f;

// Widens `count` elements of floating `dtype` at `src` (unaligned is fine) into `dst`.
void WidenToFloat32(DType dtype, const void* src, size_t count, float* dst);
// Narrows `count` floats into floating `dtype` at `dst`.
void NarrowFromFloat32(DType dtype, const float* src, size_t count, void* dst);

}  // namespace dxs
