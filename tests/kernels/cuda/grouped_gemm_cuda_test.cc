// The CUDA grouped expert GEMM: host-side guards (run everywhere, no device needed) and, on
// an sm_90 GPU, agreement with a host f32 GEMM on the same bf16 inputs. Without a device
// (or without CUTLASS in the build) the GPU cases skip.
#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <ostream>
#include <random>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/cuda/grouped_gemm.cuh"
#include "tests/kernels/cuda/cuda_test_util.h"

namespace dxs::cuda {
namespace {

constexpr ElemType kBF16 = ElemType::kBF16;
constexpr ElemType kF32 = ElemType::kF32;

const char* Name(ElemType t) { return t == kBF16 ? "bf16" : t == kF32 ? "f32" : "other"; }

// Fake device pointers, never dereferenced: every case below fails (or succeeds) on the
// host before any launch. `at` sets the alignment.
template <typename T>
T* Fake(uintptr_t at) {
  return reinterpret_cast<T*>(at);
}
const __nv_bfloat16* FakeA(uintptr_t at = 4096) { return Fake<const __nv_bfloat16>(at); }
const int32_t* FakeOffsets(uintptr_t at = 8192) { return Fake<const int32_t>(at); }
const __nv_bfloat16* const* FakeB(uintptr_t at = 12288) {
  return Fake<const __nv_bfloat16* const>(at);
}
void* FakeC(uintptr_t at = 16384) { return Fake<void>(at); }
void* FakeWorkspace(uintptr_t at = 20480) { return Fake<void>(at); }

// ---- Host-side guards: none of these may reach CUDA, so they pass without a device. ----

TEST(GroupedGemmCudaGuard, ZeroRowsWithNullPointersIsOkWithoutLaunching) {
  // A launch here would fail: no device on CI, and nothing to compute on a GPU.
  for (ElemType t : {kBF16, kF32}) {
    SCOPED_TRACE(Name(t));
    EXPECT_EQ(LaunchGroupedGemmBf16(nullptr, nullptr, nullptr, 128, 0, 1536, 2048, nullptr, t,
                                    nullptr, 0, nullptr),
              cudaSuccess);
    EXPECT_EQ(LaunchGroupedGemmBf16(nullptr, nullptr, nullptr, 0, 0, 2048, 768, nullptr, t, nullptr,
                                    0, nullptr),
              cudaSuccess);
  }
  // f32 C rows need only 16 bytes: n = 12 is fine there.
  EXPECT_EQ(LaunchGroupedGemmBf16(nullptr, nullptr, nullptr, 4, 0, 12, 16, nullptr, kF32, nullptr,
                                  0, nullptr),
            cudaSuccess);
}

TEST(GroupedGemmCudaGuard, RejectsBadSizesAndTypesEvenForEmptyBatches) {
  constexpr int64_t kBig = int64_t{1} << 31;  // past int32
  struct Case {
    int64_t num_experts, total_rows, n, k;
    ElemType c_type;
    const char* why;
  };
  for (const Case& c : {
           Case{-1, 0, 128, 128, kBF16, "negative num_experts"},
           Case{0, 5, 128, 128, kBF16, "rows and no experts"},
           Case{4, -1, 128, 128, kBF16, "negative total_rows"},
           Case{4, 0, 0, 128, kBF16, "n 0"},
           Case{4, 0, -8, 128, kBF16, "negative n"},
           Case{4, 0, 128, 0, kBF16, "k 0"},
           Case{4, 0, 128, -8, kBF16, "negative k"},
           Case{4, 0, 128, 12, kBF16, "k not a multiple of 8"},
           Case{4, 0, 128, 12, kF32, "k not a multiple of 8 (f32 C)"},
           Case{4, 0, 12, 128, kBF16, "n not a multiple of 8 (bf16 C)"},
           Case{4, 0, 6, 128, kF32, "n not a multiple of 4 (f32 C)"},
           Case{4, 0, 128, 128, ElemType::kF16, "f16 C"},
           Case{4, 0, 128, 128, ElemType::kI32, "i32 C"},
           Case{kBig, 0, 128, 128, kBF16, "num_experts past int32"},
           Case{4, kBig, 128, 128, kBF16, "total_rows past int32"},
           Case{4, 0, kBig, 128, kBF16, "n past int32"},
           Case{4, 0, 128, kBig, kBF16, "k past int32"},
       }) {
    SCOPED_TRACE(c.why);
    EXPECT_EQ(LaunchGroupedGemmBf16(nullptr, nullptr, nullptr, c.num_experts, c.total_rows, c.n,
                                    c.k, nullptr, c.c_type, nullptr, 0, nullptr),
              cudaErrorInvalidValue);
    EXPECT_EQ(GroupedGemmWorkspaceBytes(c.num_experts, c.total_rows, c.n, c.k, c.c_type), 0u);
    // With rows to compute and plausible pointers: the same answer.
    const int64_t rows = c.total_rows == 0 ? 16 : c.total_rows;
    EXPECT_EQ(LaunchGroupedGemmBf16(FakeA(), FakeOffsets(), FakeB(), c.num_experts, rows, c.n, c.k,
                                    FakeC(), c.c_type, FakeWorkspace(), 1 << 20, nullptr),
              cudaErrorInvalidValue);
  }
}

TEST(GroupedGemmCudaGuard, RejectsNullPointersWhenThereAreRows) {
  const size_t ws = 1 << 20;
  EXPECT_EQ(LaunchGroupedGemmBf16(nullptr, FakeOffsets(), FakeB(), 128, 16, 1536, 2048, FakeC(),
                                  kBF16, FakeWorkspace(), ws, nullptr),
            cudaErrorInvalidValue);
  EXPECT_EQ(LaunchGroupedGemmBf16(FakeA(), nullptr, FakeB(), 128, 16, 1536, 2048, FakeC(), kBF16,
                                  FakeWorkspace(), ws, nullptr),
            cudaErrorInvalidValue);
  EXPECT_EQ(LaunchGroupedGemmBf16(FakeA(), FakeOffsets(), nullptr, 128, 16, 1536, 2048, FakeC(),
                                  kBF16, FakeWorkspace(), ws, nullptr),
            cudaErrorInvalidValue);
  EXPECT_EQ(LaunchGroupedGemmBf16(FakeA(), FakeOffsets(), FakeB(), 128, 16, 1536, 2048, nullptr,
                                  kF32, FakeWorkspace(), ws, nullptr),
            cudaErrorInvalidValue);
  EXPECT_EQ(LaunchGroupedGemmBf16(FakeA(), FakeOffsets(), FakeB(), 128, 16, 1536, 2048, FakeC(),
                                  kF32, nullptr, ws, nullptr),
            cudaErrorInvalidValue);
}

TEST(GroupedGemmCudaGuard, RejectsMisalignedPointers) {
  const size_t ws = 1 << 20;
  // TMA needs 16-byte bases for A and C; the workspace holds TMA descriptors (128 here).
  EXPECT_EQ(LaunchGroupedGemmBf16(FakeA(4096 + 2), FakeOffsets(), FakeB(), 128, 16, 1536, 2048,
                                  FakeC(), kBF16, FakeWorkspace(), ws, nullptr),
            cudaErrorInvalidValue);
  EXPECT_EQ(LaunchGroupedGemmBf16(FakeA(), FakeOffsets(), FakeB(), 128, 16, 1536, 2048,
                                  FakeC(16384 + 8), kF32, FakeWorkspace(), ws, nullptr),
            cudaErrorInvalidValue);
  EXPECT_EQ(LaunchGroupedGemmBf16(FakeA(), FakeOffsets(8192 + 2), FakeB(), 128, 16, 1536, 2048,
                                  FakeC(), kBF16, FakeWorkspace(), ws, nullptr),
            cudaErrorInvalidValue);
  EXPECT_EQ(LaunchGroupedGemmBf16(FakeA(), FakeOffsets(), FakeB(12288 + 4), 128, 16, 1536, 2048,
                                  FakeC(), kBF16, FakeWorkspace(), ws, nullptr),
            cudaErrorInvalidValue);
  EXPECT_EQ(LaunchGroupedGemmBf16(FakeA(), FakeOffsets(), FakeB(), 128, 16, 1536, 2048, FakeC(),
                                  kBF16, FakeWorkspace(20480 + 64), ws, nullptr),
            cudaErrorInvalidValue);
}

#if !DXS_HAVE_CUTLASS
TEST(GroupedGemmCudaGuard, IsNotSupportedWithoutCutlass) {
  EXPECT_EQ(GroupedGemmWorkspaceBytes(128, 16, 1536, 2048, kBF16), 0u);
  EXPECT_EQ(LaunchGroupedGemmBf16(FakeA(), FakeOffsets(), FakeB(), 128, 16, 1536, 2048, FakeC(),
                                  kBF16, FakeWorkspace(), 1 << 20, nullptr),
            cudaErrorNotSupported);
}
#endif

// ---- Device cases: an sm_90 GPU (the kernels are sm_90a cubins); skip cleanly otherwise. ----

// Empty when the grouped GEMM can run here; otherwise why not.
std::string NoSm90Reason() {
  if (!DXS_HAVE_CUTLASS) return "built without CUTLASS (DXS_HAVE_CUTLASS=0)";
  int count = 0;
  cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess) {
    return std::string("no usable CUDA device (cudaGetDeviceCount: ") + cudaGetErrorName(err) +
           ": " + cudaGetErrorString(err) + ")";
  }
  if (count == 0) return "no CUDA device (cudaGetDeviceCount returned 0)";
  int device = 0, major = 0, minor = 0;
  err = cudaGetDevice(&device);
  if (err == cudaSuccess) {
    err = cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device);
  }
  if (err == cudaSuccess) {
    err = cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device);
  }
  if (err != cudaSuccess) return std::string("device query failed: ") + cudaGetErrorString(err);
  if (major != 9 || minor != 0) {
    return "needs compute capability 9.0 (sm_90a kernels); device " + std::to_string(device) +
           " is " + std::to_string(major) + "." + std::to_string(minor);
  }
  return "";
}

#define SKIP_WITHOUT_SM90()                                     \
  do {                                                          \
    if (std::string reason = NoSm90Reason(); !reason.empty()) { \
      GTEST_SKIP() << "GPU case skipped: " << reason;           \
    }                                                           \
  } while (0)

// A device buffer of `bytes`, freed on scope exit.
class DeviceBuffer {
 public:
  explicit DeviceBuffer(size_t bytes) : bytes_(bytes) {
    if (bytes_ > 0) err_ = cudaMalloc(&ptr_, bytes_);
  }
  ~DeviceBuffer() {
    if (ptr_ != nullptr) cudaFree(ptr_);
  }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  template <typename T = void>
  T* get() const {
    return static_cast<T*>(ptr_);
  }
  cudaError_t status() const { return err_; }
  // Synchronous: the launches below run on a non-blocking stream that would not wait.
  template <typename T>
  cudaError_t Upload(const std::vector<T>& host) {
    const cudaError_t e =
        cudaMemcpy(ptr_, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice);
    return e == cudaSuccess ? cudaDeviceSynchronize() : e;
  }

 private:
  size_t bytes_;
  void* ptr_ = nullptr;
  cudaError_t err_ = cudaSuccess;
};

constexpr int64_t kNumExperts = 128;
// Distinct weight matrices, shared round-robin by the experts (expert e uses e % 8): every
// expert still reads its own pointer, at 1/16 of the memory.
constexpr int64_t kNumWeights = 8;

enum class Routing {
  kSomeEmpty,  // rows spread at random over the experts e % 3 != 1 (the rest stay empty)
  kOneExpert,  // every row to expert 5: many M tiles in one group, 127 empty groups
};

std::vector<int32_t> MakeOffsets(Routing routing, int64_t total_rows, uint32_t seed) {
  std::vector<int32_t> counts(kNumExperts, 0);
  if (routing == Routing::kOneExpert) {
    counts[5] = static_cast<int32_t>(total_rows);
  } else {
    std::mt19937 rng(seed);
    std::uniform_int_distribution<int64_t> pick(0, kNumExperts - 1);
    for (int64_t r = 0; r < total_rows; ++r) {
      int64_t e = pick(rng);
      while (e % 3 == 1) e = pick(rng);
      ++counts[e];
    }
  }
  std::vector<int32_t> offsets(kNumExperts + 1, 0);
  for (int64_t e = 0; e < kNumExperts; ++e) offsets[e + 1] = offsets[e] + counts[e];
  return offsets;
}

std::vector<__nv_bfloat16> RandomBf16(size_t count, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> dist(-1.f, 1.f);
  std::vector<__nv_bfloat16> out(count);
  for (__nv_bfloat16& x : out) x = __float2bfloat16(dist(rng));
  return out;
}

std::vector<float> Widen(const std::vector<__nv_bfloat16>& x) {
  std::vector<float> out(x.size());
  for (size_t i = 0; i < x.size(); ++i) out[i] = __bfloat162float(x[i]);
  return out;
}

struct Case {
  int64_t n, k, total_rows;
  ElemType c_type;
  Routing routing;
};

std::ostream& operator<<(std::ostream& os, const Case& c) {
  return os << "n" << c.n << "_k" << c.k << "_rows" << c.total_rows << "_" << Name(c.c_type)
            << (c.routing == Routing::kOneExpert ? "_one_expert" : "_some_empty");
}

// Runs the GEMM on C poisoned with NaN and checks (1) every element was written (finite),
// (2) the rows in `check_rows` (all rows for small batches) against a host f32 GEMM of the
// same bf16 values. Rows of experts listed in `unweighted` get a null weight pointer even
// though they have rows: the kernel must skip them, leaving the poison.
void RunAndCheck(const Case& c, const std::vector<int64_t>& unweighted = {}) {
  const uint32_t seed = static_cast<uint32_t>(c.n * 7919 + c.k * 31 + c.total_rows);
  const std::vector<int32_t> offsets = MakeOffsets(c.routing, c.total_rows, seed);
  const std::vector<__nv_bfloat16> a = RandomBf16(static_cast<size_t>(c.total_rows * c.k), seed);
  const std::vector<__nv_bfloat16> w =
      RandomBf16(static_cast<size_t>(kNumWeights * c.n * c.k), seed + 1);
  const size_t c_elem = c.c_type == kBF16 ? 2 : 4;
  const size_t c_bytes = static_cast<size_t>(c.total_rows * c.n) * c_elem;

  DeviceBuffer a_dev(a.size() * sizeof(a[0])), w_dev(w.size() * sizeof(w[0]));
  DeviceBuffer off_dev(offsets.size() * sizeof(int32_t));
  DeviceBuffer b_ptrs_dev(kNumExperts * sizeof(void*)), c_dev(c_bytes);
  const size_t ws_bytes = GroupedGemmWorkspaceBytes(kNumExperts, c.total_rows, c.n, c.k, c.c_type);
  ASSERT_GT(ws_bytes, 0u);
  DeviceBuffer ws_dev(ws_bytes);
  for (const DeviceBuffer* b : {&a_dev, &w_dev, &off_dev, &b_ptrs_dev, &c_dev, &ws_dev}) {
    ASSERT_CUDA_OK(b->status());
  }

  std::vector<const __nv_bfloat16*> b_ptrs(kNumExperts, nullptr);
  std::vector<bool> skipped(kNumExperts, false);
  for (int64_t e : unweighted) skipped[e] = true;
  for (int64_t e = 0; e < kNumExperts; ++e) {
    if (offsets[e + 1] > offsets[e] && !skipped[e]) {
      b_ptrs[e] = w_dev.get<__nv_bfloat16>() + (e % kNumWeights) * c.n * c.k;
    }
  }
  ASSERT_CUDA_OK(a_dev.Upload(a));
  ASSERT_CUDA_OK(w_dev.Upload(w));
  ASSERT_CUDA_OK(off_dev.Upload(offsets));
  ASSERT_CUDA_OK(b_ptrs_dev.Upload(b_ptrs));
  ASSERT_CUDA_OK(cudaMemset(c_dev.get(), 0xff, c_bytes));  // NaN in bf16 and f32
  ASSERT_CUDA_OK(cudaDeviceSynchronize());                 // the memset is on the legacy stream

  cudaStream_t stream = nullptr;
  ASSERT_CUDA_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  const cudaError_t launched = LaunchGroupedGemmBf16(
      a_dev.get<__nv_bfloat16>(), off_dev.get<int32_t>(), b_ptrs_dev.get<const __nv_bfloat16*>(),
      kNumExperts, c.total_rows, c.n, c.k, c_dev.get(), c.c_type, ws_dev.get(), ws_bytes, stream);
  const cudaError_t synced = cudaStreamSynchronize(stream);
  ASSERT_CUDA_OK(cudaStreamDestroy(stream));
  ASSERT_CUDA_OK(launched);
  ASSERT_CUDA_OK(synced);

  std::vector<float> got(static_cast<size_t>(c.total_rows * c.n));
  if (c.c_type == kF32) {
    ASSERT_CUDA_OK(cudaMemcpy(got.data(), c_dev.get(), c_bytes, cudaMemcpyDeviceToHost));
  } else {
    std::vector<__nv_bfloat16> raw(got.size());
    ASSERT_CUDA_OK(cudaMemcpy(raw.data(), c_dev.get(), c_bytes, cudaMemcpyDeviceToHost));
    got = Widen(raw);
  }

  // Which expert owns each row, and which rows get the full reference: all for small
  // batches; else ~256 spread over the batch plus each expert's first and last.
  std::vector<int64_t> expert_of(c.total_rows);
  std::vector<bool> check(c.total_rows, c.total_rows <= 256);
  for (int64_t e = 0; e < kNumExperts; ++e) {
    for (int64_t r = offsets[e]; r < offsets[e + 1]; ++r) expert_of[r] = e;
    if (offsets[e + 1] > offsets[e]) {
      check[offsets[e]] = true;
      check[offsets[e + 1] - 1] = true;
    }
  }
  const int64_t stride = std::max<int64_t>(16, c.total_rows / 256);
  for (int64_t r = 0; r < c.total_rows; r += stride) check[r] = true;

  const std::vector<float> a_f = Widen(a), w_f = Widen(w);
  // Inputs uniform in [-1, 1]: a dot product of k terms has rms sqrt(k) / 3. bf16 C rounds
  // to 8 bits (2^-8 relative); f32 C differs by summation order only.
  const double scale = std::sqrt(static_cast<double>(c.k)) / 3;
  const double rel = c.c_type == kBF16 ? 1e-2 : 1e-3;
  int failures = 0;
  for (int64_t r = 0; r < c.total_rows && failures < 10; ++r) {
    const int64_t e = expert_of[r];
    const float* x = a_f.data() + r * c.k;
    const float* wt = w_f.data() + (e % kNumWeights) * c.n * c.k;
    for (int64_t j = 0; j < c.n && failures < 10; ++j) {
      const float v = got[r * c.n + j];
      if (skipped[e]) {
        if (!std::isnan(v)) {
          ADD_FAILURE() << "row " << r << " col " << j << " of weightless expert " << e
                        << " was written: " << v;
          ++failures;
        }
        continue;
      }
      if (!std::isfinite(v)) {
        ADD_FAILURE() << "row " << r << " (expert " << e << ") col " << j << " not written: " << v;
        ++failures;
        continue;
      }
      if (!check[r]) continue;
      const float* wrow = wt + j * c.k;
      double want = 0;
      for (int64_t i = 0; i < c.k; ++i) want += static_cast<double>(x[i]) * wrow[i];
      if (!(std::fabs(v - want) <= rel * (std::fabs(want) + scale))) {
        ADD_FAILURE() << "row " << r << " (expert " << e << ") col " << j << ": " << v << ", want "
                      << want;
        ++failures;
      }
    }
  }
}

class GroupedGemmCudaMatchesHost : public ::testing::TestWithParam<Case> {
 protected:
  void SetUp() override { SKIP_WITHOUT_SM90(); }
};

TEST_P(GroupedGemmCudaMatchesHost, PoisonedOutput) { RunAndCheck(GetParam()); }

// Up to 64 rows an expert on average (8192 rows here) the launch takes the 64-row ping-pong
// kernel, up to 128 (16384 rows) the 128x128 cooperative one, above that the 128x256 one
// (grouped_gemm.cc): all three are covered.
std::vector<Case> AllCases() {
  std::vector<Case> cases;
  // Qwen3-30B-A3B's expert FFN: gate_up (n 2 x 768, k 2048) and down (n 2048, k 768).
  for (auto [n, k] : {std::pair<int64_t, int64_t>{1536, 2048}, {2048, 768}}) {
    for (int64_t rows : {16, 128, 4096, 16384, 20000}) {
      for (ElemType t : {kBF16, kF32}) cases.push_back({n, k, rows, t, Routing::kSomeEmpty});
    }
    cases.push_back({n, k, 1000, kBF16, Routing::kOneExpert});   // 16 M tiles of 64
    cases.push_back({n, k, 9000, kF32, Routing::kOneExpert});    // 71 M tiles of 128
    cases.push_back({n, k, 16500, kBF16, Routing::kOneExpert});  // 129 M tiles of 128x256
  }
  // Odd sizes: one row; tiles cut in N (n 200 is not a multiple of 128) and K (k 72 of 64).
  cases.push_back({200, 72, 1, kF32, Routing::kSomeEmpty});
  cases.push_back({200, 72, 333, kBF16, Routing::kSomeEmpty});
  cases.push_back({200, 72, 20000, kBF16, Routing::kSomeEmpty});
  return cases;
}

INSTANTIATE_TEST_SUITE_P(Shapes, GroupedGemmCudaMatchesHost, ::testing::ValuesIn(AllCases()),
                         [](const ::testing::TestParamInfo<Case>& info) {
                           std::ostringstream name;
                           name << info.param;
                           return name.str();
                         });

TEST(GroupedGemmCuda, SkipsRowsOfExpertsWithoutWeights) {
  SKIP_WITHOUT_SM90();
  RunAndCheck({1536, 2048, 512, kBF16, Routing::kSomeEmpty}, /*unweighted=*/{0, 2, 64});
}

TEST(GroupedGemmCuda, RejectsTooSmallWorkspace) {
  SKIP_WITHOUT_SM90();
  const size_t ws_bytes = GroupedGemmWorkspaceBytes(kNumExperts, 16, 1536, 2048, kBF16);
  ASSERT_GT(ws_bytes, 0u);
  DeviceBuffer ws(ws_bytes);
  ASSERT_CUDA_OK(ws.status());
  // Real workspace, fake operands: the size check fires before anything is launched.
  EXPECT_EQ(LaunchGroupedGemmBf16(FakeA(), FakeOffsets(), FakeB(), kNumExperts, 16, 1536, 2048,
                                  FakeC(), kBF16, ws.get(), ws_bytes - 1, nullptr),
            cudaErrorInvalidValue);
  // More experts, more workspace.
  EXPECT_GT(GroupedGemmWorkspaceBytes(4 * kNumExperts, 16, 1536, 2048, kBF16), ws_bytes);
}

}  // namespace
}  // namespace dxs::cuda
