#include "router/control_plane/model_identity.h"

#include <algorithm>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <system_error>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/safetensors.h"  // kInPlaceWeightsFile

namespace dxs {
namespace {

constexpr uint64_t kFnvOffsetBasis = 0xcbf29ce484222325ULL;
constexpr uint64_t kFnvPrime = 0x100000001b3ULL;
// Larger safetensors headers are refused: real ones are a few MiB at most.
constexpr uint64_t kMaxHeaderBytes = uint64_t{256} << 20;

class Fnv1a64 {
 public:
  void Add(const void* data, size_t num_bytes) {
    const auto* p = static_cast<const unsigned char*>(data);
    for (size_t i = 0; i < num_bytes; ++i) {
      hash_ = (hash_ ^ p[i]) * kFnvPrime;
    }
  }
  // The 8-byte little-endian length, then the bytes.
  void AddField(const std::string& bytes) {
    AddUint64(bytes.size());
    Add(bytes.data(), bytes.size());
  }
  void AddUint64(uint64_t v) {
    unsigned char le[8];
    for (int i = 0; i < 8; ++i) le[i] = static_cast<unsigned char>(v >> (8 * i));
    Add(le, sizeof(le));
  }
  std::string Hex() const { return absl::StrFormat("%016x", hash_); }

 private:
  uint64_t hash_ = kFnvOffsetBasis;
};

absl::StatusOr<std::string> ReadWholeFile(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot read ", path.string()));
  std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  if (in.bad()) return absl::NotFoundError(absl::StrCat("cannot read ", path.string()));
  return bytes;
}

// The 8-byte length prefix and the JSON header of a safetensors file.
absl::StatusOr<std::string> ReadSafetensorsHeader(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot read ", path.string()));
  unsigned char le[8];
  if (!in.read(reinterpret_cast<char*>(le), sizeof(le))) {
    return absl::InvalidArgumentError(
        absl::StrCat(path.string(), ": too short for a safetensors header"));
  }
  uint64_t header_bytes = 0;
  for (int i = 0; i < 8; ++i) header_bytes |= uint64_t{le[i]} << (8 * i);
  std::error_code ec;
  const uint64_t file_bytes = std::filesystem::file_size(path, ec);
  if (ec || header_bytes > kMaxHeaderBytes || header_bytes > file_bytes - sizeof(le)) {
    return absl::InvalidArgumentError(absl::StrCat(path.string(), ": safetensors header length ",
                                                   header_bytes, " does not fit the file"));
  }
  std::string out(reinterpret_cast<const char*>(le), sizeof(le));
  out.resize(sizeof(le) + header_bytes);
  if (!in.read(out.data() + sizeof(le), static_cast<std::streamsize>(header_bytes))) {
    return absl::InvalidArgumentError(
        absl::StrCat(path.string(), ": safetensors header is truncated"));
  }
  return out;
}

}  // namespace

absl::StatusOr<v1::ModelFingerprint> ModelIdentity(const std::string& dir) {
  const std::filesystem::path root(dir);
  absl::StatusOr<std::string> config = ReadWholeFile(root / "config.json");
  if (!config.ok()) return config.status();

  std::vector<std::string> shards;
  std::error_code ec;
  for (const auto& entry : std::filesystem::directory_iterator(root, ec)) {
    const std::string name = entry.path().filename().string();
    constexpr std::string_view kSuffix = ".safetensors";
    if (name.size() > kSuffix.size() &&
        name.compare(name.size() - kSuffix.size(), kSuffix.size(), kSuffix) == 0) {
      shards.push_back(name);
    }
  }
  if (ec) return absl::NotFoundError(absl::StrCat("cannot list ", dir, ": ", ec.message()));
  std::sort(shards.begin(), shards.end());

  Fnv1a64 config_hash;
  config_hash.AddField(*config);

  Fnv1a64 checkpoint_hash;
  checkpoint_hash.AddField("config.json");
  checkpoint_hash.AddField(*config);
  // An in-place checkpoint's recipe (common/safetensors.h: kInPlaceWeightsFile) is
  // its weights: every value follows from it.
  if (absl::StatusOr<std::string> recipe = ReadWholeFile(root / kInPlaceWeightsFile); recipe.ok()) {
    checkpoint_hash.AddField(kInPlaceWeightsFile);
    checkpoint_hash.AddField(*recipe);
  }
  for (const std::string& name : shards) {
    absl::StatusOr<std::string> header = ReadSafetensorsHeader(root / name);
    if (!header.ok()) return header.status();
    checkpoint_hash.AddField(name);
    checkpoint_hash.AddField(*header);
  }

  v1::ModelFingerprint fingerprint;
  fingerprint.set_checkpoint_fingerprint(checkpoint_hash.Hex());
  fingerprint.set_config_fingerprint(config_hash.Hex());
  return fingerprint;
}

}  // namespace dxs
