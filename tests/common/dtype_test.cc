#include "common/dtype.h"

#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace dxs {
namespace {

using ::testing::HasSubstr;

float FromBits(uint32_t bits) {
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

uint32_t ToBits(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof(bits));
  return bits;
}

TEST(DTypeTest, NamesAndSizes) {
  for (DType d : {DType::kF32, DType::kF16, DType::kBF16}) {
    absl::StatusOr<DType> parsed = ParseDType(DTypeName(d));
    ASSERT_TRUE(parsed.ok()) << parsed.status();
    EXPECT_EQ(*parsed, d);
  }
  EXPECT_EQ(DTypeSize(DType::kF32), 4u);
  EXPECT_EQ(DTypeSize(DType::kF16), 2u);
  EXPECT_EQ(DTypeSize(DType::kBF16), 2u);
  EXPECT_EQ(DTypeName(DType::kBF16), "BF16");
}

TEST(DTypeTest, UnsupportedDTypeIsInvalidArgument) {
  for (const char* name : {"I64", "F64", "bf16", "", "F8_E5M2", "f8_e4m3"}) {
    absl::StatusOr<DType> parsed = ParseDType(name);
    ASSERT_FALSE(parsed.ok()) << name;
    EXPECT_EQ(parsed.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(parsed.status().message(), HasSubstr("unsupported dtype"));
  }
}

// float8_e4m3fn from its definition, independently of dtype.cc: (-1)^s * 2^(e-7) * (1 + m/8)
// for e in 1..15, (-1)^s * 2^-6 * m/8 for e = 0, and NaN for e = 15, m = 7.
double ReferenceE4m3(int code) {
  const int s = code >> 7, e = (code >> 3) & 15, m = code & 7;
  if (e == 15 && m == 7) return std::nan("");
  const double magnitude = e == 0 ? std::pow(2.0, -6) * (m / 8.0)  //
                                  : std::pow(2.0, e - 7) * (1.0 + m / 8.0);
  return s ? -magnitude : magnitude;
}

TEST(Fp8E4m3Test, AllCodesDecode) {
  int nans = 0;
  for (int code = 0; code < 256; ++code) {
    const double want = ReferenceE4m3(code);
    const float got = Fp8E4m3ToFloat(static_cast<uint8_t>(code));
    float widened = 0;
    const uint8_t byte = static_cast<uint8_t>(code);
    WidenToFloat32(DType::kF8E4M3, &byte, 1, &widened);
    if (std::isnan(want)) {
      ++nans;
      EXPECT_TRUE(std::isnan(got)) << code;
      EXPECT_TRUE(std::isnan(widened)) << code;
      continue;
    }
    EXPECT_EQ(static_cast<double>(got), want) << code;
    EXPECT_EQ(ToBits(widened), ToBits(got)) << code;
    EXPECT_EQ(std::signbit(got), code >= 128) << code;  // -0 is 0x80
    // Every finite code is its own nearest value.
    EXPECT_EQ(FloatToFp8E4m3(got), code) << code;
  }
  EXPECT_EQ(nans, 2);  // 0x7f and 0xff; no infinities
  EXPECT_EQ(Fp8E4m3ToFloat(0x7e), 448.0f);
  EXPECT_EQ(Fp8E4m3ToFloat(0x01), std::ldexp(1.0f, -9));
  EXPECT_EQ(Fp8E4m3ToFloat(0x38), 1.0f);
  EXPECT_EQ(DTypeSize(DType::kF8E4M3), 1u);
  EXPECT_EQ(DTypeName(DType::kF8E4M3), "F8_E4M3");
  EXPECT_EQ(*ParseDType("F8_E4M3"), DType::kF8E4M3);
  EXPECT_FALSE(IsFloatDType(DType::kF8E4M3));
}

TEST(Fp8E4m3Test, EncodeRoundsToNearestEvenAndSaturates) {
  // Against a brute-force nearest search over the finite codes (ties to the even code).
  std::mt19937 rng(42);
  std::uniform_real_distribution<float> mag(-10.f, 9.5f);
  for (int i = 0; i < 20000; ++i) {
    const float x = (i % 2 ? -1.f : 1.f) * std::exp2(mag(rng));
    int best = -1;
    double best_err = 0;
    for (int code = 0; code < 256; ++code) {
      const double v = ReferenceE4m3(code);
      if (std::isnan(v) || std::signbit(v) != std::signbit(x)) continue;
      const double err = std::fabs(v - static_cast<double>(x));
      if (best < 0 || err < best_err || (err == best_err && (code & 1) == 0)) {
        best = code;
        best_err = err;
      }
    }
    if (std::fabs(x) >= 448.f) best = x < 0 ? 0xfe : 0x7e;
    ASSERT_EQ(FloatToFp8E4m3(x), best) << x;
  }
  EXPECT_EQ(FloatToFp8E4m3(1.0625f), 0x38);  // tie between 1 and 1.125: even
  EXPECT_EQ(FloatToFp8E4m3(1.1875f), 0x3a);  // tie between 1.125 and 1.25: even
  EXPECT_EQ(FloatToFp8E4m3(1000.f), 0x7e);
  EXPECT_EQ(FloatToFp8E4m3(-std::numeric_limits<float>::infinity()), 0xfe);
  EXPECT_TRUE(std::isnan(Fp8E4m3ToFloat(FloatToFp8E4m3(std::nanf("")))));
  EXPECT_EQ(FloatToFp8E4m3(std::ldexp(1.0f, -10)), 0x00);  // half the smallest: tie, even 0
  EXPECT_EQ(FloatToFp8E4m3(std::ldexp(3.0f, -10)), 0x02);  // 1.5 steps: even, 2
  std::vector<float> in = {0.5f, -3.0f, 448.f};
  std::vector<uint8_t> out(3);
  NarrowFromFloat32(DType::kF8E4M3, in.data(), in.size(), out.data());
  EXPECT_EQ(out, (std::vector<uint8_t>{0x30, 0xc4, 0x7e}));
}

TEST(Bf16Test, KnownValues) {
  EXPECT_EQ(FloatToBf16(1.0f), 0x3f80);
  EXPECT_EQ(FloatToBf16(-2.0f), 0xc000);
  EXPECT_EQ(FloatToBf16(0.0f), 0x0000);
  EXPECT_EQ(FloatToBf16(-0.0f), 0x8000);
  EXPECT_EQ(FloatToBf16(std::numeric_limits<float>::infinity()), 0x7f80);
  EXPECT_EQ(Bf16ToFloat(0x3f80), 1.0f);
  EXPECT_EQ(Bf16ToFloat(0xc0a0), -5.0f);
  EXPECT_TRUE(std::isinf(Bf16ToFloat(0xff80)));
  EXPECT_TRUE(std::isnan(Bf16ToFloat(0x7fc0)));
  EXPECT_TRUE(std::isnan(Bf16ToFloat(FloatToBf16(std::nanf("")))));
  // A signalling NaN whose payload sits in the low bits must not become infinity.
  EXPECT_TRUE(std::isnan(Bf16ToFloat(FloatToBf16(FromBits(0x7f800001u)))));
}

TEST(Bf16Test, RoundsToNearestEven) {
  // 1 + 2^-8 is halfway between 1 and 1 + 2^-7: ties go to the even mantissa (1.0).
  EXPECT_EQ(FloatToBf16(1.0f + std::ldexp(1.0f, -8)), 0x3f80);
  // 1 + 3 * 2^-8 is halfway between 1 + 2^-7 (odd) and 1 + 2^-6: up to the even one.
  EXPECT_EQ(FloatToBf16(1.0f + 3 * std::ldexp(1.0f, -8)), 0x3f82);
  // Just above the halfway point rounds up.
  EXPECT_EQ(FloatToBf16(FromBits(0x3f808001u)), 0x3f81);
  // The largest finite float rounds to infinity.
  EXPECT_EQ(FloatToBf16(std::numeric_limits<float>::max()), 0x7f80);
}

TEST(Bf16Test, ExhaustiveRoundTrip) {
  for (uint32_t h = 0; h < 0x10000; ++h) {
    const float f = Bf16ToFloat(static_cast<uint16_t>(h));
    if (std::isnan(f)) {
      EXPECT_TRUE(std::isnan(Bf16ToFloat(FloatToBf16(f))));
    } else {
      ASSERT_EQ(FloatToBf16(f), h) << std::hex << h;
    }
  }
}

TEST(Fp16Test, KnownValues) {
  EXPECT_EQ(Fp16ToFloat(0x3c00), 1.0f);
  EXPECT_EQ(Fp16ToFloat(0xc000), -2.0f);
  EXPECT_EQ(Fp16ToFloat(0x7bff), 65504.0f);
  EXPECT_EQ(Fp16ToFloat(0x0400), std::ldexp(1.0f, -14));  // smallest normal
  EXPECT_EQ(Fp16ToFloat(0x0001), std::ldexp(1.0f, -24));  // smallest subnormal
  EXPECT_EQ(Fp16ToFloat(0x03ff), 1023 * std::ldexp(1.0f, -24));
  EXPECT_EQ(Fp16ToFloat(0x8001), -std::ldexp(1.0f, -24));
  EXPECT_EQ(Fp16ToFloat(0x3555), 0.333251953125f);      // 2^-2 * (1 + 341/1024)
  EXPECT_EQ(ToBits(Fp16ToFloat(0x8000)), 0x80000000u);  // -0
  EXPECT_EQ(Fp16ToFloat(0x7c00), std::numeric_limits<float>::infinity());
  EXPECT_EQ(Fp16ToFloat(0xfc00), -std::numeric_limits<float>::infinity());
  EXPECT_TRUE(std::isnan(Fp16ToFloat(0x7e00)));
  EXPECT_TRUE(std::isnan(Fp16ToFloat(0x7c01)));

  EXPECT_EQ(FloatToFp16(1.0f), 0x3c00);
  EXPECT_EQ(FloatToFp16(-2.0f), 0xc000);
  EXPECT_EQ(FloatToFp16(0.333251953125f), 0x3555);
  EXPECT_EQ(FloatToFp16(-0.0f), 0x8000);
  EXPECT_EQ(FloatToFp16(std::numeric_limits<float>::infinity()), 0x7c00);
  EXPECT_EQ(FloatToFp16(-std::numeric_limits<float>::infinity()), 0xfc00);
  EXPECT_TRUE(std::isnan(Fp16ToFloat(FloatToFp16(std::nanf("")))));
  EXPECT_TRUE(std::isnan(Fp16ToFloat(FloatToFp16(FromBits(0x7f800001u)))));
  EXPECT_TRUE(std::isnan(Fp16ToFloat(FloatToFp16(FromBits(0xffc00000u)))));
}

TEST(Fp16Test, RoundsToNearestEven) {
  const float ulp1 = std::ldexp(1.0f, -10);             // spacing of halves in [1, 2)
  EXPECT_EQ(FloatToFp16(1.0f + ulp1 / 2), 0x3c00);      // tie -> even (down)
  EXPECT_EQ(FloatToFp16(1.0f + 3 * ulp1 / 2), 0x3c02);  // tie -> even (up)
  EXPECT_EQ(FloatToFp16(std::nextafter(1.0f + ulp1 / 2, 2.0f)), 0x3c01);
  // Overflow: 65519 rounds down to the largest half, 65520 (a tie with 65536) to infinity.
  EXPECT_EQ(FloatToFp16(65519.0f), 0x7bff);
  EXPECT_EQ(FloatToFp16(65520.0f), 0x7c00);
  EXPECT_EQ(FloatToFp16(-65520.0f), 0xfc00);
  EXPECT_EQ(FloatToFp16(1e10f), 0x7c00);
  // Subnormals.
  const float sub = std::ldexp(1.0f, -24);
  EXPECT_EQ(FloatToFp16(sub / 2), 0x0000);                        // tie with 0 -> 0
  EXPECT_EQ(FloatToFp16(std::nextafter(sub / 2, 1.0f)), 0x0001);  // just above -> 1
  EXPECT_EQ(FloatToFp16(3 * sub / 2), 0x0002);                    // tie 1|2 -> 2
  EXPECT_EQ(FloatToFp16(5 * sub / 2), 0x0002);                    // tie 2|3 -> 2
  EXPECT_EQ(FloatToFp16(-3 * sub), 0x8003);
  EXPECT_EQ(FloatToFp16(std::ldexp(1.0f, -30)), 0x0000);
  EXPECT_EQ(FloatToFp16(std::numeric_limits<float>::denorm_min()), 0x0000);
  // Halfway between the largest subnormal and the smallest normal: to the even one (normal).
  EXPECT_EQ(FloatToFp16(1023.5f * sub), 0x0400);
}

TEST(Fp16Test, ExhaustiveRoundTrip) {
  for (uint32_t h = 0; h < 0x10000; ++h) {
    const float f = Fp16ToFloat(static_cast<uint16_t>(h));
    if (std::isnan(f)) {
      EXPECT_TRUE(std::isnan(Fp16ToFloat(FloatToFp16(f)))) << std::hex << h;
      EXPECT_EQ((h & 0x7c00u), 0x7c00u);
    } else {
      ASSERT_EQ(FloatToFp16(f), h) << std::hex << h;
    }
  }
}

// Reference: the nearest half by search, ties to the even encoding.
uint16_t ReferenceFp16(float f) {
  const double x = std::fabs(static_cast<double>(f));
  const uint16_t sign = std::signbit(f) ? 0x8000 : 0;
  if (x >= 65520.0) return sign | 0x7c00;
  uint16_t lo = 0, hi = 0x7bff;  // positive finite halves are ordered like their encodings
  while (lo < hi) {
    const uint16_t mid = static_cast<uint16_t>((lo + hi + 1) / 2);
    if (Fp16ToFloat(mid) <= x) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  if (lo == 0x7bff) return sign | lo;  // below 65520 by the check above
  const double below = Fp16ToFloat(lo);
  const double above = Fp16ToFloat(static_cast<uint16_t>(lo + 1));
  if (x - below < above - x) return sign | lo;
  if (x - below > above - x) return sign | static_cast<uint16_t>(lo + 1);
  return sign | ((lo & 1) ? static_cast<uint16_t>(lo + 1) : lo);
}

TEST(Fp16Test, MatchesReferenceOnRandomFloats) {
  std::mt19937 rng(1234);
  std::uniform_int_distribution<uint32_t> bits_dist;
  std::uniform_int_distribution<int> exp_dist(-30, 17);
  for (int i = 0; i < 200000; ++i) {
    float f;
    if (i % 2 == 0) {
      // Bias towards the fp16 range, including the subnormal and overflow boundaries.
      const uint32_t mantissa = bits_dist(rng) & 0x807fffffu;
      const uint32_t exponent = static_cast<uint32_t>(127 + exp_dist(rng));
      f = FromBits(mantissa | (exponent << 23));
    } else {
      f = FromBits(bits_dist(rng));
    }
    if (std::isnan(f)) continue;
    ASSERT_EQ(FloatToFp16(f), ReferenceFp16(f)) << std::hex << ToBits(f);
  }
}

TEST(ConvertTest, WidenAndNarrowUnaligned) {
  const std::vector<float> values = {0.0f, 1.0f, -1.5f, 3.140625f, 65504.0f, -1e-3f, 1e-6f};
  for (DType d : {DType::kF32, DType::kF16, DType::kBF16}) {
    // Offset by one byte so element accesses are misaligned.
    std::vector<uint8_t> buffer(values.size() * DTypeSize(d) + 1);
    NarrowFromFloat32(d, values.data(), values.size(), buffer.data() + 1);
    std::vector<float> widened(values.size());
    WidenToFloat32(d, buffer.data() + 1, values.size(), widened.data());
    for (size_t i = 0; i < values.size(); ++i) {
      float expected = values[i];
      if (d == DType::kF16) expected = Fp16ToFloat(FloatToFp16(values[i]));
      if (d == DType::kBF16) expected = Bf16ToFloat(FloatToBf16(values[i]));
      EXPECT_EQ(widened[i], expected) << DTypeName(d) << " " << i;
      EXPECT_NEAR(widened[i], values[i], std::fabs(values[i]) * 1e-2f + 1e-7f);
    }
  }
  // Zero elements touch nothing.
  WidenToFloat32(DType::kF32, nullptr, 0, nullptr);
  NarrowFromFloat32(DType::kBF16, nullptr, 0, nullptr);
}

// The array conversions (vectorised) agree bit for bit with the scalar ones, for every
// bf16 value, random and special floats, every tail length and misaligned pointers.
TEST(ConvertTest, Bf16ArraysMatchScalar) {
  std::vector<float> values;
  for (uint32_t h = 0; h < 0x10000; ++h) values.push_back(Bf16ToFloat(static_cast<uint16_t>(h)));
  std::mt19937 rng(99);
  std::uniform_int_distribution<uint32_t> bits;
  for (int i = 0; i < 100000; ++i) values.push_back(FromBits(bits(rng)));
  for (uint32_t special : {0x7f800001u, 0xff800001u, 0x7fc00000u, 0x7fffffffu, 0x7f7fffffu,
                           0x3f808000u, 0x3f818000u, 0x3f807fffu, 0x80000000u, 0x00000001u}) {
    values.push_back(FromBits(special));
  }
  for (size_t offset : {0, 1, 3}) {
    std::vector<uint8_t> narrow(values.size() * 2 + offset);
    NarrowFromFloat32(DType::kBF16, values.data(), values.size(), narrow.data() + offset);
    std::vector<float> wide(values.size() + 1);
    WidenToFloat32(DType::kBF16, narrow.data() + offset, values.size(), wide.data() + 1);
    for (size_t i = 0; i < values.size(); ++i) {
      uint16_t v;
      std::memcpy(&v, narrow.data() + offset + 2 * i, sizeof(v));
      ASSERT_EQ(v, FloatToBf16(values[i])) << std::hex << ToBits(values[i]);
      ASSERT_EQ(ToBits(wide[i + 1]), ToBits(Bf16ToFloat(v))) << i;
    }
  }
  for (size_t count = 0; count < 20; ++count) {
    std::vector<uint8_t> narrow(2 * count + 2, 0xab);
    NarrowFromFloat32(DType::kBF16, values.data() + 100, count, narrow.data());
    EXPECT_EQ(narrow[2 * count], 0xab) << "wrote past the end at count " << count;
    std::vector<float> wide(count + 1, 7.f);
    WidenToFloat32(DType::kBF16, narrow.data(), count, wide.data());
    EXPECT_EQ(wide[count], 7.f) << "wrote past the end at count " << count;
    for (size_t i = 0; i < count; ++i) {
      EXPECT_EQ(ToBits(wide[i]), ToBits(Bf16ToFloat(FloatToBf16(values[100 + i]))));
    }
  }
}

}  // namespace
}  // namespace dxs
