#include "dataplane/low_latency/low_latency_moe_executor.h"

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"

namespace dxs {

LowLatencyShape LowLatencyShapeOf(const ModelConfig& config, int attention_ranks, int expert_ranks,
                                  int capacity, bool fp8_rows) {
  LowLatencyShape shape;
  shape.num_attention_ranks = attention_ranks;
  shape.num_expert_ranks = expert_ranks;
  shape.capacity = capacity;
  shape.hidden = static_cast<int>(config.hidden_size);
  shape.top_k = static_cast<int>(config.num_experts_per_tok);
  shape.num_experts = static_cast<int>(config.num_experts);
  shape.fp8_rows = fp8_rows;
  return shape;
}

// What Combine needs of its round: the routing it went out with.
struct LowLatencyMoeExecutor::Handle final : MoeHandle {
  explicit Handle(LowLatencyMoeExecutor* executor) : executor(executor) {}
  ~Handle() override { executor->round_in_flight_ = false; }
  LowLatencyMoeExecutor* executor;
  Tensor ids;
};

absl::Status LowLatencyMoeExecutor::Run(int layer, const Tensor& x, const Tensor& ids,
                                        const Tensor& weights, Tensor* out) {
  DXS_ASSIGN_OR_RETURN(std::unique_ptr<MoeHandle> handle,
                       Dispatch(layer, 0, 1, x, ids, weights, out));
  return Combine(std::move(handle), out);
}

absl::StatusOr<std::unique_ptr<MoeHandle>> LowLatencyMoeExecutor::Dispatch(
    int layer, int micro, int num_micro, const Tensor& x, const Tensor& ids, const Tensor& weights,
    Tensor* out) {
  (void)out;  // written by Combine
  if (num_micro != 1 || micro != 0) {
    return absl::FailedPreconditionError(
        absl::StrCat("low-latency MoE: micro-batch ", micro, " of ", num_micro,
                     " (a step goes over the low-latency exchange as one micro-batch)"));
  }
  if (round_in_flight_) {
    return absl::FailedPreconditionError(
        absl::StrCat("low-latency MoE: layer ", layer, " dispatched before the last one combined"));
  }
  // Every MoE layer is one round; the expert ranks count them the same way. x is in the
  // activation dtype, bf16 on every backend that has the exchange: the wire's.
  DXS_RETURN_IF_ERROR(exchange_->Dispatch(x, ids, weights, expert_owner_));
  auto handle = std::make_unique<Handle>(this);
  round_in_flight_ = true;
  handle->layer = layer;
  handle->micro = micro;
  handle->ids = ids;
  return std::unique_ptr<MoeHandle>(std::move(handle));
}

absl::Status LowLatencyMoeExecutor::Combine(std::unique_ptr<MoeHandle> handle, Tensor* out) {
  auto* round = dynamic_cast<Handle*>(handle.get());
  if (round == nullptr || round->executor != this) {
    return absl::InvalidArgumentError("low-latency MoE: combine of another executor's handle");
  }
  return exchange_->Combine(round->ids, expert_owner_, out);
}

}  // namespace dxs
