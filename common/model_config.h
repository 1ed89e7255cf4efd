// Qwen3-MoE model configuration, read from a Hugging Face config.json.
//
// Field names and defaults follow transformers' Qwen3MoeConfig. Validate() checks every
// invariant the forward pass relies on, so a bad config fails once, at load, with a message
// naming the field.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"

namespace dxs {

struct ModelConfig {
  std::string model_type = "qwen3_moe";
  int64_t vocab_size = 0;
  int64_t hidden_size = 0;
  int64_t intermediate_size = 0;      // dense MLP layers
  int64_t moe_intermediate_size = 0;  // each expert
  int64_t num_hidden_layers = 0;
  int64_t num_attention_heads = 0;
  int64_t num_key_value_heads = 0;
  int64_t head_dim = 0;  // defaults to hidden_size / num_attention_heads when absent
  int64_t num_experts = 0;
  int64_t num_experts_per_tok = 0;
  int64_t decoder_sparse_step = 1;
  std::vector<int64_t> mlp_only_layers;
  bool norm_topk_prob = true;
  bool tie_word_embeddings = false;
  bool attention_bias = false;
  double rms_norm_eps = 1e-6;
  double rope_theta = 10000.0;  // "rope_theta" or "rope_parameters": {"rope_theta": ..}
  int64_t max_position_embeddings = 0;
  std::string hidden_act = "silu";
  std::string torch_dtype = "float32";  // "torch_dtype" or "dtype"
  // quantization_config.quant_method ("fp8" for block-scaled FP8 weights); empty when the
  // weights are stored in torch_dtype. The rest of quantization_config is checked against
  // the tensors when the checkpoint is opened (common/safetensors.h).
  std::string quant_method;
  std::vector<int64_t> eos_token_ids;  // int or list in the JSON
  int64_t bos_token_id = -1;

  // True when layer `layer` uses the sparse MoE block (HF's rule: not in mlp_only_layers,
  // num_experts > 0 and (layer + 1) % decoder_sparse_step == 0).
  bool IsMoeLayer(int64_t layer) const;

  absl::Status Validate() const;
  // config.json as Hugging Face writes it (architectures, model_type, ...).
  std::string ToJson() const;
};

// Parses and validates. `source` names the file in error messages.
absl::StatusOr<ModelConfig> ParseModelConfig(std::string_view json, std::string_view source);
// Reads DIR/config.json.
absl::StatusOr<ModelConfig> LoadModelConfig(const std::string& dir);

}  // namespace dxs
