// Seeded random Qwen3-MoE checkpoints in Hugging Face format (config.json + safetensors).
//
// Every tensor is drawn from its own stream, seeded by (seed, tensor name), so the values
// do not depend on write order or sharding, and are identical on every machine. Scales are
// chosen so the model is not degenerate: activations stay O(1) through the layers, the
// router spreads tokens over the experts, and greedy decoding does not repeat one token.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "common/dtype.h"
#include "common/model_config.h"
#include "common/safetensors.h"
#include "model/weights.h"

namespace dxs {

struct CheckpointPreset {
  std::string name;
  ModelConfig config;
  DType storage_dtype = DType::kF32;
  int num_shards = 1;
  uint64_t seed = 0;
  // Zipf exponent of expert popularity (model/router_skew.h; dxs gen-model --router-skew):
  // each MoE layer's gate rows are normalised to their mean norm and scaled by
  // ZipfRouterScales. 0: the gate as drawn, bit for bit.
  double router_skew = 0;
  // Per-expert gate-row scales for router_skew, as CalibrateRouterSkew measured them
  // (model/router_skew.h); empty: ZipfRouterScales's simulated ones.
  std::vector<double> router_scales;
  // Block-scaled FP8 (dxs gen-model --fp8): the linear weights of attention, experts and
  // dense MLPs (IsFp8QuantizedTensor) stored as the official Qwen3-FP8 checkpoints store
  // them (QuantizeFp8Blocks), config.json's quantization_config listing the rest.
  bool fp8 = false;
};

// The tensors --fp8 quantizes: every "*_proj.weight" (q/k/v/o, and gate/up/down of the
// experts and dense MLPs). Embeddings, norms, the router gate and lm_head stay as they are.
bool IsFp8QuantizedTensor(const std::string& name);
// Quantizes the [rows, cols] weight `w` as the official FP8 checkpoints are: per 128x128
// block, scale = amax / 448 (1 for an all-zero block) and q = e4m3 round-to-nearest-even of
// w / scale, clamped to +-448. `q` gets the e4m3 values (as floats, exactly representable),
// `scale` the [ceil(rows/128), ceil(cols/128)] weight_scale_inv.
void QuantizeFp8Blocks(const std::vector<float>& w, int64_t rows, int64_t cols,
                       std::vector<float>* q, std::vector<float>* scale);
// config.json of a preset: ModelConfig::ToJson plus, with fp8, the quantization_config.
std::string PresetConfigJson(const CheckpointPreset& preset);

// "default" (the embedded model), "odd" (GQA 3, top-3 of 12 experts, a dense layer,
// untied head), "bf16-sharded" (bf16, 3 shards, norm_topk_prob false, tied head), and
// "qwen3-30b-a3b" (full-size shape, for GPU benchmarks only).
std::vector<std::string> PresetNames();
absl::StatusOr<CheckpointPreset> GetPreset(const std::string& name);

// Writes config.json, the safetensors and the tokenizer files (model/tokenizer_files.h).
absl::Status WriteRandomCheckpoint(const CheckpointPreset& preset, const std::string& dir);

// Every tensor of a preset: values uniform with standard deviation `stddev` around `mean`
// (mean +- stddev * sqrt(3)), drawn from SplitMix64 seeded with RandomTensorSeed.
// With row_scale (the gates of a skewed preset), each row r of the [rows, cols] tensor is
// then rescaled to the rows' mean norm times row_scale[r] (RandomTensorValues).
struct RandomTensorSpec {
  std::string name;
  std::vector<int64_t> shape;
  double stddev = 0;
  double mean = 0;
  std::vector<double> row_scale;  // empty: none
};
std::vector<RandomTensorSpec> RandomTensorSpecs(const CheckpointPreset& preset);
uint64_t RandomTensorSeed(uint64_t seed, const std::string& name);
// A spec's values in float32, as WriteRandomCheckpoint stores them (before rounding to the
// storage dtype).
std::vector<float> RandomTensorValues(uint64_t seed, const RandomTensorSpec& spec);

// The preset's checkpoint made in place on the backend (Backend::FillUniform), with the
// very values WriteRandomCheckpoint would store: nothing is written to disk, so a
// full-size shape (qwen3-30b-a3b: about 61 GB in bf16) can be benchmarked on a GPU.
class RandomWeightSource final : public WeightSource {
 public:
  explicit RandomWeightSource(const CheckpointPreset& preset);
  absl::StatusOr<Tensor> Load(const std::string& name, std::vector<int64_t> shape,
                              Backend* backend) const override;
  // A --fp8 preset's projection quantized on the host as WriteRandomCheckpoint would store it,
  // kept FP8 where KeepsFp8Weight allows (model/weights.h).
  absl::StatusOr<Tensor> LoadProjection(const std::string& name, std::vector<int64_t> shape,
                                        Backend* backend) const override;

 private:
  CheckpointPreset preset_;
  std::map<std::string, RandomTensorSpec> specs_;
};

// An in-place checkpoint directory: config.json, kInPlaceWeightsFile (the preset's
// name, seed, storage dtype and router skew) and the tokenizer files, no safetensors. Every process
// that opens it (OpenWeightSource: dxs run, dxs-attention, dxs-expert, EPLB's reloads) makes the
// very weights WriteRandomCheckpoint would have written, on its own device, so a cluster of the
// full Qwen3-30B-A3B shape (61 GB in bf16) runs on a machine whose disk cannot hold it. The
// fingerprint covers the recipe file (common/safetensors.h: kInPlaceWeightsFile), so every rank
// agrees on the model.
absl::Status WriteInPlaceCheckpoint(const CheckpointPreset& preset, const std::string& dir);
// The preset an in-place directory describes; NOT_FOUND if `dir` has no kInPlaceWeightsFile
// (a checkpoint of safetensors), INVALID_ARGUMENT if it does not parse.
absl::StatusOr<CheckpointPreset> ReadInPlaceCheckpoint(const std::string& dir);

// The weights of the model in `dir`: its safetensors checkpoint, or the in-place recipe.
absl::StatusOr<std::unique_ptr<WeightSource>> OpenWeightSource(const std::string& dir);

// FNV-1a 64 over the sorted names and contents of config.json, the in-place recipe and the
// *.safetensors / index files in `dir`, as 16 hex digits (not the tokenizer files). Ties reference
// outputs to the exact checkpoint.
absl::StatusOr<std::string> CheckpointFingerprint(const std::string& dir);

}  // namespace dxs
