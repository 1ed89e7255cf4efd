// The CUDA router top-k softmax: host-side guards (run everywhere, no device needed) and,
// on a GPU, agreement with TopKSoftmaxCpu. Without a device the GPU cases skip.
#include "kernels/cuda/topk_softmax_cuda.h"

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/cuda/topk_softmax.cuh"
#include "kernels/topk_softmax.h"
#include "tests/kernels/cuda/cuda_test_util.h"

namespace dxs {
namespace {

// ---- Host-side guards: none of these may reach CUDA, so they pass without a device. ----

TEST(TopKSoftmaxCudaGuard, ZeroTokensWithNullPointersIsOkWithoutLaunching) {
  // A launch here would fail: no device on CI, and a zero-block grid on a GPU.
  EXPECT_TRUE(TopKSoftmaxCuda(nullptr, 0, 128, 8, true, nullptr, nullptr, nullptr).ok());
  EXPECT_TRUE(TopKSoftmaxCuda(nullptr, 0, 16, 1, false, nullptr, nullptr, nullptr).ok());
  EXPECT_TRUE(TopKSoftmaxCudaBf16(nullptr, 0, 128, 8, true, nullptr, nullptr, nullptr).ok());
  EXPECT_EQ(LaunchTopKSoftmax(nullptr, 0, 128, 8, true, nullptr, nullptr, nullptr), cudaSuccess);
  EXPECT_EQ(LaunchTopKSoftmaxBf16(nullptr, 0, 128, 8, true, nullptr, nullptr, nullptr),
            cudaSuccess);
}

TEST(TopKSoftmaxCudaGuard, RejectsWhatTheCpuReferenceRejects) {
  struct Case {
    int64_t num_tokens, num_experts, top_k;
    const char* field;
  };
  for (const Case& c :
       {Case{-1, 16, 4, "num_tokens"}, Case{1, 0, 1, "num_experts"}, Case{0, -3, 1, "num_experts"},
        Case{1, 16, 0, "top_k"}, Case{0, 16, -1, "top_k"}, Case{1, 4, 5, "top_k"}}) {
    SCOPED_TRACE(::testing::Message()
                 << c.num_tokens << " tokens, " << c.num_experts << " experts, top_k " << c.top_k);
    absl::Status s = TopKSoftmaxCuda(nullptr, c.num_tokens, c.num_experts, c.top_k, true, nullptr,
                                     nullptr, nullptr);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
    EXPECT_NE(s.message().find(c.field), std::string::npos) << s;
    EXPECT_EQ(TopKSoftmaxCudaBf16(nullptr, c.num_tokens, c.num_experts, c.top_k, true, nullptr,
                                  nullptr, nullptr)
                  .code(),
              absl::StatusCode::kInvalidArgument);
    EXPECT_EQ(LaunchTopKSoftmax(nullptr, c.num_tokens, c.num_experts, c.top_k, true, nullptr,
                                nullptr, nullptr),
              cudaErrorInvalidValue);
  }
}

TEST(TopKSoftmaxCudaGuard, RejectsBeyondKernelLimitsEvenForEmptyBatches) {
  for (int64_t tokens : {0, 5}) {
    absl::Status s = TopKSoftmaxCuda(nullptr, tokens, kTopKSoftmaxMaxExperts + 1, 8, true, nullptr,
                                     nullptr, nullptr);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
    EXPECT_NE(s.message().find("num_experts"), std::string::npos) << s;
    s = TopKSoftmaxCuda(nullptr, tokens, 128, kTopKSoftmaxMaxTopK + 1, true, nullptr, nullptr,
                        nullptr);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
    EXPECT_NE(s.message().find("top_k"), std::string::npos) << s;
    EXPECT_EQ(LaunchTopKSoftmax(nullptr, tokens, kTopKSoftmaxMaxExperts + 1, 8, true, nullptr,
                                nullptr, nullptr),
              cudaErrorInvalidValue);
    EXPECT_EQ(LaunchTopKSoftmax(nullptr, tokens, 128, kTopKSoftmaxMaxTopK + 1, true, nullptr,
                                nullptr, nullptr),
              cudaErrorInvalidValue);
  }
}

TEST(TopKSoftmaxCudaGuard, RejectsNullPointersWhenThereAreTokens) {
  // Fake, never dereferenced: the check fires before the launch.
  const float* logits = reinterpret_cast<const float*>(alignof(float) * 64);
  int32_t* ids = reinterpret_cast<int32_t*>(alignof(int32_t) * 64);
  float* weights = reinterpret_cast<float*>(alignof(float) * 128);
  EXPECT_EQ(TopKSoftmaxCuda(nullptr, 3, 16, 2, true, ids, weights, nullptr).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(TopKSoftmaxCuda(logits, 3, 16, 2, true, nullptr, weights, nullptr).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(TopKSoftmaxCuda(logits, 3, 16, 2, true, ids, nullptr, nullptr).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(LaunchTopKSoftmax(nullptr, 3, 16, 2, true, ids, weights, nullptr),
            cudaErrorInvalidValue);
}

// ---- Device cases: skip cleanly when there is no GPU. ----

// A device buffer freed on scope exit.
template <typename T>
class DeviceBuffer {
 public:
  explicit DeviceBuffer(size_t count) : count_(count) {
    if (count_ > 0) err_ = cudaMalloc(reinterpret_cast<void**>(&ptr_), count_ * sizeof(T));
  }
  ~DeviceBuffer() {
    if (ptr_ != nullptr) cudaFree(ptr_);
  }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  T* get() const { return ptr_; }
  cudaError_t status() const { return err_; }
  cudaError_t Upload(const std::vector<T>& host) {
    // From pageable memory, cudaMemcpy may return before the DMA lands, and the kernel runs
    // on a non-blocking stream that does not wait for it: synchronise before any launch.
    cudaError_t e = cudaMemcpy(ptr_, host.data(), count_ * sizeof(T), cudaMemcpyHostToDevice);
    return e == cudaSuccess ? cudaDeviceSynchronize() : e;
  }
  cudaError_t Download(std::vector<T>* host) const {
    host->resize(count_);
    return cudaMemcpy(host->data(), ptr_, count_ * sizeof(T), cudaMemcpyDeviceToHost);
  }

 private:
  size_t count_;
  T* ptr_ = nullptr;
  cudaError_t err_ = cudaSuccess;
};

std::vector<float> RandomLogits(int64_t num_tokens, int64_t num_experts, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> dist(0.f, 2.f);
  std::vector<float> logits(num_tokens * num_experts);
  for (float& x : logits) x = dist(rng);
  return logits;
}

// Runs the float (or, with `bf16`, the bf16) kernel and the CPU reference on `logits`
// (for bf16, on the logits rounded to bf16) and checks they agree.
void ExpectMatchesCpu(std::vector<float> logits, int64_t num_tokens, int64_t num_experts,
                      int64_t top_k, bool normalize, bool bf16 = false) {
  std::vector<__nv_bfloat16> logits_bf16;
  if (bf16) {
    for (float& x : logits) {
      logits_bf16.push_back(__float2bfloat16(x));
      x = __bfloat162float(logits_bf16.back());
    }
  }
  const size_t num_out = static_cast<size_t>(num_tokens * top_k);
  std::vector<int32_t> want_ids(num_out);
  std::vector<float> want_weights(num_out);
  ASSERT_TRUE(TopKSoftmaxCpu(logits.data(), num_tokens, num_experts, top_k, normalize,
                             want_ids.data(), want_weights.data())
                  .ok());

  DeviceBuffer<int32_t> ids(num_out);
  DeviceBuffer<float> weights(num_out);
  ASSERT_CUDA_OK(ids.status());
  ASSERT_CUDA_OK(weights.status());
  ASSERT_CUDA_OK(cudaMemset(ids.get(), 0xff, num_out * sizeof(int32_t)));
  ASSERT_CUDA_OK(cudaDeviceSynchronize());  // the memset is on the legacy stream
  cudaStream_t stream = nullptr;
  ASSERT_CUDA_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  absl::Status launched;
  if (bf16) {
    DeviceBuffer<__nv_bfloat16> in(logits_bf16.size());
    ASSERT_CUDA_OK(in.status());
    ASSERT_CUDA_OK(in.Upload(logits_bf16));
    launched = TopKSoftmaxCudaBf16(in.get(), num_tokens, num_experts, top_k, normalize, ids.get(),
                                   weights.get(), stream);
    ASSERT_CUDA_OK(cudaStreamSynchronize(stream));
  } else {
    DeviceBuffer<float> in(logits.size());
    ASSERT_CUDA_OK(in.status());
    ASSERT_CUDA_OK(in.Upload(logits));
    launched = TopKSoftmaxCuda(in.get(), num_tokens, num_experts, top_k, normalize, ids.get(),
                               weights.get(), stream);
    ASSERT_CUDA_OK(cudaStreamSynchronize(stream));
  }
  ASSERT_CUDA_OK(cudaStreamDestroy(stream));
  ASSERT_TRUE(launched.ok()) << launched;
  ASSERT_CUDA_OK(cudaGetLastError());

  std::vector<int32_t> got_ids;
  std::vector<float> got_weights;
  ASSERT_CUDA_OK(ids.Download(&got_ids));
  ASSERT_CUDA_OK(weights.Download(&got_weights));
  // Both sides add in the same order, so they differ only by device expf (within 2 ulp of
  // the host's). With normalize, each picked weight's error enters the divisor: 1e-6 covers
  // top_k <= 8 under a worst-case +-2 ulp model; wider picks (up to 32) get 2e-6.
  const float relative_tolerance = top_k <= 8 ? 1e-6f : 2e-6f;
  int failures = 0;
  for (size_t i = 0; i < num_out && failures < 10; ++i) {
    const int64_t t = static_cast<int64_t>(i) / top_k, k = static_cast<int64_t>(i) % top_k;
    if (got_ids[i] != want_ids[i]) {
      ADD_FAILURE() << "token " << t << " pick " << k << ": id " << got_ids[i] << ", want "
                    << want_ids[i];
      ++failures;
    }
    // A row with a NaN or +inf logit has NaN probabilities on both sides (its picks still
    // compare above).
    if (std::isnan(want_weights[i]) && std::isnan(got_weights[i])) continue;
    const float tolerance = relative_tolerance * std::fabs(want_weights[i]);
    if (!(std::fabs(got_weights[i] - want_weights[i]) <= tolerance)) {
      ADD_FAILURE() << "token " << t << " pick " << k << ": weight " << got_weights[i] << ", want "
                    << want_weights[i] << " (relative error "
                    << std::fabs(got_weights[i] - want_weights[i]) / want_weights[i] << ")";
      ++failures;
    }
  }
}

using Shape = std::tuple<int64_t, int64_t, int64_t, bool>;  // tokens, experts, top_k, normalize

class TopKSoftmaxCudaMatchesCpu : public ::testing::TestWithParam<Shape> {
 protected:
  void SetUp() override { SKIP_WITHOUT_GPU(); }
};

TEST_P(TopKSoftmaxCudaMatchesCpu, RandomLogits) {
  const auto [num_tokens, num_experts, top_k, normalize] = GetParam();
  const uint32_t seed = static_cast<uint32_t>(num_tokens * 1000003 + num_experts * 101 + top_k);
  ExpectMatchesCpu(RandomLogits(num_tokens, num_experts, seed), num_tokens, num_experts, top_k,
                   normalize);
}

INSTANTIATE_TEST_SUITE_P(Shapes, TopKSoftmaxCudaMatchesCpu,
                         ::testing::Combine(::testing::Values<int64_t>(1, 7, 1000),
                                            ::testing::Values<int64_t>(16, 12, 128),
                                            ::testing::Values<int64_t>(1, 3, 4, 8),
                                            ::testing::Bool()),
                         [](const ::testing::TestParamInfo<Shape>& info) {
                           return "t" + std::to_string(std::get<0>(info.param)) + "_e" +
                                  std::to_string(std::get<1>(info.param)) + "_k" +
                                  std::to_string(std::get<2>(info.param)) +
                                  (std::get<3>(info.param) ? "_norm" : "_raw");
                         });

TEST(TopKSoftmaxCudaDevice, KernelLimitsAndEveryWidth) {
  SKIP_WITHOUT_GPU();
  // Every register width (1, 2, 4, 8, 16 slots per lane), both ends of each, and the limits.
  for (int64_t experts : {1, 32, 33, 64, 65, 100, 128, 129, 256, 257, 384, 511, 512}) {
    for (int64_t k : {int64_t{1}, std::min<int64_t>(experts, 8), std::min<int64_t>(experts, 32)}) {
      SCOPED_TRACE(::testing::Message() << experts << " experts, top_k " << k);
      ExpectMatchesCpu(RandomLogits(37, experts, static_cast<uint32_t>(experts * 33 + k)), 37,
                       experts, k, /*normalize=*/k % 2 == 0);
    }
  }
}

TEST(TopKSoftmaxCudaDevice, TiesGoToTheLowerExpertId) {
  SKIP_WITHOUT_GPU();
  // Quantised logits: many exact ties, across lanes and across slots of one lane.
  std::mt19937 rng(7);
  std::uniform_int_distribution<int> level(-2, 2);
  for (int64_t experts : {12, 128, 512}) {
    std::vector<float> logits(64 * experts);
    for (float& x : logits) x = static_cast<float>(level(rng));
    SCOPED_TRACE(::testing::Message() << experts << " experts");
    ExpectMatchesCpu(logits, 64, experts, 8, true);
    ExpectMatchesCpu(std::vector<float>(3 * experts, 0.5f), 3, experts, 4, false);
  }
}

// 64 tokens of logits drawn from `levels` (seeded), `plant` then setting some, over 12, 128
// and 512 experts: GPU and CPU pick the same experts, f32 logits normalized and bf16 ones not.
void ExpectLevelsMatchCpu(const std::vector<float>& levels, unsigned seed,
                          const std::function<void(std::vector<float>&, int64_t)>& plant) {
  std::mt19937 rng(seed);
  std::uniform_int_distribution<size_t> pick(0, levels.size() - 1);
  for (int64_t experts : {12, 128, 512}) {
    SCOPED_TRACE(::testing::Message() << experts << " experts");
    std::vector<float> logits(64 * experts);
    for (float& x : logits) x = levels[pick(rng)];
    plant(logits, experts);
    ExpectMatchesCpu(logits, 64, experts, 8, true);
    ExpectMatchesCpu(logits, 64, experts, 8, false, /*bf16=*/true);
  }
}

TEST(TopKSoftmaxCudaDevice, SignedZerosAndInfinitiesRankAsOnTheCpu) {
  SKIP_WITHOUT_GPU();
  // -0 and +0 tie (the lower id first) and -inf ranks below every finite logit, as their
  // probabilities do on the CPU; each row keeps finite logits so its weights are numbers.
  const float inf = std::numeric_limits<float>::infinity();
  ExpectLevelsMatchCpu({-0.f, 0.f, -inf, 1.f, -1.f, -0.f, 0.f}, 13,
                       [](std::vector<float>& logits, int64_t experts) {
                         for (int64_t t = 0; t < 64; ++t) logits[t * experts + t % experts] = 1.f;
                       });
}

TEST(TopKSoftmaxCudaDevice, NanAndInfiniteLogitsRankAsOnTheCpu) {
  SKIP_WITHOUT_GPU();
  // NaN ranks last wherever it is in the row, +inf first: both make the row's weights NaN,
  // and the CPU then ranks the row by logit as the kernel does, so the picks are the same.
  // (Rows of numbers here never round two distinct logits to one probability.)
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const float inf = std::numeric_limits<float>::infinity();
  ExpectLevelsMatchCpu({nan, inf, -inf, 0.f, 1.f, -1.f, 2.f, 0.5f}, 29,
                       [nan](std::vector<float>& logits, int64_t) {
                         logits[0] = nan;  // expert 0 of token 0
                       });
}

TEST(TopKSoftmaxCudaDevice, ManyTokens) {
  SKIP_WITHOUT_GPU();
  ExpectMatchesCpu(RandomLogits(70001, 128, 11), 70001, 128, 8, true);
}

TEST(TopKSoftmaxCudaDevice, Bf16Logits) {
  SKIP_WITHOUT_GPU();
  for (bool normalize : {false, true}) {
    ExpectMatchesCpu(RandomLogits(1000, 128, 5), 1000, 128, 8, normalize, /*bf16=*/true);
    ExpectMatchesCpu(RandomLogits(7, 12, 6), 7, 12, 3, normalize, /*bf16=*/true);
  }
}

TEST(TopKSoftmaxCudaDevice, ZeroTokensLeavesOutputsAlone) {
  SKIP_WITHOUT_GPU();
  DeviceBuffer<int32_t> ids(4);
  ASSERT_CUDA_OK(ids.status());
  ASSERT_CUDA_OK(cudaMemset(ids.get(), 0x7f, 4 * sizeof(int32_t)));
  DeviceBuffer<float> weights(4);
  ASSERT_CUDA_OK(weights.status());
  EXPECT_TRUE(TopKSoftmaxCuda(nullptr, 0, 16, 4, true, ids.get(), weights.get(), nullptr).ok());
  ASSERT_CUDA_OK(cudaDeviceSynchronize());
  ASSERT_CUDA_OK(cudaGetLastError());
  std::vector<int32_t> got;
  ASSERT_CUDA_OK(ids.Download(&got));
  for (int32_t id : got) EXPECT_EQ(id, 0x7f7f7f7f);
}

}  // namespace
}  // namespace dxs
