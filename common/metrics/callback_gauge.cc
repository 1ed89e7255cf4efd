#include "common/metrics/callback_gauge.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "common/metrics/families.h"
#include "prometheus/check_names.h"

namespace dxs::metrics {

CallbackRegistration::CallbackRegistration(CallbackRegistration&& other) noexcept
    : family_(std::exchange(other.family_, nullptr)), labels_(std::move(other.labels_)) {}

CallbackRegistration& CallbackRegistration::operator=(CallbackRegistration&& other) noexcept {
  if (this != &other) {
    Reset();
    family_ = std::exchange(other.family_, nullptr);
    labels_ = std::move(other.labels_);
  }
  return *this;
}

void CallbackRegistration::Reset() {
  if (family_ == nullptr) return;
  family_->Unbind(labels_);
  family_ = nullptr;
  labels_.clear();
}

absl::StatusOr<CallbackRegistration> CallbackGaugeFamily::Bind(prometheus::Labels labels,
                                                               std::function<double()> fn) {
  for (const auto& [label_name, value] : labels) {
    if (!prometheus::CheckLabelName(label_name)) {
      return absl::InvalidArgumentError(
          absl::StrCat(name_, ": invalid label name \"", label_name, "\""));
    }
  }
  if (!fn) return absl::InvalidArgumentError(absl::StrCat(name_, ": empty callback"));
  absl::MutexLock lock(&mu_);
  if (!callbacks_.emplace(labels, std::move(fn)).second) {
    return absl::AlreadyExistsError(
        absl::StrCat(name_, " already has a callback for these labels"));
  }
  return CallbackRegistration(this, std::move(labels));
}

void CallbackGaugeFamily::Unbind(const prometheus::Labels& labels) {
  absl::MutexLock lock(&mu_);
  callbacks_.erase(labels);
}

prometheus::MetricFamily CallbackGaugeFamily::Collect() const {
  prometheus::MetricFamily family;
  family.name = name_;
  family.help = help_;
  family.type = prometheus::MetricType::Gauge;
  absl::ReaderMutexLock lock(&mu_);
  family.metric.reserve(callbacks_.size());
  for (const auto& [labels, fn] : callbacks_) {
    prometheus::ClientMetric metric;
    for (const auto& [label_name, value] : labels) metric.label.push_back({label_name, value});
    metric.gauge.value = fn();
    family.metric.push_back(std::move(metric));
  }
  return family;
}

absl::StatusOr<CallbackGaugeFamily*> CallbackGauges::Add(std::string_view name,
                                                         std::string_view help) {
  const std::string n(name);
  if (absl::Status s = ValidateNameAndHelp(name, help); !s.ok()) return s;
  absl::MutexLock lock(&mu_);
  std::unique_ptr<CallbackGaugeFamily>& family = families_[n];
  if (family == nullptr) {
    family = std::make_unique<CallbackGaugeFamily>(n, std::string(help));
  } else if (family->help() != help) {
    return absl::AlreadyExistsError(
        absl::StrCat("metric ", n, " is already registered with different help text"));
  }
  return family.get();
}

std::vector<prometheus::MetricFamily> CallbackGauges::Collect() const {
  std::vector<prometheus::MetricFamily> out;
  absl::ReaderMutexLock lock(&mu_);
  for (const auto& [name, family] : families_) {
    prometheus::MetricFamily collected = family->Collect();
    if (!collected.metric.empty()) out.push_back(std::move(collected));
  }
  return out;
}

}  // namespace dxs::metrics
