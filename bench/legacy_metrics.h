// The counter and histogram dxs wrote itself before it moved to prometheus-cpp (commit
// 5cb0bc9, common/metrics/counter.h and histogram.h), kept here only so that metrics_bench
// measures old against new in the same run. Nothing outside bench/ may use it.
//
// Counter: integral increments are one fetch_add on a 64-bit integer, floating ones a
// compare-exchange loop on a separate double. Histogram: a binary search, one relaxed
// fetch_add on the bucket's counter and a compare-exchange on the sum; no lock.
#pragma once

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <memory>
#include <type_traits>
#include <vector>

namespace dxs::bench::legacy {

inline void AtomicAdd(std::atomic<double>* target, double delta) {
  double current = target->load(std::memory_order_relaxed);
  while (!target->compare_exchange_weak(current, current + delta, std::memory_order_relaxed)) {
  }
}

class Counter {
 public:
  void Increment() { whole_.fetch_add(1, std::memory_order_relaxed); }

  template <typename T, std::enable_if_t<std::is_arithmetic_v<T>, int> = 0>
  void Increment(T delta) {
    if constexpr (std::is_integral_v<T>) {
      if (delta > T{0}) whole_.fetch_add(static_cast<uint64_t>(delta), std::memory_order_relaxed);
    } else {
      if (delta > T{0}) AtomicAdd(&fractional_, static_cast<double>(delta));
    }
  }

  double Value() const {
    return static_cast<double>(whole_.load(std::memory_order_relaxed)) +
           fractional_.load(std::memory_order_relaxed);
  }

 private:
  std::atomic<uint64_t> whole_{0};
  std::atomic<double> fractional_{0.0};
};

class Histogram {
 public:
  // bounds: finite, strictly increasing upper bounds, outliving this.
  explicit Histogram(const std::vector<double>* bounds)
      : bounds_(bounds), counts_(new std::atomic<uint64_t>[bounds->size() + 1]) {
    for (size_t i = 0; i <= bounds->size(); ++i) counts_[i].store(0, std::memory_order_relaxed);
  }

  void Observe(double v) {
    const std::vector<double>& b = *bounds_;
    const size_t i = std::isnan(v) ? b.size() : std::lower_bound(b.begin(), b.end(), v) - b.begin();
    counts_[i].fetch_add(1, std::memory_order_relaxed);
    AtomicAdd(&sum_, v);
  }

  uint64_t Count() const {
    uint64_t n = 0;
    for (size_t i = 0; i <= bounds_->size(); ++i) n += counts_[i].load(std::memory_order_relaxed);
    return n;
  }

 private:
  const std::vector<double>* bounds_;
  std::unique_ptr<std::atomic<uint64_t>[]> counts_;
  std::atomic<double> sum_{0.0};
};

}  // namespace dxs::bench::legacy
