#include "router/frontend/model_info.h"

#include <filesystem>

namespace dxs {
namespace {

v1::DType DTypeOf(const std::string& torch_dtype) {
  if (torch_dtype == "bfloat16") return v1::DTYPE_BFLOAT16;
  if (torch_dtype == "float16") return v1::DTYPE_FLOAT16;
  if (torch_dtype == "float32") return v1::DTYPE_FLOAT32;
  return v1::DTYPE_UNSPECIFIED;
}

}  // namespace

v1::ModelInfo MakeModelInfo(const ModelConfig& config, const std::string& model_dir,
                            const v1::ModelFingerprint& fingerprint) {
  v1::ModelInfo info;
  std::filesystem::path path(model_dir);
  if (!path.has_filename()) path = path.parent_path();  // "dir/" -> "dir"
  info.set_model_name(path.filename().string());
  info.set_model_path(model_dir);
  info.set_vocab_size(static_cast<uint32_t>(config.vocab_size));
  info.set_max_context_length(static_cast<uint32_t>(config.max_position_embeddings));
  info.set_num_layers(static_cast<uint32_t>(config.num_hidden_layers));
  info.set_num_experts(static_cast<uint32_t>(config.num_experts));
  info.set_num_experts_per_token(static_cast<uint32_t>(config.num_experts_per_tok));
  info.set_hidden_size(static_cast<uint32_t>(config.hidden_size));
  for (int64_t id : config.eos_token_ids) info.add_eos_token_ids(static_cast<uint32_t>(id));
  info.set_dtype(DTypeOf(config.torch_dtype));
  info.set_checkpoint_dtype(config.quant_method == "fp8" ? v1::DTYPE_FLOAT8_E4M3 : info.dtype());
  *info.mutable_fingerprint() = fingerprint;
  return info;
}

}  // namespace dxs
