// libFuzzer target: ParseModelConfig on arbitrary text. Whatever it accepts must validate,
// keep every size inside the documented limits, and survive a ToJson round trip unchanged.
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <string_view>

#include "common/model_config.h"

namespace {

void Check(bool condition, const char* what) {
  if (!condition) {
    std::fprintf(stderr, "config_fuzz: invariant violated: %s\n", what);
    std::abort();
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  auto config = dxs::ParseModelConfig(text, "fuzz/config.json");
  if (!config.ok()) {
    Check(config.status().code() == absl::StatusCode::kInvalidArgument,
          "bad input is INVALID_ARGUMENT");
    Check(config.status().message().find("fuzz/config.json") != absl::string_view::npos,
          "error names the source");
    return 0;
  }
  const dxs::ModelConfig& c = *config;
  Check(c.Validate().ok(), "accepted config validates");
  Check(c.vocab_size > 0 && c.vocab_size <= (int64_t{1} << 22), "vocab_size bounded");
  Check(c.hidden_size > 0 && c.hidden_size <= 65536, "hidden_size bounded");
  Check(c.num_hidden_layers > 0 && c.num_hidden_layers <= 1024, "num_hidden_layers bounded");
  Check(c.num_experts >= 0 && c.num_experts <= 4096, "num_experts bounded");
  Check(c.num_attention_heads % c.num_key_value_heads == 0, "GQA groups are whole");
  Check(c.head_dim > 0 && c.head_dim % 2 == 0, "head_dim even");
  int64_t moe_layers = 0;
  for (int64_t layer = 0; layer < c.num_hidden_layers; ++layer) moe_layers += c.IsMoeLayer(layer);
  if (moe_layers > 0) {
    Check(c.num_experts_per_tok >= 1 && c.num_experts_per_tok <= c.num_experts, "top-k");
    Check(c.moe_intermediate_size > 0, "moe_intermediate_size");
  }
  if (moe_layers < c.num_hidden_layers) Check(c.intermediate_size > 0, "intermediate_size");
  for (int64_t id : c.eos_token_ids) Check(id >= 0 && id < c.vocab_size, "eos in vocabulary");

  const std::string json = c.ToJson();
  auto again = dxs::ParseModelConfig(json, "round-trip");
  Check(again.ok(), "ToJson output parses");
  Check(again->ToJson() == json, "ToJson round trip is stable");
  Check(again->vocab_size == c.vocab_size && again->hidden_size == c.hidden_size &&
            again->head_dim == c.head_dim && again->rope_theta == c.rope_theta &&
            again->rms_norm_eps == c.rms_norm_eps && again->eos_token_ids == c.eos_token_ids &&
            again->mlp_only_layers == c.mlp_only_layers && again->torch_dtype == c.torch_dtype &&
            again->norm_topk_prob == c.norm_topk_prob && again->bos_token_id == c.bos_token_id,
        "round trip keeps the fields");
  return 0;
}
