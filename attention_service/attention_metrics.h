// AttentionMetrics: one DP rank's Prometheus series (docs/metrics.md, "Attention workers"):
// steps, empty-batch steps and steps split for two-batch overlap, step time, tokens dispatched to
// and combined from each EP rank, dispatch and combine latency, each dispatch's balance over the
// EP ranks (dxs_ep_balance_ratio), each EP rank's answer time and how often it was the
// slowest (dxs_ep_answer_seconds, dxs_ep_slowest_rounds_total), the bytes posted to the data
// exchange by memory type (dxs_exchange_bytes_total), and, read at scrape time, queue length,
// running requests and KV cache use.
//
// The step loop calls OnStep; RemoteMoeExecutor calls OnDispatch / OnCombine (this is its
// DispatchObserver). Each updates children looked up once (a per-EP-rank child on the
// first layer that sees that rank), so an update is an atomic add or a histogram Observe.
//
// Thread safety: OnStep, OnDispatch and OnCombine are called by the step thread only; the
// gauge callbacks run on the scraping thread. The registry, scheduler and KV cache must
// outlive this object.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "common/metrics/callback_gauge.h"
#include "common/metrics/families.h"
#include "dataplane/dispatch/dispatch_combine.h"
#include "dataplane/transport/exchange_bytes.h"
#include "model/kv_cache.h"
#include "model/scheduler.h"
#include "prometheus/registry.h"

namespace dxs {

class AttentionMetrics final : public DispatchObserver {
 public:
  // Counters and histograms go into `registry`, the gauges read at scrape time (queue,
  // running requests, KV cache) into `gauges`.
  static absl::StatusOr<std::unique_ptr<AttentionMetrics>> Create(prometheus::Registry* registry,
                                                                  metrics::CallbackGauges* gauges,
                                                                  int rank, Scheduler* scheduler,
                                                                  const KvCache* kv);

  // One step of the step loop ended: this rank's batch had `num_tokens` tokens (0: an
  // empty step), `failed` if the step did not produce logits; it ran as
  // `num_micro_batches` micro-batches (2: split for two-batch overlap), in graph segments
  // (`piecewise`) or over the low-latency exchange (`low_latency`); `ahead`: built ahead of
  // the step before's tokens (overlap scheduling).
  void OnStep(int64_t num_tokens, bool failed, int num_micro_batches, bool piecewise,
              bool low_latency, bool ahead, double seconds);

  void OnDispatch(const std::vector<int64_t>& num_tokens_per_rank, const std::vector<bool>& in_step,
                  double seconds) override;
  void OnCombine(const std::vector<int64_t>& num_tokens_per_rank, double seconds) override;
  void OnExchange(const Transfer* transfers, size_t num_transfers) override {
    exchange_bytes_.Count(transfers, num_transfers);
  }
  // Bytes loaded from (sent) and stored into (received) a mapped region, that side's.
  void OnMappedBytes(size_t sent, size_t received) override {
    exchange_bytes_.CountMapped(sent, received);
  }
  void OnInPlace(bool input, bool output) override {
    if (input) in_place_input_->Increment();
    if (output) in_place_output_->Increment();
  }
  // Each EP rank's answer time in one combine (dxs_ep_answer_seconds), and the slowest of
  // them when the round had two or more (dxs_ep_slowest_rounds_total): the straggler.
  void OnEpAnswers(const std::vector<double>& seconds, const std::vector<bool>& in_step) override;

 private:
  AttentionMetrics() = default;
  // Makes sure dispatched_, combined_, answer_ and slowest_ have a child for EP ranks
  // [0, num_ep_ranks).
  void GrowEpRanks(size_t num_ep_ranks);

  std::string rank_;
  prometheus::Counter* steps_ = nullptr;
  prometheus::Counter* empty_steps_ = nullptr;
  prometheus::Counter* failed_steps_ = nullptr;
  prometheus::Counter* overlapped_steps_ = nullptr;
  prometheus::Counter* piecewise_steps_ = nullptr;
  prometheus::Counter* low_latency_steps_ = nullptr;
  prometheus::Counter* steps_ahead_ = nullptr;
  prometheus::Histogram* step_duration_ = nullptr;
  metrics::CounterFamily* dispatched_family_ = nullptr;
  metrics::CounterFamily* combined_family_ = nullptr;
  std::vector<prometheus::Counter*> dispatched_;  // per EP rank
  std::vector<prometheus::Counter*> combined_;    // per EP rank
  metrics::HistogramFamily* answer_family_ = nullptr;
  metrics::CounterFamily* slowest_family_ = nullptr;
  std::vector<prometheus::Histogram*> answer_;  // per EP rank: dxs_ep_answer_seconds
  std::vector<prometheus::Counter*> slowest_;   // per EP rank: dxs_ep_slowest_rounds_total
  prometheus::Histogram* dispatch_latency_ = nullptr;
  prometheus::Histogram* balance_ratio_ = nullptr;  // mean / max tokens per EP rank
  prometheus::Histogram* combine_latency_ = nullptr;
  prometheus::Counter* in_place_input_ = nullptr;   // dxs_moe_in_place_total{buffer="input"}
  prometheus::Counter* in_place_output_ = nullptr;  // {buffer="output"}
  metrics::ExchangeBytes exchange_bytes_;
  // Declared last: unbound (and no longer running) before anything above goes away.
  metrics::CallbackRegistration queue_length_;
  metrics::CallbackRegistration running_requests_;
  metrics::CallbackRegistration kv_used_;
  metrics::CallbackRegistration kv_capacity_;
};

}  // namespace dxs
