// Qwen3-MoE weights on a backend, split the way the services split them: the attention
// side (everything but the experts) and expert shards (any subset of experts, all MoE
// layers). Tensor names are Hugging Face's.
#pragma once

#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "common/model_config.h"
#include "common/safetensors.h"
#include "kernels/backend.h"

namespace dxs {

struct AttentionLayerWeights {
  Tensor input_norm, post_attention_norm;
  Tensor q_proj, k_proj, v_proj, o_proj;
  Tensor q_bias, k_bias, v_bias, o_bias;  // only with attention_bias
  Tensor q_norm, k_norm;
  Tensor router;                            // MoE layers: mlp.gate [num_experts, hidden]
  Tensor dense_gate, dense_up, dense_down;  // dense (mlp_only) layers
};

struct AttentionWeights {
  Tensor embed_tokens;  // [vocab, hidden]
  std::vector<AttentionLayerWeights> layers;
  Tensor final_norm;
  Tensor lm_head;  // aliases embed_tokens when tied
};

// One expert's FFN. gate_proj and up_proj are packed into one weight when loaded, so a
// device runs both as one GEMM (Backend::GroupedSwiGlu); the separate copies are not kept.
struct ExpertWeights {
  Tensor gate_up_proj;  // [2 * moe_intermediate, hidden]: gate_proj's rows, then up_proj's
  Tensor down_proj;     // [hidden, moe_intermediate]
};

// [gate; up]: the two [inter, hidden] projections stacked into one new [2 * inter, hidden]
// tensor on `backend`, in gate's dtype (INVALID_ARGUMENT where their shapes or dtypes
// differ).
absl::StatusOr<Tensor> PackGateUp(const Tensor& gate, const Tensor& up, Backend* backend);

// Where weights come from: a checkpoint on disk, or a seeded random model made in place
// on the backend (model/random_checkpoint.h: RandomWeightSource).
class WeightSource {
 public:
  virtual ~WeightSource() = default;
  // Tensor `name` of `shape` on `backend`, in backend->WeightDType(its stored dtype).
  // NOT_FOUND / INVALID_ARGUMENT for a missing tensor or a shape that differs.
  virtual absl::StatusOr<Tensor> Load(const std::string& name, std::vector<int64_t> shape,
                                      Backend* backend) const = 0;
  // A projection weight (attention's q, k, v, o, a dense layer's MLP; the experts' where the
  // backend's grouped FFN takes FP8, capabilities().fp8_expert_weights): where the source
  // holds it block-scaled FP8 and KeepsFp8Weight says so, it stays FP8 with its scales
  // (Tensor::block_scales); otherwise as Load.
  virtual absl::StatusOr<Tensor> LoadProjection(const std::string& name, std::vector<int64_t> shape,
                                                Backend* backend) const {
    return Load(name, std::move(shape), backend);
  }
};

// Whether a block-scaled FP8 weight of `shape` stays FP8 on `backend`: the backend takes FP8
// weights (capabilities().fp8_block_weights) and both dimensions are whole 128-blocks.
bool KeepsFp8Weight(const Backend& backend, const std::vector<int64_t>& shape);
// A block-scaled FP8 weight on `backend`: fp8 (e4m3 bytes, [n, k] row-major) and scales
// (f32 [ceil(n / 128), ceil(k / 128)], the checkpoint's weight_scale_inv) into a kF8E4M3 tensor
// carrying Tensor::block_scales' layout. Where KeepsFp8Weight holds.
absl::StatusOr<Tensor> MakeBlockScaledWeight(const uint8_t* fp8, const float* scales,
                                             std::vector<int64_t> shape, Backend* backend);

class CheckpointWeightSource final : public WeightSource {
 public:
  explicit CheckpointWeightSource(const Checkpoint& ckpt) : ckpt_(ckpt) {}
  absl::StatusOr<Tensor> Load(const std::string& name, std::vector<int64_t> shape,
                              Backend* backend) const override;
  absl::StatusOr<Tensor> LoadProjection(const std::string& name, std::vector<int64_t> shape,
                                        Backend* backend) const override;

 private:
  const Checkpoint& ckpt_;
};

// Loads everything an attention worker needs: all tensors but the experts'.
absl::StatusOr<AttentionWeights> LoadAttentionWeights(const WeightSource& source,
                                                      const ModelConfig& config, Backend* backend);
absl::StatusOr<AttentionWeights> LoadAttentionWeights(const Checkpoint& ckpt,
                                                      const ModelConfig& config, Backend* backend);

// Experts `experts` of every MoE layer, keyed by (layer, expert).
using ExpertWeightMap = std::map<std::pair<int, int>, ExpertWeights>;
absl::StatusOr<ExpertWeightMap> LoadExpertWeights(const WeightSource& source,
                                                  const ModelConfig& config,
                                                  const std::vector<int>& experts,
                                                  Backend* backend);
absl::StatusOr<ExpertWeightMap> LoadExpertWeights(const Checkpoint& ckpt, const ModelConfig& config,
                                                  const std::vector<int>& experts,
                                                  Backend* backend);

// Hugging Face tensor names.
std::string LayerTensorName(int layer, const std::string& suffix);
std::string ExpertTensorName(int layer, int expert, const std::string& proj);

}  // namespace dxs
