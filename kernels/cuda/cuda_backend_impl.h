// CudaBackend's class, shared by its two translation units: cuda_backend.cc (memory, the
// queue, dense ops and attention) and cuda_moe_backend.cc (routing, the exchange ops and
// the grouped expert FFN). Users go through MakeCudaBackend (kernels/cuda/cuda_backend.h).
#pragma once

#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include <array>
#include <atomic>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "kernels/backend.h"
#include "kernels/caching_allocator.h"
#include "kernels/cuda/aligned.h"
#include "kernels/cuda/cublas_loader.h"
#include "kernels/cuda/ops.cuh"

namespace dxs::cuda {
struct FlashInferAttention;  // kernels/cuda/flashinfer_attention.cuh
struct FlashInferGraphPlan;
}  // namespace dxs::cuda

namespace dxs {

// INTERNAL naming the op and CUDA's error, or OK for cudaSuccess.
absl::Status CudaStatus(cudaError_t error, const char* op);
absl::Status CublasStatus(const CublasApi& blas, cublasStatus_t status, const char* op);
cuda::ElemType ToElemType(DType dtype);

class CudaBackend final : public Backend {
 public:
  // Use MakeCudaBackend; `Init` does the fallible part.
  explicit CudaBackend(int device_ordinal);
  ~CudaBackend() override;
  absl::Status Init();
  using Backend::Allocate;

  std::string name() const override { return "cuda"; }
  Device device() const override { return Device::kCuda; }
  // bf16 for every floating weight: GEMM operands must share a dtype with the activations.
  DType WeightDType(DType stored) const override {
    return IsFloatDType(stored) ? DType::kBF16 : stored;
  }
  DType ActivationDType() const override { return DType::kBF16; }
  // Device memory; a peer process maps blocks of it through CUDA IPC (AllocateShared).
  BackendCapabilities capabilities() const override {
    return {.device_memory = true,
            .maps_regions = true,
            .narrow_expert_rows = true,
            .fp8_dispatch_rows = true,
            .fp8_block_weights = fp8_weights_,
            .fp8_expert_weights = fp8_weights_ && fp8_grouped_gemm_,
            .low_latency_exchange = true};
  }

  absl::StatusOr<Tensor> Allocate(std::vector<int64_t> shape, DType dtype) override;
  absl::Status CopyFromHost(const void* src, DType src_dtype, Tensor* dst) override;
  absl::Status CopyToHost(const Tensor& src, DType dst_dtype, void* dst) override;
  absl::Status Copy(const Tensor& src, Tensor* dst) override;
  absl::Status Fill(Tensor* t, float value) override;
  absl::Status FillUniform(Tensor* t, uint64_t seed, double mean, double half_width,
                           DType values_dtype) override;

  absl::StatusOr<std::shared_ptr<Buffer>> AllocateStaging(size_t bytes) override;
  absl::Status CopyFromStaging(const Buffer& staging, size_t offset, Tensor* dst) override;
  absl::Status CopyToStaging(const Tensor& src, const Buffer& staging, size_t offset) override;
  absl::StatusOr<SharedMemory> AllocateShared(size_t bytes) override;
  absl::StatusOr<std::shared_ptr<Buffer>> OpenShared(std::string_view key) override;
  // The per-expert cuBLAS FFN reads expert offsets on the host: no graphs with it.
  bool SupportsGraphs() const override { return use_cutlass_; }
  absl::StatusOr<CapturedGraph> CaptureGraph(const std::function<absl::StatusOr<Tensor>()>& body,
                                             Tensor* eager_output) override;
  bool InGraphCapture() const override { return graph_mode_.load(); }
  absl::Status Replay(Graph* graph) override;

  absl::StatusOr<std::unique_ptr<Event>> CreateEvent() override;
  absl::Status RecordEvent(Event* event) override;
  absl::Status WaitEvent(Event* event) override;
  absl::Status SynchronizeEvent(Event* event) override;
  absl::Status Synchronize() override;

  absl::Status Linear(const Tensor& x, const Tensor& w, const Tensor* bias, Tensor* y) override;
  absl::Status PrefetchWeights(const std::vector<const Tensor*>& weights, PrefetchWhile during,
                               int64_t rows) override;
  absl::Status Linears(const Tensor& x, const std::vector<const Tensor*>& ws,
                       const std::vector<Tensor*>& ys) override;
  // Whether y = x * w^T (no bias) takes gemv.cu's decode-sized path: bf16 x and w, at most
  // cuda::kGemvMaxRows rows, 16-byte rows and pointers, y f32 or bf16.
  bool TakesGemv(const Tensor& x, const Tensor& w, const Tensor& y) const;
  absl::Status LinearsFp8(const Tensor& x, const std::vector<const Tensor*>& ws,
                          const std::vector<Tensor*>& ys);
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

  absl::Status QkNormRopeWriteKv(Tensor* q, Tensor* k, const Tensor& v, const Tensor& q_weight,
                                 const Tensor& k_weight, float eps, const Tensor& positions,
                                 double theta, const PagedAttentionMeta& meta, Tensor* k_cache,
                                 Tensor* v_cache) override;
  absl::Status WriteKvCache(const Tensor& k, const Tensor& v, const PagedAttentionMeta& meta,
                            Tensor* k_cache, Tensor* v_cache) override;
  absl::Status PagedAttention(const Tensor& q, const Tensor& k_cache, const Tensor& v_cache,
                              const PagedAttentionMeta& meta, float scale, Tensor* out) override;

  absl::Status TopKSoftmax(const Tensor& logits, int top_k, bool normalize, Tensor* ids,
                           Tensor* weights) override;
  // Decode-sized batches: one kernel (route_decode.cu), the default's bits.
  absl::Status AddRmsNormRoute(const Tensor& x, const Tensor& norm_weight, float eps,
                               Tensor* residual, Tensor* normed, const Tensor& router, int top_k,
                               bool normalize, Tensor* ids, Tensor* weights) override;
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
  absl::Status GroupedSwiGluCounted(const Tensor& xs, const Tensor& rows,
                                    const Tensor& expert_offsets,
                                    const std::vector<const Tensor*>& gate_up,
                                    const std::vector<const Tensor*>& down, Tensor* y) override;
  absl::Status ScaleAddRows(const Tensor& src, const Tensor& scales, const Tensor& rows,
                            Tensor* dst) override;
  absl::Status ScaleSumRows(const Tensor& src, const Tensor& scales, const Tensor& rows,
                            Tensor* out) override;
  absl::Status AccumulateCounts(const Tensor& offsets, Tensor* counts) override;
  absl::Status QuantizeRowsFp8(const Tensor& src, const Tensor& rows, Tensor* records) override;
  absl::Status DequantizeRowsFp8(const Tensor& records, Tensor* dst) override;
  bool TakesRoutedSwiGlu(int64_t tokens, int64_t top_k) const override;
  absl::Status RoutedSwiGlu(const Tensor& x, const Tensor& ids, const Tensor& weights,
                            const std::vector<const Tensor*>& gate_up,
                            const std::vector<const Tensor*>& down, Tensor* counts,
                            Tensor* out) override;
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
  cudaStream_t stream() const { return stream_; }

  // What the data plane's low-latency exchange (dataplane/low_latency/cuda/) launches its
  // rounds by: this backend's GPU made current on the calling thread (ops may come from any
  // thread), the GPU's SMs, whether a graph is being recorded (then nothing may wait for
  // the queue), and DXS_CUDA_LL_STATUS=copy (a rank's status read by copies, not a kernel).
  absl::Status Enter(const char* op) const;
  int num_sms() const { return num_sms_; }
  bool recording() const { return recording_.load(); }
  bool ll_status_by_copy() const { return ll_status_by_copy_; }

 private:
  // Scratch memory for one op, from the caching allocator: stream order makes its reuse by
  // a later op safe once it goes back.
  absl::StatusOr<Tensor> Workspace(size_t bytes);
  // y = x * w^T with cuBLAS, x and w in one dtype, y in that dtype or f32.
  absl::Status Gemm(const void* x, const void* w, DType in_dtype, int64_t m, int64_t n, int64_t k,
                    void* y, DType out_dtype, float beta, const char* op);
  // Linear of a block-scaled FP8 weight (kernels/cuda/fp8_linear.cc): gemv.cu's sibling
  // LaunchGemvFp8 for decode-sized x, else the activations quantized per token and 128
  // channels and cuBLASLt's FP8 matmul with 128x128 weight and 1x128 activation scales.
  absl::Status LinearFp8(const Tensor& x, const Tensor& w, const Tensor* bias, Tensor* y);
  // What LinearFp8 requires of its arguments, as INVALID_ARGUMENT (UNIMPLEMENTED for a bias).
  absl::Status CheckLinearFp8(const Tensor& x, const Tensor& w, const Tensor* bias,
                              const Tensor& y) const;
  // x quantized for cuBLASLt's FP8 matmul: e4m3 values and 1x128 scales, the rows padded to a
  // multiple of 4 with zeros. Weights sharing x (LinearsFp8: q, k and v) share one.
  struct Fp8Activations {
    Tensor values;  // e4m3 [padded_rows, k]
    Tensor scales;  // f32 [k / 128, padded_rows]
    int64_t rows = 0, padded_rows = 0;
  };
  absl::StatusOr<Fp8Activations> QuantizeForGemmFp8(const Tensor& x);
  // Whether LinearFp8 takes the FP8 GEMV for this x and w (decode-sized bf16 x).
  bool TakesGemvFp8(const Tensor& x, const Tensor& w) const;
  // LinearsFp8 past the GEMV: one Fp8Activations for all the weights, or Linear each where
  // any of them would not take cuBLASLt alone.
  absl::Status LinearsFp8Gemm(const Tensor& x, const std::vector<const Tensor*>& ws,
                              const std::vector<Tensor*>& ys);
  // cuBLASLt's FP8 matmul of x and w into y on `stream` with `workspace` (cublas_workspace_
  // on stream_). A padded result's scratch is moved into *scratch, which must outlive the
  // stream's use of it (a side stream's until it is joined back).
  absl::Status MatmulFp8(const Fp8Activations& x, const Tensor& w, Tensor* y, cudaStream_t stream,
                         const Tensor& workspace, Tensor* scratch);
  absl::Status GemmFp8(const Tensor& x, const Tensor& w, Tensor* y);
  // The same GEMM as the CUTLASS FP8 grouped GEMM's one group (grouped_gemm_fp8_sm90.cuh):
  // the weight's scales N-major and a device table {weight, scales}, made on the weight's
  // first GEMM and kept. FAILED_PRECONDITION where that first GEMM is being recorded.
  absl::Status GemmFp8Cutlass(const Tensor& x, const Tensor& w, Tensor* y);
  struct Fp8DenseWeight {
    Tensor scales;  // f32 [k / 128, n / 128]
    Tensor table;   // i64 [2]: the weight's and the scales' addresses
  };
  // cuBLASLt's description of one FP8 GEMM shape and the algorithm its heuristic chose,
  // made on the shape's first call and kept (the scale pointers are set per call).
  struct Fp8GemmPlan {
    const CublasLtApi* api = nullptr;
    cublasLtMatmulDesc_t desc = nullptr;
    cublasLtMatrixLayout_t a = nullptr, b = nullptr, d = nullptr;
    cublasLtMatmulAlgo_t algo{};
    ~Fp8GemmPlan();
  };
  absl::StatusOr<Fp8GemmPlan*> Fp8Plan(int64_t m_pad, int64_t n, int64_t k, DType out_dtype,
                                       const void* a_scales, const void* b_scales)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(fp8_mu_);
  // One expert shard's weights as the grouped FFN takes them: checked (bf16, one shape),
  // their intermediate size (-1 when none is held) and a device table of gate_up | down
  // pointers. Made on a set's first call and kept: the shard passes the same each call.
  struct ExpertWeightSet {
    Tensor pointers;  // i64 [2 * experts]
    int64_t inter = -1;
    // Block-scaled FP8 experts (Tensor::block_scales): each weight's scales N-major (the FP8
    // grouped GEMM's B scales), and their i64 [2 * experts] pointer table.
    bool fp8 = false;
    Tensor scale_pointers;
    std::vector<Tensor> scales;
    // The scale table as the GEMVs take it (gemv.cu): null for bf16 experts.
    const float* const* scale_table() const {
      return fp8 ? reinterpret_cast<const float* const*>(scale_pointers.raw()) : nullptr;
    }
  };
  absl::StatusOr<ExpertWeightSet> ExpertWeights(const std::vector<const Tensor*>& gate_up,
                                                const std::vector<const Tensor*>& down,
                                                int64_t hidden);
  // The grouped FFN as two CUTLASS grouped GEMMs (kernels/cuda/grouped_gemm.cuh): per
  // expert sizes stay on the device.
  // The grouped FFN of block-scaled FP8 experts (kernels/cuda/moe_fp8.cu and
  // grouped_gemm_fp8_sm90.cuh): the rows quantized per 128 channels in expert order, the
  // gate_up FP8 grouped GEMM into bf16, silu * up quantized again, the down FP8 grouped GEMM.
  absl::Status GroupedSwiGluFp8(const Tensor& xs, const Tensor* rows, const Tensor& expert_offsets,
                                const ExpertWeightSet& weights, Tensor* y);
  absl::Status GroupedSwiGluCutlass(const Tensor& x, const Tensor& expert_offsets,
                                    const ExpertWeightSet& weights, Tensor* y);
  absl::Status GroupedSwiGluCublas(const Tensor& xs, const Tensor& expert_offsets,
                                   const std::vector<const Tensor*>& gate_up,
                                   const std::vector<const Tensor*>& down, int64_t inter,
                                   Tensor* y);

  // Whether PagedAttention takes decode_attention.cu's one-kernel path for this step.
  bool UseDecodeAttention(const Tensor& q, const Tensor& k_cache, const PagedAttentionMeta& meta,
                          const Tensor& out) const;
  // The decode kernel's zeroed counters, at least `count` of them (grown only outside a
  // recording: the warm-up run before it sizes them).
  absl::StatusOr<int32_t*> DecodeCounters(int64_t count);
  // FlashInfer's paged attention (kernels/cuda/flashinfer_attention.cuh) for this call, or
  // null when our own kernel (attention.cu) runs it: see DXS_CUDA_ATTENTION below.
  bool UseFlashInfer(const Tensor& q, const Tensor& k_cache, const PagedAttentionMeta& meta,
                     const Tensor& out) const;

  const int device_;
  // DXS_CUDA_ATTENTION=auto|dxs|flashinfer (default auto): which paged-attention kernel.
  // FlashInfer's kernel measured faster at every size on the GPU (docs/gpu.md), so auto
  // takes it for prefill and for decode steps recorded in graphs; an eager decode step is
  // bound by the host's launches instead, where ours (fewer launches) measured faster.
  // FlashInfer's runs only where the host lengths are given and it is built for the shape
  // (bf16, head_dim 128); ours everywhere else, and always with dxs.
  enum class AttentionChoice { kAuto, kDxs, kFlashInfer };
  AttentionChoice attention_choice_ = AttentionChoice::kAuto;
  // DXS_CUDA_FUSED_KV_WRITE=auto|off (default auto): QkNormRopeWriteKv in one kernel where
  // q, k, v and the caches share a dtype (off: QkNormRope, then WriteKvCache).
  bool fused_kv_write_ = true;
  // DXS_CUDA_DECODE_ATTENTION=auto|on|off (default auto): decode steps (one query per
  // sequence) of at most kDecodeAttentionMaxPairs (sequence, kv head) pairs take
  // decode_attention.cu's one kernel instead of attention.cu's kernel and split merge
  // (auto: contexts up to kDecodeAttentionMaxContext), or at any context and instead of
  // FlashInfer's as well (on, also inside graphs); off: never, nor with
  // DXS_CUDA_ATTENTION=flashinfer.
  enum class DecodeChoice { kAuto, kOn, kOff };
  DecodeChoice decode_choice_ = DecodeChoice::kAuto;
  int num_sms_ = 1;
  // DXS_CUDA_LL_STATUS=copy: a low-latency rank's status is read by copies, not a kernel.
  bool ll_status_by_copy_ = false;
  absl::Mutex decode_mu_;
  Tensor decode_counters_ ABSL_GUARDED_BY(decode_mu_);
  absl::Mutex flashinfer_mu_;
  struct FlashInferDeleter {
    void operator()(cuda::FlashInferAttention* fi) const;
  };
  std::unique_ptr<cuda::FlashInferAttention, FlashInferDeleter> flashinfer_
      ABSL_GUARDED_BY(flashinfer_mu_);
  // While a graph records: its FlashInfer plan and what Replay must do first.
  cuda::FlashInferGraphPlan* capture_plan_ ABSL_GUARDED_BY(flashinfer_mu_) = nullptr;
  std::vector<std::function<absl::Status(cudaEvent_t)>> capture_hooks_
      ABSL_GUARDED_BY(flashinfer_mu_);
  // DXS_CUDA_GROUPED_GEMM=cublas|cutlass (default: cutlass where built): which grouped FFN.
  bool use_cutlass_ = false;
  // DXS_CUDA_GEMV=auto|off (default auto): decode-sized Linear calls (at most
  // cuda::kGemvMaxRows rows, no bias) and grouped FFNs (at most cuda::kGemvMaxPairs pairs)
  // stream their bf16 weights through kernels/cuda/gemv.cu instead of cuBLAS / CUTLASS.
  bool use_gemv_ = true;
  // DXS_CUDA_GEMV_FP8_FEATURES=auto|1|2|4: output features an FP8 dense GEMV warp computes
  // (0: auto, by the shape; cuda::LaunchGemvsFp8).
  int gemv_fp8_features_ = 0;
  // DXS_CUDA_ROUTED_SWIGLU=auto|off (default auto, off with the GEMVs): RoutedSwiGlu's fused
  // path for decode-sized batches; off keeps ExpertShard's sorted path (for A/B runs).
  bool use_routed_swiglu_ = true;
  // DXS_CUDA_SCALE_SUM_SCAN=auto|off (default auto, off with the GEMVs): ScaleSumRows in
  // one kernel up to cuda::kScaleSumMaxPairs pairs; off: up to cuda::kGemvMaxPairs, past
  // that a fill, a sort, the scale-add and a copy (for A/B runs).
  bool use_scale_sum_scan_ = true;
  // DXS_CUDA_FUSED_ROUTE=auto|off (default off until measured on a GPU; off with the GEMVs):
  // AddRmsNormRoute in one kernel for decode-sized batches; off: the norm, the router GEMV
  // and the top-k apart.
  bool use_fused_route_ = false;
  // The fused router's last-block counter (one unsigned, kept zero between launches).
  Tensor route_counter_;
  absl::Mutex tables_mu_;
  std::map<std::vector<const void*>, ExpertWeightSet> weight_tables_ ABSL_GUARDED_BY(tables_mu_);
  cudaStream_t stream_ = nullptr;
  // DXS_CUDA_FP8_WEIGHTS=auto|off (default auto: on sm_90 and later, where cuBLASLt loads):
  // capabilities().fp8_block_weights, so FP8 checkpoints' projections stay FP8 here.
  bool fp8_weights_ = false;
  // The FP8 grouped GEMM runs here (CUTLASS built, sm_90): experts stay FP8 too.
  bool fp8_grouped_gemm_ = false;
  const CublasLtApi* lt_ = nullptr;
  cublasLtHandle_t lt_handle_ = nullptr;
  // LinearsFp8Gemm runs its second and third weights (k and v beside q) on these: at decode
  // batches their matmuls fill 4 of the SMs each (a 512-row weight in 128-row tiles), so they
  // run beside q's rather than after it. Each has its own cuBLASLt workspace; the fork and
  // the joins are events on stream_, so a recorded graph holds them as parallel branches.
  // Made with the FP8 weights unless DXS_CUDA_FP8_SIDE_STREAMS=off (fp8_fork_ null then).
  struct SideStream {
    cudaStream_t stream = nullptr;
    cudaEvent_t done = nullptr;
    Tensor workspace;
  };
  std::array<SideStream, 2> fp8_side_;
  cudaEvent_t fp8_fork_ = nullptr;
  // DXS_CUDA_L2_PREFETCH: which PrefetchWeights hints a recording graph takes. Each forks a
  // branch onto l2_prefetch_stream_ (waiting on l2_prefetch_fork_) that issues the L2
  // prefetches off the decode step's critical path; the branch is joined once, before the
  // capture ends (l2_prefetch_open_), so no op of the step waits for it.
  enum class L2Prefetch { kOff, kAttention, kAll };
  L2Prefetch l2_prefetch_ = L2Prefetch::kOff;
  cudaStream_t l2_prefetch_stream_ = nullptr;
  cudaEvent_t l2_prefetch_fork_ = nullptr, l2_prefetch_done_ = nullptr;
  bool l2_prefetch_open_ = false;  // a branch forked in this capture, not yet joined
  // Joins an open prefetch branch into stream_ (before a capture ends).
  absl::Status JoinL2Prefetch();
  absl::Mutex fp8_mu_;
  std::map<std::tuple<int64_t, int64_t, int64_t, DType>, std::unique_ptr<Fp8GemmPlan>> fp8_plans_
      ABSL_GUARDED_BY(fp8_mu_);
  // DXS_CUDA_FP8_GEMM=cutlass: the GEMM past the GEMV's rows is CUTLASS's (else cuBLASLt's).
  bool fp8_gemm_cutlass_ = false;
  std::map<const void*, Fp8DenseWeight> fp8_dense_weights_ ABSL_GUARDED_BY(fp8_mu_);
  const CublasApi* blas_ = nullptr;  // kernels/cuda/cublas_loader.h
  cublasHandle_t cublas_ = nullptr;
  Tensor cublas_workspace_;
  std::shared_ptr<CachingAllocator> allocator_;
  // CaptureGraph's private pool (warm-up and recording allocate from it), and whether a
  // capture is under way (then the queue must not be synchronised).
  std::shared_ptr<CachingAllocator> graph_allocator_;
  std::atomic<bool> graph_mode_{false};
  std::atomic<bool> recording_{false};
};

}  // namespace dxs
