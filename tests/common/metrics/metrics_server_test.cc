// MetricsServer over real sockets: GET /metrics on a kernel-chosen port, headers, other
// methods and paths, bad addresses, a busy port, shutdown.
#include "common/metrics/metrics_server.h"

#include <memory>

#include "common/metrics/build_info.h"
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
        registry_.AddCounter("dxs_tokens_dispatched_total", "Tokens sent.", {"role", "rank"})
            .value();
    tokens->WithLabels({"ep", "0"}).Increment(17);
    ASSERT_TRUE(RegisterBuildInfo(&registry_, "expert").ok());
  }

  Registry registry_;
};

TEST_F(MetricsServerTest, ServesMetricsOnAKernelChosenPort) {
  absl::StatusOr<std::unique_ptr<MetricsServer>> server =
      MetricsServer::Start(&registry_, Options("127.0.0.1:0"));
  ASSERT_TRUE(server.ok()) << server.status();
  const int port = (*server)->port();
  ASSERT_GT(port, 0);

  HttpResponse response = HttpRequest(port, "GET", "/metrics");
  ASSERT_TRUE(response.connected);
  EXPECT_EQ(response.status, 200);
  EXPECT_EQ(response.headers["content-type"], "text/plain; version=0.0.4; charset=utf-8");
  EXPECT_EQ(response.body, registry_.Scrape());
  EXPECT_NE(response.body.find("dxs_tokens_dispatched_total{role=\"ep\",rank=\"0\"} 17\n"),
            std::string::npos)
      << response.body;
  EXPECT_NE(response.body.find("dxs_build_info{"), std::string::npos);

  // Each scrape sees current values.
  registry_.AddCounter("dxs_tokens_dispatched_total", "Tokens sent.", {"role", "rank"})
      .value()
      ->WithLabels({"ep", "0"})
      .Increment(3);
  response = HttpRequest(port, "GET", "/metrics?x=1");
  EXPECT_NE(response.body.find("dxs_tokens_dispatched_total{role=\"ep\",rank=\"0\"} 20\n"),
            std::string::npos)
      << response.body;
}

TEST_F(MetricsServerTest, HeadOtherMethodsAndOtherPaths) {
  std::unique_ptr<MetricsServer> server =
      MetricsServer::Start(&registry_, Options("127.0.0.1:0")).value();

  HttpResponse head = HttpRequest(server->port(), "HEAD", "/metrics");
  EXPECT_EQ(head.status, 200);
  EXPECT_EQ(head.headers["content-type"], "text/plain; version=0.0.4; charset=utf-8");
  EXPECT_EQ(head.body, "");

  HttpResponse post = HttpRequest(server->port(), "POST", "/metrics");
  EXPECT_EQ(post.status, 405);
  EXPECT_EQ(post.headers["allow"], "GET, HEAD");

  EXPECT_EQ(HttpRequest(server->port(), "GET", "/").status, 404);
  EXPECT_EQ(HttpRequest(server->port(), "GET", "/metricsx").status, 404);
  EXPECT_EQ(HttpRequest(server->port(), "GET", "/metrics/x").status, 404);
}

TEST_F(MetricsServerTest, StopReleasesThePort) {
  std::unique_ptr<MetricsServer> server =
      MetricsServer::Start(&registry_, Options("127.0.0.1:0")).value();
  const int port = server->port();
  ASSERT_EQ(HttpRequest(port, "GET", "/metrics").status, 200);

  // While it runs, a second server cannot take the same port.
  absl::StatusOr<std::unique_ptr<MetricsServer>> second =
      MetricsServer::Start(&registry_, Options("127.0.0.1:" + std::to_string(port)));
  EXPECT_EQ(second.status().code(), absl::StatusCode::kUnavailable);

  server->Stop();
  server->Stop();  // idempotent
  EXPECT_FALSE(HttpRequest(port, "GET", "/metrics").connected);

  // And after Stop the port can be bound again.
  absl::StatusOr<std::unique_ptr<MetricsServer>> again =
      MetricsServer::Start(&registry_, Options("127.0.0.1:" + std::to_string(port)));
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ((*again)->port(), port);
  EXPECT_EQ(HttpRequest(port, "GET", "/metrics").status, 200);
}

TEST_F(MetricsServerTest, ListensOnAllInterfaces) {
  absl::StatusOr<std::unique_ptr<MetricsServer>> server =
      MetricsServer::Start(&registry_, Options("0.0.0.0:0"));
  ASSERT_TRUE(server.ok()) << server.status();
  EXPECT_EQ(HttpRequest((*server)->port(), "GET", "/metrics").status, 200);
}

TEST_F(MetricsServerTest, Ipv6ServesOrSaysItCannot) {
  absl::StatusOr<std::unique_ptr<MetricsServer>> server =
      MetricsServer::Start(&registry_, Options("[::1]:0"));
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
    absl::StatusOr<std::unique_ptr<MetricsServer>> server =
        MetricsServer::Start(&registry_, Options(bad));
    EXPECT_EQ(server.status().code(), absl::StatusCode::kInvalidArgument) << bad;
  }
  EXPECT_EQ(MetricsServer::Start(&registry_, Options("127.0.0.1:0", 0)).status().code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace dxs::metrics
