// DenseCompute: the dense part of a backend (kernels/backend.h): the GEMMs, norms,
// rotary embedding and elementwise ops of an attention layer, paged attention over the KV
// cache, and sampling and log-probabilities of the LM head's rows. All of it is enqueued
// on the backend's queue (kernels/device_runtime.h).
//
// Empty batches: every operation accepts zero rows and then launches nothing; arguments are
// still checked. Dtypes: weights are kept in WeightDType(stored dtype), activations are
// computed in ActivationDType(); ops that move rows convert between floating dtypes.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "kernels/tensor.h"

namespace dxs {

// Per-step metadata of paged attention over all of a step's sequences (prefill chunks and
// decode tokens together), the layout of vLLM's and FlashInfer's paged kernels. Built once
// per step, the same for every layer. Caches are [num_blocks, block_size, kv_heads, d].
struct PagedAttentionMeta {
  int64_t num_seqs = 0;
  int64_t block_size = 0;
  int64_t max_blocks_per_seq = 0;
  int64_t max_query_len = 0;  // host hints for kernel sizing
  int64_t max_context_len = 0;
  Tensor query_start;   // [num_seqs + 1] i32: sequence s's queries are rows [qs[s], qs[s+1])
  Tensor context_lens;  // [num_seqs] i32: positions cached after this step's tokens
  Tensor block_tables;  // [num_seqs, max_blocks_per_seq] i32: block of each position / bs
  Tensor slot_mapping;  // [num_tokens] i64: block * block_size + offset of each new token
  // Optional host copies of query_start [num_seqs + 1] and context_lens [num_seqs] (null:
  // not given), equal to the tensors. A backend whose kernel plans on the host (FlashInfer's,
  // on CUDA) uses them. When a graph records the call, the backend reads them again at each
  // Replay, so there they must point into the caller's staging memory, hold each replay's
  // values when Replay is called, and live as long as the graph (ForwardDecode's staging).
  const int32_t* host_query_start = nullptr;
  const int32_t* host_context_lens = nullptr;
  std::shared_ptr<const void> host_lens_owner;  // keeps them alive where nothing else does
  // A padded decode step (Qwen3MoeModel::ForwardDecode), recorded into a graph or not: a
  // backend computes it the same way either way, so replays equal eager runs bit for bit.
  bool padded_decode = false;
};

class DenseCompute {
 public:
  virtual ~DenseCompute() = default;

  // ---- Dense ops ----
  // y[m, n] = x[m, k] * w[n, k]^T (+ bias[n] when given). The GEMM.
  virtual absl::Status Linear(const Tensor& x, const Tensor& w, const Tensor* bias, Tensor* y) = 0;
  // ys[i] = x * ws[i]^T, no biases, for weights sharing their input (a layer's q, k and v):
  // Linear for each, which a device may run as one launch. ws and ys of one size.
  virtual absl::Status Linears(const Tensor& x, const std::vector<const Tensor*>& ws,
                               const std::vector<Tensor*>& ys);
  // What runs while the weights of a PrefetchWeights hint come into a device's cache: a decode
  // step's attention (short kernels that read little, the memory mostly idle) or its experts
  // (which stream their own weights).
  enum class PrefetchWhile { kAttention, kExperts };
  // A hint: `weights` (model weights, which nothing writes) are read by an op of `rows` rows
  // after the work that `during` names; a device may bring them into its cache beside that
  // work (the o-projection's weights while a decode step's attention runs). Changes no
  // result; the default does nothing.
  virtual absl::Status PrefetchWeights(const std::vector<const Tensor*>& weights,
                                       PrefetchWhile during, int64_t rows);
  // y = x * rsqrt(mean(x^2) + eps) * weight over rows of weight.num_elements() values.
  virtual absl::Status RmsNorm(const Tensor& x, const Tensor& weight, float eps, Tensor* y) = 0;
  // y[i] = table[ids[i]]; ids is an i32 tensor of ids already checked against the table.
  virtual absl::Status Embedding(const Tensor& table, const Tensor& ids, Tensor* y) = 0;
  // Rotary embedding, rotate-half layout, in place on x[tokens, heads, head_dim];
  // positions is an i32 tensor [tokens].
  virtual absl::Status Rope(Tensor* x, const Tensor& positions, double theta) = 0;
  // out = silu(gate) * up, elementwise.
  virtual absl::Status SiluMul(const Tensor& gate, const Tensor& up, Tensor* out) = 0;
  // inout += x, elementwise.
  virtual absl::Status Add(const Tensor& x, Tensor* inout) = 0;
  // The residual add and the norm after it in one pass: residual += x (residual float32, x
  // of its element count), then y = RmsNorm(residual, weight, eps). The same values as Add
  // then RmsNorm.
  virtual absl::Status AddRmsNorm(const Tensor& x, const Tensor& weight, float eps,
                                  Tensor* residual, Tensor* y) = 0;
  // Qwen3's per-head q/k norms and the rotary embedding in one pass, in place: each head of
  // q[T, q_heads, d] and k[T, k_heads, d] (one dtype) is RmsNorm'ed with q_weight or
  // k_weight ([d]), then rotated as Rope does. The values of RmsNorm then Rope on each (a
  // device may keep the normalised values unrounded for the rotation).
  virtual absl::Status QkNormRope(Tensor* q, Tensor* k, const Tensor& q_weight,
                                  const Tensor& k_weight, float eps, const Tensor& positions,
                                  double theta) = 0;
  // dst[i] = src[rows[i]] (rows: i32 tensor), converting floating dtypes (the pack of a
  // dispatch into the wire dtype, the gather of expert rows widened from it). Works on
  // index tensors too (same dtype), with one element per row for 1-d tensors.
  virtual absl::Status GatherRows(const Tensor& src, const Tensor& rows, Tensor* dst) = 0;

  // ---- Paged attention ----
  // Writes each new token's k/v rows [T, kv_heads, d] into the caches at meta.slot_mapping;
  // a negative slot (a padding row of a padded decode step) caches nothing.
  virtual absl::Status WriteKvCache(const Tensor& k, const Tensor& v,
                                    const PagedAttentionMeta& meta, Tensor* k_cache,
                                    Tensor* v_cache) = 0;
  // QkNormRope of q and k, then WriteKvCache of the rotated k and of v: one op, so that a
  // backend may do both in one pass (CUDA: the norm-and-rope kernel writes the cache too).
  // The same values as the two ops, which the default runs.
  virtual absl::Status QkNormRopeWriteKv(Tensor* q, Tensor* k, const Tensor& v,
                                         const Tensor& q_weight, const Tensor& k_weight, float eps,
                                         const Tensor& positions, double theta,
                                         const PagedAttentionMeta& meta, Tensor* k_cache,
                                         Tensor* v_cache);
  // Causal GQA attention of q[T, heads, d] over the caches: query i of sequence s (at
  // position context_len - query_len + i) sees positions [0, that position]. out[T, heads*d].
  virtual absl::Status PagedAttention(const Tensor& q, const Tensor& k_cache, const Tensor& v_cache,
                                      const PagedAttentionMeta& meta, float scale, Tensor* out) = 0;

  // ---- Sampling and log-probabilities of the LM head's rows ----
  // Greedy sampling on the backend: ids[i] (i32 [n]) = the index of the largest of
  // logits[i, :] (f32 [n, vocab]), ties to the lowest index, NaNs never chosen unless the
  // row starts with one (then 0): exactly Argmax of kernels/sampling.h. Only the ids come back.
  virtual absl::Status ArgmaxRows(const Tensor& logits, Tensor* ids) = 0;
  // Sampling on the backend (kernels/sampling.h's ApplyLogitAdjustments then SampleToken,
  // row by row): ids[i] (i32 [n]) is logits[i, :] (f32 [n, vocab], not changed) sampled with
  // params row i (i64 [n, kSamplingRowWords], one SamplingRow each: kernels/sampling_row.h)
  // after the row's LogitAdjustments (adjustments: i32 [m, kLogitAdjustmentWords], or null
  // when no row has any). Temperature 0 is the argmax of the adjusted row; otherwise
  // temperature, top-k, top-p, min-p, then draw number `draw` of `seed`'s SplitMix64 stream,
  // which needs no state: the tokens are the CPU's on every backend, except where a draw
  // lands within rounding of a cumulative-mass boundary (the sums go in another order).
  // Shapes and dtypes are INVALID_ARGUMENT; so are out-of-range parameters where the
  // backend reads them on the host (CPU), while a device writes -1 for such a row.
  virtual absl::Status SampleRows(const Tensor& logits, const Tensor& params,
                                  const Tensor* adjustments, Tensor* ids) = 0;
  // The token a row's request drew in the step before, counted into its adjustments in a
  // step built ahead of it (overlap scheduling with penalties): for each row i of params
  // (i64 [n, kSamplingRowWords]) whose last adjustment is kAdjustPending, with t =
  // tokens[i] (i32 [n]: the step's input ids), the row's other entry of t gets output_count
  // + 1 and kAdjustSeen; where there is none, the pending entry becomes {t, 1, 0,
  // kAdjustSeen}. Other rows are left alone. adjustments: i32 [m, kLogitAdjustmentWords], in
  // place. On the queue: a graph may record it; out-of-range rows are INVALID_ARGUMENT where
  // the backend reads them on the host (CPU), skipped on a device.
  virtual absl::Status CountPendingTokens(const Tensor& tokens, const Tensor& params,
                                          Tensor* adjustments) = 0;
  // Log-probabilities of raw logits rows (log_softmax; kernels/sampling.h's RowLogprobs), for
  // row i of logits (f32 [n, vocab]): sampled_logprobs[i] (f32 [n]) of token sampled[i] (i32
  // [n]); named_logprobs[i, j] (f32 [n, m]) of token named[i, j] (i32 [n, m]; -1 gives 0);
  // and the row's k most likely tokens, top_ids[i, :] (i32 [n, k]) with their
  // top_logprobs[i, :] (f32 [n, k]), most likely first, equal logits by lower id; k <= 20.
  // Ids outside the vocabulary are INVALID_ARGUMENT on the CPU; a device gives 0 for them.
  virtual absl::Status LogprobRows(const Tensor& logits, const Tensor& sampled, const Tensor& named,
                                   Tensor* sampled_logprobs, Tensor* named_logprobs,
                                   Tensor* top_ids, Tensor* top_logprobs) = 0;
};

}  // namespace dxs
