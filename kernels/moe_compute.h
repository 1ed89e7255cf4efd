// MoeCompute: the MoE part of a backend (kernels/backend.h): the router's top-k, the
// dispatch layout, the expert side's pair sort, grouped FFN and weighted pre-sum, and the
// combine's single reduction. All of it is enqueued on the backend's queue
// (kernels/device_runtime.h). Backend (kernels/backend.h) gives GroupedSwiGluCounted,
// ScaleSumRows and RoutedSwiGlu defaults built on the other ops and the runtime.
//
// Empty batches: every operation accepts zero rows and then launches nothing; arguments are
// still checked. Index tensors are i32.
#pragma once

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "kernels/tensor.h"

namespace dxs {

// Where each EP rank's tokens and routed pairs are (DeepEP's dispatch layout plus the
// permutation), computed on the backend from the router's top-k ids. Rank r's tokens are
// token_rows[tok_off[r], tok_off[r] + num_tokens_per_rank[r]) (ascending rows of x). Its
// num_pairs_per_rank[r] = p pairs are one block of `pairs` from 3 * pair_off[r] on, as the
// wire carries them: p row indices (into the rank's token list), p expert ids, p weights
// (float32 bits). Offsets are exclusive prefix sums of the counts.
struct DispatchLayoutTensors {
  Tensor num_tokens_per_rank;    // [R] i32
  Tensor num_pairs_per_rank;     // [R] i32
  Tensor num_tokens_per_expert;  // [E] i32
  Tensor token_rows;             // [T * min(k, R)] i32 (the first sum(num_tokens) used)
  Tensor pairs;                  // [3 * T * k] i32: per rank, rows | experts | weights
};

// A per-pair array that SortPairsByExpert permutes with its order in the same pass:
// sorted[s] = values[order[s]]. Both 1-d, one element per pair, of one 32-bit dtype (i32 or
// f32): the pairs' rows, output rows and weights in the expert shard.
struct PairPayload {
  const Tensor* values = nullptr;
  Tensor* sorted = nullptr;
};
inline constexpr int kMaxPairPayloads = 3;

// One DP rank's routed pairs in an expert round's receive buffer (UnpackRoutedPairs): its
// pairs are the triples from pair first_pair on, its rows are rows [row_offset, row_offset
// + num_rows) of the round's input.
struct PairSegment {
  int32_t first_pair = 0;
  int32_t num_pairs = 0;
  int32_t row_offset = 0;
  int32_t num_rows = 0;
};
// At most this many segments (DP ranks) per UnpackRoutedPairs call: the segments travel as
// a kernel argument on a device.
inline constexpr int kMaxPairSegments = 128;

// Pairs sized by a capacity whose count only the device knows (a low-latency round's): entry
// p takes x row rows[p] through expert experts[p] and adds weights[p] times the result to
// out row out_rows[p]. Entries that are no pair have expert num_experts (after every real
// one when sorted by expert) and an out row past the rows that are summed.
struct CountedPairs {
  Tensor x;         // [rows, hidden]
  Tensor rows;      // i32 [P]
  Tensor experts;   // i32 [P]
  Tensor weights;   // f32 [P]
  Tensor out_rows;  // i32 [P]
};

// FP8 dispatch rows (--wire-dtype fp8, DeepEP's and Step-3's per-token, per-128-channel
// quantization): a row of `hidden` values travels as a record of G = ceil(hidden / 128)
// float32 scales followed by `hidden` float8_e4m3fn values, value j being fp8[j] *
// scales[j / 128]. Records are kF8E4M3 tensors [rows, Fp8RecordBytes(hidden)] (bytes); hidden
// is a multiple of 4, so that every record's scales stay 4-byte aligned.
inline constexpr int64_t kFp8GroupSize = 128;
inline constexpr int64_t Fp8RecordBytes(int64_t hidden) {
  return 4 * ((hidden + kFp8GroupSize - 1) / kFp8GroupSize) + hidden;
}

class MoeCompute {
 public:
  virtual ~MoeCompute() = default;

  // ---- Routing and the MoE exchange ----
  // Softmax over logits[T, E] (float32), then the top_k largest (ties to the lower expert
  // id; a row with a NaN logit ranks by logit, NaN last), renormalised to sum 1 when
  // `normalize`. Writes ids (i32) and weights (f32), each
  // [T, top_k], in descending weight order. Zero tokens returns at once; top_k <= 0,
  // E <= 0 or top_k > E is INVALID_ARGUMENT.
  virtual absl::Status TopKSoftmax(const Tensor& logits, int top_k, bool normalize, Tensor* ids,
                                   Tensor* weights) = 0;
  // The dispatch layout of ids/weights [T, k] for experts placed per expert_owner over
  // num_ranks ranks: [E] i32, one EP rank each, or [E, S] i32, each expert's replicas'
  // ranks (primary first, then -1), of which the pair of token row t takes the
  // (t mod replicas)-th (kernels/replica_choice.h; dataplane/dispatch/placement.h says why).
  // Either way each pair goes to exactly one rank. Tensors in *layout are allocated here.
  virtual absl::Status ComputeDispatchLayout(const Tensor& ids, const Tensor& weights,
                                             const Tensor& expert_owner, int num_ranks,
                                             DispatchLayoutTensors* layout) = 0;
  // The combine's weighted sum, the single reduction stage: out[t] = the sum, in ascending
  // rank order, of the rows recv[rank_offsets[r] + i] with token_rows[rank_offsets[r] + i]
  // == t; zero where no rank has t. recv is in the wire dtype; out float32 or the wire
  // dtype (summed in float32, rounded once). rank_offsets: R + 1 host offsets.
  virtual absl::Status CombineRows(const Tensor& recv, const Tensor& token_rows,
                                   const std::vector<int64_t>& rank_offsets, Tensor* out) = 0;
  // Stable sort of routed pairs by expert: order[P] (i32) lists pair indices expert by
  // expert, in pair order within one; expert_offsets[E + 1] (i32) bounds each expert's run.
  // Up to kMaxPairPayloads payloads are permuted by the order too (what would otherwise be a
  // GatherRows each after the sort).
  virtual absl::Status SortPairsByExpert(const Tensor& experts, int num_experts, Tensor* order,
                                         Tensor* expert_offsets,
                                         const std::vector<PairPayload>& payloads) = 0;
  // The grouped SwiGLU FFN: for each expert e, rows [off[e], off[e+1]) of the sorted input
  // go through down_e(silu(gate_e x) * up_e x) into the same rows of y. The sorted input is
  // xs itself when `rows` is null, else xs gathered by `rows` (i32 [P]; widened from a
  // narrower dtype), so the permutation is never written out (vLLM's sorted_token_ids).
  // gate_up[e] is expert e's gate and up projections packed as one [2 * inter, hidden]
  // weight, gate rows first (PackGateUp in model/weights.h), so a device does both in one
  // GEMM; down[e] is [hidden, inter]. Both are null for experts with no rows here (an
  // expert with rows and no weights is FAILED_PRECONDITION).
  virtual absl::Status GroupedSwiGlu(const Tensor& xs, const Tensor* rows,
                                     const Tensor& expert_offsets,
                                     const std::vector<const Tensor*>& gate_up,
                                     const std::vector<const Tensor*>& down, Tensor* y) = 0;
  // GroupedSwiGlu of pairs counted on the device (a low-latency round's, sized by the
  // exchange's capacity): `rows` and y hold a capacity of entries, of which the first
  // expert_offsets[E] are the pairs; the rest of y is not written. The CUDA backend's
  // grouped GEMMs take the count from the offsets on the device (no host read: it runs in
  // a graph); the default reads the count and runs GroupedSwiGlu over those rows.
  virtual absl::Status GroupedSwiGluCounted(const Tensor& xs, const Tensor& rows,
                                            const Tensor& expert_offsets,
                                            const std::vector<const Tensor*>& gate_up,
                                            const std::vector<const Tensor*>& down, Tensor* y) = 0;
  // counts[e] += offsets[e + 1] - offsets[e] for the E experts of SortPairsByExpert's
  // offsets (i32 [E + 1]) into counts (i64 [E]): per-expert loads kept on the device, so
  // that counting needs no host synchronisation.
  virtual absl::Status AccumulateCounts(const Tensor& offsets, Tensor* counts) = 0;
  // dst[rows[i]] += scales[i] * src[i] in order of i (the fixed summation order). rows i32,
  // scales f32 tensors; dst f32, src f32 or (on a backend whose activations are) the
  // activation dtype.
  virtual absl::Status ScaleAddRows(const Tensor& src, const Tensor& scales, const Tensor& rows,
                                    Tensor* dst) = 0;
  // The same into zeros, written in out's dtype: out = 0, ScaleAddRows into float32, then
  // rounded once into out (f32 or, on a backend whose activations are, the activation
  // dtype). One op, so a device may do it in one pass (an expert round's weighted pre-sum).
  virtual absl::Status ScaleSumRows(const Tensor& src, const Tensor& scales, const Tensor& rows,
                                    Tensor* out) = 0;
  // Whether RoutedSwiGlu takes `tokens` tokens of top_k routed experts each: a decode-sized
  // batch on a backend that fuses it (the CUDA backend's GEMV path). The default takes none.
  virtual bool TakesRoutedSwiGlu(int64_t tokens, int64_t top_k) const;
  // The MoE FFN of a few tokens straight from their routing (ids i32 and weights f32
  // [tokens, top_k]), on a shard holding every expert (gate_up / down as GroupedSwiGlu's):
  // out[t] = the sum over token t's pairs, in ascending expert order, of weights[t, j] *
  // down_e(silu(gate_e x[t]) * up_e x[t]), each expert's output rounded to the activation
  // dtype first, the sum in float32 from zero rounded once into out. That is what
  // SortPairsByExpert, GroupedSwiGlu and ScaleSumRows give (ExpertShard's path), without the
  // sort and its launches. counts (i64 [E], may be null) += each expert's pairs. Only where
  // TakesRoutedSwiGlu says so; elsewhere FAILED_PRECONDITION.
  virtual absl::Status RoutedSwiGlu(const Tensor& x, const Tensor& ids, const Tensor& weights,
                                    const std::vector<const Tensor*>& gate_up,
                                    const std::vector<const Tensor*>& down, Tensor* counts,
                                    Tensor* out) = 0;
  // An expert round's routed pairs as the wire delivered them, checked and unpacked where
  // they arrived (device memory on a GPU: no pair crosses the host). `blocks` (i32 [3 * P])
  // holds each segment's pairs as the dispatch layout sends them: its num_pairs rows (into
  // the segment's own rows), then its experts, then its weights (float32 bits), from
  // 3 * first_pair on. Writes rows[p] (the row plus the segment's row_offset), experts[p]
  // and weights[p] ([P] i32, i32, f32). A pair is bad if its row is outside [0, num_rows)
  // or its expert outside [0, E) or held[expert] == 0 (held: i32 [E], non-zero for the
  // experts this rank holds); bad (i32 [2]) gets their count and the lowest bad pair index
  // (INT32_MAX if none), and each bad pair is written as (the segment's first row, the
  // lowest held expert, weight 0): safe to compute on, adding nothing. So the caller may
  // compute first and read `bad` at the synchronisation it has anyway, before anything
  // leaves. Segments must tile [0, P) in order, and one with pairs must have rows; at most
  // kMaxPairSegments. No pairs: nothing is done, and `bad` is not written.
  // records[i] = the FP8 record of src[rows[i]] (src floating [T, hidden], rows i32 [n],
  // records [>= n, Fp8RecordBytes(hidden)]): each group's scale is max(amax, 1e-4) / 448,
  // its values src / scale rounded to nearest even (saturating, NaN kept). The attention
  // rank's pack of a dispatch. Backend's default is UNIMPLEMENTED
  // (capabilities().fp8_dispatch_rows says which backends have it).
  virtual absl::Status QuantizeRowsFp8(const Tensor& src, const Tensor& rows, Tensor* records) = 0;
  // dst[i] = the values record i holds (records [n, Fp8RecordBytes(hidden)], dst floating
  // [n, hidden], each value rounded once into dst's dtype): the expert rank's unpack.
  virtual absl::Status DequantizeRowsFp8(const Tensor& records, Tensor* dst) = 0;
  virtual absl::Status UnpackRoutedPairs(const Tensor& blocks,
                                         const std::vector<PairSegment>& segments,
                                         const Tensor& held, Tensor* rows, Tensor* experts,
                                         Tensor* weights, Tensor* bad) = 0;
};

}  // namespace dxs
