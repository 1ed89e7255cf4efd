// Registration rules (names, labels, buckets, duplicates), child lookup and the hot-path
// types under concurrent use.
#include "common/metrics/registry.h"

#include <cmath>
#include <limits>
#include <thread>
#include <vector>

#include "gtest/gtest.h"

namespace dxs::metrics {
namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();
constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

TEST(RegistryTest, MetricNamesFollowThePrometheusRule) {
  Registry registry;
  for (const char* bad : {"", "1abc", "a-b", "a b", "a.b", "é_total"}) {
    absl::StatusOr<GaugeFamily*> family = registry.AddGauge(bad, "help");
    EXPECT_EQ(family.status().code(), absl::StatusCode::kInvalidArgument) << bad;
  }
  for (const char* good : {"a", "_a", "dxs:ratio", "A9_b:c", ":x"}) {
    EXPECT_TRUE(registry.AddGauge(good, "help").ok()) << good;
  }
}

TEST(RegistryTest, CountersMustEndInTotal) {
  Registry registry;
  absl::StatusOr<CounterFamily*> bad = registry.AddCounter("dxs_requests", "help");
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(bad.status().message().find("_total"), absl::string_view::npos);
  EXPECT_TRUE(registry.AddCounter("dxs_requests_total", "help").ok());
}

TEST(RegistryTest, HelpIsRequired) {
  Registry registry;
  EXPECT_EQ(registry.AddGauge("dxs_x", "").status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(RegistryTest, LabelNamesAreValidatedAndReservedOnesRejected) {
  Registry registry;
  for (const char* bad : {"", "le", "__name__", "__x", "a:b", "1a", "a-b"}) {
    absl::StatusOr<CounterFamily*> family = registry.AddCounter("dxs_x_total", "help", {bad});
    EXPECT_EQ(family.status().code(), absl::StatusCode::kInvalidArgument) << bad;
  }
  EXPECT_EQ(registry.AddCounter("dxs_x_total", "help", {"rank", "rank"}).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(registry.AddCounter("dxs_x_total", "help", {"_role", "rank2", "lE"}).ok());
}

TEST(RegistryTest, HistogramBucketsMustStrictlyIncrease) {
  Registry registry;
  const std::vector<std::vector<double>> bad = {{1, 1},     {2, 1},       {kNaN},
                                                {-kInf, 1}, {1, kInf, 2}, {0.1, 0.2, 0.2}};
  for (const std::vector<double>& bounds : bad) {
    EXPECT_EQ(registry.AddHistogram("dxs_h_seconds", "help", {}, bounds).status().code(),
              absl::StatusCode::kInvalidArgument);
  }
  // A trailing +Inf is accepted and dropped: the +Inf bucket always exists.
  absl::StatusOr<HistogramFamily*> with_inf =
      registry.AddHistogram("dxs_h_seconds", "help", {}, {0.5, 1, kInf});
  ASSERT_TRUE(with_inf.ok()) << with_inf.status();
  EXPECT_EQ((*with_inf)->bucket_bounds(), (std::vector<double>{0.5, 1}));
  // No finite bound at all: only the +Inf bucket.
  EXPECT_TRUE(registry.AddHistogram("dxs_h2_seconds", "help", {}, {}).ok());
}

TEST(RegistryTest, BucketHelpers) {
  EXPECT_EQ(LinearBuckets(1, 2, 3), (std::vector<double>{1, 3, 5}));
  EXPECT_EQ(ExponentialBuckets(0.001, 10, 3).size(), 3u);
  EXPECT_DOUBLE_EQ(ExponentialBuckets(0.001, 10, 3)[2], 0.1);
  EXPECT_TRUE(ValidateBucketBounds(ExponentialBuckets(1e-6, 2, 30)).ok());
  EXPECT_FALSE(ValidateBucketBounds(LinearBuckets(1, 0, 3)).ok());
}

TEST(RegistryTest, SameRegistrationReturnsTheSameFamily) {
  Registry registry;
  CounterFamily* a = registry.AddCounter("dxs_x_total", "help", {"role", "rank"}).value();
  CounterFamily* b = registry.AddCounter("dxs_x_total", "help", {"role", "rank"}).value();
  EXPECT_EQ(a, b);
  HistogramFamily* h1 = registry.AddHistogram("dxs_h_seconds", "help", {}, {1, 2}).value();
  HistogramFamily* h2 = registry.AddHistogram("dxs_h_seconds", "help", {}, {1, 2, kInf}).value();
  EXPECT_EQ(h1, h2);
}

TEST(RegistryTest, ConflictingRegistrationIsAnError) {
  Registry registry;
  ASSERT_TRUE(registry.AddCounter("dxs_x_total", "help", {"role"}).ok());
  EXPECT_EQ(registry.AddCounter("dxs_x_total", "help", {"rank"}).status().code(),
            absl::StatusCode::kAlreadyExists);
  EXPECT_EQ(registry.AddCounter("dxs_x_total", "other help", {"role"}).status().code(),
            absl::StatusCode::kAlreadyExists);
  EXPECT_EQ(registry.AddGauge("dxs_x_total", "help", {"role"}).status().code(),
            absl::StatusCode::kAlreadyExists);

  ASSERT_TRUE(registry.AddHistogram("dxs_h_seconds", "help", {}, {1, 2}).ok());
  EXPECT_EQ(registry.AddHistogram("dxs_h_seconds", "help", {}, {1, 3}).status().code(),
            absl::StatusCode::kAlreadyExists);

  ASSERT_TRUE(registry.AddGauge("dxs_g", "help").ok());
  EXPECT_EQ(registry.AddCallbackGauge("dxs_g", "help").status().code(),
            absl::StatusCode::kAlreadyExists);
}

TEST(RegistryTest, SampleNamesMayNotCollideAcrossFamilies) {
  Registry registry;
  ASSERT_TRUE(registry.AddHistogram("dxs_step_seconds", "help", {}, {1}).ok());
  EXPECT_EQ(registry.AddGauge("dxs_step_seconds_count", "help").status().code(),
            absl::StatusCode::kAlreadyExists);
  EXPECT_EQ(registry.AddCounter("dxs_step_seconds_bucket", "help").status().code(),
            absl::StatusCode::kInvalidArgument);  // no _total: rejected before the collision
  ASSERT_TRUE(registry.AddGauge("dxs_q_sum", "help").ok());
  EXPECT_EQ(registry.AddHistogram("dxs_q", "help", {}, {1}).status().code(),
            absl::StatusCode::kAlreadyExists);
}

TEST(FamilyTest, WithLabelsReturnsAStableChildPerLabelValues) {
  Registry registry;
  CounterFamily* family = registry.AddCounter("dxs_x_total", "help", {"role", "rank"}).value();
  Counter& dp0 = family->WithLabels({"dp", "0"});
  Counter& dp1 = family->WithLabels({"dp", "1"});
  EXPECT_NE(&dp0, &dp1);
  // Creating many more children does not move the first ones.
  for (int i = 2; i < 1000; ++i) family->WithLabels({"dp", std::to_string(i)});
  EXPECT_EQ(&family->WithLabels({"dp", "0"}), &dp0);
  EXPECT_EQ(family->TryWithLabels({"dp", "1"}).value(), &dp1);
}

TEST(FamilyTest, WrongNumberOfLabelValues) {
  Registry registry;
  CounterFamily* family = registry.AddCounter("dxs_x_total", "help", {"role", "rank"}).value();
  EXPECT_EQ(family->TryWithLabels({"dp"}).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_DEATH(family->WithLabels({"dp", "0", "extra"}), "2 label names");
}

TEST(CounterTest, DropsNegativeZeroAndNaNIncrements) {
  Counter counter;
  counter.Increment();
  counter.Increment(2);
  counter.Increment(uint64_t{3});
  counter.Increment(0.25);
  counter.Increment(-5);
  counter.Increment(-0.5);
  counter.Increment(kNaN);
  counter.Increment(0.0);
  EXPECT_DOUBLE_EQ(counter.Value(), 6.25);
}

TEST(GaugeTest, SetIncrementDecrement) {
  Gauge gauge;
  gauge.Set(10);
  gauge.Increment();
  gauge.Increment(2.5);
  gauge.Decrement(4);
  EXPECT_DOUBLE_EQ(gauge.Value(), 9.5);
}

TEST(ConcurrencyTest, ThreadsIncrementingGiveAnExactTotal) {
  Registry registry;
  CounterFamily* counters = registry.AddCounter("dxs_x_total", "help", {"rank"}).value();
  GaugeFamily* gauges = registry.AddGauge("dxs_g", "help", {"rank"}).value();
  HistogramFamily* histograms =
      registry.AddHistogram("dxs_h_seconds", "help", {"rank"}, {0.5, 1.5, 2.5}).value();
  constexpr int kThreads = 8;
  constexpr int kIterations = 100000;
  std::vector<std::thread> threads;
  std::vector<Counter*> seen(kThreads);
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      // Every thread looks the children up itself: creation races on the same labels.
      Counter& shared = counters->WithLabels({"all"});
      Counter& mine = counters->WithLabels({std::to_string(t)});
      Gauge& gauge = gauges->WithLabels({"all"});
      Histogram& histogram = histograms->WithLabels({"all"});
      seen[t] = &shared;
      for (int i = 0; i < kIterations; ++i) {
        shared.Increment();
        shared.Increment(0.5);
        mine.Increment(2);
        gauge.Increment();
        gauge.Decrement();
        histogram.Observe(static_cast<double>(i % 3));  // 0, 1, 2: one per finite bucket
        if (i % 10000 == 0) registry.Scrape();          // readers alongside the writers
      }
    });
  }
  for (std::thread& thread : threads) thread.join();

  for (int t = 1; t < kThreads; ++t) EXPECT_EQ(seen[t], seen[0]);
  EXPECT_EQ(counters->WithLabels({"all"}).Value(), kThreads * kIterations * 1.5);
  for (int t = 0; t < kThreads; ++t) {
    EXPECT_EQ(counters->WithLabels({std::to_string(t)}).Value(), 2.0 * kIterations);
  }
  EXPECT_EQ(gauges->WithLabels({"all"}).Value(), 0.0);

  const Histogram::Snapshot snapshot = histograms->WithLabels({"all"}).Collect();
  const uint64_t total = uint64_t{kThreads} * kIterations;
  EXPECT_EQ(snapshot.count, total);
  ASSERT_EQ(snapshot.cumulative_counts.size(), 4u);
  // kIterations is not a multiple of 3: 0 is seen once more than 1 and 2 per thread.
  const uint64_t zeros = uint64_t{kThreads} * ((kIterations + 2) / 3);
  const uint64_t ones = uint64_t{kThreads} * ((kIterations + 1) / 3);
  EXPECT_EQ(snapshot.cumulative_counts[0], zeros);
  EXPECT_EQ(snapshot.cumulative_counts[1], zeros + ones);
  EXPECT_EQ(snapshot.cumulative_counts[2], total);
  EXPECT_EQ(snapshot.cumulative_counts[3], total);
  EXPECT_EQ(snapshot.sum, static_cast<double>(ones + 2 * (total - zeros - ones)));
}

}  // namespace
}  // namespace dxs::metrics
