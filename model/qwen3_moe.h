// Qwen3MoeModel: the forward pass of transformers' Qwen3MoeForCausalLM, attention side.
//
// Per layer: RMSNorm -> attention (GQA, per-head q/k RMSNorm, RoPE, KV cache) -> residual
// -> RMSNorm -> MoE (router softmax, top-k, optional renormalisation; experts through a
// MoeExecutor) or a dense SwiGLU MLP -> residual. Then the final norm and lm_head.
//
// A step takes any number of sequence chunks (prefill, chunked prefill or one decode
// token each), flattened into one token batch. Zero chunks is a valid step: it still
// walks every MoE layer with zero tokens so distributed ranks stay in lockstep.
//
// Thread safety: one thread calls Forward at a time.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <tuple>
#include <vector>

#include "absl/status/statusor.h"
#include "common/model_config.h"
#include "kernels/backend.h"
#include "kernels/moe_executor.h"
#include "model/kv_cache.h"
#include "model/step_sampling.h"
#include "model/weights.h"

namespace dxs {

struct SequenceChunk {
  int kv_slot = -1;
  int64_t start_position = 0;  // tokens of this sequence already in the KV cache
  std::vector<int32_t> tokens;
  // Logits rows the step returns for this chunk: those of its last `logit_rows` tokens
  // (1..tokens.size(); more than 1 to score a prompt). Decode steps take 1.
  int64_t logit_rows = 1;
};

// The logits rows a step of `chunks` returns: the sum of their logit_rows.
int64_t StepLogitRows(const std::vector<SequenceChunk>& chunks);

class Qwen3MoeModel {
 public:
  Qwen3MoeModel(const ModelConfig& config, AttentionWeights weights, Backend* backend,
                MoeExecutor* moe);

  const ModelConfig& config() const { return config_; }
  Backend* backend() const { return backend_; }

  // Runs one step and returns logits[StepLogitRows(chunks), vocab]: each chunk's last
  // logit_rows tokens in order, chunk after chunk (a backend tensor). Writes the chunks' keys and
  // values into `kv`'s pages. Checks token ids and KV bounds first.
  //
  // num_micro_batches = 2: two-batch overlap. The chunks are split into two micro-batches
  // of about equal token count (either may be empty) that go through the layers
  // interleaved, so one micro-batch's attention runs while the experts work on the other's
  // MoE (MoeExecutor::Dispatch/Combine). Each token's arithmetic is the same as with one
  // micro-batch; only the GEMMs' row counts change.
  //
  // `input_ids` (one per token of the chunks, in order, on the backend) replaces the chunks'
  // tokens as the step's input: overlap scheduling's decode steps, whose input tokens the
  // step before sampled and has not brought to the host yet (their chunks hold placeholders).
  absl::StatusOr<Tensor> Forward(const std::vector<SequenceChunk>& chunks, KvCache* kv,
                                 int num_micro_batches = 1, const Tensor* input_ids = nullptr);

  // A decode-shaped step (one token per chunk, at most kMaxGraphBatch chunks) padded to a
  // batch bucket (a power of two) and a block-table width, as vLLM and SGLang pad for
  // CUDA graphs: with `use_graph` on a backend that has graphs, the first step of a bucket
  // records the step's work once (Backend::CaptureGraph) and later steps replay it, with
  // the step's inputs staged in pinned memory; without, the same padded work runs eagerly
  // (the reference a replay must equal bit for bit). Padding rows cache nothing. Returns
  // logits[num_chunks, vocab] (f32), as Forward.
  //
  // With `sampling` (Scheduler::PlanStepSampling of a step without forked samples), the
  // step's sampling runs after the logits in the same graph (EnqueueStepSampling: the
  // penalties, filters, draw and log-probabilities), its plan staged in pinned memory
  // beside the step's inputs, and its outputs (one row per chunk) go to `sampled`, valid
  // until the next ForwardDecode. A shape's graph is recorded per kind of sampling (none,
  // argmax, sampled with the adjustment list's capacity, the log-probability widths).
  // `input_ids` as Forward's.
  static constexpr int64_t kMaxGraphBatch = 256;
  static bool IsDecodeStep(const std::vector<SequenceChunk>& chunks);
  absl::StatusOr<Tensor> ForwardDecode(const std::vector<SequenceChunk>& chunks, KvCache* kv,
                                       bool use_graph, const StepSamplingPlan* sampling = nullptr,
                                       StepSamplingOutputs* sampled = nullptr,
                                       const Tensor* input_ids = nullptr);
  // Graphs recorded so far (one per batch bucket and table width).
  size_t num_graphs() const;
  // The rows ForwardDecode runs for a decode step of `num_chunks` tokens (its batch bucket).
  static int64_t PaddedDecodeBatch(int64_t num_chunks);
  // Forgets ForwardDecode's recorded graphs (their MoE executor's memory is going away: a
  // new low-latency exchange); the next steps record them again.
  void DropDecodeGraphs();

  // A decode-shaped step through a MoE executor whose experts are elsewhere (overlaps():
  // the dispatch and combine need the host between layers), padded as ForwardDecode pads,
  // with the work between two exchanges recorded as one graph per segment (vLLM's
  // piecewise CUDA graphs): segment 0 is the step's inputs, the embedding and every layer
  // up to the first MoE layer's router; segment i + 1 is MoE layer i's residual add and
  // the layers up to the next MoE layer's router; the last ends with lm_head. Between
  // segments the executor's Dispatch and Combine run eagerly on the step's real rows only
  // (padding rows are never dispatched). Every tensor that crosses a segment boundary is
  // allocated once per shape, so a segment's first run records it and later steps replay
  // it. Attention takes the backend's plan-free kernel (no host lengths), so nothing runs
  // on the host between replays. With `use_graph` false (or a backend without graphs) the
  // same padded segments run eagerly: the reference a replay must equal. Returns
  // logits[num_chunks, vocab] (f32), as Forward.
  // `input_ids` as Forward's.
  absl::StatusOr<Tensor> ForwardDecodePiecewise(const std::vector<SequenceChunk>& chunks,
                                                KvCache* kv, bool use_graph,
                                                const Tensor* input_ids = nullptr);
  // Segment graphs recorded so far, all shapes.
  size_t num_piecewise_graphs() const;

 private:
  absl::Status Validate(const std::vector<SequenceChunk>& chunks, KvCache* kv) const;

  // One micro-batch of a step (the whole step when it is not split).
  struct MicroBatch {
    std::vector<SequenceChunk> chunks;
    Tensor positions;                // [tokens] i32
    PagedAttentionMeta attn;         // the same for every layer of the step
    Tensor hidden, normed, mlp_out;  // normed and mlp_out live until the combine
    // The next layer's input norm of hidden, written by this layer's last residual add
    // (AddRmsNorm); the first layer computes its own.
    Tensor input_normed;
    std::unique_ptr<MoeHandle> moe;  // a dispatched MoE layer, until its combine
  };
  // Uploads the micro-batch's token ids (unless given on the backend: `input_ids`),
  // positions and paged-attention metadata, and embeds.
  absl::Status Prepare(KvCache* kv, MicroBatch* mb, const Tensor* input_ids = nullptr);
  // Attention of `layer` over mb->hidden (normed by the previous layer, or here for the
  // first): the o projection into *o, before the residual add.
  absl::Status AttentionBlock(int layer, KvCache* kv, MicroBatch* mb, Tensor* o);
  // hidden += x, fused with the next layer's input norm into mb->input_normed (a plain add
  // after the last layer: the final norm reads the chunks' last rows only).
  absl::Status ResidualAdd(int layer, const Tensor& x, MicroBatch* mb);
  // The dense SwiGLU MLP of a non-MoE layer: normed -> out.
  absl::Status DenseMlp(int layer, const Tensor& normed, Tensor* out);
  // Attention of `layer`, the post-attention norm, then either the dense MLP (and its
  // residual add) or the MoE's dispatch.
  absl::Status MicroFront(int layer, int micro, int num_micro, KvCache* kv, MicroBatch* mb);
  // For MoE layers: the combine and the residual add.
  absl::Status MicroBack(int layer, int micro, MicroBatch* mb);
  // Gathers each chunk's last row of `hidden` (the chunks' rows, in order) into `last`
  // from row `first_row` on.
  absl::Status GatherLastRows(const std::vector<SequenceChunk>& chunks, const Tensor& hidden,
                              int64_t first_row, Tensor* last);
  // Final norm and lm_head: last[num_chunks, hidden] -> logits[num_chunks, vocab].
  absl::StatusOr<Tensor> Logits(Tensor last);
  // An MoE layer after its attention: hidden += o, normed = the post-attention norm of it,
  // then the router's top-k ids [T, k] (i32) and weights [T, k] (f32), in one backend op
  // (Backend::AddRmsNormRoute: one kernel on the GPU at decode sizes).
  absl::Status AddNormRoute(int layer, const Tensor& o, Tensor* hidden, Tensor* normed, Tensor* ids,
                            Tensor* weights);

  // A padded decode shape: the pinned inputs its steps read and, once recorded, its graph.
  // What a decode graph samples: kind (0 nothing, 1 argmax, 2 SampleRows), the adjustment
  // list's capacity (0: none), and the log-probability widths (top, named; -1: none).
  using DecodeSamplingKey = std::tuple<int, int64_t, int64_t, int64_t>;
  static DecodeSamplingKey SamplingKeyOf(const StepSamplingPlan* sampling);
  struct DecodeGraph {
    CapturedGraph captured;
    std::shared_ptr<Buffer> staging;
    std::unique_ptr<Event> done;    // after the last replay: staging may be rewritten
    const void* kv_pool = nullptr;  // the KV pool recorded; a grown pool makes it stale
    StepSamplingOutputs sampled;    // what its sampling writes, [batch] rows
    Tensor token_ids;               // [batch] i32: the input ids, written before each run
  };
  // ForwardDecode's padded work, reading its inputs from `staging` (layout: StagingLayout)
  // but the token ids, from `token_ids` (written before each run, so that they may come
  // from the device), then the sampling of `key` into *sampled.
  absl::StatusOr<Tensor> DecodeBody(const Buffer& staging, const Tensor& token_ids, int64_t batch,
                                    int64_t width, KvCache* kv, const DecodeSamplingKey& key,
                                    StepSamplingOutputs* sampled);

  // Writes a padded decode step's inputs into `base` (StagingLayout of batch x width).
  void StageDecodeStep(const std::vector<SequenceChunk>& chunks, KvCache* kv, int64_t batch,
                       int64_t width, uint8_t* base) const;
  // Checks a decode-shaped step (IsDecodeStep, Validate) and returns its padded batch and
  // block-table width.
  absl::StatusOr<std::pair<int64_t, int64_t>> CheckedDecodeShape(
      const std::vector<SequenceChunk>& chunks, KvCache* kv) const;

  // One padded shape of ForwardDecodePiecewise: its staging, the tensors that cross segment
  // boundaries (allocated once) and, once recorded, one graph per segment.
  struct PiecewiseShape {
    std::shared_ptr<Buffer> staging;
    std::unique_ptr<Event> done;  // after the last step: staging may be rewritten
    const void* kv_pool = nullptr;
    MicroBatch mb;  // positions, attention metadata, hidden, normed, mlp_out
    Tensor token_ids, ids, weights;
    std::vector<CapturedGraph> segments;
  };
  absl::Status PreparePiecewise(int64_t batch, int64_t width, KvCache* kv, PiecewiseShape* p);
  // One segment of a piecewise step: layers (after, last] (after = -1: the step's inputs
  // and the embedding first; else MoE layer `after`'s residual add first), a MoE layer
  // `last` up to its router; with `logits`, then the logits, which it returns.
  absl::StatusOr<Tensor> PiecewiseSegment(PiecewiseShape* p, int after, int last, bool logits,
                                          int64_t batch, int64_t width, KvCache* kv);

  ModelConfig config_;
  AttentionWeights w_;
  Backend* backend_;
  MoeExecutor* moe_;
  std::map<std::tuple<const KvCache*, int64_t, int64_t, DecodeSamplingKey>, DecodeGraph> graphs_;
  std::map<std::tuple<const KvCache*, int64_t, int64_t>, PiecewiseShape> piecewise_;
};

}  // namespace dxs
