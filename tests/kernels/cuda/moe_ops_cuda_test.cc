// The CUDA MoE kernels (kernels/cuda/moe_ops.cu): host-side guards (run everywhere, no
// device needed) and, on a GPU, agreement with the CPU backend's ops on seeded random
// inputs: integer outputs identical, float sums bit-identical in f32 (same order) and
// within one rounding when stored narrower. Without a device the GPU cases skip.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "common/dtype.h"
#include "gtest/gtest.h"
#include "kernels/backend.h"
#include "kernels/cuda/ops.cuh"
#include "kernels/tensor.h"
#include "tests/kernels/cuda/cuda_test_util.h"

namespace dxs::cuda {
namespace {

// A distinct, aligned, never dereferenced pointer: the guards fire before any launch.
template <typename T>
T* Fake(uintptr_t slot) {
  return reinterpret_cast<T*>(slot * 256);
}

// ---- Host-side guards: none of these may reach CUDA, so they pass without a device. ----

TEST(MoeOpsCudaGuard, WorkspaceSizesArePlainArithmetic) {
  EXPECT_EQ(DispatchLayoutWorkspaceBytes(0, 8, 4), 0u);
  EXPECT_EQ(DispatchLayoutWorkspaceBytes(16, 0, 4), 0u);
  EXPECT_EQ(SortPairsWorkspaceBytes(0, 128), 0u);
  EXPECT_EQ(ScaleAddRowsWorkspaceBytes(0, 16), 0u);
  EXPECT_GT(DispatchLayoutWorkspaceBytes(1, 1, 1), 0u);
  EXPECT_GT(SortPairsWorkspaceBytes(1, 1), 0u);
  EXPECT_GT(ScaleAddRowsWorkspaceBytes(1, 1), 0u);
  // More work never needs less scratch.
  EXPECT_GE(DispatchLayoutWorkspaceBytes(16384, 8, 64), DispatchLayoutWorkspaceBytes(4096, 8, 64));
  EXPECT_GE(DispatchLayoutWorkspaceBytes(4096, 8, 64), DispatchLayoutWorkspaceBytes(4096, 8, 8));
  EXPECT_GE(SortPairsWorkspaceBytes(131072, 128), SortPairsWorkspaceBytes(1024, 128));
  EXPECT_GE(ScaleAddRowsWorkspaceBytes(1024, 70000), ScaleAddRowsWorkspaceBytes(1024, 16));
  EXPECT_GE(ScaleAddRowsWorkspaceBytes(131072, 16384), ScaleAddRowsWorkspaceBytes(1024, 16384));
}

TEST(MoeOpsCudaGuard, ZeroWorkWithNullPointersIsOkWithoutLaunching) {
  EXPECT_EQ(LaunchSortPairsByExpert(nullptr, 0, 128, nullptr, nullptr, nullptr, 0, nullptr),
            cudaSuccess);
  EXPECT_EQ(LaunchCombineRows(nullptr, ElemType::kBF16, nullptr, nullptr, 4, 0, 2048, nullptr,
                              ElemType::kBF16, nullptr),
            cudaSuccess);
  EXPECT_EQ(LaunchCombineRows(nullptr, ElemType::kF32, nullptr, nullptr, 4, 16, 0, nullptr,
                              ElemType::kF32, nullptr),
            cudaSuccess);
  EXPECT_EQ(LaunchScaleAddRows(nullptr, ElemType::kF32, nullptr, nullptr, 0, 64, nullptr, 16,
                               nullptr, 0, nullptr),
            cudaSuccess);
  EXPECT_EQ(LaunchScaleAddRows(nullptr, ElemType::kF32, nullptr, nullptr, 5, 0, nullptr, 16,
                               nullptr, 0, nullptr),
            cudaSuccess);
}

TEST(MoeOpsCudaGuard, DispatchLayoutRejectsBadArguments) {
  const int32_t* ids = Fake<const int32_t>(1);
  const float* weights = Fake<const float>(2);
  const int32_t* owner = Fake<const int32_t>(3);
  int32_t* per_rank_tokens = Fake<int32_t>(4);
  int32_t* per_rank_pairs = Fake<int32_t>(5);
  int32_t* per_expert = Fake<int32_t>(6);
  int32_t* token_rows = Fake<int32_t>(7);
  int32_t* pairs = Fake<int32_t>(8);
  void* ws = Fake<void>(9);
  const size_t bytes = DispatchLayoutWorkspaceBytes(16, 8, 4);
  auto launch = [&](int64_t tokens, int64_t k, int64_t experts, int64_t ranks) {
    return LaunchDispatchLayout(ids, weights, owner, 1, tokens, k, experts, ranks, per_rank_tokens,
                                per_rank_pairs, per_expert, token_rows, pairs, ws, bytes, nullptr);
  };
  EXPECT_EQ(launch(16, 8, 128, 0), cudaErrorInvalidValue);
  EXPECT_EQ(launch(0, 8, 128, 0), cudaErrorInvalidValue);  // ranks are checked even when empty
  EXPECT_EQ(launch(16, 8, 128, -1), cudaErrorInvalidValue);
  EXPECT_EQ(launch(-1, 8, 128, 4), cudaErrorInvalidValue);
  EXPECT_EQ(launch(16, -1, 128, 4), cudaErrorInvalidValue);
  EXPECT_EQ(launch(16, 8, -1, 4), cudaErrorInvalidValue);
  EXPECT_EQ(launch(16, 8, 0, 4), cudaErrorInvalidValue);  // pairs but no expert to own them
  EXPECT_EQ(launch(int64_t{1} << 28, 16, 128, 1), cudaErrorInvalidValue);  // pairs overflow i32
  EXPECT_EQ(launch(int64_t{1} << 26, 1, 128, 64), cudaErrorInvalidValue);  // cells overflow i32
  EXPECT_EQ(launch(int64_t{1} << 40, int64_t{1} << 40, 128, 4), cudaErrorInvalidValue);

  // Too little workspace, or none.
  EXPECT_EQ(
      LaunchDispatchLayout(ids, weights, owner, 1, 16, 8, 128, 4, per_rank_tokens, per_rank_pairs,
                           per_expert, token_rows, pairs, ws, bytes - 1, nullptr),
      cudaErrorInvalidValue);
  EXPECT_EQ(
      LaunchDispatchLayout(ids, weights, owner, 1, 16, 8, 128, 4, per_rank_tokens, per_rank_pairs,
                           per_expert, token_rows, pairs, nullptr, bytes, nullptr),
      cudaErrorInvalidValue);
  // Null pointers with pairs to lay out.
  for (int which = 0; which < 7; ++which) {
    SCOPED_TRACE(::testing::Message() << "null pointer " << which);
    EXPECT_EQ(LaunchDispatchLayout(which == 0 ? nullptr : ids, which == 1 ? nullptr : weights,
                                   which == 2 ? nullptr : owner, 1, 16, 8, 128, 4,
                                   which == 3 ? nullptr : per_rank_tokens,
                                   which == 4 ? nullptr : per_rank_pairs,
                                   which == 5 ? nullptr : per_expert,
                                   which == 6 ? nullptr : token_rows, pairs, ws, bytes, nullptr),
              cudaErrorInvalidValue);
  }
  EXPECT_EQ(
      LaunchDispatchLayout(ids, weights, owner, 1, 16, 8, 128, 4, per_rank_tokens, per_rank_pairs,
                           per_expert, token_rows, nullptr, ws, bytes, nullptr),
      cudaErrorInvalidValue);
  // Zero tokens still writes the counts: their pointers are needed.
  EXPECT_EQ(LaunchDispatchLayout(nullptr, nullptr, nullptr, 1, 0, 8, 128, 4, nullptr,
                                 per_rank_pairs, per_expert, nullptr, nullptr, nullptr, 0, nullptr),
            cudaErrorInvalidValue);
  EXPECT_EQ(LaunchDispatchLayout(nullptr, nullptr, nullptr, 1, 0, 8, 128, 4, per_rank_tokens,
                                 per_rank_pairs, nullptr, nullptr, nullptr, nullptr, 0, nullptr),
            cudaErrorInvalidValue);
}

TEST(MoeOpsCudaGuard, SortPairsRejectsBadArguments) {
  const int32_t* experts = Fake<const int32_t>(1);
  int32_t* order = Fake<int32_t>(2);
  int32_t* offsets = Fake<int32_t>(3);
  void* ws = Fake<void>(4);
  const size_t bytes = SortPairsWorkspaceBytes(100, 128);
  EXPECT_EQ(LaunchSortPairsByExpert(experts, -1, 128, order, offsets, ws, bytes, nullptr),
            cudaErrorInvalidValue);
  EXPECT_EQ(LaunchSortPairsByExpert(experts, 100, 0, order, offsets, ws, bytes, nullptr),
            cudaErrorInvalidValue);
  EXPECT_EQ(LaunchSortPairsByExpert(nullptr, 0, 0, nullptr, nullptr, nullptr, 0, nullptr),
            cudaErrorInvalidValue);  // experts are checked even when empty, like the CPU's
  EXPECT_EQ(LaunchSortPairsByExpert(experts, 100, -5, order, offsets, ws, bytes, nullptr),
            cudaErrorInvalidValue);
  EXPECT_EQ(
      LaunchSortPairsByExpert(experts, int64_t{1} << 31, 128, order, offsets, ws, bytes, nullptr),
      cudaErrorInvalidValue);
  EXPECT_EQ(LaunchSortPairsByExpert(nullptr, 100, 128, order, offsets, ws, bytes, nullptr),
            cudaErrorInvalidValue);
  EXPECT_EQ(LaunchSortPairsByExpert(experts, 100, 128, nullptr, offsets, ws, bytes, nullptr),
            cudaErrorInvalidValue);
  EXPECT_EQ(LaunchSortPairsByExpert(experts, 100, 128, order, nullptr, ws, bytes, nullptr),
            cudaErrorInvalidValue);
  EXPECT_EQ(LaunchSortPairsByExpert(experts, 100, 128, order, offsets, nullptr, bytes, nullptr),
            cudaErrorInvalidValue);
  EXPECT_EQ(LaunchSortPairsByExpert(experts, 100, 128, order, offsets, ws, bytes - 1, nullptr),
            cudaErrorInvalidValue);
  // The same bytes do not cover more pairs.
  EXPECT_LT(bytes, SortPairsWorkspaceBytes(1000, 128));
  EXPECT_EQ(LaunchSortPairsByExpert(experts, 1000, 128, order, offsets, ws, bytes, nullptr),
            cudaErrorInvalidValue);
  // Payloads: a count outside [0, kMaxSortPayloads], or a null array.
  SortPayloads payloads;
  payloads.count = kMaxSortPayloads + 1;
  EXPECT_EQ(
      LaunchSortPairsByExpert(experts, 100, 128, order, offsets, ws, bytes, nullptr, payloads),
      cudaErrorInvalidValue);
  payloads.count = -1;
  EXPECT_EQ(
      LaunchSortPairsByExpert(experts, 100, 128, order, offsets, ws, bytes, nullptr, payloads),
      cudaErrorInvalidValue);
  payloads.count = 1;
  payloads.in[0] = Fake<const int32_t>(5);
  EXPECT_EQ(
      LaunchSortPairsByExpert(experts, 100, 128, order, offsets, ws, bytes, nullptr, payloads),
      cudaErrorInvalidValue);  // out[0] is null
}

TEST(MoeOpsCudaGuard, CombineRowsRejectsBadArguments) {
  const void* recv = Fake<const void>(1);
  const int32_t* token_rows = Fake<const int32_t>(2);
  const int64_t* offsets = Fake<const int64_t>(3);
  void* out = Fake<void>(4);
  for (ElemType bad : {ElemType::kI32, ElemType::kI64}) {
    // Types are checked even with nothing to combine.
    EXPECT_EQ(
        LaunchCombineRows(recv, bad, token_rows, offsets, 2, 0, 64, out, ElemType::kF32, nullptr),
        cudaErrorInvalidValue);
    EXPECT_EQ(
        LaunchCombineRows(recv, ElemType::kF32, token_rows, offsets, 2, 8, 64, out, bad, nullptr),
        cudaErrorInvalidValue);
  }
  EXPECT_EQ(LaunchCombineRows(recv, static_cast<ElemType>(99), token_rows, offsets, 2, 8, 64, out,
                              ElemType::kF32, nullptr),
            cudaErrorInvalidValue);
  EXPECT_EQ(LaunchCombineRows(recv, ElemType::kF32, token_rows, offsets, -1, 8, 64, out,
                              ElemType::kF32, nullptr),
            cudaErrorInvalidValue);
  EXPECT_EQ(LaunchCombineRows(recv, ElemType::kF32, token_rows, offsets, 2, -1, 64, out,
                              ElemType::kF32, nullptr),
            cudaErrorInvalidValue);
  EXPECT_EQ(LaunchCombineRows(recv, ElemType::kF32, token_rows, offsets, 2, 8, -1, out,
                              ElemType::kF32, nullptr),
            cudaErrorInvalidValue);
  EXPECT_EQ(LaunchCombineRows(recv, ElemType::kF32, token_rows, offsets, 2, 8, 64, nullptr,
                              ElemType::kF32, nullptr),
            cudaErrorInvalidValue);
  EXPECT_EQ(LaunchCombineRows(recv, ElemType::kF32, token_rows, nullptr, 2, 8, 64, out,
                              ElemType::kF32, nullptr),
            cudaErrorInvalidValue);
}

TEST(MoeOpsCudaGuard, ScaleAddRowsRejectsBadArguments) {
  const float* src = Fake<const float>(1);
  const float* scales = Fake<const float>(2);
  const int32_t* rows = Fake<const int32_t>(3);
  float* dst = Fake<float>(4);
  void* ws = Fake<void>(5);
  const size_t bytes = ScaleAddRowsWorkspaceBytes(100, 16);
  auto launch = [&](int64_t n, int64_t cols, int64_t dst_rows, size_t ws_bytes) {
    return LaunchScaleAddRows(src, ElemType::kF32, scales, rows, n, cols, dst, dst_rows, ws,
                              ws_bytes, nullptr);
  };
  EXPECT_EQ(launch(-1, 64, 16, bytes), cudaErrorInvalidValue);
  EXPECT_EQ(launch(100, -1, 16, bytes), cudaErrorInvalidValue);
  EXPECT_EQ(launch(100, 64, -1, bytes), cudaErrorInvalidValue);
  EXPECT_EQ(launch(100, 64, 0, bytes), cudaErrorInvalidValue);  // every row out of range
  EXPECT_EQ(launch(100, 64, 16, bytes - 1), cudaErrorInvalidValue);
  EXPECT_EQ(launch(100, 64, 16, 0), cudaErrorInvalidValue);
  EXPECT_EQ(launch(100, 64, 70000, bytes), cudaErrorInvalidValue);  // needs more scratch
  EXPECT_EQ(LaunchScaleAddRows(nullptr, ElemType::kF32, scales, rows, 100, 64, dst, 16, ws, bytes,
                               nullptr),
            cudaErrorInvalidValue);
  EXPECT_EQ(
      LaunchScaleAddRows(src, ElemType::kF32, nullptr, rows, 100, 64, dst, 16, ws, bytes, nullptr),
      cudaErrorInvalidValue);
  EXPECT_EQ(LaunchScaleAddRows(src, ElemType::kF32, scales, nullptr, 100, 64, dst, 16, ws, bytes,
                               nullptr),
            cudaErrorInvalidValue);
  EXPECT_EQ(LaunchScaleAddRows(src, ElemType::kF32, scales, rows, 100, 64, nullptr, 16, ws, bytes,
                               nullptr),
            cudaErrorInvalidValue);
  EXPECT_EQ(LaunchScaleAddRows(src, ElemType::kF32, scales, rows, 100, 64, dst, 16, nullptr, bytes,
                               nullptr),
            cudaErrorInvalidValue);
}

// ---- Device cases: skip cleanly when there is no GPU. ----

#define ASSERT_OK(expr)                           \
  do {                                            \
    const absl::Status dxs_status_ = (expr);      \
    ASSERT_TRUE(dxs_status_.ok()) << dxs_status_; \
  } while (0)

#define ASSIGN_OR_FAIL_IMPL_(tmp, lhs, expr) \
  auto tmp = (expr);                         \
  ASSERT_TRUE(tmp.ok()) << tmp.status();     \
  lhs = *std::move(tmp)
#define ASSIGN_OR_FAIL_CONCAT_(a, b) a##b
#define ASSIGN_OR_FAIL_NAME_(line) ASSIGN_OR_FAIL_CONCAT_(dxs_status_or_, line)
#define ASSIGN_OR_FAIL(lhs, expr) ASSIGN_OR_FAIL_IMPL_(ASSIGN_OR_FAIL_NAME_(__LINE__), lhs, expr)

// A device buffer freed on scope exit; empty buffers hold a null pointer. Every launch
// below is on the legacy default stream, which orders it with these blocking copies.
template <typename T>
class DeviceBuffer {
 public:
  explicit DeviceBuffer(size_t count) : count_(count) {
    if (count_ > 0) err_ = cudaMalloc(reinterpret_cast<void**>(&ptr_), count_ * sizeof(T));
  }
  explicit DeviceBuffer(const std::vector<T>& host) : DeviceBuffer(host.size()) {
    if (err_ == cudaSuccess && count_ > 0) {
      err_ = cudaMemcpy(ptr_, host.data(), count_ * sizeof(T), cudaMemcpyHostToDevice);
    }
  }
  ~DeviceBuffer() {
    if (ptr_ != nullptr) cudaFree(ptr_);
  }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  T* get() const { return ptr_; }
  size_t count() const { return count_; }
  cudaError_t status() const { return err_; }
  // Every byte 0xff: outputs the kernel must write cannot pass by accident.
  cudaError_t Poison() {
    return count_ == 0 ? cudaSuccess : cudaMemset(ptr_, 0xff, count_ * sizeof(T));
  }
  cudaError_t Download(std::vector<T>* host) const {
    host->resize(count_);
    if (count_ == 0) return cudaSuccess;
    return cudaMemcpy(host->data(), ptr_, count_ * sizeof(T), cudaMemcpyDeviceToHost);
  }

 private:
  size_t count_;
  T* ptr_ = nullptr;
  cudaError_t err_ = cudaSuccess;
};

constexpr int32_t kPoison = -1;  // an i32 of 0xff bytes

uint32_t FloatBits(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof(bits));
  return bits;
}

// The reference, shared by every case (never destroyed: tests may run in any order).
Backend& Cpu() {
  static Backend* const cpu = MakeCpuBackend().release();
  return *cpu;
}

// ---- Dispatch layout ----

struct Routing {
  std::vector<int32_t> ids;  // [tokens, top_k]
  std::vector<float> weights;
  std::vector<int32_t> owner;  // [experts]
};

// Each expert goes to a random rank among `owning_ranks`; each token routes to top_k
// distinct experts (or, with `repeats`, independent ones that may repeat).
Routing RandomRouting(int64_t tokens, int64_t top_k, int64_t experts,
                      const std::vector<int32_t>& owning_ranks, bool repeats, uint32_t seed) {
  std::mt19937 rng(seed);
  Routing r;
  std::uniform_int_distribution<size_t> pick_rank(0, owning_ranks.size() - 1);
  for (int64_t e = 0; e < experts; ++e) r.owner.push_back(owning_ranks[pick_rank(rng)]);
  std::vector<int32_t> perm(static_cast<size_t>(experts));
  std::iota(perm.begin(), perm.end(), 0);
  std::uniform_int_distribution<int32_t> pick_expert(0, static_cast<int32_t>(experts - 1));
  std::uniform_real_distribution<float> weight(0.f, 1.f);
  for (int64_t t = 0; t < tokens; ++t) {
    for (int64_t k = 0; k < top_k; ++k) {
      if (repeats) {
        r.ids.push_back(pick_expert(rng));
      } else {
        std::uniform_int_distribution<int64_t> rest(k, experts - 1);
        std::swap(perm[k], perm[rest(rng)]);
        r.ids.push_back(perm[k]);
      }
      r.weights.push_back(weight(rng));
    }
  }
  return r;
}

void ExpectLayoutMatchesCpu(const Routing& routing, int64_t tokens, int64_t top_k, int64_t experts,
                            int num_ranks) {
  Backend& cpu = Cpu();
  ASSIGN_OR_FAIL(Tensor ids, cpu.UploadIndices(routing.ids));
  ASSIGN_OR_FAIL(Tensor weights, cpu.Upload(routing.weights, {tokens, top_k}));
  ASSIGN_OR_FAIL(Tensor owner, cpu.UploadIndices(routing.owner));
  DispatchLayoutTensors want;
  ASSERT_OK(
      cpu.ComputeDispatchLayout(ids.Reshape({tokens, top_k}), weights, owner, num_ranks, &want));
  ASSIGN_OR_FAIL(std::vector<int32_t> want_tokens, cpu.DownloadIndices(want.num_tokens_per_rank));
  ASSIGN_OR_FAIL(std::vector<int32_t> want_pairs, cpu.DownloadIndices(want.num_pairs_per_rank));
  ASSIGN_OR_FAIL(std::vector<int32_t> want_experts,
                 cpu.DownloadIndices(want.num_tokens_per_expert));
  ASSIGN_OR_FAIL(std::vector<int32_t> want_rows, cpu.DownloadIndices(want.token_rows));
  ASSIGN_OR_FAIL(std::vector<int32_t> want_blocks, cpu.DownloadIndices(want.pairs));

  const size_t num_pairs = static_cast<size_t>(tokens * top_k);
  const size_t max_rows = static_cast<size_t>(tokens * std::min<int64_t>(top_k, num_ranks));
  DeviceBuffer<int32_t> d_ids(routing.ids), d_owner(routing.owner);
  DeviceBuffer<float> d_weights(routing.weights);
  DeviceBuffer<int32_t> d_tokens(num_ranks), d_pairs_per_rank(num_ranks), d_experts(experts),
      d_rows(max_rows), d_blocks(3 * num_pairs);
  const size_t ws_bytes = DispatchLayoutWorkspaceBytes(tokens, top_k, num_ranks);
  DeviceBuffer<uint8_t> ws(ws_bytes);
  for (auto* b : {&d_ids, &d_owner, &d_tokens, &d_pairs_per_rank, &d_experts, &d_rows, &d_blocks}) {
    ASSERT_CUDA_OK(b->status());
  }
  for (auto* b : {&d_tokens, &d_pairs_per_rank, &d_experts, &d_rows, &d_blocks}) {
    ASSERT_CUDA_OK(b->Poison());
  }
  ASSERT_CUDA_OK(d_weights.status());
  ASSERT_CUDA_OK(ws.status());
  ASSERT_CUDA_OK(ws.Poison());
  ASSERT_CUDA_OK(LaunchDispatchLayout(d_ids.get(), d_weights.get(), d_owner.get(), 1, tokens, top_k,
                                      experts, num_ranks, d_tokens.get(), d_pairs_per_rank.get(),
                                      d_experts.get(), d_rows.get(), d_blocks.get(), ws.get(),
                                      ws_bytes, nullptr));
  ASSERT_CUDA_OK(cudaDeviceSynchronize());

  std::vector<int32_t> got_tokens, got_pairs, got_experts, got_rows, got_blocks;
  ASSERT_CUDA_OK(d_tokens.Download(&got_tokens));
  ASSERT_CUDA_OK(d_pairs_per_rank.Download(&got_pairs));
  ASSERT_CUDA_OK(d_experts.Download(&got_experts));
  ASSERT_CUDA_OK(d_rows.Download(&got_rows));
  ASSERT_CUDA_OK(d_blocks.Download(&got_blocks));
  EXPECT_EQ(got_tokens, want_tokens);
  EXPECT_EQ(got_pairs, want_pairs);
  EXPECT_EQ(got_experts, want_experts);
  const int64_t used_rows = std::accumulate(want_tokens.begin(), want_tokens.end(), int64_t{0});
  ASSERT_LE(used_rows, static_cast<int64_t>(max_rows));
  EXPECT_TRUE(std::equal(want_rows.begin(), want_rows.begin() + used_rows, got_rows.begin()))
      << "token_rows differ";
  for (size_t i = used_rows; i < got_rows.size(); ++i) {
    ASSERT_EQ(got_rows[i], kPoison) << "token_rows[" << i << "] written past the used rows";
  }
  ASSERT_EQ(want_blocks.size(), got_blocks.size());
  int failures = 0;
  for (size_t i = 0; i < got_blocks.size() && failures < 10; ++i) {
    if (got_blocks[i] != want_blocks[i]) {
      ADD_FAILURE() << "pairs[" << i << "] = " << got_blocks[i] << ", want " << want_blocks[i];
      ++failures;
    }
  }
}

// tokens, ranks, top_k, experts, whether some ranks own no expert
using LayoutShape = std::tuple<int64_t, int, int64_t, int64_t, bool>;

class MoeOpsCudaDispatchLayoutVsCpu : public ::testing::TestWithParam<LayoutShape> {
 protected:
  void SetUp() override { SKIP_WITHOUT_GPU(); }
};

TEST_P(MoeOpsCudaDispatchLayoutVsCpu, RandomRouting) {
  const auto [tokens, ranks, top_k, experts, some_empty] = GetParam();
  std::vector<int32_t> owning;
  for (int r = 0; r < ranks; ++r) {
    // With some_empty, rank 1 (and every third rank after it) owns nothing.
    if (!some_empty || ranks == 1 || r % 3 != 1) owning.push_back(r);
  }
  const uint32_t seed = static_cast<uint32_t>(tokens * 7919 + ranks * 31 + top_k + some_empty);
  ExpectLayoutMatchesCpu(RandomRouting(tokens, top_k, experts, owning, false, seed), tokens, top_k,
                         experts, ranks);
}

INSTANTIATE_TEST_SUITE_P(Shapes, MoeOpsCudaDispatchLayoutVsCpu,
                         ::testing::Combine(::testing::Values<int64_t>(1, 37, 4096),
                                            ::testing::Values(1, 2, 3, 8),
                                            ::testing::Values<int64_t>(1, 8),
                                            ::testing::Values<int64_t>(12, 128), ::testing::Bool()),
                         [](const ::testing::TestParamInfo<LayoutShape>& info) {
                           return "t" + std::to_string(std::get<0>(info.param)) + "_r" +
                                  std::to_string(std::get<1>(info.param)) + "_k" +
                                  std::to_string(std::get<2>(info.param)) + "_e" +
                                  std::to_string(std::get<3>(info.param)) +
                                  (std::get<4>(info.param) ? "_someempty" : "_allown");
                         });

TEST(MoeOpsCudaDispatchLayout, LargestTypicalBatch) {
  SKIP_WITHOUT_GPU();
  std::vector<int32_t> owning(64);
  std::iota(owning.begin(), owning.end(), 0);
  ExpectLayoutMatchesCpu(RandomRouting(16384, 8, 128, owning, false, 3), 16384, 8, 128, 64);
}

TEST(MoeOpsCudaDispatchLayout, RepeatedExpertsAndRanksWithinAToken) {
  SKIP_WITHOUT_GPU();
  // Independent picks: a token may route to one expert twice, and often to one rank more
  // than once (its pairs share one local row).
  ExpectLayoutMatchesCpu(RandomRouting(999, 8, 6, {0, 2}, true, 17), 999, 8, 6, 3);
  ExpectLayoutMatchesCpu(RandomRouting(500, 6, 16, {0, 1, 2, 3, 4}, true, 18), 500, 6, 16, 5);
}

TEST(MoeOpsCudaDispatchLayout, ZeroTokensWritesZeroCounts) {
  SKIP_WITHOUT_GPU();
  DeviceBuffer<int32_t> tokens(8), pairs(8), experts(128);
  for (auto* b : {&tokens, &pairs, &experts}) {
    ASSERT_CUDA_OK(b->status());
    ASSERT_CUDA_OK(b->Poison());
  }
  ASSERT_CUDA_OK(LaunchDispatchLayout(nullptr, nullptr, nullptr, 1, 0, 8, 128, 8, tokens.get(),
                                      pairs.get(), experts.get(), nullptr, nullptr, nullptr, 0,
                                      nullptr));
  ASSERT_CUDA_OK(cudaDeviceSynchronize());
  for (auto* b : {&tokens, &pairs, &experts}) {
    std::vector<int32_t> got;
    ASSERT_CUDA_OK(b->Download(&got));
    EXPECT_EQ(got, std::vector<int32_t>(b->count(), 0));
  }
}

// ---- Sort pairs by expert ----

// With num_payloads > 0, that many seeded random 32-bit payloads (i32 and f32 bits
// alternately) are permuted with the order and compared bit for bit.
void ExpectSortMatchesCpu(const std::vector<int32_t>& experts, int64_t num_experts,
                          int num_payloads = 0) {
  const int64_t n = static_cast<int64_t>(experts.size());
  Backend& cpu = Cpu();
  std::mt19937 rng(static_cast<uint32_t>(n * 31 + num_experts));
  std::vector<std::vector<int32_t>> payloads(static_cast<size_t>(num_payloads));
  for (auto& p : payloads) {
    p.resize(static_cast<size_t>(n));
    for (int32_t& x : p) x = static_cast<int32_t>(rng());
  }
  ASSIGN_OR_FAIL(Tensor e, cpu.UploadIndices(experts));
  ASSIGN_OR_FAIL(Tensor order, cpu.Allocate({n}, DType::kI32));
  ASSIGN_OR_FAIL(Tensor offsets, cpu.Allocate({num_experts + 1}, DType::kI32));
  std::vector<Tensor> c_values, c_sorted;
  for (int j = 0; j < num_payloads; ++j) {
    const DType dtype = j % 2 == 0 ? DType::kI32 : DType::kF32;
    ASSIGN_OR_FAIL(Tensor v, cpu.Allocate({n}, dtype));
    ASSERT_OK(cpu.CopyFromHost(payloads[j].data(), dtype, &v));
    c_values.push_back(v);
    ASSIGN_OR_FAIL(Tensor s, cpu.Allocate({n}, dtype));
    c_sorted.push_back(s);
  }
  std::vector<PairPayload> c_payloads;
  for (int j = 0; j < num_payloads; ++j) c_payloads.push_back({&c_values[j], &c_sorted[j]});
  ASSERT_OK(cpu.SortPairsByExpert(e, static_cast<int>(num_experts), &order, &offsets, c_payloads));
  ASSIGN_OR_FAIL(std::vector<int32_t> want_order, cpu.DownloadIndices(order));
  ASSIGN_OR_FAIL(std::vector<int32_t> want_offsets, cpu.DownloadIndices(offsets));

  DeviceBuffer<int32_t> d_experts(experts), d_order(n), d_offsets(num_experts + 1);
  const size_t ws_bytes = SortPairsWorkspaceBytes(n, num_experts);
  DeviceBuffer<uint8_t> ws(ws_bytes);
  for (auto* b : {&d_experts, &d_order, &d_offsets}) ASSERT_CUDA_OK(b->status());
  ASSERT_CUDA_OK(ws.status());
  ASSERT_CUDA_OK(d_order.Poison());
  ASSERT_CUDA_OK(d_offsets.Poison());
  ASSERT_CUDA_OK(ws.Poison());
  std::vector<std::unique_ptr<DeviceBuffer<int32_t>>> d_in, d_out;
  SortPayloads d_payloads;
  for (int j = 0; j < num_payloads; ++j) {
    d_in.push_back(std::make_unique<DeviceBuffer<int32_t>>(payloads[j]));
    d_out.push_back(std::make_unique<DeviceBuffer<int32_t>>(n));
    ASSERT_CUDA_OK(d_in.back()->status());
    ASSERT_CUDA_OK(d_out.back()->status());
    ASSERT_CUDA_OK(d_out.back()->Poison());
    d_payloads.in[j] = d_in.back()->get();
    d_payloads.out[j] = d_out.back()->get();
  }
  d_payloads.count = num_payloads;
  ASSERT_CUDA_OK(LaunchSortPairsByExpert(d_experts.get(), n, num_experts, d_order.get(),
                                         d_offsets.get(), ws.get(), ws_bytes, nullptr, d_payloads));
  ASSERT_CUDA_OK(cudaDeviceSynchronize());
  std::vector<int32_t> got_order, got_offsets;
  ASSERT_CUDA_OK(d_order.Download(&got_order));
  ASSERT_CUDA_OK(d_offsets.Download(&got_offsets));
  EXPECT_EQ(got_offsets, want_offsets);
  EXPECT_EQ(got_order, want_order);
  for (int j = 0; j < num_payloads; ++j) {
    SCOPED_TRACE(::testing::Message() << "payload " << j);
    std::vector<int32_t> want(static_cast<size_t>(n)), got;
    std::memcpy(want.data(), c_sorted[j].raw(), want.size() * sizeof(int32_t));
    ASSERT_CUDA_OK(d_out[j]->Download(&got));
    EXPECT_EQ(got, want);
  }
}

std::vector<int32_t> RandomExperts(int64_t n, int64_t num_experts, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_int_distribution<int32_t> pick(0, static_cast<int32_t>(num_experts - 1));
  std::vector<int32_t> e(static_cast<size_t>(n));
  for (int32_t& x : e) x = pick(rng);
  return e;
}

using SortShapeParam = std::tuple<int64_t, int64_t>;  // pairs, experts

class MoeOpsCudaSortPairsVsCpu : public ::testing::TestWithParam<SortShapeParam> {
 protected:
  void SetUp() override { SKIP_WITHOUT_GPU(); }
};

TEST_P(MoeOpsCudaSortPairsVsCpu, RandomExperts) {
  const auto [n, experts] = GetParam();
  const std::vector<int32_t> e = RandomExperts(n, experts, static_cast<uint32_t>(n * 13 + experts));
  ExpectSortMatchesCpu(e, experts);
  ExpectSortMatchesCpu(e, experts, /*num_payloads=*/3);
}

TEST(MoeOpsCudaSortPairs, OneOrTwoPayloads) {
  SKIP_WITHOUT_GPU();
  for (const int64_t n : {int64_t{8}, int64_t{5000}}) {
    const std::vector<int32_t> e = RandomExperts(n, 128, static_cast<uint32_t>(n));
    ExpectSortMatchesCpu(e, 128, 1);
    ExpectSortMatchesCpu(e, 128, 2);
  }
}

// Expert counts around the radix digits: 127 (one 7-bit pass), 128 and 255 (8 bits), 256
// and 300 (two passes), 70000 (three). Around the one-block sort's limits: up to 4096 pairs
// and 4095 experts (4096 buckets) take it, 4097 pairs or 4096 experts the radix chain.
INSTANTIATE_TEST_SUITE_P(Shapes, MoeOpsCudaSortPairsVsCpu,
                         ::testing::Combine(::testing::Values<int64_t>(1, 7, 8, 92, 256, 257, 4095,
                                                                       4096, 4097, 32768, 131072),
                                            ::testing::Values<int64_t>(1, 12, 16, 127, 128, 255,
                                                                       256, 300, 512, 4095, 4096,
                                                                       70000)),
                         [](const ::testing::TestParamInfo<SortShapeParam>& info) {
                           return "n" + std::to_string(std::get<0>(info.param)) + "_e" +
                                  std::to_string(std::get<1>(info.param));
                         });

TEST(MoeOpsCudaSortPairs, OneExpertKeepsPairOrder) {
  SKIP_WITHOUT_GPU();
  ExpectSortMatchesCpu(std::vector<int32_t>(5000, 5), 128);
  ExpectSortMatchesCpu(std::vector<int32_t>(3000, 127), 128);
  std::vector<int32_t> descending(4000);
  for (size_t i = 0; i < descending.size(); ++i) descending[i] = 127 - static_cast<int>(i / 32);
  ExpectSortMatchesCpu(descending, 128);
}

// Out-of-range experts (which the CPU backend refuses) sort last, in pair order, after
// expert_offsets[num_experts], on the one-block path and the radix chain alike.
TEST(MoeOpsCudaSortPairs, OutOfRangeExpertsSortLast) {
  SKIP_WITHOUT_GPU();
  for (const int64_t n : {int64_t{9}, int64_t{4096}, int64_t{4097}, int64_t{20000}}) {
    SCOPED_TRACE(::testing::Message() << n << " pairs");
    const int64_t num_experts = 128;
    std::vector<int32_t> experts = RandomExperts(n, num_experts, static_cast<uint32_t>(n));
    for (int64_t p = 0; p < n; p += 3) experts[p] = p % 2 == 0 ? -1 - (p % 5) : 128 + (p % 7);
    // The documented order: stable by expert, bad experts as one bucket past the last.
    std::vector<int32_t> want_order(static_cast<size_t>(n));
    std::iota(want_order.begin(), want_order.end(), 0);
    auto bucket = [&](int32_t p) {
      const int32_t e = experts[p];
      return e >= 0 && e < num_experts ? e : static_cast<int32_t>(num_experts);
    };
    std::stable_sort(want_order.begin(), want_order.end(),
                     [&](int32_t a, int32_t b) { return bucket(a) < bucket(b); });
    std::vector<int32_t> want_offsets(static_cast<size_t>(num_experts) + 1, 0);
    for (int64_t e = 0; e <= num_experts; ++e) {
      want_offsets[e] = static_cast<int32_t>(std::count_if(
          experts.begin(), experts.end(), [&](int32_t x) { return x >= 0 && x < e; }));
    }
    DeviceBuffer<int32_t> d_experts(experts), d_order(n), d_offsets(num_experts + 1);
    const size_t ws_bytes = SortPairsWorkspaceBytes(n, num_experts);
    DeviceBuffer<uint8_t> ws(ws_bytes);
    for (auto* b : {&d_experts, &d_order, &d_offsets}) ASSERT_CUDA_OK(b->status());
    ASSERT_CUDA_OK(ws.status());
    ASSERT_CUDA_OK(d_order.Poison());
    ASSERT_CUDA_OK(d_offsets.Poison());
    ASSERT_CUDA_OK(LaunchSortPairsByExpert(d_experts.get(), n, num_experts, d_order.get(),
                                           d_offsets.get(), ws.get(), ws_bytes, nullptr));
    ASSERT_CUDA_OK(cudaDeviceSynchronize());
    std::vector<int32_t> got_order, got_offsets;
    ASSERT_CUDA_OK(d_order.Download(&got_order));
    ASSERT_CUDA_OK(d_offsets.Download(&got_offsets));
    EXPECT_EQ(got_offsets, want_offsets);
    EXPECT_EQ(got_order, want_order);
  }
}

// ---- Combine ----

// Bits of `x` in `type` (f32, f16 or bf16), as the CPU backend converts.
std::vector<uint8_t> ToBytes(const std::vector<float>& x, ElemType type) {
  std::vector<uint8_t> bytes;
  for (float f : x) {
    uint32_t bits = 0;
    size_t size = 4;
    if (type == ElemType::kF32) {
      bits = FloatBits(f);
    } else {
      bits = type == ElemType::kBF16 ? FloatToBf16(f) : FloatToFp16(f);
      size = 2;
    }
    for (size_t b = 0; b < size; ++b) bytes.push_back(static_cast<uint8_t>(bits >> (8 * b)));
  }
  return bytes;
}

float FromBytes(const uint8_t* p, ElemType type) {
  if (type == ElemType::kF32) {
    float f;
    std::memcpy(&f, p, sizeof(f));
    return f;
  }
  const uint16_t v = static_cast<uint16_t>(p[0] | p[1] << 8);
  return type == ElemType::kBF16 ? Bf16ToFloat(v) : Fp16ToFloat(v);
}

DType ToDType(ElemType t) { return static_cast<DType>(static_cast<int32_t>(t)); }
size_t ElemSize(ElemType t) { return t == ElemType::kF32 ? 4 : 2; }

// Each rank holds each token with probability `hold` (ascending): some tokens are held by
// no rank, some by several, some ranks by no token.
void ExpectCombineMatchesCpu(int64_t num_tokens, int num_ranks, int64_t hidden, double hold,
                             ElemType recv_type, ElemType out_type, uint32_t seed) {
  std::mt19937 rng(seed);
  std::bernoulli_distribution holds(hold);
  std::vector<int32_t> token_rows;
  std::vector<int64_t> rank_offsets = {0};
  for (int r = 0; r < num_ranks; ++r) {
    for (int64_t t = 0; t < num_tokens; ++t) {
      if (holds(rng)) token_rows.push_back(static_cast<int32_t>(t));
    }
    rank_offsets.push_back(static_cast<int64_t>(token_rows.size()));
  }
  const int64_t total = rank_offsets.back();
  std::normal_distribution<float> value(0.f, 1.f);
  std::vector<float> recv(static_cast<size_t>(total * hidden));
  for (float& x : recv) x = value(rng);
  const std::vector<uint8_t> recv_bytes = ToBytes(recv, recv_type);

  Backend& cpu = Cpu();
  ASSIGN_OR_FAIL(Tensor c_recv, cpu.Allocate({total, hidden}, ToDType(recv_type)));
  ASSERT_OK(cpu.CopyFromHost(recv_bytes.data(), ToDType(recv_type), &c_recv));
  ASSIGN_OR_FAIL(Tensor c_rows, cpu.UploadIndices(token_rows));
  ASSIGN_OR_FAIL(Tensor c_out, cpu.Allocate({num_tokens, hidden}, ToDType(out_type)));
  ASSERT_OK(cpu.CombineRows(c_recv, c_rows, rank_offsets, &c_out));
  std::vector<uint8_t> want(c_out.num_bytes());
  ASSERT_OK(cpu.CopyToHost(c_out, ToDType(out_type), want.data()));

  DeviceBuffer<uint8_t> d_recv(recv_bytes), d_out(want.size());
  DeviceBuffer<int32_t> d_rows(token_rows);
  DeviceBuffer<int64_t> d_offsets(rank_offsets);
  ASSERT_CUDA_OK(d_recv.status());
  ASSERT_CUDA_OK(d_out.status());
  ASSERT_CUDA_OK(d_rows.status());
  ASSERT_CUDA_OK(d_offsets.status());
  ASSERT_CUDA_OK(d_out.Poison());
  ASSERT_CUDA_OK(LaunchCombineRows(d_recv.get(), recv_type, d_rows.get(), d_offsets.get(),
                                   num_ranks, num_tokens, hidden, d_out.get(), out_type, nullptr));
  ASSERT_CUDA_OK(cudaDeviceSynchronize());
  std::vector<uint8_t> got;
  ASSERT_CUDA_OK(d_out.Download(&got));
  ASSERT_EQ(got.size(), want.size());
  // f32: the same additions in the same order, so the same bits. Narrower: the same f32 sum
  // rounded once; allow one rounding of slack (a half ulp each way).
  const float tolerance = out_type == ElemType::kF32    ? 0.f
                          : out_type == ElemType::kBF16 ? 1.f / 256
                                                        : 1.f / 2048;
  const size_t size = ElemSize(out_type);
  int failures = 0;
  for (size_t i = 0; i < got.size() / size && failures < 10; ++i) {
    const float g = FromBytes(got.data() + i * size, out_type);
    const float w = FromBytes(want.data() + i * size, out_type);
    const bool same = out_type == ElemType::kF32 ? FloatBits(g) == FloatBits(w)
                                                 : std::fabs(g - w) <= tolerance * std::fabs(w);
    if (!same) {
      ADD_FAILURE() << "out[" << i / hidden << "][" << i % hidden << "] = " << g << ", want " << w;
      ++failures;
    }
  }
}

TEST(MoeOpsCudaCombineRows, F32MatchesCpuBitForBit) {
  SKIP_WITHOUT_GPU();
  struct Case {
    int64_t tokens;
    int ranks;
    int64_t hidden;
    double hold;
  };
  for (const Case& c : {Case{1, 1, 64, 1.0}, Case{1, 3, 1, 0.5}, Case{37, 3, 130, 0.5},
                        Case{4096, 8, 256, 0.3}, Case{100, 300, 64, 0.05},  // ranks > a block
                        Case{50, 2, 2100, 0.7},                             // several column blocks
                        Case{20, 4, 64, 0.0},     // no rank holds anything
                        Case{33, 0, 16, 1.0}}) {  // no ranks at all
    SCOPED_TRACE(::testing::Message() << c.tokens << " tokens, " << c.ranks << " ranks, hidden "
                                      << c.hidden << ", hold " << c.hold);
    ExpectCombineMatchesCpu(c.tokens, c.ranks, c.hidden, c.hold, ElemType::kF32, ElemType::kF32,
                            static_cast<uint32_t>(c.tokens + c.ranks * 7 + c.hidden));
  }
}

TEST(MoeOpsCudaCombineRows, NarrowTypes) {
  SKIP_WITHOUT_GPU();
  for (auto [recv, out] :
       {std::pair{ElemType::kBF16, ElemType::kBF16}, std::pair{ElemType::kBF16, ElemType::kF32},
        std::pair{ElemType::kF16, ElemType::kF16}, std::pair{ElemType::kF32, ElemType::kBF16},
        std::pair{ElemType::kF16, ElemType::kBF16}}) {
    SCOPED_TRACE(::testing::Message() << "recv type " << static_cast<int>(recv) << ", out type "
                                      << static_cast<int>(out));
    ExpectCombineMatchesCpu(4096, 8, 256, 0.3, recv, out, 5);
    ExpectCombineMatchesCpu(7, 3, 1500, 0.6, recv, out, 6);
  }
}

// ---- Scale-add ----

void ExpectScaleAddMatchesCpu(const std::vector<int32_t>& rows, int64_t cols, int64_t dst_rows,
                              uint32_t seed, bool bf16_src = false) {
  const int64_t n = static_cast<int64_t>(rows.size());
  std::mt19937 rng(seed);
  std::normal_distribution<float> value(0.f, 1.f);
  std::vector<float> src(static_cast<size_t>(n * cols)), scales(static_cast<size_t>(n)),
      dst(static_cast<size_t>(dst_rows * cols));
  for (float& x : src) x = value(rng);
  for (float& x : scales) x = value(rng);
  for (float& x : dst) x = value(rng);
  // A bf16 src (the expert outputs on a GPU): the CPU adds the same values, widened.
  std::vector<uint16_t> src_bf16;
  if (bf16_src) {
    for (float& x : src) {
      src_bf16.push_back(FloatToBf16(x));
      x = Bf16ToFloat(src_bf16.back());
    }
  }

  Backend& cpu = Cpu();
  ASSIGN_OR_FAIL(Tensor c_src, cpu.Upload(src, {n, cols}));
  ASSIGN_OR_FAIL(Tensor c_scales, cpu.Upload(scales, {n}));
  ASSIGN_OR_FAIL(Tensor c_rows, cpu.UploadIndices(rows));
  ASSIGN_OR_FAIL(Tensor c_dst, cpu.Upload(dst, {dst_rows, cols}));
  ASSERT_OK(cpu.ScaleAddRows(c_src, c_scales, c_rows, &c_dst));
  ASSIGN_OR_FAIL(std::vector<float> want, cpu.Download(c_dst));

  DeviceBuffer<float> d_src(src), d_scales(scales), d_dst(dst);
  DeviceBuffer<uint16_t> d_src_bf16(src_bf16);
  DeviceBuffer<int32_t> d_rows(rows);
  const size_t ws_bytes = ScaleAddRowsWorkspaceBytes(n, dst_rows);
  DeviceBuffer<uint8_t> ws(ws_bytes);
  for (auto* b : {&d_src, &d_scales, &d_dst}) ASSERT_CUDA_OK(b->status());
  ASSERT_CUDA_OK(d_src_bf16.status());
  ASSERT_CUDA_OK(d_rows.status());
  ASSERT_CUDA_OK(ws.status());
  ASSERT_CUDA_OK(ws.Poison());
  ASSERT_CUDA_OK(
      LaunchScaleAddRows(bf16_src ? static_cast<const void*>(d_src_bf16.get()) : d_src.get(),
                         bf16_src ? ElemType::kBF16 : ElemType::kF32, d_scales.get(), d_rows.get(),
                         n, cols, d_dst.get(), dst_rows, ws.get(), ws_bytes, nullptr));
  ASSERT_CUDA_OK(cudaDeviceSynchronize());
  std::vector<float> got;
  ASSERT_CUDA_OK(d_dst.Download(&got));
  ASSERT_EQ(got.size(), want.size());
  int failures = 0;
  for (size_t i = 0; i < got.size() && failures < 10; ++i) {
    if (FloatBits(got[i]) != FloatBits(want[i])) {
      ADD_FAILURE() << "dst[" << i / cols << "][" << i % cols << "] = " << got[i] << ", want "
                    << want[i];
      ++failures;
    }
  }
}

TEST(MoeOpsCudaScaleAddRows, RandomRowsMatchCpuBitForBit) {
  SKIP_WITHOUT_GPU();
  struct Case {
    int64_t n, cols, dst_rows;
  };
  for (const Case& c :
       {Case{1, 1, 1}, Case{8, 2048, 1}, Case{300, 64, 7}, Case{92, 128, 23}, Case{28, 128, 7},
        Case{69, 96, 23}, Case{4096, 64, 4095}, Case{4096, 64, 4096}, Case{4097, 64, 100},
        Case{32768, 64, 4096}, Case{5000, 1500, 300},  // several column blocks
        Case{2000, 16, 70000},                         // three radix passes
        Case{131072, 8, 16384}}) {
    SCOPED_TRACE(::testing::Message() << c.n << " rows of " << c.cols << " into " << c.dst_rows);
    const std::vector<int32_t> rows = RandomExperts(c.n, c.dst_rows, static_cast<uint32_t>(c.n));
    ExpectScaleAddMatchesCpu(rows, c.cols, c.dst_rows, static_cast<uint32_t>(c.n + c.cols));
    ExpectScaleAddMatchesCpu(rows, c.cols, c.dst_rows, static_cast<uint32_t>(c.n + c.cols),
                             /*bf16_src=*/true);
  }
}

TEST(MoeOpsCudaScaleAddRows, ManyContributionsToOneRowAddInOrder) {
  SKIP_WITHOUT_GPU();
  ExpectScaleAddMatchesCpu(std::vector<int32_t>(3000, 2), 33, 5, 1);
  // The expert shard's pattern: each token's k pairs, in expert-sorted order.
  std::vector<int32_t> rows;
  for (int k = 0; k < 8; ++k) {
    for (int t = 0; t < 1000; ++t) rows.push_back((t * 7 + k * 131) % 1000);
  }
  ExpectScaleAddMatchesCpu(rows, 128, 1000, 2);
}

}  // namespace
}  // namespace dxs::cuda
