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
enum class DType { kF32, kF16, kBF16, kI32, kI64 };

inline bool IsFloatDType(DType dtype) {
  return dtype == DType::kF32 || dtype == DType::kF16 || dtype == DType::kBF16;
}

// Bytes per element.
size_t DTypeSize(DType dtype);
// Safetensors spelling: "F32", "F16", "BF16", "I32", "I64".
std::string_view DTypeName(DType dtype);
// Floating types only: checkpoints hold float tensors.
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

// Widens `count` elements of floating `dtype` at `src` (unaligned is fine) into `dst`.
void WidenToFloat32(DType dtype, const void* src, size_t count, float* dst);
// Narrows `count` floats into floating `dtype` at `dst`.
void NarrowFromFloat32(DType dtype, const float* src, size_t count, void* dst);

}  // namespace dxs
