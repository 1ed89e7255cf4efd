// ExpertShard: the experts one process holds (all of them in the single-process engine, a
// placement's subset on an expert worker) and the SwiGLU FFN over rows routed to them.
//
// Forward pre-sums, per row, the weighted outputs of this shard's experts: the shard's part
// of the single reduction stage. It runs as backend ops, one call each per layer: a stable
// sort of the pairs by expert, the gather of their rows, the grouped SwiGLU over the rows
// sorted by expert, and the weighted scatter-add. Pairs are applied grouped by ascending
// expert id, and in their given order within an expert, so the summation order is fixed.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "common/model_config.h"
#include "kernels/backend.h"
#include "model/weights.h"

namespace dxs {

// Routed (row, expert, weight) triples, one per selected expert of a row.
struct RoutedPairs {
  std::vector<int32_t> rows;  // rows of x
  std::vector<int32_t> experts;
  std::vector<float> weights;
  // Rows of out, when they differ from `rows` (an expert worker reads rows from sparse
  // receive slots and writes a dense output); empty: out row == x row.
  std::vector<int32_t> out_rows;
  size_t size() const { return rows.size(); }
  int32_t out_row(size_t p) const { return out_rows.empty() ? rows[p] : out_rows[p]; }
  void Add(int32_t row, int32_t expert, float weight) {
    rows.push_back(row);
    experts.push_back(expert);
    weights.push_back(weight);
  }
};

// What an expert worker's data path needs from the experts it holds. ExpertShard is the
// real one; benchmarks substitute a cheap one to time the exchange alone.
class ExpertCompute {
 public:
  virtual ~ExpertCompute() = default;
  virtual bool Holds(int layer, int expert) const = 0;
  virtual Backend* backend() const = 0;
  // out[o] = sum over pairs p with out_row(p) == o of weights[p] * FFN_{experts[p]}(x[rows[p]]).
  // out is overwritten; its rows with no pair become zero. x may have zero rows; out may
  // have fewer rows than x (with out_rows). x and out
  // are float32, or (host tensors, CPU backend) in the bf16 wire dtype: the rows as they
  // arrived and the answer as it goes back, converted by the compute that reads and
  // writes them.
  virtual absl::Status Forward(int layer, const Tensor& x, const RoutedPairs& pairs,
                               Tensor* out) = 0;
};

class ExpertShard final : public ExpertCompute {
 public:
  ExpertShard(const ModelConfig& config, ExpertWeightMap weights, Backend* backend);

  bool Holds(int layer, int expert) const override;
  Backend* backend() const override { return backend_; }
  absl::Status Forward(int layer, const Tensor& x, const RoutedPairs& pairs, Tensor* out) override;
  // The same for the router's output on the backend: row t's pairs are ids/weights[t, :]
  // (every expert local, out row == x row), as the single-process engine routes.
  absl::Status ForwardRouted(int layer, const Tensor& x, const Tensor& ids, const Tensor& weights,
                             Tensor* out);
  // The core, on backend tensors: pair p takes x row rows[p] through expert experts[p] and
  // adds weights[p] times the result to out row out_rows[p] (i32, i32, f32, i32 [P]).
  absl::Status ForwardPairs(int layer, const Tensor& x, const Tensor& rows, const Tensor& experts,
                            const Tensor& weights, const Tensor& out_rows, Tensor* out);

  // Rows processed per expert since construction (layer-aggregated), for metrics. Safe to
  // call from any thread.
  std::vector<int64_t> tokens_per_expert_snapshot() const;

 private:
  ModelConfig config_;
  ExpertWeightMap weights_;
  Backend* backend_;
  // Per layer, per expert id: the weights, or null where not held (GroupedSwiGlu's table).
  std::vector<std::vector<const Tensor*>> gate_, up_, down_;
  std::unique_ptr<std::atomic<int64_t>[]> tokens_per_expert_;
  Tensor accumulator_;  // float32 sums for a narrower `out`, reused
};

}  // namespace dxs
