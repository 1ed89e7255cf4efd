#include "dataplane/low_latency/low_latency_moe_executor.h"

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"

namespace dxs {

LowLatencyShape LowLatencyShapeOf(const ModelConfig& config, int attention_ranks, int expert_ranks,
                                  int capacity) {
  LowLatencyShape shape;
  shape.num_attention_ranks = attention_ranks;
  shape.num_expert_ranks = expert_ranks;
  shape.capacity = capacity;
  shape.hidden = static_cast<int>(config.hidden_size);
  shape.top_k = static_cast<int>(config.num_experts_per_tok);
  shape.num_experts = static_cast<int>(config.num_experts);
  return shape;
}

absl::Status LowLatencyMoeExecutor::Run(int layer, const Tensor& x, const Tensor& ids,
                                        const Tensor& weights, Tensor* out) {
  (void)layer;  // every MoE layer is one round; the expert ranks count them the same way
  // x is in the activation dtype, bf16 on every backend that has the exchange: the wire's.
  DXS_RETURN_IF_ERROR(exchange_->Dispatch(x, ids, weights, expert_owner_));
  return exchange_->Combine(ids, expert_owner_, out);
}

}  // namespace dxs
