#include "expert_service/low_latency_expert_rounds.h"

#include <vector>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"

namespace dxs {

absl::StatusOr<std::unique_ptr<LowLatencyExpertRounds>> LowLatencyExpertRounds::Make(
    const ModelConfig& config, ExpertShard* shard, LowLatencyExchange* exchange) {
  const LowLatencyShape& s = exchange->shape();
  if (exchange->side() != LowLatencySide::kExpert || s.num_experts != config.num_experts ||
      s.hidden != config.hidden_size) {
    return absl::InvalidArgumentError(absl::StrCat(
        "low-latency expert rounds: an exchange of ", s.num_experts, " experts, hidden ", s.hidden,
        ", for a model of ", config.num_experts, " and ", config.hidden_size));
  }
  Backend* backend = shard->backend();
  const int layers = config.num_hidden_layers;
  std::vector<int32_t> held(static_cast<size_t>(layers) * s.num_experts);
  for (int l = 0; l < layers; ++l) {
    for (int e = 0; e < s.num_experts; ++e) {
      held[static_cast<size_t>(l) * s.num_experts + e] = shard->Holds(l, e) ? 1 : 0;
    }
  }
  auto rounds =
      std::unique_ptr<LowLatencyExpertRounds>(new LowLatencyExpertRounds(shard, exchange));
  DXS_ASSIGN_OR_RETURN(rounds->held_, backend->Allocate({layers, s.num_experts}, DType::kI32));
  DXS_RETURN_IF_ERROR(backend->CopyFromHost(held.data(), DType::kI32, &rounds->held_));
  for (int l = 0; l < layers; ++l) {
    if (config.IsMoeLayer(l)) rounds->moe_layers_.push_back(l);
  }
  const int64_t slots = static_cast<int64_t>(s.num_attention_ranks) * s.capacity;
  DXS_ASSIGN_OR_RETURN(rounds->y_, backend->Allocate({slots + 1, s.hidden}, DType::kBF16));
  // Every layer's experts once over a round of no pairs, before any round: the workspaces,
  // weight tables and kernels are made here, not while the attention ranks wait for an
  // answer (a wait's timeout counts from their send).
  const int64_t entries = slots * s.top_k;
  LowLatencyPairs none;
  DXS_ASSIGN_OR_RETURN(none.x, backend->Zeros({slots, s.hidden}, DType::kBF16));
  DXS_ASSIGN_OR_RETURN(none.rows, backend->Zeros({entries}, DType::kI32));
  DXS_ASSIGN_OR_RETURN(none.weights, backend->Zeros({entries}, DType::kF32));
  DXS_ASSIGN_OR_RETURN(none.experts, backend->Allocate({entries}, DType::kI32));
  DXS_ASSIGN_OR_RETURN(none.out_rows, backend->Allocate({entries}, DType::kI32));
  const std::vector<int32_t> no_expert(static_cast<size_t>(entries), s.num_experts);
  const std::vector<int32_t> spare_row(static_cast<size_t>(entries), static_cast<int32_t>(slots));
  DXS_RETURN_IF_ERROR(backend->CopyFromHost(no_expert.data(), DType::kI32, &none.experts));
  DXS_RETURN_IF_ERROR(backend->CopyFromHost(spare_row.data(), DType::kI32, &none.out_rows));
  for (int l = 0; l < layers; ++l) {
    if (config.IsMoeLayer(l)) DXS_RETURN_IF_ERROR(shard->ForwardCountedPairs(l, none, &rounds->y_));
  }
  DXS_RETURN_IF_ERROR(backend->Synchronize());
  // The step's graph, recorded now (not run): recording in a first live step would allocate
  // and instantiate while the other ranks' waits spin, and in one process (one CUDA
  // context) those calls can wait for the GPU to go idle: a stall until the waits time out.
  if (backend->SupportsGraphs()) {
    DXS_ASSIGN_OR_RETURN(CapturedGraph captured, backend->CaptureGraph(
                                                     [&]() -> absl::StatusOr<Tensor> {
                                                       DXS_RETURN_IF_ERROR(rounds->Rounds());
                                                       return Tensor();
                                                     },
                                                     /*eager_output=*/nullptr));
    rounds->graph_ = std::move(captured.graph);
  }
  return rounds;
}

absl::Status LowLatencyExpertRounds::Round(int layer) {
  if (layer < 0 || layer >= held_.rows()) {
    return absl::InvalidArgumentError(absl::StrCat("low-latency round: layer ", layer));
  }
  DXS_RETURN_IF_ERROR(
      exchange_->Receive(held_.Rows(layer, 1).Reshape({held_.row_size()}), &pairs_));
  DXS_RETURN_IF_ERROR(shard_->ForwardCountedPairs(layer, pairs_, &y_));
  return exchange_->Send(y_);
}

absl::Status LowLatencyExpertRounds::Rounds() {
  for (int l : moe_layers_) DXS_RETURN_IF_ERROR(Round(l));
  return absl::OkStatus();
}

absl::Status LowLatencyExpertRounds::Launch() {
  return graph_ != nullptr ? shard_->backend()->Replay(graph_.get()) : Rounds();
}

absl::Status LowLatencyExpertRounds::Step() {
  DXS_RETURN_IF_ERROR(Launch());
  return CheckStatus();
}

}  // namespace dxs
