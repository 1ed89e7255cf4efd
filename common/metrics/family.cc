#include "common/metrics/family.h"

#include <cstdio>
#include <cstdlib>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace dxs::metrics {

std::string_view TypeName(MetricKind kind) {
  switch (kind) {
    case MetricKind::kCounter:
      return "counter";
    case MetricKind::kHistogram:
      return "histogram";
    case MetricKind::kGauge:
    case MetricKind::kCallbackGauge:
      break;
  }
  return "gauge";
}

FamilyBase::FamilyBase(MetricKind kind, std::string name, std::string help,
                       std::vector<std::string> label_names, std::vector<double> bucket_bounds)
    : kind_(kind),
      name_(std::move(name)),
      help_(std::move(help)),
      label_names_(std::move(label_names)),
      bucket_bounds_(std::move(bucket_bounds)) {}

std::vector<std::string> OccupiedNames(MetricKind kind, std::string_view name) {
  if (kind == MetricKind::kHistogram) {
    const std::string n(name);
    return {n, n + "_bucket", n + "_sum", n + "_count"};
  }
  return {std::string(name)};
}

absl::Status FamilyBase::CheckLabelValueCount(size_t num_values) const {
  if (num_values == label_names_.size()) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat(name_, " has ", label_names_.size(), " label names [",
                   absl::StrJoin(label_names_, ", "), "] but got ", num_values, " label values"));
}

void FamilyBase::DieOnLabelValues(const absl::Status& status) const {
  std::fprintf(stderr, "dxs metrics: %s\n", std::string(status.message()).c_str());
  std::abort();
}

namespace internal {

void AppendChild(std::string_view name, const std::string& labels, const Counter& counter,
                 std::string* out) {
  text::AppendSample(name, labels, "", "", counter.Value(), out);
}

void AppendChild(std::string_view name, const std::string& labels, const Gauge& gauge,
                 std::string* out) {
  text::AppendSample(name, labels, "", "", gauge.Value(), out);
}

void AppendChild(std::string_view name, const std::string& labels, const Histogram& histogram,
                 std::string* out) {
  const Histogram::Snapshot snapshot = histogram.Collect();
  const std::vector<double>& bounds = histogram.bounds();
  const std::string n(name);
  const std::string bucket = n + "_bucket";
  std::string le;
  for (size_t i = 0; i <= bounds.size(); ++i) {
    le.clear();
    if (i < bounds.size()) {
      text::AppendValue(bounds[i], &le);
    } else {
      le = "+Inf";
    }
    text::AppendSample(bucket, labels, "le", le, static_cast<double>(snapshot.cumulative_counts[i]),
                       out);
  }
  text::AppendSample(n + "_sum", labels, "", "", snapshot.sum, out);
  text::AppendSample(n + "_count", labels, "", "", static_cast<double>(snapshot.count), out);
}

}  // namespace internal

template class Family<Counter>;
template class Family<Gauge>;
template class Family<Histogram>;

}  // namespace dxs::metrics
