// Reading and writing Hugging Face safetensors checkpoints.
//
// Format: 8-byte little-endian header length N, N bytes of JSON
// {"name": {"dtype": "BF16", "shape": [..], "data_offsets": [begin, end]}, "__metadata__": {..}},
// then the data block; offsets are relative to the start of the data block.
//
// SafetensorsFile validates the whole header when it is opened: every error names the file
// and, where there is one, the tensor. Nothing read from a file can crash the reader.
// Checkpoint opens a directory holding either model.safetensors or a sharded set with
// model.safetensors.index.json ({"weight_map": {tensor: file}}).
//
// Block-scaled FP8 checkpoints (the DeepSeek-V3 / Qwen3-FP8 layout): config.json has
// "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme":
// "dynamic", "weight_block_size": [128, 128], "modules_to_not_convert": [..]}; each quantized
// weight W [out, in] is F8_E4M3 with an F32 (or BF16) tensor W_scale_inv of shape
// [ceil(out/128), ceil(in/128)], and its value is fp8(W) * scale_inv of its 128x128 block.
// Checkpoint::Open validates the config and every F8_E4M3 tensor's scale, and ReadFloat32
// dequantizes, so every reader of a checkpoint sees float weights.
//
// Thread safety: after Open, all const methods may be called concurrently.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "common/dtype.h"
#include "nlohmann/json_fwd.hpp"

namespace dxs {

struct TensorView {
  std::string name;
  DType dtype;
  std::vector<int64_t> shape;
  const uint8_t* data = nullptr;  // into the mapped file; valid while the file lives
  size_t num_bytes = 0;
  int64_t num_elements() const;
};

class SafetensorsFile {
 public:
  // Maps `path` read-only and validates it.
  static absl::StatusOr<std::unique_ptr<SafetensorsFile>> Open(const std::string& path);
  // Validates an in-memory image; `bytes` must outlive the result. `display_name` is used in
  // error messages. Used by Open and by the fuzzer.
  static absl::StatusOr<std::unique_ptr<SafetensorsFile>> FromBytes(std::string_view bytes,
                                                                    std::string display_name);
  ~SafetensorsFile();
  SafetensorsFile(const SafetensorsFile&) = delete;
  SafetensorsFile& operator=(const SafetensorsFile&) = delete;

  const std::string& path() const { return path_; }
  const std::map<std::string, TensorView>& tensors() const { return tensors_; }
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  // NOT_FOUND naming the file and the tensor when absent.
  absl::StatusOr<const TensorView*> Find(std::string_view name) const;

 private:
  SafetensorsFile() = default;
  std::string path_;
  void* mapping_ = nullptr;
  size_t mapping_bytes_ = 0;
  std::map<std::string, TensorView> tensors_;
  std::map<std::string, std::string> metadata_;
};

// The recipe file of an in-place checkpoint directory (config.json and this, no
// safetensors: model/random_checkpoint.h makes its weights on a device); it is part of
// the directory's fingerprint wherever one is taken.
inline constexpr char kInPlaceWeightsFile[] = "dxs_in_place_weights.json";

// config.json's "quantization_config" of a block-scaled FP8 checkpoint.
struct Fp8BlockQuantization {
  int64_t block_rows = 128, block_cols = 128;
  std::vector<std::string> modules_to_not_convert;
};
inline constexpr char kFp8ScaleSuffix[] = "_scale_inv";

// Parses the "quantization_config" value of config.json (`source` names the file in
// messages). INVALID_ARGUMENT naming the field for anything but fp8 / e4m3 / dynamic /
// [128, 128].
absl::StatusOr<Fp8BlockQuantization> ParseFp8Quantization(const nlohmann::json& quantization,
                                                          std::string_view source);

class Checkpoint {
 public:
  // `dir` holds model.safetensors, or model.safetensors.index.json and its shards, and
  // config.json where its weights are quantized (see above).
  static absl::StatusOr<std::unique_ptr<Checkpoint>> Open(const std::string& dir);

  // Set for a block-scaled FP8 checkpoint.
  const std::optional<Fp8BlockQuantization>& fp8() const { return fp8_; }
  // The dtype FP8 weights dequantize into before the backend's WeightDType: config.json's
  // torch_dtype (F32 when absent).
  DType dequantized_dtype() const { return dequantized_dtype_; }

  const std::string& dir() const { return dir_; }
  bool Has(std::string_view name) const;
  std::vector<std::string> TensorNames() const;
  absl::StatusOr<const TensorView*> Find(std::string_view name) const;
  // The file that holds `name` (for messages).
  std::string FileOf(std::string_view name) const;

  // `name` as stored, after checking its shape equals `expected_shape` (errors as below).
  absl::StatusOr<const TensorView*> FindWithShape(std::string_view name,
                                                  const std::vector<int64_t>& expected_shape) const;
  // Reads `name`, checks its shape equals `expected_shape` and widens it to float32 (an
  // F8_E4M3 weight times its block scales). Errors name the file and tensor: NOT_FOUND if
  // absent, INVALID_ARGUMENT on a wrong shape.
  absl::StatusOr<std::vector<float>> ReadFloat32(std::string_view name,
                                                 const std::vector<int64_t>& expected_shape) const;

 private:
  // Reads config.json's quantization_config and checks every F8_E4M3 tensor's scale.
  absl::Status LoadQuantization();
  std::string dir_;
  std::optional<Fp8BlockQuantization> fp8_;
  DType dequantized_dtype_ = DType::kF32;
  std::vector<std::unique_ptr<SafetensorsFile>> files_;
  std::map<std::string, const SafetensorsFile*, std::less<>> owner_;
};

// Accumulates tensors and writes them as safetensors: one file, or `num_shards` files named
// model-0000k-of-0000n.safetensors plus model.safetensors.index.json.
class SafetensorsWriter {
 public:
  // Stores `values` converted to `dtype`. Names must be unique.
  void Add(const std::string& name, DType dtype, std::vector<int64_t> shape,
           const std::vector<float>& values);
  absl::Status WriteDirectory(const std::string& dir, int num_shards = 1) const;

 private:
  struct Entry {
    std::string name;
    DType dtype;
    std::vector<int64_t> shape;
    std::vector<uint8_t> bytes;
  };
  // Writes entries_[first, last) as one safetensors file.
  absl::Status WriteShard(const std::string& path, size_t first, size_t last) const;
  std::vector<Entry> entries_;
  std::string error_;  // first misuse of Add (bad shape, duplicate name); WriteDirectory reports it
};

}  // namespace dxs
