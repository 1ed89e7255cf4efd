// MoeExecutor: how the attention side gets the MoE output of one layer.
//
// The single-process engine runs the experts locally (LocalMoeExecutor); an attention
// worker dispatches rows to expert workers and combines their pre-summed results. Either
// way `out[t] = sum_k weights[t, k] * expert_{ids[t, k]}(x[t])` and that sum is the one
// reduction: nothing reduces the output again.
//
// Every DP rank calls Run once per MoE layer per step, with zero tokens when it has none:
// that keeps the ranks in lockstep with the expert workers.
#pragma once

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "kernels/tensor.h"
#include "model/expert_shard.h"

namespace dxs {

class MoeExecutor {
 public:
  virtual ~MoeExecutor() = default;
  // x[T, hidden]; ids/weights[T * top_k] from the router; out[T, hidden] is overwritten.
  virtual absl::Status Run(int layer, const Tensor& x, const std::vector<int32_t>& ids,
                           const std::vector<float>& weights, int top_k, Tensor* out) = 0;
};

// Runs every expert in this process.
class LocalMoeExecutor final : public MoeExecutor {
 public:
  explicit LocalMoeExecutor(ExpertShard* shard) : shard_(shard) {}
  absl::Status Run(int layer, const Tensor& x, const std::vector<int32_t>& ids,
                   const std::vector<float>& weights, int top_k, Tensor* out) override {
    RoutedPairs pairs;
    for (size_t i = 0; i < ids.size(); ++i) {
      pairs.Add(static_cast<int32_t>(i / top_k), ids[i], weights[i]);
    }
    return shard_->Forward(layer, x, pairs, out);
  }

 private:
  ExpertShard* shard_;
};

}  // namespace dxs
