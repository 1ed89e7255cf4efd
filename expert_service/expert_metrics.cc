#include "expert_service/expert_metrics.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "common/metrics/step_metrics.h"
#include "common/status_macros.h"

namespace dxs {

namespace m = metrics;

absl::StatusOr<std::unique_ptr<ExpertMetrics>> ExpertMetrics::Create(
    prometheus::Registry* registry, int rank, const std::vector<int>& experts, int num_experts) {
  std::unique_ptr<ExpertMetrics> em(new ExpertMetrics());
  em->rank_ = std::to_string(rank);
  const std::string& r = em->rank_;
  DXS_ASSIGN_OR_RETURN(const m::StepMetrics steps,
                       m::RegisterStepMetrics(registry, "expert", rank));
  em->steps_ = steps.steps;
  em->empty_steps_ = steps.empty_steps;
  em->low_latency_steps_ = steps.low_latency_steps;
  DXS_ASSIGN_OR_RETURN(em->exchange_bytes_, m::ExchangeBytes::Register(registry, "expert", rank));
  DXS_ASSIGN_OR_RETURN(
      m::CounterFamily * rounds,
      m::AddCounter(registry, "dxs_layer_rounds_total",
                    "MoE layer rounds this EP rank served (one per MoE layer and step)."));
  em->rounds_ = &rounds->Add({{"rank", r}});
  DXS_ASSIGN_OR_RETURN(
      m::CounterFamily * empty_rounds,
      m::AddCounter(registry, "dxs_empty_layer_rounds_total",
                    "MoE layer rounds in which this EP rank received no token rows from "
                    "any DP rank."));
  em->empty_rounds_ = &empty_rounds->Add({{"rank", r}});
  DXS_ASSIGN_OR_RETURN(
      m::CounterFamily * received,
      m::AddCounter(registry, "dxs_tokens_received_total",
                    "Token rows this EP rank received from all DP ranks, summed over MoE "
                    "layers."));
  em->tokens_received_ = &received->Add({{"rank", r}});
  DXS_ASSIGN_OR_RETURN(
      m::HistogramFamily * compute,
      m::AddHistogram(registry, "dxs_expert_compute_seconds",
                      "Time this EP rank's experts took for one MoE layer round."));
  em->compute_ = &compute->Add({{"rank", r}}, m::ExponentialBuckets(1e-5, 2, 20));
  DXS_ASSIGN_OR_RETURN(em->expert_tokens_family_,
                       m::AddCounter(registry, "dxs_expert_tokens_total",
                                     "Token rows computed by one expert, summed over MoE "
                                     "layers (a row routed to two of this rank's experts "
                                     "counts for each)."));
  em->expert_tokens_.assign(static_cast<size_t>(std::max(num_experts, 0)), nullptr);
  em->synced_.assign(em->expert_tokens_.size(), 0);
  for (int e : experts) {
    if (e < 0 || e >= num_experts) {
      return absl::InvalidArgumentError(
          absl::StrCat("expert ", e, " is outside [0, ", num_experts, ")"));
    }
    em->expert_tokens_[e] =
        &em->expert_tokens_family_->Add({{"rank", r}, {"expert", std::to_string(e)}});
  }
  return em;
}

void ExpertMetrics::OnRound(int64_t num_rows, double compute_seconds) {
  rounds_->Increment();
  if (num_rows == 0) empty_rounds_->Increment();
  tokens_received_->Increment(num_rows);
  compute_->Observe(compute_seconds);
}

void ExpertMetrics::SyncExpertTokens(const std::vector<int64_t>& cumulative) {
  const size_t n = std::min(cumulative.size(), synced_.size());
  for (size_t e = 0; e < n; ++e) {
    // A count that went down was started again (the experts were rebuilt): all of it is new.
    const int64_t grown = cumulative[e] >= synced_[e] ? cumulative[e] - synced_[e] : cumulative[e];
    synced_[e] = cumulative[e];
    if (grown == 0) continue;
    if (expert_tokens_[e] == nullptr) {  // not in the initial set: placement changed
      expert_tokens_[e] =
          &expert_tokens_family_->Add({{"rank", rank_}, {"expert", std::to_string(e)}});
    }
    expert_tokens_[e]->Increment(static_cast<double>(grown));
  }
}

void ExpertMetrics::OnLowLatencyStep(int rounds, bool empty) {
  low_latency_steps_->Increment();
  rounds_->Increment(rounds);
  if (empty) empty_rounds_->Increment(rounds);
}

void ExpertMetrics::OnStep(bool empty) {
  steps_->Increment();
  if (empty) empty_steps_->Increment();
}

}  // namespace dxs
