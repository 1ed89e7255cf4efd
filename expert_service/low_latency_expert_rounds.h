// LowLatencyExpertRounds: an expert rank's side of the low-latency exchange
// (dataplane/low_latency/low_latency_exchange.h) over the experts its ExpertShard holds.
// Round(layer) enqueues the wait for every attention rank's rows, the experts over them
// (ExpertShard::ForwardCountedPairs) and the answers' send, and returns: the ranks' waits
// run on the device, so a worker enqueues (or replays from a graph) a whole step's rounds
// at once and looks at the host only for CheckStatus.
#pragma once

#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "dataplane/low_latency/low_latency_exchange.h"
#include "model/expert_shard.h"

namespace dxs {

class LowLatencyExpertRounds {
 public:
  // exchange: this expert rank's side, connected. Which experts the shard holds is read
  // here, per layer (call again after the placement changes).
  static absl::StatusOr<std::unique_ptr<LowLatencyExpertRounds>> Make(const ModelConfig& config,
                                                                      ExpertShard* shard,
                                                                      LowLatencyExchange* exchange);

  absl::Status Round(int layer);
  // One step: every MoE layer's round, then CheckStatus (which waits for them). Where the
  // backend has graphs the step was recorded by Make, and a step replays it: its host work
  // is one launch and one status read.
  absl::Status Step();
  // Step's first half: the step's launch (the graph's replay, or every round's enqueue).
  absl::Status Launch();
  absl::Status CheckStatus() { return exchange_->CheckStatus(); }
  int num_rounds() const { return static_cast<int>(moe_layers_.size()); }

 private:
  LowLatencyExpertRounds(ExpertShard* shard, LowLatencyExchange* exchange)
      : shard_(shard), exchange_(exchange) {}
  absl::Status Rounds();

  ExpertShard* shard_;
  LowLatencyExchange* exchange_;
  std::vector<int> moe_layers_;
  std::unique_ptr<Graph> graph_;  // the recorded step (Make), where the backend has graphs
  Tensor held_;  // i32 [layers, num_experts]: non-zero where the shard holds the expert
  Tensor y_;     // bf16 [slots + 1, hidden]: a round's pre-sums
  LowLatencyPairs pairs_;
};

}  // namespace dxs
