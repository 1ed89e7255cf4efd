// The step series both worker roles expose under the same names, so that one query covers
// every rank of the cluster (docs/metrics.md):
//
//   dxs_steps_total{role="attention"|"expert", rank}
//   dxs_empty_batch_steps_total{role, rank}
//   dxs_low_latency_steps_total{role, rank}
//
// "Empty" is the centre: a DP rank with no tokens in its batch, or an EP rank that
// received no rows in any MoE layer of the step, still takes part in the step.
#pragma once

#include <string_view>

#include "absl/status/statusor.h"
#include "prometheus/counter.h"
#include "prometheus/registry.h"

namespace dxs::metrics {

struct StepMetrics {
  prometheus::Counter* steps = nullptr;
  prometheus::Counter* empty_steps = nullptr;
  prometheus::Counter* low_latency_steps = nullptr;
};

// Registers the families (or finds them) and returns this rank's children.
absl::StatusOr<StepMetrics> RegisterStepMetrics(prometheus::Registry* registry,
                                                std::string_view role, int rank);

}  // namespace dxs::metrics
