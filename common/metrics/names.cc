#include "common/metrics/names.h"

#include <set>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/metrics/absl_compat.h"

namespace dxs::metrics {
namespace {

bool IsAsciiLetter(char c) { return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z'); }
bool IsDigit(char c) { return c >= '0' && c <= '9'; }

}  // namespace

absl::Status ValidateMetricName(std::string_view name) {
  bool ok = !name.empty();
  for (size_t i = 0; ok && i < name.size(); ++i) {
    const char c = name[i];
    ok = IsAsciiLetter(c) || c == '_' || c == ':' || (i > 0 && IsDigit(c));
  }
  if (!ok) {
    return absl::InvalidArgumentError(absl::StrCat("metric name \"", internal::AsAbsl(name),
                                                   "\" does not match [a-zA-Z_:][a-zA-Z0-9_:]*"));
  }
  return absl::OkStatus();
}

absl::Status ValidateLabelName(std::string_view name) {
  bool ok = !name.empty();
  for (size_t i = 0; ok && i < name.size(); ++i) {
    const char c = name[i];
    ok = IsAsciiLetter(c) || c == '_' || (i > 0 && IsDigit(c));
  }
  if (!ok) {
    return absl::InvalidArgumentError(absl::StrCat("label name \"", internal::AsAbsl(name),
                                                   "\" does not match [a-zA-Z_][a-zA-Z0-9_]*"));
  }
  if (name == "le") {
    return absl::InvalidArgumentError("label name \"le\" is reserved for histogram buckets");
  }
  if (name.substr(0, 2) == "__") {
    return absl::InvalidArgumentError(absl::StrCat("label name \"", internal::AsAbsl(name),
                                                   "\" is reserved: names starting with \"__\" are "
                                                   "Prometheus-internal"));
  }
  return absl::OkStatus();
}

absl::Status ValidateLabelNames(const std::vector<std::string>& names) {
  std::set<std::string_view> seen;
  for (const std::string& name : names) {
    if (absl::Status s = ValidateLabelName(name); !s.ok()) return s;
    if (!seen.insert(name).second) {
      return absl::InvalidArgumentError(
          absl::StrCat("label name \"", name, "\" repeated in [", absl::StrJoin(names, ", "), "]"));
    }
  }
  return absl::OkStatus();
}

}  // namespace dxs::metrics
