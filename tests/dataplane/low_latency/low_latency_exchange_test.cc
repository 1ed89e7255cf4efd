// MakeLowLatencyExchange on backends without the exchange: the low-latency exchange is a
// GPU path, and the CPU and the opaque test backend say so instead of pretending (their MoE
// goes by the host-driven exchange). And LowLatencyMoeExecutor's two halves over an exchange
// that records its calls (the order and arguments of the rounds; no data moves). The CUDA
// backend's rounds are in low_latency_moe_cuda_test and ll_exchange_cuda_test.
#include "dataplane/low_latency/low_latency_exchange.h"

#include <memory>
#include <string>
#include <vector>

#include "dataplane/low_latency/low_latency_moe_executor.h"
#include "gtest/gtest.h"
#include "kernels/backend.h"
#include "kernels/opaque_backend.h"

namespace dxs {
namespace {

LowLatencyShape SmallShape() {
  LowLatencyShape shape;
  shape.num_attention_ranks = shape.num_expert_ranks = 1;
  shape.capacity = 8;
  shape.hidden = 64;
  shape.top_k = 2;
  shape.num_experts = 4;
  return shape;
}

void ExpectNoExchange(Backend* backend) {
  EXPECT_FALSE(backend->capabilities().low_latency_exchange) << backend->name();
  for (LowLatencySide side : {LowLatencySide::kAttention, LowLatencySide::kExpert}) {
    auto exchange = MakeLowLatencyExchange(backend, SmallShape(), side, 0);
    EXPECT_EQ(exchange.status().code(), absl::StatusCode::kUnimplemented) << backend->name();
    EXPECT_NE(exchange.status().message().find("low-latency"), std::string::npos)
        << exchange.status();
    EXPECT_NE(exchange.status().message().find(backend->name()), std::string::npos)
        << exchange.status();
  }
}

TEST(LowLatencyExchangeTest, CpuBackendHasNone) { ExpectNoExchange(MakeCpuBackend().get()); }

TEST(LowLatencyExchangeTest, OpaqueBackendHasNone) {
  auto backend = MakeOpaqueBackend(size_t{64} << 20);
  ASSERT_TRUE(backend.ok()) << backend.status();
  ExpectNoExchange(backend->get());
}

// An in-process maker is consulted only for a backend that has the exchange: the CPU
// backend stays UNIMPLEMENTED with one registered, and the maker never runs.
int maker_calls = 0;
absl::StatusOr<std::unique_ptr<LowLatencyExchange>> CountingMaker(Backend*, const LowLatencyShape&,
                                                                  LowLatencySide, int) {
  ++maker_calls;
  return absl::InternalError("not reached");
}

TEST(LowLatencyExchangeTest, InProcessMakerOnlyForBackendsWithTheExchange) {
  UseInProcessLowLatencyExchange(&CountingMaker);
  ExpectNoExchange(MakeCpuBackend().get());
  EXPECT_EQ(maker_calls, 0);
  UseInProcessLowLatencyExchange(nullptr);
}

// The attention side's calls, in order, with the ids tensor each was given.
class RecordingExchange final : public LowLatencyExchange {
 public:
  struct Call {
    std::string op;
    const void* ids;
  };
  std::vector<Call> calls;

  const LowLatencyShape& shape() const override { return shape_; }
  LowLatencySide side() const override { return LowLatencySide::kAttention; }
  int rank() const override { return 0; }
  const std::string& region_key() const override { return key_; }
  absl::Status Connect(const std::vector<std::string>&) override { return absl::OkStatus(); }
  absl::Status Dispatch(const Tensor&, const Tensor& ids, const Tensor&, const Tensor&) override {
    calls.push_back({"dispatch", ids.raw()});
    return absl::OkStatus();
  }
  absl::Status Combine(const Tensor& ids, const Tensor&, Tensor*) override {
    calls.push_back({"combine", ids.raw()});
    return absl::OkStatus();
  }
  absl::Status Receive(const Tensor&, LowLatencyPairs*) override {
    return absl::UnimplementedError("attention side");
  }
  absl::Status Send(const Tensor&) override { return absl::UnimplementedError("attention side"); }
  absl::Status CheckStatus() override { return absl::OkStatus(); }
  absl::StatusOr<LowLatencyProgress> Progress() const override { return LowLatencyProgress(); }

 private:
  LowLatencyShape shape_ = SmallShape();
  std::string key_ = "recording";
};

class LowLatencyMoeExecutorTest : public ::testing::Test {
 protected:
  std::unique_ptr<Backend> backend_ = MakeCpuBackend();
  RecordingExchange exchange_;
  LowLatencyMoeExecutor executor_{&exchange_, *backend_->Zeros({4}, DType::kI32)};
  Tensor x_ = *backend_->Zeros({3, 64}, DType::kF32);
  Tensor ids_ = *backend_->Zeros({3, 2}, DType::kI32);
  Tensor weights_ = *backend_->Zeros({3, 2}, DType::kF32);
  Tensor out_ = *backend_->Zeros({3, 64}, DType::kF32);
};

TEST_F(LowLatencyMoeExecutorTest, CombineSumsTheRoundItsHandleDispatched) {
  auto handle = executor_.Dispatch(0, 0, 1, x_, ids_, weights_, &out_);
  ASSERT_TRUE(handle.ok()) << handle.status();
  ASSERT_EQ(exchange_.calls.size(), 1u);
  ASSERT_TRUE(executor_.Combine(*std::move(handle), &out_).ok());
  ASSERT_EQ(exchange_.calls.size(), 2u);
  EXPECT_EQ(exchange_.calls[0].op, "dispatch");
  EXPECT_EQ(exchange_.calls[1].op, "combine");
  EXPECT_EQ(exchange_.calls[1].ids, ids_.raw());  // the routing the round went out with
  // Run is the two back to back.
  ASSERT_TRUE(executor_.Run(1, x_, ids_, weights_, &out_).ok());
  ASSERT_EQ(exchange_.calls.size(), 4u);
  EXPECT_EQ(exchange_.calls[2].op, "dispatch");
  EXPECT_EQ(exchange_.calls[3].op, "combine");
}

// One round in flight: the regions have a slot per token, not per micro-batch.
TEST_F(LowLatencyMoeExecutorTest, OneRoundInFlightAndOneMicroBatch) {
  EXPECT_EQ(executor_.Dispatch(0, 0, 2, x_, ids_, weights_, &out_).status().code(),
            absl::StatusCode::kFailedPrecondition);
  auto first = executor_.Dispatch(0, 0, 1, x_, ids_, weights_, &out_);
  ASSERT_TRUE(first.ok());
  EXPECT_EQ(executor_.Dispatch(1, 0, 1, x_, ids_, weights_, &out_).status().code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(exchange_.calls.size(), 1u);  // nothing sent for the refused ones
  // A handle dropped uncombined (a failed step) frees the executor for the next round.
  first->reset();
  EXPECT_TRUE(executor_.Dispatch(1, 0, 1, x_, ids_, weights_, &out_).ok());
}

TEST_F(LowLatencyMoeExecutorTest, AnotherExecutorsHandleIsInvalidArgument) {
  RecordingExchange other_exchange;
  LowLatencyMoeExecutor other(&other_exchange, *backend_->Zeros({4}, DType::kI32));
  auto handle = other.Dispatch(0, 0, 1, x_, ids_, weights_, &out_);
  ASSERT_TRUE(handle.ok());
  EXPECT_EQ(executor_.Combine(*std::move(handle), &out_).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(exchange_.calls.empty());
}

}  // namespace
}  // namespace dxs
