// ExpertMetrics: one EP rank's Prometheus series (docs/metrics.md, "Expert workers"): steps
// and empty-batch steps, layer rounds and empty ones, token rows received, rows computed
// per expert, expert compute time, and the bytes posted to the data exchange by memory type.
//
// ExpertStepServer calls OnRound after each MoE layer round and OnStep after a step's last
// MoE layer. Children are looked up once (per expert: this rank's experts at creation), so
// a round costs a pass over its pairs into a reused count vector, then one atomic add per
// expert that got rows.
//
// Thread safety: OnRound and OnStep are called by the serving thread only. The registry
// must outlive this object.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "common/metrics/families.h"
#include "dataplane/transport/exchange_bytes.h"
#include "prometheus/registry.h"

namespace dxs {

class ExpertMetrics {
 public:
  // `experts`: the experts this rank holds (exposed at zero from the start), each in
  // [0, num_experts).
  static absl::StatusOr<std::unique_ptr<ExpertMetrics>> Create(prometheus::Registry* registry,
                                                               int rank,
                                                               const std::vector<int>& experts,
                                                               int num_experts);

  // One MoE layer round: `num_rows` token rows received from all DP ranks; the experts took
  // `compute_seconds`.
  void OnRound(int64_t num_rows, double compute_seconds);
  // The experts' cumulative rows so far ([E], ExpertCompute::TokensPerExpert): what grew
  // since the last call goes to dxs_expert_tokens_total. The per-expert counts are kept
  // where the experts run (on the device on a GPU), so they are read once per step, not
  // from the pairs of every round.
  void SyncExpertTokens(const std::vector<int64_t>& cumulative);
  // A step over the low-latency exchange was served: `rounds` MoE layer rounds, all empty
  // or not (their rows stay on the device: not in dxs_tokens_received_total; `empty` comes
  // from the experts' counts). OnStep follows.
  void OnLowLatencyStep(int rounds, bool empty);
  // A step ended (its last MoE layer was served); `empty` if no row arrived in any layer.
  void OnStep(bool empty);
  // A group (a round's receives, or its combine sends) is about to be posted.
  void OnExchange(const Transfer* transfers, size_t num_transfers) {
    exchange_bytes_.Count(transfers, num_transfers);
  }
  // Bytes loaded from (sent) and stored into (received) a mapped region, that side's.
  void OnMappedBytes(size_t sent, size_t received) { exchange_bytes_.CountMapped(sent, received); }

 private:
  ExpertMetrics() = default;

  std::string rank_;
  prometheus::Counter* steps_ = nullptr;
  prometheus::Counter* empty_steps_ = nullptr;
  prometheus::Counter* rounds_ = nullptr;
  prometheus::Counter* empty_rounds_ = nullptr;
  prometheus::Counter* low_latency_steps_ = nullptr;
  prometheus::Counter* tokens_received_ = nullptr;
  prometheus::Histogram* compute_ = nullptr;
  metrics::CounterFamily* expert_tokens_family_ = nullptr;
  std::vector<prometheus::Counter*> expert_tokens_;  // by expert id; null until seen
  std::vector<int64_t> synced_;                      // by expert id: the last cumulative
  metrics::ExchangeBytes exchange_bytes_;
};

}  // namespace dxs
