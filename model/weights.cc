#include "model/weights.h"

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"

namespace dxs {
absl::StatusOr<Tensor> CheckpointWeightSource::Load(const std::string& name,
                                                    std::vector<int64_t> shape,
                                                    Backend* backend) const {
  // In the stored dtype where the backend computes in it; the CPU widens to float32.
  DXS_ASSIGN_OR_RETURN(const TensorView* view, ckpt_.FindWithShape(name, shape));
  if (view->dtype == DType::kF8E4M3) {
    // Block-scaled FP8: dequantized on the host (fp8 value times its block's scale, in
    // float32), then kept as the backend keeps the checkpoint's compute dtype.
    DXS_ASSIGN_OR_RETURN(std::vector<float> values, ckpt_.ReadFloat32(name, shape));
    DXS_ASSIGN_OR_RETURN(
        Tensor t,
        backend->Allocate(std::move(shape), backend->WeightDType(ckpt_.dequantized_dtype())));
    DXS_RETURN_IF_ERROR(backend->CopyFromHost(values.data(), DType::kF32, &t));
    return t;
  }
  DXS_ASSIGN_OR_RETURN(Tensor t,
                       backend->Allocate(std::move(shape), backend->WeightDType(view->dtype)));
  DXS_RETURN_IF_ERROR(backend->CopyFromHost(view->data, view->dtype, &t));
  return t;
}

absl::StatusOr<Tensor> PackGateUp(const Tensor& gate, const Tensor& up, Backend* backend) {
  if (gate.shape() != up.shape() || gate.dtype() != up.dtype() || gate.shape().size() != 2) {
    return absl::InvalidArgumentError(
        absl::StrCat("pack gate_up: gate ", gate.ShapeString(), " and up ", up.ShapeString()));
  }
  const int64_t inter = gate.rows();
  DXS_ASSIGN_OR_RETURN(Tensor packed,
                       backend->Allocate({2 * inter, gate.row_size()}, gate.dtype()));
  Tensor gate_half = packed.Rows(0, inter), up_half = packed.Rows(inter, inter);
  DXS_RETURN_IF_ERROR(backend->Copy(gate, &gate_half));
  DXS_RETURN_IF_ERROR(backend->Copy(up, &up_half));
  return packed;
}

std::string LayerTensorName(int layer, const std::string& suffix) {
  return absl::StrCat("model.layers.", layer, ".", suffix);
}

std::string ExpertTensorName(int layer, int expert, const std::string& proj) {
  return absl::StrCat("model.layers.", layer, ".mlp.experts.", expert, ".", proj, ".weight");
}

absl::StatusOr<AttentionWeights> LoadAttentionWeights(const Checkpoint& ckpt, const ModelConfig& c,
                                                      Backend* backend) {
  return LoadAttentionWeights(CheckpointWeightSource(ckpt), c, backend);
}

absl::StatusOr<ExpertWeightMap> LoadExpertWeights(const Checkpoint& ckpt, const ModelConfig& c,
                                                  const std::vector<int>& experts,
                                                  Backend* backend) {
  return LoadExpertWeights(CheckpointWeightSource(ckpt), c, experts, backend);
}

absl::StatusOr<AttentionWeights> LoadAttentionWeights(const WeightSource& source,
                                                      const ModelConfig& c, Backend* backend) {
  auto Load = [&source](const std::string& name, std::vector<int64_t> shape, Backend* b) {
    return source.Load(name, std::move(shape), b);
  };
  const int64_t h = c.hidden_size, d = c.head_dim;
  const int64_t q_dim = c.num_attention_heads * d, kv_dim = c.num_key_value_heads * d;
  AttentionWeights w;
  DXS_ASSIGN_OR_RETURN(w.embed_tokens,
                       Load("model.embed_tokens.weight", {c.vocab_size, h}, backend));
  for (int l = 0; l < c.num_hidden_layers; ++l) {
    AttentionLayerWeights lw;
    auto name = [l](const std::string& s) { return LayerTensorName(l, s); };
    DXS_ASSIGN_OR_RETURN(lw.input_norm, Load(name("input_layernorm.weight"), {h}, backend));
    DXS_ASSIGN_OR_RETURN(lw.post_attention_norm,
                         Load(name("post_attention_layernorm.weight"), {h}, backend));
    DXS_ASSIGN_OR_RETURN(lw.q_proj, Load(name("self_attn.q_proj.weight"), {q_dim, h}, backend));
    DXS_ASSIGN_OR_RETURN(lw.k_proj, Load(name("self_attn.k_proj.weight"), {kv_dim, h}, backend));
    DXS_ASSIGN_OR_RETURN(lw.v_proj, Load(name("self_attn.v_proj.weight"), {kv_dim, h}, backend));
    DXS_ASSIGN_OR_RETURN(lw.o_proj, Load(name("self_attn.o_proj.weight"), {h, q_dim}, backend));
    if (c.attention_bias) {
      DXS_ASSIGN_OR_RETURN(lw.q_bias, Load(name("self_attn.q_proj.bias"), {q_dim}, backend));
      DXS_ASSIGN_OR_RETURN(lw.k_bias, Load(name("self_attn.k_proj.bias"), {kv_dim}, backend));
      DXS_ASSIGN_OR_RETURN(lw.v_bias, Load(name("self_attn.v_proj.bias"), {kv_dim}, backend));
      DXS_ASSIGN_OR_RETURN(lw.o_bias, Load(name("self_attn.o_proj.bias"), {h}, backend));
    }
    DXS_ASSIGN_OR_RETURN(lw.q_norm, Load(name("self_attn.q_norm.weight"), {d}, backend));
    DXS_ASSIGN_OR_RETURN(lw.k_norm, Load(name("self_attn.k_norm.weight"), {d}, backend));
    if (c.IsMoeLayer(l)) {
      DXS_ASSIGN_OR_RETURN(lw.router, Load(name("mlp.gate.weight"), {c.num_experts, h}, backend));
    } else {
      const int64_t inter = c.intermediate_size;
      DXS_ASSIGN_OR_RETURN(lw.dense_gate, Load(name("mlp.gate_proj.weight"), {inter, h}, backend));
      DXS_ASSIGN_OR_RETURN(lw.dense_up, Load(name("mlp.up_proj.weight"), {inter, h}, backend));
      DXS_ASSIGN_OR_RETURN(lw.dense_down, Load(name("mlp.down_proj.weight"), {h, inter}, backend));
    }
    w.layers.push_back(std::move(lw));
  }
  DXS_ASSIGN_OR_RETURN(w.final_norm, Load("model.norm.weight", {h}, backend));
  if (c.tie_word_embeddings) {
    w.lm_head = w.embed_tokens;
  } else {
    DXS_ASSIGN_OR_RETURN(w.lm_head, Load("lm_head.weight", {c.vocab_size, h}, backend));
  }
  return w;
}

absl::StatusOr<ExpertWeightMap> LoadExpertWeights(const WeightSource& source, const ModelConfig& c,
                                                  const std::vector<int>& experts,
                                                  Backend* backend) {
  auto Load = [&source](const std::string& name, std::vector<int64_t> shape, Backend* b) {
    return source.Load(name, std::move(shape), b);
  };
  const int64_t h = c.hidden_size, inter = c.moe_intermediate_size;
  ExpertWeightMap map;
  for (int l = 0; l < c.num_hidden_layers; ++l) {
    if (!c.IsMoeLayer(l)) continue;
    for (int e : experts) {
      if (e < 0 || e >= c.num_experts) {
        return absl::InvalidArgumentError(
            absl::StrCat("expert ", e, " is outside [0, ", c.num_experts, ")"));
      }
      ExpertWeights ew;
      {
        // The separate projections live only until packed: one expert's worth of extra
        // memory at a time (the allocator reuses it for the next).
        DXS_ASSIGN_OR_RETURN(Tensor gate,
                             Load(ExpertTensorName(l, e, "gate_proj"), {inter, h}, backend));
        DXS_ASSIGN_OR_RETURN(Tensor up,
                             Load(ExpertTensorName(l, e, "up_proj"), {inter, h}, backend));
        DXS_ASSIGN_OR_RETURN(ew.gate_up_proj, PackGateUp(gate, up, backend));
      }
      DXS_ASSIGN_OR_RETURN(ew.down_proj,
                           Load(ExpertTensorName(l, e, "down_proj"), {h, inter}, backend));
      map.emplace(std::make_pair(l, e), std::move(ew));
    }
  }
  return map;
}

}  // namespace dxs
