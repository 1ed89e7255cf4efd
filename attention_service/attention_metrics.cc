#include "attention_service/attention_metrics.h"

#include "common/metrics/step_metrics.h"
#include "common/status_macros.h"

namespace dxs {

namespace m = metrics;

absl::StatusOr<std::unique_ptr<AttentionMetrics>> AttentionMetrics::Create(m::Registry* registry,
                                                                           int rank,
                                                                           Scheduler* scheduler,
                                                                           const KvCache* kv) {
  std::unique_ptr<AttentionMetrics> am(new AttentionMetrics());
  am->rank_ = std::to_string(rank);
  const std::string& r = am->rank_;

  DXS_ASSIGN_OR_RETURN(const m::StepMetrics steps,
                       m::RegisterStepMetrics(registry, "attention", rank));
  am->steps_ = steps.steps;
  am->empty_steps_ = steps.empty_steps;
  DXS_ASSIGN_OR_RETURN(
      m::CounterFamily * failed,
      registry->AddCounter("dxs_failed_steps_total",
                           "Steps that failed (a peer timed out or was lost); their requests "
                           "ended with UNAVAILABLE.",
                           {"role", "rank"}));
  am->failed_steps_ = &failed->WithLabels({"attention", r});
  DXS_ASSIGN_OR_RETURN(
      m::CounterFamily * overlapped,
      registry->AddCounter("dxs_overlapped_steps_total",
                           "Steps split into two micro-batches for two-batch overlap (the "
                           "attention of one runs while the experts compute the other); every "
                           "DP rank splits the same steps.",
                           {"rank"}));
  am->overlapped_steps_ = &overlapped->WithLabels({r});
  DXS_ASSIGN_OR_RETURN(
      m::HistogramFamily * step_duration,
      registry->AddHistogram("dxs_step_duration_seconds",
                             "Duration of one model step on this rank, from building the batch "
                             "to sampling, including the step exchange with the other DP ranks.",
                             {"role", "rank"}, m::ExponentialBuckets(1e-4, 2, 18)));
  am->step_duration_ = &step_duration->WithLabels({"attention", r});

  DXS_ASSIGN_OR_RETURN(am->dispatched_family_,
                       registry->AddCounter("dxs_tokens_dispatched_total",
                                            "Tokens this DP rank sent to an EP rank (a token "
                                            "counts once per MoE layer and EP rank it visits).",
                                            {"rank", "ep_rank"}));
  DXS_ASSIGN_OR_RETURN(am->combined_family_,
                       registry->AddCounter("dxs_tokens_combined_total",
                                            "Token rows this DP rank received back from an EP "
                                            "rank and summed into its MoE output.",
                                            {"rank", "ep_rank"}));
  DXS_ASSIGN_OR_RETURN(
      m::HistogramFamily * dispatch,
      registry->AddHistogram("dxs_dispatch_latency_seconds",
                             "Dispatch phase of one MoE layer: layout, packing and one send to "
                             "every EP rank.",
                             {"rank"}, m::ExponentialBuckets(1e-5, 2, 20)));
  am->dispatch_latency_ = &dispatch->WithLabels({r});
  DXS_ASSIGN_OR_RETURN(
      m::HistogramFamily * combine,
      registry->AddHistogram("dxs_combine_latency_seconds",
                             "Combine phase of one MoE layer: from the last dispatch send until "
                             "every EP rank's rows are received and summed (includes the "
                             "experts' compute).",
                             {"rank"}, m::ExponentialBuckets(1e-5, 2, 20)));
  am->combine_latency_ = &combine->WithLabels({r});

  DXS_ASSIGN_OR_RETURN(
      m::CallbackGaugeFamily * queue,
      registry->AddCallbackGauge("dxs_queue_length",
                                 "Requests accepted by this rank and waiting for admission to "
                                 "the running batch.",
                                 {"rank"}));
  DXS_ASSIGN_OR_RETURN(am->queue_length_, queue->Bind({r}, [scheduler] {
    return static_cast<double>(scheduler->num_queued());
  }));
  DXS_ASSIGN_OR_RETURN(
      m::CallbackGaugeFamily * running,
      registry->AddCallbackGauge("dxs_running_requests", "Requests in this rank's running batch.",
                                 {"rank"}));
  DXS_ASSIGN_OR_RETURN(am->running_requests_, running->Bind({r}, [scheduler] {
    return static_cast<double>(scheduler->num_running());
  }));
  DXS_ASSIGN_OR_RETURN(
      m::CallbackGaugeFamily * kv_used,
      registry->AddCallbackGauge("dxs_kv_cache_used_tokens",
                                 "KV cache positions reserved by live requests (each reserves "
                                 "prompt + max_new_tokens at admission).",
                                 {"rank"}));
  DXS_ASSIGN_OR_RETURN(am->kv_used_, kv_used->Bind({r}, [kv] {
    return static_cast<double>(kv->reserved_tokens());
  }));
  DXS_ASSIGN_OR_RETURN(
      m::CallbackGaugeFamily * kv_capacity,
      registry->AddCallbackGauge("dxs_kv_cache_capacity_tokens",
                                 "KV cache positions this rank can hold.", {"rank"}));
  DXS_ASSIGN_OR_RETURN(am->kv_capacity_, kv_capacity->Bind({r}, [kv] {
    return static_cast<double>(kv->capacity_tokens());
  }));
  return am;
}

void AttentionMetrics::OnStep(int64_t num_tokens, bool failed, int num_micro_batches,
                              double seconds) {
  steps_->Increment();
  if (num_tokens == 0) empty_steps_->Increment();
  if (failed) failed_steps_->Increment();
  if (num_micro_batches > 1) overlapped_steps_->Increment();
  step_duration_->Observe(seconds);
}

void AttentionMetrics::GrowEpRanks(size_t num_ep_ranks) {
  while (dispatched_.size() < num_ep_ranks) {
    const std::string ep_rank = std::to_string(dispatched_.size());
    dispatched_.push_back(&dispatched_family_->WithLabels({rank_, ep_rank}));
    combined_.push_back(&combined_family_->WithLabels({rank_, ep_rank}));
  }
}

void AttentionMetrics::OnDispatch(const std::vector<int64_t>& num_tokens_per_rank, double seconds) {
  GrowEpRanks(num_tokens_per_rank.size());
  for (size_t r = 0; r < num_tokens_per_rank.size(); ++r) {
    dispatched_[r]->Increment(num_tokens_per_rank[r]);
  }
  dispatch_latency_->Observe(seconds);
}

void AttentionMetrics::OnCombine(const std::vector<int64_t>& num_tokens_per_rank, double seconds) {
  GrowEpRanks(num_tokens_per_rank.size());
  for (size_t r = 0; r < num_tokens_per_rank.size(); ++r) {
    combined_[r]->Increment(num_tokens_per_rank[r]);
  }
  combine_latency_->Observe(seconds);
}

}  // namespace dxs
