// The FP8 grouped FFN's activation passes (kernels/cuda/moe_fp8.cu) bit for bit:
// - LaunchQuantizeGroupedFp8 against the recipe computed here (per row and 128 channels: scale
//   max(amax, 1e-4) / 448 by IEEE division, value / scale rounded to e4m3, nearest even,
//   saturating; the scale in the row's expert's M-major block), over groups of amax from 1e-6
//   to 1e4 with negative zeros among them (the kernels divide by a reciprocal and a remainder,
//   which must round as the division does), bf16 and f32 rows, gathered
//   by index (one index outside the source: zeros), an expert without rows, rows past
//   offsets[E] left as they were, an odd number of groups a row (a warp step with one group),
//   16-byte aligned rows and rows that are not (the one-value-at-a-time loads);
// - LaunchSiluMulQuantizeGroupedFp8 against LaunchSiluMulPacked's bf16 rows quantized by
//   LaunchQuantizeGroupedFp8 (the same device expf, so the same bits; the host's expf may
//   differ from it in the last place).
// Without a device the GPU cases skip.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "common/dtype.h"
#include "gtest/gtest.h"
#include "kernels/cuda/ops.cuh"
#include "tests/kernels/cuda/cuda_test_util.h"

namespace dxs::cuda {
namespace {

constexpr uint8_t kUntouched = 0xab;  // e4m3 bytes nobody should write
constexpr float kUntouchedScale = -7.f;

template <typename T>
T* ToDevice(const std::vector<T>& host, size_t pad_bytes = 0) {
  char* p = nullptr;
  EXPECT_EQ(cudaMalloc(reinterpret_cast<void**>(&p), host.size() * sizeof(T) + pad_bytes),
            cudaSuccess);
  EXPECT_EQ(cudaMemcpy(p + pad_bytes, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice),
            cudaSuccess);
  return reinterpret_cast<T*>(p + pad_bytes);
}

template <typename T>
std::vector<T> ToHost(const T* p, size_t n) {
  std::vector<T> host(n);
  EXPECT_EQ(cudaMemcpy(host.data(), p, n * sizeof(T), cudaMemcpyDeviceToHost), cudaSuccess);
  return host;
}

// The passes' output: e4m3 [rows, k] and the scales, every expert's block M-major.
struct Quantized {
  std::vector<uint8_t> bytes;
  std::vector<float> scales;
};

// The recipe on the host: row r of values(r) (k floats) into its expert's block.
template <typename ValuesOf>
Quantized HostQuantize(int64_t num_rows, int64_t k, const std::vector<int32_t>& offsets,
                       ValuesOf values) {
  const int64_t groups = k / 128, experts = static_cast<int64_t>(offsets.size()) - 1;
  Quantized q{std::vector<uint8_t>(num_rows * k, kUntouched),
              std::vector<float>(num_rows * groups, kUntouchedScale)};
  for (int64_t e = 0; e < experts; ++e) {
    const int64_t begin = offsets[e], count = offsets[e + 1] - begin;
    for (int64_t r = begin; r < offsets[e + 1]; ++r) {
      const std::vector<float> v = values(r);
      for (int64_t g = 0; g < groups; ++g) {
        float amax = 0.f;
        for (int64_t j = g * 128; j < (g + 1) * 128; ++j) amax = std::max(amax, std::fabs(v[j]));
        const float scale = std::max(amax, 1e-4f) / 448.f;
        for (int64_t j = g * 128; j < (g + 1) * 128; ++j) {
          q.bytes[r * k + j] = FloatToFp8E4m3(v[j] / scale);
        }
        q.scales[begin * groups + g * count + (r - begin)] = scale;
      }
    }
  }
  return q;
}

struct Case {
  int64_t x_rows, num_rows, k;
  std::vector<int32_t> offsets;  // num_rows past offsets.back(): capacity left unwritten
  bool gather;                   // rows by index (one of them outside the source)
  ElemType type;                 // kBF16 or kF32
  size_t misalign_bytes;         // the source rows' start off 16-byte alignment
};

TEST(Fp8QuantizeCuda, QuantizeGroupedFp8IsTheRecipeBitForBit) {
  SKIP_WITHOUT_GPU();
  const std::vector<Case> cases = {
      {40, 40, 2048, {0, 5, 5, 17, 40}, false, ElemType::kBF16, 0},  // an empty expert
      {40, 36, 2048, {0, 9, 20, 30}, true, ElemType::kBF16, 0},      // capacity past the count
      {13, 24, 384, {0, 1, 11, 24}, true, ElemType::kF32, 0},        // 3 groups a row
      {9, 9, 768, {0, 4, 9}, false, ElemType::kBF16, 2},             // misaligned rows
      {7, 7, 128, {0, 7}, false, ElemType::kF32, 4},                 // one group, misaligned
      // A prefill's worth of values (8M), every bit of the division checked.
      {4096, 4096, 2048, {0, 1000, 1001, 4096}, false, ElemType::kBF16, 0},
      {2048, 2048, 2048, {0, 2048}, false, ElemType::kF32, 0},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(::testing::Message() << c.num_rows << " rows of " << c.k << ", gather " << c.gather
                                      << ", misaligned by " << c.misalign_bytes);
    std::mt19937 rng(static_cast<uint32_t>(c.k + c.num_rows));
    std::normal_distribution<float> dist(0.f, 1.f);
    std::vector<float> x(c.x_rows * c.k);
    for (int64_t i = 0; i < c.x_rows * c.k; ++i) {
      // Groups of amax from about 1e-6 (below the 1e-4 floor) to 1e4, and negative zeros.
      x[i] =
          i % 97 == 0 ? -0.f : dist(rng) * std::pow(10.f, static_cast<float>((i / 128) % 11 - 6));
      if (c.type == ElemType::kBF16) x[i] = Bf16ToFloat(FloatToBf16(x[i]));
    }
    for (int64_t j = 0; j < c.k; ++j) x[j] = 0.f;  // a row of zeros: scale 1e-4 / 448
    std::vector<int32_t> rows(c.num_rows);
    for (int64_t r = 0; r < c.num_rows; ++r) {
      rows[r] = static_cast<int32_t>((r * 7 + 3) % c.x_rows);
    }
    if (c.gather) rows[c.num_rows / 2] = static_cast<int32_t>(c.x_rows + 5);  // outside
    const Quantized want = HostQuantize(c.num_rows, c.k, c.offsets, [&](int64_t r) {
      const int64_t src = c.gather ? rows[r] : r;
      std::vector<float> v(c.k, 0.f);
      if (src < c.x_rows) std::copy(x.begin() + src * c.k, x.begin() + (src + 1) * c.k, v.begin());
      return v;
    });

    void* d_x = nullptr;
    if (c.type == ElemType::kBF16) {
      std::vector<uint16_t> bits(x.size());
      for (size_t i = 0; i < x.size(); ++i) bits[i] = FloatToBf16(x[i]);
      d_x = ToDevice(bits, c.misalign_bytes);
    } else {
      d_x = ToDevice(x, c.misalign_bytes);
    }
    int32_t* d_rows = ToDevice(rows);
    int32_t* d_offsets = ToDevice(c.offsets);
    uint8_t* d_out = ToDevice(std::vector<uint8_t>(c.num_rows * c.k, kUntouched));
    float* d_sfa = ToDevice(std::vector<float>(c.num_rows * (c.k / 128), kUntouchedScale));
    ASSERT_CUDA_OK(LaunchQuantizeGroupedFp8(
        d_x, c.type, c.x_rows, c.gather ? d_rows : nullptr, c.num_rows, c.k, d_offsets,
        static_cast<int64_t>(c.offsets.size()) - 1, d_out, d_sfa, nullptr));
    ASSERT_CUDA_OK(cudaDeviceSynchronize());
    EXPECT_EQ(ToHost(d_out, want.bytes.size()), want.bytes);
    const std::vector<float> scales = ToHost(d_sfa, want.scales.size());
    EXPECT_EQ(std::memcmp(scales.data(), want.scales.data(), scales.size() * sizeof(float)), 0);
    for (void* p : {static_cast<void*>(static_cast<char*>(d_x) - c.misalign_bytes),
                    static_cast<void*>(d_rows), static_cast<void*>(d_offsets),
                    static_cast<void*>(d_out), static_cast<void*>(d_sfa)}) {
      ASSERT_CUDA_OK(cudaFree(p));
    }
  }
}

TEST(Fp8QuantizeCuda, SiluMulQuantizeIsSiluMulThenQuantize) {
  SKIP_WITHOUT_GPU();
  // Qwen3-30B-A3B's inter (6 groups a row) and 3 groups, an empty expert, capacity past the
  // count.
  for (const int64_t inter : {int64_t{768}, int64_t{384}}) {
    SCOPED_TRACE(::testing::Message() << "inter " << inter);
    const int64_t num_rows = 70;
    const std::vector<int32_t> offsets = {0, 12, 12, 40, 66};
    std::mt19937 rng(static_cast<uint32_t>(inter));
    std::normal_distribution<float> dist(0.f, 2.f);
    std::vector<uint16_t> gu(num_rows * 2 * inter);
    for (auto& v : gu) v = FloatToBf16(dist(rng));
    uint16_t* d_gu = ToDevice(gu);
    int32_t* d_offsets = ToDevice(offsets);
    uint16_t* d_h = ToDevice(std::vector<uint16_t>(num_rows * inter));
    const size_t groups = inter / 128;
    uint8_t* d_want = ToDevice(std::vector<uint8_t>(num_rows * inter, kUntouched));
    float* d_want_sfa = ToDevice(std::vector<float>(num_rows * groups, kUntouchedScale));
    uint8_t* d_got = ToDevice(std::vector<uint8_t>(num_rows * inter, kUntouched));
    float* d_got_sfa = ToDevice(std::vector<float>(num_rows * groups, kUntouchedScale));
    const int64_t experts = static_cast<int64_t>(offsets.size()) - 1;
    ASSERT_CUDA_OK(
        LaunchSiluMulPacked(d_gu, ElemType::kBF16, num_rows, inter, d_h, ElemType::kBF16, nullptr));
    ASSERT_CUDA_OK(LaunchQuantizeGroupedFp8(d_h, ElemType::kBF16, num_rows, nullptr, num_rows,
                                            inter, d_offsets, experts, d_want, d_want_sfa,
                                            nullptr));
    ASSERT_CUDA_OK(LaunchSiluMulQuantizeGroupedFp8(d_gu, num_rows, inter, d_offsets, experts, d_got,
                                                   d_got_sfa, nullptr));
    ASSERT_CUDA_OK(cudaDeviceSynchronize());
    const std::vector<uint8_t> got = ToHost(d_got, num_rows * inter);
    EXPECT_EQ(got, ToHost(d_want, num_rows * inter));
    EXPECT_EQ(got[66 * inter], kUntouched);  // past offsets[E]
    const std::vector<float> got_sfa = ToHost(d_got_sfa, num_rows * groups);
    const std::vector<float> want_sfa = ToHost(d_want_sfa, num_rows * groups);
    EXPECT_EQ(std::memcmp(got_sfa.data(), want_sfa.data(), got_sfa.size() * sizeof(float)), 0);
    for (void* p :
         {static_cast<void*>(d_gu), static_cast<void*>(d_offsets), static_cast<void*>(d_h),
          static_cast<void*>(d_want), static_cast<void*>(d_want_sfa), static_cast<void*>(d_got),
          static_cast<void*>(d_got_sfa)}) {
      ASSERT_CUDA_OK(cudaFree(p));
    }
  }
}

}  // namespace
}  // namespace dxs::cuda
