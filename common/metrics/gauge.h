// A value that goes up and down and is owned by the code that sets it: in-flight requests,
// ranks alive. For a value owned elsewhere and read at scrape time (KV blocks in use, queue
// length), use a callback gauge (family.h: CallbackGaugeFamily) instead of copying it here.
//
// Thread safety: every method may be called from any thread; Set is one atomic store,
// Increment/Decrement a compare-exchange loop.
#pragma once

#include <atomic>

#include "common/metrics/atomic_double.h"

namespace dxs::metrics {

class Gauge {
 public:
  Gauge() = default;
  Gauge(const Gauge&) = delete;
  Gauge& operator=(const Gauge&) = delete;

  void Set(double value) { value_.store(value, std::memory_order_relaxed); }
  void Increment(double delta = 1.0) { internal::AtomicAdd(&value_, delta); }
  void Decrement(double delta = 1.0) { internal::AtomicAdd(&value_, -delta); }
  double Value() const { return value_.load(std::memory_order_relaxed); }

 private:
  std::atomic<double> value_{0.0};
};

}  // namespace dxs::metrics
