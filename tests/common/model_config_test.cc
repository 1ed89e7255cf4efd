#include "common/model_config.h"

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"

namespace dxs {
namespace {

using ::testing::AllOf;
using ::testing::ElementsAre;
using ::testing::HasSubstr;
using Json = nlohmann::json;

// config.json of Qwen/Qwen3-30B-A3B as published.
constexpr char kQwen3_30B_A3B[] = R"({
  "architectures": ["Qwen3MoeForCausalLM"],
  "attention_bias": false,
  "attention_dropout": 0.0,
  "bos_token_id": 151643,
  "decoder_sparse_step": 1,
  "eos_token_id": 151645,
  "head_dim": 128,
  "hidden_act": "silu",
  "hidden_size": 2048,
  "initializer_range": 0.02,
  "intermediate_size": 6144,
  "max_position_embeddings": 40960,
  "max_window_layers": 48,
  "mlp_only_layers": [],
  "model_type": "qwen3_moe",
  "moe_intermediate_size": 768,
  "norm_topk_prob": true,
  "num_attention_heads": 32,
  "num_experts": 128,
  "num_experts_per_tok": 8,
  "num_hidden_layers": 48,
  "num_key_value_heads": 4,
  "output_router_logits": false,
  "rms_norm_eps": 1e-06,
  "rope_scaling": null,
  "rope_theta": 1000000.0,
  "router_aux_loss_coef": 0.001,
  "sliding_window": null,
  "tie_word_embeddings": false,
  "torch_dtype": "bfloat16",
  "transformers_version": "4.51.0",
  "use_cache": true,
  "use_sliding_window": false,
  "vocab_size": 151936
})";

void ExpectSameConfig(const ModelConfig& a, const ModelConfig& b) {
  EXPECT_EQ(a.model_type, b.model_type);
  EXPECT_EQ(a.vocab_size, b.vocab_size);
  EXPECT_EQ(a.hidden_size, b.hidden_size);
  EXPECT_EQ(a.intermediate_size, b.intermediate_size);
  EXPECT_EQ(a.moe_intermediate_size, b.moe_intermediate_size);
  EXPECT_EQ(a.num_hidden_layers, b.num_hidden_layers);
  EXPECT_EQ(a.num_attention_heads, b.num_attention_heads);
  EXPECT_EQ(a.num_key_value_heads, b.num_key_value_heads);
  EXPECT_EQ(a.head_dim, b.head_dim);
  EXPECT_EQ(a.num_experts, b.num_experts);
  EXPECT_EQ(a.num_experts_per_tok, b.num_experts_per_tok);
  EXPECT_EQ(a.decoder_sparse_step, b.decoder_sparse_step);
  EXPECT_EQ(a.mlp_only_layers, b.mlp_only_layers);
  EXPECT_EQ(a.norm_topk_prob, b.norm_topk_prob);
  EXPECT_EQ(a.tie_word_embeddings, b.tie_word_embeddings);
  EXPECT_EQ(a.attention_bias, b.attention_bias);
  EXPECT_EQ(a.rms_norm_eps, b.rms_norm_eps);
  EXPECT_EQ(a.rope_theta, b.rope_theta);
  EXPECT_EQ(a.max_position_embeddings, b.max_position_embeddings);
  EXPECT_EQ(a.hidden_act, b.hidden_act);
  EXPECT_EQ(a.torch_dtype, b.torch_dtype);
  EXPECT_EQ(a.eos_token_ids, b.eos_token_ids);
  EXPECT_EQ(a.bos_token_id, b.bos_token_id);
}

// A small valid config to mutate.
Json SmallConfig() {
  return Json::parse(R"({
    "model_type": "qwen3_moe", "vocab_size": 256, "hidden_size": 64, "intermediate_size": 96,
    "moe_intermediate_size": 32, "num_hidden_layers": 4, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 16, "num_experts": 8, "num_experts_per_tok": 2,
    "decoder_sparse_step": 1, "mlp_only_layers": [], "norm_topk_prob": true,
    "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "max_position_embeddings": 512,
    "hidden_act": "silu", "torch_dtype": "float32", "eos_token_id": 1, "bos_token_id": 0
  })");
}

absl::StatusOr<ModelConfig> Parse(const Json& j) { return ParseModelConfig(j.dump(), "cfg.json"); }

TEST(ModelConfigTest, ParsesQwen3_30B_A3B) {
  absl::StatusOr<ModelConfig> c = ParseModelConfig(kQwen3_30B_A3B, "Qwen3-30B-A3B/config.json");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->vocab_size, 151936);
  EXPECT_EQ(c->hidden_size, 2048);
  EXPECT_EQ(c->intermediate_size, 6144);
  EXPECT_EQ(c->moe_intermediate_size, 768);
  EXPECT_EQ(c->num_hidden_layers, 48);
  EXPECT_EQ(c->num_attention_heads, 32);
  EXPECT_EQ(c->num_key_value_heads, 4);
  EXPECT_EQ(c->head_dim, 128);
  EXPECT_EQ(c->num_experts, 128);
  EXPECT_EQ(c->num_experts_per_tok, 8);
  EXPECT_TRUE(c->norm_topk_prob);
  EXPECT_FALSE(c->tie_word_embeddings);
  EXPECT_EQ(c->rms_norm_eps, 1e-6);
  EXPECT_EQ(c->rope_theta, 1e6);
  EXPECT_EQ(c->max_position_embeddings, 40960);
  EXPECT_EQ(c->torch_dtype, "bfloat16");
  EXPECT_THAT(c->eos_token_ids, ElementsAre(151645));
  EXPECT_EQ(c->bos_token_id, 151643);
  EXPECT_TRUE(c->mlp_only_layers.empty());
  for (int64_t layer = 0; layer < 48; ++layer) EXPECT_TRUE(c->IsMoeLayer(layer));
}

// The quantization method of an FP8 checkpoint (Qwen3-*-FP8's quantization_config); none
// without one. The rest of quantization_config is checked with the tensors.
TEST(ModelConfigTest, QuantMethod) {
  Json j = SmallConfig();
  absl::StatusOr<ModelConfig> c = Parse(j);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->quant_method, "");
  j["quantization_config"] = Json::parse(R"({"quant_method": "fp8", "fmt": "e4m3",
      "activation_scheme": "dynamic", "weight_block_size": [128, 128]})");
  c = Parse(j);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->quant_method, "fp8");
  j["quantization_config"]["quant_method"] = 8;
  c = Parse(j);
  ASSERT_FALSE(c.ok());
  EXPECT_THAT(std::string(c.status().message()), HasSubstr("quant_method"));
}

TEST(ModelConfigTest, DefaultsFollowTransformers) {
  absl::StatusOr<ModelConfig> c = ParseModelConfig("{}", "cfg.json");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->model_type, "qwen3_moe");
  EXPECT_EQ(c->vocab_size, 151936);
  EXPECT_EQ(c->hidden_size, 2048);
  EXPECT_EQ(c->intermediate_size, 6144);
  EXPECT_EQ(c->moe_intermediate_size, 768);
  EXPECT_EQ(c->num_hidden_layers, 24);
  EXPECT_EQ(c->num_attention_heads, 32);
  EXPECT_EQ(c->num_key_value_heads, 4);
  EXPECT_EQ(c->head_dim, 64);  // hidden_size / num_attention_heads
  EXPECT_EQ(c->num_experts, 128);
  EXPECT_EQ(c->num_experts_per_tok, 8);
  EXPECT_EQ(c->decoder_sparse_step, 1);
  EXPECT_FALSE(c->norm_topk_prob);
  EXPECT_FALSE(c->tie_word_embeddings);
  EXPECT_FALSE(c->attention_bias);
  EXPECT_EQ(c->rms_norm_eps, 1e-6);
  EXPECT_EQ(c->rope_theta, 10000.0);
  EXPECT_EQ(c->max_position_embeddings, 32768);
  EXPECT_EQ(c->hidden_act, "silu");
  EXPECT_TRUE(c->eos_token_ids.empty());
  EXPECT_EQ(c->bos_token_id, -1);

  // Nulls mean "not set".
  c = ParseModelConfig(R"({"head_dim": null, "hidden_size": 512, "num_attention_heads": 8,
                           "eos_token_id": null, "mlp_only_layers": null})",
                       "cfg.json");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->head_dim, 64);
  EXPECT_TRUE(c->eos_token_ids.empty());
}

TEST(ModelConfigTest, TransformersV5Spelling) {
  Json j = SmallConfig();
  j.erase("rope_theta");
  j.erase("torch_dtype");
  j["dtype"] = "bfloat16";
  j["rope_parameters"] = {{"rope_type", "default"}, {"rope_theta", 1000000.0}};
  absl::StatusOr<ModelConfig> c = Parse(j);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->torch_dtype, "bfloat16");
  EXPECT_EQ(c->rope_theta, 1e6);
  // rope_parameters wins over a top-level rope_theta, as in transformers.
  j["rope_theta"] = 5.0;
  c = Parse(j);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->rope_theta, 1e6);
}

// config.json as transformers 5.x save_pretrained() writes it: "dtype", "rope_parameters"
// and num_experts under its attribute_map name "num_local_experts".
TEST(ModelConfigTest, TransformersV5SavedConfig) {
  constexpr char kSaved[] = R"({
    "attention_bias": false, "attention_dropout": 0.0, "bos_token_id": null,
    "decoder_sparse_step": 1, "dtype": "bfloat16", "eos_token_id": [1, 2], "head_dim": 16,
    "hidden_act": "silu", "hidden_size": 64, "initializer_range": 0.02,
    "intermediate_size": 64, "max_position_embeddings": 32768, "mlp_only_layers": [],
    "model_type": "qwen3_moe", "moe_intermediate_size": 32, "norm_topk_prob": false,
    "num_attention_heads": 4, "num_experts_per_tok": 2, "num_hidden_layers": 2,
    "num_key_value_heads": 2, "num_local_experts": 4, "output_router_logits": false,
    "pad_token_id": null, "rms_norm_eps": 1e-06,
    "rope_parameters": {"rope_theta": 1000000.0, "rope_type": "default"},
    "router_aux_loss_coef": 0.001, "sliding_window": null, "tie_word_embeddings": false,
    "transformers_version": "5.24.0", "use_cache": true, "use_sliding_window": false,
    "vocab_size": 128
  })";
  absl::StatusOr<ModelConfig> c = ParseModelConfig(kSaved, "v5/config.json");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->num_experts, 4);
  EXPECT_EQ(c->num_experts_per_tok, 2);
  EXPECT_EQ(c->rope_theta, 1e6);
  EXPECT_EQ(c->torch_dtype, "bfloat16");
  EXPECT_EQ(c->bos_token_id, -1);
  EXPECT_THAT(c->eos_token_ids, ElementsAre(1, 2));

  Json j = Json::parse(kSaved);
  j["num_experts"] = 8;
  c = Parse(j);
  EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(c.status().message(),
              AllOf(HasSubstr("num_experts"), HasSubstr("num_local_experts")));
  j["num_experts"] = 4;
  EXPECT_TRUE(Parse(j).ok());
}

TEST(ModelConfigTest, RopeScaling) {
  Json j = SmallConfig();
  j["rope_scaling"] = {{"type", "default"}};
  EXPECT_TRUE(Parse(j).ok());
  j["rope_scaling"] = nullptr;
  EXPECT_TRUE(Parse(j).ok());

  j["rope_scaling"] = {{"rope_type", "yarn"}, {"factor", 4.0}};
  absl::StatusOr<ModelConfig> c = Parse(j);
  EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(c.status().message(), AllOf(HasSubstr("cfg.json"), HasSubstr("rope_scaling"),
                                          HasSubstr("yarn"), HasSubstr("not supported")));
  j["rope_scaling"] = {{"type", "linear"}, {"factor", 2.0}};
  EXPECT_THAT(Parse(j).status().message(), HasSubstr("not supported"));
  j["rope_scaling"] = "yarn";
  EXPECT_THAT(Parse(j).status().message(), HasSubstr("rope_scaling"));

  j.erase("rope_scaling");
  j["rope_parameters"] = {{"rope_type", "dynamic"}, {"rope_theta", 10000.0}};
  c = Parse(j);
  EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(c.status().message(),
              AllOf(HasSubstr("rope_parameters"), HasSubstr("not supported")));
}

TEST(ModelConfigTest, EosTokenIdIntOrList) {
  Json j = SmallConfig();
  j["eos_token_id"] = {1, 2, 3};
  absl::StatusOr<ModelConfig> c = Parse(j);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_THAT(c->eos_token_ids, ElementsAre(1, 2, 3));
  j["eos_token_id"] = 7;
  c = Parse(j);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_THAT(c->eos_token_ids, ElementsAre(7));
}

TEST(ModelConfigTest, HeadDimDefaultsToHiddenOverHeads) {
  Json j = SmallConfig();
  j.erase("head_dim");
  absl::StatusOr<ModelConfig> c = Parse(j);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->head_dim, 16);  // 64 / 4
}

TEST(ModelConfigTest, SyntaxAndTypeErrorsNameTheField) {
  absl::StatusOr<ModelConfig> c = ParseModelConfig("{\"hidden_size\": ", "dir/config.json");
  EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(c.status().message(), AllOf(HasSubstr("dir/config.json"), HasSubstr("JSON")));
  c = ParseModelConfig("", "dir/config.json");
  EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument);
  c = ParseModelConfig("[1]", "dir/config.json");
  EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(c.status().message(), HasSubstr("JSON object"));

  const std::vector<std::pair<std::string, Json>> cases = {
      {"hidden_size", "big"},
      {"hidden_size", 64.5},
      {"vocab_size", true},
      {"num_hidden_layers", Json::array()},
      {"num_experts", 18446744073709551615ull},
      {"norm_topk_prob", 1},
      {"tie_word_embeddings", "false"},
      {"rms_norm_eps", "1e-6"},
      {"rope_theta", Json::object()},
      {"hidden_act", 3},
      {"model_type", Json::array({"qwen3_moe"})},
      {"torch_dtype", 16},
      {"dtype", false},
      {"mlp_only_layers", 3},
      {"mlp_only_layers", Json::array({1.5})},
      {"eos_token_id", "</s>"},
      {"eos_token_id", Json::array({"a"})},
      {"bos_token_id", 0.5},
      {"rope_parameters", 3},
      {"num_local_experts", "4"},
  };
  for (const auto& [field, value] : cases) {
    SCOPED_TRACE(field + " = " + value.dump());
    Json j = SmallConfig();
    j[field] = value;
    c = Parse(j);
    ASSERT_FALSE(c.ok());
    EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(c.status().message(), AllOf(HasSubstr("cfg.json"), HasSubstr("'" + field + "'")));
  }
}

TEST(ModelConfigTest, ValidationErrorsNameTheField) {
  const std::vector<std::tuple<std::string, Json, std::string>> cases = {
      {"model_type", "qwen2", "model_type"},
      {"hidden_act", "gelu", "hidden_act"},
      {"torch_dtype", "int8", "torch_dtype"},
      {"vocab_size", 0, "vocab_size"},
      {"vocab_size", (1 << 22) + 1, "vocab_size"},
      {"hidden_size", -64, "hidden_size"},
      {"hidden_size", 65537, "hidden_size"},
      {"num_hidden_layers", 0, "num_hidden_layers"},
      {"num_hidden_layers", 1025, "num_hidden_layers"},
      {"num_attention_heads", 0, "num_attention_heads"},
      {"num_key_value_heads", 3, "num_key_value_heads"},
      {"num_key_value_heads", 0, "num_key_value_heads"},
      {"num_key_value_heads", 8, "num_key_value_heads"},
      {"head_dim", 15, "head_dim"},
      {"head_dim", 0, "head_dim"},
      {"num_experts", 4097, "num_experts"},
      {"num_experts", -1, "num_experts"},
      {"num_experts_per_tok", 0, "num_experts_per_tok"},
      {"num_experts_per_tok", 9, "num_experts_per_tok"},
      {"decoder_sparse_step", 0, "decoder_sparse_step"},
      {"mlp_only_layers", Json::array({4}), "mlp_only_layers"},
      {"mlp_only_layers", Json::array({-1}), "mlp_only_layers"},
      {"rms_norm_eps", 0.0, "rms_norm_eps"},
      {"rms_norm_eps", -1e-6, "rms_norm_eps"},
      {"rope_theta", 0.0, "rope_theta"},
      {"rope_theta", -10000.0, "rope_theta"},
      {"max_position_embeddings", 0, "max_position_embeddings"},
      {"eos_token_id", 256, "eos_token_id"},
      {"eos_token_id", Json::array({1, -2}), "eos_token_id"},
      {"bos_token_id", 1000, "bos_token_id"},
      {"moe_intermediate_size", 0, "moe_intermediate_size"},
      {"intermediate_size", -1, "intermediate_size"},
  };
  for (const auto& [field, value, named] : cases) {
    SCOPED_TRACE(field + " = " + value.dump());
    Json j = SmallConfig();
    j[field] = value;
    absl::StatusOr<ModelConfig> c = Parse(j);
    ASSERT_FALSE(c.ok());
    EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(c.status().message(), AllOf(HasSubstr("cfg.json"), HasSubstr(named)));
  }
}

TEST(ModelConfigTest, DenseAndMoeLayers) {
  // All layers MoE: intermediate_size may be 0.
  Json j = SmallConfig();
  j["intermediate_size"] = 0;
  EXPECT_TRUE(Parse(j).ok());
  // One dense layer needs intermediate_size.
  j["mlp_only_layers"] = {2};
  absl::StatusOr<ModelConfig> c = Parse(j);
  EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(c.status().message(), HasSubstr("intermediate_size"));
  // No experts at all: dense model, moe_intermediate_size may be 0.
  j = SmallConfig();
  j["num_experts"] = 0;
  j["num_experts_per_tok"] = 0;
  j["moe_intermediate_size"] = 0;
  c = Parse(j);
  ASSERT_TRUE(c.ok()) << c.status();
  for (int64_t layer = 0; layer < 4; ++layer) EXPECT_FALSE(c->IsMoeLayer(layer));

  j = SmallConfig();
  j["decoder_sparse_step"] = 2;
  j["mlp_only_layers"] = {3};
  c = Parse(j);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_FALSE(c->IsMoeLayer(0));
  EXPECT_TRUE(c->IsMoeLayer(1));
  EXPECT_FALSE(c->IsMoeLayer(2));
  EXPECT_FALSE(c->IsMoeLayer(3));  // in mlp_only_layers

  ModelConfig bad = *c;
  bad.decoder_sparse_step = 0;  // must not divide by zero
  EXPECT_FALSE(bad.IsMoeLayer(0));
  EXPECT_FALSE(bad.Validate().ok());
}

TEST(ModelConfigTest, ToJsonRoundTrips) {
  std::vector<ModelConfig> configs;
  configs.push_back(*ParseModelConfig(kQwen3_30B_A3B, "a"));
  configs.push_back(*ParseModelConfig("{}", "b"));
  ModelConfig odd = *Parse(SmallConfig());
  odd.eos_token_ids = {1, 2};
  odd.bos_token_id = -1;
  odd.mlp_only_layers = {0, 3};
  odd.decoder_sparse_step = 2;
  odd.rms_norm_eps = 1.0 / 3.0;
  odd.rope_theta = 123456.789;
  odd.tie_word_embeddings = true;
  odd.attention_bias = true;
  odd.norm_topk_prob = false;
  odd.torch_dtype = "float16";
  configs.push_back(odd);
  odd.eos_token_ids.clear();
  configs.push_back(odd);

  for (const ModelConfig& original : configs) {
    ASSERT_TRUE(original.Validate().ok()) << original.Validate();
    const std::string text = original.ToJson();
    absl::StatusOr<ModelConfig> parsed = ParseModelConfig(text, "round-trip");
    ASSERT_TRUE(parsed.ok()) << parsed.status() << "\n" << text;
    ExpectSameConfig(original, *parsed);
    EXPECT_EQ(parsed->ToJson(), text);
  }
}

TEST(ModelConfigTest, ToJsonHasWhatTransformersNeeds) {
  const Json j = Json::parse(ParseModelConfig(kQwen3_30B_A3B, "a")->ToJson());
  EXPECT_EQ(j["architectures"], Json::array({"Qwen3MoeForCausalLM"}));
  EXPECT_EQ(j["model_type"], "qwen3_moe");
  EXPECT_TRUE(j["rope_scaling"].is_null());
  EXPECT_EQ(j["rope_theta"], 1e6);
  EXPECT_EQ(j["use_sliding_window"], false);
  EXPECT_TRUE(j["sliding_window"].is_null());
  EXPECT_EQ(j["max_window_layers"], 48);
  EXPECT_EQ(j["attention_dropout"], 0.0);
  EXPECT_EQ(j["output_router_logits"], false);
  EXPECT_EQ(j["router_aux_loss_coef"], 0.001);
  EXPECT_EQ(j["initializer_range"], 0.02);
  EXPECT_EQ(j["use_cache"], true);
  EXPECT_EQ(j["torch_dtype"], "bfloat16");
  EXPECT_EQ(j["eos_token_id"], 151645);
  EXPECT_EQ(j["bos_token_id"], 151643);
  EXPECT_EQ(j["head_dim"], 128);
  EXPECT_EQ(j["norm_topk_prob"], true);
  EXPECT_EQ(j["mlp_only_layers"], Json::array());
}

TEST(ModelConfigTest, LoadFromDirectory) {
  std::string pattern = "/tmp/dxs_model_config_test_XXXXXX";
  ASSERT_NE(::mkdtemp(pattern.data()), nullptr);
  const std::string dir = pattern;

  absl::StatusOr<ModelConfig> c = LoadModelConfig(dir);
  EXPECT_EQ(c.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(c.status().message(), HasSubstr(dir + "/config.json"));

  {
    std::ofstream out(dir + "/config.json");
    out << kQwen3_30B_A3B;
  }
  c = LoadModelConfig(dir);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->num_hidden_layers, 48);

  {
    std::ofstream out(dir + "/config.json");
    out << R"({"num_key_value_heads": 5})";
  }
  c = LoadModelConfig(dir);
  EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(c.status().message(),
              AllOf(HasSubstr(dir + "/config.json"), HasSubstr("num_key_value_heads")));
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace dxs
