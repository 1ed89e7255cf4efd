// MetricsServer (prometheus-cpp's exposer) over real sockets: GET /metrics on a kernel-chosen
// port, several collectables, other paths, bad addresses, a busy port, a fast shutdown.
#include "common/metrics/metrics_server.h"

#include <chrono>
#include <memory>

#include "common/metrics/build_info.h"
#include "common/metrics/callback_gauge.h"
#include "common/metrics/families.h"
#include "gtest/gtest.h"
#include "tests/common/metrics/http_get.h"

namespace dxs::metrics {
namespace {

MetricsServerOptions Options(const std::string& address, int num_threads = 2) {
  MetricsServerOptions options;
  options.address = address;
  options.num_threads = num_threads;
  return options;
}

using testing::HttpRequest;
using testing::HttpResponse;

class MetricsServerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    CounterFamily* tokens =
        AddCounter(registry_.get(), "dxs_tokens_dispatched_total", "Tokens sent.").value();
    tokens->Add({{"role", "ep"}, {"rank", "0"}}).Increment(17);
    ASSERT_TRUE(RegisterBuildInfo(registry_.get(), "expert").ok());
  }

  // Start plus Expose(registry_).
  absl::StatusOr<std::unique_ptr<MetricsServer>> Start(const MetricsServerOptions& options) {
    absl::StatusOr<std::unique_ptr<MetricsServer>> server = MetricsServer::Start(options);
    if (server.ok()) (*server)->Expose(registry_);
    return server;
  }

  std::shared_ptr<prometheus::Registry> registry_ = std::make_shared<prometheus::Registry>();
};

TEST_F(MetricsServerTest, ServesMetricsOnAKernelChosenPort) {
  absl::StatusOr<std::unique_ptr<MetricsServer>> server = Start(Options("127.0.0.1:0"));
  ASSERT_TRUE(server.ok()) << server.status();
  const int port = (*server)->port();
  ASSERT_GT(port, 0);

  HttpResponse response = HttpRequest(port, "GET", "/metrics");
  ASSERT_TRUE(response.connected);
  EXPECT_EQ(response.status, 200);
  EXPECT_EQ(response.headers["content-type"], "text/plain; charset=utf-8");
  // prometheus-cpp writes labels in name order.
  EXPECT_NE(response.body.find("dxs_tokens_dispatched_total{rank=\"0\",role=\"ep\"} 17\n"),
            std::string::npos)
      << response.body;
  EXPECT_NE(response.body.find("dxs_build_info{"), std::string::npos);

  // Each scrape sees current values.
  AddCounter(registry_.get(), "dxs_tokens_dispatched_total", "Tokens sent.")
      .value()
      ->Add({{"role", "ep"}, {"rank", "0"}})
      .Increment(3);
  response = HttpRequest(port, "GET", "/metrics?x=1");
  EXPECT_NE(response.body.find("dxs_tokens_dispatched_total{rank=\"0\",role=\"ep\"} 20\n"),
            std::string::npos)
      << response.body;
}

TEST_F(MetricsServerTest, ServesEveryCollectableAndSkipsDestroyedOnes) {
  std::unique_ptr<MetricsServer> server = Start(Options("127.0.0.1:0")).value();
  auto gauges = std::make_shared<CallbackGauges>();
  CallbackRegistration bound =
      gauges->Add("dxs_queue_length", "Queued.").value()->Bind({}, [] { return 2.0; }).value();
  server->Expose(gauges);
  HttpResponse response = HttpRequest(server->port(), "GET", "/metrics");
  EXPECT_NE(response.body.find("\ndxs_queue_length 2\n"), std::string::npos) << response.body;
  EXPECT_NE(response.body.find("dxs_tokens_dispatched_total{"), std::string::npos);

  bound.Reset();
  gauges.reset();
  response = HttpRequest(server->port(), "GET", "/metrics");
  EXPECT_EQ(response.status, 200);
  EXPECT_EQ(response.body.find("dxs_queue_length"), std::string::npos) << response.body;
  EXPECT_NE(response.body.find("dxs_tokens_dispatched_total{"), std::string::npos);
}

TEST_F(MetricsServerTest, NothingElseIsServed) {
  std::unique_ptr<MetricsServer> server = Start(Options("127.0.0.1:0")).value();
  EXPECT_EQ(HttpRequest(server->port(), "GET", "/").status, 404);
  EXPECT_EQ(HttpRequest(server->port(), "GET", "/index.html").status, 404);
}

TEST_F(MetricsServerTest, StopReleasesThePort) {
  std::unique_ptr<MetricsServer> server = Start(Options("127.0.0.1:0")).value();
  const int port = server->port();
  ASSERT_EQ(HttpRequest(port, "GET", "/metrics").status, 200);

  // While it runs, a second server cannot take the same port.
  absl::StatusOr<std::unique_ptr<MetricsServer>> second =
      Start(Options("127.0.0.1:" + std::to_string(port)));
  EXPECT_EQ(second.status().code(), absl::StatusCode::kUnavailable);

  // Stop wakes civetweb's accept loop instead of waiting out its 2 s poll.
  const auto stop_start = std::chrono::steady_clock::now();
  server->Stop();
  EXPECT_LT(std::chrono::steady_clock::now() - stop_start, std::chrono::milliseconds(1000));
  server->Stop();  // idempotent
  EXPECT_FALSE(HttpRequest(port, "GET", "/metrics").connected);

  // And after Stop the port can be bound again.
  absl::StatusOr<std::unique_ptr<MetricsServer>> again =
      Start(Options("127.0.0.1:" + std::to_string(port)));
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ((*again)->port(), port);
  EXPECT_EQ(HttpRequest(port, "GET", "/metrics").status, 200);
}

TEST_F(MetricsServerTest, ListensOnAllInterfaces) {
  absl::StatusOr<std::unique_ptr<MetricsServer>> server = Start(Options("0.0.0.0:0"));
  ASSERT_TRUE(server.ok()) << server.status();
  EXPECT_EQ(HttpRequest((*server)->port(), "GET", "/metrics").status, 200);
}

TEST_F(MetricsServerTest, Ipv6ServesOrSaysItCannot) {
  absl::StatusOr<std::unique_ptr<MetricsServer>> server = Start(Options("[::1]:0"));
  if (server.status().code() == absl::StatusCode::kUnimplemented) {
    GTEST_SKIP() << server.status();
  }
  ASSERT_TRUE(server.ok()) << server.status();
  EXPECT_GT((*server)->port(), 0);
}

TEST_F(MetricsServerTest, RejectsMalformedAddresses) {
  for (const char* bad :
       {"", "9100", "localhost:9100", "127.0.0.1:", "127.0.0.1:70000", "127.0.0.1:9100s",
        "127.0.0.1:9100,127.0.0.1:9101", "::1:0", "[::1]x:0", "127.0.0.1:-1"}) {
    absl::StatusOr<std::unique_ptr<MetricsServer>> server = Start(Options(bad));
    EXPECT_EQ(server.status().code(), absl::StatusCode::kInvalidArgument) << bad;
  }
  EXPECT_EQ(Start(Options("127.0.0.1:0", 0)).status().code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace dxs::metrics
