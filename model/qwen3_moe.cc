#include "model/qwen3_moe.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <optional>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"

namespace dxs {

Qwen3MoeModel::Qwen3MoeModel(const ModelConfig& config, AttentionWeights weights, Backend* backend,
                             MoeExecutor* moe)
    : config_(config), w_(std::move(weights)), backend_(backend), moe_(moe) {}

absl::Status Qwen3MoeModel::Validate(const std::vector<SequenceChunk>& chunks, KvCache* kv) const {
  for (const SequenceChunk& c : chunks) {
    if (c.tokens.empty()) return absl::InvalidArgumentError("a sequence chunk has no tokens");
    if (c.logit_rows < 1 || c.logit_rows > static_cast<int64_t>(c.tokens.size())) {
      return absl::InvalidArgumentError(absl::StrCat(
          "a chunk of ", c.tokens.size(), " tokens asks for ", c.logit_rows, " logits rows"));
    }
    if (!kv->HasSlot(c.kv_slot)) {
      return absl::InvalidArgumentError(absl::StrCat("unknown KV slot ", c.kv_slot));
    }
    for (int32_t id : c.tokens) {
      if (id < 0 || id >= config_.vocab_size) {
        return absl::InvalidArgumentError(absl::StrCat(
            "token id ", id, " is outside the vocabulary [0, ", config_.vocab_size, ")"));
      }
    }
    if (c.start_position < 0 ||
        c.start_position + static_cast<int64_t>(c.tokens.size()) > kv->slot_capacity(c.kv_slot)) {
      return absl::OutOfRangeError(
          absl::StrCat("positions [", c.start_position, ", ", c.start_position + c.tokens.size(),
                       ") exceed KV slot capacity ", kv->slot_capacity(c.kv_slot)));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<Tensor> Qwen3MoeModel::Forward(const std::vector<SequenceChunk>& chunks, KvCache* kv,
                                              int num_micro_batches, const Tensor* input_ids) {
  if (num_micro_batches < 1 || num_micro_batches > MoeExecutor::kMaxMicroBatches) {
    return absl::InvalidArgumentError(
        absl::StrCat("num_micro_batches: ", num_micro_batches, " is not 1 or 2"));
  }
  DXS_RETURN_IF_ERROR(Validate(chunks, kv));
  // Two micro-batches split in chunk order (so the logits keep it) where the token count
  // is closest to half; either may be empty.
  int64_t total = 0;
  for (const SequenceChunk& c : chunks) total += static_cast<int64_t>(c.tokens.size());
  if (input_ids != nullptr && input_ids->num_elements() != total) {
    return absl::InvalidArgumentError(
        absl::StrCat("forward: ", input_ids->num_elements(), " input ids for ", total, " tokens"));
  }
  size_t split = chunks.size();
  if (num_micro_batches == 2) {
    split = 0;
    int64_t before = 0;
    while (split < chunks.size() &&
           std::abs(2 * (before + static_cast<int64_t>(chunks[split].tokens.size())) - total) <
               std::abs(2 * before - total)) {
      before += static_cast<int64_t>(chunks[split].tokens.size());
      ++split;
    }
  }
  MicroBatch mbs[MoeExecutor::kMaxMicroBatches];
  mbs[0].chunks.assign(chunks.begin(), chunks.begin() + split);
  mbs[1].chunks.assign(chunks.begin() + split, chunks.end());
  int64_t first_token = 0;
  for (int m = 0; m < num_micro_batches; ++m) {
    int64_t tokens = 0;
    for (const SequenceChunk& c : mbs[m].chunks) tokens += static_cast<int64_t>(c.tokens.size());
    std::optional<Tensor> ids;
    if (input_ids != nullptr) ids = input_ids->Rows(first_token, tokens);
    first_token += tokens;
    DXS_RETURN_IF_ERROR(Prepare(kv, &mbs[m], ids ? &*ids : nullptr));
  }
  // front(l, m): attention of layer l, then the dense MLP or the MoE dispatch; back(l, m):
  // the MoE combine. With two micro-batches, front(l+1, 0) before back(l, 1) is the
  // overlap: while the experts work on one micro-batch, this rank computes the other's
  // attention. With one, it is the plain layer order.
  const int layers = config_.num_hidden_layers;
  for (int m = 0; m < num_micro_batches; ++m) {
    DXS_RETURN_IF_ERROR(MicroFront(0, m, num_micro_batches, kv, &mbs[m]));
  }
  for (int l = 0; l < layers; ++l) {
    for (int m = 0; m < num_micro_batches; ++m) {
      DXS_RETURN_IF_ERROR(MicroBack(l, m, &mbs[m]));
      if (l + 1 < layers) {
        DXS_RETURN_IF_ERROR(MicroFront(l + 1, m, num_micro_batches, kv, &mbs[m]));
      }
    }
  }
  DXS_ASSIGN_OR_RETURN(
      Tensor last, backend_->Allocate({StepLogitRows(chunks), config_.hidden_size}, DType::kF32));
  DXS_RETURN_IF_ERROR(GatherLastRows(mbs[0].chunks, mbs[0].hidden, 0, &last));
  if (num_micro_batches == 2) {
    DXS_RETURN_IF_ERROR(
        GatherLastRows(mbs[1].chunks, mbs[1].hidden, StepLogitRows(mbs[0].chunks), &last));
  }
  return Logits(std::move(last));
}

// ---- Decode steps padded for graphs ----

namespace {

// Where each input of a padded decode step lies in its staging buffer; then, for a step
// that samples in its graph, the sampling rows, adjustments and named ids.
struct StagingLayout {
  size_t slots, ids, positions, query_start, context_lens, block_tables, params, adjustments, named,
      bytes;
  StagingLayout(int64_t batch, int64_t width, int64_t adjust_capacity = 0,
                int64_t named_width = 0) {
    size_t at = 0;
    auto take = [&at](size_t n) {
      const size_t start = at;
      at += (n + 63) / 64 * 64;
      return start;
    };
    slots = take(batch * sizeof(int64_t));
    ids = take(batch * sizeof(int32_t));
    positions = take(batch * sizeof(int32_t));
    query_start = take((batch + 1) * sizeof(int32_t));
    context_lens = take(batch * sizeof(int32_t));
    block_tables = take(batch * width * sizeof(int32_t));
    params = take(batch * sizeof(SamplingRow));
    adjustments = take(adjust_capacity * sizeof(LogitAdjustment));
    named = take(batch * named_width * sizeof(int32_t));
    bytes = at;
  }
};

// The sizes of a padded decode step's paged-attention metadata (its tensors are the
// caller's): one query per sequence, every table `width` blocks wide.
PagedAttentionMeta PaddedDecodeMeta(int64_t batch, int64_t width, const KvCache& kv) {
  PagedAttentionMeta a;
  a.num_seqs = batch;
  a.block_size = kv.block_size();
  a.max_blocks_per_seq = width;
  a.max_query_len = 1;
  a.max_context_len = width * kv.block_size();
  a.padded_decode = true;
  return a;
}

int64_t NextPowerOfTwo(int64_t n) {
  int64_t p = 1;
  while (p < n) p *= 2;
  return p;
}

}  // namespace

int64_t Qwen3MoeModel::PaddedDecodeBatch(int64_t num_chunks) { return NextPowerOfTwo(num_chunks); }

void Qwen3MoeModel::DropDecodeGraphs() {
  // A graph's staging may still be read by its last replay.
  for (auto& [shape, g] : graphs_) {
    if (g.done != nullptr) (void)backend_->SynchronizeEvent(g.done.get());
  }
  graphs_.clear();
}

size_t Qwen3MoeModel::num_graphs() const {
  size_t n = 0;
  for (const auto& [shape, g] : graphs_) n += g.captured.graph != nullptr ? 1 : 0;
  return n;
}

bool Qwen3MoeModel::IsDecodeStep(const std::vector<SequenceChunk>& chunks) {
  if (chunks.empty() || static_cast<int64_t>(chunks.size()) > kMaxGraphBatch) return false;
  for (const SequenceChunk& c : chunks) {
    if (c.tokens.size() != 1 || c.logit_rows != 1) return false;
  }
  return true;
}

int64_t StepLogitRows(const std::vector<SequenceChunk>& chunks) {
  int64_t rows = 0;
  for (const SequenceChunk& c : chunks) rows += c.logit_rows;
  return rows;
}

Qwen3MoeModel::DecodeSamplingKey Qwen3MoeModel::SamplingKeyOf(const StepSamplingPlan* sampling) {
  if (sampling == nullptr) return {0, 0, -1, -1};
  const int64_t adjust = static_cast<int64_t>(sampling->adjustments.size());
  // Capacities in powers of two from 1024, so that a growing list records few graphs.
  const int64_t capacity =
      sampling->argmax || adjust == 0 ? 0 : NextPowerOfTwo(std::max<int64_t>(adjust, 1024));
  const StepLogprobShape& lp = sampling->logprobs;
  return {sampling->argmax ? 1 : 2, capacity, lp.any ? lp.top : -1, lp.any ? lp.named : -1};
}

absl::StatusOr<Tensor> Qwen3MoeModel::DecodeBody(const Buffer& staging, const Tensor& token_ids,
                                                 int64_t batch, int64_t width, KvCache* kv,
                                                 const DecodeSamplingKey& key,
                                                 StepSamplingOutputs* sampled) {
  const auto [kind, capacity, top, named_width] = key;
  const StagingLayout at(batch, width, capacity, std::max<int64_t>(named_width, 0));
  MicroBatch mb;
  PagedAttentionMeta& a = mb.attn;
  a = PaddedDecodeMeta(batch, width, *kv);
  auto staged = [&](std::vector<int64_t> shape, DType dtype,
                    size_t offset) -> absl::StatusOr<Tensor> {
    DXS_ASSIGN_OR_RETURN(Tensor t, backend_->Allocate(std::move(shape), dtype));
    DXS_RETURN_IF_ERROR(backend_->CopyFromStaging(staging, offset, &t));
    return t;
  };
  DXS_ASSIGN_OR_RETURN(a.slot_mapping, staged({batch}, DType::kI64, at.slots));
  DXS_ASSIGN_OR_RETURN(mb.positions, staged({batch}, DType::kI32, at.positions));
  DXS_ASSIGN_OR_RETURN(a.query_start, staged({batch + 1}, DType::kI32, at.query_start));
  DXS_ASSIGN_OR_RETURN(a.context_lens, staged({batch}, DType::kI32, at.context_lens));
  DXS_ASSIGN_OR_RETURN(a.block_tables, staged({batch, width}, DType::kI32, at.block_tables));
  // Each replay's lengths are in the staging too (ForwardDecode writes them before Replay):
  // a backend that plans attention on the host reads them there.
  const uint8_t* base = static_cast<const uint8_t*>(staging.data());
  a.host_query_start = reinterpret_cast<const int32_t*>(base + at.query_start);
  a.host_context_lens = reinterpret_cast<const int32_t*>(base + at.context_lens);
  DXS_ASSIGN_OR_RETURN(mb.hidden, backend_->Allocate({batch, config_.hidden_size}, DType::kF32));
  DXS_RETURN_IF_ERROR(backend_->Embedding(w_.embed_tokens, token_ids, &mb.hidden));
  for (int l = 0; l < config_.num_hidden_layers; ++l) {
    DXS_RETURN_IF_ERROR(MicroFront(l, 0, 1, kv, &mb));
    DXS_RETURN_IF_ERROR(MicroBack(l, 0, &mb));
  }
  DXS_ASSIGN_OR_RETURN(Tensor logits, Logits(mb.hidden));  // one row per sequence: its last
  if (kind == 0) return logits;
  // The step's sampling, from the staged plan (padding rows: greedy, nothing named).
  std::optional<Tensor> params, adjustments, named;
  if (kind == 2) {
    DXS_ASSIGN_OR_RETURN(params, staged({batch, kSamplingRowWords}, DType::kI64, at.params));
    if (capacity > 0) {
      DXS_ASSIGN_OR_RETURN(adjustments,
                           staged({capacity, kLogitAdjustmentWords}, DType::kI32, at.adjustments));
      // A step built ahead: its input ids are the step before's tokens, counted into the
      // penalised rows' pending entries (a no-op for rows without one, so every replay of
      // this graph may run it).
      DXS_RETURN_IF_ERROR(backend_->CountPendingTokens(token_ids, *params, &*adjustments));
    }
  }
  const StepLogprobShape shape{top >= 0, std::max<int64_t>(top, 0),
                               std::max<int64_t>(named_width, 0)};
  if (shape.any) {
    if (shape.named > 0) {
      DXS_ASSIGN_OR_RETURN(named, staged({batch, shape.named}, DType::kI32, at.named));
    } else {
      DXS_ASSIGN_OR_RETURN(named, backend_->Allocate({batch, 0}, DType::kI32));
    }
  }
  DXS_RETURN_IF_ERROR(EnqueueStepSampling(backend_, logits, kind == 1, params ? &*params : nullptr,
                                          adjustments ? &*adjustments : nullptr,
                                          named ? &*named : nullptr, shape, sampled));
  return logits;
}

absl::StatusOr<Tensor> Qwen3MoeModel::ForwardDecode(const std::vector<SequenceChunk>& chunks,
                                                    KvCache* kv, bool use_graph,
                                                    const StepSamplingPlan* sampling,
                                                    StepSamplingOutputs* sampled,
                                                    const Tensor* input_ids) {
  DXS_ASSIGN_OR_RETURN(const auto shape, CheckedDecodeShape(chunks, kv));
  const int64_t n = static_cast<int64_t>(chunks.size());
  if (input_ids != nullptr && input_ids->num_elements() != n) {
    return absl::InvalidArgumentError(
        absl::StrCat("decode step: ", input_ids->num_elements(), " input ids for ", n, " chunks"));
  }
  const int64_t batch = shape.first, width = shape.second;
  if (sampling != nullptr &&
      (sampled == nullptr || static_cast<int64_t>(sampling->rows.size()) != n ||
       !sampling->fork_rows.empty() ||
       static_cast<int64_t>(sampling->named_ids.size()) != n * sampling->logprobs.named)) {
    return absl::InvalidArgumentError(
        "decode step sampling: one row per chunk, no forked samples, and an output");
  }
  if (sampling != nullptr && sampling->pending_tokens && input_ids == nullptr) {
    return absl::FailedPreconditionError(
        "decode step sampling: a step built ahead needs its input ids on the device (its "
        "penalties count the step before's tokens)");
  }
  use_graph = use_graph && backend_->SupportsGraphs();
  const DecodeSamplingKey key = SamplingKeyOf(sampling);
  // One entry per shape, graphed or not: its pinned staging is reused from step to step.
  DecodeGraph& g = graphs_[{kv, batch, width, key}];
  const void* pool = kv->keys(0).defined() ? kv->keys(0).raw() : nullptr;
  if (g.captured.graph != nullptr && g.kv_pool != pool) {
    g = DecodeGraph();  // the KV pool grew since recording: record again
  }
  const auto [kind, capacity, top, named_width] = key;
  const StagingLayout at(batch, width, capacity, std::max<int64_t>(named_width, 0));
  if (g.staging == nullptr) {
    DXS_ASSIGN_OR_RETURN(g.staging, backend_->AllocateStaging(at.bytes));
    DXS_ASSIGN_OR_RETURN(g.done, backend_->CreateEvent());
    DXS_ASSIGN_OR_RETURN(g.token_ids, backend_->Allocate({batch}, DType::kI32));
    if (sampling != nullptr) {
      DXS_ASSIGN_OR_RETURN(g.sampled,
                           AllocateStepSamplingOutputs(backend_, batch, sampling->logprobs));
    }
  } else {
    DXS_RETURN_IF_ERROR(backend_->SynchronizeEvent(g.done.get()));  // the last replay read it
  }
  uint8_t* base = static_cast<uint8_t*>(g.staging->data());
  StageDecodeStep(chunks, kv, batch, width, base);
  if (sampling != nullptr) {
    auto* rows = reinterpret_cast<SamplingRow*>(base + at.params);
    std::copy(sampling->rows.begin(), sampling->rows.end(), rows);
    std::fill(rows + n, rows + batch, ToSamplingRow(SamplingParams{}, 0));  // padding: greedy
    std::copy(sampling->adjustments.begin(), sampling->adjustments.end(),
              reinterpret_cast<LogitAdjustment*>(base + at.adjustments));
    auto* named = reinterpret_cast<int32_t*>(base + at.named);
    std::copy(sampling->named_ids.begin(), sampling->named_ids.end(), named);
    std::fill(named + n * sampling->logprobs.named, named + batch * sampling->logprobs.named, -1);
  }
  // The token ids go in before the graph (which reads them from g.token_ids): staged, then
  // the real rows' from the device where the step before sampled them (input_ids).
  DXS_RETURN_IF_ERROR(backend_->CopyFromStaging(*g.staging, at.ids, &g.token_ids));
  if (input_ids != nullptr) {
    Tensor rows = g.token_ids.Rows(0, n);
    DXS_RETURN_IF_ERROR(backend_->Copy(*input_ids, &rows));
  }
  Tensor logits;
  auto body = [&]() {
    return DecodeBody(*g.staging, g.token_ids, batch, width, kv, key, &g.sampled);
  };
  if (!use_graph) {
    DXS_ASSIGN_OR_RETURN(logits, body());
  } else if (g.captured.graph == nullptr) {
    // The first step of this shape: run it, and record it for the next ones.
    DXS_ASSIGN_OR_RETURN(g.captured, backend_->CaptureGraph(body, &logits));
    g.kv_pool = pool;
  } else {
    DXS_RETURN_IF_ERROR(backend_->Replay(g.captured.graph.get()));
    logits = g.captured.output;
  }
  DXS_RETURN_IF_ERROR(backend_->RecordEvent(g.done.get()));
  if (sampling != nullptr) *sampled = g.sampled.Rows(n);
  return logits.Rows(0, n);
}

absl::StatusOr<std::pair<int64_t, int64_t>> Qwen3MoeModel::CheckedDecodeShape(
    const std::vector<SequenceChunk>& chunks, KvCache* kv) const {
  if (!IsDecodeStep(chunks)) {
    return absl::InvalidArgumentError(
        absl::StrCat("a padded decode step takes 1 to ", kMaxGraphBatch, " one-token chunks"));
  }
  DXS_RETURN_IF_ERROR(Validate(chunks, kv));
  const int64_t bs = kv->block_size();
  int64_t blocks = 1;
  for (const SequenceChunk& c : chunks) {
    blocks = std::max(blocks, (c.start_position + 1 + bs - 1) / bs);
  }
  return std::pair<int64_t, int64_t>{PaddedDecodeBatch(static_cast<int64_t>(chunks.size())),
                                     NextPowerOfTwo(std::max<int64_t>(blocks, 16))};
}

void Qwen3MoeModel::StageDecodeStep(const std::vector<SequenceChunk>& chunks, KvCache* kv,
                                    int64_t batch, int64_t width, uint8_t* base) const {
  // The step's inputs, padded: extra rows decode token 0 at position 0 over one position
  // and cache nothing (slot -1).
  const StagingLayout at(batch, width);
  const int64_t n = static_cast<int64_t>(chunks.size()), bs = kv->block_size();
  auto* slots = reinterpret_cast<int64_t*>(base + at.slots);
  auto* ids = reinterpret_cast<int32_t*>(base + at.ids);
  auto* positions = reinterpret_cast<int32_t*>(base + at.positions);
  auto* query_start = reinterpret_cast<int32_t*>(base + at.query_start);
  auto* context_lens = reinterpret_cast<int32_t*>(base + at.context_lens);
  auto* tables = reinterpret_cast<int32_t*>(base + at.block_tables);
  std::fill(tables, tables + batch * width, 0);
  for (int64_t s = 0; s <= batch; ++s) query_start[s] = static_cast<int32_t>(s);
  for (int64_t s = 0; s < batch; ++s) {
    if (s >= n) {
      slots[s] = -1;
      ids[s] = 0;
      positions[s] = 0;
      context_lens[s] = 1;
      continue;
    }
    const SequenceChunk& c = chunks[s];
    const std::vector<int32_t>& table = kv->block_table(c.kv_slot);
    const int64_t p = c.start_position;
    slots[s] = static_cast<int64_t>(table[p / bs]) * bs + p % bs;
    ids[s] = c.tokens[0];
    positions[s] = static_cast<int32_t>(p);
    context_lens[s] = static_cast<int32_t>(p + 1);
    std::copy(table.begin(), table.begin() + std::min<int64_t>(width, table.size()),
              tables + s * width);
  }
}

// ---- Decode steps through remote experts, in graph segments ----

size_t Qwen3MoeModel::num_piecewise_graphs() const {
  size_t n = 0;
  for (const auto& [shape, p] : piecewise_) {
    for (const CapturedGraph& g : p.segments) n += g.graph != nullptr ? 1 : 0;
  }
  return n;
}

absl::Status Qwen3MoeModel::PreparePiecewise(int64_t batch, int64_t width, KvCache* kv,
                                             PiecewiseShape* p) {
  const int64_t h = config_.hidden_size, k = config_.num_experts_per_tok;
  const StagingLayout at(batch, width);
  DXS_ASSIGN_OR_RETURN(p->staging, backend_->AllocateStaging(at.bytes));
  DXS_ASSIGN_OR_RETURN(p->done, backend_->CreateEvent());
  MicroBatch& mb = p->mb;
  PagedAttentionMeta& a = mb.attn;
  // No host lengths: the backend's attention needs no plan on the host between replays.
  a = PaddedDecodeMeta(batch, width, *kv);
  DXS_ASSIGN_OR_RETURN(a.slot_mapping, backend_->Allocate({batch}, DType::kI64));
  DXS_ASSIGN_OR_RETURN(a.query_start, backend_->Allocate({batch + 1}, DType::kI32));
  DXS_ASSIGN_OR_RETURN(a.context_lens, backend_->Allocate({batch}, DType::kI32));
  DXS_ASSIGN_OR_RETURN(a.block_tables, backend_->Allocate({batch, width}, DType::kI32));
  DXS_ASSIGN_OR_RETURN(mb.positions, backend_->Allocate({batch}, DType::kI32));
  DXS_ASSIGN_OR_RETURN(p->token_ids, backend_->Allocate({batch}, DType::kI32));
  DXS_ASSIGN_OR_RETURN(mb.hidden, backend_->Allocate({batch, h}, DType::kF32));
  DXS_ASSIGN_OR_RETURN(mb.normed, backend_->Allocate({batch, h}));
  // The combine writes the real rows only; the padding rows' MoE output stays zero.
  DXS_ASSIGN_OR_RETURN(mb.mlp_out, backend_->Zeros({batch, h}, backend_->ActivationDType()));
  DXS_ASSIGN_OR_RETURN(p->ids, backend_->Allocate({batch, k}, DType::kI32));
  DXS_ASSIGN_OR_RETURN(p->weights, backend_->Allocate({batch, k}, DType::kF32));
  return absl::OkStatus();
}

absl::StatusOr<Tensor> Qwen3MoeModel::PiecewiseSegment(PiecewiseShape* p, int after, int last,
                                                       bool logits, int64_t batch, int64_t width,
                                                       KvCache* kv) {
  MicroBatch& mb = p->mb;
  if (after < 0) {
    const StagingLayout at(batch, width);
    PagedAttentionMeta& a = mb.attn;
    for (const auto& [dst, offset] : {std::pair<Tensor*, size_t>{&a.slot_mapping, at.slots},
                                      {&mb.positions, at.positions},
                                      {&a.query_start, at.query_start},
                                      {&a.context_lens, at.context_lens},
                                      {&a.block_tables, at.block_tables}}) {
      DXS_RETURN_IF_ERROR(backend_->CopyFromStaging(*p->staging, offset, dst));
    }
    DXS_RETURN_IF_ERROR(backend_->Embedding(w_.embed_tokens, p->token_ids, &mb.hidden));
  } else {
    DXS_RETURN_IF_ERROR(ResidualAdd(after, mb.mlp_out, &mb));
  }
  for (int l = after + 1; l <= last; ++l) {
    Tensor o;
    DXS_RETURN_IF_ERROR(AttentionBlock(l, kv, &mb, &o));
    if (config_.IsMoeLayer(l)) {
      DXS_RETURN_IF_ERROR(AddNormRoute(l, o, &mb.hidden, &mb.normed, &p->ids, &p->weights));
      continue;  // the last layer of the segment: its dispatch follows
    }
    DXS_RETURN_IF_ERROR(backend_->AddRmsNorm(o, w_.layers[l].post_attention_norm,
                                             static_cast<float>(config_.rms_norm_eps), &mb.hidden,
                                             &mb.normed));
    DXS_ASSIGN_OR_RETURN(Tensor dense, backend_->Allocate({batch, config_.hidden_size}));
    DXS_RETURN_IF_ERROR(DenseMlp(l, mb.normed, &dense));
    DXS_RETURN_IF_ERROR(ResidualAdd(l, dense, &mb));
  }
  if (!logits) return Tensor();
  return Logits(mb.hidden);  // one row per sequence: every row is its last
}

absl::StatusOr<Tensor> Qwen3MoeModel::ForwardDecodePiecewise(
    const std::vector<SequenceChunk>& chunks, KvCache* kv, bool use_graph,
    const Tensor* input_ids) {
  DXS_ASSIGN_OR_RETURN(const auto shape, CheckedDecodeShape(chunks, kv));
  const int64_t n = static_cast<int64_t>(chunks.size());
  if (input_ids != nullptr && input_ids->num_elements() != n) {
    return absl::InvalidArgumentError(
        absl::StrCat("decode step: ", input_ids->num_elements(), " input ids for ", n, " chunks"));
  }
  const int64_t batch = shape.first, width = shape.second;
  use_graph = use_graph && backend_->SupportsGraphs();
  PiecewiseShape& p = piecewise_[{kv, batch, width}];
  const void* pool = kv->keys(0).defined() ? kv->keys(0).raw() : nullptr;
  if (p.done == nullptr || p.kv_pool != pool) {
    // New, or the KV pool grew since the segments were recorded: record them again.
    if (p.done != nullptr) DXS_RETURN_IF_ERROR(backend_->SynchronizeEvent(p.done.get()));
    p = PiecewiseShape();
    DXS_RETURN_IF_ERROR(PreparePiecewise(batch, width, kv, &p));
    p.kv_pool = pool;
  } else {
    DXS_RETURN_IF_ERROR(backend_->SynchronizeEvent(p.done.get()));  // the last step read it
  }
  StageDecodeStep(chunks, kv, batch, width, static_cast<uint8_t*>(p.staging->data()));
  // The token ids go in before segment 0 (which embeds them from p.token_ids): staged,
  // then the real rows' from the device where the step before sampled them (input_ids).
  DXS_RETURN_IF_ERROR(
      backend_->CopyFromStaging(*p.staging, StagingLayout(batch, width).ids, &p.token_ids));
  if (input_ids != nullptr) {
    Tensor rows = p.token_ids.Rows(0, n);
    DXS_RETURN_IF_ERROR(backend_->Copy(*input_ids, &rows));
  }
  // The segments: up to each MoE layer's router (its exchange follows), then the rest of
  // the layers and the logits. Each is (the MoE layer before it, or -1; its last layer).
  std::vector<std::pair<int, int>> plan;
  int after = -1;
  for (int l = 0; l < config_.num_hidden_layers; ++l) {
    if (!config_.IsMoeLayer(l)) continue;
    plan.push_back({after, l});
    after = l;
  }
  plan.push_back({after, config_.num_hidden_layers - 1});
  if (p.segments.size() != plan.size()) p.segments.resize(plan.size());
  Tensor logits;
  for (size_t s = 0; s < plan.size(); ++s) {
    const int from = plan[s].first, last = plan[s].second;
    const bool is_last = s + 1 == plan.size();
    auto body = [&, from, last, is_last]() -> absl::StatusOr<Tensor> {
      return PiecewiseSegment(&p, from, last, is_last, batch, width, kv);
    };
    CapturedGraph& g = p.segments[s];
    Tensor out;
    if (!use_graph) {
      DXS_ASSIGN_OR_RETURN(out, body());
    } else if (g.graph == nullptr) {
      DXS_ASSIGN_OR_RETURN(g, backend_->CaptureGraph(body, &out));
    } else {
      DXS_RETURN_IF_ERROR(backend_->Replay(g.graph.get()));
      out = g.output;
    }
    if (is_last) {
      logits = out;
      break;
    }
    // MoE layer `last`'s exchange, eagerly, for the step's real rows only.
    Tensor mlp_rows = p.mb.mlp_out.Rows(0, n);
    absl::StatusOr<std::unique_ptr<MoeHandle>> h = moe_->Dispatch(
        last, 0, 1, p.mb.normed.Rows(0, n), p.ids.Rows(0, n), p.weights.Rows(0, n), &mlp_rows);
    absl::Status combined = h.ok() ? moe_->Combine(*std::move(h), &mlp_rows) : h.status();
    if (!combined.ok()) {
      // A failed exchange (a lost EP rank) ends the step here: let the segments already
      // queued finish before the next step rewrites the staging they may still read.
      (void)backend_->Synchronize();
      return combined;
    }
  }
  DXS_RETURN_IF_ERROR(backend_->RecordEvent(p.done.get()));
  return logits.Rows(0, n);
}

absl::Status Qwen3MoeModel::Prepare(KvCache* kv, MicroBatch* mb, const Tensor* input_ids) {
  // Host metadata of the micro-batch: computed from the chunks alone, uploaded once for
  // every layer.
  std::vector<int32_t> ids, positions, query_start = {0}, context_lens, block_tables;
  std::vector<int64_t> slot_mapping;
  const int64_t bs = kv->block_size();
  int64_t max_blocks = 1, max_query = 0, max_context = 0;
  for (const SequenceChunk& c : mb->chunks) {
    const int64_t context = c.start_position + static_cast<int64_t>(c.tokens.size());
    max_blocks = std::max(max_blocks, (context + bs - 1) / bs);
    max_query = std::max<int64_t>(max_query, static_cast<int64_t>(c.tokens.size()));
    max_context = std::max(max_context, context);
  }
  for (const SequenceChunk& c : mb->chunks) {
    const std::vector<int32_t>& table = kv->block_table(c.kv_slot);
    for (size_t i = 0; i < c.tokens.size(); ++i) {
      const int64_t p = c.start_position + static_cast<int64_t>(i);
      ids.push_back(c.tokens[i]);
      positions.push_back(static_cast<int32_t>(p));
      slot_mapping.push_back(static_cast<int64_t>(table[p / bs]) * bs + p % bs);
    }
    query_start.push_back(static_cast<int32_t>(ids.size()));
    context_lens.push_back(static_cast<int32_t>(c.start_position + c.tokens.size()));
    for (int64_t b = 0; b < max_blocks; ++b) {
      block_tables.push_back(b < static_cast<int64_t>(table.size()) ? table[b] : 0);
    }
  }
  const int64_t t = static_cast<int64_t>(ids.size());
  PagedAttentionMeta& a = mb->attn;
  a.num_seqs = static_cast<int64_t>(mb->chunks.size());
  a.block_size = bs;
  a.max_blocks_per_seq = max_blocks;
  a.max_query_len = max_query;
  a.max_context_len = max_context;
  DXS_ASSIGN_OR_RETURN(a.query_start, backend_->UploadIndices(query_start));
  DXS_ASSIGN_OR_RETURN(a.context_lens, backend_->UploadIndices(context_lens));
  DXS_ASSIGN_OR_RETURN(a.block_tables, backend_->UploadIndices(block_tables));
  auto host_lens = std::make_shared<std::pair<std::vector<int32_t>, std::vector<int32_t>>>(
      std::move(query_start), std::move(context_lens));
  a.host_query_start = host_lens->first.data();
  a.host_context_lens = host_lens->second.data();
  a.host_lens_owner = std::move(host_lens);
  DXS_ASSIGN_OR_RETURN(a.slot_mapping, backend_->Allocate({t}, DType::kI64));
  DXS_RETURN_IF_ERROR(backend_->CopyFromHost(slot_mapping.data(), DType::kI64, &a.slot_mapping));
  DXS_ASSIGN_OR_RETURN(mb->positions, backend_->UploadIndices(positions));
  Tensor token_ids;
  if (input_ids != nullptr) {
    token_ids = *input_ids;  // already on the device (the step before sampled them there)
  } else {
    DXS_ASSIGN_OR_RETURN(token_ids, backend_->UploadIndices(ids));
  }
  // The residual stream is float32 on every backend (TensorRT-LLM offers the same for
  // accuracy): on bf16 activations it keeps the sum of many layers' updates from rounding
  // at every add. Layer inputs (the norms' outputs) are in the activation dtype.
  DXS_ASSIGN_OR_RETURN(mb->hidden, backend_->Allocate({t, config_.hidden_size}, DType::kF32));
  return backend_->Embedding(w_.embed_tokens, token_ids, &mb->hidden);
}

absl::Status Qwen3MoeModel::MicroFront(int layer, int micro, int num_micro, KvCache* kv,
                                       MicroBatch* mb) {
  Tensor o;
  DXS_RETURN_IF_ERROR(AttentionBlock(layer, kv, mb, &o));
  const int64_t t = mb->hidden.rows();
  // An MoE layer's input and output where the executor's exchange moves none of their
  // rows (the one-copy exchange's region), when it has such a place.
  const bool moe = config_.IsMoeLayer(layer);
  const bool staged =
      moe && moe_->StageBuffers(micro, t, backend_->ActivationDType(), &mb->normed, &mb->mlp_out);
  if (!staged) {
    DXS_ASSIGN_OR_RETURN(mb->normed, backend_->Allocate({t, config_.hidden_size}));
    DXS_ASSIGN_OR_RETURN(mb->mlp_out, backend_->Allocate({t, config_.hidden_size}));
  }
  if (!moe) {
    // The attention's residual add and the post-attention norm, one op.
    DXS_RETURN_IF_ERROR(backend_->AddRmsNorm(o, w_.layers[layer].post_attention_norm,
                                             static_cast<float>(config_.rms_norm_eps), &mb->hidden,
                                             &mb->normed));
    DXS_RETURN_IF_ERROR(DenseMlp(layer, mb->normed, &mb->mlp_out));
    return ResidualAdd(layer, mb->mlp_out, mb);
  }
  Tensor ids, weights;
  DXS_RETURN_IF_ERROR(AddNormRoute(layer, o, &mb->hidden, &mb->normed, &ids, &weights));
  DXS_ASSIGN_OR_RETURN(
      mb->moe, moe_->Dispatch(layer, micro, num_micro, mb->normed, ids, weights, &mb->mlp_out));
  return absl::OkStatus();
}

absl::Status Qwen3MoeModel::MicroBack(int layer, int micro, MicroBatch* mb) {
  if (!config_.IsMoeLayer(layer)) return absl::OkStatus();  // MicroFront did it all
  DXS_RETURN_IF_ERROR(moe_->Combine(std::move(mb->moe), &mb->mlp_out));
  return ResidualAdd(layer, mb->mlp_out, mb);
}

absl::Status Qwen3MoeModel::ResidualAdd(int layer, const Tensor& x, MicroBatch* mb) {
  if (layer + 1 >= config_.num_hidden_layers) return backend_->Add(x, &mb->hidden);
  DXS_ASSIGN_OR_RETURN(mb->input_normed,
                       backend_->Allocate({mb->hidden.rows(), config_.hidden_size}));
  return backend_->AddRmsNorm(x, w_.layers[layer + 1].input_norm,
                              static_cast<float>(config_.rms_norm_eps), &mb->hidden,
                              &mb->input_normed);
}

absl::Status Qwen3MoeModel::GatherLastRows(const std::vector<SequenceChunk>& chunks,
                                           const Tensor& hidden, int64_t first_row, Tensor* last) {
  std::vector<int32_t> last_rows;
  int64_t offset = 0;
  for (const SequenceChunk& c : chunks) {
    offset += static_cast<int64_t>(c.tokens.size());
    for (int64_t r = c.logit_rows; r > 0; --r)
      last_rows.push_back(static_cast<int32_t>(offset - r));
  }
  Tensor dst = last->Rows(first_row, static_cast<int64_t>(last_rows.size()));
  DXS_ASSIGN_OR_RETURN(Tensor rows, backend_->UploadIndices(last_rows));
  return backend_->GatherRows(hidden, rows, &dst);
}

absl::StatusOr<Tensor> Qwen3MoeModel::Logits(Tensor last) {
  DXS_ASSIGN_OR_RETURN(Tensor normed, backend_->Allocate({last.rows(), config_.hidden_size}));
  DXS_RETURN_IF_ERROR(
      backend_->RmsNorm(last, w_.final_norm, static_cast<float>(config_.rms_norm_eps), &normed));
  // Logits in float32 whatever the activations: sampling and first_logits see the GEMM's
  // fp32 accumulation, not its bf16 rounding.
  DXS_ASSIGN_OR_RETURN(Tensor logits,
                       backend_->Allocate({last.rows(), config_.vocab_size}, DType::kF32));
  DXS_RETURN_IF_ERROR(backend_->Linear(normed, w_.lm_head, nullptr, &logits));
  return logits;
}

absl::Status Qwen3MoeModel::AddNormRoute(int layer, const Tensor& o, Tensor* hidden, Tensor* normed,
                                         Tensor* ids, Tensor* weights) {
  const int64_t top_k = config_.num_experts_per_tok, t = normed->rows();
  // Into the caller's tensors where it gives them (a piecewise step's, kept across
  // segments), else new ones.
  if (!ids->defined()) {
    DXS_ASSIGN_OR_RETURN(*ids, backend_->Allocate({t, top_k}, DType::kI32));
  }
  if (!weights->defined()) {
    DXS_ASSIGN_OR_RETURN(*weights, backend_->Allocate({t, top_k}, DType::kF32));
  }
  const AttentionLayerWeights& lw = w_.layers[layer];
  return backend_->AddRmsNormRoute(
      o, lw.post_attention_norm, static_cast<float>(config_.rms_norm_eps), hidden, normed,
      lw.router, static_cast<int>(top_k), config_.norm_topk_prob, ids, weights);
}

absl::Status Qwen3MoeModel::AttentionBlock(int layer, KvCache* kv, MicroBatch* mb, Tensor* o) {
  const AttentionLayerWeights& lw = w_.layers[layer];
  Tensor* hidden = &mb->hidden;
  const int64_t t = hidden->rows(), d = config_.head_dim;
  const int64_t heads = config_.num_attention_heads, kv_heads = config_.num_key_value_heads;
  const float eps = static_cast<float>(config_.rms_norm_eps);
  auto bias = [](const Tensor& b) { return b.defined() ? &b : nullptr; };

  Tensor normed = std::move(mb->input_normed);  // the previous layer's residual add made it
  mb->input_normed = Tensor();
  if (layer == 0) {
    DXS_ASSIGN_OR_RETURN(normed, backend_->Allocate({t, config_.hidden_size}));
    DXS_RETURN_IF_ERROR(backend_->RmsNorm(*hidden, lw.input_norm, eps, &normed));
  } else if (!normed.defined()) {
    return absl::InternalError(
        absl::StrCat("layer ", layer, ": no input norm from layer ", layer - 1));
  }
  DXS_ASSIGN_OR_RETURN(Tensor q, backend_->Allocate({t, heads, d}));
  DXS_ASSIGN_OR_RETURN(Tensor k, backend_->Allocate({t, kv_heads, d}));
  DXS_ASSIGN_OR_RETURN(Tensor v, backend_->Allocate({t, kv_heads, d}));
  Tensor q2 = q.Reshape({t, heads * d}), k2 = k.Reshape({t, kv_heads * d}),
         v2 = v.Reshape({t, kv_heads * d});
  if (!lw.q_bias.defined() && !lw.k_bias.defined() && !lw.v_bias.defined()) {
    // Qwen3: no biases; the three projections of one input, in one launch where it can.
    DXS_RETURN_IF_ERROR(
        backend_->Linears(normed, {&lw.q_proj, &lw.k_proj, &lw.v_proj}, {&q2, &k2, &v2}));
  } else {
    DXS_RETURN_IF_ERROR(backend_->Linear(normed, lw.q_proj, bias(lw.q_bias), &q2));
    DXS_RETURN_IF_ERROR(backend_->Linear(normed, lw.k_proj, bias(lw.k_bias), &k2));
    DXS_RETURN_IF_ERROR(backend_->Linear(normed, lw.v_proj, bias(lw.v_bias), &v2));
  }
  // The o-projection's weights are read right after attention, whose kernels leave the
  // memory mostly idle at decode sizes: the backend may bring them into its cache meanwhile.
  DXS_RETURN_IF_ERROR(
      backend_->PrefetchWeights({&lw.o_proj}, DenseCompute::PrefetchWhile::kAttention, t));
  // Per-head q/k norms and the rotary embedding, then the new keys and values into their
  // pages: one op (one kernel on CUDA), for all the step's sequences.
  DXS_RETURN_IF_ERROR(backend_->QkNormRopeWriteKv(&q, &k, v, lw.q_norm, lw.k_norm, eps,
                                                  mb->positions, config_.rope_theta, mb->attn,
                                                  &kv->keys(layer), &kv->values(layer)));
  // Then attention over the pages, one call for all of them.
  DXS_ASSIGN_OR_RETURN(Tensor attn, backend_->Allocate({t, heads * d}));
  const float scale = 1.f / std::sqrt(static_cast<float>(d));
  DXS_RETURN_IF_ERROR(
      backend_->PagedAttention(q, kv->keys(layer), kv->values(layer), mb->attn, scale, &attn));
  DXS_ASSIGN_OR_RETURN(*o, backend_->Allocate({t, config_.hidden_size}));
  DXS_RETURN_IF_ERROR(backend_->Linear(attn, lw.o_proj, bias(lw.o_bias), o));
  if (layer + 1 >= config_.num_hidden_layers) return absl::OkStatus();
  // And the next layer's q, k and v while this layer's MLP runs (on an attention worker, while
  // its experts answer over the exchange).
  const AttentionLayerWeights& next = w_.layers[layer + 1];
  return backend_->PrefetchWeights({&next.q_proj, &next.k_proj, &next.v_proj},
                                   DenseCompute::PrefetchWhile::kExperts, t);
}

absl::Status Qwen3MoeModel::DenseMlp(int layer, const Tensor& normed, Tensor* out) {
  const AttentionLayerWeights& lw = w_.layers[layer];
  const int64_t t = normed.rows(), inter = config_.intermediate_size;
  DXS_ASSIGN_OR_RETURN(Tensor gate, backend_->Allocate({t, inter}));
  DXS_ASSIGN_OR_RETURN(Tensor up, backend_->Allocate({t, inter}));
  DXS_RETURN_IF_ERROR(backend_->Linear(normed, lw.dense_gate, nullptr, &gate));
  DXS_RETURN_IF_ERROR(backend_->Linear(normed, lw.dense_up, nullptr, &up));
  DXS_RETURN_IF_ERROR(backend_->SiluMul(gate, up, &gate));
  return backend_->Linear(gate, lw.dense_down, nullptr, out);
}

}  // namespace dxs
