#include "common/metrics/step_metrics.h"

#include <string>

#include "common/metrics/families.h"
#include "common/status_macros.h"

namespace dxs::metrics {

absl::StatusOr<StepMetrics> RegisterStepMetrics(prometheus::Registry* registry,
                                                std::string_view role, int rank) {
  DXS_ASSIGN_OR_RETURN(CounterFamily * steps,
                       AddCounter(registry, "dxs_steps_total",
                                  "Model steps this rank took part in, empty ones included."));
  DXS_ASSIGN_OR_RETURN(
      CounterFamily * empty,
      AddCounter(registry, "dxs_empty_batch_steps_total",
                 "Steps in which this rank had nothing to compute (attention: no tokens in its "
                 "batch; expert: no rows received in any MoE layer of the step)."));
  DXS_ASSIGN_OR_RETURN(
      CounterFamily * low_latency,
      AddCounter(registry, "dxs_low_latency_steps_total",
                 "Steps whose MoE went over the low-latency exchange (dxs-attention "
                 "--low-latency-capacity on GPUs): one graph replay a step, no host "
                 "synchronisation between layers; counted in dxs_steps_total too."));
  const prometheus::Labels labels = {{"role", std::string(role)}, {"rank", std::to_string(rank)}};
  StepMetrics out;
  out.steps = &steps->Add(labels);
  out.empty_steps = &empty->Add(labels);
  out.low_latency_steps = &low_latency->Add(labels);
  return out;
}

}  // namespace dxs::metrics
