#include "common/metrics/histogram.h"

#include <cmath>

#include "absl/strings/str_cat.h"

namespace dxs::metrics {

absl::Status ValidateBucketBounds(const std::vector<double>& bounds) {
  for (size_t i = 0; i < bounds.size(); ++i) {
    if (std::isnan(bounds[i])) {
      return absl::InvalidArgumentError(absl::StrCat("histogram bucket bound ", i, " is NaN"));
    }
    if (std::isinf(bounds[i]) && (bounds[i] < 0 || i + 1 != bounds.size())) {
      return absl::InvalidArgumentError(absl::StrCat(
          "histogram bucket bound ", i, " is infinite; only a trailing +Inf is allowed"));
    }
    if (i > 0 && !(bounds[i - 1] < bounds[i])) {
      return absl::InvalidArgumentError(
          absl::StrCat("histogram bucket bounds must be strictly increasing: bound ", i - 1, " is ",
                       bounds[i - 1], ", bound ", i, " is ", bounds[i]));
    }
  }
  return absl::OkStatus();
}

std::vector<double> LinearBuckets(double start, double width, int count) {
  std::vector<double> bounds;
  for (int i = 0; i < count; ++i) bounds.push_back(start + i * width);
  return bounds;
}

std::vector<double> ExponentialBuckets(double start, double factor, int count) {
  std::vector<double> bounds;
  double bound = start;
  for (int i = 0; i < count; ++i, bound *= factor) bounds.push_back(bound);
  return bounds;
}

Histogram::Histogram(const std::vector<double>* bounds)
    : bounds_(bounds), counts_(new std::atomic<uint64_t>[bounds->size() + 1]) {
  for (size_t i = 0; i <= bounds->size(); ++i) counts_[i].store(0, std::memory_order_relaxed);
}

Histogram::Snapshot Histogram::Collect() const {
  Snapshot snapshot;
  snapshot.cumulative_counts.resize(bounds_->size() + 1);
  uint64_t running = 0;
  for (size_t i = 0; i <= bounds_->size(); ++i) {
    running += counts_[i].load(std::memory_order_relaxed);
    snapshot.cumulative_counts[i] = running;
  }
  snapshot.count = running;
  snapshot.sum = sum_.load(std::memory_order_relaxed);
  return snapshot;
}

}  // namespace dxs::metrics
