// A metric family: one name, help text, type and fixed label names, with one child metric
// per distinct tuple of label values, e.g. dxs_tokens_dispatched_total{role,rank} with a
// Counter for {"ep","0"}, another for {"ep","1"}, ...
//
// Families are created by Registry (registry.h), which validates names once, and live as
// long as it. Children are never removed, so a reference from WithLabels stays valid for the
// registry's lifetime: look it up once, keep it, and update it without any lock.
//
// Thread safety: all methods may be called from any thread. WithLabels takes the family's
// lock (shared on a hit, exclusive to create a child); updates to a child are atomics.
#pragma once

#include <initializer_list>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "common/metrics/counter.h"
#include "common/metrics/gauge.h"
#include "common/metrics/histogram.h"
#include "common/metrics/text_format.h"

namespace dxs::metrics {

// kCallbackGauge is exposed as a gauge; it is a separate kind so that registering the same
// name once as a settable gauge and once with callbacks is caught as a conflict.
enum class MetricKind { kCounter, kGauge, kHistogram, kCallbackGauge };

// The # TYPE word: "counter", "gauge" or "histogram".
std::string_view TypeName(MetricKind kind);

// The names a family of this kind occupies in the exposition: its own and those of its
// sample lines (name_bucket, name_sum and name_count for a histogram). No two families of a
// registry may share one.
std::vector<std::string> OccupiedNames(MetricKind kind, std::string_view name);

class FamilyBase {
 public:
  virtual ~FamilyBase() = default;
  FamilyBase(const FamilyBase&) = delete;
  FamilyBase& operator=(const FamilyBase&) = delete;

  const std::string& name() const { return name_; }
  const std::string& help() const { return help_; }
  MetricKind kind() const { return kind_; }
  const std::vector<std::string>& label_names() const { return label_names_; }
  // Finite upper bounds; empty except for histograms.
  const std::vector<double>& bucket_bounds() const { return bucket_bounds_; }

  // Appends # HELP, # TYPE and the samples of every child, ordered by label values; nothing
  // when the family has no children yet.
  virtual void AppendText(std::string* out) const = 0;

 protected:
  FamilyBase(MetricKind kind, std::string name, std::string help,
             std::vector<std::string> label_names, std::vector<double> bucket_bounds);

  // InvalidArgument unless there is one value per label name.
  absl::Status CheckLabelValueCount(size_t num_values) const;
  [[noreturn]] void DieOnLabelValues(const absl::Status& status) const;

 private:
  const MetricKind kind_;
  const std::string name_;
  const std::string help_;
  const std::vector<std::string> label_names_;
  const std::vector<double> bucket_bounds_;
};

namespace internal {

template <typename T>
constexpr MetricKind KindOf() {
  if constexpr (std::is_same_v<T, Counter>) return MetricKind::kCounter;
  if constexpr (std::is_same_v<T, Gauge>) return MetricKind::kGauge;
  if constexpr (std::is_same_v<T, Histogram>) return MetricKind::kHistogram;
}

// The sample lines of one child; labels as made by text::FormatLabels.
void AppendChild(std::string_view name, const std::string& labels, const Counter& counter,
                 std::string* out);
void AppendChild(std::string_view name, const std::string& labels, const Gauge& gauge,
                 std::string* out);
void AppendChild(std::string_view name, const std::string& labels, const Histogram& histogram,
                 std::string* out);

}  // namespace internal

// T is Counter, Gauge or Histogram.
template <typename T>
class Family final : public FamilyBase {
 public:
  // Registry::Add* makes families after validating their arguments.
  Family(std::string name, std::string help, std::vector<std::string> label_names,
         std::vector<double> bucket_bounds = {})
      : FamilyBase(internal::KindOf<T>(), std::move(name), std::move(help), std::move(label_names),
                   std::move(bucket_bounds)) {
    // An unlabelled metric is exposed from the start, at zero.
    if (this->label_names().empty()) WithLabels(std::vector<std::string>{});
  }

  // The child for these label values, one per label name in registration order, created at
  // zero on first use. Aborts with a message when the count is wrong: that is a bug at the
  // call site, not a runtime condition. TryWithLabels reports it instead.
  T& WithLabels(std::initializer_list<std::string_view> label_values) {
    return WithLabels(std::vector<std::string>(label_values.begin(), label_values.end()));
  }
  T& WithLabels(const std::vector<std::string>& label_values) {
    absl::StatusOr<T*> child = TryWithLabels(label_values);
    if (!child.ok()) DieOnLabelValues(child.status());
    return **child;
  }
  absl::StatusOr<T*> TryWithLabels(const std::vector<std::string>& label_values) {
    if (absl::Status s = CheckLabelValueCount(label_values.size()); !s.ok()) return s;
    {
      absl::ReaderMutexLock lock(&mu_);
      auto it = children_.find(label_values);
      if (it != children_.end()) return it->second.get();
    }
    absl::MutexLock lock(&mu_);
    std::unique_ptr<T>& child = children_[label_values];
    if (child == nullptr) child = MakeChild();
    return child.get();
  }

  void AppendText(std::string* out) const override {
    absl::ReaderMutexLock lock(&mu_);
    if (children_.empty()) return;
    text::AppendHeader(name(), help(), TypeName(kind()), out);
    for (const auto& [label_values, child] : children_) {
      internal::AppendChild(name(), text::FormatLabels(label_names(), label_values), *child, out);
    }
  }

 private:
  std::unique_ptr<T> MakeChild() const {
    if constexpr (std::is_same_v<T, Histogram>) {
      return std::make_unique<Histogram>(&bucket_bounds());
    } else {
      return std::make_unique<T>();
    }
  }

  mutable absl::Mutex mu_;
  std::map<std::vector<std::string>, std::unique_ptr<T>> children_ ABSL_GUARDED_BY(mu_);
};

extern template class Family<Counter>;
extern template class Family<Gauge>;
extern template class Family<Histogram>;

using CounterFamily = Family<Counter>;
using GaugeFamily = Family<Gauge>;
using HistogramFamily = Family<Histogram>;

}  // namespace dxs::metrics
