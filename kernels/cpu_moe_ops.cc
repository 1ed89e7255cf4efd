// CPU backend: routing (top-k softmax), the dispatch layout, the combine's weighted sum and
// the grouped expert FFN.

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "kernels/cpu_backend.h"
#include "kernels/replica_choice.h"
#include "kernels/sampling.h"
#include "kernels/topk_softmax.h"

namespace dxs {

absl::Status CpuBackend::TopKSoftmax(const Tensor& logits, int top_k, bool normalize, Tensor* ids,
                                     Tensor* weights) {
  const int64_t tokens = logits.rows(), experts = logits.row_size();
  DXS_RETURN_IF_ERROR(ValidateTopKArgs(tokens, experts, top_k));
  DXS_RETURN_IF_ERROR(CheckDType("top-k softmax", logits, DType::kF32, "logits"));
  DXS_RETURN_IF_ERROR(CheckDType("top-k softmax", *ids, DType::kI32, "ids"));
  DXS_RETURN_IF_ERROR(CheckDType("top-k softmax", *weights, DType::kF32, "weights"));
  if (ids->num_elements() != tokens * top_k || weights->num_elements() != tokens * top_k) {
    return absl::InvalidArgumentError(
        absl::StrCat("top-k softmax: outputs ", ids->ShapeString(), " for ", tokens, " x ", top_k));
  }
  return TopKSoftmaxCpu(logits.f32(), tokens, experts, top_k, normalize, ids->i32(),
                        weights->f32());
}

absl::Status CpuBackend::ComputeDispatchLayout(const Tensor& ids, const Tensor& weights,
                                               const Tensor& expert_owner, int num_ranks,
                                               DispatchLayoutTensors* layout) {
  DXS_RETURN_IF_ERROR(CheckDispatchLayoutArgs(ids, weights, expert_owner, num_ranks));
  const int64_t num_tokens = ids.rows(), top_k = ids.rows() > 0 ? ids.row_size() : 0;
  const int64_t num_pairs = ids.num_elements(), num_experts = expert_owner.rows();
  const int64_t num_slots = expert_owner.row_size();
  const int64_t max_token_rows = num_tokens * std::min<int64_t>(top_k, num_ranks);
  DXS_ASSIGN_OR_RETURN(layout->num_tokens_per_rank, Allocate({num_ranks}, DType::kI32));
  DXS_ASSIGN_OR_RETURN(layout->num_pairs_per_rank, Allocate({num_ranks}, DType::kI32));
  DXS_ASSIGN_OR_RETURN(layout->num_tokens_per_expert, Allocate({num_experts}, DType::kI32));
  DXS_ASSIGN_OR_RETURN(layout->token_rows, Allocate({max_token_rows}, DType::kI32));
  DXS_ASSIGN_OR_RETURN(layout->pairs, Allocate({3 * num_pairs}, DType::kI32));
  const int32_t* id = ids.i32();
  const float* weight = weights.f32();
  const int32_t* table = expert_owner.i32();
  int32_t* per_expert = layout->num_tokens_per_expert.i32();
  std::fill(per_expert, per_expert + num_experts, 0);
  // Each pair's rank: the replica choice of dataplane/dispatch/placement.h.
  thread_local std::vector<int32_t> pair_rank;
  pair_rank.resize(static_cast<size_t>(num_pairs));
  for (int64_t p = 0; p < num_pairs; ++p) {
    const int64_t t = p / std::max<int64_t>(top_k, 1);
    const int r = id[p] < 0 || id[p] >= num_experts
                      ? -1
                      : ChooseReplicaRank(table + id[p] * num_slots, num_slots, t);
    if (r < 0 || r >= num_ranks) {
      return absl::InvalidArgumentError(absl::StrCat("dispatch layout: expert ", id[p],
                                                     " has no owner among ", num_ranks, " ranks"));
    }
    pair_rank[p] = r;
    ++per_expert[id[p]];
  }
  int32_t* token_count = layout->num_tokens_per_rank.i32();
  int32_t* pair_count = layout->num_pairs_per_rank.i32();
  if (num_ranks == 1) {
    // One rank holds every expert: it gets every token in order, the pairs as routed.
    token_count[0] = static_cast<int32_t>(num_tokens);
    pair_count[0] = static_cast<int32_t>(num_pairs);
    std::iota(layout->token_rows.i32(), layout->token_rows.i32() + num_tokens, 0);
    for (int64_t t = 0; t < num_tokens; ++t) {
      std::fill_n(layout->pairs.i32() + t * top_k, top_k, static_cast<int32_t>(t));
    }
    if (num_pairs > 0) {
      std::memcpy(layout->pairs.i32() + num_pairs, id, num_pairs * sizeof(int32_t));
      std::memcpy(layout->pairs.i32() + 2 * num_pairs, weight, num_pairs * sizeof(float));
    }
    return absl::OkStatus();
  }
  // Two passes: count each rank's tokens and pairs, then fill through per-rank cursors. A
  // token is new to rank r when r last saw an earlier token.
  std::fill(token_count, token_count + num_ranks, 0);
  std::fill(pair_count, pair_count + num_ranks, 0);
  std::vector<int64_t> last_token(num_ranks, -1);
  for (int64_t t = 0; t < num_tokens; ++t) {
    for (int64_t k = 0; k < top_k; ++k) {
      const int r = pair_rank[t * top_k + k];
      ++pair_count[r];
      if (last_token[r] != t) {
        last_token[r] = t;
        ++token_count[r];
      }
    }
  }
  // Rank r's pair block is rows | experts | weights, p_r each, from 3 * pair_off[r] on.
  struct Cursor {
    int64_t token;  // next slot in token_rows
    int32_t* rows;  // next pair slots of the rank's block
    int32_t* experts;
    float* weights;
    int32_t next_row;  // the rank's next local row
  };
  std::vector<Cursor> cursor(num_ranks);
  int64_t token_offset = 0, pair_offset = 0;
  int32_t* const blocks = layout->pairs.i32();
  for (int r = 0; r < num_ranks; ++r) {
    int32_t* block = blocks + 3 * pair_offset;
    cursor[r] = {token_offset, block, block + pair_count[r],
                 reinterpret_cast<float*>(block + 2 * pair_count[r]), 0};
    token_offset += token_count[r];
    pair_offset += pair_count[r];
  }
  int32_t* token_rows = layout->token_rows.i32();
  std::fill(last_token.begin(), last_token.end(), -1);
  for (int64_t t = 0; t < num_tokens; ++t) {
    for (int64_t k = 0; k < top_k; ++k) {
      const int32_t expert = id[t * top_k + k];
      const int r = pair_rank[t * top_k + k];
      Cursor& c = cursor[r];
      if (last_token[r] != t) {
        last_token[r] = t;
        token_rows[c.token++] = static_cast<int32_t>(t);
        ++c.next_row;
      }
      *c.rows++ = c.next_row - 1;
      *c.experts++ = expert;
      *c.weights++ = weight[t * top_k + k];
    }
  }
  return absl::OkStatus();
}

absl::Status CpuBackend::CombineRows(const Tensor& recv, const Tensor& token_rows,
                                     const std::vector<int64_t>& rank_offsets, Tensor* out) {
  DXS_RETURN_IF_ERROR(CheckCombineArgs(recv, token_rows, rank_offsets, *out));
  const int64_t num_tokens = out->rows(), hidden = out->row_size();
  // The first rank holding a token writes it, later ones add; tokens no rank holds are
  // zeroed. A narrower output is summed in float32 and rounded once.
  thread_local std::vector<float> wide_sum, wide_row;
  thread_local std::vector<uint8_t> touched;
  const bool sum_in_out = out->dtype() == DType::kF32;
  if (!sum_in_out) wide_sum.resize(static_cast<size_t>(num_tokens * hidden));
  float* const sum = sum_in_out ? out->f32() : wide_sum.data();
  touched.assign(static_cast<size_t>(num_tokens), 0);
  wide_row.resize(static_cast<size_t>(hidden));
  const size_t row_bytes = static_cast<size_t>(hidden) * DTypeSize(recv.dtype());
  const uint8_t* src = static_cast<const uint8_t*>(recv.raw());
  const int32_t* rows = token_rows.i32();
  for (size_t r = 0; r + 1 < rank_offsets.size(); ++r) {
    for (int64_t i = rank_offsets[r]; i < rank_offsets[r + 1]; ++i) {
      const int32_t t = rows[i];
      if (t < 0 || t >= num_tokens) {
        return absl::InvalidArgumentError(
            absl::StrCat("combine: token ", t, " outside [0, ", num_tokens, ")"));
      }
      const uint8_t* row = src + i * row_bytes;
      float* dst = sum + static_cast<int64_t>(t) * hidden;
      if (!touched[t]) {
        WidenToFloat32(recv.dtype(), row, static_cast<size_t>(hidden), dst);
        touched[t] = 1;
        continue;
      }
      const float* add = reinterpret_cast<const float*>(row);
      if (recv.dtype() != DType::kF32) {
        WidenToFloat32(recv.dtype(), row, static_cast<size_t>(hidden), wide_row.data());
        add = wide_row.data();
      }
      for (int64_t j = 0; j < hidden; ++j) dst[j] += add[j];
    }
  }
  for (int64_t t = 0; t < num_tokens; ++t) {
    if (!touched[t]) std::fill(sum + t * hidden, sum + (t + 1) * hidden, 0.f);
  }
  if (!sum_in_out) {
    NarrowFromFloat32(out->dtype(), sum, static_cast<size_t>(num_tokens * hidden), out->raw());
  }
  return absl::OkStatus();
}

absl::Status CpuBackend::SortPairsByExpert(const Tensor& experts, int num_experts, Tensor* order,
                                           Tensor* expert_offsets,
                                           const std::vector<PairPayload>& payloads) {
  DXS_RETURN_IF_ERROR(CheckSortPairsArgs(experts, num_experts, *order, *expert_offsets, payloads));
  const int64_t n = experts.num_elements();
  // A counting sort: stable, one pass to count, one to place.
  int32_t* offsets = expert_offsets->i32();
  std::fill(offsets, offsets + num_experts + 1, 0);
  const int32_t* e = experts.i32();
  for (int64_t p = 0; p < n; ++p) {
    if (e[p] < 0 || e[p] >= num_experts) {
      return absl::InvalidArgumentError(
          absl::StrCat("sort pairs: expert ", e[p], " outside [0, ", num_experts, ")"));
    }
    ++offsets[e[p] + 1];
  }
  for (int x = 0; x < num_experts; ++x) offsets[x + 1] += offsets[x];
  thread_local std::vector<int32_t> next;
  next.assign(offsets, offsets + num_experts);
  int32_t* o = order->i32();
  for (int64_t p = 0; p < n; ++p) o[next[e[p]]++] = static_cast<int32_t>(p);
  for (const PairPayload& payload : payloads) {  // 32-bit elements, moved as bits
    const uint32_t* in = static_cast<const uint32_t*>(payload.values->raw());
    uint32_t* out = static_cast<uint32_t*>(payload.sorted->raw());
    for (int64_t s = 0; s < n; ++s) out[s] = in[o[s]];
  }
  return absl::OkStatus();
}

absl::Status CpuBackend::GroupedSwiGlu(const Tensor& xs, const Tensor* rows,
                                       const Tensor& expert_offsets,
                                       const std::vector<const Tensor*>& gate_up,
                                       const std::vector<const Tensor*>& down, Tensor* y) {
  DXS_RETURN_IF_ERROR(CheckDType("grouped SwiGLU", expert_offsets, DType::kI32, "offsets"));
  if (rows != nullptr)
    DXS_RETURN_IF_ERROR(CheckDType("grouped SwiGLU", *rows, DType::kI32, "rows"));
  if (rows == nullptr) DXS_RETURN_IF_ERROR(CheckDType("grouped SwiGLU", xs, DType::kF32, "xs"));
  const int64_t num_experts = expert_offsets.num_elements() - 1;
  const int64_t hidden = xs.row_size();
  const int64_t num_rows = rows != nullptr ? rows->num_elements() : xs.rows();
  if (num_experts < 0 || static_cast<int64_t>(gate_up.size()) != num_experts ||
      down.size() != gate_up.size() || y->rows() != num_rows || y->row_size() != hidden ||
      !IsFloatDType(xs.dtype())) {
    return absl::InvalidArgumentError(absl::StrCat("grouped SwiGLU: ", xs.ShapeString(), " over ",
                                                   num_experts, " experts into ",
                                                   y->ShapeString()));
  }
  const int32_t* offsets = expert_offsets.i32();
  if (num_experts > 0 && (offsets[0] != 0 || offsets[num_experts] != num_rows)) {
    return absl::InvalidArgumentError("grouped SwiGLU: offsets do not cover the rows");
  }
  thread_local std::vector<float> x_rows, gate_rows, up_rows;
  const size_t in_row_bytes = static_cast<size_t>(hidden) * DTypeSize(xs.dtype());
  const uint8_t* in = static_cast<const uint8_t*>(xs.raw());
  for (int64_t e = 0; e < num_experts; ++e) {
    const int64_t begin = offsets[e], n = offsets[e + 1] - begin;
    if (n == 0) continue;  // no rows: no GEMM
    if (n < 0 || gate_up[e] == nullptr || down[e] == nullptr) {
      return absl::FailedPreconditionError(
          absl::StrCat("grouped SwiGLU: expert ", e, " has ", n, " rows and no weights here"));
    }
    const float* x = nullptr;
    if (rows == nullptr) {
      x = xs.f32() + begin * hidden;
    } else {
      // This expert's rows, gathered (and widened) into a cache-resident block.
      x_rows.resize(static_cast<size_t>(n * hidden));
      for (int64_t i = 0; i < n; ++i) {
        const int32_t r = rows->i32()[begin + i];
        if (r < 0 || r >= xs.rows()) {
          return absl::InvalidArgumentError(
              absl::StrCat("grouped SwiGLU: row ", r, " outside [0, ", xs.rows(), ")"));
        }
        WidenToFloat32(xs.dtype(), in + static_cast<int64_t>(r) * in_row_bytes,
                       static_cast<size_t>(hidden), x_rows.data() + i * hidden);
      }
      x = x_rows.data();
    }
    const int64_t inter = down[e]->row_size();
    if (gate_up[e]->rows() != 2 * inter || gate_up[e]->row_size() != hidden ||
        down[e]->rows() != hidden) {
      return absl::InvalidArgumentError(
          absl::StrCat("grouped SwiGLU: expert ", e, " weights ", gate_up[e]->ShapeString(), " / ",
                       down[e]->ShapeString(), " for hidden ", hidden));
    }
    // The gate and up halves of the packed weight, each on its own: the same sums, in the
    // same order, as with separate weights (and, row by row, whatever other rows the expert
    // has: CpuRowsTimesWeight).
    const float* gate_w = gate_up[e]->f32();
    const float* up_w = gate_w + inter * hidden;
    gate_rows.resize(static_cast<size_t>(n * inter));
    up_rows.resize(static_cast<size_t>(n * inter));
    CpuRowsTimesWeight(x, n, gate_w, inter, hidden, gate_rows.data());
    CpuRowsTimesWeight(x, n, up_w, inter, hidden, up_rows.data());
    float* g = gate_rows.data();
    const float* u = up_rows.data();
    for (int64_t i = 0; i < n * inter; ++i) g[i] = g[i] / (1.f + std::exp(-g[i])) * u[i];
    CpuRowsTimesWeight(g, n, down[e]->f32(), hidden, inter, y->f32() + begin * hidden);
  }
  return absl::OkStatus();
}

absl::Status CpuBackend::ArgmaxRows(const Tensor& logits, Tensor* ids) {
  DXS_RETURN_IF_ERROR(CheckArgmaxRowsArgs(logits, *ids));
  const int64_t n = logits.rows(), vocab = logits.row_size();
  for (int64_t i = 0; i < n; ++i) ids->i32()[i] = Argmax(logits.f32() + i * vocab, vocab);
  return absl::OkStatus();
}

absl::Status CpuBackend::CountPendingTokens(const Tensor& tokens, const Tensor& params,
                                            Tensor* adjustments) {
  DXS_RETURN_IF_ERROR(CheckCountPendingTokensArgs(tokens, params, *adjustments));
  const int64_t n = tokens.num_elements(), m = adjustments->rows();
  const auto* rows = reinterpret_cast<const SamplingRow*>(params.i64());
  auto* adjust = reinterpret_cast<LogitAdjustment*>(adjustments->i32());
  for (int64_t i = 0; i < n; ++i) {
    const SamplingRow& row = rows[i];
    if (row.adjust_begin < 0 || row.adjust_count < 0 ||
        int64_t{row.adjust_begin} + row.adjust_count > m) {
      return absl::InvalidArgumentError(absl::StrCat("count pending tokens: row ", i,
                                                     "'s adjustments [", row.adjust_begin, ", +",
                                                     row.adjust_count, ") exceed ", m));
    }
    CountPendingToken(tokens.i32()[i], adjust + row.adjust_begin,
                      static_cast<size_t>(row.adjust_count));
  }
  return absl::OkStatus();
}

absl::Status CpuBackend::SampleRows(const Tensor& logits, const Tensor& params,
                                    const Tensor* adjustments, Tensor* ids) {
  DXS_RETURN_IF_ERROR(CheckSampleRowsArgs(logits, params, adjustments, *ids));
  const int64_t n = logits.rows(), vocab = logits.row_size();
  const int64_t num_adjust = adjustments != nullptr ? adjustments->rows() : 0;
  const auto* rows = reinterpret_cast<const SamplingRow*>(params.i64());
  const auto* adjust =
      num_adjust > 0 ? reinterpret_cast<const LogitAdjustment*>(adjustments->i32()) : nullptr;
  for (int64_t i = 0; i < n; ++i) {
    DXS_RETURN_IF_ERROR(CheckSamplingRow(i, rows[i]));
    if (int64_t{rows[i].adjust_begin} + rows[i].adjust_count > num_adjust) {
      return absl::InvalidArgumentError(
          absl::StrCat("sample rows: row ", i, "'s adjustments [", rows[i].adjust_begin, ", +",
                       rows[i].adjust_count, ") exceed ", num_adjust));
    }
    for (int32_t a = 0; a < rows[i].adjust_count; ++a) {
      const int32_t t = adjust[rows[i].adjust_begin + a].token;
      if (t < 0 || t >= vocab) {
        return absl::InvalidArgumentError(absl::StrCat("sample rows: row ", i, " adjusts token ", t,
                                                       ", outside [0, ", vocab, ")"));
      }
    }
  }
  SamplingScratch scratch;
  std::vector<float> adjusted;
  for (int64_t i = 0; i < n; ++i) {
    const float* row = logits.f32() + i * vocab;
    const SamplingParams p = FromSamplingRow(rows[i]);
    if (rows[i].adjust_count > 0) {
      adjusted.assign(row, row + vocab);
      ApplyLogitAdjustments(p, adjust + rows[i].adjust_begin, rows[i].adjust_count,
                            adjusted.data());
      row = adjusted.data();
    }
    ids->i32()[i] = SampleToken(row, vocab, p, rows[i].draw, &scratch);
  }
  return absl::OkStatus();
}

absl::Status CpuBackend::LogprobRows(const Tensor& logits, const Tensor& sampled,
                                     const Tensor& named, Tensor* sampled_logprobs,
                                     Tensor* named_logprobs, Tensor* top_ids,
                                     Tensor* top_logprobs) {
  DXS_RETURN_IF_ERROR(CheckLogprobRowsArgs(logits, sampled, named, *sampled_logprobs,
                                           *named_logprobs, *top_ids, *top_logprobs));
  const int64_t n = logits.rows(), vocab = logits.row_size();
  const int64_t m = named.shape()[1], k = top_ids->shape()[1];
  for (int64_t i = 0; i < n * m; ++i) {
    if (named.i32()[i] < -1 || named.i32()[i] >= vocab) {
      return absl::InvalidArgumentError(
          absl::StrCat("logprob rows: named id ", named.i32()[i], " is outside [0, ", vocab, ")"));
    }
  }
  for (int64_t i = 0; i < n; ++i) {
    if (sampled.i32()[i] < 0 || sampled.i32()[i] >= vocab) {
      return absl::InvalidArgumentError(absl::StrCat("logprob rows: sampled id ", sampled.i32()[i],
                                                     " is outside [0, ", vocab, ")"));
    }
  }
  TokenLogprobs lp;
  std::vector<int32_t> ids;
  for (int64_t i = 0; i < n; ++i) {
    ids.clear();
    for (int64_t j = 0; j < m; ++j) ids.push_back(std::max(named.i32()[i * m + j], 0));
    RowLogprobs(logits.f32() + i * vocab, vocab, sampled.i32()[i], static_cast<int32_t>(k), ids,
                &lp);
    sampled_logprobs->f32()[i] = lp.logprob;
    for (int64_t j = 0; j < m; ++j) {
      named_logprobs->f32()[i * m + j] = named.i32()[i * m + j] < 0 ? 0.f : lp.named[j];
    }
    for (int64_t j = 0; j < k; ++j) {  // a vocabulary smaller than k leaves -1 and -inf
      const bool has = j < static_cast<int64_t>(lp.top.size());
      top_ids->i32()[i * k + j] = has ? lp.top[j].first : -1;
      top_logprobs->f32()[i * k + j] = has ? lp.top[j].second : -INFINITY;
    }
  }
  return absl::OkStatus();
}

absl::Status CpuBackend::AccumulateCounts(const Tensor& offsets, Tensor* counts) {
  DXS_RETURN_IF_ERROR(CheckAccumulateCountsArgs(offsets, *counts));
  const int32_t* off = offsets.i32();
  for (int64_t e = 0; e < counts->num_elements(); ++e) counts->i64()[e] += off[e + 1] - off[e];
  return absl::OkStatus();
}

absl::Status CpuBackend::QuantizeRowsFp8(const Tensor& src, const Tensor& rows, Tensor* records) {
  const char* op = "quantize rows (fp8)";
  DXS_RETURN_IF_ERROR(CheckQuantizeRowsFp8Args(src, rows, *records));
  const int64_t hidden = src.row_size(), n = rows.num_elements();
  const int64_t groups = (hidden + kFp8GroupSize - 1) / kFp8GroupSize;
  const size_t src_row = static_cast<size_t>(hidden) * DTypeSize(src.dtype());
  const uint8_t* in = static_cast<const uint8_t*>(src.raw());
  uint8_t* out = static_cast<uint8_t*>(records->raw());
  const int32_t* r = rows.i32();
  std::vector<float> row(static_cast<size_t>(hidden));
  for (int64_t i = 0; i < n; ++i) {
    if (r[i] < 0 || r[i] >= src.rows()) {
      return absl::InvalidArgumentError(
          absl::StrCat(op, ": row ", r[i], " outside [0, ", src.rows(), ")"));
    }
    WidenToFloat32(src.dtype(), in + static_cast<size_t>(r[i]) * src_row, row.size(), row.data());
    uint8_t* record = out + i * Fp8RecordBytes(hidden);
    uint8_t* values = record + 4 * groups;
    for (int64_t g = 0; g < groups; ++g) {
      const int64_t begin = g * kFp8GroupSize, end = std::min(hidden, begin + kFp8GroupSize);
      float amax = 0.f;
      for (int64_t j = begin; j < end; ++j) amax = std::max(amax, std::fabs(row[j]));
      const float scale = std::max(amax, 1e-4f) / kFp8E4m3Max;
      std::memcpy(record + 4 * g, &scale, sizeof(scale));
      for (int64_t j = begin; j < end; ++j) values[j] = FloatToFp8E4m3(row[j] / scale);
    }
  }
  return absl::OkStatus();
}

absl::Status CpuBackend::DequantizeRowsFp8(const Tensor& records, Tensor* dst) {
  DXS_RETURN_IF_ERROR(CheckDequantizeRowsFp8Args(records, *dst));
  const int64_t hidden = dst->row_size(), n = records.rows();
  const int64_t groups = (hidden + kFp8GroupSize - 1) / kFp8GroupSize;
  const size_t dst_row = static_cast<size_t>(hidden) * DTypeSize(dst->dtype());
  const uint8_t* in = static_cast<const uint8_t*>(records.raw());
  uint8_t* out = static_cast<uint8_t*>(dst->raw());
  std::vector<float> row(static_cast<size_t>(hidden));
  for (int64_t i = 0; i < n; ++i) {
    const uint8_t* record = in + i * Fp8RecordBytes(hidden);
    const uint8_t* values = record + 4 * groups;
    for (int64_t g = 0; g < groups; ++g) {
      float scale;
      std::memcpy(&scale, record + 4 * g, sizeof(scale));
      const int64_t begin = g * kFp8GroupSize, end = std::min(hidden, begin + kFp8GroupSize);
      for (int64_t j = begin; j < end; ++j) row[j] = Fp8E4m3ToFloat(values[j]) * scale;
    }
    NarrowFromFloat32(dst->dtype(), row.data(), row.size(), out + i * dst_row);
  }
  return absl::OkStatus();
}

absl::Status CpuBackend::UnpackRoutedPairs(const Tensor& blocks,
                                           const std::vector<PairSegment>& segments,
                                           const Tensor& held, Tensor* rows, Tensor* experts,
                                           Tensor* weights, Tensor* bad) {
  DXS_RETURN_IF_ERROR(
      CheckUnpackRoutedPairsArgs(blocks, segments, held, *rows, *experts, *weights, *bad));
  if (rows->num_elements() == 0) return absl::OkStatus();  // as a device: bad untouched
  const int32_t* in = blocks.i32();
  const int32_t* is_held = held.i32();
  const int64_t num_experts = held.num_elements();
  int32_t lowest_held = 0;
  while (lowest_held + 1 < num_experts && is_held[lowest_held] == 0) ++lowest_held;
  int32_t num_bad = 0, first_bad = std::numeric_limits<int32_t>::max();
  for (const PairSegment& s : segments) {
    const int32_t* seg_rows = in + 3 * static_cast<int64_t>(s.first_pair);
    const int32_t* seg_experts = seg_rows + s.num_pairs;
    const int32_t* seg_weights = seg_experts + s.num_pairs;
    for (int32_t k = 0; k < s.num_pairs; ++k) {
      const int64_t p = s.first_pair + k;
      const int32_t row = seg_rows[k], expert = seg_experts[k];
      const bool ok = row >= 0 && row < s.num_rows && expert >= 0 && expert < num_experts &&
                      is_held[expert] != 0;
      if (!ok) {
        ++num_bad;
        first_bad = std::min(first_bad, static_cast<int32_t>(p));
      }
      // A bad pair becomes one that is safe to compute and adds nothing.
      rows->i32()[p] = (ok ? row : 0) + s.row_offset;
      experts->i32()[p] = ok ? expert : lowest_held;
      if (ok) {
        std::memcpy(weights->f32() + p, seg_weights + k, sizeof(float));
      } else {
        weights->f32()[p] = 0.f;
      }
    }
  }
  bad->i32()[0] = num_bad;
  bad->i32()[1] = first_bad;
  return absl::OkStatus();
}

absl::Status CpuBackend::ScaleAddRows(const Tensor& src, const Tensor& scales, const Tensor& rows,
                                      Tensor* dst) {
  DXS_RETURN_IF_ERROR(CheckDType("scale add rows", scales, DType::kF32, "scales"));
  DXS_RETURN_IF_ERROR(CheckDType("scale add rows", rows, DType::kI32, "rows"));
  const int64_t n = rows.num_elements(), d = src.row_size();
  if (scales.num_elements() != n || src.rows() < n || dst->row_size() != d) {
    return absl::InvalidArgumentError(absl::StrCat(
        "scale add rows: ", n, " rows of ", src.ShapeString(), " into ", dst->ShapeString()));
  }
  const int32_t* r = rows.i32();
  const float* w = scales.f32();
  for (int64_t i = 0; i < n; ++i) {
    if (r[i] < 0 || r[i] >= dst->rows()) {
      return absl::InvalidArgumentError(
          absl::StrCat("scale add rows: row ", r[i], " outside [0, ", dst->rows(), ")"));
    }
    const float* s = src.f32() + i * d;
    float* o = dst->f32() + static_cast<int64_t>(r[i]) * d;
    for (int64_t j = 0; j < d; ++j) o[j] += w[i] * s[j];
  }
  return absl::OkStatus();
}

}  // namespace dxs
