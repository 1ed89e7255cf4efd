// MakeLowLatencyExchange on backends without the exchange: the low-latency exchange is a
// GPU path, and the CPU and the opaque test backend say so instead of pretending (their MoE
// goes by the host-driven exchange). The CUDA backend's rounds are in
// low_latency_moe_cuda_test and ll_exchange_cuda_test.
#include "dataplane/low_latency/low_latency_exchange.h"

#include <memory>
#include <string>

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

}  // namespace
}  // namespace dxs
