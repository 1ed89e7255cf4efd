#include "common/metrics/families.h"

#include <stdexcept>
#include <string>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "prometheus/check_names.h"
#include "prometheus/detail/builder.h"

namespace dxs::metrics {
namespace {

// The library reports every registration problem as std::invalid_argument; its name check
// comes first, so a name that passes CheckMetricName and still throws is taken.
template <typename T>
absl::StatusOr<prometheus::Family<T>*> Add(prometheus::Registry* registry, std::string_view name,
                                           std::string_view help) {
  const std::string n(name);
  if (absl::Status s = ValidateNameAndHelp(name, help); !s.ok()) return s;
  try {
    return &prometheus::detail::Builder<T>().Name(n).Help(std::string(help)).Register(*registry);
  } catch (const std::invalid_argument& e) {
    return absl::AlreadyExistsError(absl::StrCat("metric ", n, ": ", e.what()));
  }
}

}  // namespace

absl::Status ValidateNameAndHelp(std::string_view name, std::string_view help) {
  if (!prometheus::CheckMetricName(std::string(name))) {
    return absl::InvalidArgumentError(absl::StrCat("metric name \"", std::string(name),
                                                   "\" does not match [a-zA-Z_:][a-zA-Z0-9_:]*"));
  }
  if (help.empty()) {
    return absl::InvalidArgumentError(absl::StrCat("metric ", std::string(name), " has no help"));
  }
  if (help.find_first_of("\n\\") != std::string_view::npos) {
    return absl::InvalidArgumentError(absl::StrCat(
        "metric ", std::string(name), ": help must not hold a newline or a backslash"));
  }
  return absl::OkStatus();
}

absl::StatusOr<CounterFamily*> AddCounter(prometheus::Registry* registry, std::string_view name,
                                          std::string_view help) {
  if (!absl::EndsWith(absl::string_view(name.data(), name.size()), "_total")) {
    return absl::InvalidArgumentError(
        absl::StrCat("counter name \"", std::string(name), "\" must end in _total"));
  }
  return Add<prometheus::Counter>(registry, name, help);
}

absl::StatusOr<GaugeFamily*> AddGauge(prometheus::Registry* registry, std::string_view name,
                                      std::string_view help) {
  return Add<prometheus::Gauge>(registry, name, help);
}

absl::StatusOr<HistogramFamily*> AddHistogram(prometheus::Registry* registry, std::string_view name,
                                              std::string_view help) {
  return Add<prometheus::Histogram>(registry, name, help);
}

prometheus::Histogram::BucketBoundaries LinearBuckets(double start, double width, int count) {
  prometheus::Histogram::BucketBoundaries bounds;
  for (int i = 0; i < count; ++i) bounds.push_back(start + i * width);
  return bounds;
}

prometheus::Histogram::BucketBoundaries ExponentialBuckets(double start, double factor, int count) {
  prometheus::Histogram::BucketBoundaries bounds;
  double bound = start;
  for (int i = 0; i < count; ++i, bound *= factor) bounds.push_back(bound);
  return bounds;
}

}  // namespace dxs::metrics
