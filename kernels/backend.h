// Backend: the compute interface the model, the dispatch/combine engine and the expert
// workers are written against.
//
// A backend owns memory (Allocate, from its caching allocator) and implements every
// operation on tensor data: the Qwen3-MoE forward pass, paged attention, routing, the
// dispatch layout, packing, the grouped expert FFN and the combine's weighted sum. Code
// outside a backend never dereferences a tensor's memory; it moves bytes in and out with
// CopyFromHost/CopyToHost only. All tensors are row-major.
//
// Work queue: operations are enqueued in call order on the backend's one ordered queue (a
// CUDA stream; the CPU backend runs each at once). A returned Status reports argument
// errors and launch errors; errors of asynchronous work surface at the next
// Synchronize/SynchronizeEvent. Events mark points in the queue: a transport waits on one
// before it sends rows (they are written), compute waits on one before it reads rows that
// arrived.
//
// Empty batches: every operation accepts zero rows and then launches nothing; arguments are
// still checked.
//
// Dtypes: weights are kept in WeightDType(stored dtype); activations are computed in
// ActivationDType(). Ops that move rows (GatherRows, Copy, CopyFromHost/ToHost) convert
// between floating dtypes; index tensors are i32 (i64 for cache slots).
//
// Thread safety: a Backend may be shared by threads that operate on distinct tensors; its
// queue order is the order of calls as they reach it.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kernels/low_latency_exchange.h"
#include "kernels/tensor.h"

namespace dxs {

// A point in a backend's work queue. Made by Backend::CreateEvent, used with that backend.
class Event {
 public:
  virtual ~Event() = default;
};

// Recorded queue work that can be run again (a CUDA graph). Made by Backend::CaptureGraph.
class Graph {
 public:
  virtual ~Graph() = default;
};

// CaptureGraph's result: the graph, and the tensor its body returned while being recorded
// (what each Replay writes).
struct CapturedGraph {
  std::unique_ptr<Graph> graph;
  Tensor output;
};

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

// Device memory another process of this host maps (Backend::AllocateShared): the block and
// the key that names it to the other process (Backend::OpenShared).
struct SharedMemory {
  std::shared_ptr<Buffer> buffer;
  std::string key;
};

class Backend {
 public:
  virtual ~Backend() = default;
  virtual std::string name() const = 0;
  virtual Device device() const = 0;
  // The dtype a weight stored as `stored` is kept in (the CPU widens to float32).
  virtual DType WeightDType(DType stored) const = 0;
  // The dtype activations are computed in.
  virtual DType ActivationDType() const = 0;

  // ---- Memory (the caching allocator; uninitialised) ----
  virtual absl::StatusOr<Tensor> Allocate(std::vector<int64_t> shape, DType dtype) = 0;
  // dst's elements from host memory holding them in `src_dtype` (converted when both are
  // floating types; index dtypes must match).
  virtual absl::Status CopyFromHost(const void* src, DType src_dtype, Tensor* dst) = 0;
  // src's elements to host memory, in `dst_dtype`. Waits for queued work writing src.
  virtual absl::Status CopyToHost(const Tensor& src, DType dst_dtype, void* dst) = 0;
  // dst = src elementwise (equal element counts), converting floating dtypes.
  virtual absl::Status Copy(const Tensor& src, Tensor* dst) = 0;
  virtual absl::Status Fill(Tensor* t, float value) = 0;
  // Seeded uniform values, the same on every backend (random checkpoints made in place,
  // model/random_checkpoint.h): element i is mean + (2u - 1) * half_width computed in
  // double, with u = (SplitMix64 output i of `seed`) >> 11 scaled to [0, 1); rounded to
  // `values_dtype` (the dtype a checkpoint would store), then converted to t's dtype.
  virtual absl::Status FillUniform(Tensor* t, uint64_t seed, double mean, double half_width,
                                   DType values_dtype) = 0;
  // Where a transport reads and writes t's memory: the memory itself for host memory and
  // for device memory a device-capable transport takes (UCX with CUDA, NCCL); the opaque
  // test backend's read-write view of its memory. Only transports dereference it, after
  // the events that order it with the queue.
  virtual void* TransportAddress(const Tensor& t) { return t.raw(); }

  // ---- Queue and events ----
  virtual absl::StatusOr<std::unique_ptr<Event>> CreateEvent() = 0;
  // Marks the point after all work enqueued so far.
  virtual absl::Status RecordEvent(Event* event) = 0;
  // Work enqueued from now on starts after `event` (another backend's queue may record it
  // on the same device).
  virtual absl::Status WaitEvent(Event* event) = 0;
  // The calling thread waits for `event`.
  virtual absl::Status SynchronizeEvent(Event* event) = 0;
  // The calling thread waits for all enqueued work.
  virtual absl::Status Synchronize() = 0;

  // ---- Graphs (CUDA graphs; unsupported on the CPU) ----
  // Host memory the queue reads asynchronously (pinned on CUDA): inputs staged for a graph
  // replay. The caller must not rewrite it while queued work may still read it.
  virtual absl::StatusOr<std::shared_ptr<Buffer>> AllocateStaging(size_t bytes);
  // dst's bytes from staging memory at `offset`; enqueued (and recorded by a capture).
  virtual absl::Status CopyFromStaging(const Buffer& staging, size_t offset, Tensor* dst);
  // src's bytes into staging memory at `offset`, enqueued: they are there once an event
  // recorded after it has passed (overlap scheduling reads a step's tokens so while the
  // next step runs). Where the queue is the caller's (the CPU), the copy is done on return.
  virtual absl::Status CopyToStaging(const Tensor& src, const Buffer& staging, size_t offset);

  // ---- Memory another process maps (the one-copy exchange on a device) ----
  // At least `bytes` of this backend's memory that another process of this host maps with
  // OpenShared(key) and reads and writes in place: on CUDA a block of its own cudaMalloc and
  // its IPC handle. UNIMPLEMENTED where the backend's memory is the host's (the transport
  // maps that: DataExchange::MapRegion) or cannot be shared.
  virtual absl::StatusOr<SharedMemory> AllocateShared(size_t bytes);
  // The block `key` names (AllocateShared's, this process's or another's), mapped here
  // until the Buffer goes. INVALID_ARGUMENT for a key that names none; UNIMPLEMENTED where
  // nothing is shared.
  virtual absl::StatusOr<std::shared_ptr<Buffer>> OpenShared(std::string_view key);
  // One rank's side of the low-latency exchange of decode steps (kernels/low_latency_exchange.h):
  // its receive region made here, the rounds enqueued on this backend's queue.
  // UNIMPLEMENTED where the backend has none (the CPU's: the host-driven exchange serves
  // it).
  virtual absl::StatusOr<std::unique_ptr<LowLatencyExchange>> MakeLowLatencyExchange(
      const LowLatencyShape& shape, LowLatencySide side, int rank);
  virtual bool SupportsGraphs() const { return false; }
  // Runs `body` once eagerly (its result goes to *eager_output), then records it into a
  // graph. During both, the backend allocates from a pool of its own that eager work never
  // uses, so the memory a graph writes between replays is the graph's alone (PyTorch's
  // private graph pool). `body` must not synchronise with the host while recorded. Tensors
  // it reads that were made outside must outlive the graph unchanged in place.
  // eager_output null: no eager run, the body is only recorded; whatever it makes lazily
  // (tables, workspaces, kernels' first loads) must exist already. For work that waits on
  // other ranks (the low-latency exchange): recorded before any of them runs, so no
  // allocation or instantiation happens while a peer's kernels spin on the same GPU.
  virtual absl::StatusOr<CapturedGraph> CaptureGraph(
      const std::function<absl::StatusOr<Tensor>()>& body, Tensor* eager_output);
  // Whether CaptureGraph is running a body (persistent scratch must not be used then).
  virtual bool InGraphCapture() const { return false; }
  // Enqueues the recorded work again; it writes the CapturedGraph's output.
  virtual absl::Status Replay(Graph* graph);

  // ---- Dense ops ----
  // y[m, n] = x[m, k] * w[n, k]^T (+ bias[n] when given). The GEMM.
  virtual absl::Status Linear(const Tensor& x, const Tensor& w, const Tensor* bias, Tensor* y) = 0;
  // ys[i] = x * ws[i]^T, no biases, for weights sharing their input (a layer's q, k and v):
  // Linear for each, which a device may run as one launch. ws and ys of one size.
  virtual absl::Status Linears(const Tensor& x, const std::vector<const Tensor*>& ws,
                               const std::vector<Tensor*>& ys);
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

  // ---- Routing and the MoE exchange ----
  // Softmax over logits[T, E] (float32), then the top_k largest (ties to the lower expert
  // id), renormalised to sum 1 when `normalize`. Writes ids (i32) and weights (f32), each
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
                                            const std::vector<const Tensor*>& down, Tensor* y);
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
  // Log-probabilities of raw logits rows (log_softmax; kernels/sampling.h's RowLogprobs), for
  // row i of logits (f32 [n, vocab]): sampled_logprobs[i] (f32 [n]) of token sampled[i] (i32
  // [n]); named_logprobs[i, j] (f32 [n, m]) of token named[i, j] (i32 [n, m]; -1 gives 0);
  // and the row's k most likely tokens, top_ids[i, :] (i32 [n, k]) with their
  // top_logprobs[i, :] (f32 [n, k]), most likely first, equal logits by lower id; k <= 20.
  // Ids outside the vocabulary are INVALID_ARGUMENT on the CPU; a device gives 0 for them.
  virtual absl::Status LogprobRows(const Tensor& logits, const Tensor& sampled, const Tensor& named,
                                   Tensor* sampled_logprobs, Tensor* named_logprobs,
                                   Tensor* top_ids, Tensor* top_logprobs) = 0;
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
                                    Tensor* out);
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
                                    Tensor* out);
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
  virtual absl::Status UnpackRoutedPairs(const Tensor& blocks,
                                         const std::vector<PairSegment>& segments,
                                         const Tensor& held, Tensor* rows, Tensor* experts,
                                         Tensor* weights, Tensor* bad) = 0;

  // ---- Conveniences over the ops above ----
  absl::StatusOr<Tensor> Allocate(std::vector<int64_t> shape) {
    return Allocate(std::move(shape), ActivationDType());
  }
  absl::StatusOr<Tensor> Zeros(std::vector<int64_t> shape, DType dtype);
  // A float32 tensor from host floats.
  absl::StatusOr<Tensor> Upload(const std::vector<float>& host, std::vector<int64_t> shape);
  // An i32 tensor [n] from host values.
  absl::StatusOr<Tensor> UploadIndices(const std::vector<int32_t>& host);
  // The whole tensor as host floats.
  absl::StatusOr<std::vector<float>> Download(const Tensor& t);
  absl::StatusOr<std::vector<int32_t>> DownloadIndices(const Tensor& t);
};

// The CPU backend: float32, OpenBLAS for GEMM, threads sized to the machine.
std::unique_ptr<Backend> MakeCpuBackend();

}  // namespace dxs
