// The text exposition: exact output for a small registry, escaping, number formatting,
// cumulative histogram buckets, callback gauges and dxs_build_info.
#include "common/metrics/text_format.h"

#include <limits>
#include <string>

#include "common/metrics/build_info.h"
#include "common/metrics/registry.h"
#include "gtest/gtest.h"

namespace dxs::metrics {
namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();
constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

std::string Value(double v) {
  std::string out;
  text::AppendValue(v, &out);
  return out;
}

TEST(TextFormatTest, ExactOutputForASmallRegistry) {
  Registry registry;
  CounterFamily* requests =
      registry.AddCounter("dxs_requests_total", "Requests finished.", {"role", "rank"}).value();
  requests->WithLabels({"dp", "1"}).Increment(3);
  requests->WithLabels({"dp", "0"}).Increment();
  registry.AddGauge("dxs_queue_length", "Requests waiting.").value()->WithLabels({}).Set(2.5);
  Histogram& step =
      registry.AddHistogram("dxs_step_seconds", "Step time.", {"role"}, {0.25, 1, 2.5})
          .value()
          ->WithLabels({"dp"});
  for (double v : {0.125, 0.5, 0.5, 4.0}) step.Observe(v);
  // A labelled family without children writes nothing, not even HELP/TYPE.
  ASSERT_TRUE(registry.AddGauge("dxs_unused", "Never set.", {"rank"}).ok());

  EXPECT_EQ(registry.Scrape(),
            "# HELP dxs_queue_length Requests waiting.\n"
            "# TYPE dxs_queue_length gauge\n"
            "dxs_queue_length 2.5\n"
            "# HELP dxs_requests_total Requests finished.\n"
            "# TYPE dxs_requests_total counter\n"
            "dxs_requests_total{role=\"dp\",rank=\"0\"} 1\n"
            "dxs_requests_total{role=\"dp\",rank=\"1\"} 3\n"
            "# HELP dxs_step_seconds Step time.\n"
            "# TYPE dxs_step_seconds histogram\n"
            "dxs_step_seconds_bucket{role=\"dp\",le=\"0.25\"} 1\n"
            "dxs_step_seconds_bucket{role=\"dp\",le=\"1\"} 3\n"
            "dxs_step_seconds_bucket{role=\"dp\",le=\"2.5\"} 3\n"
            "dxs_step_seconds_bucket{role=\"dp\",le=\"+Inf\"} 4\n"
            "dxs_step_seconds_sum{role=\"dp\"} 5.125\n"
            "dxs_step_seconds_count{role=\"dp\"} 4\n");
}

TEST(TextFormatTest, UnlabelledMetricsAreExposedAtZeroFromRegistration) {
  Registry registry;
  ASSERT_TRUE(registry.AddCounter("dxs_errors_total", "Errors.").ok());
  ASSERT_TRUE(registry.AddHistogram("dxs_wait_seconds", "Wait.", {}, {1}).ok());
  EXPECT_EQ(registry.Scrape(),
            "# HELP dxs_errors_total Errors.\n"
            "# TYPE dxs_errors_total counter\n"
            "dxs_errors_total 0\n"
            "# HELP dxs_wait_seconds Wait.\n"
            "# TYPE dxs_wait_seconds histogram\n"
            "dxs_wait_seconds_bucket{le=\"1\"} 0\n"
            "dxs_wait_seconds_bucket{le=\"+Inf\"} 0\n"
            "dxs_wait_seconds_sum 0\n"
            "dxs_wait_seconds_count 0\n");
}

TEST(TextFormatTest, EscapesHelpAndLabelValues) {
  std::string help;
  text::AppendEscapedHelp("a\\b\nc \"q\"", &help);
  EXPECT_EQ(help, "a\\\\b\\nc \"q\"");  // HELP keeps double quotes as they are
  std::string value;
  text::AppendEscapedLabelValue("a\\b\nc \"q\"", &value);
  EXPECT_EQ(value, "a\\\\b\\nc \\\"q\\\"");

  Registry registry;
  registry.AddGauge("dxs_g", "Line one\nline \\two\\ \"quoted\".", {"path"})
      .value()
      ->WithLabels({"C:\\dir\n\"x\""})
      .Set(1);
  EXPECT_EQ(registry.Scrape(),
            "# HELP dxs_g Line one\\nline \\\\two\\\\ \"quoted\".\n"
            "# TYPE dxs_g gauge\n"
            "dxs_g{path=\"C:\\\\dir\\n\\\"x\\\"\"} 1\n");
}

TEST(TextFormatTest, FormatsValuesTheWayPrometheusParsesThem) {
  EXPECT_EQ(Value(0), "0");
  EXPECT_EQ(Value(42), "42");
  EXPECT_EQ(Value(-0.5), "-0.5");
  EXPECT_EQ(Value(0.1), "0.1");
  EXPECT_EQ(Value(1.0 / 3), "0.3333333333333333");
  EXPECT_EQ(Value(1e6), "1e+06");
  EXPECT_EQ(Value(123456), "123456");
  EXPECT_EQ(Value(1.5e-7), "1.5e-07");
  EXPECT_EQ(Value(1234567), "1234567");  // Go writes 1.234567e+06; both parse the same
  EXPECT_EQ(Value(2.5e-300), "2.5e-300");
  EXPECT_EQ(Value(kInf), "+Inf");
  EXPECT_EQ(Value(-kInf), "-Inf");
  EXPECT_EQ(Value(kNaN), "NaN");
}

TEST(HistogramTest, BucketsAreCumulativeWithUpperBoundsInclusive) {
  Registry registry;
  Histogram& h =
      registry.AddHistogram("dxs_h_seconds", "help", {}, {1, 2, 4}).value()->WithLabels({});
  for (double v : {-3.0, 1.0, 1.0000001, 2.0, 3.0, 4.0, 4.5, 100.0, kInf}) h.Observe(v);
  const Histogram::Snapshot s = h.Collect();
  // <=1: -3, 1 | <=2: +1.0000001, 2 | <=4: +3, 4 | +Inf: +4.5, 100, +Inf
  EXPECT_EQ(s.cumulative_counts, (std::vector<uint64_t>{2, 4, 6, 9}));
  EXPECT_EQ(s.count, 9u);
  EXPECT_EQ(s.sum, kInf);

  Histogram& nan = registry.AddHistogram("dxs_n_seconds", "help", {}, {1}).value()->WithLabels({});
  nan.Observe(kNaN);
  EXPECT_EQ(nan.Collect().cumulative_counts, (std::vector<uint64_t>{0, 1}));
  const std::string text = registry.Scrape();
  EXPECT_NE(text.find("dxs_n_seconds_sum NaN\n"), std::string::npos) << text;
  EXPECT_NE(text.find("dxs_h_seconds_bucket{le=\"4\"} 6\n"), std::string::npos) << text;
  EXPECT_NE(text.find("dxs_h_seconds_bucket{le=\"+Inf\"} 9\n"), std::string::npos) << text;
  EXPECT_NE(text.find("dxs_h_seconds_count 9\n"), std::string::npos) << text;
}

TEST(CallbackGaugeTest, EvaluatedAtScrapeAndGoneAfterReset) {
  Registry registry;
  CallbackGaugeFamily* family =
      registry.AddCallbackGauge("dxs_kv_cache_used_blocks", "KV blocks in use.", {"rank"}).value();
  int used = 3;
  absl::StatusOr<CallbackRegistration> r0 = family->Bind({"0"}, [&] { return double(used); });
  ASSERT_TRUE(r0.ok()) << r0.status();
  CallbackRegistration r1 = family->Bind({"1"}, [] { return 7.0; }).value();
  EXPECT_EQ(family->Bind({"1"}, [] { return 0.0; }).status().code(),
            absl::StatusCode::kAlreadyExists);
  EXPECT_EQ(family->Bind({"1", "x"}, [] { return 0.0; }).status().code(),
            absl::StatusCode::kInvalidArgument);

  used = 5;
  EXPECT_EQ(registry.Scrape(),
            "# HELP dxs_kv_cache_used_blocks KV blocks in use.\n"
            "# TYPE dxs_kv_cache_used_blocks gauge\n"
            "dxs_kv_cache_used_blocks{rank=\"0\"} 5\n"
            "dxs_kv_cache_used_blocks{rank=\"1\"} 7\n");

  CallbackRegistration moved = std::move(*r0);
  EXPECT_FALSE(r0->bound());
  EXPECT_TRUE(moved.bound());
  r1.Reset();
  EXPECT_EQ(registry.Scrape(),
            "# HELP dxs_kv_cache_used_blocks KV blocks in use.\n"
            "# TYPE dxs_kv_cache_used_blocks gauge\n"
            "dxs_kv_cache_used_blocks{rank=\"0\"} 5\n");
  { CallbackRegistration scoped = std::move(moved); }
  EXPECT_EQ(registry.Scrape(), "");
  // The label values are free again.
  EXPECT_TRUE(family->Bind({"1"}, [] { return 1.0; }).ok());
}

TEST(BuildInfoTest, GaugeWithVersionCommitAndRoleSetToOne) {
  Registry registry;
  ASSERT_TRUE(RegisterBuildInfo(&registry, "router").ok());
  ASSERT_TRUE(RegisterBuildInfo(&registry, "router").ok());  // idempotent
  EXPECT_EQ(BuildVersion(), DXS_VERSION_STRING);
  EXPECT_FALSE(BuildGitCommit().empty());
  const std::string expected =
      "# HELP dxs_build_info Build of this dxs process; the value is always 1.\n"
      "# TYPE dxs_build_info gauge\n"
      "dxs_build_info{version=\"" DXS_VERSION_STRING "\",git_commit=\"" +
      std::string(BuildGitCommit()) + "\",role=\"router\"} 1\n";
  EXPECT_EQ(registry.Scrape(), expected);
}

}  // namespace
}  // namespace dxs::metrics
