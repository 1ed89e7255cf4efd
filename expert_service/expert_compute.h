// ExpertCompute: what an expert worker's data path (ExpertStepServer) needs from the
// experts it holds. ShardCompute runs a model ExpertShard; benchmarks substitute a cheap
// one to time the exchange alone. Everything it is handed lives on its backend.
#pragma once

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/status_macros.h"
#include "dataplane/dispatch/routed_pairs.h"
#include "kernels/backend.h"
#include "model/expert_shard.h"

namespace dxs {

// One round's routed pairs where the compute's backend keeps them (device memory on a GPU;
// Backend::UnpackRoutedPairs made them from the wire): [P] rows of x, experts and weights.
// Each pair's output row is its row of x.
struct RoutedPairTensors {
  Tensor rows;     // i32
  Tensor experts;  // i32
  Tensor weights;  // f32
  int64_t size() const { return rows.defined() ? rows.num_elements() : 0; }
};

class ExpertCompute {
 public:
  virtual ~ExpertCompute() = default;
  virtual bool Holds(int layer, int expert) const = 0;
  virtual Backend* backend() const = 0;
  // out[r] = sum over pairs p with rows[p] == r of weights[p] * FFN_{experts[p]}(x[r]).
  // out is overwritten; its rows with no pair become zero. x may have zero rows. x, out and
  // the pairs are backend tensors (the pairs checked: rows in range, experts held); x and
  // out in the wire dtype: the rows as they arrived and the answer as it goes back,
  // converted by the compute that reads and writes them.
  virtual absl::Status Forward(int layer, const Tensor& x, const RoutedPairTensors& pairs,
                               Tensor* out) = 0;
  // Rows computed per expert so far, all layers ([E], cumulative; dxs_expert_tokens_total);
  // empty where the compute does not count.
  virtual std::vector<int64_t> TokensPerExpert() const { return {}; }
};

// Host pairs (tests and benchmarks build them so) as a compute takes them, on `backend`.
// Their out rows are their rows.
inline absl::StatusOr<RoutedPairTensors> UploadRoutedPairs(const RoutedPairs& pairs,
                                                           Backend* backend) {
  if (!pairs.out_rows.empty() && pairs.out_rows != pairs.rows) {
    return absl::InvalidArgumentError("routed pairs: out rows that differ from rows");
  }
  const int64_t n = static_cast<int64_t>(pairs.size());
  RoutedPairTensors t;
  DXS_ASSIGN_OR_RETURN(t.rows, backend->Allocate({n}, DType::kI32));
  DXS_ASSIGN_OR_RETURN(t.experts, backend->Allocate({n}, DType::kI32));
  DXS_ASSIGN_OR_RETURN(t.weights, backend->Allocate({n}, DType::kF32));
  DXS_RETURN_IF_ERROR(backend->CopyFromHost(pairs.rows.data(), DType::kI32, &t.rows));
  DXS_RETURN_IF_ERROR(backend->CopyFromHost(pairs.experts.data(), DType::kI32, &t.experts));
  DXS_RETURN_IF_ERROR(backend->CopyFromHost(pairs.weights.data(), DType::kF32, &t.weights));
  return t;
}

// A model ExpertShard's grouped expert FFN.
class ShardCompute final : public ExpertCompute {
 public:
  explicit ShardCompute(ExpertShard* shard) : shard_(shard) {}
  bool Holds(int layer, int expert) const override { return shard_->Holds(layer, expert); }
  Backend* backend() const override { return shard_->backend(); }
  absl::Status Forward(int layer, const Tensor& x, const RoutedPairTensors& pairs,
                       Tensor* out) override {
    return shard_->ForwardPairs(layer, x, pairs.rows, pairs.experts, pairs.weights, pairs.rows,
                                out);
  }
  std::vector<int64_t> TokensPerExpert() const override {
    return shard_->tokens_per_expert_snapshot();
  }

 private:
  ExpertShard* shard_;
};

}  // namespace dxs
