#include "kernels/op_checks.h"

#include <cstdint>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/status_macros.h"
#include "kernels/sampling.h"

namespace dxs {

absl::Status CheckDType(const char* op, const Tensor& t, DType want, const char* what) {
  if (!t.defined()) return absl::InvalidArgumentError(absl::StrCat(op, ": ", what, " is unset"));
  if (t.dtype() != want) {
    return absl::InvalidArgumentError(absl::StrCat(op, ": ", what, " is ",
                                                   std::string(DTypeName(t.dtype())), ", not ",
                                                   std::string(DTypeName(want))));
  }
  return absl::OkStatus();
}

absl::Status CheckSameElements(const char* op, const Tensor& a, const Tensor& b) {
  if (a.num_elements() != b.num_elements()) {
    return absl::InvalidArgumentError(
        absl::StrCat(op, ": ", a.ShapeString(), " and ", b.ShapeString(), " differ in size"));
  }
  return absl::OkStatus();
}

absl::StatusOr<int64_t> CountElements(const char* op, const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t d : shape) {
    if (d < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat(op, ": negative dimension in [", absl::StrJoin(shape, ", "), "]"));
    }
    n *= d;
  }
  return n;
}

absl::Status CheckFloat(const char* op, const Tensor& t, const char* what) {
  if (!t.defined()) return absl::InvalidArgumentError(absl::StrCat(op, ": ", what, " is unset"));
  if (!IsFloatDType(t.dtype())) {
    return absl::InvalidArgumentError(absl::StrCat(
        op, ": ", what, " is ", std::string(DTypeName(t.dtype())), ", not a floating type"));
  }
  return absl::OkStatus();
}

absl::Status CheckDispatchLayoutArgs(const Tensor& ids, const Tensor& weights,
                                     const Tensor& expert_owner, int num_ranks) {
  DXS_RETURN_IF_ERROR(CheckDType("dispatch layout", ids, DType::kI32, "ids"));
  DXS_RETURN_IF_ERROR(CheckDType("dispatch layout", weights, DType::kF32, "weights"));
  DXS_RETURN_IF_ERROR(CheckDType("dispatch layout", expert_owner, DType::kI32, "expert_owner"));
  DXS_RETURN_IF_ERROR(CheckSameElements("dispatch layout", ids, weights));
  if (expert_owner.shape().empty() || expert_owner.shape().size() > 2 || expert_owner.rows() <= 0 ||
      expert_owner.row_size() <= 0) {
    return absl::InvalidArgumentError(absl::StrCat("dispatch layout: expert_owner is ",
                                                   expert_owner.ShapeString(),
                                                   ", not [E] or [E, replicas] with E >= 1"));
  }
  if (num_ranks <= 0) {
    return absl::InvalidArgumentError(absl::StrCat("dispatch layout: ", num_ranks, " ranks"));
  }
  return absl::OkStatus();
}

absl::Status CheckCombineArgs(const Tensor& recv, const Tensor& token_rows,
                              const std::vector<int64_t>& rank_offsets, const Tensor& out) {
  DXS_RETURN_IF_ERROR(CheckDType("combine", token_rows, DType::kI32, "token_rows"));
  const int64_t hidden = out.row_size();
  const int64_t total = rank_offsets.empty() ? 0 : rank_offsets.back();
  if (rank_offsets.empty() || rank_offsets.front() != 0 || recv.rows() < total ||
      token_rows.num_elements() < total || (total > 0 && recv.row_size() != hidden)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "combine: ", total, " rows of ", recv.ShapeString(), " into ", out.ShapeString()));
  }
  if (!IsFloatDType(recv.dtype()) || !IsFloatDType(out.dtype())) {
    return absl::InvalidArgumentError("combine: rows must be floating point");
  }
  for (size_t r = 0; r + 1 < rank_offsets.size(); ++r) {
    if (rank_offsets[r + 1] < rank_offsets[r]) {
      return absl::InvalidArgumentError("combine: rank offsets decrease");
    }
  }
  return absl::OkStatus();
}

absl::Status CheckSortPairsArgs(const Tensor& experts, int num_experts, const Tensor& order,
                                const Tensor& expert_offsets,
                                const std::vector<PairPayload>& payloads) {
  DXS_RETURN_IF_ERROR(CheckDType("sort pairs", experts, DType::kI32, "experts"));
  DXS_RETURN_IF_ERROR(CheckDType("sort pairs", order, DType::kI32, "order"));
  DXS_RETURN_IF_ERROR(CheckDType("sort pairs", expert_offsets, DType::kI32, "expert_offsets"));
  const int64_t n = experts.num_elements();
  if (num_experts <= 0 || order.num_elements() != n ||
      expert_offsets.num_elements() != num_experts + 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("sort pairs: ", n, " pairs over ", num_experts, " experts"));
  }
  if (payloads.size() > static_cast<size_t>(kMaxPairPayloads)) {
    return absl::InvalidArgumentError(absl::StrCat("sort pairs: ", payloads.size(),
                                                   " payloads (at most ", kMaxPairPayloads, ")"));
  }
  for (const PairPayload& p : payloads) {
    if (p.values == nullptr || p.sorted == nullptr) {
      return absl::InvalidArgumentError("sort pairs: a payload without values or output");
    }
    const DType dtype = p.values->dtype();
    if ((dtype != DType::kI32 && dtype != DType::kF32) || p.sorted->dtype() != dtype ||
        p.values->num_elements() != n || p.sorted->num_elements() != n) {
      return absl::InvalidArgumentError(
          absl::StrCat("sort pairs: payload ", p.values->ShapeString(), " into ",
                       p.sorted->ShapeString(), " for ", n, " pairs (i32 or f32, alike)"));
    }
  }
  return absl::OkStatus();
}

absl::Status CheckAddRmsNormArgs(const Tensor& x, const Tensor& weight, const Tensor& residual,
                                 const Tensor& y) {
  DXS_RETURN_IF_ERROR(CheckDType("add rms norm", residual, DType::kF32, "residual"));
  DXS_RETURN_IF_ERROR(CheckFloat("add rms norm", x, "x"));
  DXS_RETURN_IF_ERROR(CheckFloat("add rms norm", weight, "weight"));
  DXS_RETURN_IF_ERROR(CheckFloat("add rms norm", y, "y"));
  DXS_RETURN_IF_ERROR(CheckSameElements("add rms norm", x, residual));
  DXS_RETURN_IF_ERROR(CheckSameElements("add rms norm", x, y));
  const int64_t d = weight.num_elements();
  if (d == 0 || x.num_elements() % d != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("add rms norm: rows of ", d, " do not tile ", x.ShapeString()));
  }
  return absl::OkStatus();
}

absl::Status CheckQkNormRopeArgs(const Tensor& q, const Tensor& k, const Tensor& q_weight,
                                 const Tensor& k_weight, const Tensor& positions) {
  DXS_RETURN_IF_ERROR(CheckDType("qk norm rope", positions, DType::kI32, "positions"));
  DXS_RETURN_IF_ERROR(CheckFloat("qk norm rope", q, "q"));
  DXS_RETURN_IF_ERROR(CheckDType("qk norm rope", k, q.dtype(), "k"));
  DXS_RETURN_IF_ERROR(CheckFloat("qk norm rope", q_weight, "q_weight"));
  DXS_RETURN_IF_ERROR(CheckFloat("qk norm rope", k_weight, "k_weight"));
  if (q.shape().size() != 3 || k.shape().size() != 3 || q.dim(0) != k.dim(0) ||
      q.dim(2) != k.dim(2) || q.dim(2) % 2 != 0 || q.dim(2) == 0) {
    return absl::InvalidArgumentError(absl::StrCat("qk norm rope: q ", q.ShapeString(), " and k ",
                                                   k.ShapeString(),
                                                   " are not [tokens, heads, even head_dim]"));
  }
  const int64_t d = q.dim(2);
  if (q_weight.num_elements() != d || k_weight.num_elements() != d) {
    return absl::InvalidArgumentError(absl::StrCat("qk norm rope: weights ", q_weight.ShapeString(),
                                                   " and ", k_weight.ShapeString(),
                                                   " for head_dim ", d));
  }
  if (positions.num_elements() != q.dim(0)) {
    return absl::InvalidArgumentError(absl::StrCat("qk norm rope: ", positions.num_elements(),
                                                   " positions for ", q.dim(0), " tokens"));
  }
  return absl::OkStatus();
}

absl::Status CheckArgmaxRowsArgs(const Tensor& logits, const Tensor& ids) {
  DXS_RETURN_IF_ERROR(CheckDType("argmax rows", logits, DType::kF32, "logits"));
  DXS_RETURN_IF_ERROR(CheckDType("argmax rows", ids, DType::kI32, "ids"));
  const int64_t n = logits.rows(), vocab = logits.row_size();
  if (ids.num_elements() != n || (n > 0 && vocab <= 0)) {
    return absl::InvalidArgumentError(
        absl::StrCat("argmax rows: ", logits.ShapeString(), " into ", ids.ShapeString()));
  }
  return absl::OkStatus();
}

absl::Status CheckSampleRowsArgs(const Tensor& logits, const Tensor& params,
                                 const Tensor* adjustments, const Tensor& ids) {
  DXS_RETURN_IF_ERROR(CheckDType("sample rows", logits, DType::kF32, "logits"));
  DXS_RETURN_IF_ERROR(CheckDType("sample rows", params, DType::kI64, "params"));
  DXS_RETURN_IF_ERROR(CheckDType("sample rows", ids, DType::kI32, "ids"));
  const int64_t n = logits.rows(), vocab = logits.row_size();
  if (ids.num_elements() != n || params.shape() != std::vector<int64_t>{n, kSamplingRowWords} ||
      (n > 0 && (vocab <= 0 || vocab > INT32_MAX))) {
    return absl::InvalidArgumentError(absl::StrCat("sample rows: ", logits.ShapeString(),
                                                   " with params ", params.ShapeString(), " into ",
                                                   ids.ShapeString()));
  }
  if (adjustments != nullptr) {
    DXS_RETURN_IF_ERROR(CheckDType("sample rows", *adjustments, DType::kI32, "adjustments"));
    if (adjustments->shape().size() != 2 || adjustments->shape()[1] != kLogitAdjustmentWords ||
        adjustments->rows() > INT32_MAX) {
      return absl::InvalidArgumentError(absl::StrCat("sample rows: adjustments ",
                                                     adjustments->ShapeString(), ", want [m, ",
                                                     kLogitAdjustmentWords, "]"));
    }
  }
  return absl::OkStatus();
}

absl::Status CheckCountPendingTokensArgs(const Tensor& tokens, const Tensor& params,
                                         const Tensor& adjustments) {
  DXS_RETURN_IF_ERROR(CheckDType("count pending tokens", tokens, DType::kI32, "tokens"));
  DXS_RETURN_IF_ERROR(CheckDType("count pending tokens", params, DType::kI64, "params"));
  DXS_RETURN_IF_ERROR(CheckDType("count pending tokens", adjustments, DType::kI32, "adjustments"));
  const int64_t n = tokens.num_elements();
  if (params.shape() != std::vector<int64_t>{n, kSamplingRowWords} ||
      adjustments.shape().size() != 2 || adjustments.shape()[1] != kLogitAdjustmentWords ||
      adjustments.rows() > INT32_MAX) {
    return absl::InvalidArgumentError(
        absl::StrCat("count pending tokens: tokens ", tokens.ShapeString(), " with params ",
                     params.ShapeString(), " into adjustments ", adjustments.ShapeString()));
  }
  return absl::OkStatus();
}

absl::Status CheckLogprobRowsArgs(const Tensor& logits, const Tensor& sampled, const Tensor& named,
                                  const Tensor& sampled_logprobs, const Tensor& named_logprobs,
                                  const Tensor& top_ids, const Tensor& top_logprobs) {
  DXS_RETURN_IF_ERROR(CheckDType("logprob rows", logits, DType::kF32, "logits"));
  DXS_RETURN_IF_ERROR(CheckDType("logprob rows", sampled, DType::kI32, "sampled"));
  DXS_RETURN_IF_ERROR(CheckDType("logprob rows", named, DType::kI32, "named"));
  DXS_RETURN_IF_ERROR(
      CheckDType("logprob rows", sampled_logprobs, DType::kF32, "sampled_logprobs"));
  DXS_RETURN_IF_ERROR(CheckDType("logprob rows", named_logprobs, DType::kF32, "named_logprobs"));
  DXS_RETURN_IF_ERROR(CheckDType("logprob rows", top_ids, DType::kI32, "top_ids"));
  DXS_RETURN_IF_ERROR(CheckDType("logprob rows", top_logprobs, DType::kF32, "top_logprobs"));
  const int64_t n = logits.rows(), vocab = logits.row_size();
  auto matrix = [n](const Tensor& t) { return t.shape().size() == 2 && t.shape()[0] == n; };
  const bool ok = (n == 0 || (vocab > 0 && vocab <= INT32_MAX)) && sampled.num_elements() == n &&
                  sampled_logprobs.num_elements() == n && matrix(named) &&
                  named_logprobs.shape() == named.shape() && matrix(top_ids) &&
                  top_logprobs.shape() == top_ids.shape() && top_ids.shape()[1] <= kMaxTopLogprobs;
  if (!ok) {
    return absl::InvalidArgumentError(
        absl::StrCat("logprob rows: ", logits.ShapeString(), " with sampled ",
                     sampled.ShapeString(), ", named ", named.ShapeString(), " into ",
                     sampled_logprobs.ShapeString(), ", ", named_logprobs.ShapeString(), ", ",
                     top_ids.ShapeString(), ", ", top_logprobs.ShapeString()));
  }
  return absl::OkStatus();
}

absl::Status CheckSamplingRow(int64_t row, const SamplingRow& params) {
  absl::Status s = ValidateSamplingParams(FromSamplingRow(params));
  for (int32_t r : params.reserved) {
    if (s.ok() && r != 0)
      s = absl::InvalidArgumentError(absl::StrCat("reserved must be 0, got ", r));
  }
  if (s.ok() && (params.adjust_begin < 0 || params.adjust_count < 0)) {
    s = absl::InvalidArgumentError(absl::StrCat("adjustments [", params.adjust_begin, ", +",
                                                params.adjust_count, ") are negative"));
  }
  if (s.ok()) return s;
  return absl::InvalidArgumentError(absl::StrCat("sample rows: row ", row, ": ", s.message()));
}

absl::Status CheckAccumulateCountsArgs(const Tensor& offsets, const Tensor& counts) {
  DXS_RETURN_IF_ERROR(CheckDType("accumulate counts", offsets, DType::kI32, "offsets"));
  DXS_RETURN_IF_ERROR(CheckDType("accumulate counts", counts, DType::kI64, "counts"));
  if (offsets.num_elements() != counts.num_elements() + 1) {
    return absl::InvalidArgumentError(absl::StrCat("accumulate counts: ", offsets.ShapeString(),
                                                   " offsets for ", counts.ShapeString()));
  }
  return absl::OkStatus();
}

absl::Status CheckUnpackRoutedPairsArgs(const Tensor& blocks,
                                        const std::vector<PairSegment>& segments,
                                        const Tensor& held, const Tensor& rows,
                                        const Tensor& experts, const Tensor& weights,
                                        const Tensor& bad) {
  constexpr const char* kOp = "unpack routed pairs";
  DXS_RETURN_IF_ERROR(CheckDType(kOp, blocks, DType::kI32, "blocks"));
  DXS_RETURN_IF_ERROR(CheckDType(kOp, held, DType::kI32, "held"));
  DXS_RETURN_IF_ERROR(CheckDType(kOp, rows, DType::kI32, "rows"));
  DXS_RETURN_IF_ERROR(CheckDType(kOp, experts, DType::kI32, "experts"));
  DXS_RETURN_IF_ERROR(CheckDType(kOp, weights, DType::kF32, "weights"));
  DXS_RETURN_IF_ERROR(CheckDType(kOp, bad, DType::kI32, "bad"));
  const int64_t p = rows.num_elements();
  if (blocks.num_elements() < 3 * p || experts.num_elements() != p || weights.num_elements() != p ||
      bad.num_elements() != 2) {
    return absl::InvalidArgumentError(absl::StrCat(
        kOp, ": ", p, " pairs from ", blocks.ShapeString(), " blocks into ", experts.ShapeString(),
        " experts, ", weights.ShapeString(), " weights and ", bad.ShapeString(), " bad"));
  }
  if (segments.size() > static_cast<size_t>(kMaxPairSegments)) {
    return absl::InvalidArgumentError(
        absl::StrCat(kOp, ": ", segments.size(), " segments, at most ", kMaxPairSegments));
  }
  int64_t next = 0;
  for (const PairSegment& s : segments) {
    if (s.first_pair != next || s.num_pairs < 0 || s.num_rows < 0 || s.row_offset < 0 ||
        (s.num_pairs > 0 && s.num_rows == 0)) {
      return absl::InvalidArgumentError(
          absl::StrCat(kOp, ": segments do not tile the ", p, " pairs in order"));
    }
    next += s.num_pairs;
  }
  if (next != p) {
    return absl::InvalidArgumentError(
        absl::StrCat(kOp, ": segments hold ", next, " pairs, not ", p));
  }
  return absl::OkStatus();
}

absl::Status CheckPagedAttentionMeta(const char* op, const PagedAttentionMeta& meta,
                                     int64_t num_tokens) {
  DXS_RETURN_IF_ERROR(CheckDType(op, meta.query_start, DType::kI32, "query_start"));
  DXS_RETURN_IF_ERROR(CheckDType(op, meta.context_lens, DType::kI32, "context_lens"));
  DXS_RETURN_IF_ERROR(CheckDType(op, meta.block_tables, DType::kI32, "block_tables"));
  DXS_RETURN_IF_ERROR(CheckDType(op, meta.slot_mapping, DType::kI64, "slot_mapping"));
  if (meta.block_size <= 0 || meta.query_start.num_elements() != meta.num_seqs + 1 ||
      meta.context_lens.num_elements() != meta.num_seqs ||
      meta.block_tables.num_elements() != meta.num_seqs * meta.max_blocks_per_seq ||
      meta.slot_mapping.num_elements() != num_tokens) {
    return absl::InvalidArgumentError(absl::StrCat(
        op, ": metadata for ", meta.num_seqs, " sequences does not fit ", num_tokens, " tokens"));
  }
  return absl::OkStatus();
}

namespace {

// The record geometry of FP8 rows of `hidden` values, checked.
absl::Status CheckFp8Records(const char* op, int64_t hidden, const Tensor& records) {
  if (hidden <= 0 || hidden % 4 != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(op, ": rows of ", hidden, " values (FP8 records need a multiple of 4)"));
  }
  if (records.dtype() != DType::kF8E4M3 || records.row_size() != Fp8RecordBytes(hidden)) {
    return absl::InvalidArgumentError(
        absl::StrCat(op, ": records ", records.ShapeString(), " ",
                     std::string(DTypeName(records.dtype())), " for rows of ", hidden, " (want ",
                     Fp8RecordBytes(hidden), " bytes of float8_e4m3 a row)"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status CheckQuantizeRowsFp8Args(const Tensor& src, const Tensor& rows,
                                      const Tensor& records) {
  const char* op = "quantize rows (fp8)";
  DXS_RETURN_IF_ERROR(CheckDType(op, rows, DType::kI32, "rows"));
  DXS_RETURN_IF_ERROR(CheckFloat(op, src, "src"));
  const int64_t hidden = src.row_size(), n = rows.num_elements();
  DXS_RETURN_IF_ERROR(CheckFp8Records(op, hidden, records));
  if (records.rows() < n) {
    return absl::InvalidArgumentError(
        absl::StrCat(op, ": ", n, " rows into ", records.ShapeString()));
  }
  return absl::OkStatus();
}

absl::Status CheckDequantizeRowsFp8Args(const Tensor& records, const Tensor& dst) {
  const char* op = "dequantize rows (fp8)";
  DXS_RETURN_IF_ERROR(CheckFloat(op, dst, "dst"));
  const int64_t n = records.rows();
  DXS_RETURN_IF_ERROR(CheckFp8Records(op, dst.row_size(), records));
  if (dst.rows() < n) {
    return absl::InvalidArgumentError(
        absl::StrCat(op, ": ", records.ShapeString(), " into ", dst.ShapeString()));
  }
  return absl::OkStatus();
}

}  // namespace dxs
