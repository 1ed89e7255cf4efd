// CpuBackend: float32 compute on the host, OpenBLAS for every matrix product (a GEMV a row:
// CpuRowsTimesWeight).
//
// Weights of any stored dtype are widened to float32 on upload; activations are float32,
// and rows in a narrower wire dtype (bf16) are converted by the ops that move them
// (GatherRows, Copy, CombineRows). The queue is immediate: every op has finished when it
// returns, so events are always complete.
//
// The class is visible so that a test backend (kernels/opaque_backend.h) can run these
// very ops on memory it maps itself.
//
// Thread safety: ops on distinct tensors may run from several threads.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "kernels/backend.h"
#include "kernels/caching_allocator.h"
#include "kernels/op_checks.h"

namespace dxs {

// y[i] = w x[i] for each of x's m rows (w row-major [n, k], x [m, k], y [m, n], float32), one
// OpenBLAS GEMV a row. Not one GEMM over the rows: a row's bits must not depend on the batch
// it is in (a request's n samples equal the requests alone; overlap scheduling's batches equal
// the plain ones), and OpenBLAS picks its GEMM kernels by shape, so a batch's GEMM may sum a
// row in another order than a one-row call. On an AVX-512 Xeon (OpenBLAS 0.3.21, Cooperlake
// kernels) engine_test's NSamplesEqualSingleRequestsWithDerivedSeeds failed that way in every
// ctest run. The CPU test suite took 342 s with GEMVs against 338 s with the GEMM.
void CpuRowsTimesWeight(const float* x, int64_t m, const float* w, int64_t n, int64_t k, float* y);

class CpuBackend : public Backend {
 public:
  CpuBackend();
  using Backend::Allocate;

  std::string name() const override { return "cpu"; }
  Device device() const override { return Device::kCpu; }
  DType WeightDType(DType stored) const override { return DType::kF32; }
  DType ActivationDType() const override { return DType::kF32; }
  // Host memory, which the transport maps for peers; float32 rows, narrower ones widened.
  BackendCapabilities capabilities() const override {
    return {.device_memory = false,
            .maps_regions = true,
            .narrow_expert_rows = true,
            .fp8_dispatch_rows = true};
  }

  absl::StatusOr<Tensor> Allocate(std::vector<int64_t> shape, DType dtype) override;
  absl::Status CopyFromHost(const void* src, DType src_dtype, Tensor* dst) override;
  absl::Status CopyToHost(const Tensor& src, DType dst_dtype, void* dst) override;
  absl::Status Copy(const Tensor& src, Tensor* dst) override;
  absl::Status Fill(Tensor* t, float value) override;
  absl::Status FillUniform(Tensor* t, uint64_t seed, double mean, double half_width,
                           DType values_dtype) override;

  absl::StatusOr<std::unique_ptr<Event>> CreateEvent() override;
  absl::Status RecordEvent(Event* event) override;
  absl::Status WaitEvent(Event* event) override;
  absl::Status SynchronizeEvent(Event* event) override;
  absl::Status Synchronize() override { return absl::OkStatus(); }

  absl::Status Linear(const Tensor& x, const Tensor& w, const Tensor* bias, Tensor* y) override;
  absl::Status RmsNorm(const Tensor& x, const Tensor& weight, float eps, Tensor* y) override;
  absl::Status Embedding(const Tensor& table, const Tensor& ids, Tensor* y) override;
  absl::Status Rope(Tensor* x, const Tensor& positions, double theta) override;
  absl::Status SiluMul(const Tensor& gate, const Tensor& up, Tensor* out) override;
  absl::Status Add(const Tensor& x, Tensor* inout) override;
  absl::Status AddRmsNorm(const Tensor& x, const Tensor& weight, float eps, Tensor* residual,
                          Tensor* y) override;
  absl::Status QkNormRope(Tensor* q, Tensor* k, const Tensor& q_weight, const Tensor& k_weight,
                          float eps, const Tensor& positions, double theta) override;
  absl::Status GatherRows(const Tensor& src, const Tensor& rows, Tensor* dst) override;

  absl::Status WriteKvCache(const Tensor& k, const Tensor& v, const PagedAttentionMeta& meta,
                            Tensor* k_cache, Tensor* v_cache) override;
  absl::Status PagedAttention(const Tensor& q, const Tensor& k_cache, const Tensor& v_cache,
                              const PagedAttentionMeta& meta, float scale, Tensor* out) override;

  absl::Status TopKSoftmax(const Tensor& logits, int top_k, bool normalize, Tensor* ids,
                           Tensor* weights) override;
  absl::Status ComputeDispatchLayout(const Tensor& ids, const Tensor& weights,
                                     const Tensor& expert_owner, int num_ranks,
                                     DispatchLayoutTensors* layout) override;
  absl::Status CombineRows(const Tensor& recv, const Tensor& token_rows,
                           const std::vector<int64_t>& rank_offsets, Tensor* out) override;
  absl::Status SortPairsByExpert(const Tensor& experts, int num_experts, Tensor* order,
                                 Tensor* expert_offsets,
                                 const std::vector<PairPayload>& payloads) override;
  absl::Status GroupedSwiGlu(const Tensor& xs, const Tensor* rows, const Tensor& expert_offsets,
                             const std::vector<const Tensor*>& gate_up,
                             const std::vector<const Tensor*>& down, Tensor* y) override;
  absl::Status ScaleAddRows(const Tensor& src, const Tensor& scales, const Tensor& rows,
                            Tensor* dst) override;
  absl::Status AccumulateCounts(const Tensor& offsets, Tensor* counts) override;
  absl::Status QuantizeRowsFp8(const Tensor& src, const Tensor& rows, Tensor* records) override;
  absl::Status DequantizeRowsFp8(const Tensor& records, Tensor* dst) override;
  absl::Status UnpackRoutedPairs(const Tensor& blocks, const std::vector<PairSegment>& segments,
                                 const Tensor& held, Tensor* rows, Tensor* experts, Tensor* weights,
                                 Tensor* bad) override;
  absl::Status ArgmaxRows(const Tensor& logits, Tensor* ids) override;
  absl::Status SampleRows(const Tensor& logits, const Tensor& params, const Tensor* adjustments,
                          Tensor* ids) override;
  absl::Status CountPendingTokens(const Tensor& tokens, const Tensor& params,
                                  Tensor* adjustments) override;
  absl::Status LogprobRows(const Tensor& logits, const Tensor& sampled, const Tensor& named,
                           Tensor* sampled_logprobs, Tensor* named_logprobs, Tensor* top_ids,
                           Tensor* top_logprobs) override;

  CachingAllocator::Stats allocator_stats() const { return allocator_->stats(); }

 protected:
  // Where this backend's memory comes from; the opaque test backend replaces it.
  explicit CpuBackend(std::shared_ptr<CachingAllocator> allocator);

 private:
  std::shared_ptr<CachingAllocator> allocator_;
};

}  // namespace dxs
