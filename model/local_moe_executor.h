// LocalMoeExecutor: the single-process engine's MoE, every expert in this process.
#pragma once

#include "kernels/moe_executor.h"
#include "model/expert_shard.h"

namespace dxs {

// Runs every expert in this process.
class LocalMoeExecutor final : public MoeExecutor {
 public:
  explicit LocalMoeExecutor(ExpertShard* shard) : shard_(shard) {}
  absl::Status Run(int layer, const Tensor& x, const Tensor& ids, const Tensor& weights,
                   Tensor* out) override {
    return shard_->ForwardRouted(layer, x, ids, weights, out);
  }

 private:
  ExpertShard* shard_;
};

}  // namespace dxs
