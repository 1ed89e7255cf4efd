// ExpertCompute: what an expert worker's data path (ExpertStepServer) needs from the
// experts it holds. ShardCompute runs a model ExpertShard; benchmarks substitute a cheap
// one to time the exchange alone.
#pragma once

#include "absl/status/status.h"
#include "kernels/backend.h"
#include "model/expert_shard.h"
#include "router/dispatch/routed_pairs.h"

namespace dxs {

class ExpertCompute {
 public:
  virtual ~ExpertCompute() = default;
  virtual bool Holds(int layer, int expert) const = 0;
  virtual Backend* backend() const = 0;
  // out[o] = sum over pairs p with out_row(p) == o of weights[p] * FFN_{experts[p]}(x[rows[p]]).
  // out is overwritten; its rows with no pair become zero. x may have zero rows. x and out
  // are backend tensors in the wire dtype: the rows as they arrived and the answer as it
  // goes back, converted by the compute that reads and writes them.
  virtual absl::Status Forward(int layer, const Tensor& x, const RoutedPairs& pairs,
                               Tensor* out) = 0;
};

// The routed pairs (host memory, as they arrived) onto the shard's backend, then its
// grouped expert FFN. One thread at a time (its pair tensors are reused).
class ShardCompute final : public ExpertCompute {
 public:
  explicit ShardCompute(ExpertShard* shard) : shard_(shard) {}
  bool Holds(int layer, int expert) const override { return shard_->Holds(layer, expert); }
  Backend* backend() const override { return shard_->backend(); }
  absl::Status Forward(int layer, const Tensor& x, const RoutedPairs& pairs, Tensor* out) override;

 private:
  ExpertShard* shard_;
  Tensor rows_, experts_, weights_, out_rows_;  // [capacity] pair tensors, reused
};

}  // namespace dxs
