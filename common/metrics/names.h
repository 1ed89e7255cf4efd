// Name rules of the Prometheus data model, checked once when a family is registered so that
// a scrape can never produce text that Prometheus rejects.
//
//   metric names  [a-zA-Z_:][a-zA-Z0-9_:]*
//   label names   [a-zA-Z_][a-zA-Z0-9_]*, not "le" (histogram buckets use it) and not
//                 starting with "__" (reserved for Prometheus itself)
#pragma once

#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"

namespace dxs::metrics {

// InvalidArgument naming the offending name and the rule it breaks.
absl::Status ValidateMetricName(std::string_view name);
absl::Status ValidateLabelName(std::string_view name);

// Each name valid and none repeated.
absl::Status ValidateLabelNames(const std::vector<std::string>& names);

}  // namespace dxs::metrics
