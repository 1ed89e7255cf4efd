// What the server sends passes `promtool check metrics` (Prometheus' own parser and linter)
// with no complaint: histograms, labelled counters, gauges, callback gauges, build info,
// escaped label values, +Inf and NaN values, and the exposer's own series.
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <fstream>
#include <limits>
#include <memory>
#include <sstream>
#include <string>

#include "common/metrics/build_info.h"
#include "common/metrics/callback_gauge.h"
#include "common/metrics/families.h"
#include "common/metrics/metrics_server.h"
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

constexpr char kPromtool[] = "/usr/bin/promtool";

struct PromtoolResult {
  int exit_code = -1;
  std::string output;  // stdout and stderr together
};

// Pipes text to `promtool check metrics` on stdin.
PromtoolResult CheckMetrics(const std::string& text) {
  char path[] = "/tmp/dxs_promtool_XXXXXX";
  const int fd = mkstemp(path);
  if (fd < 0) return {};
  close(fd);
  const std::string command = std::string(kPromtool) + " check metrics >" + path + " 2>&1";
  PromtoolResult result;
  FILE* pipe = popen(command.c_str(), "w");
  if (pipe == nullptr) return result;
  std::fwrite(text.data(), 1, text.size(), pipe);
  const int status = pclose(pipe);
  result.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  std::ifstream in(path);
  std::stringstream output;
  output << in.rdbuf();
  result.output = output.str();
  unlink(path);
  return result;
}

TEST(PromtoolTest, ScrapedTextPassesPromtoolCheckMetrics) {
  if (access(kPromtool, X_OK) != 0) GTEST_SKIP() << kPromtool << " not installed";

  auto registry = std::make_shared<prometheus::Registry>();
  ASSERT_TRUE(RegisterBuildInfo(registry.get(), "attention").ok());
  CounterFamily* tokens =
      AddCounter(registry.get(), "dxs_tokens_dispatched_total", "Tokens sent to expert ranks.")
          .value();
  tokens->Add({{"role", "dp"}, {"rank", "0"}}).Increment(1024);
  tokens->Add({{"role", "dp"}, {"rank", "1"}}).Increment(0.5);
  AddCounter(registry.get(), "dxs_empty_steps_total", "Steps with an empty batch.")
      .value()
      ->Add({{"role", "ep"}, {"rank", "3"}})
      .Increment();
  HistogramFamily* latency =
      AddHistogram(registry.get(), "dxs_dispatch_latency_seconds", "Dispatch latency.").value();
  prometheus::Histogram& rank0 = latency->Add({{"rank", "0"}}, ExponentialBuckets(1e-6, 4, 12));
  for (int i = 0; i < 100; ++i) rank0.Observe(i * 1e-5);
  latency->Add({{"rank", "1"}}, ExponentialBuckets(1e-6, 4, 12)).Observe(50);  // lands in +Inf
  AddHistogram(registry.get(), "dxs_step_seconds", "Step time.")
      .value()
      ->Add({}, LinearBuckets(0.01, 0.01, 5))
      .Observe(0.025);
  GaugeFamily* odd =
      AddGauge(registry.get(), "dxs_odd_values", "Values: \"quoted\", +Inf, NaN.").value();
  odd->Add({{"path", "C:\\tmp\n\"x\""}}).Set(std::numeric_limits<double>::infinity());
  odd->Add({{"path", "nan"}}).Set(std::numeric_limits<double>::quiet_NaN());
  odd->Add({{"path", "neg"}}).Set(-1e-9);
  odd->Add({{"path", "utf8 ✓"}}).Set(1e300);
  auto gauges = std::make_shared<CallbackGauges>();
  CallbackRegistration bound = gauges->Add("dxs_queue_length", "Requests waiting.")
                                   .value()
                                   ->Bind({{"rank", "0"}}, [] { return 4.0; })
                                   .value();

  std::unique_ptr<MetricsServer> server = MetricsServer::Start(Options("127.0.0.1:0")).value();
  server->Expose(registry);
  server->Expose(gauges);
  testing::HttpResponse response = testing::HttpRequest(server->port(), "GET", "/metrics");
  ASSERT_EQ(response.status, 200);
  ASSERT_NE(response.body.find("dxs_dispatch_latency_seconds_bucket{rank=\"1\",le=\"+Inf\"} 1"),
            std::string::npos);
  ASSERT_NE(response.body.find("dxs_queue_length{rank=\"0\"} 4"), std::string::npos);

  const PromtoolResult result = CheckMetrics(response.body);
  EXPECT_EQ(result.exit_code, 0) << result.output << "\n--- input ---\n" << response.body;
  EXPECT_EQ(result.output, "") << "--- input ---\n" << response.body;
}

// The check is only worth something if promtool does complain about bad input.
TEST(PromtoolTest, PromtoolRejectsWhatWeNeverWrite) {
  if (access(kPromtool, X_OK) != 0) GTEST_SKIP() << kPromtool << " not installed";
  PromtoolResult lint = CheckMetrics("# HELP x h\n# TYPE x counter\nx 1\n");
  EXPECT_NE(lint.exit_code, 0);
  EXPECT_NE(lint.output, "");
  PromtoolResult parse = CheckMetrics("# HELP x h\n# TYPE x gauge\nx{a=\"b\\q\"} 1\n");
  EXPECT_NE(parse.exit_code, 0);
}

}  // namespace
}  // namespace dxs::metrics
