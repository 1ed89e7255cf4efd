// A monotonically increasing value: tokens dispatched, requests failed, empty steps.
//
// Thread safety: every method may be called from any thread. Integral increments are one
// wait-free fetch_add on a 64-bit integer; floating increments are a compare-exchange loop
// on a separate double, so the common "count one more" case never spins.
// Invariant: Value() never decreases. Increments that are negative, zero or NaN are dropped.
#pragma once

#include <atomic>
#include <cstdint>
#include <type_traits>

#include "common/metrics/atomic_double.h"

namespace dxs::metrics {

class Counter {
 public:
  Counter() = default;
  Counter(const Counter&) = delete;
  Counter& operator=(const Counter&) = delete;

  void Increment() { whole_.fetch_add(1, std::memory_order_relaxed); }

  template <typename T, std::enable_if_t<std::is_arithmetic_v<T>, int> = 0>
  void Increment(T delta) {
    if constexpr (std::is_integral_v<T>) {
      if (delta > T{0}) whole_.fetch_add(static_cast<uint64_t>(delta), std::memory_order_relaxed);
    } else {
      if (delta > T{0}) internal::AtomicAdd(&fractional_, static_cast<double>(delta));
    }
  }

  double Value() const {
    return static_cast<double>(whole_.load(std::memory_order_relaxed)) +
           fractional_.load(std::memory_order_relaxed);
  }

 private:
  std::atomic<uint64_t> whole_{0};
  // Sum of the floating-point increments (seconds, bytes as double).
  std::atomic<double> fractional_{0.0};
};

}  // namespace dxs::metrics
