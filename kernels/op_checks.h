// Argument checks shared by backends: a clear INVALID_ARGUMENT naming the op and the
// argument, the same text from every backend.
#pragma once

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kernels/backend.h"
#include "kernels/sampling_row.h"
#include "kernels/tensor.h"

namespace dxs {

absl::Status CheckDType(const char* op, const Tensor& t, DType want, const char* what);
absl::Status CheckSameElements(const char* op, const Tensor& a, const Tensor& b);
// The element count of `shape`; INVALID_ARGUMENT naming the op for a negative dimension.
absl::StatusOr<int64_t> CountElements(const char* op, const std::vector<int64_t>& shape);
// t is defined and of a floating dtype (f32, f16, bf16).
absl::Status CheckFloat(const char* op, const Tensor& t, const char* what);
// The arguments of the routing and exchange ops (kernels/backend.h), checked alike by
// every backend: dtypes, sizes, and (combine) offsets that start at 0 and never decrease.
absl::Status CheckDispatchLayoutArgs(const Tensor& ids, const Tensor& weights,
                                     const Tensor& expert_owner, int num_ranks);
absl::Status CheckCombineArgs(const Tensor& recv, const Tensor& token_rows,
                              const std::vector<int64_t>& rank_offsets, const Tensor& out);
absl::Status CheckSortPairsArgs(const Tensor& experts, int num_experts, const Tensor& order,
                                const Tensor& expert_offsets,
                                const std::vector<PairPayload>& payloads);
// The fused dense ops (kernels/backend.h): dtypes and shapes.
absl::Status CheckAddRmsNormArgs(const Tensor& x, const Tensor& weight, const Tensor& residual,
                                 const Tensor& y);
absl::Status CheckQkNormRopeArgs(const Tensor& q, const Tensor& k, const Tensor& q_weight,
                                 const Tensor& k_weight, const Tensor& positions);
absl::Status CheckArgmaxRowsArgs(const Tensor& logits, const Tensor& ids);
// SampleRows: logits f32 [n, vocab], params i64 [n, kSamplingRowWords], adjustments null or
// i32 [m, kLogitAdjustmentWords], ids i32 [n].
absl::Status CheckSampleRowsArgs(const Tensor& logits, const Tensor& params,
                                 const Tensor* adjustments, const Tensor& ids);
// CountPendingTokens: tokens i32 [n], params i64 [n, kSamplingRowWords], adjustments i32 [m,
// kLogitAdjustmentWords].
absl::Status CheckCountPendingTokensArgs(const Tensor& tokens, const Tensor& params,
                                         const Tensor& adjustments);
// LogprobRows: logits f32 [n, vocab], sampled i32 [n], named i32 [n, m], sampled_logprobs f32
// [n], named_logprobs f32 [n, m], top_ids i32 [n, k], top_logprobs f32 [n, k], k <= 20.
absl::Status CheckLogprobRowsArgs(const Tensor& logits, const Tensor& sampled, const Tensor& named,
                                  const Tensor& sampled_logprobs, const Tensor& named_logprobs,
                                  const Tensor& top_ids, const Tensor& top_logprobs);
// Row `row`'s sampling parameters are in range (ValidateSamplingParams; reserved is 0).
// Only where the backend can read them on the host: the CPU backend.
absl::Status CheckSamplingRow(int64_t row, const SamplingRow& params);
absl::Status CheckAccumulateCountsArgs(const Tensor& offsets, const Tensor& counts);
absl::Status CheckUnpackRoutedPairsArgs(const Tensor& blocks,
                                        const std::vector<PairSegment>& segments,
                                        const Tensor& held, const Tensor& rows,
                                        const Tensor& experts, const Tensor& weights,
                                        const Tensor& bad);

// QuantizeRowsFp8: src floating, rows i32 [n], records kF8E4M3 [>= n,
// Fp8RecordBytes(hidden)] with hidden (src's row size) a multiple of 4.
absl::Status CheckQuantizeRowsFp8Args(const Tensor& src, const Tensor& rows, const Tensor& records);
// DequantizeRowsFp8: records kF8E4M3 [n, Fp8RecordBytes(hidden)], dst floating [>= n, hidden].
absl::Status CheckDequantizeRowsFp8Args(const Tensor& records, const Tensor& dst);
// The metadata tensors of paged attention fit `num_tokens` query rows.
absl::Status CheckPagedAttentionMeta(const char* op, const PagedAttentionMeta& meta,
                                     int64_t num_tokens);

}  // namespace dxs
