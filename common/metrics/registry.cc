#include "common/metrics/registry.h"

#include <cmath>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/metrics/absl_compat.h"
#include "common/metrics/names.h"

namespace dxs::metrics {
namespace {

absl::Status CheckSameAs(const FamilyBase& existing, MetricKind kind, std::string_view help,
                         const std::vector<std::string>& label_names,
                         const std::vector<double>& bucket_bounds) {
  std::string what;
  if (existing.kind() != kind) {
    what = "a different type";
  } else if (existing.label_names() != label_names) {
    what = absl::StrCat("label names [", absl::StrJoin(existing.label_names(), ", "), "]");
  } else if (existing.help() != help) {
    what = "different help text";
  } else if (existing.bucket_bounds() != bucket_bounds) {
    what = "different bucket bounds";
  } else {
    return absl::OkStatus();
  }
  return absl::AlreadyExistsError(
      absl::StrCat("metric ", existing.name(), " is already registered with ", what));
}

}  // namespace

template <typename F, typename Make>
absl::StatusOr<F*> Registry::Add(MetricKind kind, std::string_view name_view, std::string_view help,
                                 const std::vector<std::string>& label_names,
                                 const std::vector<double>& bucket_bounds, Make make) {
  const std::string name(name_view);
  if (absl::Status s = ValidateMetricName(name); !s.ok()) return s;
  if (kind == MetricKind::kCounter && !absl::EndsWith(name, "_total")) {
    return absl::InvalidArgumentError(
        absl::StrCat("counter name \"", name, "\" must end in _total"));
  }
  if (help.empty()) {
    return absl::InvalidArgumentError(absl::StrCat("metric ", name, " has no help text"));
  }
  if (absl::Status s = ValidateLabelNames(label_names); !s.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("metric ", name, ": ", s.message()));
  }

  absl::MutexLock lock(&mu_);
  if (auto it = families_.find(name); it != families_.end()) {
    if (absl::Status s = CheckSameAs(*it->second, kind, help, label_names, bucket_bounds);
        !s.ok()) {
      return s;
    }
    return static_cast<F*>(it->second.get());
  }
  const std::vector<std::string> mine = OccupiedNames(kind, name);
  for (const auto& [other_name, other] : families_) {
    const std::vector<std::string> theirs = OccupiedNames(other->kind(), other_name);
    for (const std::string& a : mine) {
      for (const std::string& b : theirs) {
        if (a == b) {
          return absl::AlreadyExistsError(absl::StrCat("metric ", name, " would use the name ", a,
                                                       ", which metric ", other_name,
                                                       " already uses"));
        }
      }
    }
  }
  std::unique_ptr<F> family = make();
  F* raw = family.get();
  families_.emplace(name, std::move(family));
  return raw;
}

absl::StatusOr<CounterFamily*> Registry::AddCounter(std::string_view name, std::string_view help,
                                                    std::vector<std::string> label_names) {
  return Add<CounterFamily>(MetricKind::kCounter, name, help, label_names, {}, [&] {
    return std::make_unique<CounterFamily>(std::string(name), std::string(help), label_names);
  });
}

absl::StatusOr<GaugeFamily*> Registry::AddGauge(std::string_view name, std::string_view help,
                                                std::vector<std::string> label_names) {
  return Add<GaugeFamily>(MetricKind::kGauge, name, help, label_names, {}, [&] {
    return std::make_unique<GaugeFamily>(std::string(name), std::string(help), label_names);
  });
}

absl::StatusOr<HistogramFamily*> Registry::AddHistogram(std::string_view name,
                                                        std::string_view help,
                                                        std::vector<std::string> label_names,
                                                        std::vector<double> bucket_bounds) {
  if (absl::Status s = ValidateBucketBounds(bucket_bounds); !s.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("metric ", internal::AsAbsl(name), ": ", s.message()));
  }
  if (!bucket_bounds.empty() && std::isinf(bucket_bounds.back())) bucket_bounds.pop_back();
  return Add<HistogramFamily>(MetricKind::kHistogram, name, help, label_names, bucket_bounds, [&] {
    return std::make_unique<HistogramFamily>(std::string(name), std::string(help), label_names,
                                             bucket_bounds);
  });
}

absl::StatusOr<CallbackGaugeFamily*> Registry::AddCallbackGauge(
    std::string_view name, std::string_view help, std::vector<std::string> label_names) {
  return Add<CallbackGaugeFamily>(MetricKind::kCallbackGauge, name, help, label_names, {}, [&] {
    return std::make_unique<CallbackGaugeFamily>(std::string(name), std::string(help), label_names);
  });
}

std::string Registry::Scrape() const {
  std::string out;
  absl::ReaderMutexLock lock(&mu_);
  for (const auto& [name, family] : families_) family->AppendText(&out);
  return out;
}

}  // namespace dxs::metrics
