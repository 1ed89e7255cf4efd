// Backend: the compute interface the model, the dispatch/combine engine and the expert
// workers are written against, in three parts by what they are for:
//   DeviceRuntime (kernels/device_runtime.h): memory, the ordered queue, events, graphs,
//     memory shared with other processes, what the backend is (capabilities());
//   DenseCompute (kernels/dense_compute.h): the attention layer's ops, paged attention,
//     sampling;
//   MoeCompute (kernels/moe_compute.h): routing, the dispatch layout, the grouped expert FFN
//     and the combine's weighted sum.
// A backend implements all three (the CPU's, CUDA's, and the opaque test backend, which
// proves that nothing outside kernels/ reads tensor memory); code takes the Backend.
//
// A backend owns memory (from its caching allocator) and implements every operation on
// tensor data. Code outside a backend never dereferences a tensor's memory; it moves bytes
// in and out with CopyFromHost/CopyToHost only. All tensors are row-major.
//
// Dtypes: weights are kept in WeightDType(stored dtype); activations are computed in
// ActivationDType(). Ops that move rows (GatherRows, Copy, CopyFromHost/ToHost) convert
// between floating dtypes; index tensors are i32 (i64 for cache slots).
//
// Thread safety: a Backend may be shared by threads that operate on distinct tensors; its
// queue order is the order of calls as they reach it.
#pragma once

#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "kernels/dense_compute.h"
#include "kernels/device_runtime.h"
#include "kernels/moe_compute.h"
#include "kernels/tensor.h"

namespace dxs {

class Backend : public DeviceRuntime, public DenseCompute, public MoeCompute {
 public:
  ~Backend() override = default;

  // Defaults of MoeCompute's ops built on the other ops and the runtime; a backend with a
  // fused form overrides them.
  // Reads the count (expert_offsets[E]) to the host, then GroupedSwiGlu over those rows.
  absl::Status GroupedSwiGluCounted(const Tensor& xs, const Tensor& rows,
                                    const Tensor& expert_offsets,
                                    const std::vector<const Tensor*>& gate_up,
                                    const std::vector<const Tensor*>& down, Tensor* y) override;
  // Fill, ScaleAddRows into float32, then Copy into out's dtype.
  absl::Status ScaleSumRows(const Tensor& src, const Tensor& scales, const Tensor& rows,
                            Tensor* out) override;
  // UNIMPLEMENTED: no FP8 rows on this backend (capabilities().fp8_dispatch_rows is false).
  absl::Status QuantizeRowsFp8(const Tensor& src, const Tensor& rows, Tensor* records) override;
  absl::Status DequantizeRowsFp8(const Tensor& records, Tensor* dst) override;
  // An MoE layer's router after its attention: AddRmsNorm(x, norm_weight, eps, residual,
  // normed), then Linear(normed, router) into float32 logits [T, E] and TopKSoftmax(logits,
  // top_k, normalize, ids, weights), which is this default. A backend may do the three in
  // fewer passes (the CUDA backend: one kernel for decode-sized batches, the same bits).
  virtual absl::Status AddRmsNormRoute(const Tensor& x, const Tensor& norm_weight, float eps,
                                       Tensor* residual, Tensor* normed, const Tensor& router,
                                       int top_k, bool normalize, Tensor* ids, Tensor* weights);
  // FAILED_PRECONDITION: no fused path (TakesRoutedSwiGlu is false).
  absl::Status RoutedSwiGlu(const Tensor& x, const Tensor& ids, const Tensor& weights,
                            const std::vector<const Tensor*>& gate_up,
                            const std::vector<const Tensor*>& down, Tensor* counts,
                            Tensor* out) override;
};

// The CPU backend: float32, OpenBLAS for GEMM, threads sized to the machine.
std::unique_ptr<Backend> MakeCpuBackend();

}  // namespace dxs
