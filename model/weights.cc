#include "model/weights.h"

#include <algorithm>

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

bool KeepsFp8Weight(const Backend& backend, const std::vector<int64_t>& shape) {
  return backend.capabilities().fp8_block_weights && shape.size() == 2 && shape[0] > 0 &&
         shape[1] > 0 && shape[0] % Tensor::kWeightBlock == 0 &&
         shape[1] % Tensor::kWeightBlock == 0;
}

absl::StatusOr<Tensor> MakeBlockScaledWeight(const uint8_t* fp8, const float* scales,
                                             std::vector<int64_t> shape, Backend* backend) {
  if (!KeepsFp8Weight(*backend, shape)) {
    return absl::FailedPreconditionError(
        absl::StrCat("an FP8 weight of shape [", shape.size() == 2 ? shape[0] : -1, ", ",
                     shape.size() == 2 ? shape[1] : -1, "] cannot stay FP8 on ", backend->name()));
  }
  const int64_t n_blocks = shape[0] / Tensor::kWeightBlock,
                k_blocks = shape[1] / Tensor::kWeightBlock, stride = BlockScaleStride(shape[1]);
  std::vector<float> padded(static_cast<size_t>(n_blocks * stride), 0.f);
  for (int64_t b = 0; b < n_blocks; ++b) {
    std::copy(scales + b * k_blocks, scales + (b + 1) * k_blocks, padded.begin() + b * stride);
  }
  DXS_ASSIGN_OR_RETURN(Tensor s, backend->Allocate({n_blocks, stride}, DType::kF32));
  DXS_RETURN_IF_ERROR(backend->CopyFromHost(padded.data(), DType::kF32, &s));
  DXS_ASSIGN_OR_RETURN(Tensor w, backend->Allocate(std::move(shape), DType::kF8E4M3));
  DXS_RETURN_IF_ERROR(backend->CopyFromHost(fp8, DType::kF8E4M3, &w));
  return w.WithBlockScales(std::move(s));
}

absl::StatusOr<Tensor> CheckpointWeightSource::LoadProjection(const std::string& name,
                                                              std::vector<int64_t> shape,
                                                              Backend* backend) const {
  DXS_ASSIGN_OR_RETURN(const TensorView* view, ckpt_.FindWithShape(name, shape));
  if (view->dtype != DType::kF8E4M3 || !KeepsFp8Weight(*backend, shape)) {
    return Load(name, std::move(shape), backend);
  }
  // Checkpoint::Open checked the scale's shape against the weight's.
  const std::vector<int64_t> scale_shape = {shape[0] / Tensor::kWeightBlock,
                                            shape[1] / Tensor::kWeightBlock};
  DXS_ASSIGN_OR_RETURN(std::vector<float> scales,
                       ckpt_.ReadFloat32(name + kFp8ScaleSuffix, scale_shape));
  return MakeBlockScaledWeight(static_cast<const uint8_t*>(view->data), scales.data(),
                               std::move(shape), backend);
}

absl::StatusOr<Tensor> PackGateUp(const Tensor& gate, const Tensor& up, Backend* backend) {
  if (gate.shape() != up.shape() || gate.dtype() != up.dtype() || gate.shape().size() != 2) {
    return absl::InvalidArgumentError(
        absl::StrCat("pack gate_up: gate ", gate.ShapeString(), " and up ", up.ShapeString()));
  }
  const int64_t inter = gate.rows();
  DXS_ASSIGN_OR_RETURN(Tensor packed,
                       backend->Allocate({2 * inter, gate.row_size()}, gate.dtype()));
  if (gate.block_scales() != nullptr || up.block_scales() != nullptr) {
    // Block-scaled FP8: the scales stack as the rows do (inter is whole 128-blocks).
    if (gate.block_scales() == nullptr || up.block_scales() == nullptr ||
        gate.block_scales()->shape() != up.block_scales()->shape()) {
      return absl::InvalidArgumentError("pack gate_up: gate and up scaled differently");
    }
    const Tensor& gs = *gate.block_scales();
    DXS_ASSIGN_OR_RETURN(Tensor scales,
                         backend->Allocate({2 * gs.rows(), gs.row_size()}, gs.dtype()));
    packed = packed.WithBlockScales(std::move(scales));
  }
  Tensor gate_half = packed.Rows(0, inter), up_half = packed.Rows(inter, inter);
  DXS_RETURN_IF_ERROR(backend->Copy(gate, &gate_half));
  DXS_RETURN_IF_ERROR(backend->Copy(up, &up_half));
  if (packed.block_scales() != nullptr) {
    Tensor gate_scales = *gate_half.block_scales(), up_scales = *up_half.block_scales();
    DXS_RETURN_IF_ERROR(backend->Copy(*gate.block_scales(), &gate_scales));
    DXS_RETURN_IF_ERROR(backend->Copy(*up.block_scales(), &up_scales));
  }
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
  auto LoadProjection = [&source](const std::string& name, std::vector<int64_t> shape, Backend* b) {
    return source.LoadProjection(name, std::move(shape), b);
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
    DXS_ASSIGN_OR_RETURN(lw.q_proj,
                         LoadProjection(name("self_attn.q_proj.weight"), {q_dim, h}, backend));
    DXS_ASSIGN_OR_RETURN(lw.k_proj,
                         LoadProjection(name("self_attn.k_proj.weight"), {kv_dim, h}, backend));
    DXS_ASSIGN_OR_RETURN(lw.v_proj,
                         LoadProjection(name("self_attn.v_proj.weight"), {kv_dim, h}, backend));
    DXS_ASSIGN_OR_RETURN(lw.o_proj,
                         LoadProjection(name("self_attn.o_proj.weight"), {h, q_dim}, backend));
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
      DXS_ASSIGN_OR_RETURN(lw.dense_gate,
                           LoadProjection(name("mlp.gate_proj.weight"), {inter, h}, backend));
      DXS_ASSIGN_OR_RETURN(lw.dense_up,
                           LoadProjection(name("mlp.up_proj.weight"), {inter, h}, backend));
      DXS_ASSIGN_OR_RETURN(lw.dense_down,
                           LoadProjection(name("mlp.down_proj.weight"), {h, inter}, backend));
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
  // Experts stay block-scaled FP8 where the backend's grouped FFN takes them.
  const bool fp8_experts = backend->capabilities().fp8_expert_weights;
  auto Load = [&source, fp8_experts](const std::string& name, std::vector<int64_t> shape,
                                     Backend* b) {
    return fp8_experts ? source.LoadProjection(name, std::move(shape), b)
                       : source.Load(name, std::move(shape), b);
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
