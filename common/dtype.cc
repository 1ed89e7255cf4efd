#include "common/dtype.h"

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#include <array>
#include <cmath>
#include <cstdlib>
#include <limits>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace dxs {

size_t DTypeSize(DType dtype) {
  switch (dtype) {
    case DType::kF32:
      return 4;
    case DType::kF16:
    case DType::kBF16:
      return 2;
    case DType::kI32:
      return 4;
    case DType::kI64:
      return 8;
    case DType::kF8E4M3:
      return 1;
  }
  return 0;
}

std::string_view DTypeName(DType dtype) {
  switch (dtype) {
    case DType::kF32:
      return "F32";
    case DType::kF16:
      return "F16";
    case DType::kBF16:
      return "BF16";
    case DType::kI32:
      return "I32";
    case DType::kI64:
      return "I64";
    case DType::kF8E4M3:
      return "F8_E4M3";
  }
  return "?";
}

absl::StatusOr<DType> ParseDType(std::string_view name) {
  if (name == "F32") return DType::kF32;
  if (name == "F16") return DType::kF16;
  if (name == "BF16") return DType::kBF16;
  if (name == "F8_E4M3") return DType::kF8E4M3;
  return absl::InvalidArgumentError(absl::StrCat("unsupported dtype '",
                                                 absl::string_view(name.data(), name.size()),
                                                 "' (supported: F32, F16, BF16, F8_E4M3)"));
}

float Fp16ToFloat(uint16_t v) {
  const uint32_t sign = static_cast<uint32_t>(v & 0x8000u) << 16;
  const uint32_t exponent = (v >> 10) & 0x1fu;
  uint32_t mantissa = v & 0x3ffu;
  uint32_t bits;
  if (exponent == 0x1f) {
    // Inf or NaN; the payload moves to the top of the float mantissa, so NaN stays NaN.
    bits = sign | 0x7f800000u | (mantissa << 13);
  } else if (exponent != 0) {
    bits = sign | ((exponent + 127 - 15) << 23) | (mantissa << 13);
  } else if (mantissa == 0) {
    bits = sign;
  } else {
    // Subnormal: value = mantissa * 2^-24. Normalise so the leading one becomes implicit.
    int32_t e = -14;
    while ((mantissa & 0x400u) == 0) {
      mantissa <<= 1;
      --e;
    }
    mantissa &= 0x3ffu;
    bits = sign | (static_cast<uint32_t>(e + 127) << 23) | (mantissa << 13);
  }
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

uint16_t FloatToFp16(float f) {
  uint32_t x;
  std::memcpy(&x, &f, sizeof(x));
  const uint16_t sign = static_cast<uint16_t>((x >> 16) & 0x8000u);
  x &= 0x7fffffffu;
  if (x > 0x7f800000u) {
    // NaN: keep it quiet and keep what fits of the payload.
    return static_cast<uint16_t>(sign | 0x7e00u | ((x >> 13) & 0x3ffu));
  }
  // 65520 (0x477ff000) is halfway between the largest half, 65504, and 65536; ties go to the
  // even neighbour, which is infinity. Everything from there up (including inf) is inf.
  if (x >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);
  const uint32_t exponent = x >> 23;
  if (exponent < 113) {
    // Below 2^-14: the result is a half subnormal (or zero), round(value * 2^24).
    if (exponent < 102) return sign;  // below 2^-25, rounds to zero
    const uint32_t mantissa = (x & 0x7fffffu) | 0x800000u;
    const uint32_t shift = 126 - exponent;  // 14..24
    uint32_t result = mantissa >> shift;
    const uint32_t remainder = mantissa & ((1u << shift) - 1);
    const uint32_t half = 1u << (shift - 1);
    if (remainder > half || (remainder == half && (result & 1u))) ++result;
    return static_cast<uint16_t>(sign | result);  // a carry into 0x400 is the smallest normal
  }
  uint32_t result = ((exponent - 112) << 10) | ((x >> 13) & 0x3ffu);
  const uint32_t remainder = x & 0x1fffu;
  if (remainder > 0x1000u || (remainder == 0x1000u && (result & 1u))) ++result;
  return static_cast<uint16_t>(sign | result);
}

namespace {

// All 256 e4m3fn codes, decoded once.
std::array<float, 256> MakeFp8E4m3Table() {
  std::array<float, 256> table{};
  for (int code = 0; code < 256; ++code) {
    const int exponent = (code >> 3) & 0xf;
    const int mantissa = code & 0x7;
    float magnitude;
    if (exponent == 0xf && mantissa == 0x7) {
      magnitude = std::numeric_limits<float>::quiet_NaN();
    } else if (exponent == 0) {
      magnitude = std::ldexp(static_cast<float>(mantissa), -9);  // subnormal: m/8 * 2^-6
    } else {
      magnitude = std::ldexp(static_cast<float>(8 + mantissa), exponent - 7 - 3);
    }
    table[code] = (code & 0x80) ? -magnitude : magnitude;
  }
  return table;
}

const std::array<float, 256>& Fp8E4m3Table() {
  static const std::array<float, 256> table = MakeFp8E4m3Table();
  return table;
}

}  // namespace

float Fp8E4m3ToFloat(uint8_t v) { return Fp8E4m3Table()[v]; }

uint8_t FloatToFp8E4m3(float f) {
  uint8_t sign = std::signbit(f) ? 0x80 : 0x00;
  if (std::isnan(f)) return static_cast<uint8_t>(sign | 0x7f);
  const float x = std::fabs(f);
  if (!(x < kFp8E4m3Max)) return static_cast<uint8_t>(sign | 0x7e);  // saturate (and inf)
  if (x < 0x1p-6f) {
    // Subnormal range: the code is round(x * 2^9), exact scaling, ties to even; a result of 8
    // is the smallest normal, 0x08, as an integer too.
    const float q = std::nearbyint(x * 512.0f);
    return static_cast<uint8_t>(sign | static_cast<uint8_t>(q));
  }
  int e = 0;
  const float frac = std::frexp(x, &e);  // x = frac * 2^e, frac in [0.5, 1)
  // Mantissa steps of 1/8 on [1, 2): (2 * frac - 1) * 8 in [0, 8), exact; ties to even.
  int exponent = e - 1 + 7;
  int mantissa = static_cast<int>(std::nearbyint((2.0f * frac - 1.0f) * 8.0f));
  if (mantissa == 8) {
    mantissa = 0;
    ++exponent;
  }
  if (exponent > 15 || (exponent == 15 && mantissa == 7)) return static_cast<uint8_t>(sign | 0x7e);
  return static_cast<uint8_t>(sign | (exponent << 3) | mantissa);
}

namespace {

// bfloat16 <-> float32 over arrays. These carry every bf16 dispatch and combine row, so
// they run eight elements at a time with SSE2 (part of x86-64, so no CPU check is needed):
// a scalar loop over a 16 MiB payload was slower than moving the bytes. The arithmetic is
// FloatToBf16's, lane by lane, so results are bit-identical to it: round to nearest even,
// NaN stays NaN. Unaligned pointers are fine.
void WidenBf16(const uint8_t* in, size_t count, float* dst) {
  size_t i = 0;
#if defined(__SSE2__)
  const __m128i zero = _mm_setzero_si128();
  for (; i + 8 <= count; i += 8) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(in + 2 * i));
    // Interleaving zeros below each half puts its bits in the top of a 32-bit lane.
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i), _mm_unpacklo_epi16(zero, h));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i + 4), _mm_unpackhi_epi16(zero, h));
  }
#endif
  for (; i < count; ++i) {
    uint16_t v;
    std::memcpy(&v, in + 2 * i, sizeof(v));
    dst[i] = Bf16ToFloat(v);
  }
}

#if defined(__SSE2__)
// FloatToBf16 on four lanes; each result sign-extended in its 32-bit lane, ready for the
// signed-saturating pack (which then keeps it exactly).
inline __m128i Bf16Lanes(__m128i bits) {
  const __m128i abs = _mm_and_si128(bits, _mm_set1_epi32(0x7fffffff));
  // Both sides are non-negative as int32, so the signed compare is the unsigned one.
  const __m128i nan = _mm_cmpgt_epi32(abs, _mm_set1_epi32(0x7f800000));
  const __m128i odd = _mm_and_si128(_mm_srli_epi32(bits, 16), _mm_set1_epi32(1));
  const __m128i rounding = _mm_add_epi32(_mm_set1_epi32(0x7fff), odd);
  const __m128i rounded = _mm_srli_epi32(_mm_add_epi32(bits, rounding), 16);
  const __m128i quiet = _mm_or_si128(_mm_srli_epi32(bits, 16), _mm_set1_epi32(0x40));
  const __m128i result = _mm_or_si128(_mm_and_si128(nan, quiet), _mm_andnot_si128(nan, rounded));
  return _mm_srai_epi32(_mm_slli_epi32(result, 16), 16);
}
#endif

void NarrowBf16(const float* src, size_t count, uint8_t* out) {
  size_t i = 0;
#if defined(__SSE2__)
  for (; i + 8 <= count; i += 8) {
    const __m128i lo = Bf16Lanes(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i)));
    const __m128i hi = Bf16Lanes(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i + 4)));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + 2 * i), _mm_packs_epi32(lo, hi));
  }
#endif
  for (; i < count; ++i) {
    const uint16_t v = FloatToBf16(src[i]);
    std::memcpy(out + 2 * i, &v, sizeof(v));
  }
}

}  // namespace

void WidenToFloat32(DType dtype, const void* src, size_t count, float* dst) {
  const auto* in = static_cast<const uint8_t*>(src);
  switch (dtype) {
    case DType::kF32:
      if (count > 0) std::memcpy(dst, in, count * sizeof(float));
      return;
    case DType::kF16:
      for (size_t i = 0; i < count; ++i) {
        uint16_t v;
        std::memcpy(&v, in + 2 * i, sizeof(v));
        dst[i] = Fp16ToFloat(v);
      }
      return;
    case DType::kBF16:
      WidenBf16(in, count, dst);
      return;
    case DType::kF8E4M3: {
      const std::array<float, 256>& table = Fp8E4m3Table();
      for (size_t i = 0; i < count; ++i) dst[i] = table[in[i]];
      return;
    }
    case DType::kI32:
    case DType::kI64:
      std::abort();  // programming error: index tensors are never converted
  }
}

void NarrowFromFloat32(DType dtype, const float* src, size_t count, void* dst) {
  auto* out = static_cast<uint8_t*>(dst);
  switch (dtype) {
    case DType::kF32:
      if (count > 0) std::memcpy(out, src, count * sizeof(float));
      return;
    case DType::kF16:
      for (size_t i = 0; i < count; ++i) {
        const uint16_t v = FloatToFp16(src[i]);
        std::memcpy(out + 2 * i, &v, sizeof(v));
      }
      return;
    case DType::kBF16:
      NarrowBf16(src, count, out);
      return;
    case DType::kF8E4M3:
      for (size_t i = 0; i < count; ++i) out[i] = FloatToFp8E4m3(src[i]);
      return;
    case DType::kI32:
    case DType::kI64:
      std::abort();  // programming error: index tensors are never converted
  }
}

}  // namespace dxs
