// LowLatencyMoeExecutor: an attention rank's MoE over the low-latency exchange
// (dataplane/low_latency/low_latency_exchange.h), for decode steps: each layer's Run enqueues the
// dispatch and the combine and returns, with no host synchronisation, so a whole decode
// step (every layer's exchange with it) is captured in one CUDA graph, as the single-process
// engine's is. The expert ranks run the matching rounds
// (expert_service/low_latency_expert_rounds.h).
//
// A batch above the exchange's capacity is FAILED_PRECONDITION: prefill goes by the
// host-driven exchange (RemoteMoeExecutor). Placements are one rank an expert (the exchange
// sends a token once to each rank that holds one of its experts); CheckStatus after a step
// turns a peer that stopped answering into UNAVAILABLE.
#pragma once

#include <cstdint>
#include <memory>

#include "absl/status/status.h"
#include "common/model_config.h"
#include "dataplane/low_latency/low_latency_exchange.h"
#include "kernels/backend.h"
#include "kernels/moe_executor.h"

namespace dxs {

// The exchange's shape for `config`'s model (hidden size, top-k, experts) between these
// ranks at this capacity, its dispatch rows FP8 records or not; the wait's timeout is the
// shape's default unless set after.
LowLatencyShape LowLatencyShapeOf(const ModelConfig& config, int attention_ranks, int expert_ranks,
                                  int capacity, bool fp8_rows = false);

class LowLatencyMoeExecutor final : public MoeExecutor {
 public:
  // exchange: this attention rank's side, connected. expert_owner: i32 [num_experts] on
  // the exchange's backend, the expert rank of each expert; kept as is for every round.
  LowLatencyMoeExecutor(LowLatencyExchange* exchange, Tensor expert_owner)
      : exchange_(exchange), expert_owner_(std::move(expert_owner)) {}

  // Dispatch and Combine enqueued back to back.
  absl::Status Run(int layer, const Tensor& x, const Tensor& ids, const Tensor& weights,
                   Tensor* out) override;
  // The exchange's two halves (DeepEP's low-latency dispatch and combine): Dispatch enqueues
  // the rows' send, Combine the wait for the answers and their sum into out. One round is in
  // flight at a time (the regions have a slot per token, not per micro-batch), so a step
  // goes as one micro-batch: FAILED_PRECONDITION for num_micro > 1 or a second Dispatch
  // before Combine. A handle dropped uncombined leaves its round unanswered here: the
  // exchange is then remade, as after any failed step.
  absl::StatusOr<std::unique_ptr<MoeHandle>> Dispatch(int layer, int micro, int num_micro,
                                                      const Tensor& x, const Tensor& ids,
                                                      const Tensor& weights, Tensor* out) override;
  absl::Status Combine(std::unique_ptr<MoeHandle> handle, Tensor* out) override;
  absl::Status CheckStatus() { return exchange_->CheckStatus(); }

 private:
  struct Handle;
  LowLatencyExchange* exchange_;
  Tensor expert_owner_;
  bool round_in_flight_ = false;
};

}  // namespace dxs
