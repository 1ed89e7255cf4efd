#include "model/random_checkpoint.h"

#include <sys/stat.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <iterator>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/safetensors.h"
#include "common/status_macros.h"
#include "model/router_skew.h"
#include "model/sampler.h"
#include "model/tokenizer_files.h"
#include "model/weights.h"
#include "nlohmann/json.hpp"

namespace dxs {
namespace {

uint64_t Fnv1a(uint64_t h, const void* data, size_t n) {
  const auto* p = static_cast<const uint8_t*>(data);
  for (size_t i = 0; i < n; ++i) {
    h ^= p[i];
    h *= 0x100000001b3ull;
  }
  return h;
}

constexpr uint64_t kFnvOffset = 0xcbf29ce484222325ull;

// Uniform values with standard deviation `stddev` around `mean`.
std::vector<float> RandomValues(uint64_t seed, const std::string& name, int64_t count,
                                double stddev, double mean = 0.0) {
  SplitMix64 rng(Fnv1a(kFnvOffset ^ seed, name.data(), name.size()));
  const double half_width = stddev * std::sqrt(3.0);
  std::vector<float> v(count);
  for (int64_t i = 0; i < count; ++i) {
    v[i] = static_cast<float>(mean + (2.0 * rng.NextDouble() - 1.0) * half_width);
  }
  return v;
}

ModelConfig BaseConfig() {
  ModelConfig c;
  c.max_position_embeddings = 4096;
  c.rms_norm_eps = 1e-6;
  c.bos_token_id = 1;
  c.eos_token_ids = {2};
  return c;
}

}  // namespace

std::vector<std::string> PresetNames() {
  return {"default", "odd", "bf16-sharded", "qwen3-30b-a3b"};
}

absl::StatusOr<CheckpointPreset> GetPreset(const std::string& name) {
  CheckpointPreset p;
  p.name = name;
  ModelConfig c = BaseConfig();
  if (name == "default") {
    c.vocab_size = 4096;
    c.hidden_size = 128;
    c.num_hidden_layers = 4;
    c.num_attention_heads = 4;
    c.num_key_value_heads = 2;
    c.head_dim = 32;
    c.num_experts = 16;
    c.num_experts_per_tok = 4;
    c.moe_intermediate_size = 64;
    c.intermediate_size = 256;
    c.rope_theta = 1000000.0;
    c.norm_topk_prob = true;
    c.tie_word_embeddings = false;
    p.seed = 20261129;
  } else if (name == "odd") {
    c.vocab_size = 3001;
    c.hidden_size = 96;
    c.num_hidden_layers = 3;
    c.num_attention_heads = 6;
    c.num_key_value_heads = 2;  // GQA ratio 3
    c.head_dim = 24;
    c.num_experts = 12;  // not a power of two
    c.num_experts_per_tok = 3;
    c.moe_intermediate_size = 40;
    c.intermediate_size = 112;
    c.mlp_only_layers = {1};  // one dense layer in the middle
    c.rope_theta = 10000.0;
    c.norm_topk_prob = true;
    c.tie_word_embeddings = false;
    c.eos_token_ids = {2, 3000};
    p.seed = 7;
  } else if (name == "bf16-sharded") {
    c.vocab_size = 2048;
    c.hidden_size = 64;
    c.num_hidden_layers = 3;
    c.num_attention_heads = 4;
    c.num_key_value_heads = 1;
    c.head_dim = 16;
    c.num_experts = 8;
    c.num_experts_per_tok = 2;
    c.moe_intermediate_size = 48;
    c.intermediate_size = 128;
    c.rope_theta = 500000.0;
    c.norm_topk_prob = false;
    c.tie_word_embeddings = true;
    c.torch_dtype = "bfloat16";
    p.storage_dtype = DType::kBF16;
    p.num_shards = 3;
    p.seed = 99;
  } else if (name == "qwen3-30b-a3b") {
    c.vocab_size = 151936;
    c.hidden_size = 2048;
    c.num_hidden_layers = 48;
    c.num_attention_heads = 32;
    c.num_key_value_heads = 4;
    c.head_dim = 128;
    c.num_experts = 128;
    c.num_experts_per_tok = 8;
    c.moe_intermediate_size = 768;
    c.intermediate_size = 6144;
    c.max_position_embeddings = 40960;
    c.rope_theta = 1000000.0;
    c.norm_topk_prob = true;
    c.torch_dtype = "bfloat16";
    c.eos_token_ids = {151645};
    c.bos_token_id = 151643;
    p.storage_dtype = DType::kBF16;
    p.num_shards = 16;
    p.seed = 30;
  } else {
    return absl::NotFoundError(absl::StrCat("unknown preset '", name,
                                            "'; known: default, odd, bf16-sharded, qwen3-30b-a3b"));
  }
  DXS_RETURN_IF_ERROR(c.Validate());
  p.config = c;
  return p;
}

std::vector<RandomTensorSpec> RandomTensorSpecs(const CheckpointPreset& preset) {
  const ModelConfig& c = preset.config;
  std::vector<RandomTensorSpec> specs;
  auto add = [&](const std::string& name, std::vector<int64_t> shape, double stddev,
                 double mean = 0.0) {
    specs.push_back({name, std::move(shape), stddev, mean});
  };
  const int64_t h = c.hidden_size, d = c.head_dim;
  const int64_t q_dim = c.num_attention_heads * d, kv_dim = c.num_key_value_heads * d;
  auto fan_in = [](int64_t n) { return 1.0 / std::sqrt(static_cast<double>(n)); };
  // A tied head scores each token by its own embedding; small embeddings keep the input
  // token from winning every step, so greedy output stays varied.
  add("model.embed_tokens.weight", {c.vocab_size, h}, c.tie_word_embeddings ? 0.05 : 1.0);
  for (int l = 0; l < c.num_hidden_layers; ++l) {
    auto name = [l](const std::string& s) { return LayerTensorName(l, s); };
    // Norm weights near one, but not one, so a missing multiply is caught.
    add(name("input_layernorm.weight"), {h}, 0.1, 1.0);
    add(name("post_attention_layernorm.weight"), {h}, 0.1, 1.0);
    add(name("self_attn.q_proj.weight"), {q_dim, h}, fan_in(h));
    add(name("self_attn.k_proj.weight"), {kv_dim, h}, fan_in(h));
    add(name("self_attn.v_proj.weight"), {kv_dim, h}, fan_in(h));
    add(name("self_attn.o_proj.weight"), {h, q_dim}, fan_in(q_dim));
    if (c.attention_bias) {
      add(name("self_attn.q_proj.bias"), {q_dim}, 0.1);
      add(name("self_attn.k_proj.bias"), {kv_dim}, 0.1);
      add(name("self_attn.v_proj.bias"), {kv_dim}, 0.1);
      add(name("self_attn.o_proj.bias"), {h}, 0.1);
    }
    // q/k norm weights a little above one sharpen attention over a random context.
    add(name("self_attn.q_norm.weight"), {d}, 0.2, 1.5);
    add(name("self_attn.k_norm.weight"), {d}, 0.2, 1.5);
    if (c.IsMoeLayer(l)) {
      // Router logits with a spread of about 2: decisive, yet every expert gets tokens.
      add(name("mlp.gate.weight"), {c.num_experts, h}, 2.0 * fan_in(h));
      if (preset.router_skew != 0) {
        specs.back().row_scale =
            preset.router_scales.size() == static_cast<size_t>(c.num_experts)
                ? preset.router_scales
                : ZipfRouterScales(c.num_experts, c.num_experts_per_tok, preset.router_skew);
      }
      for (int e = 0; e < c.num_experts; ++e) {
        add(ExpertTensorName(l, e, "gate_proj"), {c.moe_intermediate_size, h}, fan_in(h));
        add(ExpertTensorName(l, e, "up_proj"), {c.moe_intermediate_size, h}, fan_in(h));
        add(ExpertTensorName(l, e, "down_proj"), {h, c.moe_intermediate_size},
            fan_in(c.moe_intermediate_size));
      }
    } else {
      add(name("mlp.gate_proj.weight"), {c.intermediate_size, h}, fan_in(h));
      add(name("mlp.up_proj.weight"), {c.intermediate_size, h}, fan_in(h));
      add(name("mlp.down_proj.weight"), {h, c.intermediate_size}, fan_in(c.intermediate_size));
    }
  }
  add("model.norm.weight", {h}, 0.1, 1.0);
  if (!c.tie_word_embeddings) add("lm_head.weight", {c.vocab_size, h}, 4.0 * fan_in(h));
  return specs;
}

bool IsFp8QuantizedTensor(const std::string& name) {
  constexpr std::string_view kSuffix = "_proj.weight";
  return name.size() > kSuffix.size() &&
         name.compare(name.size() - kSuffix.size(), kSuffix.size(), kSuffix) == 0;
}

void QuantizeFp8Blocks(const std::vector<float>& w, int64_t rows, int64_t cols,
                       std::vector<float>* q, std::vector<float>* scale) {
  constexpr int64_t kBlock = 128;
  const int64_t block_rows = (rows + kBlock - 1) / kBlock,
                block_cols = (cols + kBlock - 1) / kBlock;
  q->assign(w.size(), 0.0f);
  scale->assign(block_rows * block_cols, 1.0f);
  for (int64_t br = 0; br < block_rows; ++br) {
    for (int64_t bc = 0; bc < block_cols; ++bc) {
      const int64_t r_end = std::min(rows, (br + 1) * kBlock);
      const int64_t c_end = std::min(cols, (bc + 1) * kBlock);
      float amax = 0;
      for (int64_t r = br * kBlock; r < r_end; ++r) {
        for (int64_t c = bc * kBlock; c < c_end; ++c)
          amax = std::max(amax, std::fabs(w[r * cols + c]));
      }
      const float s = amax > 0 ? amax / kFp8E4m3Max : 1.0f;
      (*scale)[br * block_cols + bc] = s;
      for (int64_t r = br * kBlock; r < r_end; ++r) {
        for (int64_t c = bc * kBlock; c < c_end; ++c) {
          const float x = std::clamp(w[r * cols + c] / s, -kFp8E4m3Max, kFp8E4m3Max);
          (*q)[r * cols + c] = Fp8E4m3ToFloat(FloatToFp8E4m3(x));
        }
      }
    }
  }
}

std::string PresetConfigJson(const CheckpointPreset& preset) {
  const ModelConfig& c = preset.config;
  if (!preset.fp8) return c.ToJson();
  nlohmann::ordered_json j = nlohmann::ordered_json::parse(c.ToJson());
  // As Qwen3's FP8 configs: the modules left in their dtype.
  std::vector<std::string> keep;
  if (!c.tie_word_embeddings) keep.push_back("lm_head");
  keep.push_back("model.embed_tokens");
  for (int l = 0; l < c.num_hidden_layers; ++l) {
    for (const char* m :
         {"input_layernorm", "post_attention_layernorm", "self_attn.q_norm", "self_attn.k_norm"}) {
      keep.push_back(LayerTensorName(l, m));
    }
    if (c.IsMoeLayer(l)) keep.push_back(LayerTensorName(l, "mlp.gate"));
  }
  keep.push_back("model.norm");
  nlohmann::ordered_json q;
  q["quant_method"] = "fp8";
  q["fmt"] = "e4m3";
  q["activation_scheme"] = "dynamic";
  q["weight_block_size"] = {128, 128};
  q["modules_to_not_convert"] = keep;
  j["quantization_config"] = q;
  return j.dump(2) + "\n";
}

namespace {

// A quantized tensor's values before quantization: as drawn, rounded to the storage dtype
// (the official checkpoints are quantized from their bf16 weights).
std::vector<float> StoredValues(const CheckpointPreset& preset, const RandomTensorSpec& spec) {
  std::vector<float> values = RandomTensorValues(preset.seed, spec);
  if (preset.storage_dtype != DType::kF32) {
    std::vector<uint8_t> stored(values.size() * DTypeSize(preset.storage_dtype));
    NarrowFromFloat32(preset.storage_dtype, values.data(), values.size(), stored.data());
    WidenToFloat32(preset.storage_dtype, stored.data(), values.size(), values.data());
  }
  return values;
}

}  // namespace

uint64_t RandomTensorSeed(uint64_t seed, const std::string& name) {
  return Fnv1a(kFnvOffset ^ seed, name.data(), name.size());
}

std::vector<float> RandomTensorValues(uint64_t seed, const RandomTensorSpec& spec) {
  int64_t n = 1;
  for (int64_t dim : spec.shape) n *= dim;
  std::vector<float> values = RandomValues(seed, spec.name, n, spec.stddev, spec.mean);
  const int64_t rows = static_cast<int64_t>(spec.row_scale.size());
  if (rows == 0 || spec.shape.empty() || spec.shape[0] != rows) return values;
  const int64_t cols = n / rows;
  std::vector<double> norm(rows);
  double mean_norm = 0;
  for (int64_t r = 0; r < rows; ++r) {
    double sq = 0;
    for (int64_t i = 0; i < cols; ++i) sq += double{values[r * cols + i]} * values[r * cols + i];
    norm[r] = std::sqrt(sq);
    mean_norm += norm[r] / rows;
  }
  for (int64_t r = 0; r < rows; ++r) {
    const double f = norm[r] > 0 ? mean_norm / norm[r] * spec.row_scale[r] : 0.0;
    for (int64_t i = 0; i < cols; ++i) {
      values[r * cols + i] = static_cast<float>(values[r * cols + i] * f);
    }
  }
  return values;
}

RandomWeightSource::RandomWeightSource(const CheckpointPreset& preset) : preset_(preset) {
  for (RandomTensorSpec& spec : RandomTensorSpecs(preset)) {
    const std::string name = spec.name;
    specs_.emplace(name, std::move(spec));
  }
}

absl::StatusOr<Tensor> RandomWeightSource::LoadProjection(const std::string& name,
                                                          std::vector<int64_t> shape,
                                                          Backend* backend) const {
  auto it = specs_.find(name);
  if (!preset_.fp8 || !IsFp8QuantizedTensor(name) || it == specs_.end() ||
      it->second.shape != shape || !KeepsFp8Weight(*backend, shape)) {
    return Load(name, std::move(shape), backend);
  }
  std::vector<float> q, scale;
  QuantizeFp8Blocks(StoredValues(preset_, it->second), shape[0], shape[1], &q, &scale);
  std::vector<uint8_t> fp8(q.size());
  for (size_t i = 0; i < q.size(); ++i) fp8[i] = FloatToFp8E4m3(q[i]);
  return MakeBlockScaledWeight(fp8.data(), scale.data(), std::move(shape), backend);
}

absl::StatusOr<Tensor> RandomWeightSource::Load(const std::string& name, std::vector<int64_t> shape,
                                                Backend* backend) const {
  auto it = specs_.find(name);
  if (it == specs_.end()) {
    return absl::NotFoundError(absl::StrCat("preset ", preset_.name, " has no tensor ", name));
  }
  const RandomTensorSpec& spec = it->second;
  if (spec.shape != shape) {
    return absl::InvalidArgumentError(
        absl::StrCat("preset ", preset_.name, ": tensor ", name, " has another shape"));
  }
  if (preset_.fp8 && IsFp8QuantizedTensor(name) && shape.size() == 2) {
    // Made on the host, quantized and dequantized as a checkpoint of --fp8 would be loaded
    // (CheckpointWeightSource: fp8 value times its block scale, in float32).
    std::vector<float> q, scale;
    QuantizeFp8Blocks(StoredValues(preset_, spec), shape[0], shape[1], &q, &scale);
    const int64_t cols = shape[1], block_cols = (cols + 127) / 128;
    for (size_t i = 0; i < q.size(); ++i) {
      const int64_t r = static_cast<int64_t>(i) / cols, c = static_cast<int64_t>(i) % cols;
      q[i] *= scale[(r / 128) * block_cols + c / 128];
    }
    const DType dequantized = preset_.config.torch_dtype == "bfloat16"  ? DType::kBF16
                              : preset_.config.torch_dtype == "float16" ? DType::kF16
                                                                        : DType::kF32;
    DXS_ASSIGN_OR_RETURN(Tensor t,
                         backend->Allocate(std::move(shape), backend->WeightDType(dequantized)));
    DXS_RETURN_IF_ERROR(backend->CopyFromHost(q.data(), DType::kF32, &t));
    return t;
  }
  DXS_ASSIGN_OR_RETURN(
      Tensor t, backend->Allocate(std::move(shape), backend->WeightDType(preset_.storage_dtype)));
  if (!spec.row_scale.empty()) {
    // A skewed gate (small: experts x hidden) is made on the host, rounded to the storage
    // dtype as the checkpoint would hold it.
    std::vector<float> values = RandomTensorValues(preset_.seed, spec);
    std::vector<uint8_t> stored(values.size() * DTypeSize(preset_.storage_dtype));
    NarrowFromFloat32(preset_.storage_dtype, values.data(), values.size(), stored.data());
    DXS_RETURN_IF_ERROR(backend->CopyFromHost(stored.data(), preset_.storage_dtype, &t));
    return t;
  }
  DXS_RETURN_IF_ERROR(backend->FillUniform(&t, RandomTensorSeed(preset_.seed, name), spec.mean,
                                           spec.stddev * std::sqrt(3.0), preset_.storage_dtype));
  return t;
}

absl::Status WriteRandomCheckpoint(const CheckpointPreset& preset, const std::string& dir) {
  const ModelConfig& c = preset.config;
  DXS_RETURN_IF_ERROR(c.Validate());
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) {
    return absl::InternalError(absl::StrCat("cannot create ", dir, ": ", ec.message()));
  }
  SafetensorsWriter writer;
  for (RandomTensorSpec& spec : RandomTensorSpecs(preset)) {
    if (preset.fp8 && IsFp8QuantizedTensor(spec.name) && spec.shape.size() == 2) {
      std::vector<float> q, scale;
      QuantizeFp8Blocks(StoredValues(preset, spec), spec.shape[0], spec.shape[1], &q, &scale);
      const std::vector<int64_t> scale_shape = {(spec.shape[0] + 127) / 128,
                                                (spec.shape[1] + 127) / 128};
      writer.Add(spec.name, DType::kF8E4M3, spec.shape, q);
      writer.Add(spec.name + kFp8ScaleSuffix, DType::kF32, scale_shape, scale);
      continue;
    }
    std::vector<float> values = RandomTensorValues(preset.seed, spec);
    writer.Add(spec.name, preset.storage_dtype, std::move(spec.shape), std::move(values));
  }
  DXS_RETURN_IF_ERROR(writer.WriteDirectory(dir, preset.num_shards));
  std::ofstream cfg(dir + "/config.json");
  cfg << PresetConfigJson(preset) << "\n";
  if (!cfg.good()) return absl::InternalError(absl::StrCat("cannot write ", dir, "/config.json"));
  return WriteTokenizerFiles(c, dir);
}

absl::Status WriteInPlaceCheckpoint(const CheckpointPreset& preset, const std::string& dir) {
  DXS_RETURN_IF_ERROR(preset.config.Validate());
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) return absl::InternalError(absl::StrCat("cannot create ", dir, ": ", ec.message()));
  nlohmann::ordered_json recipe;
  recipe["format"] = "dxs in-place random weights";
  recipe["format_version"] = 1;
  recipe["preset"] = preset.name;
  recipe["seed"] = preset.seed;
  recipe["storage_dtype"] = std::string(DTypeName(preset.storage_dtype));
  recipe["router_skew"] = preset.router_skew;
  recipe["router_scales"] = preset.router_scales;
  if (preset.fp8) recipe["fp8"] = true;  // absent otherwise: older recipes stay byte-identical
  for (const auto& [name, text] :
       {std::pair<std::string, std::string>{"config.json", PresetConfigJson(preset)},
        std::pair<std::string, std::string>{kInPlaceWeightsFile, recipe.dump(2)}}) {
    std::ofstream out(dir + "/" + name);
    out << text << "\n";
    if (!out.good()) return absl::InternalError(absl::StrCat("cannot write ", dir, "/", name));
  }
  return WriteTokenizerFiles(preset.config, dir);
}

absl::StatusOr<CheckpointPreset> ReadInPlaceCheckpoint(const std::string& dir) {
  const std::string path = dir + "/" + kInPlaceWeightsFile;
  std::ifstream in(path);
  if (!in) return absl::NotFoundError(absl::StrCat(dir, ": no ", kInPlaceWeightsFile));
  const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  CheckpointPreset preset;
  try {
    const nlohmann::json recipe = nlohmann::json::parse(text);
    if (recipe.value("format", "") != "dxs in-place random weights" ||
        recipe.value("format_version", 0) != 1) {
      return absl::InvalidArgumentError(
          absl::StrCat(path, ": not a dxs in-place recipe of format_version 1"));
    }
    preset.name = recipe.at("preset").get<std::string>();
    preset.seed = recipe.at("seed").get<uint64_t>();
    DXS_ASSIGN_OR_RETURN(preset.storage_dtype,
                         ParseDType(recipe.at("storage_dtype").get<std::string>()));
    preset.router_skew = recipe.value("router_skew", 0.0);
    preset.router_scales = recipe.value("router_scales", std::vector<double>());
    preset.fp8 = recipe.value("fp8", false);
  } catch (const nlohmann::json::exception& e) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": ", e.what()));
  }
  DXS_ASSIGN_OR_RETURN(preset.config, LoadModelConfig(dir));
  if (!preset.router_scales.empty() &&
      static_cast<int64_t>(preset.router_scales.size()) != preset.config.num_experts) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": router_scales has ",
                                                   preset.router_scales.size(), " entries for ",
                                                   preset.config.num_experts, " experts"));
  }
  return preset;
}

namespace {

// CheckpointWeightSource over a checkpoint it owns.
class OwnedCheckpointSource final : public WeightSource {
 public:
  explicit OwnedCheckpointSource(std::unique_ptr<Checkpoint> ckpt)
      : ckpt_(std::move(ckpt)), source_(*ckpt_) {}
  absl::StatusOr<Tensor> Load(const std::string& name, std::vector<int64_t> shape,
                              Backend* backend) const override {
    return source_.Load(name, std::move(shape), backend);
  }
  absl::StatusOr<Tensor> LoadProjection(const std::string& name, std::vector<int64_t> shape,
                                        Backend* backend) const override {
    return source_.LoadProjection(name, std::move(shape), backend);
  }

 private:
  std::unique_ptr<Checkpoint> ckpt_;
  CheckpointWeightSource source_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<WeightSource>> OpenWeightSource(const std::string& dir) {
  absl::StatusOr<CheckpointPreset> in_place = ReadInPlaceCheckpoint(dir);
  if (in_place.ok()) return std::make_unique<RandomWeightSource>(*in_place);
  if (!absl::IsNotFound(in_place.status())) return in_place.status();
  DXS_ASSIGN_OR_RETURN(std::unique_ptr<Checkpoint> ckpt, Checkpoint::Open(dir));
  return std::make_unique<OwnedCheckpointSource>(std::move(ckpt));
}

absl::StatusOr<std::string> CheckpointFingerprint(const std::string& dir) {
  std::vector<std::string> names;
  std::error_code ec;
  for (const auto& entry : std::filesystem::directory_iterator(dir, ec)) {
    const std::string n = entry.path().filename().string();
    if (n == "config.json" || n == kInPlaceWeightsFile ||
        (n.size() > 12 &&
         (n.substr(n.size() - 12) == ".safetensors" || n.substr(n.size() - 11) == ".index.json"))) {
      names.push_back(n);
    }
  }
  if (ec) return absl::NotFoundError(absl::StrCat("cannot list ", dir, ": ", ec.message()));
  std::sort(names.begin(), names.end());
  uint64_t h = kFnvOffset;
  for (const std::string& n : names) {
    std::ifstream f(dir + "/" + n, std::ios::binary);
    std::string bytes((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
    h = Fnv1a(h, n.data(), n.size());
    h = Fnv1a(h, bytes.data(), bytes.size());
  }
  return absl::StrFormat("%016x", h);
}

}  // namespace dxs
