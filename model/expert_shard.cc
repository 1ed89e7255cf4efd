#include "model/expert_shard.h"

#include <algorithm>
#include <numeric>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"

namespace dxs {

ExpertShard::ExpertShard(const ModelConfig& config, ExpertWeightMap weights, Backend* backend)
    : config_(config),
      weights_(std::move(weights)),
      backend_(backend),
      tokens_per_expert_(new std::atomic<int64_t>[std::max<int64_t>(config.num_experts, 0)]()) {}

std::vector<int64_t> ExpertShard::tokens_per_expert_snapshot() const {
  std::vector<int64_t> out(std::max<int64_t>(config_.num_experts, 0));
  for (size_t e = 0; e < out.size(); ++e) out[e] = tokens_per_expert_[e].load();
  return out;
}

bool ExpertShard::Holds(int layer, int expert) const { return weights_.count({layer, expert}) > 0; }

absl::Status ExpertShard::Forward(int layer, const Tensor& x, const RoutedPairs& pairs,
                                  Tensor* out) {
  if ((x.dtype() != DType::kF32 || out->dtype() != DType::kF32) &&
      backend_->device() != Device::kCpu) {
    return absl::FailedPreconditionError(
        absl::StrCat("the ", backend_->name(), " backend's experts take float32 rows only"));
  }
  if (out->dtype() != DType::kF32) {
    // Rows on a narrower wire (bf16): sum in float32, round once at the end.
    if (!accumulator_.defined() || accumulator_.num_elements() < out->num_elements()) {
      accumulator_ = backend_->Allocate({std::max<int64_t>(out->rows(), 1), out->row_size()});
    }
    Tensor sum = accumulator_.Rows(0, out->rows());
    DXS_RETURN_IF_ERROR(Forward(layer, x, pairs, &sum));
    NarrowFromFloat32(out->dtype(), sum.f32(), static_cast<size_t>(out->num_elements()),
                      out->raw());
    return absl::OkStatus();
  }
  backend_->Fill(out, 0.f);
  if (pairs.size() == 0) return absl::OkStatus();  // empty batch: no kernels
  // Stable order: by expert, then by position in `pairs`.
  std::vector<size_t> order(pairs.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(),
                   [&](size_t a, size_t b) { return pairs.experts[a] < pairs.experts[b]; });
  const int64_t hidden = config_.hidden_size, inter = config_.moe_intermediate_size;
  for (size_t begin = 0; begin < order.size();) {
    const int32_t expert = pairs.experts[order[begin]];
    size_t end = begin;
    while (end < order.size() && pairs.experts[order[end]] == expert) ++end;
    auto it = weights_.find({layer, expert});
    if (it == weights_.end()) {
      return absl::FailedPreconditionError(
          absl::StrCat("expert ", expert, " of layer ", layer, " is not held by this shard"));
    }
    const int64_t n = static_cast<int64_t>(end - begin);
    std::vector<int32_t> src_rows(n), dst_rows(n);
    std::vector<float> scales(n);
    for (int64_t i = 0; i < n; ++i) {
      const size_t p = order[begin + i];
      const int32_t out_row = pairs.out_row(p);
      if (pairs.rows[p] < 0 || pairs.rows[p] >= x.rows() || out_row < 0 || out_row >= out->rows()) {
        return absl::InvalidArgumentError(absl::StrCat("routed row ", pairs.rows[p], " -> ",
                                                       out_row, " outside [0, ", x.rows(),
                                                       ") -> [0, ", out->rows(), ")"));
      }
      src_rows[i] = pairs.rows[p];
      dst_rows[i] = out_row;
      scales[i] = pairs.weights[p];
    }
    const ExpertWeights& w = it->second;
    Tensor xs = backend_->Allocate({n, hidden});
    backend_->GatherRows(x, src_rows, &xs);
    Tensor gate = backend_->Allocate({n, inter});
    Tensor up = backend_->Allocate({n, inter});
    backend_->Linear(xs, w.gate_proj, nullptr, &gate);
    backend_->Linear(xs, w.up_proj, nullptr, &up);
    backend_->SiluMul(gate, up, &gate);
    Tensor y = backend_->Allocate({n, hidden});
    backend_->Linear(gate, w.down_proj, nullptr, &y);
    backend_->ScaleAddRows(y, scales, dst_rows, out);
    tokens_per_expert_[expert] += n;
    begin = end;
  }
  return absl::OkStatus();
}

}  // namespace dxs
