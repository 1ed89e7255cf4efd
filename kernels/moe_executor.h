// MoeExecutor: how the attention side gets the MoE output of one layer.
//
// The single-process engine runs the experts locally (model/local_moe_executor.h); an
// attention worker dispatches rows to expert workers and combines their pre-summed
// results (dataplane/dispatch/dispatch_combine.h). The interface sits beside the Backend so
// that the dispatch engine does not depend on the model. Either
// way `out[t] = sum_k weights[t, k] * expert_{ids[t, k]}(x[t])` and that sum is the one
// reduction: nothing reduces the output again.
//
// Every DP rank calls Run once per MoE layer per step, with zero tokens when it has none:
// that keeps the ranks in lockstep with the expert workers.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kernels/moe_compute.h"
#include "kernels/tensor.h"

namespace dxs {

// What Dispatch hands to Combine (DeepEP's handle): everything the combine needs, so that
// nothing is recomputed and the executor keeps no per-micro-batch state. Destroying a
// handle that was never combined (a failed step) abandons its exchange: nothing writes
// into the caller's memory afterwards.
class MoeHandle {
 public:
  virtual ~MoeHandle() = default;
  int layer = -1;
  int micro = 0;
};

class MoeExecutor {
 public:
  // Micro-batches a step may be split into (two-batch overlap).
  static constexpr int kMaxMicroBatches = 2;

  virtual ~MoeExecutor() = default;
  // x[T, hidden]; ids (i32) / weights (f32) [T, top_k] from the router, on the backend;
  // out[T, hidden] is overwritten.
  virtual absl::Status Run(int layer, const Tensor& x, const Tensor& ids, const Tensor& weights,
                           Tensor* out) = 0;

  // The two-phase form, for two-batch overlap: the model dispatches one micro-batch's
  // rows and computes the other micro-batch's attention while the experts work, then
  // combines. Dispatch(layer, micro, ...) starts the MoE of micro-batch `micro` (0 or 1)
  // of a step split into `num_micro` micro-batches and returns its handle; Combine(handle)
  // finishes it, with `out` (given to Dispatch, kept alive by the caller until Combine)
  // overwritten as Run would. Every DP rank splits every step the same way, empty
  // micro-batches included, so the expert workers see each (layer, micro) once from every
  // rank.
  //
  // True if Dispatch returns before the experts finish (remote experts); the default
  // runs everything in Dispatch, so splitting a step only costs time.
  virtual bool overlaps() const { return false; }
  virtual absl::StatusOr<std::unique_ptr<MoeHandle>> Dispatch(int layer, int micro, int num_micro,
                                                              const Tensor& x, const Tensor& ids,
                                                              const Tensor& weights, Tensor* out) {
    auto handle = std::make_unique<DoneHandle>();
    handle->layer = layer;
    handle->micro = micro;
    handle->status = Run(layer, x, ids, weights, out);
    return std::unique_ptr<MoeHandle>(std::move(handle));
  }
  virtual absl::Status Combine(std::unique_ptr<MoeHandle> handle, Tensor* out) {
    auto* done = dynamic_cast<DoneHandle*>(handle.get());
    if (done == nullptr) return absl::InvalidArgumentError("combine: not this executor's handle");
    return done->status;
  }

  // Where micro-batch `micro` may build its MoE input x and take its output out, both
  // [rows, hidden] of `dtype`, so that the exchange moves none of their rows itself (DeepEP's
  // zero-copy buffers). True, with *x and *out set, when the executor has such a place:
  // RemoteMoeExecutor's one-copy exchange region, where the EP ranks read x and store
  // their answers into out in place. False, touching nothing, when it has none; the caller
  // then allocates them as usual. Handing Dispatch other tensors stays correct.
  // Every call for `micro` hands out the same memory while it fits: the caller finishes
  // with a layer's out before it writes the next layer's x, as the model's residual add
  // does. The tensors stay valid memory while held, even after a later call moves the
  // place elsewhere.
  virtual bool StageBuffers(int micro, int64_t rows, DType dtype, Tensor* x, Tensor* out) {
    return false;
  }

 private:
  // The default Dispatch ran everything: the outcome is all Combine has to report.
  struct DoneHandle final : MoeHandle {
    absl::Status status;
  };
};

}  // namespace dxs
