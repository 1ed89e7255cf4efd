// The CUDA backend's kernels: raw launch API, free of absl so that .cu files need only the
// CUDA headers. kernels/cuda/cuda_backend.cc checks shapes and dtypes, then calls these;
// each launcher enqueues on `stream` and returns cudaGetLastError() after the launch (or
// cudaErrorInvalidValue for arguments it cannot take, without launching). Zero rows return
// cudaSuccess without touching CUDA: null pointers are fine then.
//
// Conventions:
// - Pointers are device pointers; tensors are row-major and packed.
// - Floating data is f32, f16 or bf16 (ElemType); every kernel computes in f32 and rounds
//   once when it stores into a narrower type. Index tensors are i32 (i64 for cache slots).
// - Data-dependent bad indices (an expert id or a row outside its range) cannot be
//   reported without a host synchronisation: kernels skip them. The backend checks what it
//   can on the host; the CPU backend, which checks everything, is the reference in tests.
// - Results are deterministic: no floating-point atomics; every sum has a fixed order.
//
// Files: gemv.cu (decode-sized GEMVs), route_decode.cu (a decode step's router, fused),
// dense_ops.cu (conversion, norms, rope, elementwise, gathers), attention.cu (KV cache write,
// paged attention), moe_ops.cu (layout, sort, combine, scale-add), sampling.cu (argmax and
// SampleRows), random_fill.cu (seeded weights made in place), fp8_rows.cu (FP8 dispatch
// records).
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "kernels/sampling_row.h"

namespace dxs::cuda {

// The same values as dxs::DType (common/dtype.h); cuda_backend.cc static_asserts that.
enum class ElemType : int32_t { kF32 = 0, kF16 = 1, kBF16 = 2, kI32 = 3, kI64 = 4 };

// ---- gemv.cu (decode-sized batches: weights streamed once, see the file comment) ----

// Rows of x (tokens) LaunchGemvBf16 takes, and routed pairs LaunchMoeSwiGluGemv takes.
inline constexpr int64_t kGemvMaxRows = 8;
inline constexpr int64_t kGemvMaxPairs = 128;
// The same for FP8 experts: past 32 pairs CUTLASS's FP8 grouped GEMMs (with the quantization
// passes) are as fast or faster (H100: the GEMV 1.18x faster at 32 pairs, 0.91x at 128;
// docs/results/fp8.md).
inline constexpr int64_t kGemvMaxPairsFp8 = 32;

// y[m, n] = sum_k x[m, k] * w[n, k]: x f32 or bf16 [m, k], w bf16 [n, k], y f32 or bf16;
// m <= kGemvMaxRows, k % 8 == 0, x and w 16-byte aligned.
cudaError_t LaunchGemvBf16(const void* x, ElemType x_type, int64_t m, const void* w, int64_t n,
                           int64_t k, void* y, ElemType y_type, cudaStream_t stream);
// The same for `count` (<= kGemvMaxOutputs) weights sharing x, in one launch: ys[o][m,
// ns[o]] = x * ws[o]^T (q, k and v of a decode step).
inline constexpr int kGemvMaxOutputs = 3;
cudaError_t LaunchGemvsBf16(const void* x, ElemType x_type, int64_t m, int64_t k, int count,
                            const void* const* ws, const int64_t* ns, void* const* ys,
                            ElemType y_type, cudaStream_t stream);

// ---- route_decode.cu (a decode step's MoE router in one kernel) ----

// residual (f32 [m, hidden]) += x (bf16), normed (bf16) = RMS-normed residual * norm_weight
// (bf16 [hidden]), logits (f32 [m, E]) = normed . router^T (bf16 [E, hidden]), then ids / weights
// ([m, top_k]) the top-k softmax of each row's logits: LaunchAddRmsNorm, LaunchGemvBf16 and
// LaunchTopKSoftmax in that order, bit for bit, in one launch. m <= kGemvMaxRows, hidden a
// multiple of 8, x, residual, norm_weight, router and normed 16-byte aligned, E and top_k
// within topk_softmax.cuh's limits. counter: one unsigned in device memory, zero before the
// first launch and left zero by each (launches using one counter must not overlap).
cudaError_t LaunchResidualNormRoute(const void* x, float* residual, const void* norm_weight,
                                    float eps, int64_t m, int64_t hidden, const void* router,
                                    int64_t num_experts, int64_t top_k, bool normalize,
                                    void* normed, float* logits, int32_t* ids, float* weights,
                                    unsigned* counter, cudaStream_t stream);

// The grouped SwiGLU FFN of num_pairs <= kGemvMaxPairs routed pairs sorted by expert
// (expert_offsets [E + 1]): pair p's input is row rows[p] of xs (f32 or bf16 [x_rows,
// hidden]; row p when rows is null), weights[e] / weights[E + e] expert e's bf16 gate_up
// [2 * inter, hidden] / down [hidden, inter] (null: zeros). act is bf16 scratch [num_pairs,
// inter]; y [num_pairs, hidden] f32 or bf16. hidden and inter multiples of 8. With
// weight_scales (laid out as weights), the weights are e4m3 and weight_scales[e] their
// float32 128 x 128 block scales, N-major ([k / 128, n / 128]); hidden and inter multiples of
// 128 then.
cudaError_t LaunchMoeSwiGluGemv(const void* xs, ElemType x_type, int64_t x_rows,
                                const int32_t* rows, int64_t num_pairs,
                                const int32_t* expert_offsets, int64_t num_experts,
                                const void* const* weights, const float* const* weight_scales,
                                int64_t hidden, int64_t inter, void* act, void* y, ElemType y_type,
                                cudaStream_t stream);

// Starts bringing [p, p + bytes) (16-byte aligned; a model weight, which no kernel writes)
// into L2 with bulk prefetches, for a kernel queued later on another stream. The prefetches
// are issued, not waited for; results are unchanged whether they land or not.
cudaError_t LaunchPrefetchL2(const void* p, size_t bytes, cudaStream_t stream);

// The MoE FFN of `tokens` tokens from their routing, without sorting the pairs: out[t]
// (f32 or bf16 [tokens, hidden]) = the sum over the token's top_k pairs (ids i32 and scales
// f32 [tokens, top_k]) in ascending expert order of scales * SwiGLU_e(xs[t]), each expert's
// output rounded to y_type first and the sum in float32 rounded once: LaunchMoeSwiGluGemv on
// the sorted pairs then LaunchScaleSumRows, bit for bit, in two kernels. weights as there;
// act bf16 scratch [tokens * top_k, inter]; counts (i64 [E], may be null) += each expert's
// pairs; weight_scales as LaunchMoeSwiGluGemv's. tokens * top_k <= kGemvMaxPairs, top_k <= 16.
cudaError_t LaunchRoutedSwiGluGemv(const void* xs, ElemType x_type, int64_t tokens,
                                   const int32_t* ids, const float* scales, int64_t top_k,
                                   int64_t num_experts, const void* const* weights,
                                   const float* const* weight_scales, int64_t hidden, int64_t inter,
                                   void* act, ElemType y_type, int64_t* counts, void* out,
                                   ElemType out_type, cudaStream_t stream);

// out[t] (f32 or bf16 [out_rows, cols]) = the sum over i < n in ascending order with
// rows[i] == t of scales[i] * src[i] (f32 or bf16 rows), zero where none (rows outside
// [0, out_rows) add to nothing): a zeroed f32 LaunchScaleAddRows then the copy into out,
// bit for bit, in one kernel; n <= kScaleSumMaxPairs. Each block scans all n rows for its
// own, so past that a sort (LaunchScaleAddRows) is cheaper.
inline constexpr int64_t kScaleSumMaxPairs = 4096;
cudaError_t LaunchScaleSumRows(const void* src, ElemType src_type, const float* scales,
                               const int32_t* rows, int64_t n, int64_t cols, void* out,
                               ElemType out_type, int64_t out_rows, cudaStream_t stream);

// ---- fp8_rows.cu (--wire-dtype fp8's dispatch records; layout in kernels/moe_compute.h) ----

// records[i] = row rows[i] of src (floating [src_rows, hidden]) as an FP8 record: per 128
// values a float32 scale max(amax, 1e-4) / 448, then the values divided by their scale in
// float8_e4m3fn (nearest, ties to even, saturating); bit for bit the CPU backend's. A row
// outside [0, src_rows) leaves its record as it was. hidden a multiple of 4.
cudaError_t LaunchQuantizeRowsFp8(const void* src, ElemType src_type, int64_t src_rows,
                                  const int32_t* rows, int64_t n, int64_t hidden, void* records,
                                  cudaStream_t stream);
// dst (floating [n, hidden]) = the values records [n] hold, each e4m3 value times its scale,
// rounded once into dst's type.
cudaError_t LaunchDequantizeRowsFp8(const void* records, int64_t n, int64_t hidden, void* dst,
                                    ElemType dst_type, cudaStream_t stream);

// ---- fp8_linear.cu (block-scaled FP8 weights, Tensor::block_scales; see the file comment) ----

// x (floating [m, k], k a multiple of 128) quantized per token and 128 channels as
// LaunchQuantizeRowsFp8 does: values e4m3 [m_pad, k], scales f32 [k / 128, m_pad] (group-major);
// rows m..m_pad are zeros with scale 1.
cudaError_t LaunchQuantizeActivationsFp8(const void* x, ElemType x_type, int64_t m, int64_t k,
                                         int64_t m_pad, uint8_t* values, float* scales,
                                         cudaStream_t stream);
// y[m, n] (bf16 or f32) = x (bf16 [m, k]) . (w * its block scales)^T for m <= kGemvMaxRows; w
// e4m3 [n, k], w_scales f32 [n / 128, scale_stride]; n and k multiples of 128, x and w 16-byte
// aligned. `features`: output features a warp computes, 1, 2 or 4 (the same bits whichever),
// or 0 to choose by the shape.
cudaError_t LaunchGemvFp8(const void* x, int64_t m, const uint8_t* w, const float* w_scales,
                          int64_t scale_stride, int64_t n, int64_t k, void* y, ElemType y_type,
                          int features, cudaStream_t stream);
// The same for `count` (<= kGemvMaxOutputs) FP8 weights sharing x, in one launch: ys[o][m,
// ns[o]] = x * dequant(ws[o])^T with w_scales[o] [ns[o] / 128, scale_strides[o]].
cudaError_t LaunchGemvsFp8(const void* x, int64_t m, int64_t k, int count, const uint8_t* const* ws,
                           const float* const* w_scales, const int64_t* scale_strides,
                           const int64_t* ns, void* const* ys, ElemType y_type, int features,
                           cudaStream_t stream);

// ---- moe_fp8.cu (the FP8 grouped FFN's activation passes; see the file comment) ----

// xs rows (gathered by `rows` [num_rows] when not null) quantized per row and 128 channels into
// out e4m3 [num_rows, k] and sfa in expert e's M-major block (LaunchGroupedGemmFp8's A).
cudaError_t LaunchQuantizeGroupedFp8(const void* xs, ElemType x_type, int64_t x_rows,
                                     const int32_t* rows, int64_t num_rows, int64_t k,
                                     const int32_t* offsets, int64_t num_experts, uint8_t* out,
                                     float* sfa, cudaStream_t stream);
// bf16(silu(gate) * up) of gate_up (bf16 [num_rows, 2 * inter], gate first), quantized as above
// into out e4m3 [num_rows, inter] and sfa.
cudaError_t LaunchSiluMulQuantizeGroupedFp8(const void* gate_up, int64_t num_rows, int64_t inter,
                                            const int32_t* offsets, int64_t num_experts,
                                            uint8_t* out, float* sfa, cudaStream_t stream);
// offsets (i32 [2]) = {0, rows}: a dense GEMM as the grouped GEMM's one group, written on the
// queue so that a graph replays it with the rows it was recorded with.
cudaError_t LaunchWriteOneGroup(int32_t* offsets, int64_t rows, cudaStream_t stream);
// dst[kb * n_blocks + nb] = src[nb * stride + kb]: block scales N-major.
cudaError_t LaunchTransposeBlockScales(const float* src, int64_t n_blocks, int64_t k_blocks,
                                       int64_t stride, float* dst, cudaStream_t stream);

// ---- dense_ops.cu ----

// dst[i] = src[i] for n elements, converting between floating types (or copying index
// types of equal type; other mixes are cudaErrorInvalidValue).
cudaError_t LaunchConvert(const void* src, ElemType src_type, void* dst, ElemType dst_type,
                          int64_t n, cudaStream_t stream);
// dst[i] = value (index types get the value truncated to an integer).
cudaError_t LaunchFill(void* dst, ElemType type, int64_t n, float value, cudaStream_t stream);
// y[r] = weight * (x[r] * rsqrt(mean(x[r]^2) + eps)) for `rows` rows of `cols`.
cudaError_t LaunchRmsNorm(const void* x, ElemType x_type, const void* weight, ElemType w_type,
                          float eps, int64_t rows, int64_t cols, void* y, ElemType y_type,
                          cudaStream_t stream);
// residual[r] += x[r] (residual f32), then y[r] = weight * (residual[r] * rsqrt(mean of
// residual[r]^2 + eps)), for `rows` rows of `cols`: Add and RmsNorm in one pass.
cudaError_t LaunchAddRmsNorm(const void* x, ElemType x_type, float* residual, const void* weight,
                             ElemType w_type, float eps, int64_t rows, int64_t cols, void* y,
                             ElemType y_type, cudaStream_t stream);
// y[i] = table[ids[i]] (rows of `cols`); ids outside [0, table_rows) give a zero row.
cudaError_t LaunchEmbedding(const void* table, ElemType table_type, int64_t table_rows,
                            const int32_t* ids, int64_t n, int64_t cols, void* y, ElemType y_type,
                            cudaStream_t stream);
// Rotate-half rotary embedding in place on x[tokens, heads, head_dim] at positions[tokens],
// with inv_freq[i] = 1 / theta^(2i / head_dim) in f32 (transformers' default).
cudaError_t LaunchRope(void* x, ElemType type, const int32_t* positions, int64_t tokens,
                       int64_t heads, int64_t head_dim, float theta, cudaStream_t stream);
// Per-head RmsNorm (weights [head_dim] of w_type) then LaunchRope's rotation, in place on
// q[tokens, q_heads, head_dim] and k[tokens, k_heads, head_dim] (both of `type`; head_dim
// even), in one kernel. The normalised values stay f32 for the rotation.
cudaError_t LaunchQkNormRope(void* q, void* k, ElemType type, const void* q_weight,
                             const void* k_weight, ElemType w_type, const int32_t* positions,
                             int64_t tokens, int64_t q_heads, int64_t k_heads, int64_t head_dim,
                             float eps, float theta, cudaStream_t stream);
// LaunchQkNormRope, and in the same kernel the KV cache write of LaunchWriteKvCache: token
// t's rotated k heads and its v rows v[tokens, k_heads, head_dim] to slot_mapping[t] of the
// caches [blocks, block_size, k_heads, head_dim] (negative: skipped), all of `type`.
cudaError_t LaunchQkNormRopeWriteKv(void* q, void* k, const void* v, ElemType type,
                                    const void* q_weight, const void* k_weight, ElemType w_type,
                                    const int32_t* positions, int64_t tokens, int64_t q_heads,
                                    int64_t k_heads, int64_t head_dim, float eps, float theta,
                                    const int64_t* slot_mapping, void* k_cache, void* v_cache,
                                    cudaStream_t stream);
// out = silu(gate) * up, elementwise over n.
cudaError_t LaunchSiluMul(const void* gate, ElemType gate_type, const void* up, ElemType up_type,
                          void* out, ElemType out_type, int64_t n, cudaStream_t stream);
// out[r, j] = silu(gate_up[r, j]) * gate_up[r, inter + j] for r < rows, j < inter:
// gate_up [rows, 2 * inter] (the gate half first, the grouped FFN's packed projections),
// out [rows, inter], both packed.
cudaError_t LaunchSiluMulPacked(const void* gate_up, ElemType in_type, int64_t rows, int64_t inter,
                                void* out, ElemType out_type, cudaStream_t stream);
// inout += x, elementwise over n.
cudaError_t LaunchAdd(const void* x, ElemType x_type, void* inout, ElemType inout_type, int64_t n,
                      cudaStream_t stream);
// dst[i] = src[rows[i]] for i < n, rows of `cols` elements, converting floating types (or
// copying equal index types). Rows outside [0, src_rows) give a zero row.
cudaError_t LaunchGatherRows(const void* src, ElemType src_type, int64_t src_rows,
                             const int32_t* rows, int64_t n, int64_t cols, void* dst,
                             ElemType dst_type, cudaStream_t stream);

// ---- attention.cu ----

// Paged-attention metadata on the device (kernels/backend.h, PagedAttentionMeta).
struct PagedAttentionArgs {
  int64_t num_seqs = 0;
  int64_t num_tokens = 0;  // query rows
  int64_t num_heads = 0;
  int64_t num_kv_heads = 0;
  int64_t head_dim = 0;
  int64_t block_size = 0;
  int64_t max_blocks_per_seq = 0;
  int64_t max_query_len = 0;
  int64_t max_context_len = 0;
  int64_t num_blocks = 0;  // cache blocks: table entries outside [0, num_blocks) read as zero rows
  const int32_t* query_start = nullptr;   // [num_seqs + 1]
  const int32_t* context_lens = nullptr;  // [num_seqs]
  const int32_t* block_tables = nullptr;  // [num_seqs, max_blocks_per_seq]
};

// k/v rows [tokens, kv_heads * head_dim] into the caches [blocks, block_size, kv_heads,
// head_dim] at slot_mapping[t] = block * block_size + offset (negative: skipped).
cudaError_t LaunchWriteKvCache(const void* k, const void* v, ElemType kv_type,
                               const int64_t* slot_mapping, int64_t tokens, int64_t row_elems,
                               void* k_cache, void* v_cache, ElemType cache_type,
                               cudaStream_t stream);
// Scratch for LaunchPagedAttention with these arguments (the split-KV partials of short
// queries over long contexts; 0 when it does not split). Depends on the sizes and hints in
// args and on the current device only, never on the data.
size_t PagedAttentionWorkspaceBytes(const PagedAttentionArgs& args);
// Causal GQA attention of q[num_tokens, num_heads, head_dim] over the caches into
// out[num_tokens, num_heads * head_dim]: query i of sequence s (at position
// context_len - query_len + i) sees positions [0, that position]. `workspace` holds at least
// PagedAttentionWorkspaceBytes(args) bytes (cudaErrorInvalidValue otherwise). The summation
// order depends on args' sizes and hints (how the positions are split), not on the data:
// the same call gives the same bits.
cudaError_t LaunchPagedAttention(const void* q, ElemType q_type, const void* k_cache,
                                 const void* v_cache, ElemType cache_type,
                                 const PagedAttentionArgs& args, float scale, void* out,
                                 ElemType out_type, void* workspace, size_t workspace_bytes,
                                 cudaStream_t stream);

// ---- decode_attention.cu ----

// LaunchPagedAttention's result for steps of one query per sequence and few sequences, in one
// kernel (no separate split merge; decode_attention.cu says how). Takes 16-bit q and cache
// of one type, out of that type or f32, head_dim 64 or 128, and group * head_dim <= 1024.
bool DecodeAttentionSupports(ElemType q_type, ElemType cache_type, ElemType out_type,
                             int64_t num_heads, int64_t num_kv_heads, int64_t head_dim);
// Blocks per (sequence, kv head): about one block per SM in all, 1 to 16. It depends on the
// sizes only, so one launch shape serves every replay of a graph.
int DecodeAttentionSplits(int64_t num_seqs, int64_t num_kv_heads, int num_sms);
// Scratch for LaunchDecodeAttention (the splits' f32 partials).
size_t DecodeAttentionWorkspaceBytes(const PagedAttentionArgs& args, int splits);
// As LaunchPagedAttention (the same causal rows; any number of query rows per sequence is
// right, one is fast). `counters` holds num_tokens * num_kv_heads zeros, and holds zeros
// again when the kernel ends (the last block of each row and kv head resets its counter).
// The summation order depends on the sizes and `splits` only: the same call gives the same
// bits.
cudaError_t LaunchDecodeAttention(const void* q, ElemType q_type, const void* k_cache,
                                  const void* v_cache, ElemType cache_type,
                                  const PagedAttentionArgs& args, float scale, void* out,
                                  ElemType out_type, int splits, void* workspace,
                                  size_t workspace_bytes, int32_t* counters, cudaStream_t stream);

// ---- moe_ops.cu ----

// Scratch sizes for the launchers below that need workspace (CUB's temporary storage and
// their own arrays), for the given sizes. The backend keeps one workspace and grows it.
size_t DispatchLayoutWorkspaceBytes(int64_t num_tokens, int64_t top_k, int64_t num_ranks);
size_t SortPairsWorkspaceBytes(int64_t num_pairs, int64_t num_experts);
size_t ScaleAddRowsWorkspaceBytes(int64_t num_rows, int64_t dst_rows);

// The dispatch layout of kernels/backend.h (DispatchLayoutTensors), identical to the CPU
// backend's: per-rank token and pair counts, per-expert token counts, token_rows grouped
// by rank (ascending within a rank), and pairs as per-rank blocks rows | experts | weights.
// ids/weights are [num_tokens, top_k]; owner[num_experts, owner_width] lists each
// expert's replicas' ranks (primary first, then -1; owner_width 1: one rank an expert);
// the pair of token row t goes to the (t mod replicas)-th (kernels/replica_choice.h).
cudaError_t LaunchDispatchLayout(const int32_t* ids, const float* weights, const int32_t* owner,
                                 int64_t owner_width, int64_t num_tokens, int64_t top_k,
                                 int64_t num_experts, int64_t num_ranks,
                                 int32_t* num_tokens_per_rank, int32_t* num_pairs_per_rank,
                                 int32_t* num_tokens_per_expert, int32_t* token_rows,
                                 int32_t* pairs, void* workspace, size_t workspace_bytes,
                                 cudaStream_t stream);
// Up to kMaxSortPayloads arrays of n 32-bit elements permuted with a sort:
// out[j][s] = in[j][order[s]] for j < count.
constexpr int kMaxSortPayloads = 3;
struct SortPayloads {
  const int32_t* in[kMaxSortPayloads] = {};
  int32_t* out[kMaxSortPayloads] = {};
  int count = 0;
};
// Stable sort of pairs by expert: order[n] (pair indices, expert by expert, in pair order
// within one) and expert_offsets[num_experts + 1], the payloads permuted alike.
cudaError_t LaunchSortPairsByExpert(const int32_t* experts, int64_t n, int64_t num_experts,
                                    int32_t* order, int32_t* expert_offsets, void* workspace,
                                    size_t workspace_bytes, cudaStream_t stream,
                                    const SortPayloads& payloads = {});
// The combine: out[t] = sum in ascending rank order of recv[i] over the i in rank r's range
// [rank_offsets[r], rank_offsets[r + 1]) with token_rows[i] == t (each rank's token_rows
// ascend); zero where no rank has t. rank_offsets is a device array of num_ranks + 1.
cudaError_t LaunchCombineRows(const void* recv, ElemType recv_type, const int32_t* token_rows,
                              const int64_t* rank_offsets, int64_t num_ranks, int64_t num_tokens,
                              int64_t hidden, void* out, ElemType out_type, cudaStream_t stream);
// dst[rows[i]] += scales[i] * src[i] for i < n in order of i (per destination row, the
// contributions are added in ascending i). src rows of `cols` in f32 or bf16 (widened
// exactly), dst f32.
cudaError_t LaunchScaleAddRows(const void* src, ElemType src_type, const float* scales,
                               const int32_t* rows, int64_t n, int64_t cols, float* dst,
                               int64_t dst_rows, void* workspace, size_t workspace_bytes,
                               cudaStream_t stream);
// Backend::UnpackRoutedPairs: an expert round's pair blocks, segment by segment, into rows
// (plus each segment's row offset), experts and weights [num_pairs]; bad[0] = the number
// of pairs with a row outside their segment's rows or an expert outside [0, num_experts)
// or not held, bad[1] = the lowest such pair index (INT32_MAX if none); a bad pair is
// written as (its segment's first row, the lowest held expert, weight 0). Segments are
// PairSegment {first_pair, num_pairs, row_offset, num_rows} (kernels/backend.h) as int32
// quadruples, at most kMaxUnpackSegments, tiling [0, num_pairs) in order.
inline constexpr int kMaxUnpackSegments = 128;
cudaError_t LaunchUnpackRoutedPairs(const int32_t* blocks, const int32_t* segments,
                                    int num_segments, const int32_t* held, int64_t num_experts,
                                    int64_t num_pairs, int32_t* rows, int32_t* experts,
                                    float* weights, int32_t* bad, cudaStream_t stream);

// ---- sampling.cu ----

// ids[i] = argmax of logits[i, 0..vocab) (Backend::ArgmaxRows: ties to the lowest index,
// NaNs never chosen unless at index 0), one block per row.
cudaError_t LaunchArgmaxRows(const float* logits, int64_t n, int64_t vocab, int32_t* ids,
                             cudaStream_t stream);

// Scratch for LaunchSampleRows: sorted candidates of the rows sampled at once (at most
// 2^23 candidates, 128 MiB) and CUB's sort storage. Asks CUB for its size (no device work).
// cudaErrorInvalidValue for vocab outside [1, 2^23] or n outside [0, INT_MAX].
cudaError_t SampleRowsWorkspaceBytes(int64_t n, int64_t vocab, size_t* bytes);
// Backend::SampleRows: ids[i] = logits[i, 0..vocab) sampled with params[i] (device
// SamplingRows) after its adjustments (of the num_adjust at `adjustments`), the host's
// ApplyLogitAdjustments and SampleToken (kernels/sampling.h) up to the summation order; -1
// for a row whose parameters are out of range. No host synchronisation.
cudaError_t LaunchSampleRows(const float* logits, int64_t n, int64_t vocab,
                             const SamplingRow* params, const LogitAdjustment* adjustments,
                             int64_t num_adjust, int32_t* ids, void* workspace,
                             size_t workspace_bytes, cudaStream_t stream);
// Backend::CountPendingTokens: for each row i of params whose adjustments (of the num_adjust
// at `adjustments`) end in a kAdjustPending entry, tokens[i] counted into them as the host's
// CountPendingToken (kernels/sampling.h) does; rows whose adjustments fall outside are
// skipped. One warp a row; no host synchronisation.
cudaError_t LaunchCountPendingTokens(const int32_t* tokens, int64_t n, const SamplingRow* params,
                                     LogitAdjustment* adjustments, int64_t num_adjust,
                                     cudaStream_t stream);

// ---- logprobs.cu ----

// Scratch for LaunchLogprobRows: each row's slices' maxima, sums and k first candidates.
cudaError_t LogprobRowsWorkspaceBytes(int64_t n, int64_t vocab, int64_t k, size_t* bytes);
// Backend::LogprobRows: log_softmax of the raw row at sampled[i] and at named[i, 0..m), and
// the row's k most likely tokens (k <= 20), most likely first. Ids outside [0, vocab) give
// 0. No host synchronisation.
cudaError_t LaunchLogprobRows(const float* logits, int64_t n, int64_t vocab, const int32_t* sampled,
                              const int32_t* named, int64_t m, int64_t k, float* sampled_logprobs,
                              float* named_logprobs, int32_t* top_ids, float* top_logprobs,
                              void* workspace, size_t workspace_bytes, cudaStream_t stream);

// counts[e] += offsets[e + 1] - offsets[e] for e < n (Backend::AccumulateCounts).
cudaError_t LaunchAccumulateCounts(const int32_t* offsets, int64_t n, int64_t* counts,
                                   cudaStream_t stream);

// ---- random_fill.cu ----

// Backend::FillUniform (kernels/backend.h): dst[i] = mean + (2u_i - 1) * half_width in
// double, u_i from SplitMix64 output i of `seed` (common/splitmix64.h), rounded to
// `values_type` and stored as `dst_type`: bit-identical to the CPU backend's values.
cudaError_t LaunchFillUniform(void* dst, ElemType dst_type, int64_t n, uint64_t seed, double mean,
                              double half_width, ElemType values_type, cudaStream_t stream);

}  // namespace dxs::cuda
