// ExpertStepServer: the expert worker's data path.
//
// One round = one MoE layer of one step: a dispatch message from every DP rank (empty
// ones included) carrying the same (step, layer). The server runs this rank's experts over
// all received rows (SwiGLU, grouped by expert), pre-sums each row's weighted outputs
// over its own experts, and answers every DP rank with one combine message, in dispatch
// order. Messages from an older (step, layer) than the newest seen are stale (a step that
// failed elsewhere) and are dropped.
//
// Thread safety: ServeRound is called by one thread; counters may be read from any.
#pragma once

#include <atomic>
#include <cstdint>
#include <optional>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "common/model_config.h"
#include "expert_service/expert_metrics.h"
#include "kernels/tensor.h"
#include "model/expert_shard.h"
#include "router/transport/transport.h"

namespace dxs {

struct ExpertCounters {
  std::atomic<int64_t> rounds{0};         // layer rounds served
  std::atomic<int64_t> empty_rounds{0};   // rounds in which this rank received no rows
  std::atomic<int64_t> steps{0};          // steps completed (last MoE layer served)
  std::atomic<int64_t> empty_steps{0};    // steps in which this rank received no rows at all
  std::atomic<int64_t> rows_received{0};  // token rows received, all layers
};

class ExpertStepServer {
 public:
  ExpertStepServer(Transport* transport, std::vector<int> dp_peers, ExpertCompute* shard,
                   const ModelConfig& config);

  void set_dp_peers(std::vector<int> peers);
  const ExpertCounters& counters() const { return counters_; }
  // Where each round and step is reported for Prometheus; not owned, null (the default)
  // for none. Set before the first ServeRound.
  void set_metrics(ExpertMetrics* metrics) { metrics_ = metrics; }

  // Serves one round. DEADLINE_EXCEEDED if it is incomplete by `deadline` (what arrived is
  // kept for the next call); UNAVAILABLE if a DP peer failed (its pending message dropped).
  absl::Status ServeRound(absl::Time deadline);

 private:
  absl::Status Fill(size_t i, absl::Time deadline);

  Transport* transport_;
  std::vector<int> dp_peers_;
  ExpertCompute* shard_;
  ModelConfig config_;
  int last_moe_layer_ = -1;
  ExpertCounters counters_;
  ExpertMetrics* metrics_ = nullptr;
  int64_t rows_this_step_ = 0;
  std::vector<std::optional<TransportMessage>> pending_;
  int64_t buffer_rows_ = 0;
  Tensor x_buffer_, out_buffer_;  // [buffer_rows_, hidden], reused across rounds
  PayloadBytes send_buffer_;
};

}  // namespace dxs
