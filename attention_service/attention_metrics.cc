#include "attention_service/attention_metrics.h"

#include <algorithm>

#include "common/metrics/step_metrics.h"
#include "common/status_macros.h"
#include "dataplane/dispatch/dispatch_balance.h"

namespace dxs {

namespace m = metrics;

absl::StatusOr<std::unique_ptr<AttentionMetrics>> AttentionMetrics::Create(
    prometheus::Registry* registry, m::CallbackGauges* gauges, int rank, Scheduler* scheduler,
    const KvCache* kv) {
  std::unique_ptr<AttentionMetrics> am(new AttentionMetrics());
  am->rank_ = std::to_string(rank);
  const std::string& r = am->rank_;

  DXS_ASSIGN_OR_RETURN(const m::StepMetrics steps,
                       m::RegisterStepMetrics(registry, "attention", rank));
  am->steps_ = steps.steps;
  am->empty_steps_ = steps.empty_steps;
  am->low_latency_steps_ = steps.low_latency_steps;
  DXS_ASSIGN_OR_RETURN(
      m::CounterFamily * failed,
      m::AddCounter(registry, "dxs_failed_steps_total",
                    "Steps that failed (a peer timed out or was lost). With elastic EP "
                    "such a step is run again once a placement without the lost rank "
                    "arrives (each attempt counts); else its requests end with "
                    "UNAVAILABLE."));
  am->failed_steps_ = &failed->Add({{"role", "attention"}, {"rank", r}});
  DXS_ASSIGN_OR_RETURN(
      m::CounterFamily * overlapped,
      m::AddCounter(registry, "dxs_overlapped_steps_total",
                    "Steps split into two micro-batches for two-batch overlap (the "
                    "attention of one runs while the experts compute the other); every "
                    "DP rank splits the same steps."));
  am->overlapped_steps_ = &overlapped->Add({{"rank", r}});
  DXS_ASSIGN_OR_RETURN(
      m::CounterFamily * piecewise,
      m::AddCounter(registry, "dxs_piecewise_decode_steps_total",
                    "Decode steps of one micro-batch run in graph segments (dxs-attention "
                    "--piecewise-graphs on a GPU: the work between two exchanges replayed "
                    "as recorded CUDA graphs)."));
  am->piecewise_steps_ = &piecewise->Add({{"rank", r}});
  DXS_ASSIGN_OR_RETURN(
      m::CounterFamily * ahead,
      m::AddCounter(registry, "dxs_steps_built_ahead_total",
                    "Decode steps built and queued before the tokens of the step before "
                    "them were read (overlap scheduling, dxs-attention --overlap-schedule): "
                    "the host streams one step's tokens while the device runs the next."));
  am->steps_ahead_ = &ahead->Add({{"rank", r}});
  DXS_ASSIGN_OR_RETURN(
      m::CounterFamily * in_place,
      m::AddCounter(registry, "dxs_moe_in_place_total",
                    "MoE layers (micro-batches) whose input the EP ranks that take every token "
                    "read where the model wrote it, nothing packed (buffer=input), and whose "
                    "output the one EP rank holding every token stored into the model's MoE "
                    "output, nothing copied (buffer=output): the one-copy exchange with the "
                    "activations in the wire dtype."));
  am->in_place_input_ = &in_place->Add({{"rank", r}, {"buffer", "input"}});
  am->in_place_output_ = &in_place->Add({{"rank", r}, {"buffer", "output"}});
  DXS_ASSIGN_OR_RETURN(
      m::HistogramFamily * step_duration,
      m::AddHistogram(registry, "dxs_step_duration_seconds",
                      "Duration of one model step on this rank, from building the batch "
                      "to sampling, including the step exchange with the other DP ranks."));
  am->step_duration_ =
      &step_duration->Add({{"role", "attention"}, {"rank", r}}, m::ExponentialBuckets(1e-4, 2, 18));

  DXS_ASSIGN_OR_RETURN(am->dispatched_family_,
                       m::AddCounter(registry, "dxs_tokens_dispatched_total",
                                     "Tokens this DP rank sent to an EP rank (a token "
                                     "counts once per MoE layer and EP rank it visits)."));
  DXS_ASSIGN_OR_RETURN(am->combined_family_,
                       m::AddCounter(registry, "dxs_tokens_combined_total",
                                     "Token rows this DP rank received back from an EP "
                                     "rank and summed into its MoE output."));
  DXS_ASSIGN_OR_RETURN(
      m::HistogramFamily * dispatch,
      m::AddHistogram(registry, "dxs_dispatch_latency_seconds",
                      "Dispatch phase of one MoE layer: layout, packing and one send to "
                      "every EP rank."));
  am->dispatch_latency_ = &dispatch->Add({{"rank", r}}, m::ExponentialBuckets(1e-5, 2, 20));
  DXS_ASSIGN_OR_RETURN(
      m::HistogramFamily * balance,
      m::AddHistogram(registry, "dxs_ep_balance_ratio",
                      "Balance of one MoE layer's dispatch from this DP rank: mean over max "
                      "of the tokens sent to each EP rank (1 is even); dispatches with no "
                      "tokens are not observed."));
  am->balance_ratio_ = &balance->Add({{"rank", r}}, m::LinearBuckets(0.1, 0.1, 10));
  DXS_ASSIGN_OR_RETURN(
      m::HistogramFamily * combine,
      m::AddHistogram(registry, "dxs_combine_latency_seconds",
                      "Combine phase of one MoE layer: from the last dispatch send until "
                      "every EP rank's rows are received and summed (includes the "
                      "experts' compute)."));
  am->combine_latency_ = &combine->Add({{"rank", r}}, m::ExponentialBuckets(1e-5, 2, 20));
  DXS_ASSIGN_OR_RETURN(
      am->answer_family_,
      m::AddHistogram(registry, "dxs_ep_answer_seconds",
                      "One EP rank's answer time in one MoE layer's round, from this DP "
                      "rank's dispatch to the arrival of that rank's combine rows."));
  DXS_ASSIGN_OR_RETURN(am->slowest_family_,
                       m::AddCounter(registry, "dxs_ep_slowest_rounds_total",
                                     "MoE layer rounds of two or more EP ranks in which this "
                                     "EP rank answered last (the straggler)."));
  DXS_ASSIGN_OR_RETURN(am->exchange_bytes_,
                       m::ExchangeBytes::Register(registry, "attention", rank));

  DXS_ASSIGN_OR_RETURN(m::CallbackGaugeFamily * queue,
                       gauges->Add("dxs_queue_length",
                                   "Requests accepted by this rank and waiting for admission to "
                                   "the running batch."));
  DXS_ASSIGN_OR_RETURN(am->queue_length_, queue->Bind({{"rank", r}}, [scheduler] {
    return static_cast<double>(scheduler->num_queued());
  }));
  DXS_ASSIGN_OR_RETURN(
      m::CallbackGaugeFamily * running,
      gauges->Add("dxs_running_requests", "Requests in this rank's running batch."));
  DXS_ASSIGN_OR_RETURN(am->running_requests_, running->Bind({{"rank", r}}, [scheduler] {
    return static_cast<double>(scheduler->num_running());
  }));
  DXS_ASSIGN_OR_RETURN(m::CallbackGaugeFamily * kv_used,
                       gauges->Add("dxs_kv_cache_used_tokens",
                                   "KV cache positions reserved by live requests (each reserves "
                                   "prompt + max_new_tokens at admission)."));
  DXS_ASSIGN_OR_RETURN(am->kv_used_, kv_used->Bind({{"rank", r}}, [kv] {
    return static_cast<double>(kv->reserved_tokens());
  }));
  DXS_ASSIGN_OR_RETURN(
      m::CallbackGaugeFamily * kv_capacity,
      gauges->Add("dxs_kv_cache_capacity_tokens", "KV cache positions this rank can hold."));
  DXS_ASSIGN_OR_RETURN(am->kv_capacity_, kv_capacity->Bind({{"rank", r}}, [kv] {
    return static_cast<double>(kv->capacity_tokens());
  }));
  return am;
}

void AttentionMetrics::OnStep(int64_t num_tokens, bool failed, int num_micro_batches,
                              bool piecewise, bool low_latency, bool ahead, double seconds) {
  steps_->Increment();
  if (num_tokens == 0) empty_steps_->Increment();
  if (failed) failed_steps_->Increment();
  if (num_micro_batches > 1) overlapped_steps_->Increment();
  if (piecewise) piecewise_steps_->Increment();
  if (low_latency) low_latency_steps_->Increment();
  if (ahead) steps_ahead_->Increment();
  step_duration_->Observe(seconds);
}

void AttentionMetrics::GrowEpRanks(size_t num_ep_ranks) {
  while (dispatched_.size() < num_ep_ranks) {
    const std::string ep_rank = std::to_string(dispatched_.size());
    dispatched_.push_back(&dispatched_family_->Add({{"rank", rank_}, {"ep_rank", ep_rank}}));
    combined_.push_back(&combined_family_->Add({{"rank", rank_}, {"ep_rank", ep_rank}}));
    answer_.push_back(&answer_family_->Add({{"rank", rank_}, {"ep_rank", ep_rank}},
                                           metrics::ExponentialBuckets(1e-5, 2, 20)));
    slowest_.push_back(&slowest_family_->Add({{"rank", rank_}, {"ep_rank", ep_rank}}));
  }
}

void AttentionMetrics::OnEpAnswers(const std::vector<double>& seconds,
                                   const std::vector<bool>& in_step) {
  GrowEpRanks(seconds.size());
  int slowest = -1, answered = 0;
  for (size_t r = 0; r < seconds.size() && r < in_step.size(); ++r) {
    if (!in_step[r]) continue;
    answer_[r]->Observe(seconds[r]);
    ++answered;
    if (slowest < 0 || seconds[r] > seconds[slowest]) slowest = static_cast<int>(r);
  }
  if (answered >= 2) slowest_[slowest]->Increment();
}

void AttentionMetrics::OnDispatch(const std::vector<int64_t>& num_tokens_per_rank,
                                  const std::vector<bool>& in_step, double seconds) {
  GrowEpRanks(num_tokens_per_rank.size());
  int64_t most = 0;
  for (size_t r = 0; r < num_tokens_per_rank.size(); ++r) {
    dispatched_[r]->Increment(num_tokens_per_rank[r]);
    most = std::max(most, num_tokens_per_rank[r]);
  }
  dispatch_latency_->Observe(seconds);
  // Over the EP ranks of the step only: a dead or empty rank is not an imbalance.
  if (most > 0) balance_ratio_->Observe(DispatchBalanceRatio(num_tokens_per_rank, in_step));
}

void AttentionMetrics::OnCombine(const std::vector<int64_t>& num_tokens_per_rank, double seconds) {
  GrowEpRanks(num_tokens_per_rank.size());
  for (size_t r = 0; r < num_tokens_per_rank.size(); ++r) {
    combined_[r]->Increment(num_tokens_per_rank[r]);
  }
  combine_latency_->Observe(seconds);
}

}  // namespace dxs
