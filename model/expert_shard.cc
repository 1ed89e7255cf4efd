#include "model/expert_shard.h"

#include <algorithm>
#include <numeric>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"

namespace dxs {
namespace {

// Layers with routed experts (the others are dense).
size_t LayersWithExperts(const ModelConfig& c) {
  size_t n = 0;
  for (int l = 0; l < c.num_hidden_layers; ++l) n += c.IsMoeLayer(l) ? 1 : 0;
  return n;
}

}  // namespace

ExpertShard::ExpertShard(const ModelConfig& config, ExpertWeightMap weights, Backend* backend)
    : config_(config),
      weights_(std::move(weights)),
      backend_(backend),
      tokens_per_expert_(new std::atomic<int64_t>[std::max<int64_t>(config.num_experts, 0)]()) {
  RebuildTables();
  const size_t experts = static_cast<size_t>(std::max<int64_t>(config.num_experts, 0));
  const bool holds_all =
      config.num_experts > 0 && weights_.size() == LayersWithExperts(config) * experts;
  // On device memory the loads are counted on the queue: a host counter would wait for it.
  if (holds_all && backend_->capabilities().device_memory) {
    absl::StatusOr<Tensor> counts = backend_->Zeros({config.num_experts}, DType::kI64);
    if (counts.ok()) {
      device_counts_ = *counts;
      counts_on_device_ = true;
    }
  }
}

std::vector<int64_t> ExpertShard::tokens_per_expert_snapshot() const {
  std::vector<int64_t> out(std::max<int64_t>(config_.num_experts, 0));
  for (size_t e = 0; e < out.size(); ++e) out[e] = tokens_per_expert_[e].load();
  absl::MutexLock lock(&device_counts_mu_);
  for (const Tensor* counts : {&device_counts_, &ll_counts_}) {
    if (!counts->defined()) continue;
    std::vector<int64_t> device(out.size());
    if (backend_->CopyToHost(*counts, DType::kI64, device.data()).ok()) {
      for (size_t e = 0; e < out.size(); ++e) out[e] += device[e];
    }
  }
  return out;
}

void ExpertShard::RebuildTables() {
  const size_t layers = static_cast<size_t>(std::max<int64_t>(config_.num_hidden_layers, 0));
  const size_t experts = static_cast<size_t>(std::max<int64_t>(config_.num_experts, 0));
  for (auto* table : {&gate_up_, &down_}) {
    table->assign(layers, std::vector<const Tensor*>(experts, nullptr));
  }
  for (const auto& [key, w] : weights_) {
    const auto [layer, expert] = key;
    if (layer < 0 || static_cast<size_t>(layer) >= layers || expert < 0 ||
        static_cast<size_t>(expert) >= experts) {
      continue;
    }
    gate_up_[layer][expert] = &w.gate_up_proj;
    down_[layer][expert] = &w.down_proj;
  }
}

void ExpertShard::AddExperts(ExpertWeightMap more) {
  for (auto& [key, w] : more) weights_.emplace(key, std::move(w));
  RebuildTables();
}

void ExpertShard::KeepOnly(const std::vector<int>& keep) {
  for (auto it = weights_.begin(); it != weights_.end();) {
    if (std::find(keep.begin(), keep.end(), it->first.second) == keep.end()) {
      it = weights_.erase(it);
    } else {
      ++it;
    }
  }
  RebuildTables();
}

bool ExpertShard::Holds(int layer, int expert) const { return weights_.count({layer, expert}) > 0; }

absl::Status ExpertShard::ForwardRouted(int layer, const Tensor& x, const Tensor& ids,
                                        const Tensor& weights, Tensor* out) {
  const int64_t tokens = ids.rows(), top_k = tokens > 0 ? ids.row_size() : 0;
  const int64_t num_pairs = tokens * top_k;
  if (num_pairs > 0 && counts_on_device_ && layer >= 0 &&
      static_cast<size_t>(layer) < gate_up_.size() && backend_->TakesRoutedSwiGlu(tokens, top_k)) {
    // Every expert is here and the batch is decode-sized: the backend's fused path gives
    // the sorted path's sums without the sort (Backend::RoutedSwiGlu).
    absl::MutexLock lock(&device_counts_mu_);
    return backend_->RoutedSwiGlu(x, ids, weights, gate_up_[layer], down_[layer], &device_counts_,
                                  out);
  }
  // Pair p belongs to token p / top_k: metadata from the shape alone, uploaded once for the
  // largest batch seen (a smaller batch's is a prefix of it).
  if (num_pairs > 0 && (routed_rows_top_k_ != top_k || routed_rows_.rows() < num_pairs)) {
    std::vector<int32_t> host_rows(
        static_cast<size_t>(std::max(num_pairs, 2 * routed_rows_.rows())));
    for (size_t p = 0; p < host_rows.size(); ++p) host_rows[p] = static_cast<int32_t>(p / top_k);
    // The old table stays alive: a captured graph may read it (it is a prefix of the new
    // one, so its contents never change).
    if (routed_rows_.defined()) retired_routed_rows_.push_back(routed_rows_);
    DXS_ASSIGN_OR_RETURN(routed_rows_, backend_->UploadIndices(host_rows));
    routed_rows_top_k_ = top_k;
  }
  const Tensor rows = num_pairs > 0 ? routed_rows_.Rows(0, num_pairs) : ids.Reshape({0});
  return ForwardPairs(layer, x, rows, ids.Reshape({num_pairs}), weights.Reshape({num_pairs}), rows,
                      out);
}

absl::Status ExpertShard::ForwardPairs(int layer, const Tensor& x, const Tensor& rows,
                                       const Tensor& experts, const Tensor& weights,
                                       const Tensor& out_rows, Tensor* out) {
  if ((x.dtype() != DType::kF32 || out->dtype() != DType::kF32) &&
      !backend_->capabilities().narrow_expert_rows) {
    return absl::FailedPreconditionError(
        absl::StrCat("the ", backend_->name(), " backend's experts take float32 rows only"));
  }
  if (layer < 0 || static_cast<size_t>(layer) >= gate_up_.size()) {
    return absl::InvalidArgumentError(absl::StrCat("expert layer ", layer, " does not exist"));
  }
  const int64_t num_pairs = rows.num_elements();
  const int64_t hidden = config_.hidden_size;
  const int num_experts = static_cast<int>(config_.num_experts);
  // In a graph capture the scratch is the call's own (from the graph's pool): the reused
  // workspace may be regrown and handed to other tensors between replays.
  const bool own_scratch = backend_->InGraphCapture();
  Workspace local;
  Workspace& ws = own_scratch ? local : ws_;
  // Empty batch: zeros, no other kernel.
  if (num_pairs == 0) return backend_->Fill(out, 0.f);
  // Workspace reused across calls (grown for the largest batch seen).
  if (!ws.order.defined() || ws.order.rows() < num_pairs) {
    const int64_t n = std::max(num_pairs, 2 * (ws.order.defined() ? ws.order.rows() : 0));
    DXS_ASSIGN_OR_RETURN(ws.order, backend_->Allocate({n}, DType::kI32));
    DXS_ASSIGN_OR_RETURN(ws.sorted_rows, backend_->Allocate({n}, DType::kI32));
    DXS_ASSIGN_OR_RETURN(ws.sorted_out_rows, backend_->Allocate({n}, DType::kI32));
    DXS_ASSIGN_OR_RETURN(ws.sorted_weights, backend_->Allocate({n}, DType::kF32));
    // Each pair's expert output in the activation dtype (bf16 on a GPU, as a bf16 model's
    // experts return it); the weighted sum over a token's pairs is float32.
    DXS_ASSIGN_OR_RETURN(ws.y, backend_->Allocate({n, hidden}));
  }
  if (!ws.offsets.defined()) {
    DXS_ASSIGN_OR_RETURN(ws.offsets, backend_->Allocate({num_experts + 1}, DType::kI32));
  }
  Tensor order = ws.order.Rows(0, num_pairs), offsets = ws.offsets;
  Tensor sorted_rows = ws.sorted_rows.Rows(0, num_pairs);
  Tensor sorted_out_rows = ws.sorted_out_rows.Rows(0, num_pairs);
  Tensor sorted_weights = ws.sorted_weights.Rows(0, num_pairs);
  // The pairs' rows, output rows and weights permuted in the sort's own pass.
  DXS_RETURN_IF_ERROR(backend_->SortPairsByExpert(
      experts, num_experts, &order, &offsets,
      {{&rows, &sorted_rows}, {&out_rows, &sorted_out_rows}, {&weights, &sorted_weights}}));
  if (counts_on_device_) {
    // Every expert is here: count on the device, no host round trip.
    absl::MutexLock lock(&device_counts_mu_);
    DXS_RETURN_IF_ERROR(backend_->AccumulateCounts(offsets, &device_counts_));
  } else {
    DXS_RETURN_IF_ERROR(CountOnHost(layer, offsets));
  }
  Tensor y = ws.y.Rows(0, num_pairs);
  DXS_RETURN_IF_ERROR(
      backend_->GroupedSwiGlu(x, &sorted_rows, offsets, gate_up_[layer], down_[layer], &y));
  // The weighted pre-sum over each token's pairs, in float32, rounded once into out (rows
  // on a bf16 wire are bf16).
  return backend_->ScaleSumRows(y, sorted_weights, sorted_out_rows, out);
}

absl::Status ExpertShard::ForwardCountedPairs(int layer, const CountedPairs& pairs, Tensor* y) {
  if (layer < 0 || static_cast<size_t>(layer) >= gate_up_.size()) {
    return absl::InvalidArgumentError(absl::StrCat("expert layer ", layer, " does not exist"));
  }
  const int64_t entries = pairs.rows.num_elements();
  const int num_experts = static_cast<int>(config_.num_experts);
  // A rank that holds none of this layer's experts is sent no row (the attention ranks
  // route by the same placement); its answers are zeros.
  const std::vector<const Tensor*>& held = gate_up_[layer];
  if (std::all_of(held.begin(), held.end(), [](const Tensor* w) { return w == nullptr; })) {
    return backend_->Fill(y, 0.f);
  }
  const bool own_scratch = backend_->InGraphCapture();
  Workspace local;
  Workspace& ws = own_scratch ? local : ll_ws_;
  if (!ws.order.defined() || ws.order.rows() != entries) {
    DXS_ASSIGN_OR_RETURN(ws.order, backend_->Allocate({entries}, DType::kI32));
    DXS_ASSIGN_OR_RETURN(ws.sorted_rows, backend_->Allocate({entries}, DType::kI32));
    DXS_ASSIGN_OR_RETURN(ws.sorted_out_rows, backend_->Allocate({entries}, DType::kI32));
    DXS_ASSIGN_OR_RETURN(ws.sorted_weights, backend_->Allocate({entries}, DType::kF32));
    DXS_ASSIGN_OR_RETURN(ws.y, backend_->Allocate({entries, config_.hidden_size}));
    DXS_ASSIGN_OR_RETURN(ws.offsets, backend_->Allocate({num_experts + 2}, DType::kI32));
  }
  DXS_RETURN_IF_ERROR(backend_->SortPairsByExpert(pairs.experts, num_experts + 1, &ws.order,
                                                  &ws.offsets,
                                                  {{&pairs.rows, &ws.sorted_rows},
                                                   {&pairs.out_rows, &ws.sorted_out_rows},
                                                   {&pairs.weights, &ws.sorted_weights}}));
  const Tensor offsets = ws.offsets.Rows(0, num_experts + 1);  // the real pairs' runs
  {
    absl::MutexLock lock(&device_counts_mu_);
    if (!counts_on_device_ && !ll_counts_.defined()) {
      DXS_ASSIGN_OR_RETURN(ll_counts_, backend_->Zeros({num_experts}, DType::kI64));
    }
    DXS_RETURN_IF_ERROR(
        backend_->AccumulateCounts(offsets, counts_on_device_ ? &device_counts_ : &ll_counts_));
  }
  // Only the device knows how many of the capacity's entries are pairs: the backend takes
  // the count from the offsets.
  DXS_RETURN_IF_ERROR(backend_->GroupedSwiGluCounted(pairs.x, ws.sorted_rows, offsets,
                                                     gate_up_[layer], down_[layer], &ws.y));
  // The sums of the slots only: the no-pair entries' out row (the spare last row) lies
  // outside, so the sum skips them (the device ops skip rows outside their destination).
  // Summed into the spare row they would be one row's serial sum over every empty entry of
  // the capacity (452 us a layer at capacity 128: gpu_bench --low-latency, H200, 2026-12-03).
  Tensor slots = y->Rows(0, y->rows() - 1);
  return backend_->ScaleSumRows(ws.y, ws.sorted_weights, ws.sorted_out_rows, &slots);
}

absl::Status ExpertShard::CountOnHost(int layer, const Tensor& offsets) {
  const int num_experts = static_cast<int>(config_.num_experts);
  // Experts' per-layer counts: E + 1 offsets to the host, for the load metrics and to name
  // a routed expert this shard does not hold.
  std::vector<int32_t>& bounds = ws_.bounds;
  bounds.resize(static_cast<size_t>(num_experts) + 1);
  DXS_RETURN_IF_ERROR(backend_->CopyToHost(offsets, DType::kI32, bounds.data()));
  for (int e = 0; e < num_experts; ++e) {
    const int32_t n = bounds[e + 1] - bounds[e];
    if (n > 0 && gate_up_[layer][e] == nullptr) {
      return absl::FailedPreconditionError(
          absl::StrCat("expert ", e, " of layer ", layer, " is not held by this shard"));
    }
  }
  for (int e = 0; e < num_experts; ++e) tokens_per_expert_[e] += bounds[e + 1] - bounds[e];
  return absl::OkStatus();
}

}  // namespace dxs
