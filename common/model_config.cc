#include "common/model_config.h"

#include <algorithm>
#include <cmath>
#include <fstream>
#include <limits>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/status_macros.h"
#include "nlohmann/json.hpp"

namespace dxs {
namespace {

using Json = nlohmann::json;
using OrderedJson = nlohmann::ordered_json;

// NOTES: upper bounds keep every later size computation (tensor shapes, KV cache, random
// initialisation) far from overflow and stop a hostile config from asking for terabytes of
// memory. They are generous: Qwen3-235B-A22B uses vocab 151936, hidden 4096, 94 layers,
// 128 experts.
constexpr int64_t kMaxVocabSize = int64_t{1} << 22;
constexpr int64_t kMaxHiddenSize = 65536;
constexpr int64_t kMaxIntermediateSize = int64_t{1} << 20;
constexpr int64_t kMaxLayers = 1024;
constexpr int64_t kMaxHeads = 1024;
constexpr int64_t kMaxHeadDim = 4096;
constexpr int64_t kMaxExperts = 4096;
constexpr int64_t kMaxPositionEmbeddings = int64_t{1} << 24;
constexpr size_t kMaxConfigBytes = 64 << 20;

// A short description of an untrusted value for an error message. dump() recurses, so
// nested containers are summarised instead of printed: a hostile file could nest millions deep.
std::string JsonForMessage(const Json& j) {
  bool flat = !j.is_structured();
  if (j.is_array() && j.size() <= 16) {
    flat = std::none_of(j.begin(), j.end(), [](const Json& e) { return e.is_structured(); });
  }
  if (!flat)
    return absl::StrCat(j.is_array() ? "an array" : "an object", " of ", j.size(), " elements");
  std::string s = j.dump(-1, ' ', /*ensure_ascii=*/true, Json::error_handler_t::replace);
  if (s.size() > 100) s = s.substr(0, 100) + "...";
  return s;
}

// Reads typed fields of a JSON object; a missing or null field keeps the default.
class FieldReader {
 public:
  FieldReader(const Json& object, const std::string& source) : object_(object), source_(source) {}

  const Json* Get(const char* field) const {
    auto it = object_.find(field);
    if (it == object_.end() || it->is_null()) return nullptr;
    return &*it;
  }

  absl::Status TypeError(const char* field, const Json& value, const char* expected) const {
    return absl::InvalidArgumentError(absl::StrCat(source_, ": field '", field, "' must be ",
                                                   expected, ", got ", JsonForMessage(value)));
  }

  absl::Status Int(const char* field, int64_t* out) const {
    const Json* v = Get(field);
    if (v == nullptr) return absl::OkStatus();
    return ToInt(field, *v, out);
  }

  absl::Status ToInt(const char* field, const Json& v, int64_t* out) const {
    if (v.is_number_unsigned()) {
      if (v.get<uint64_t>() > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
        return TypeError(field, v, "an integer in the int64 range");
      }
      *out = static_cast<int64_t>(v.get<uint64_t>());
      return absl::OkStatus();
    }
    if (v.is_number_integer()) {
      *out = v.get<int64_t>();
      return absl::OkStatus();
    }
    return TypeError(field, v, "an integer");
  }

  absl::Status Double(const char* field, double* out) const {
    const Json* v = Get(field);
    if (v == nullptr) return absl::OkStatus();
    if (!v->is_number()) return TypeError(field, *v, "a number");
    *out = v->get<double>();
    return absl::OkStatus();
  }

  absl::Status Bool(const char* field, bool* out) const {
    const Json* v = Get(field);
    if (v == nullptr) return absl::OkStatus();
    if (!v->is_boolean()) return TypeError(field, *v, "true or false");
    *out = v->get<bool>();
    return absl::OkStatus();
  }

  absl::Status String(const char* field, std::string* out) const {
    const Json* v = Get(field);
    if (v == nullptr) return absl::OkStatus();
    if (!v->is_string()) return TypeError(field, *v, "a string");
    *out = v->get<std::string>();
    return absl::OkStatus();
  }

  // An integer or a list of integers.
  absl::Status IntList(const char* field, bool allow_scalar, std::vector<int64_t>* out) const {
    const Json* v = Get(field);
    if (v == nullptr) return absl::OkStatus();
    out->clear();
    if (allow_scalar && v->is_number()) {
      int64_t x;
      DXS_RETURN_IF_ERROR(ToInt(field, *v, &x));
      out->push_back(x);
      return absl::OkStatus();
    }
    if (!v->is_array()) {
      return TypeError(field, *v,
                       allow_scalar ? "an integer or a list of integers" : "a list of integers");
    }
    for (const Json& element : *v) {
      int64_t x;
      if (!element.is_number_integer()) return TypeError(field, *v, "a list of integers");
      DXS_RETURN_IF_ERROR(ToInt(field, element, &x));
      out->push_back(x);
    }
    return absl::OkStatus();
  }

 private:
  const Json& object_;
  const std::string& source_;
};

// rope_parameters (transformers v5) or rope_scaling (v4): only plain RoPE is implemented.
absl::Status ReadRope(const FieldReader& reader, const char* field, const std::string& source,
                      double* rope_theta) {
  const Json* rope = reader.Get(field);
  if (rope == nullptr) return absl::OkStatus();
  if (!rope->is_object()) return reader.TypeError(field, *rope, "an object or null");
  std::string type = "default";
  for (const char* key : {"rope_type", "type"}) {
    auto it = rope->find(key);
    if (it == rope->end() || it->is_null()) continue;
    if (!it->is_string()) {
      return absl::InvalidArgumentError(absl::StrCat(
          source, ": field '", field, ".", key, "' must be a string, got ", JsonForMessage(*it)));
    }
    type = it->get<std::string>();
    break;
  }
  if (type != "default") {
    return absl::InvalidArgumentError(
        absl::StrCat(source, ": field '", field, "': RoPE type '", type,
                     "' is not supported (only plain RoPE, type 'default')"));
  }
  auto theta = rope->find("rope_theta");
  if (theta != rope->end() && !theta->is_null()) {
    if (!theta->is_number()) {
      return absl::InvalidArgumentError(absl::StrCat(source, ": field '", field,
                                                     ".rope_theta' must be a number, got ",
                                                     JsonForMessage(*theta)));
    }
    *rope_theta = theta->get<double>();
  }
  return absl::OkStatus();
}

absl::StatusOr<ModelConfig> ParseObject(const Json& j, const std::string& source) {
  if (!j.is_object()) {
    return absl::InvalidArgumentError(
        absl::StrCat(source, ": config must be a JSON object, got ", JsonForMessage(j)));
  }
  FieldReader r(j, source);
  ModelConfig c;
  // transformers' Qwen3MoeConfig defaults for anything the file leaves out.
  c.vocab_size = 151936;
  c.hidden_size = 2048;
  c.intermediate_size = 6144;
  c.moe_intermediate_size = 768;
  c.num_hidden_layers = 24;
  c.num_attention_heads = 32;
  c.num_key_value_heads = 4;
  c.num_experts = 128;
  c.num_experts_per_tok = 8;
  c.decoder_sparse_step = 1;
  c.norm_topk_prob = false;
  c.tie_word_embeddings = false;
  c.attention_bias = false;
  c.rms_norm_eps = 1e-6;
  c.rope_theta = 10000.0;
  c.max_position_embeddings = 32768;
  c.hidden_act = "silu";
  c.model_type = "qwen3_moe";
  c.torch_dtype = "float32";
  c.bos_token_id = -1;

  DXS_RETURN_IF_ERROR(r.String("model_type", &c.model_type));
  DXS_RETURN_IF_ERROR(r.Int("vocab_size", &c.vocab_size));
  DXS_RETURN_IF_ERROR(r.Int("hidden_size", &c.hidden_size));
  DXS_RETURN_IF_ERROR(r.Int("intermediate_size", &c.intermediate_size));
  DXS_RETURN_IF_ERROR(r.Int("moe_intermediate_size", &c.moe_intermediate_size));
  DXS_RETURN_IF_ERROR(r.Int("num_hidden_layers", &c.num_hidden_layers));
  DXS_RETURN_IF_ERROR(r.Int("num_attention_heads", &c.num_attention_heads));
  DXS_RETURN_IF_ERROR(r.Int("num_key_value_heads", &c.num_key_value_heads));
  c.head_dim = c.num_attention_heads > 0 ? c.hidden_size / c.num_attention_heads : 0;
  DXS_RETURN_IF_ERROR(r.Int("head_dim", &c.head_dim));
  DXS_RETURN_IF_ERROR(r.Int("num_experts", &c.num_experts));
  // transformers v5 saves num_experts under its attribute_map name, num_local_experts.
  if (r.Get("num_local_experts") != nullptr) {
    int64_t num_local_experts = 0;
    DXS_RETURN_IF_ERROR(r.Int("num_local_experts", &num_local_experts));
    if (r.Get("num_experts") != nullptr && num_local_experts != c.num_experts) {
      return absl::InvalidArgumentError(absl::StrCat(source, ": fields 'num_experts' (",
                                                     c.num_experts, ") and 'num_local_experts' (",
                                                     num_local_experts, ") disagree"));
    }
    c.num_experts = num_local_experts;
  }
  DXS_RETURN_IF_ERROR(r.Int("num_experts_per_tok", &c.num_experts_per_tok));
  DXS_RETURN_IF_ERROR(r.Int("decoder_sparse_step", &c.decoder_sparse_step));
  DXS_RETURN_IF_ERROR(r.IntList("mlp_only_layers", /*allow_scalar=*/false, &c.mlp_only_layers));
  DXS_RETURN_IF_ERROR(r.Bool("norm_topk_prob", &c.norm_topk_prob));
  DXS_RETURN_IF_ERROR(r.Bool("tie_word_embeddings", &c.tie_word_embeddings));
  DXS_RETURN_IF_ERROR(r.Bool("attention_bias", &c.attention_bias));
  DXS_RETURN_IF_ERROR(r.Double("rms_norm_eps", &c.rms_norm_eps));
  DXS_RETURN_IF_ERROR(r.Double("rope_theta", &c.rope_theta));
  // Priority as in transformers: rope_scaling replaces rope_parameters, whose rope_theta
  // wins over the top-level one.
  if (r.Get("rope_scaling") != nullptr) {
    DXS_RETURN_IF_ERROR(ReadRope(r, "rope_scaling", source, &c.rope_theta));
  } else {
    DXS_RETURN_IF_ERROR(ReadRope(r, "rope_parameters", source, &c.rope_theta));
  }
  DXS_RETURN_IF_ERROR(r.Int("max_position_embeddings", &c.max_position_embeddings));
  DXS_RETURN_IF_ERROR(r.String("hidden_act", &c.hidden_act));
  // transformers v5 writes "dtype"; v4 wrote "torch_dtype".
  DXS_RETURN_IF_ERROR(r.String("torch_dtype", &c.torch_dtype));
  DXS_RETURN_IF_ERROR(r.String("dtype", &c.torch_dtype));
  if (const Json* q = r.Get("quantization_config"); q != nullptr && q->is_object()) {
    FieldReader quant(*q, source);
    DXS_RETURN_IF_ERROR(quant.String("quant_method", &c.quant_method));
  }
  DXS_RETURN_IF_ERROR(r.IntList("eos_token_id", /*allow_scalar=*/true, &c.eos_token_ids));
  DXS_RETURN_IF_ERROR(r.Int("bos_token_id", &c.bos_token_id));

  absl::Status valid = c.Validate();
  if (!valid.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(source, ": ", valid.message()));
  }
  return c;
}

absl::Status Range(const char* field, int64_t value, int64_t lo, int64_t hi) {
  if (value < lo || value > hi) {
    return absl::InvalidArgumentError(
        absl::StrCat("field '", field, "' is ", value, ", must be in [", lo, ", ", hi, "]"));
  }
  return absl::OkStatus();
}

absl::Status Invalid(const char* field, const std::string& why) {
  return absl::InvalidArgumentError(absl::StrCat("field '", field, "' ", why));
}

}  // namespace

bool ModelConfig::IsMoeLayer(int64_t layer) const {
  if (num_experts <= 0 || decoder_sparse_step <= 0) return false;
  if (std::find(mlp_only_layers.begin(), mlp_only_layers.end(), layer) != mlp_only_layers.end()) {
    return false;
  }
  return (layer + 1) % decoder_sparse_step == 0;
}

absl::Status ModelConfig::Validate() const {
  if (model_type != "qwen3_moe") {
    return Invalid("model_type", absl::StrCat("is '", model_type, "', must be 'qwen3_moe'"));
  }
  if (hidden_act != "silu") {
    return Invalid("hidden_act", absl::StrCat("is '", hidden_act, "', only 'silu' is supported"));
  }
  if (torch_dtype != "float32" && torch_dtype != "float16" && torch_dtype != "bfloat16") {
    return Invalid(
        "torch_dtype",
        absl::StrCat("is '", torch_dtype, "', must be one of 'float32', 'float16', 'bfloat16'"));
  }
  DXS_RETURN_IF_ERROR(Range("vocab_size", vocab_size, 1, kMaxVocabSize));
  DXS_RETURN_IF_ERROR(Range("hidden_size", hidden_size, 1, kMaxHiddenSize));
  DXS_RETURN_IF_ERROR(Range("num_hidden_layers", num_hidden_layers, 1, kMaxLayers));
  DXS_RETURN_IF_ERROR(Range("num_attention_heads", num_attention_heads, 1, kMaxHeads));
  DXS_RETURN_IF_ERROR(Range("num_key_value_heads", num_key_value_heads, 1, num_attention_heads));
  if (num_attention_heads % num_key_value_heads != 0) {
    return Invalid("num_key_value_heads",
                   absl::StrCat("(", num_key_value_heads, ") must divide num_attention_heads (",
                                num_attention_heads, ")"));
  }
  DXS_RETURN_IF_ERROR(Range("head_dim", head_dim, 2, kMaxHeadDim));
  if (head_dim % 2 != 0) {
    return Invalid("head_dim", absl::StrCat("(", head_dim, ") must be even for RoPE"));
  }
  DXS_RETURN_IF_ERROR(Range("intermediate_size", intermediate_size, 0, kMaxIntermediateSize));
  DXS_RETURN_IF_ERROR(
      Range("moe_intermediate_size", moe_intermediate_size, 0, kMaxIntermediateSize));
  DXS_RETURN_IF_ERROR(Range("num_experts", num_experts, 0, kMaxExperts));
  if (num_experts > 0) {
    DXS_RETURN_IF_ERROR(Range("num_experts_per_tok", num_experts_per_tok, 1, num_experts));
  } else if (num_experts_per_tok < 0) {
    return Invalid("num_experts_per_tok",
                   absl::StrCat("is ", num_experts_per_tok, ", must not be negative"));
  }
  DXS_RETURN_IF_ERROR(Range("decoder_sparse_step", decoder_sparse_step, 1, kMaxLayers));
  for (int64_t layer : mlp_only_layers) {
    if (layer < 0 || layer >= num_hidden_layers) {
      return Invalid("mlp_only_layers",
                     absl::StrCat("holds layer ", layer, ", outside [0, ", num_hidden_layers, ")"));
    }
  }
  bool any_dense = false;
  bool any_moe = false;
  for (int64_t layer = 0; layer < num_hidden_layers; ++layer) {
    (IsMoeLayer(layer) ? any_moe : any_dense) = true;
  }
  if (any_dense && intermediate_size <= 0) {
    return Invalid("intermediate_size", absl::StrCat("is ", intermediate_size,
                                                     ", must be positive: some layers are dense"));
  }
  if (any_moe && moe_intermediate_size <= 0) {
    return Invalid(
        "moe_intermediate_size",
        absl::StrCat("is ", moe_intermediate_size, ", must be positive: some layers are MoE"));
  }
  if (!(rms_norm_eps > 0) || !std::isfinite(rms_norm_eps)) {
    return Invalid("rms_norm_eps", absl::StrCat("is ", rms_norm_eps, ", must be positive"));
  }
  if (!(rope_theta > 0) || !std::isfinite(rope_theta)) {
    return Invalid("rope_theta", absl::StrCat("is ", rope_theta, ", must be positive"));
  }
  DXS_RETURN_IF_ERROR(
      Range("max_position_embeddings", max_position_embeddings, 1, kMaxPositionEmbeddings));
  for (int64_t id : eos_token_ids) {
    if (id < 0 || id >= vocab_size) {
      return Invalid("eos_token_id",
                     absl::StrCat("holds ", id, ", outside the vocabulary [0, ", vocab_size, ")"));
    }
  }
  if (bos_token_id != -1 && (bos_token_id < 0 || bos_token_id >= vocab_size)) {
    return Invalid("bos_token_id", absl::StrCat("is ", bos_token_id,
                                                ", outside the vocabulary [0, ", vocab_size, ")"));
  }
  return absl::OkStatus();
}

std::string ModelConfig::ToJson() const {
  OrderedJson j;
  j["architectures"] = {"Qwen3MoeForCausalLM"};
  j["model_type"] = model_type;
  j["vocab_size"] = vocab_size;
  j["hidden_size"] = hidden_size;
  j["intermediate_size"] = intermediate_size;
  j["moe_intermediate_size"] = moe_intermediate_size;
  j["num_hidden_layers"] = num_hidden_layers;
  j["num_attention_heads"] = num_attention_heads;
  j["num_key_value_heads"] = num_key_value_heads;
  j["head_dim"] = head_dim;
  j["num_experts"] = num_experts;
  j["num_experts_per_tok"] = num_experts_per_tok;
  j["decoder_sparse_step"] = decoder_sparse_step;
  j["mlp_only_layers"] = mlp_only_layers;
  j["norm_topk_prob"] = norm_topk_prob;
  j["tie_word_embeddings"] = tie_word_embeddings;
  j["attention_bias"] = attention_bias;
  j["rms_norm_eps"] = rms_norm_eps;
  j["rope_theta"] = rope_theta;
  j["rope_scaling"] = nullptr;
  j["max_position_embeddings"] = max_position_embeddings;
  j["hidden_act"] = hidden_act;
  j["torch_dtype"] = torch_dtype;
  if (eos_token_ids.empty()) {
    j["eos_token_id"] = nullptr;
  } else if (eos_token_ids.size() == 1) {
    j["eos_token_id"] = eos_token_ids[0];
  } else {
    j["eos_token_id"] = eos_token_ids;
  }
  if (bos_token_id >= 0) {
    j["bos_token_id"] = bos_token_id;
  } else {
    j["bos_token_id"] = nullptr;
  }
  j["use_sliding_window"] = false;
  j["sliding_window"] = nullptr;
  j["max_window_layers"] = num_hidden_layers;
  j["attention_dropout"] = 0.0;
  j["output_router_logits"] = false;
  j["router_aux_loss_coef"] = 0.001;
  j["initializer_range"] = 0.02;
  j["use_cache"] = true;
  return j.dump(2) + "\n";
}

absl::StatusOr<ModelConfig> ParseModelConfig(std::string_view json, std::string_view source_view) {
  const std::string source(source_view);
  // nlohmann reports bad input with exceptions; none may leave this function.
  try {
    Json j;
    try {
      j = Json::parse(json.begin(), json.end());
    } catch (const Json::parse_error& e) {
      return absl::InvalidArgumentError(absl::StrCat(source, ": not valid JSON: ", e.what()));
    }
    return ParseObject(j, source);
  } catch (const Json::exception& e) {
    return absl::InvalidArgumentError(absl::StrCat(source, ": bad config: ", e.what()));
  } catch (const std::exception& e) {
    return absl::InternalError(absl::StrCat(source, ": ", e.what()));
  }
}

absl::StatusOr<ModelConfig> LoadModelConfig(const std::string& dir) {
  const std::string path =
      dir.empty() || dir.back() == '/' ? dir + "config.json" : dir + "/config.json";
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat(path, ": cannot open model config"));
  std::string text;
  char buffer[65536];
  while (in.read(buffer, sizeof(buffer)) || in.gcount() > 0) {
    text.append(buffer, static_cast<size_t>(in.gcount()));
    if (text.size() > kMaxConfigBytes) {
      return absl::InvalidArgumentError(
          absl::StrCat(path, ": larger than ", kMaxConfigBytes, " bytes; not a config.json"));
    }
  }
  if (in.bad()) return absl::InternalError(absl::StrCat(path, ": read failed"));
  return ParseModelConfig(text, path);
}

}  // namespace dxs
