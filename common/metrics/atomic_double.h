// std::atomic<double>::fetch_add is C++20; this is the C++17 compare-exchange loop.
#pragma once

#include <atomic>

namespace dxs::metrics::internal {

inline void AtomicAdd(std::atomic<double>* target, double delta) {
  double current = target->load(std::memory_order_relaxed);
  while (!target->compare_exchange_weak(current, current + delta, std::memory_order_relaxed)) {
  }
}

}  // namespace dxs::metrics::internal
