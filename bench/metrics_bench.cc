// metrics_bench: what one metric update costs on the hot path, dxs's own counter and
// histogram (before prometheus-cpp; bench/legacy_metrics.h) against prometheus-cpp's, in
// the same run. Each update goes through a reference looked up once, as the services do.
//
//   build/bin/metrics_bench [--benchmark_repetitions=5 --benchmark_report_aggregates_only]
//
// Counter: Increment() (one more step) and Increment(37) (tokens of a layer). Histogram:
// Observe over the 20 exponential buckets of dxs_dispatch_latency_seconds, values spread
// over them. /threads:2 runs two threads on the same child (contention, as when a scrape
// or a second thread updates it).
#include <cstdint>
#include <vector>

#include "bench/legacy_metrics.h"
#include "benchmark/benchmark.h"
#include "common/metrics/families.h"
#include "prometheus/registry.h"

namespace {

namespace legacy = dxs::bench::legacy;

// The buckets of dxs_dispatch_latency_seconds and observations spread over them.
const std::vector<double>& Bounds() {
  static const std::vector<double> bounds = dxs::metrics::ExponentialBuckets(1e-5, 2, 20);
  return bounds;
}
const std::vector<double>& Observations() {
  static const std::vector<double> values = [] {
    std::vector<double> v;
    for (int i = 0; i < 1024; ++i) v.push_back(1e-5 * (1 << (i % 22)) * (0.5 + (i % 7) / 7.0));
    return v;
  }();
  return values;
}

legacy::Counter legacy_counter;
prometheus::Counter& PrometheusCounter() {
  static prometheus::Registry registry;
  static prometheus::Counter& c =
      dxs::metrics::AddCounter(&registry, "dxs_bench_total", "Bench.").value()->Add({});
  return c;
}
legacy::Histogram legacy_histogram(&Bounds());
prometheus::Histogram& PrometheusHistogram() {
  static prometheus::Registry registry;
  static prometheus::Histogram& h =
      dxs::metrics::AddHistogram(&registry, "dxs_bench_seconds", "Bench.")
          .value()
          ->Add({}, Bounds());
  return h;
}

void BM_CounterIncrement_Legacy(benchmark::State& state) {
  for (auto _ : state) legacy_counter.Increment();
  benchmark::DoNotOptimize(legacy_counter.Value());
}
void BM_CounterIncrement_PrometheusCpp(benchmark::State& state) {
  prometheus::Counter& c = PrometheusCounter();
  for (auto _ : state) c.Increment();
  benchmark::DoNotOptimize(c.Value());
}
void BM_CounterIncrementBy37_Legacy(benchmark::State& state) {
  const int64_t n = 37;
  for (auto _ : state) legacy_counter.Increment(n);
  benchmark::DoNotOptimize(legacy_counter.Value());
}
void BM_CounterIncrementBy37_PrometheusCpp(benchmark::State& state) {
  prometheus::Counter& c = PrometheusCounter();
  const int64_t n = 37;
  for (auto _ : state) c.Increment(static_cast<double>(n));
  benchmark::DoNotOptimize(c.Value());
}
void BM_HistogramObserve_Legacy(benchmark::State& state) {
  const std::vector<double>& v = Observations();
  size_t i = state.thread_index();
  for (auto _ : state) legacy_histogram.Observe(v[i++ & 1023]);
  benchmark::DoNotOptimize(legacy_histogram.Count());
}
void BM_HistogramObserve_PrometheusCpp(benchmark::State& state) {
  prometheus::Histogram& h = PrometheusHistogram();
  const std::vector<double>& v = Observations();
  size_t i = state.thread_index();
  for (auto _ : state) h.Observe(v[i++ & 1023]);
}

BENCHMARK(BM_CounterIncrement_Legacy)->Threads(1)->Threads(2);
BENCHMARK(BM_CounterIncrement_PrometheusCpp)->Threads(1)->Threads(2);
BENCHMARK(BM_CounterIncrementBy37_Legacy)->Threads(1)->Threads(2);
BENCHMARK(BM_CounterIncrementBy37_PrometheusCpp)->Threads(1)->Threads(2);
BENCHMARK(BM_HistogramObserve_Legacy)->Threads(1)->Threads(2);
BENCHMARK(BM_HistogramObserve_PrometheusCpp)->Threads(1)->Threads(2);

}  // namespace

BENCHMARK_MAIN();
