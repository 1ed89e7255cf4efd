#include "common/metrics/callback_gauge.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/metrics/text_format.h"

namespace dxs::metrics {

CallbackRegistration::CallbackRegistration(CallbackRegistration&& other) noexcept
    : family_(std::exchange(other.family_, nullptr)),
      label_values_(std::move(other.label_values_)) {}

CallbackRegistration& CallbackRegistration::operator=(CallbackRegistration&& other) noexcept {
  if (this != &other) {
    Reset();
    family_ = std::exchange(other.family_, nullptr);
    label_values_ = std::move(other.label_values_);
  }
  return *this;
}

void CallbackRegistration::Reset() {
  if (family_ == nullptr) return;
  family_->Unbind(label_values_);
  family_ = nullptr;
  label_values_.clear();
}

CallbackGaugeFamily::CallbackGaugeFamily(std::string name, std::string help,
                                         std::vector<std::string> label_names)
    : FamilyBase(MetricKind::kCallbackGauge, std::move(name), std::move(help),
                 std::move(label_names), {}) {}

absl::StatusOr<CallbackRegistration> CallbackGaugeFamily::Bind(
    std::initializer_list<std::string_view> label_values, std::function<double()> fn) {
  return Bind(std::vector<std::string>(label_values.begin(), label_values.end()), std::move(fn));
}

absl::StatusOr<CallbackRegistration> CallbackGaugeFamily::Bind(
    std::vector<std::string> label_values, std::function<double()> fn) {
  if (absl::Status s = CheckLabelValueCount(label_values.size()); !s.ok()) return s;
  if (!fn) return absl::InvalidArgumentError(absl::StrCat(name(), ": empty callback"));
  absl::MutexLock lock(&mu_);
  if (!callbacks_.emplace(label_values, std::move(fn)).second) {
    return absl::AlreadyExistsError(absl::StrCat(name(), " already has a callback for {",
                                                 absl::StrJoin(label_values, ", "), "}"));
  }
  return CallbackRegistration(this, std::move(label_values));
}

void CallbackGaugeFamily::Unbind(const std::vector<std::string>& label_values) {
  absl::MutexLock lock(&mu_);
  callbacks_.erase(label_values);
}

void CallbackGaugeFamily::AppendText(std::string* out) const {
  absl::ReaderMutexLock lock(&mu_);
  if (callbacks_.empty()) return;
  text::AppendHeader(name(), help(), TypeName(kind()), out);
  for (const auto& [label_values, fn] : callbacks_) {
    text::AppendSample(name(), text::FormatLabels(label_names(), label_values), "", "", fn(), out);
  }
}

}  // namespace dxs::metrics
