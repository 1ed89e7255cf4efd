// CUDA backend: routing (top-k softmax), the dispatch layout, the combine's weighted sum,
// the pair sort and scale-add (moe_ops.cu), and the grouped expert FFN.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "kernels/cuda/cuda_backend_impl.h"
#include "kernels/cuda/grouped_gemm.cuh"
#include "kernels/cuda/topk_softmax.cuh"
#include "kernels/cuda/topk_softmax_cuda.h"
#include "kernels/op_checks.h"
#include "kernels/topk_softmax.h"

namespace dxs {

absl::Status CudaBackend::TopKSoftmax(const Tensor& logits, int top_k, bool normalize, Tensor* ids,
                                      Tensor* weights) {
  const int64_t tokens = logits.rows(), experts = logits.row_size();
  DXS_RETURN_IF_ERROR(ValidateTopKArgs(tokens, experts, top_k));
  DXS_RETURN_IF_ERROR(CheckDType("top-k softmax", *ids, DType::kI32, "ids"));
  DXS_RETURN_IF_ERROR(CheckDType("top-k softmax", *weights, DType::kF32, "weights"));
  if (ids->num_elements() != tokens * top_k || weights->num_elements() != tokens * top_k) {
    return absl::InvalidArgumentError(
        absl::StrCat("top-k softmax: outputs ", ids->ShapeString(), " for ", tokens, " x ", top_k));
  }
  if (tokens == 0) return absl::OkStatus();
  DXS_RETURN_IF_ERROR(Enter("top-k softmax"));
  if (logits.dtype() == DType::kBF16) {
    return TopKSoftmaxCudaBf16(static_cast<const __nv_bfloat16*>(logits.raw()), tokens, experts,
                               top_k, normalize, ids->i32(), weights->f32(), stream_);
  }
  DXS_RETURN_IF_ERROR(CheckDType("top-k softmax", logits, DType::kF32, "logits"));
  return TopKSoftmaxCuda(logits.f32(), tokens, experts, top_k, normalize, ids->i32(),
                         weights->f32(), stream_);
}

absl::Status CudaBackend::AddRmsNormRoute(const Tensor& x, const Tensor& norm_weight, float eps,
                                          Tensor* residual, Tensor* normed, const Tensor& router,
                                          int top_k, bool normalize, Tensor* ids, Tensor* weights) {
  const int64_t m = normed->rows(), hidden = norm_weight.num_elements(), experts = router.rows();
  // The fused kernel where each of the three would take its bf16 kernel (the norm's 16-byte
  // path, the router's GEMV): its bits are theirs.
  const bool fused =
      use_fused_route_ && x.dtype() == DType::kBF16 && norm_weight.dtype() == DType::kBF16 &&
      residual->dtype() == DType::kF32 && normed->dtype() == DType::kBF16 &&
      router.dtype() == DType::kBF16 && m >= 1 && m <= cuda::kGemvMaxRows && hidden % 8 == 0 &&
      x.num_elements() == m * hidden && residual->num_elements() == m * hidden &&
      normed->row_size() == hidden && router.row_size() == hidden && experts >= 1 &&
      experts <= kTopKSoftmaxMaxExperts && top_k >= 1 && top_k <= experts &&
      top_k <= kTopKSoftmaxMaxTopK && ids->dtype() == DType::kI32 &&
      weights->dtype() == DType::kF32 && ids->num_elements() == m * top_k &&
      weights->num_elements() == m * top_k && Aligned16(x.raw()) && Aligned16(residual->raw()) &&
      Aligned16(norm_weight.raw()) && Aligned16(normed->raw()) && Aligned16(router.raw());
  if (!fused) {
    return Backend::AddRmsNormRoute(x, norm_weight, eps, residual, normed, router, top_k, normalize,
                                    ids, weights);
  }
  DXS_RETURN_IF_ERROR(CheckAddRmsNormArgs(x, norm_weight, *residual, *normed));
  DXS_ASSIGN_OR_RETURN(Tensor logits, Allocate({m, experts}, DType::kF32));
  DXS_RETURN_IF_ERROR(Enter("add rms norm route"));
  return CudaStatus(cuda::LaunchResidualNormRoute(
                        x.raw(), residual->f32(), norm_weight.raw(), eps, m, hidden, router.raw(),
                        experts, top_k, normalize, normed->raw(), logits.f32(), ids->i32(),
                        weights->f32(), static_cast<unsigned*>(route_counter_.raw()), stream_),
                    "add rms norm route");
}

absl::Status CudaBackend::ComputeDispatchLayout(const Tensor& ids, const Tensor& weights,
                                                const Tensor& expert_owner, int num_ranks,
                                                DispatchLayoutTensors* layout) {
  DXS_RETURN_IF_ERROR(CheckDispatchLayoutArgs(ids, weights, expert_owner, num_ranks));
  const int64_t num_tokens = ids.rows(), top_k = ids.rows() > 0 ? ids.row_size() : 0;
  const int64_t num_pairs = ids.num_elements(), num_experts = expert_owner.rows();
  const int64_t max_token_rows = num_tokens * std::min<int64_t>(top_k, num_ranks);
  DXS_RETURN_IF_ERROR(Enter("dispatch layout"));
  DXS_ASSIGN_OR_RETURN(layout->num_tokens_per_rank, Allocate({num_ranks}, DType::kI32));
  DXS_ASSIGN_OR_RETURN(layout->num_pairs_per_rank, Allocate({num_ranks}, DType::kI32));
  DXS_ASSIGN_OR_RETURN(layout->num_tokens_per_expert, Allocate({num_experts}, DType::kI32));
  DXS_ASSIGN_OR_RETURN(layout->token_rows, Allocate({max_token_rows}, DType::kI32));
  DXS_ASSIGN_OR_RETURN(layout->pairs, Allocate({3 * num_pairs}, DType::kI32));
  const size_t bytes = cuda::DispatchLayoutWorkspaceBytes(num_tokens, top_k, num_ranks);
  DXS_ASSIGN_OR_RETURN(Tensor workspace, Workspace(bytes));
  return CudaStatus(
      cuda::LaunchDispatchLayout(
          ids.i32(), weights.f32(), expert_owner.i32(), expert_owner.row_size(), num_tokens, top_k,
          num_experts, num_ranks, layout->num_tokens_per_rank.i32(),
          layout->num_pairs_per_rank.i32(), layout->num_tokens_per_expert.i32(),
          layout->token_rows.i32(), layout->pairs.i32(), workspace.raw(), bytes, stream_),
      "dispatch layout");
}

absl::Status CudaBackend::CombineRows(const Tensor& recv, const Tensor& token_rows,
                                      const std::vector<int64_t>& rank_offsets, Tensor* out) {
  DXS_RETURN_IF_ERROR(CheckCombineArgs(recv, token_rows, rank_offsets, *out));
  const int64_t num_tokens = out->rows(), hidden = out->row_size();
  if (num_tokens == 0 || hidden == 0) return absl::OkStatus();
  DXS_RETURN_IF_ERROR(Enter("combine"));
  const int64_t num_ranks = static_cast<int64_t>(rank_offsets.size()) - 1;
  DXS_ASSIGN_OR_RETURN(Tensor offsets, Allocate({num_ranks + 1}, DType::kI64));
  DXS_RETURN_IF_ERROR(CopyFromHost(rank_offsets.data(), DType::kI64, &offsets));
  return CudaStatus(cuda::LaunchCombineRows(recv.raw(), ToElemType(recv.dtype()), token_rows.i32(),
                                            offsets.i64(), num_ranks, num_tokens, hidden,
                                            out->raw(), ToElemType(out->dtype()), stream_),
                    "combine");
}

absl::Status CudaBackend::SortPairsByExpert(const Tensor& experts, int num_experts, Tensor* order,
                                            Tensor* expert_offsets,
                                            const std::vector<PairPayload>& payloads) {
  DXS_RETURN_IF_ERROR(CheckSortPairsArgs(experts, num_experts, *order, *expert_offsets, payloads));
  static_assert(kMaxPairPayloads == cuda::kMaxSortPayloads, "one payload limit");
  const int64_t n = experts.num_elements();
  DXS_RETURN_IF_ERROR(Enter("sort pairs"));
  if (n == 0) return Fill(expert_offsets, 0.f);
  cuda::SortPayloads device_payloads;
  for (const PairPayload& p : payloads) {  // 32-bit elements, moved as bits
    device_payloads.in[device_payloads.count] = static_cast<const int32_t*>(p.values->raw());
    device_payloads.out[device_payloads.count++] = static_cast<int32_t*>(p.sorted->raw());
  }
  const size_t bytes = cuda::SortPairsWorkspaceBytes(n, num_experts);
  DXS_ASSIGN_OR_RETURN(Tensor workspace, Workspace(bytes));
  return CudaStatus(cuda::LaunchSortPairsByExpert(experts.i32(), n, num_experts, order->i32(),
                                                  expert_offsets->i32(), workspace.raw(), bytes,
                                                  stream_, device_payloads),
                    "sort pairs");
}

namespace {

// What ScaleAddRows and ScaleSumRows take: f32 scales and i32 rows of one count n, at
// least n rows of f32 or bf16 src, rows as wide as dst's.
absl::Status CheckScaleRowsArgs(const char* op, const Tensor& src, const Tensor& scales,
                                const Tensor& rows, const Tensor& dst) {
  DXS_RETURN_IF_ERROR(CheckDType(op, scales, DType::kF32, "scales"));
  DXS_RETURN_IF_ERROR(CheckDType(op, rows, DType::kI32, "rows"));
  if (src.dtype() != DType::kF32 && src.dtype() != DType::kBF16) {
    return absl::InvalidArgumentError(
        absl::StrCat(op, ": src must be f32 or bf16, got ", std::string(DTypeName(src.dtype()))));
  }
  const int64_t n = rows.num_elements();
  if (scales.num_elements() != n || src.rows() < n || dst.row_size() != src.row_size()) {
    return absl::InvalidArgumentError(
        absl::StrCat(op, ": ", n, " rows of ", src.ShapeString(), " into ", dst.ShapeString()));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status CudaBackend::ScaleAddRows(const Tensor& src, const Tensor& scales, const Tensor& rows,
                                       Tensor* dst) {
  DXS_RETURN_IF_ERROR(CheckScaleRowsArgs("scale add rows", src, scales, rows, *dst));
  DXS_RETURN_IF_ERROR(CheckDType("scale add rows", *dst, DType::kF32, "dst"));
  const int64_t n = rows.num_elements(), d = src.row_size();
  if (n == 0 || d == 0) return absl::OkStatus();
  DXS_RETURN_IF_ERROR(Enter("scale add rows"));
  const size_t bytes = cuda::ScaleAddRowsWorkspaceBytes(n, dst->rows());
  DXS_ASSIGN_OR_RETURN(Tensor workspace, Workspace(bytes));
  return CudaStatus(
      cuda::LaunchScaleAddRows(src.raw(), ToElemType(src.dtype()), scales.f32(), rows.i32(), n, d,
                               dst->f32(), dst->rows(), workspace.raw(), bytes, stream_),
      "scale add rows");
}

absl::Status CudaBackend::QuantizeRowsFp8(const Tensor& src, const Tensor& rows, Tensor* records) {
  DXS_RETURN_IF_ERROR(CheckQuantizeRowsFp8Args(src, rows, *records));
  const int64_t n = rows.num_elements();
  if (n == 0) return absl::OkStatus();
  DXS_RETURN_IF_ERROR(Enter("quantize rows (fp8)"));
  return CudaStatus(
      cuda::LaunchQuantizeRowsFp8(src.raw(), ToElemType(src.dtype()), src.rows(), rows.i32(), n,
                                  src.row_size(), records->raw(), stream_),
      "quantize rows (fp8)");
}

absl::Status CudaBackend::DequantizeRowsFp8(const Tensor& records, Tensor* dst) {
  DXS_RETURN_IF_ERROR(CheckDequantizeRowsFp8Args(records, *dst));
  const int64_t n = records.rows();
  if (n == 0) return absl::OkStatus();
  DXS_RETURN_IF_ERROR(Enter("dequantize rows (fp8)"));
  return CudaStatus(cuda::LaunchDequantizeRowsFp8(records.raw(), n, dst->row_size(), dst->raw(),
                                                  ToElemType(dst->dtype()), stream_),
                    "dequantize rows (fp8)");
}

absl::Status CudaBackend::ScaleSumRows(const Tensor& src, const Tensor& scales, const Tensor& rows,
                                       Tensor* out) {
  const int64_t n = rows.num_elements();
  // Up to a few thousand pairs: the zeroing, the sum and the rounding in one kernel
  // (gemv.cu) instead of a fill, a sort, the sum and a copy.
  const int64_t one_kernel_up_to =
      use_scale_sum_scan_ ? cuda::kScaleSumMaxPairs : cuda::kGemvMaxPairs;
  if (!use_gemv_ || n > one_kernel_up_to ||
      (out->dtype() != DType::kF32 && out->dtype() != DType::kBF16)) {
    return Backend::ScaleSumRows(src, scales, rows, out);
  }
  DXS_RETURN_IF_ERROR(CheckScaleRowsArgs("scale sum rows", src, scales, rows, *out));
  const int64_t d = out->row_size();
  if (out->num_elements() == 0) return absl::OkStatus();
  DXS_RETURN_IF_ERROR(Enter("scale sum rows"));
  return CudaStatus(
      cuda::LaunchScaleSumRows(src.raw(), ToElemType(src.dtype()), scales.f32(), rows.i32(), n, d,
                               out->raw(), ToElemType(out->dtype()), out->rows(), stream_),
      "scale sum rows");
}

// At most 16 routed pairs (a decode step of one or two tokens at top-8): the pairs are then
// single-expert runs in the sorted path too, so the fused path streams the same weights
// with three fewer launches (sort, counts, ScaleSumRows).
bool CudaBackend::TakesRoutedSwiGlu(int64_t tokens, int64_t top_k) const {
  return use_routed_swiglu_ && tokens >= 1 && top_k >= 1 && top_k <= 16 && tokens * top_k <= 16;
}

absl::Status CudaBackend::RoutedSwiGlu(const Tensor& x, const Tensor& ids, const Tensor& weights,
                                       const std::vector<const Tensor*>& gate_up,
                                       const std::vector<const Tensor*>& down, Tensor* counts,
                                       Tensor* out) {
  constexpr const char* kOp = "routed SwiGLU";
  DXS_RETURN_IF_ERROR(CheckDType(kOp, ids, DType::kI32, "ids"));
  DXS_RETURN_IF_ERROR(CheckDType(kOp, weights, DType::kF32, "weights"));
  DXS_RETURN_IF_ERROR(CheckFloat(kOp, x, "x"));
  const int64_t tokens = x.rows(), hidden = x.row_size();
  const int64_t top_k = ids.num_elements() > 0 ? ids.row_size() : 0;
  if (ids.rows() != tokens || weights.rows() != tokens || weights.row_size() != ids.row_size() ||
      out->rows() != tokens || out->row_size() != hidden ||
      (out->dtype() != DType::kF32 && out->dtype() != DType::kBF16) ||
      gate_up.size() != down.size()) {
    return absl::InvalidArgumentError(absl::StrCat(kOp, ": ", x.ShapeString(), " routed by ",
                                                   ids.ShapeString(), " / ", weights.ShapeString(),
                                                   " into ", out->ShapeString()));
  }
  const int64_t num_experts = static_cast<int64_t>(gate_up.size());
  if (counts != nullptr) {
    DXS_RETURN_IF_ERROR(CheckDType(kOp, *counts, DType::kI64, "counts"));
    if (counts->num_elements() != num_experts) {
      return absl::InvalidArgumentError(
          absl::StrCat(kOp, ": counts ", counts->ShapeString(), " for ", num_experts, " experts"));
    }
  }
  if (tokens == 0) return absl::OkStatus();
  if (!TakesRoutedSwiGlu(tokens, top_k) || !Aligned16(x.raw())) {
    return absl::FailedPreconditionError(absl::StrCat(
        kOp, ": ", tokens, " tokens of top-", top_k, " are not a fused batch (TakesRoutedSwiGlu)"));
  }
  DXS_ASSIGN_OR_RETURN(const ExpertWeightSet set, ExpertWeights(gate_up, down, hidden));
  if (set.inter < 0) return absl::FailedPreconditionError("routed SwiGLU: no expert weights here");
  DXS_RETURN_IF_ERROR(Enter(kOp));
  DXS_ASSIGN_OR_RETURN(Tensor act, Allocate({tokens * top_k, set.inter}, DType::kBF16));
  return CudaStatus(cuda::LaunchRoutedSwiGluGemv(
                        x.raw(), ToElemType(x.dtype()), tokens, ids.i32(), weights.f32(), top_k,
                        num_experts, reinterpret_cast<const void* const*>(set.pointers.raw()),
                        set.scale_table(), hidden, set.inter, act.raw(),
                        ToElemType(ActivationDType()), counts != nullptr ? counts->i64() : nullptr,
                        out->raw(), ToElemType(out->dtype()), stream_),
                    kOp);
}

absl::Status CudaBackend::ArgmaxRows(const Tensor& logits, Tensor* ids) {
  DXS_RETURN_IF_ERROR(CheckArgmaxRowsArgs(logits, *ids));
  const int64_t n = logits.rows(), vocab = logits.row_size();
  if (n == 0) return absl::OkStatus();
  DXS_RETURN_IF_ERROR(Enter("argmax rows"));
  return CudaStatus(cuda::LaunchArgmaxRows(logits.f32(), n, vocab, ids->i32(), stream_),
                    "argmax rows");
}

absl::Status CudaBackend::SampleRows(const Tensor& logits, const Tensor& params,
                                     const Tensor* adjustments, Tensor* ids) {
  DXS_RETURN_IF_ERROR(CheckSampleRowsArgs(logits, params, adjustments, *ids));
  const int64_t n = logits.rows(), vocab = logits.row_size();
  if (n == 0) return absl::OkStatus();
  DXS_RETURN_IF_ERROR(Enter("sample rows"));
  size_t bytes = 0;
  DXS_RETURN_IF_ERROR(
      CudaStatus(cuda::SampleRowsWorkspaceBytes(n, vocab, &bytes), "sample rows: workspace"));
  DXS_ASSIGN_OR_RETURN(Tensor workspace, Workspace(bytes));
  const int64_t num_adjust = adjustments != nullptr ? adjustments->rows() : 0;
  const auto* adjust =
      num_adjust > 0 ? reinterpret_cast<const LogitAdjustment*>(adjustments->i32()) : nullptr;
  return CudaStatus(cuda::LaunchSampleRows(
                        logits.f32(), n, vocab, reinterpret_cast<const SamplingRow*>(params.i64()),
                        adjust, num_adjust, ids->i32(), workspace.raw(), bytes, stream_),
                    "sample rows");
}

absl::Status CudaBackend::CountPendingTokens(const Tensor& tokens, const Tensor& params,
                                             Tensor* adjustments) {
  DXS_RETURN_IF_ERROR(CheckCountPendingTokensArgs(tokens, params, *adjustments));
  const int64_t n = tokens.num_elements();
  if (n == 0 || adjustments->rows() == 0) return absl::OkStatus();
  DXS_RETURN_IF_ERROR(Enter("count pending tokens"));
  return CudaStatus(
      cuda::LaunchCountPendingTokens(
          tokens.i32(), n, reinterpret_cast<const SamplingRow*>(params.i64()),
          reinterpret_cast<LogitAdjustment*>(adjustments->i32()), adjustments->rows(), stream_),
      "count pending tokens");
}

absl::Status CudaBackend::LogprobRows(const Tensor& logits, const Tensor& sampled,
                                      const Tensor& named, Tensor* sampled_logprobs,
                                      Tensor* named_logprobs, Tensor* top_ids,
                                      Tensor* top_logprobs) {
  DXS_RETURN_IF_ERROR(CheckLogprobRowsArgs(logits, sampled, named, *sampled_logprobs,
                                           *named_logprobs, *top_ids, *top_logprobs));
  const int64_t n = logits.rows(), vocab = logits.row_size();
  if (n == 0) return absl::OkStatus();
  DXS_RETURN_IF_ERROR(Enter("logprob rows"));
  const int64_t k = top_ids->shape()[1];
  size_t bytes = 0;
  DXS_RETURN_IF_ERROR(
      CudaStatus(cuda::LogprobRowsWorkspaceBytes(n, vocab, k, &bytes), "logprob rows: workspace"));
  DXS_ASSIGN_OR_RETURN(Tensor workspace, Workspace(bytes));
  return CudaStatus(
      cuda::LaunchLogprobRows(logits.f32(), n, vocab, sampled.i32(), named.i32(), named.shape()[1],
                              k, sampled_logprobs->f32(), named_logprobs->f32(), top_ids->i32(),
                              top_logprobs->f32(), workspace.raw(), bytes, stream_),
      "logprob rows");
}

absl::Status CudaBackend::AccumulateCounts(const Tensor& offsets, Tensor* counts) {
  DXS_RETURN_IF_ERROR(CheckAccumulateCountsArgs(offsets, *counts));
  if (counts->num_elements() == 0) return absl::OkStatus();
  DXS_RETURN_IF_ERROR(Enter("accumulate counts"));
  return CudaStatus(
      cuda::LaunchAccumulateCounts(offsets.i32(), counts->num_elements(), counts->i64(), stream_),
      "accumulate counts");
}

absl::Status CudaBackend::UnpackRoutedPairs(const Tensor& blocks,
                                            const std::vector<PairSegment>& segments,
                                            const Tensor& held, Tensor* rows, Tensor* experts,
                                            Tensor* weights, Tensor* bad) {
  DXS_RETURN_IF_ERROR(
      CheckUnpackRoutedPairsArgs(blocks, segments, held, *rows, *experts, *weights, *bad));
  static_assert(sizeof(PairSegment) == 4 * sizeof(int32_t) &&
                kMaxPairSegments == cuda::kMaxUnpackSegments);
  if (rows->num_elements() == 0) return absl::OkStatus();  // nothing launched, bad untouched
  DXS_RETURN_IF_ERROR(Enter("unpack routed pairs"));
  return CudaStatus(
      cuda::LaunchUnpackRoutedPairs(blocks.i32(), reinterpret_cast<const int32_t*>(segments.data()),
                                    static_cast<int>(segments.size()), held.i32(),
                                    held.num_elements(), rows->num_elements(), rows->i32(),
                                    experts->i32(), weights->f32(), bad->i32(), stream_),
      "unpack routed pairs");
}

// ---- The grouped expert FFN ----

absl::Status CudaBackend::GroupedSwiGlu(const Tensor& xs, const Tensor* rows,
                                        const Tensor& expert_offsets,
                                        const std::vector<const Tensor*>& gate_up,
                                        const std::vector<const Tensor*>& down, Tensor* y) {
  DXS_RETURN_IF_ERROR(CheckDType("grouped SwiGLU", expert_offsets, DType::kI32, "offsets"));
  if (rows != nullptr) {
    DXS_RETURN_IF_ERROR(CheckDType("grouped SwiGLU", *rows, DType::kI32, "rows"));
  }
  DXS_RETURN_IF_ERROR(CheckFloat("grouped SwiGLU", xs, "xs"));
  if (y->dtype() != DType::kF32 && y->dtype() != DType::kBF16) {
    return absl::InvalidArgumentError("grouped SwiGLU: y must be f32 or bf16");
  }
  const int64_t num_experts = expert_offsets.num_elements() - 1;
  const int64_t hidden = xs.row_size();
  const int64_t num_rows = rows != nullptr ? rows->num_elements() : xs.rows();
  if (num_experts < 0 || static_cast<int64_t>(gate_up.size()) != num_experts ||
      down.size() != gate_up.size() || y->rows() != num_rows || y->row_size() != hidden) {
    return absl::InvalidArgumentError(absl::StrCat("grouped SwiGLU: ", xs.ShapeString(), " over ",
                                                   num_experts, " experts into ",
                                                   y->ShapeString()));
  }
  // The weights' checks and device pointer table, made once per set of weights.
  DXS_ASSIGN_OR_RETURN(const ExpertWeightSet weights, ExpertWeights(gate_up, down, hidden));
  const int64_t inter = weights.inter;
  if (num_rows == 0) return absl::OkStatus();
  if (inter < 0) return absl::FailedPreconditionError("grouped SwiGLU: no expert weights here");
  DXS_RETURN_IF_ERROR(Enter("grouped SwiGLU"));
  // Decode-sized: each held expert's weights streamed once (gemv.cu), the rows read where
  // they are, no gather, no SiLU pass; FP8 experts too (widened in registers, no
  // quantization pass).
  if (use_gemv_ && num_rows <= (weights.fp8 ? cuda::kGemvMaxPairsFp8 : cuda::kGemvMaxPairs) &&
      hidden % 8 == 0 && inter % 8 == 0 &&
      (xs.dtype() == DType::kBF16 || xs.dtype() == DType::kF32) && Aligned16(xs.raw())) {
    DXS_ASSIGN_OR_RETURN(Tensor act, Allocate({num_rows, inter}, DType::kBF16));
    return CudaStatus(
        cuda::LaunchMoeSwiGluGemv(
            xs.raw(), ToElemType(xs.dtype()), xs.rows(), rows != nullptr ? rows->i32() : nullptr,
            num_rows, expert_offsets.i32(), num_experts,
            reinterpret_cast<const void* const*>(weights.pointers.raw()), weights.scale_table(),
            hidden, inter, act.raw(), y->raw(), ToElemType(y->dtype()), stream_),
        "grouped SwiGLU (gemv)");
  }
  if (weights.fp8) return GroupedSwiGluFp8(xs, rows, expert_offsets, weights, y);
  // The GEMMs take bf16 rows: the sorted rows gathered (and narrowed) in one pass. (A
  // TMA-fed mainloop cannot load A rows by index on Hopper, so the gather stays a pass.)
  Tensor x = xs;
  if (rows != nullptr || xs.dtype() != DType::kBF16) {
    DXS_ASSIGN_OR_RETURN(x, Allocate({num_rows, hidden}, DType::kBF16));
    if (rows != nullptr) {
      DXS_RETURN_IF_ERROR(GatherRows(xs, *rows, &x));
    } else {
      DXS_RETURN_IF_ERROR(Copy(xs, &x));
    }
  }
  if (use_cutlass_) return GroupedSwiGluCutlass(x, expert_offsets, weights, y);
  return GroupedSwiGluCublas(x, expert_offsets, gate_up, down, inter, y);
}

absl::Status CudaBackend::GroupedSwiGluCounted(const Tensor& xs, const Tensor& rows,
                                               const Tensor& expert_offsets,
                                               const std::vector<const Tensor*>& gate_up,
                                               const std::vector<const Tensor*>& down, Tensor* y) {
  // The cuBLAS path sizes its GEMMs on the host: the default reads the count. The CUTLASS
  // path's GEMMs take it from the offsets on the device (the entries past it are in no
  // group); its gather and SiLU run over the capacity.
  if (!use_cutlass_)
    return Backend::GroupedSwiGluCounted(xs, rows, expert_offsets, gate_up, down, y);
  return GroupedSwiGlu(xs, &rows, expert_offsets, gate_up, down, y);
}

absl::StatusOr<CudaBackend::ExpertWeightSet> CudaBackend::ExpertWeights(
    const std::vector<const Tensor*>& gate_up, const std::vector<const Tensor*>& down,
    int64_t hidden) {
  std::vector<const void*> key;
  key.reserve(2 * gate_up.size());
  for (const auto* list : {&gate_up, &down}) {
    for (const Tensor* w : *list) key.push_back(w != nullptr ? w->raw() : nullptr);
  }
  absl::MutexLock lock(&tables_mu_);
  auto it = weight_tables_.find(key);
  if (it != weight_tables_.end()) return it->second;
  // Shapes from the experts this shard holds (all alike); those with rows but no weights
  // are the paths' to report or skip (ExpertShard checks holders on the host first).
  ExpertWeightSet set;
  for (size_t e = 0; e < gate_up.size(); ++e) {
    if (gate_up[e] == nullptr && down[e] == nullptr) continue;
    if (gate_up[e] == nullptr || down[e] == nullptr) {
      return absl::InvalidArgumentError(
          absl::StrCat("grouped SwiGLU: expert ", e, " has some weights and not others"));
    }
    const bool fp8 = gate_up[e]->dtype() == DType::kF8E4M3;
    if (set.inter >= 0 && fp8 != set.fp8) {
      return absl::InvalidArgumentError(
          absl::StrCat("grouped SwiGLU: expert ", e, " is not in the other experts' dtype"));
    }
    set.fp8 = fp8;
    for (const Tensor* w : {gate_up[e], down[e]}) {
      if (!fp8) {
        DXS_RETURN_IF_ERROR(CheckDType("grouped SwiGLU", *w, DType::kBF16, "expert weight"));
      } else if (w->dtype() != DType::kF8E4M3 || w->block_scales() == nullptr ||
                 !fp8_grouped_gemm_) {
        return absl::InvalidArgumentError(
            absl::StrCat("grouped SwiGLU: expert ", e, "'s FP8 weights ",
                         !fp8_grouped_gemm_ ? "on a backend without the FP8 grouped GEMM"
                                            : "without their block scales, or beside bf16 ones"));
      }
    }
    if (set.inter < 0) set.inter = down[e]->row_size();
    if (gate_up[e]->rows() != 2 * set.inter || gate_up[e]->row_size() != hidden ||
        down[e]->rows() != hidden || down[e]->row_size() != set.inter) {
      return absl::InvalidArgumentError(
          absl::StrCat("grouped SwiGLU: expert ", e, " weights ", gate_up[e]->ShapeString(), " / ",
                       down[e]->ShapeString(), " for hidden ", hidden));
    }
  }
  static_assert(sizeof(void*) == sizeof(int64_t), "pointers travel as i64");
  DXS_ASSIGN_OR_RETURN(set.pointers, Allocate({static_cast<int64_t>(key.size())}, DType::kI64));
  DXS_RETURN_IF_ERROR(CopyFromHost(key.data(), DType::kI64, &set.pointers));
  if (set.fp8) {
    // Each weight's block scales N-major, as the FP8 grouped GEMM reads B's.
    DXS_RETURN_IF_ERROR(Enter("grouped SwiGLU: expert scales"));
    std::vector<const void*> scale_ptrs(key.size(), nullptr);
    const std::vector<const Tensor*>* lists[2] = {&gate_up, &down};
    for (size_t half = 0; half < 2; ++half) {
      for (size_t e = 0; e < gate_up.size(); ++e) {
        const Tensor* w = (*lists[half])[e];
        if (w == nullptr) continue;
        const Tensor& src = *w->block_scales();
        const int64_t n_blocks = w->rows() / Tensor::kWeightBlock,
                      k_blocks = w->row_size() / Tensor::kWeightBlock;
        DXS_ASSIGN_OR_RETURN(Tensor t, Allocate({k_blocks, n_blocks}, DType::kF32));
        DXS_RETURN_IF_ERROR(
            CudaStatus(cuda::LaunchTransposeBlockScales(src.f32(), n_blocks, k_blocks,
                                                        src.row_size(), t.f32(), stream_),
                       "grouped SwiGLU: expert scales"));
        scale_ptrs[half * gate_up.size() + e] = t.raw();
        set.scales.push_back(std::move(t));
      }
    }
    DXS_ASSIGN_OR_RETURN(set.scale_pointers,
                         Allocate({static_cast<int64_t>(key.size())}, DType::kI64));
    DXS_RETURN_IF_ERROR(CopyFromHost(scale_ptrs.data(), DType::kI64, &set.scale_pointers));
  }
  weight_tables_.emplace(std::move(key), set);
  return set;
}

absl::Status CudaBackend::GroupedSwiGluFp8(const Tensor& xs, const Tensor* rows,
                                           const Tensor& expert_offsets,
                                           const ExpertWeightSet& weights, Tensor* y) {
  const int64_t num_experts = weights.pointers.num_elements() / 2, inter = weights.inter;
  const int64_t hidden = xs.row_size();
  const int64_t num_rows = rows != nullptr ? rows->num_elements() : xs.rows();
  const size_t ws_bytes =
      std::max(cuda::GroupedGemmFp8WorkspaceBytes(num_experts, num_rows, 2 * inter, hidden,
                                                  cuda::ElemType::kBF16),
               cuda::GroupedGemmFp8WorkspaceBytes(num_experts, num_rows, hidden, inter,
                                                  ToElemType(y->dtype())));
  if (ws_bytes == 0) {
    return absl::InternalError("grouped SwiGLU (fp8): no grouped GEMM workspace size");
  }
  DXS_ASSIGN_OR_RETURN(Tensor ws, Workspace(ws_bytes));
  const auto* ptrs = reinterpret_cast<const void* const*>(weights.pointers.raw());
  const auto* scale_ptrs = reinterpret_cast<const float* const*>(weights.scale_pointers.raw());
  const int32_t* off = expert_offsets.i32();
  DXS_ASSIGN_OR_RETURN(Tensor a, Allocate({num_rows, hidden}, DType::kF8E4M3));
  DXS_ASSIGN_OR_RETURN(Tensor sfa,
                       Allocate({num_rows * (hidden / Tensor::kWeightBlock)}, DType::kF32));
  DXS_RETURN_IF_ERROR(CudaStatus(
      cuda::LaunchQuantizeGroupedFp8(
          xs.raw(), ToElemType(xs.dtype()), xs.rows(), rows != nullptr ? rows->i32() : nullptr,
          num_rows, hidden, off, num_experts, static_cast<uint8_t*>(a.raw()), sfa.f32(), stream_),
      "grouped SwiGLU (fp8): rows"));
  DXS_ASSIGN_OR_RETURN(Tensor gu, Allocate({num_rows, 2 * inter}, DType::kBF16));
  DXS_RETURN_IF_ERROR(CudaStatus(
      cuda::LaunchGroupedGemmFp8(static_cast<const uint8_t*>(a.raw()), sfa.f32(), off, ptrs,
                                 scale_ptrs, num_experts, num_rows, 2 * inter, hidden, gu.raw(),
                                 cuda::ElemType::kBF16, ws.raw(), ws_bytes, stream_),
      "grouped SwiGLU (fp8): gate_up"));
  DXS_ASSIGN_OR_RETURN(Tensor h, Allocate({num_rows, inter}, DType::kF8E4M3));
  DXS_ASSIGN_OR_RETURN(Tensor sfh,
                       Allocate({num_rows * (inter / Tensor::kWeightBlock)}, DType::kF32));
  DXS_RETURN_IF_ERROR(CudaStatus(
      cuda::LaunchSiluMulQuantizeGroupedFp8(gu.raw(), num_rows, inter, off, num_experts,
                                            static_cast<uint8_t*>(h.raw()), sfh.f32(), stream_),
      "grouped SwiGLU (fp8): silu mul"));
  return CudaStatus(cuda::LaunchGroupedGemmFp8(static_cast<const uint8_t*>(h.raw()), sfh.f32(), off,
                                               ptrs + num_experts, scale_ptrs + num_experts,
                                               num_experts, num_rows, hidden, inter, y->raw(),
                                               ToElemType(y->dtype()), ws.raw(), ws_bytes, stream_),
                    "grouped SwiGLU (fp8): down");
}

absl::Status CudaBackend::GroupedSwiGluCutlass(const Tensor& x, const Tensor& expert_offsets,
                                               const ExpertWeightSet& weights, Tensor* y) {
  const int64_t num_experts = weights.pointers.num_elements() / 2, inter = weights.inter;
  const int64_t hidden = x.row_size(), num_rows = x.rows();
  const auto* ptrs = reinterpret_cast<const __nv_bfloat16* const*>(weights.pointers.raw());
  const size_t ws_bytes = std::max(cuda::GroupedGemmWorkspaceBytes(num_experts, num_rows, 2 * inter,
                                                                   hidden, cuda::ElemType::kBF16),
                                   cuda::GroupedGemmWorkspaceBytes(num_experts, num_rows, hidden,
                                                                   inter, ToElemType(y->dtype())));
  if (ws_bytes == 0) return absl::InternalError("grouped SwiGLU: no grouped GEMM workspace size");
  DXS_ASSIGN_OR_RETURN(Tensor ws, Workspace(ws_bytes));
  // gate | up of every row in bf16 (as torch._grouped_mm's MoE does), then silu(gate) * up.
  DXS_ASSIGN_OR_RETURN(Tensor gu, Allocate({num_rows, 2 * inter}, DType::kBF16));
  DXS_ASSIGN_OR_RETURN(Tensor h, Allocate({num_rows, inter}, DType::kBF16));
  const int32_t* off = expert_offsets.i32();
  DXS_RETURN_IF_ERROR(
      CudaStatus(cuda::LaunchGroupedGemmBf16(static_cast<const __nv_bfloat16*>(x.raw()), off, ptrs,
                                             num_experts, num_rows, 2 * inter, hidden, gu.raw(),
                                             cuda::ElemType::kBF16, ws.raw(), ws_bytes, stream_),
                 "grouped SwiGLU: gate_up"));
  DXS_RETURN_IF_ERROR(
      CudaStatus(cuda::LaunchSiluMulPacked(gu.raw(), cuda::ElemType::kBF16, num_rows, inter,
                                           h.raw(), cuda::ElemType::kBF16, stream_),
                 "grouped SwiGLU: silu mul"));
  return CudaStatus(
      cuda::LaunchGroupedGemmBf16(static_cast<const __nv_bfloat16*>(h.raw()), off,
                                  ptrs + num_experts, num_experts, num_rows, hidden, inter,
                                  y->raw(), ToElemType(y->dtype()), ws.raw(), ws_bytes, stream_),
      "grouped SwiGLU: down");
}

absl::Status CudaBackend::GroupedSwiGluCublas(const Tensor& x, const Tensor& expert_offsets,
                                              const std::vector<const Tensor*>& gate_up,
                                              const std::vector<const Tensor*>& down, int64_t inter,
                                              Tensor* y) {
  const int64_t num_experts = static_cast<int64_t>(gate_up.size());
  const int64_t hidden = x.row_size(), num_rows = x.rows();
  std::vector<int32_t> offsets(static_cast<size_t>(num_experts) + 1);
  DXS_RETURN_IF_ERROR(CopyToHost(expert_offsets, DType::kI32, offsets.data()));
  if (offsets[0] != 0 || offsets[num_experts] != num_rows) {
    return absl::InvalidArgumentError("grouped SwiGLU: offsets do not cover the rows");
  }
  int64_t max_rows = 0;
  for (int64_t e = 0; e < num_experts; ++e) {
    const int64_t n = offsets[e + 1] - offsets[e];
    if (n == 0) continue;
    if (n < 0 || gate_up[e] == nullptr) {
      return absl::FailedPreconditionError(
          absl::StrCat("grouped SwiGLU: expert ", e, " has ", n, " rows and no weights here"));
    }
    max_rows = std::max(max_rows, n);
  }
  DXS_ASSIGN_OR_RETURN(Tensor gu, Allocate({max_rows, 2 * inter}, DType::kBF16));
  DXS_ASSIGN_OR_RETURN(Tensor h, Allocate({max_rows, inter}, DType::kBF16));
  const size_t x_row = static_cast<size_t>(hidden) * DTypeSize(x.dtype());
  const size_t y_row = static_cast<size_t>(hidden) * DTypeSize(y->dtype());
  for (int64_t e = 0; e < num_experts; ++e) {
    const int64_t begin = offsets[e], n = offsets[e + 1] - begin;
    if (n == 0) continue;
    const uint8_t* xe = static_cast<const uint8_t*>(x.raw()) + begin * x_row;
    DXS_RETURN_IF_ERROR(Gemm(xe, gate_up[e]->raw(), DType::kBF16, n, 2 * inter, hidden, gu.raw(),
                             DType::kBF16, 0.f, "grouped SwiGLU: gate_up"));
    DXS_RETURN_IF_ERROR(
        CudaStatus(cuda::LaunchSiluMulPacked(gu.raw(), cuda::ElemType::kBF16, n, inter, h.raw(),
                                             cuda::ElemType::kBF16, stream_),
                   "grouped SwiGLU: silu mul"));
    uint8_t* ye = static_cast<uint8_t*>(y->raw()) + begin * y_row;
    DXS_RETURN_IF_ERROR(Gemm(h.raw(), down[e]->raw(), DType::kBF16, n, hidden, inter, ye,
                             y->dtype(), 0.f, "grouped SwiGLU: down"));
  }
  return absl::OkStatus();
}

}  // namespace dxs
