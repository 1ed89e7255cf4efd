#include "model/qwen3_moe.h"

#include <cmath>
#include <cstdlib>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"

namespace dxs {

Qwen3MoeModel::Qwen3MoeModel(const ModelConfig& config, AttentionWeights weights, Backend* backend,
                             MoeExecutor* moe)
    : config_(config), w_(std::move(weights)), backend_(backend), moe_(moe) {
  routing_stats_.tokens_per_expert.assign(std::max<int64_t>(config_.num_experts, 0), 0);
}

absl::Status Qwen3MoeModel::Validate(const std::vector<SequenceChunk>& chunks, KvCache* kv) const {
  for (const SequenceChunk& c : chunks) {
    if (c.tokens.empty()) return absl::InvalidArgumentError("a sequence chunk has no tokens");
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
                                              int num_micro_batches) {
  if (num_micro_batches < 1 || num_micro_batches > MoeExecutor::kMaxMicroBatches) {
    return absl::InvalidArgumentError(
        absl::StrCat("num_micro_batches: ", num_micro_batches, " is not 1 or 2"));
  }
  DXS_RETURN_IF_ERROR(Validate(chunks, kv));
  // Two micro-batches split in chunk order (so the logits keep it) where the token count
  // is closest to half; either may be empty.
  int64_t total = 0;
  for (const SequenceChunk& c : chunks) total += static_cast<int64_t>(c.tokens.size());
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
  for (int m = 0; m < num_micro_batches; ++m) {
    MicroBatch& mb = mbs[m];
    std::vector<int32_t> ids;
    for (const SequenceChunk& c : mb.chunks) {
      for (size_t i = 0; i < c.tokens.size(); ++i) {
        ids.push_back(c.tokens[i]);
        mb.positions.push_back(c.start_position + static_cast<int64_t>(i));
      }
    }
    mb.hidden = backend_->Allocate({static_cast<int64_t>(ids.size()), config_.hidden_size});
    backend_->Embedding(w_.embed_tokens, ids, &mb.hidden);
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
  Tensor last = backend_->Allocate({static_cast<int64_t>(chunks.size()), config_.hidden_size});
  GatherLastRows(mbs[0].chunks, mbs[0].hidden, 0, &last);
  if (num_micro_batches == 2) {
    GatherLastRows(mbs[1].chunks, mbs[1].hidden, static_cast<int64_t>(split), &last);
  }
  return Logits(std::move(last));
}

absl::Status Qwen3MoeModel::MicroFront(int layer, int micro, int num_micro, KvCache* kv,
                                       MicroBatch* mb) {
  AttentionBlock(layer, mb->chunks, mb->positions, kv, &mb->hidden);
  const int64_t t = mb->hidden.rows();
  mb->normed = backend_->Allocate({t, config_.hidden_size});
  backend_->RmsNorm(mb->hidden, w_.layers[layer].post_attention_norm,
                    static_cast<float>(config_.rms_norm_eps), &mb->normed);
  mb->mlp_out = backend_->Allocate({t, config_.hidden_size});
  if (!config_.IsMoeLayer(layer)) {
    DenseMlp(layer, mb->normed, &mb->mlp_out);
    backend_->Add(mb->mlp_out, &mb->hidden);
    return absl::OkStatus();
  }
  std::vector<int32_t> ids;
  std::vector<float> weights;
  DXS_RETURN_IF_ERROR(Route(layer, mb->normed, &ids, &weights));
  return moe_->Dispatch(layer, micro, num_micro, mb->normed, ids, weights,
                        static_cast<int>(config_.num_experts_per_tok), &mb->mlp_out);
}

absl::Status Qwen3MoeModel::MicroBack(int layer, int micro, MicroBatch* mb) {
  if (!config_.IsMoeLayer(layer)) return absl::OkStatus();  // MicroFront did it all
  DXS_RETURN_IF_ERROR(moe_->Combine(layer, micro, &mb->mlp_out));
  backend_->Add(mb->mlp_out, &mb->hidden);
  return absl::OkStatus();
}

void Qwen3MoeModel::GatherLastRows(const std::vector<SequenceChunk>& chunks, const Tensor& hidden,
                                   int64_t first_row, Tensor* last) {
  std::vector<int32_t> last_rows;
  int64_t offset = 0;
  for (const SequenceChunk& c : chunks) {
    offset += static_cast<int64_t>(c.tokens.size());
    last_rows.push_back(static_cast<int32_t>(offset - 1));
  }
  Tensor dst = last->Rows(first_row, static_cast<int64_t>(chunks.size()));
  backend_->GatherRows(hidden, last_rows, &dst);
}

Tensor Qwen3MoeModel::Logits(Tensor last) {
  backend_->RmsNorm(last, w_.final_norm, static_cast<float>(config_.rms_norm_eps), &last);
  Tensor logits = backend_->Allocate({last.rows(), config_.vocab_size});
  backend_->Linear(last, w_.lm_head, nullptr, &logits);
  return logits;
}

absl::Status Qwen3MoeModel::Route(int layer, const Tensor& normed, std::vector<int32_t>* ids,
                                  std::vector<float>* weights) {
  const int top_k = static_cast<int>(config_.num_experts_per_tok);
  Tensor router_logits = backend_->Allocate({normed.rows(), config_.num_experts});
  backend_->Linear(normed, w_.layers[layer].router, nullptr, &router_logits);
  DXS_RETURN_IF_ERROR(
      backend_->TopKSoftmax(router_logits, top_k, config_.norm_topk_prob, ids, weights));
  for (int32_t e : *ids) ++routing_stats_.tokens_per_expert[e];
  return absl::OkStatus();
}

void Qwen3MoeModel::AttentionBlock(int layer, const std::vector<SequenceChunk>& chunks,
                                   const std::vector<int64_t>& positions, KvCache* kv,
                                   Tensor* hidden) {
  const AttentionLayerWeights& lw = w_.layers[layer];
  const int64_t t = hidden->rows(), d = config_.head_dim;
  const int64_t heads = config_.num_attention_heads, kv_heads = config_.num_key_value_heads;
  const float eps = static_cast<float>(config_.rms_norm_eps);
  auto bias = [](const Tensor& b) { return b.defined() ? &b : nullptr; };

  Tensor normed = backend_->Allocate({t, config_.hidden_size});
  backend_->RmsNorm(*hidden, lw.input_norm, eps, &normed);
  Tensor q = backend_->Allocate({t, heads, d});
  Tensor k = backend_->Allocate({t, kv_heads, d});
  Tensor v = backend_->Allocate({t, kv_heads, d});
  Tensor q2 = q.Reshape({t, heads * d}), k2 = k.Reshape({t, kv_heads * d}),
         v2 = v.Reshape({t, kv_heads * d});
  backend_->Linear(normed, lw.q_proj, bias(lw.q_bias), &q2);
  backend_->Linear(normed, lw.k_proj, bias(lw.k_bias), &k2);
  backend_->Linear(normed, lw.v_proj, bias(lw.v_bias), &v2);
  backend_->RmsNorm(q, lw.q_norm, eps, &q);
  backend_->RmsNorm(k, lw.k_norm, eps, &k);
  backend_->Rope(&q, positions, config_.rope_theta);
  backend_->Rope(&k, positions, config_.rope_theta);

  Tensor attn = backend_->Allocate({t, heads, d});
  const float scale = 1.f / std::sqrt(static_cast<float>(d));
  int64_t offset = 0;
  for (const SequenceChunk& c : chunks) {
    const int64_t n = static_cast<int64_t>(c.tokens.size());
    Tensor& keys = kv->keys(c.kv_slot, layer);
    Tensor& values = kv->values(c.kv_slot, layer);
    backend_->CopyRows(k.Rows(offset, n), &keys, c.start_position);
    backend_->CopyRows(v.Rows(offset, n), &values, c.start_position);
    Tensor out = attn.Rows(offset, n);
    backend_->Attention(q.Rows(offset, n), keys, values, c.start_position, scale, &out);
    offset += n;
  }
  Tensor o = backend_->Allocate({t, config_.hidden_size});
  backend_->Linear(attn.Reshape({t, heads * d}), lw.o_proj, bias(lw.o_bias), &o);
  backend_->Add(o, hidden);
}

void Qwen3MoeModel::DenseMlp(int layer, const Tensor& normed, Tensor* out) {
  const AttentionLayerWeights& lw = w_.layers[layer];
  const int64_t t = normed.rows(), inter = config_.intermediate_size;
  Tensor gate = backend_->Allocate({t, inter});
  Tensor up = backend_->Allocate({t, inter});
  backend_->Linear(normed, lw.dense_gate, nullptr, &gate);
  backend_->Linear(normed, lw.dense_up, nullptr, &up);
  backend_->SiluMul(gate, up, &gate);
  backend_->Linear(gate, lw.dense_down, nullptr, out);
}

}  // namespace dxs
