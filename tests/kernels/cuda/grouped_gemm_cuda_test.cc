// The CUDA grouped expert GEMM: host-side guards (run everywhere, no device needed) and, on
// an sm_90 GPU, agreement with a host f32 GEMM on the same bf16 inputs and with cuBLAS's
// grouped batched GEMM (cublasGemmGroupedBatchedEx, an independent cross-check). Without a
// device (or without CUTLASS in the build, or without a cuBLAS that has that entry point)
// the GPU cases skip.
#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <iostream>
#include <ostream>
#include <random>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "gtest/gtest.h"
#include "kernels/cuda/cublas_loader.h"
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

// ---- Cross-check: cuBLAS's grouped batched GEMM on the same inputs. ----
//
// cublasGemmGroupedBatchedEx takes its per-group sizes in host arrays, so the serving path
// (whose expert offsets live on the device) cannot use it without a synchronisation. Here
// the host knows the routing, and cuBLAS is an independent implementation of the same
// grouped GEMM: one group (group_size 1) per expert, with that expert's own row count,
// experts with no rows included.
//
// The column-major mapping. cuBLAS computes, per group, C = op(A) op(B) on column-major
// operands. A row-major [r, c] matrix with row stride c is, read column-major, its
// transpose: a [c, r] matrix with leading dimension c. So for expert e with m_e rows:
//   x_e (rows off[e].. of A)  row-major [m_e, k] = column-major x_e^T [k, m_e], ld k
//   W_e (its weight)          row-major [n, k]   = column-major W_e^T [k, n],   ld k
//   y_e (rows off[e].. of C)  row-major [m_e, n] = column-major y_e^T [n, m_e], ld n
// and y_e = x_e W_e^T  <=>  y_e^T = W_e x_e^T = (W_e^T)^T (x_e^T). cuBLAS's arguments:
//   transa = T, A = W_e (the k x n view), lda = k;  transb = N, B = x_e (the k x m_e view),
//   ldb = k;  m = n, n = m_e, k = k;  C = y_e (the n x m_e view), ldc = n.
// That is CudaBackend::Gemm's cublasGemmEx mapping, one group per expert. The expert's row
// count is cuBLAS's n, on which no leading dimension depends: an expert with no rows is a
// valid n = 0 group, which BLAS does nothing for.
//
// Types: A and B bf16 (CUDA_R_16BF), CUBLAS_COMPUTE_32F, float alpha 1 and beta 0 (host
// arrays, one value a group; beta 0 means C is not read, so its NaN poison cannot leak in),
// C bf16. This entry point answered CUBLAS_STATUS_NOT_SUPPORTED for bf16 inputs with an
// f32 C (cuBLAS 13.1 on an H200), so cuBLAS writes bf16 only. The CUTLASS path runs with
// both of its C types, bf16 (gate_up, and down into a bf16 y) and f32 (down into an f32
// y), and each is compared with cuBLAS's bf16.
//
// Tolerance. Both paths multiply the same bf16 values exactly (a bf16 x bf16 product fits
// in fp32) and sum the k products in fp32: CUTLASS's ElementAccumulator is float
// (grouped_gemm_sm90.cuh), cuBLAS runs CUBLAS_COMPUTE_32F, and the handle's
// CUBLAS_MATH_DISALLOW_REDUCED_PRECISION_REDUCTION keeps a split-K reduction, should cuBLAS
// pick one, in fp32 rather than in the bf16 output type. The fp32 sums then differ by
// summation order only. With inputs uniform in [-1, 1] a k-term dot product has rms
// scale = sqrt(k) / 3, which bounds the partial sums' size; each fp32 addition errs by at
// most 2^-24 of its result and the errors walk like sqrt(k): ~4e-5 for k 2048 (scale 15).
// The slack, sum_slack = 2^-12 * scale, allows ~100x that (room for tensor-core
// accumulation that rounds differently from IEEE additions) and is still ~40x tighter than
// the host test's 1% of scale. Each path then rounds its fp32 sum once into its C type; a
// bf16 value v has 8 significant bits, so its ulp is at most 2^-7 |v| and a rounding moves
// it by at most 2^-8 |v| (half an ulp):
// - CUTLASS bf16 vs cuBLAS bf16: two roundings, at most one bf16 ulp apart (sums a hair
//   apart can round to neighbouring bf16 values):  |d| <= 2^-7 max(|a|, |b|) + sum_slack.
// - CUTLASS f32 vs cuBLAS bf16: one rounding:       |d| <= 2^-8 max(|a|, |b|) + sum_slack.
// Against the host's double sums of the same bf16 values (exact to ~1e-16) the same bounds
// hold with one side exact: cuBLAS's bf16 within 2^-8 |v| + sum_slack, CUTLASS's f32
// within sum_slack. A wrong or swapped expert weight, a row shifted by one, a lost K tile
// or a NaN left by an unwritten element all fail.

// One case: a shape and each expert's row count (one cuBLAS group each).
struct CrossCase {
  std::string name;
  int64_t n, k;
  std::vector<int32_t> rows;
};

std::ostream& operator<<(std::ostream& os, const CrossCase& c) { return os << c.name; }

#define ASSERT_CUBLAS_OK(blas, expr)                                 \
  do {                                                               \
    const cublasStatus_t dxs_blas_st_ = (expr);                      \
    ASSERT_EQ(dxs_blas_st_, CUBLAS_STATUS_SUCCESS)                   \
        << #expr << ": " << (blas).status_name(dxs_blas_st_) << " (" \
        << (blas).status_string(dxs_blas_st_) << ")";                \
  } while (0)

// A non-blocking stream, destroyed on scope exit.
class TestStream {
 public:
  TestStream() { err_ = cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking); }
  ~TestStream() {
    if (stream_ != nullptr) cudaStreamDestroy(stream_);
  }
  TestStream(const TestStream&) = delete;
  TestStream& operator=(const TestStream&) = delete;
  cudaStream_t get() const { return stream_; }
  cudaError_t status() const { return err_; }

 private:
  cudaStream_t stream_ = nullptr;
  cudaError_t err_ = cudaSuccess;
};

// A cuBLAS handle, destroyed on scope exit (before the stream it runs on: declare it after).
class CublasHandle {
 public:
  explicit CublasHandle(const CublasApi& blas) : blas_(blas) {
    status_ = blas_.create(&handle_);
    if (status_ != CUBLAS_STATUS_SUCCESS) handle_ = nullptr;
  }
  ~CublasHandle() {
    if (handle_ != nullptr) blas_.destroy(handle_);
  }
  CublasHandle(const CublasHandle&) = delete;
  CublasHandle& operator=(const CublasHandle&) = delete;
  cublasHandle_t get() const { return handle_; }
  cublasStatus_t status() const { return status_; }

 private:
  const CublasApi& blas_;
  cublasHandle_t handle_ = nullptr;
  cublasStatus_t status_ = CUBLAS_STATUS_NOT_INITIALIZED;
};

// `count` elements of `type` (bf16 or f32) from the device, as floats.
cudaError_t DownloadWidened(const DeviceBuffer& buf, ElemType type, size_t count,
                            std::vector<float>* out) {
  out->assign(count, 0.f);
  if (type == kF32) {
    return cudaMemcpy(out->data(), buf.get(), count * sizeof(float), cudaMemcpyDeviceToHost);
  }
  std::vector<__nv_bfloat16> raw(count);
  const cudaError_t err =
      cudaMemcpy(raw.data(), buf.get(), count * sizeof(__nv_bfloat16), cudaMemcpyDeviceToHost);
  if (err == cudaSuccess) *out = Widen(raw);
  return err;
}

void RunCrossCheck(const CrossCase& c, const CublasApi& blas) {
  const int64_t num_experts = static_cast<int64_t>(c.rows.size());
  std::vector<int32_t> offsets(num_experts + 1, 0);
  for (int64_t e = 0; e < num_experts; ++e) offsets[e + 1] = offsets[e] + c.rows[e];
  const int64_t total_rows = offsets.back();
  ASSERT_GT(total_rows, 0);
  const uint32_t seed = static_cast<uint32_t>(c.n * 104729 + c.k * 131 + total_rows);
  const std::vector<__nv_bfloat16> a = RandomBf16(static_cast<size_t>(total_rows * c.k), seed);
  // A weight of its own for every expert, so that a mixed-up expert pointer shows.
  const std::vector<__nv_bfloat16> w =
      RandomBf16(static_cast<size_t>(num_experts * c.n * c.k), seed + 1);
  const size_t out_count = static_cast<size_t>(total_rows * c.n);

  DeviceBuffer a_dev(a.size() * sizeof(a[0])), w_dev(w.size() * sizeof(w[0]));
  DeviceBuffer off_dev(offsets.size() * sizeof(int32_t));
  DeviceBuffer b_ptrs_dev(num_experts * sizeof(void*));
  DeviceBuffer cutlass_bf16_dev(out_count * sizeof(__nv_bfloat16));
  DeviceBuffer cutlass_f32_dev(out_count * sizeof(float));
  DeviceBuffer cublas_c_dev(out_count * sizeof(__nv_bfloat16));
  DeviceBuffer cublas_a_ptrs(num_experts * sizeof(void*)),
      cublas_b_ptrs(num_experts * sizeof(void*));
  DeviceBuffer cublas_c_ptrs(num_experts * sizeof(void*));
  // One workspace for both CUTLASS launches (same stream, one after the other).
  const size_t ws_bytes =
      std::max(GroupedGemmWorkspaceBytes(num_experts, total_rows, c.n, c.k, kBF16),
               GroupedGemmWorkspaceBytes(num_experts, total_rows, c.n, c.k, kF32));
  ASSERT_GT(ws_bytes, 0u);
  DeviceBuffer ws_dev(ws_bytes);
  for (const DeviceBuffer* b :
       {&a_dev, &w_dev, &off_dev, &b_ptrs_dev, &cutlass_bf16_dev, &cutlass_f32_dev, &cublas_c_dev,
        &cublas_a_ptrs, &cublas_b_ptrs, &cublas_c_ptrs, &ws_dev}) {
    ASSERT_CUDA_OK(b->status());
  }

  // CUTLASS: expert e's weight, null for experts with no rows (its contract). cuBLAS: the
  // per-group A, B and C pointers (device arrays of device pointers), real ones for every
  // group; those of an n = 0 group are never read.
  const __nv_bfloat16* const w_base = w_dev.get<const __nv_bfloat16>();
  std::vector<const __nv_bfloat16*> cutlass_b(num_experts, nullptr);
  std::vector<const void*> cublas_a(num_experts), cublas_b(num_experts);
  std::vector<void*> cublas_c(num_experts);
  for (int64_t e = 0; e < num_experts; ++e) {
    const __nv_bfloat16* weight = w_base + e * c.n * c.k;
    if (c.rows[e] > 0) cutlass_b[e] = weight;
    cublas_a[e] = weight;
    cublas_b[e] = a_dev.get<const __nv_bfloat16>() + int64_t{offsets[e]} * c.k;
    cublas_c[e] = cublas_c_dev.get<__nv_bfloat16>() + int64_t{offsets[e]} * c.n;
  }
  ASSERT_CUDA_OK(a_dev.Upload(a));
  ASSERT_CUDA_OK(w_dev.Upload(w));
  ASSERT_CUDA_OK(off_dev.Upload(offsets));
  ASSERT_CUDA_OK(b_ptrs_dev.Upload(cutlass_b));
  ASSERT_CUDA_OK(cublas_a_ptrs.Upload(cublas_a));
  ASSERT_CUDA_OK(cublas_b_ptrs.Upload(cublas_b));
  ASSERT_CUDA_OK(cublas_c_ptrs.Upload(cublas_c));
  // NaN (all ones in bf16 and f32) in every output: an element neither path writes stays NaN.
  ASSERT_CUDA_OK(cudaMemset(cutlass_bf16_dev.get(), 0xff, out_count * sizeof(__nv_bfloat16)));
  ASSERT_CUDA_OK(cudaMemset(cutlass_f32_dev.get(), 0xff, out_count * sizeof(float)));
  ASSERT_CUDA_OK(cudaMemset(cublas_c_dev.get(), 0xff, out_count * sizeof(__nv_bfloat16)));
  ASSERT_CUDA_OK(cudaDeviceSynchronize());  // the memsets are on the legacy stream

  TestStream stream;
  ASSERT_CUDA_OK(stream.status());
  const auto launch_cutlass = [&](void* out, ElemType type) {
    return LaunchGroupedGemmBf16(a_dev.get<__nv_bfloat16>(), off_dev.get<int32_t>(),
                                 b_ptrs_dev.get<const __nv_bfloat16*>(), num_experts, total_rows,
                                 c.n, c.k, out, type, ws_dev.get(), ws_bytes, stream.get());
  };
  ASSERT_CUDA_OK(launch_cutlass(cutlass_bf16_dev.get(), kBF16));
  ASSERT_CUDA_OK(launch_cutlass(cutlass_f32_dev.get(), kF32));

  CublasHandle handle(blas);
  ASSERT_CUBLAS_OK(blas, handle.status());
  ASSERT_CUBLAS_OK(blas, blas.set_stream(handle.get(), stream.get()));
  ASSERT_CUBLAS_OK(blas, blas.set_math_mode(handle.get(),
                                            static_cast<cublasMath_t>(
                                                CUBLAS_DEFAULT_MATH |
                                                CUBLAS_MATH_DISALLOW_REDUCED_PRECISION_REDUCTION)));
  // Host arrays, one entry a group (the mapping is worked out above).
  const int groups = static_cast<int>(num_experts);
  const std::vector<cublasOperation_t> trans_a(groups, CUBLAS_OP_T);
  const std::vector<cublasOperation_t> trans_b(groups, CUBLAS_OP_N);
  const std::vector<int> m_array(groups, static_cast<int>(c.n));  // output columns
  const std::vector<int> n_array(c.rows.begin(), c.rows.end());   // the expert's rows
  const std::vector<int> k_array(groups, static_cast<int>(c.k));
  const std::vector<int> lda(groups, static_cast<int>(c.k));
  const std::vector<int> ldb(groups, static_cast<int>(c.k));
  const std::vector<int> ldc(groups, static_cast<int>(c.n));
  const std::vector<float> alpha(groups, 1.f), beta(groups, 0.f);
  const std::vector<int> group_size(groups, 1);
  ASSERT_CUBLAS_OK(
      blas, blas.gemm_grouped_batched_ex(
                handle.get(), trans_a.data(), trans_b.data(), m_array.data(), n_array.data(),
                k_array.data(), alpha.data(), cublas_a_ptrs.get<const void* const>(), CUDA_R_16BF,
                lda.data(), cublas_b_ptrs.get<const void* const>(), CUDA_R_16BF, ldb.data(),
                beta.data(), cublas_c_ptrs.get<void* const>(), CUDA_R_16BF, ldc.data(), groups,
                group_size.data(), CUBLAS_COMPUTE_32F));
  ASSERT_CUDA_OK(cudaStreamSynchronize(stream.get()));

  std::vector<float> cutlass_bf16, cutlass_f32, cublas_bf16;
  ASSERT_CUDA_OK(DownloadWidened(cutlass_bf16_dev, kBF16, out_count, &cutlass_bf16));
  ASSERT_CUDA_OK(DownloadWidened(cutlass_f32_dev, kF32, out_count, &cutlass_f32));
  ASSERT_CUDA_OK(DownloadWidened(cublas_c_dev, kBF16, out_count, &cublas_bf16));

  std::vector<int64_t> expert_of(total_rows, -1);
  for (int64_t e = 0; e < num_experts; ++e) {
    for (int64_t r = offsets[e]; r < offsets[e + 1]; ++r) expert_of[r] = e;
  }
  const double scale = std::sqrt(static_cast<double>(c.k)) / 3;
  const double sum_slack = scale / 4096;  // 2^-12 scale (see above)
  constexpr double kBf16Ulp = 1.0 / 128;  // a bf16 ulp at v is at most 2^-7 |v|
  constexpr double kBf16HalfUlp = 1.0 / 256;
  constexpr int kMaxFailures = 20;

  // 1. Every element, GPU against GPU.
  int failures = 0;
  double max_diff_bf16 = 0, max_diff_f32 = 0;
  int64_t differing_bf16 = 0;
  for (int64_t r = 0; r < total_rows && failures < kMaxFailures; ++r) {
    for (int64_t j = 0; j < c.n && failures < kMaxFailures; ++j) {
      const size_t i = static_cast<size_t>(r * c.n + j);
      const double ref = cublas_bf16[i], got_bf16 = cutlass_bf16[i], got_f32 = cutlass_f32[i];
      if (!std::isfinite(ref) || !std::isfinite(got_bf16) || !std::isfinite(got_f32)) {
        ADD_FAILURE() << "row " << r << " (expert " << expert_of[r] << ") col " << j
                      << " not written (NaN poison left?): cuBLAS " << ref << ", CUTLASS bf16 "
                      << got_bf16 << ", CUTLASS f32 " << got_f32;
        ++failures;
        continue;
      }
      const double d_bf16 = std::fabs(got_bf16 - ref), d_f32 = std::fabs(got_f32 - ref);
      max_diff_bf16 = std::max(max_diff_bf16, d_bf16);
      max_diff_f32 = std::max(max_diff_f32, d_f32);
      if (d_bf16 != 0) ++differing_bf16;
      const double tol_bf16 = kBf16Ulp * std::max(std::fabs(got_bf16), std::fabs(ref)) + sum_slack;
      const double tol_f32 =
          kBf16HalfUlp * std::max(std::fabs(got_f32), std::fabs(ref)) + sum_slack;
      if (!(d_bf16 <= tol_bf16) || !(d_f32 <= tol_f32)) {
        ADD_FAILURE() << "row " << r << " (expert " << expert_of[r] << ") col " << j << ": cuBLAS "
                      << ref << ", CUTLASS bf16 " << got_bf16 << " (tolerance " << tol_bf16
                      << "), CUTLASS f32 " << got_f32 << " (tolerance " << tol_f32 << ")";
        ++failures;
      }
    }
  }

  // 2. Sampled rows against the host's double GEMM of the same bf16 values, so that the two
  // paths cannot agree on a wrong answer: every expert's first and last row (all rows of the
  // 1-row experts) and ~64 rows spread over the batch.
  std::vector<bool> check(total_rows, false);
  for (int64_t e = 0; e < num_experts; ++e) {
    if (offsets[e + 1] > offsets[e]) {
      check[offsets[e]] = true;
      check[offsets[e + 1] - 1] = true;
    }
  }
  for (int64_t r = 0; r < total_rows; r += std::max<int64_t>(1, total_rows / 64)) check[r] = true;
  const std::vector<float> a_f = Widen(a), w_f = Widen(w);
  int64_t checked = 0;
  double max_want = 0;
  for (int64_t r = 0; r < total_rows && failures < kMaxFailures; ++r) {
    if (!check[r]) continue;
    const int64_t e = expert_of[r];
    const float* x = a_f.data() + r * c.k;
    const float* wt = w_f.data() + e * c.n * c.k;
    for (int64_t j = 0; j < c.n && failures < kMaxFailures; ++j) {
      const float* wrow = wt + j * c.k;
      double want = 0;
      for (int64_t i = 0; i < c.k; ++i) want += static_cast<double>(x[i]) * wrow[i];
      max_want = std::max(max_want, std::fabs(want));
      ++checked;
      const size_t idx = static_cast<size_t>(r * c.n + j);
      const double ref = cublas_bf16[idx], got_f32 = cutlass_f32[idx];
      const double tol_ref = kBf16HalfUlp * std::max(std::fabs(ref), std::fabs(want)) + sum_slack;
      if (!(std::fabs(ref - want) <= tol_ref) || !(std::fabs(got_f32 - want) <= sum_slack)) {
        ADD_FAILURE() << "row " << r << " (expert " << e << ") col " << j << ": host " << want
                      << ", cuBLAS bf16 " << ref << " (tolerance " << tol_ref << "), CUTLASS f32 "
                      << got_f32 << " (tolerance " << sum_slack << ")";
        ++failures;
      }
    }
  }
  EXPECT_GT(checked, 0);
  // The inputs are not degenerate: all-zero outputs could not have matched the host.
  EXPECT_GT(max_want, scale / 2);

  // For the record (docs/gpu.md): how far apart the two implementations are.
  const double differing_share = static_cast<double>(differing_bf16) / out_count;
  ::testing::Test::RecordProperty("max_abs_diff_bf16", std::to_string(max_diff_bf16));
  ::testing::Test::RecordProperty("max_abs_diff_f32", std::to_string(max_diff_f32));
  ::testing::Test::RecordProperty("bf16_differing_share", std::to_string(differing_share));
  std::cout << "[ cross-check ] " << c.name << ": " << total_rows << " rows over " << num_experts
            << " experts; CUTLASS bf16 vs cuBLAS bf16: max |d| " << max_diff_bf16 << ", "
            << differing_share * 100 << "% of elements differ; CUTLASS f32 vs cuBLAS "
            << "bf16: max |d| " << max_diff_f32 << " (rms of an element ~" << scale << ")\n";
}

class GroupedGemmCudaMatchesCublas : public ::testing::TestWithParam<CrossCase> {
 protected:
  void SetUp() override {
    SKIP_WITHOUT_GPU();
    SKIP_WITHOUT_SM90();
    const absl::StatusOr<const CublasApi*> blas = LoadCublas();
    if (!blas.ok()) {
      GTEST_SKIP() << "cuBLAS cross-check skipped: " << blas.status().ToString();
    }
    if ((*blas)->gemm_grouped_batched_ex == nullptr) {
      GTEST_SKIP() << "cuBLAS cross-check skipped: libcublas.so." << CUBLAS_VER_MAJOR
                   << " has no cublasGemmGroupedBatchedEx (cuBLAS 12.5 and later have it)";
    }
    blas_ = *blas;
  }

  const CublasApi* blas_ = nullptr;
};

TEST_P(GroupedGemmCudaMatchesCublas, PoisonedOutputs) { RunCrossCheck(GetParam(), *blas_); }

std::vector<CrossCase> CrossCases() {
  // Rows per expert, 12 experts: empty experts (first, last and between), 1-row experts,
  // odd counts, and one large expert. With 12 experts the launch picks its tiles from the
  // total (grouped_gemm.cc): up to 768 rows the 64x128 ping-pong kernel, up to 1536 the
  // 128x128 cooperative one, above that the 128x256 one; one routing for each.
  const std::vector<int32_t> decode = {1, 0, 3, 1, 0, 5, 1, 17, 0, 1, 11, 0};         // 40
  const std::vector<int32_t> medium = {0, 1, 77, 301, 0, 131, 1, 99, 3, 0, 255, 33};  // 901
  const std::vector<int32_t> large = {0, 1, 7, 0, 33, 1, 129, 0, 255, 3, 2501, 64};   // 2994
  // Qwen3-30B-A3B's experts (hidden 2048, intermediate 768): gate_up is [2 x 768, 2048],
  // down [2048, 768]; and a small shape that cuts tiles in N (200) and K (72).
  struct Shape {
    const char* name;
    int64_t n, k;
  };
  struct Counts {
    const char* name;
    const std::vector<int32_t>* rows;
  };
  const Shape shapes[] = {
      {"qwen_gate_up", 1536, 2048}, {"qwen_down", 2048, 768}, {"small", 200, 72}};
  const Counts counts[] = {{"decode", &decode}, {"medium", &medium}, {"large_expert", &large}};
  std::vector<CrossCase> cases;
  for (const Shape& shape : shapes) {
    for (const Counts& routing : counts) {
      cases.push_back(
          {std::string(shape.name) + "_" + routing.name, shape.n, shape.k, *routing.rows});
    }
  }
  return cases;
}

INSTANTIATE_TEST_SUITE_P(Shapes, GroupedGemmCudaMatchesCublas, ::testing::ValuesIn(CrossCases()),
                         [](const ::testing::TestParamInfo<CrossCase>& info) {
                           return info.param.name;
                         });

}  // namespace
}  // namespace dxs::cuda
