// LowLatencyDecode: an attention worker's decode steps over the low-latency exchange
// (dataplane/low_latency/low_latency_exchange.h) to expert workers in other processes: the
// attention service's side of the low-latency decode path (`dxs-attention --low-latency-capacity
// N`).
//
// Which steps: the DP ranks decide together in the step exchange (AttentionStepLoop). A
// rank's step fits when it is decode-shaped (one token per request, or no request) and its
// padded batch (Qwen3MoeModel::PaddedDecodeBatch) is at most the capacity; the step goes
// over the low-latency exchange when every DP rank's fits, and by the host-driven exchange
// (RemoteMoeExecutor) otherwise: prefill, large batches, a backend without the exchange.
// This is SGLang's `--deepep-mode auto` (low latency for decode, normal for prefill),
// decided per step instead of per batch kind.
//
// A low-latency step: BeginStep tells every expert rank that holds experts in the step's
// placement (kLowLatencyStep, dataplane/dispatch/wire.h), then the model's padded decode step
// runs with moe() switched to the exchange (recorded into a CUDA graph once per batch
// bucket, every layer's dispatch and combine in it: no host synchronisation in the step),
// and EndStep reads the exchange's status. A token goes to the primary replica of each of
// its experts (the exchange sends a token once to each rank that holds one of them).
//
// Generations: an exchange is made for a (generation, placement version). The DP ranks
// agree on the generation in the step exchange (the highest any rank wants); a rank wants a
// new one on its first step, after a failed step and after a new cluster view (Reset), so
// every DP rank makes its new exchange in the same step. That step's messages carry the
// combine region keys (kConnect); each expert rank makes its side, warms up and answers
// with its dispatch region key; then the regions are connected and the step runs. An
// expert rank that answers with no key has no exchange (a CPU backend): the step and all
// later ones go by the host-driven exchange.
//
// Thread safety: used by the step thread only.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/model_config.h"
#include "dataplane/dispatch/placement.h"
#include "dataplane/low_latency/low_latency_exchange.h"
#include "dataplane/low_latency/low_latency_moe_executor.h"
#include "dataplane/transport/transport.h"
#include "kernels/backend.h"
#include "kernels/moe_executor.h"

namespace dxs {

// The attention worker's MoE: the host-driven executor, or for one step another one (the
// low-latency exchange's). Every call goes to the one in use.
class SwitchedMoeExecutor final : public MoeExecutor {
 public:
  explicit SwitchedMoeExecutor(MoeExecutor* host_driven)
      : host_driven_(host_driven), current_(host_driven) {}
  // `executor` from now on; null: the host-driven one.
  void Use(MoeExecutor* executor) { current_ = executor != nullptr ? executor : host_driven_; }

  absl::Status Run(int layer, const Tensor& x, const Tensor& ids, const Tensor& weights,
                   Tensor* out) override {
    return current_->Run(layer, x, ids, weights, out);
  }
  bool overlaps() const override { return current_->overlaps(); }
  absl::StatusOr<std::unique_ptr<MoeHandle>> Dispatch(int layer, int micro, int num_micro,
                                                      const Tensor& x, const Tensor& ids,
                                                      const Tensor& weights, Tensor* out) override {
    return current_->Dispatch(layer, micro, num_micro, x, ids, weights, out);
  }
  absl::Status Combine(std::unique_ptr<MoeHandle> handle, Tensor* out) override {
    return current_->Combine(std::move(handle), out);
  }
  bool StageBuffers(int micro, int64_t rows, DType dtype, Tensor* x, Tensor* out) override {
    return current_->StageBuffers(micro, rows, dtype, x, out);
  }

 private:
  MoeExecutor* host_driven_;
  MoeExecutor* current_;
};

class LowLatencyDecode {
 public:
  // Checks that `backend` has the exchange (a small one is made and dropped): UNIMPLEMENTED
  // where it has none, INVALID_ARGUMENT for FP8 rows the exchange cannot carry (hidden not
  // a multiple of 512). host_driven: the steps that do not fit go there. fp8_rows: the
  // dispatch rows go as FP8 records (the cluster's --wire-dtype fp8), as on host_driven.
  static absl::StatusOr<std::unique_ptr<LowLatencyDecode>> Make(
      int dp_rank, int num_dp, int capacity, const ModelConfig& config, Backend* backend,
      Transport* transport, MoeExecutor* host_driven, absl::Duration timeout,
      bool fp8_rows = false);

  // What the model is built with.
  MoeExecutor* moe() { return &moe_; }
  // Whether a step of these chunks' shape fits (see above): decode-shaped, padded within
  // the capacity, and the exchange available (no expert rank has answered that it has
  // none).
  bool Fits(bool decode_shaped, int64_t num_chunks) const;
  // The generation this rank asks for in the step exchange.
  uint32_t wanted_generation() const;
  // A new cluster view: the next low-latency step makes a new exchange.
  void Reset() { stale_ = true; }

  // Before the forward pass of step `step`, which the DP ranks agreed runs over the
  // exchange of `generation` with `placement` (EP rank r's transport peer: ep_peers[r]).
  // Makes the exchange first if this rank's is not that one (*made_new then: recorded
  // graphs of the old one must go). True: moe() now runs the exchange. False: an expert
  // rank has no exchange, the step goes by the host-driven one (and every later one).
  absl::StatusOr<bool> BeginStep(uint64_t step, uint32_t generation, const Placement& placement,
                                 const std::vector<int>& ep_peers, bool* made_new);
  // A step of no tokens on this rank: every MoE layer's round with zero rows.
  absl::Status EmptyStep();
  // After the step's work: switches moe() back and waits for the exchange's status. A
  // failure (UNAVAILABLE: a peer stopped answering) drops the exchange.
  absl::Status EndStep();

 private:
  LowLatencyDecode(int dp_rank, int num_dp, int capacity, const ModelConfig& config,
                   Backend* backend, Transport* transport, MoeExecutor* host_driven,
                   absl::Duration timeout, bool fp8_rows)
      : dp_rank_(dp_rank),
        num_dp_(num_dp),
        capacity_(capacity),
        fp8_rows_(fp8_rows),
        config_(config),
        backend_(backend),
        transport_(transport),
        moe_(host_driven),
        timeout_(timeout) {}
  LowLatencyShape Shape(int num_expert_ranks) const;
  // Makes and connects the exchange of `generation` with the expert ranks of `placement`.
  absl::StatusOr<bool> Connect(uint64_t step, uint32_t generation, const Placement& placement,
                               const std::vector<int>& ep_peers);
  absl::Status Tell(uint64_t step, bool connect);
  void Drop();

  int dp_rank_, num_dp_, capacity_;
  bool fp8_rows_;
  ModelConfig config_;
  Backend* backend_;
  Transport* transport_;
  SwitchedMoeExecutor moe_;
  absl::Duration timeout_;
  bool available_ = true;
  bool stale_ = false;
  uint32_t generation_ = 0;  // of exchange_; 0 before the first
  uint64_t placement_version_ = 0;
  std::unique_ptr<LowLatencyExchange> exchange_;
  std::unique_ptr<LowLatencyMoeExecutor> executor_;
  // The expert ranks of the exchange: transport peers, in exchange rank order.
  std::vector<int> expert_peers_;
  Tensor empty_x_, empty_ids_, empty_weights_, empty_out_;  // EmptyStep's zero-row tensors
};

}  // namespace dxs
