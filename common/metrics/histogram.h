// A distribution of observations counted into fixed buckets: dispatch latency, step time,
// time to first token. Bucket upper bounds are fixed when the family is registered.
//
// Thread safety: Observe and Collect may be called from any thread. Observe is a binary
// search, one relaxed fetch_add on the bucket's own counter and a compare-exchange on the
// sum; no lock.
// Invariant: in a Snapshot, the +Inf bucket equals count (count is the sum of the buckets
// read), so the exposition is always self-consistent; sum is read separately and may lag or
// lead the buckets by the observations in flight during the scrape.
#pragma once

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "common/metrics/atomic_double.h"

namespace dxs::metrics {

// OK when bounds are strictly increasing and none is NaN. A trailing +Inf is allowed (the
// family drops it; the +Inf bucket always exists).
absl::Status ValidateBucketBounds(const std::vector<double>& bounds);

// count bounds start, start + width, ...; width > 0, count >= 1.
std::vector<double> LinearBuckets(double start, double width, int count);
// count bounds start, start * factor, ...; start > 0, factor > 1, count >= 1.
std::vector<double> ExponentialBuckets(double start, double factor, int count);

class Histogram {
 public:
  struct Snapshot {
    // cumulative_counts[i] = observations <= bounds[i]; the last entry is the +Inf bucket.
    std::vector<uint64_t> cumulative_counts;
    double sum = 0.0;
    uint64_t count = 0;
  };

  // bounds: finite, strictly increasing upper bounds, owned by the family and outliving this.
  explicit Histogram(const std::vector<double>* bounds);
  Histogram(const Histogram&) = delete;
  Histogram& operator=(const Histogram&) = delete;

  // v lands in the first bucket whose bound is >= v (Prometheus "le"); NaN lands in +Inf.
  void Observe(double v) {
    const std::vector<double>& b = *bounds_;
    const size_t i = std::isnan(v) ? b.size() : std::lower_bound(b.begin(), b.end(), v) - b.begin();
    counts_[i].fetch_add(1, std::memory_order_relaxed);
    internal::AtomicAdd(&sum_, v);
  }

  Snapshot Collect() const;
  const std::vector<double>& bounds() const { return *bounds_; }

 private:
  const std::vector<double>* bounds_;
  // Non-cumulative: counts_[i] for bucket i, counts_[bounds.size()] for (last bound, +Inf).
  std::unique_ptr<std::atomic<uint64_t>[]> counts_;
  std::atomic<double> sum_{0.0};
};

}  // namespace dxs::metrics
