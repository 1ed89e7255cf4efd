// ExpertShard: the experts one process holds (all of them in the single-process engine, a
// placement's subset on an expert worker) and the SwiGLU FFN over rows routed to them.
//
// Forward pre-sums, per row, the weighted outputs of this shard's experts: the shard's part
// of the single reduction stage. It runs as backend ops, one call each per layer: a stable
// sort of the pairs by expert (permuting their rows, output rows and weights in the same pass), the
// grouped SwiGLU over the rows sorted by expert, and the weighted scatter-add. Pairs are applied
// grouped by ascending expert id, and in their given order within an expert, so the summation order
// is fixed.
//
// Thread safety: one thread at a time calls the Forward methods (they reuse a workspace);
// Holds and tokens_per_expert_snapshot may be called from any thread (on a device backend,
// the snapshot waits for the backend's queued work).
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "common/model_config.h"
#include "kernels/backend.h"
#include "model/weights.h"

namespace dxs {

class ExpertShard final {
 public:
  ExpertShard(const ModelConfig& config, ExpertWeightMap weights, Backend* backend);

  bool Holds(int layer, int expert) const;
  // EPLB live rebalancing: makes `more` resident beside what is held (a key already
  // held keeps its weights), or frees every expert outside `keep`. Call them from the
  // thread that calls the Forward methods, between calls (they change the tables Forward
  // reads).
  void AddExperts(ExpertWeightMap more);
  void KeepOnly(const std::vector<int>& keep);
  Backend* backend() const { return backend_; }
  // The same for the router's output on the backend: row t's pairs are ids/weights[t, :]
  // (every expert local, out row == x row), as the single-process engine routes.
  absl::Status ForwardRouted(int layer, const Tensor& x, const Tensor& ids, const Tensor& weights,
                             Tensor* out);
  // The core, on backend tensors: pair p takes x row rows[p] through expert experts[p] and
  // adds weights[p] times the result to out row out_rows[p] (i32, i32, f32, i32 [P]). out
  // is overwritten (rows with no pair become zero); x and out are float32, or on the CPU
  // backend in the bf16 wire dtype (widened as rows are gathered, the sums rounded once).
  absl::Status ForwardPairs(int layer, const Tensor& x, const Tensor& rows, const Tensor& experts,
                            const Tensor& weights, const Tensor& out_rows, Tensor* out);

  // The experts of a low-latency round (the pairs a low-latency round receives, sized by the
  // exchange's capacity, no count on the host): the pairs sorted by expert with the entries
  // that are no pair last, the grouped SwiGLU over the real ones (the first E + 1 offsets),
  // the weighted pre-sum into the first `slots` rows of y[slots + 1, hidden] (bf16; the
  // no-pair entries' out row, the last, is outside the sum and left alone). The per-expert
  // counts stay on the device. Nothing synchronises with the host.
  absl::Status ForwardCountedPairs(int layer, const CountedPairs& pairs, Tensor* y);

  // Rows processed per expert since construction (layer-aggregated), for metrics. Safe to
  // call from any thread.
  std::vector<int64_t> tokens_per_expert_snapshot() const;

 private:
  // The per-layer counts on the host (and the check that every routed expert is held).
  absl::Status CountOnHost(int layer, const Tensor& offsets);

  ModelConfig config_;
  ExpertWeightMap weights_;
  Backend* backend_;
  // Per layer, per expert id: the weights, or null where not held (GroupedSwiGlu's table).
  std::vector<std::vector<const Tensor*>> gate_up_, down_;
  std::unique_ptr<std::atomic<int64_t>[]> tokens_per_expert_;
  void RebuildTables();
  // Where the shard holds every expert of every layer on a device backend, nothing can be
  // routed to a missing expert, so the per-layer counts stay on the device (i64 [E],
  // AccumulateCounts) instead of coming to the host each layer: no synchronisation inside
  // a decode step. Read (and synchronised) only by tokens_per_expert_snapshot.
  bool counts_on_device_ = false;
  mutable absl::Mutex device_counts_mu_;
  Tensor device_counts_;
  // ForwardPairs' workspace, reused (one caller thread), and ForwardRouted's pair rows.
  struct Workspace {
    Tensor order, offsets, sorted_rows, sorted_out_rows, sorted_weights, y;
    std::vector<int32_t> bounds;
  };
  Workspace ws_;
  // ForwardCountedPairs's: the same, with E + 2 offsets (the no-pair entries' run last), and
  // its per-expert counts where the shard does not hold every expert (device_counts_ then).
  Workspace ll_ws_;
  Tensor ll_counts_ ABSL_GUARDED_BY(device_counts_mu_);
  Tensor routed_rows_;
  std::vector<Tensor> retired_routed_rows_;  // smaller tables a captured graph may still read
  int64_t routed_rows_top_k_ = 0;
};

}  // namespace dxs
