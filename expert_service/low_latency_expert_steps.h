// LowLatencyExpertSteps: an expert worker's decode steps over the low-latency exchange
// (dataplane/low_latency/low_latency_exchange.h) between processes: the expert service's side of
// the low-latency decode path.
//
// The DP ranks decide each step's path together (AttentionStepLoop): a step that goes this
// way reaches an expert rank as one kLowLatencyStep message from every DP rank
// (dataplane/dispatch/wire.h) instead of a dispatch header per MoE layer. ExpertStepServer
// gathers them as it gathers dispatch headers and hands them to Serve, which runs the
// step's rounds (LowLatencyExpertRounds::Step: recorded into a CUDA graph the first time,
// replayed after) and waits for them.
//
// The exchange is made per generation. The first step of a generation carries every DP
// rank's combine region key (kConnect): this rank makes its side (its dispatch region,
// sized by the message's capacity and rank counts), connects to the DP ranks' regions,
// warms its experts up, then answers each DP rank with its own key (kLowLatencyRegion), so
// the DP ranks' waits start only once this rank is ready. A rank whose backend has no
// low-latency exchange (the CPU) answers with no key: the DP ranks run that step and every
// later one by the host-driven exchange. A step that fails (a wait that timed out, a
// message of another generation) drops the exchange; the DP ranks make a new generation.
//
// Thread safety: Serve is called by the serving thread only.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "common/model_config.h"
#include "dataplane/dispatch/wire.h"
#include "dataplane/low_latency/low_latency_exchange.h"
#include "dataplane/transport/transport.h"
#include "expert_service/low_latency_expert_rounds.h"
#include "model/expert_shard.h"

namespace dxs {

class LowLatencyExpertSteps {
 public:
  LowLatencyExpertSteps(Transport* transport, ExpertShard* shard, const ModelConfig& config)
      : transport_(transport), shard_(shard), config_(config) {}

  // Serves the step whose kLowLatencyStep messages arrived: headers[i] and keys[i] (its
  // payload) from DP rank i, whose transport peer is dp_peers[i].
  absl::Status Serve(const std::vector<int>& dp_peers, const std::vector<WireHeader>& headers,
                     const std::vector<std::string>& keys);
  // The generation of the exchange this rank holds; 0: none.
  uint32_t generation() const { return exchange_ != nullptr ? generation_ : 0; }
  // The rounds (MoE layers) of the step Serve last ran.
  int num_rounds() const { return rounds_ != nullptr ? rounds_->num_rounds() : 0; }

 private:
  // A new exchange for `first`'s generation, connected to the DP ranks' `keys`.
  absl::Status Make(const WireHeader& first, const std::vector<std::string>& keys);
  // Answers every DP rank's kConnect with this rank's key (empty: no exchange).
  absl::Status Answer(const std::vector<int>& dp_peers, const WireHeader& first,
                      const std::string& key);
  void Drop();

  Transport* transport_;
  ExpertShard* shard_;
  ModelConfig config_;
  uint32_t generation_ = 0;
  std::unique_ptr<LowLatencyExchange> exchange_;
  std::unique_ptr<LowLatencyExpertRounds> rounds_;
};

}  // namespace dxs
