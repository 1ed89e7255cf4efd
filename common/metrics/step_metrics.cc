#include "common/metrics/step_metrics.h"

#include <string>

namespace dxs::metrics {

absl::StatusOr<StepMetrics> RegisterStepMetrics(Registry* registry, std::string_view role,
                                                int rank) {
  absl::StatusOr<CounterFamily*> steps = registry->AddCounter(
      "dxs_steps_total", "Model steps this rank took part in, empty ones included.",
      {"role", "rank"});
  if (!steps.ok()) return steps.status();
  absl::StatusOr<CounterFamily*> empty = registry->AddCounter(
      "dxs_empty_batch_steps_total",
      "Steps in which this rank had nothing to compute (attention: no tokens in its batch; "
      "expert: no rows received in any MoE layer of the step).",
      {"role", "rank"});
  if (!empty.ok()) return empty.status();
  const std::string r = std::to_string(rank);
  StepMetrics out;
  out.steps = &(*steps)->WithLabels({role, r});
  out.empty_steps = &(*empty)->WithLabels({role, r});
  return out;
}

}  // namespace dxs::metrics
