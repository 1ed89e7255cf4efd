// The registration helpers over prometheus-cpp: the dxs naming rules, the library's
// exceptions turned into absl::Status, merging of repeated registrations, bucket helpers,
// and callback gauges bound and unbound around scrapes.
#include "common/metrics/families.h"

#include <atomic>
#include <chrono>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "common/metrics/callback_gauge.h"
#include "gtest/gtest.h"
#include "prometheus/text_serializer.h"

namespace dxs::metrics {
namespace {

std::string Text(const prometheus::Collectable& c) {
  return prometheus::TextSerializer().Serialize(c.Collect());
}

TEST(FamiliesTest, MetricNamesFollowThePrometheusRule) {
  prometheus::Registry registry;
  for (const char* bad : {"", "1abc", "a-b", "a b", "dxs_é"}) {
    EXPECT_EQ(AddGauge(&registry, bad, "help").status().code(), absl::StatusCode::kInvalidArgument)
        << bad;
  }
  EXPECT_TRUE(AddGauge(&registry, "dxs:ok_name", "help").ok());
}

TEST(FamiliesTest, CountersMustEndInTotal) {
  prometheus::Registry registry;
  EXPECT_EQ(AddCounter(&registry, "dxs_tokens", "help").status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(AddCounter(&registry, "dxs_tokens_total", "help").ok());
}

TEST(FamiliesTest, HelpIsRequiredAndNeverNeedsEscaping) {
  prometheus::Registry registry;
  EXPECT_EQ(AddGauge(&registry, "dxs_a", "").status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(AddGauge(&registry, "dxs_b", "two\nlines").status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(AddGauge(&registry, "dxs_c", "back\\slash").status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(AddGauge(&registry, "dxs_d", "\"Quoted\" is fine.").ok());
}

TEST(FamiliesTest, SameRegistrationReturnsTheSameFamily) {
  prometheus::Registry registry;
  CounterFamily* a = AddCounter(&registry, "dxs_steps_total", "Steps.").value();
  CounterFamily* b = AddCounter(&registry, "dxs_steps_total", "Steps.").value();
  EXPECT_EQ(a, b);
  // Children are stable: the reference the hot path keeps is the one a later lookup finds.
  prometheus::Counter& child = a->Add({{"role", "attention"}, {"rank", "0"}});
  child.Increment(3);
  EXPECT_EQ(&b->Add({{"rank", "0"}, {"role", "attention"}}), &child);
  EXPECT_EQ(child.Value(), 3);
}

TEST(FamiliesTest, ANameTakenByAnotherTypeIsAlreadyExists) {
  prometheus::Registry registry;
  ASSERT_TRUE(AddGauge(&registry, "dxs_x_total", "A gauge.").ok());
  EXPECT_EQ(AddCounter(&registry, "dxs_x_total", "A counter.").status().code(),
            absl::StatusCode::kAlreadyExists);
  EXPECT_EQ(AddHistogram(&registry, "dxs_x_total", "A histogram.").status().code(),
            absl::StatusCode::kAlreadyExists);
}

TEST(FamiliesTest, BucketHelpers) {
  EXPECT_EQ(LinearBuckets(1, 2, 3), (std::vector<double>{1, 3, 5}));
  EXPECT_EQ(ExponentialBuckets(1e-3, 2, 4), (std::vector<double>{1e-3, 2e-3, 4e-3, 8e-3}));
}

TEST(FamiliesTest, ConcurrentIncrementsGiveAnExactTotal) {
  prometheus::Registry registry;
  prometheus::Counter& c = AddCounter(&registry, "dxs_n_total", "N.").value()->Add({});
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&c] {
      for (int i = 0; i < 10000; ++i) c.Increment();
    });
  }
  for (std::thread& t : threads) t.join();
  EXPECT_EQ(c.Value(), 40000);
}

TEST(CallbackGaugesTest, ReadAtScrapeTimeAndGoneOnceUnbound) {
  CallbackGauges gauges;
  CallbackGaugeFamily* queue = gauges.Add("dxs_queue_length", "Requests waiting.").value();
  EXPECT_EQ(Text(gauges), "");  // no callback bound: the family is not exposed
  double value = 4;
  CallbackRegistration bound = queue->Bind({{"rank", "0"}}, [&value] { return value; }).value();
  EXPECT_EQ(Text(gauges),
            "# HELP dxs_queue_length Requests waiting.\n# TYPE dxs_queue_length gauge\n"
            "dxs_queue_length{rank=\"0\"} 4\n");
  value = 7;
  EXPECT_NE(Text(gauges).find("dxs_queue_length{rank=\"0\"} 7\n"), std::string::npos);

  // The same labels twice is a mistake; other labels are another series.
  EXPECT_EQ(queue->Bind({{"rank", "0"}}, [] { return 1.0; }).status().code(),
            absl::StatusCode::kAlreadyExists);
  EXPECT_EQ(queue->Bind({{"bad-name", "0"}}, [] { return 1.0; }).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(queue->Bind({{"rank", "1"}}, nullptr).status().code(),
            absl::StatusCode::kInvalidArgument);

  CallbackRegistration moved = std::move(bound);
  EXPECT_FALSE(bound.bound());
  EXPECT_TRUE(moved.bound());
  moved.Reset();
  EXPECT_EQ(Text(gauges), "");
  // After Reset the labels are free again.
  EXPECT_TRUE(queue->Bind({{"rank", "0"}}, [] { return 1.0; }).ok());
}

TEST(CallbackGaugesTest, SameNameSameHelpIsOneFamily) {
  CallbackGauges gauges;
  CallbackGaugeFamily* a = gauges.Add("dxs_kv_used", "KV used.").value();
  EXPECT_EQ(gauges.Add("dxs_kv_used", "KV used.").value(), a);
  EXPECT_EQ(gauges.Add("dxs_kv_used", "Other help.").status().code(),
            absl::StatusCode::kAlreadyExists);
  EXPECT_EQ(gauges.Add("dxs kv", "KV.").status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(gauges.Add("dxs_kv2", "").status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(CallbackGaugesTest, UnbindWaitsForAScrapeInProgress) {
  CallbackGauges gauges;
  CallbackGaugeFamily* family = gauges.Add("dxs_slow", "Slow.").value();
  std::atomic<bool> entered{false};
  std::atomic<bool> finished{false};
  auto state = std::make_unique<int>(5);
  CallbackRegistration r = family
                               ->Bind({},
                                      [&entered, &finished, p = state.get()] {
                                        entered = true;
                                        std::this_thread::sleep_for(std::chrono::milliseconds(50));
                                        const double value = *p;
                                        finished = true;
                                        return value;
                                      })
                               .value();
  std::thread scraper([&gauges] { (void)gauges.Collect(); });
  while (!entered) std::this_thread::yield();
  r.Reset();  // returns only after the callback above has finished
  EXPECT_TRUE(finished) << "Reset returned while the callback was still running";
  state.reset();  // so this is safe
  scraper.join();
}

}  // namespace
}  // namespace dxs::metrics
