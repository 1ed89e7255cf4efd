#include "common/safetensors.h"

#include <errno.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <limits>
#include <set>
#include <sstream>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "common/status_macros.h"
#include "nlohmann/json.hpp"

static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__,
              "safetensors data is little-endian; this reader assumes a little-endian host");

namespace dxs {
namespace {

using Json = nlohmann::json;

// The reference implementation (huggingface/safetensors) refuses headers above 100 MB.
constexpr uint64_t kMaxHeaderBytes = 100'000'000;
// index.json files are a few hundred KB even for the largest models.
constexpr uint64_t kMaxIndexBytes = 100'000'000;
constexpr char kSingleFile[] = "model.safetensors";
constexpr char kIndexFile[] = "model.safetensors.index.json";

// This absl is built with its own string_view (ABSL_OPTION_USE_STD_STRING_VIEW 0).
absl::string_view AsAbsl(std::string_view s) { return absl::string_view(s.data(), s.size()); }

// Names come from untrusted files: keep messages short and printable.
std::string Quote(std::string_view s) {
  constexpr size_t kMaxShown = 200;
  std::string shown = absl::Utf8SafeCHexEscape(AsAbsl(s.substr(0, kMaxShown)));
  if (s.size() > kMaxShown) absl::StrAppend(&shown, "...");
  return absl::StrCat("'", shown, "'");
}

std::string ShapeString(const std::vector<int64_t>& shape) {
  return absl::StrCat("[", absl::StrJoin(shape, ", "), "]");
}

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

absl::Status FileError(std::string_view file, std::string_view message) {
  return absl::InvalidArgumentError(absl::StrCat(AsAbsl(file), ": ", AsAbsl(message)));
}

absl::Status TensorError(std::string_view file, std::string_view tensor, std::string_view message) {
  return absl::InvalidArgumentError(
      absl::StrCat(AsAbsl(file), ": tensor ", Quote(tensor), ": ", AsAbsl(message)));
}

std::string JoinPath(const std::string& dir, const std::string& name) {
  if (dir.empty()) return name;
  if (dir.back() == '/') return dir + name;
  return dir + "/" + name;
}

bool IsRegularFile(const std::string& path) {
  struct stat st;
  return ::stat(path.c_str(), &st) == 0 && S_ISREG(st.st_mode);
}

absl::Status ErrnoError(int err, const std::string& path, std::string_view what) {
  std::string message = absl::StrCat(path, ": ", AsAbsl(what), ": ", std::strerror(err));
  switch (err) {
    case ENOENT:
    case ENOTDIR:
      return absl::NotFoundError(message);
    case EACCES:
    case EPERM:
      return absl::PermissionDeniedError(message);
    default:
      return absl::InternalError(message);
  }
}

absl::StatusOr<std::string> ReadSmallFile(const std::string& path, uint64_t max_bytes) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return ErrnoError(errno, path, "cannot open");
  in.seekg(0, std::ios::end);
  const std::streamoff size = in.tellg();
  if (size < 0) return absl::InternalError(absl::StrCat(path, ": cannot determine the size"));
  if (static_cast<uint64_t>(size) > max_bytes) {
    return FileError(path,
                     absl::StrCat("file is ", size, " bytes, more than the limit of ", max_bytes));
  }
  in.seekg(0, std::ios::beg);
  std::string data(static_cast<size_t>(size), '\0');
  if (size > 0 && !in.read(data.data(), size)) {
    return absl::InternalError(absl::StrCat(path, ": read failed"));
  }
  return data;
}

// Reads a non-negative JSON integer. Floats, negatives and out-of-range values are rejected.
bool GetUint64(const Json& j, uint64_t* out) {
  if (j.is_number_unsigned()) {
    *out = j.get<uint64_t>();
    return true;
  }
  if (j.is_number_integer()) {
    const int64_t v = j.get<int64_t>();
    if (v < 0) return false;
    *out = static_cast<uint64_t>(v);
    return true;
  }
  return false;
}

struct Span {
  uint64_t begin;
  uint64_t end;
  const std::string* name;
};

// Validates one header entry and fills `view` (data pointer left for the caller).
absl::Status ParseEntry(std::string_view file, const std::string& name, const Json& entry,
                        uint64_t data_bytes, TensorView* view, Span* span) {
  if (!entry.is_object()) {
    return TensorError(file, name,
                       absl::StrCat("entry must be a JSON object, got ", JsonForMessage(entry)));
  }
  view->name = name;

  auto dtype_it = entry.find("dtype");
  if (dtype_it == entry.end()) return TensorError(file, name, "missing 'dtype'");
  if (!dtype_it->is_string()) {
    return TensorError(file, name,
                       absl::StrCat("'dtype' must be a string, got ", JsonForMessage(*dtype_it)));
  }
  const std::string& dtype_name = dtype_it->get_ref<const std::string&>();
  absl::StatusOr<DType> dtype = ParseDType(dtype_name);
  if (!dtype.ok()) {
    return TensorError(file, name,
                       absl::StrCat("unsupported dtype ", Quote(dtype_name),
                                    " (supported: F32, F16, BF16, F8_E4M3)"));
  }
  view->dtype = *dtype;

  auto shape_it = entry.find("shape");
  if (shape_it == entry.end()) return TensorError(file, name, "missing 'shape'");
  if (!shape_it->is_array()) {
    return TensorError(file, name,
                       absl::StrCat("'shape' must be an array, got ", JsonForMessage(*shape_it)));
  }
  view->shape.clear();
  view->shape.reserve(shape_it->size());
  int64_t num_elements = 1;
  bool overflow = false;
  for (const Json& dim_json : *shape_it) {
    if (dim_json.is_number_integer() && !dim_json.is_number_unsigned() &&
        dim_json.get<int64_t>() < 0) {
      return TensorError(file, name,
                         absl::StrCat("negative dimension ", dim_json.get<int64_t>(),
                                      " in 'shape' ", JsonForMessage(*shape_it)));
    }
    uint64_t dim;
    if (!GetUint64(dim_json, &dim)) {
      return TensorError(
          file, name, absl::StrCat("'shape' must hold integers, got ", JsonForMessage(*shape_it)));
    }
    if (dim > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
      return TensorError(file, name, absl::StrCat("dimension ", dim, " in 'shape' is too large"));
    }
    view->shape.push_back(static_cast<int64_t>(dim));
    if (!overflow &&
        __builtin_mul_overflow(num_elements, static_cast<int64_t>(dim), &num_elements)) {
      overflow = true;
    }
  }
  uint64_t expected_bytes = 0;
  if (overflow ||
      __builtin_mul_overflow(static_cast<uint64_t>(num_elements),
                             static_cast<uint64_t>(DTypeSize(view->dtype)), &expected_bytes)) {
    return TensorError(file, name,
                       absl::StrCat("shape ", ShapeString(view->shape),
                                    " has too many elements (overflows 64 bits)"));
  }

  auto offsets_it = entry.find("data_offsets");
  if (offsets_it == entry.end()) return TensorError(file, name, "missing 'data_offsets'");
  uint64_t begin = 0, end = 0;
  if (!offsets_it->is_array() || offsets_it->size() != 2 || !GetUint64((*offsets_it)[0], &begin) ||
      !GetUint64((*offsets_it)[1], &end)) {
    return TensorError(file, name,
                       absl::StrCat("'data_offsets' must be two non-negative integers, got ",
                                    JsonForMessage(*offsets_it)));
  }
  const std::string offsets = absl::StrCat("data_offsets [", begin, ", ", end, "]");
  if (begin > end) return TensorError(file, name, absl::StrCat(offsets, " are not ascending"));
  if (end > data_bytes) {
    return TensorError(file, name,
                       absl::StrCat(offsets, " exceed data block of ", data_bytes, " bytes"));
  }
  if (end - begin != expected_bytes) {
    return TensorError(
        file, name,
        absl::StrCat(offsets, " hold ", end - begin, " bytes but shape ", ShapeString(view->shape),
                     " of ", AsAbsl(DTypeName(view->dtype)), " needs ", expected_bytes, " bytes"));
  }
  view->num_bytes = static_cast<size_t>(expected_bytes);
  span->begin = begin;
  span->end = end;
  return absl::OkStatus();
}

// Owns an mmap'ed region until released.
class Mapping {
 public:
  Mapping(void* address, size_t num_bytes) : address_(address), num_bytes_(num_bytes) {}
  ~Mapping() {
    if (address_ != nullptr) ::munmap(address_, num_bytes_);
  }
  Mapping(const Mapping&) = delete;
  Mapping& operator=(const Mapping&) = delete;
  void* release() { return std::exchange(address_, nullptr); }

 private:
  void* address_;
  size_t num_bytes_;
};

}  // namespace

int64_t TensorView::num_elements() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

SafetensorsFile::~SafetensorsFile() {
  if (mapping_ != nullptr) ::munmap(mapping_, mapping_bytes_);
}

absl::StatusOr<std::unique_ptr<SafetensorsFile>> SafetensorsFile::Open(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return ErrnoError(errno, path, "cannot open safetensors file");
  struct stat st;
  if (::fstat(fd, &st) != 0) {
    const int err = errno;
    ::close(fd);
    return ErrnoError(err, path, "cannot stat");
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd);
    return FileError(path, "not a regular file");
  }
  const uint64_t size = static_cast<uint64_t>(st.st_size);
  if (size < 8) {
    ::close(fd);
    return FileError(
        path, absl::StrCat("file is ", size, " bytes, shorter than the 8-byte header length"));
  }
  void* address = ::mmap(nullptr, size, PROT_READ, MAP_PRIVATE, fd, 0);
  const int mmap_errno = errno;
  ::close(fd);
  if (address == MAP_FAILED) return ErrnoError(mmap_errno, path, "mmap failed");
  Mapping mapping(address, size);
  DXS_ASSIGN_OR_RETURN(std::unique_ptr<SafetensorsFile> file,
                       FromBytes(std::string_view(static_cast<const char*>(address), size), path));
  file->mapping_ = mapping.release();
  file->mapping_bytes_ = size;
  return file;
}

absl::StatusOr<std::unique_ptr<SafetensorsFile>> SafetensorsFile::FromBytes(
    std::string_view bytes, std::string display_name) {
  std::unique_ptr<SafetensorsFile> result(new SafetensorsFile());
  result->path_ = std::move(display_name);
  const std::string& file = result->path_;
  if (bytes.size() < 8) {
    return FileError(file, absl::StrCat("file is ", bytes.size(),
                                        " bytes, shorter than the 8-byte header length"));
  }
  uint64_t header_bytes = 0;
  for (int i = 7; i >= 0; --i) {
    header_bytes = (header_bytes << 8) | static_cast<uint8_t>(bytes[i]);
  }
  if (header_bytes > kMaxHeaderBytes) {
    return FileError(file, absl::StrCat("header length ", header_bytes, " is absurd (limit ",
                                        kMaxHeaderBytes, " bytes)"));
  }
  if (header_bytes > bytes.size() - 8) {
    return FileError(file, absl::StrCat("header length ", header_bytes,
                                        " exceeds the file size of ", bytes.size(), " bytes"));
  }
  const std::string_view header_text = bytes.substr(8, header_bytes);
  const uint64_t data_bytes = bytes.size() - 8 - header_bytes;
  const auto* data = reinterpret_cast<const uint8_t*>(bytes.data()) + 8 + header_bytes;

  // nlohmann keeps the last of duplicate keys silently; a duplicated tensor name would hide
  // one of two definitions, so it is an error.
  std::string duplicate;
  std::set<std::string> top_level_keys;
  Json::parser_callback_t on_event = [&](int depth, Json::parse_event_t event, Json& parsed) {
    if (event == Json::parse_event_t::key && depth == 1 && duplicate.empty() &&
        parsed.is_string() && !top_level_keys.insert(parsed.get<std::string>()).second) {
      duplicate = parsed.get<std::string>();
    }
    return true;
  };
  Json header;
  try {
    header = Json::parse(header_text.begin(), header_text.end(), on_event);
  } catch (const Json::exception& e) {
    return FileError(file, absl::StrCat("header is not valid JSON: ", e.what()));
  }
  if (!header.is_object()) {
    return FileError(file,
                     absl::StrCat("header must be a JSON object, got ", JsonForMessage(header)));
  }
  if (!duplicate.empty()) {
    return TensorError(file, duplicate, "appears more than once in the header");
  }

  std::vector<Span> spans;
  spans.reserve(header.size());
  for (auto it = header.begin(); it != header.end(); ++it) {
    const std::string& key = it.key();
    const Json& value = it.value();
    if (key == "__metadata__") {
      if (value.is_null()) continue;
      if (!value.is_object()) {
        return FileError(file, absl::StrCat("'__metadata__' must be an object of strings, got ",
                                            JsonForMessage(value)));
      }
      for (auto m = value.begin(); m != value.end(); ++m) {
        if (!m.value().is_string()) {
          return FileError(
              file, absl::StrCat("'__metadata__' entry ", Quote(m.key()), " must be a string, got ",
                                 JsonForMessage(m.value())));
        }
        result->metadata_[m.key()] = m.value().get<std::string>();
      }
      continue;
    }
    TensorView view;
    Span span;
    DXS_RETURN_IF_ERROR(ParseEntry(file, key, value, data_bytes, &view, &span));
    view.data = data + span.begin;
    auto [inserted, unused] = result->tensors_.emplace(key, std::move(view));
    span.name = &inserted->first;
    spans.push_back(span);
  }

  // Tensors must tile the data block: no overlap, no holes (as the reference implementation
  // requires), so every byte belongs to exactly one tensor.
  std::sort(spans.begin(), spans.end(), [](const Span& a, const Span& b) {
    return a.begin != b.begin ? a.begin < b.begin : a.end < b.end;
  });
  uint64_t covered = 0;
  const Span* previous = nullptr;
  for (const Span& span : spans) {
    if (span.begin < covered) {
      return TensorError(
          file, *span.name,
          absl::StrCat("data_offsets [", span.begin, ", ", span.end, "] overlap tensor ",
                       Quote(*previous->name), " at [", previous->begin, ", ", previous->end, "]"));
    }
    if (span.begin > covered) {
      return TensorError(
          file, *span.name,
          absl::StrCat("data_offsets [", span.begin, ", ", span.end, "] leave data bytes [",
                       covered, ", ", span.begin, ") unused (holes are not allowed)"));
    }
    covered = span.end;
    previous = &span;
  }
  if (covered != data_bytes) {
    return FileError(file, absl::StrCat("data block has ", data_bytes, " bytes but tensors cover ",
                                        covered, " (trailing bytes are not allowed)"));
  }
  return result;
}

absl::StatusOr<const TensorView*> SafetensorsFile::Find(std::string_view name) const {
  auto it = tensors_.find(std::string(name));
  if (it == tensors_.end()) {
    return absl::NotFoundError(absl::StrCat(path_, ": tensor ", Quote(name), " not found"));
  }
  return &it->second;
}

// ---------------------------------------------------------------------------------------------
// Checkpoint

absl::StatusOr<std::unique_ptr<Checkpoint>> Checkpoint::Open(const std::string& dir) {
  struct stat st;
  if (::stat(dir.c_str(), &st) != 0) return ErrnoError(errno, dir, "cannot open checkpoint");
  if (!S_ISDIR(st.st_mode)) {
    return FileError(dir, "checkpoint path is not a directory");
  }
  auto checkpoint = std::unique_ptr<Checkpoint>(new Checkpoint());
  checkpoint->dir_ = dir;

  const std::string single = JoinPath(dir, kSingleFile);
  const std::string index_path = JoinPath(dir, kIndexFile);
  // Same preference as transformers: the single file wins when both exist.
  if (IsRegularFile(single)) {
    DXS_ASSIGN_OR_RETURN(std::unique_ptr<SafetensorsFile> file, SafetensorsFile::Open(single));
    for (const auto& [name, view] : file->tensors()) checkpoint->owner_[name] = file.get();
    checkpoint->files_.push_back(std::move(file));
    DXS_RETURN_IF_ERROR(checkpoint->LoadQuantization());
    return checkpoint;
  }
  if (!IsRegularFile(index_path)) {
    return absl::NotFoundError(absl::StrCat(dir, ": no checkpoint: neither ", kSingleFile, " nor ",
                                            kIndexFile, " exists"));
  }

  DXS_ASSIGN_OR_RETURN(std::string index_text, ReadSmallFile(index_path, kMaxIndexBytes));
  Json index;
  try {
    index = Json::parse(index_text);
  } catch (const Json::exception& e) {
    return FileError(index_path, absl::StrCat("not valid JSON: ", e.what()));
  }
  if (!index.is_object()) return FileError(index_path, "must be a JSON object");
  auto map_it = index.find("weight_map");
  if (map_it == index.end()) return FileError(index_path, "missing 'weight_map'");
  if (!map_it->is_object()) {
    return FileError(index_path,
                     absl::StrCat("'weight_map' must be an object, got ", JsonForMessage(*map_it)));
  }

  std::map<std::string, SafetensorsFile*> shards;
  for (auto it = map_it->begin(); it != map_it->end(); ++it) {
    const std::string& tensor = it.key();
    if (!it.value().is_string()) {
      return TensorError(
          index_path, tensor,
          absl::StrCat("weight_map value must be a file name, got ", JsonForMessage(it.value())));
    }
    const std::string& shard_name = it.value().get_ref<const std::string&>();
    if (shard_name.empty() || shard_name.front() == '/' || shard_name == ".." ||
        shard_name.rfind("../", 0) == 0 || shard_name.find("/../") != std::string::npos ||
        (shard_name.size() >= 3 && shard_name.compare(shard_name.size() - 3, 3, "/..") == 0)) {
      return TensorError(index_path, tensor,
                         absl::StrCat("shard ", Quote(shard_name),
                                      " must be a relative path inside the checkpoint directory"));
    }
    auto shard_it = shards.find(shard_name);
    if (shard_it == shards.end()) {
      const std::string shard_path = JoinPath(dir, shard_name);
      if (!IsRegularFile(shard_path)) {
        return absl::NotFoundError(absl::StrCat(index_path, ": tensor ", Quote(tensor), ": shard ",
                                                Quote(shard_name), " does not exist (", shard_path,
                                                ")"));
      }
      DXS_ASSIGN_OR_RETURN(std::unique_ptr<SafetensorsFile> file,
                           SafetensorsFile::Open(shard_path));
      shard_it = shards.emplace(shard_name, file.get()).first;
      checkpoint->files_.push_back(std::move(file));
    }
    if (shard_it->second->tensors().count(tensor) == 0) {
      return TensorError(index_path, tensor,
                         absl::StrCat("listed in shard ", Quote(shard_name), " but ",
                                      shard_it->second->path(), " does not contain it"));
    }
    checkpoint->owner_[tensor] = shard_it->second;
  }
  DXS_RETURN_IF_ERROR(checkpoint->LoadQuantization());
  return checkpoint;
}

absl::StatusOr<Fp8BlockQuantization> ParseFp8Quantization(const Json& q, std::string_view source) {
  auto field_error = [&](std::string_view field, std::string_view message) {
    return absl::InvalidArgumentError(absl::StrCat(AsAbsl(source), ": quantization_config.",
                                                   AsAbsl(field), ": ", AsAbsl(message)));
  };
  if (!q.is_object()) {
    return absl::InvalidArgumentError(absl::StrCat(
        AsAbsl(source), ": quantization_config must be an object, got ", JsonForMessage(q)));
  }
  auto string_field = [&](const char* field, const char* fallback, const char* supported,
                          std::string* out) -> absl::Status {
    auto it = q.find(field);
    if (it == q.end() || it->is_null()) {
      if (fallback == nullptr) return field_error(field, "missing");
      *out = fallback;
    } else if (!it->is_string()) {
      return field_error(field, absl::StrCat("must be a string, got ", JsonForMessage(*it)));
    } else {
      *out = it->get<std::string>();
    }
    if (*out != supported) {
      return field_error(
          field, absl::StrCat(Quote(*out), " is not supported (supported: \"", supported, "\")"));
    }
    return absl::OkStatus();
  };
  std::string value;
  DXS_RETURN_IF_ERROR(string_field("quant_method", nullptr, "fp8", &value));
  // Qwen's FP8 configs leave fmt out; DeepSeek-V3's say "e4m3".
  DXS_RETURN_IF_ERROR(string_field("fmt", "e4m3", "e4m3", &value));
  DXS_RETURN_IF_ERROR(string_field("activation_scheme", "dynamic", "dynamic", &value));
  Fp8BlockQuantization result;
  auto block = q.find("weight_block_size");
  if (block == q.end() || block->is_null()) {
    return field_error("weight_block_size",
                       "missing (only block-scaled FP8 with [128, 128] blocks is supported)");
  }
  if (!block->is_array() || block->size() != 2 || !(*block)[0].is_number_integer() ||
      !(*block)[1].is_number_integer() || (*block)[0].get<int64_t>() != 128 ||
      (*block)[1].get<int64_t>() != 128) {
    return field_error(
        "weight_block_size",
        absl::StrCat(JsonForMessage(*block), " is not supported (supported: [128, 128])"));
  }
  auto skip = q.find("modules_to_not_convert");
  if (skip != q.end() && !skip->is_null()) {
    if (!skip->is_array()) {
      return field_error("modules_to_not_convert",
                         absl::StrCat("must be an array of strings, got ", JsonForMessage(*skip)));
    }
    for (const Json& m : *skip) {
      if (!m.is_string()) {
        return field_error("modules_to_not_convert",
                           absl::StrCat("must hold strings, got ", JsonForMessage(m)));
      }
      result.modules_to_not_convert.push_back(m.get<std::string>());
    }
  }
  return result;
}

absl::Status Checkpoint::LoadQuantization() {
  const std::string config_path = JoinPath(dir_, "config.json");
  if (IsRegularFile(config_path)) {
    DXS_ASSIGN_OR_RETURN(std::string text, ReadSmallFile(config_path, kMaxIndexBytes));
    Json config;
    try {
      config = Json::parse(text);
    } catch (const Json::exception& e) {
      return FileError(config_path, absl::StrCat("not valid JSON: ", e.what()));
    }
    if (config.is_object()) {
      auto q = config.find("quantization_config");
      if (q != config.end() && !q->is_null()) {
        DXS_ASSIGN_OR_RETURN(Fp8BlockQuantization fp8, ParseFp8Quantization(*q, config_path));
        fp8_ = std::move(fp8);
      }
      for (const char* key : {"torch_dtype", "dtype"}) {
        auto it = config.find(key);
        if (it == config.end() || !it->is_string()) continue;
        const std::string& name = it->get_ref<const std::string&>();
        if (name == "bfloat16") dequantized_dtype_ = DType::kBF16;
        if (name == "float16") dequantized_dtype_ = DType::kF16;
        break;
      }
    }
  }
  for (const auto& [name, file] : owner_) {
    const TensorView& view = file->tensors().at(name);
    if (view.dtype != DType::kF8E4M3) continue;
    const std::string& path = file->path();
    if (!fp8_.has_value()) {
      return TensorError(path, name, "is F8_E4M3 but config.json has no fp8 quantization_config");
    }
    if (view.shape.size() != 2) {
      return TensorError(
          path, name,
          absl::StrCat("an F8_E4M3 weight must be 2-D, got shape ", ShapeString(view.shape)));
    }
    const std::string scale_name = name + kFp8ScaleSuffix;
    auto scale_it = owner_.find(scale_name);
    if (scale_it == owner_.end()) {
      return TensorError(path, name,
                         absl::StrCat("F8_E4M3 weight has no scale tensor ", Quote(scale_name)));
    }
    const TensorView& scale = scale_it->second->tensors().at(scale_name);
    const std::vector<int64_t> want = {(view.shape[0] + fp8_->block_rows - 1) / fp8_->block_rows,
                                       (view.shape[1] + fp8_->block_cols - 1) / fp8_->block_cols};
    if (scale.dtype != DType::kF32 && scale.dtype != DType::kBF16) {
      return TensorError(scale_it->second->path(), scale_name,
                         absl::StrCat("scale of F8_E4M3 weight ", Quote(name), " is ",
                                      AsAbsl(DTypeName(scale.dtype)), ", expected F32 (or BF16)"));
    }
    if (scale.shape != want) {
      return TensorError(
          scale_it->second->path(), scale_name,
          absl::StrCat("scale shape ", ShapeString(scale.shape), " does not match ",
                       ShapeString(want), " (one per ", fp8_->block_rows, "x", fp8_->block_cols,
                       " block of ", Quote(name), " ", ShapeString(view.shape), ")"));
    }
  }
  return absl::OkStatus();
}

bool Checkpoint::Has(std::string_view name) const { return owner_.find(name) != owner_.end(); }

std::vector<std::string> Checkpoint::TensorNames() const {
  std::vector<std::string> names;
  names.reserve(owner_.size());
  for (const auto& [name, file] : owner_) names.push_back(name);
  return names;
}

absl::StatusOr<const TensorView*> Checkpoint::Find(std::string_view name) const {
  auto it = owner_.find(name);
  if (it == owner_.end()) {
    return absl::NotFoundError(
        absl::StrCat(dir_, ": tensor ", Quote(name), " not found in the checkpoint"));
  }
  return it->second->Find(name);
}

std::string Checkpoint::FileOf(std::string_view name) const {
  auto it = owner_.find(name);
  return it == owner_.end() ? std::string() : it->second->path();
}

absl::StatusOr<const TensorView*> Checkpoint::FindWithShape(
    std::string_view name, const std::vector<int64_t>& expected_shape) const {
  DXS_ASSIGN_OR_RETURN(const TensorView* view, Find(name));
  if (view->shape != expected_shape) {
    return TensorError(FileOf(name), name,
                       absl::StrCat("shape ", ShapeString(view->shape),
                                    " does not match the expected ", ShapeString(expected_shape)));
  }
  return view;
}

absl::StatusOr<std::vector<float>> Checkpoint::ReadFloat32(
    std::string_view name, const std::vector<int64_t>& expected_shape) const {
  DXS_ASSIGN_OR_RETURN(const TensorView* view, FindWithShape(name, expected_shape));
  std::vector<float> out(view->num_bytes / DTypeSize(view->dtype));
  WidenToFloat32(view->dtype, view->data, out.size(), out.data());
  if (view->dtype == DType::kF8E4M3) {
    // Open checked the scale: fp8 config present, 2-D, [ceil(rows/br), ceil(cols/bc)].
    const std::string scale_name = absl::StrCat(AsAbsl(name), kFp8ScaleSuffix);
    DXS_ASSIGN_OR_RETURN(const TensorView* scale_view, Find(scale_name));
    std::vector<float> scale(static_cast<size_t>(scale_view->num_elements()));
    WidenToFloat32(scale_view->dtype, scale_view->data, scale.size(), scale.data());
    const int64_t rows = view->shape[0], cols = view->shape[1];
    const int64_t br = fp8_->block_rows, bc = fp8_->block_cols;
    const int64_t scale_cols = scale_view->shape[1];
    for (int64_t r = 0; r < rows; ++r) {
      const float* scale_row = scale.data() + (r / br) * scale_cols;
      float* row = out.data() + r * cols;
      for (int64_t c = 0; c < cols; ++c) row[c] *= scale_row[c / bc];
    }
  }
  return out;
}

// ---------------------------------------------------------------------------------------------
// SafetensorsWriter

void SafetensorsWriter::Add(const std::string& name, DType dtype, std::vector<int64_t> shape,
                            const std::vector<float>& values) {
  Entry entry;
  entry.name = name;
  entry.dtype = dtype;
  entry.shape = std::move(shape);
  int64_t num_elements = 1;
  bool bad_shape = false;
  for (int64_t d : entry.shape) {
    if (d < 0 || __builtin_mul_overflow(num_elements, d, &num_elements)) bad_shape = true;
  }
  if (bad_shape || static_cast<uint64_t>(num_elements) != values.size()) {
    if (error_.empty()) {
      error_ = absl::StrCat("tensor ", Quote(name), ": shape ", ShapeString(entry.shape),
                            " does not match ", values.size(), " values");
    }
    return;
  }
  for (const Entry& e : entries_) {
    if (e.name == name) {
      if (error_.empty()) error_ = absl::StrCat("tensor ", Quote(name), " added twice");
      return;
    }
  }
  if (name == "__metadata__") {
    if (error_.empty()) error_ = "'__metadata__' is reserved and cannot name a tensor";
    return;
  }
  entry.bytes.resize(values.size() * DTypeSize(dtype));
  NarrowFromFloat32(dtype, values.data(), values.size(), entry.bytes.data());
  entries_.push_back(std::move(entry));
}

namespace {

absl::Status WriteFileAtomically(const std::string& path,
                                 const std::vector<std::string_view>& pieces) {
  const std::string tmp = path + ".tmp";
  FILE* f = std::fopen(tmp.c_str(), "wb");
  if (f == nullptr) return ErrnoError(errno, tmp, "cannot create");
  bool ok = true;
  for (std::string_view piece : pieces) {
    if (!piece.empty() && std::fwrite(piece.data(), 1, piece.size(), f) != piece.size()) {
      ok = false;
      break;
    }
  }
  const int write_errno = errno;
  if (std::fclose(f) != 0) ok = false;
  if (!ok) {
    std::remove(tmp.c_str());
    return ErrnoError(write_errno, tmp, "write failed");
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    const int err = errno;
    std::remove(tmp.c_str());
    return ErrnoError(err, path, "rename failed");
  }
  return absl::OkStatus();
}

std::string ShardName(int k, int n) {
  return absl::StrFormat("model-%05d-of-%05d.safetensors", k, n);
}

}  // namespace

absl::Status SafetensorsWriter::WriteShard(const std::string& path, size_t first,
                                           size_t last) const {
  Json header = Json::object();
  header["__metadata__"] = {{"format", "pt"}};
  uint64_t offset = 0;
  for (size_t i = first; i < last; ++i) {
    const Entry& e = entries_[i];
    header[e.name] = {{"dtype", std::string(DTypeName(e.dtype))},
                      {"shape", e.shape},
                      {"data_offsets", {offset, offset + e.bytes.size()}}};
    offset += e.bytes.size();
  }
  std::string text = header.dump();
  // Pad with spaces so the data block starts 8-byte aligned, as the reference writer does.
  text.append((8 - text.size() % 8) % 8, ' ');
  char length[8];
  uint64_t n = text.size();
  for (int i = 0; i < 8; ++i) length[i] = static_cast<char>((n >> (8 * i)) & 0xff);
  std::vector<std::string_view> pieces;
  pieces.emplace_back(length, sizeof(length));
  pieces.emplace_back(text);
  for (size_t i = first; i < last; ++i) {
    pieces.emplace_back(reinterpret_cast<const char*>(entries_[i].bytes.data()),
                        entries_[i].bytes.size());
  }
  return WriteFileAtomically(path, pieces);
}

absl::Status SafetensorsWriter::WriteDirectory(const std::string& dir, int num_shards) const {
  if (!error_.empty()) return absl::InvalidArgumentError(absl::StrCat(dir, ": ", error_));
  if (num_shards < 1 || num_shards > 99999) {
    return absl::InvalidArgumentError(
        absl::StrCat(dir, ": num_shards must be in [1, 99999], got ", num_shards));
  }
  if (num_shards > 1 && static_cast<size_t>(num_shards) > entries_.size()) {
    return absl::InvalidArgumentError(absl::StrCat(dir, ": cannot split ", entries_.size(),
                                                   " tensors into ", num_shards, " shards"));
  }
  if (::mkdir(dir.c_str(), 0755) != 0 && errno != EEXIST) {
    return ErrnoError(errno, dir, "cannot create directory");
  }
  const std::string single = JoinPath(dir, kSingleFile);
  const std::string index_path = JoinPath(dir, kIndexFile);
  if (num_shards == 1) {
    DXS_RETURN_IF_ERROR(WriteShard(single, 0, entries_.size()));
    // A stale index would describe other files; the single file is now the checkpoint.
    std::remove(index_path.c_str());
    return absl::OkStatus();
  }

  // Contiguous split in insertion order, balanced by bytes: a tensor goes to the shard that
  // holds its midpoint, but shards are never skipped and each one gets at least one tensor.
  uint64_t total_bytes = 0;
  for (const Entry& e : entries_) total_bytes += e.bytes.size();
  const size_t num_entries = entries_.size();
  const size_t shards = static_cast<size_t>(num_shards);
  std::vector<size_t> shard_of(num_entries);
  uint64_t before = 0;
  for (size_t i = 0; i < num_entries; ++i) {
    size_t desired;
    if (total_bytes == 0) {
      desired = i * shards / num_entries;
    } else {
      const long double mid = static_cast<long double>(before) + entries_[i].bytes.size() / 2.0L;
      desired = static_cast<size_t>(mid * shards / static_cast<long double>(total_bytes));
    }
    const size_t previous = i == 0 ? 0 : shard_of[i - 1];
    const size_t lowest = std::max(previous, shards - std::min(shards, num_entries - i));
    const size_t highest = i == 0 ? 0 : std::min(previous + 1, shards - 1);
    shard_of[i] = std::min(std::max(desired, lowest), highest);
    before += entries_[i].bytes.size();
  }

  Json weight_map = Json::object();
  size_t first = 0;
  for (size_t s = 0; s < shards; ++s) {
    size_t last = first;
    while (last < num_entries && shard_of[last] == s) ++last;
    const std::string name = ShardName(static_cast<int>(s + 1), num_shards);
    DXS_RETURN_IF_ERROR(WriteShard(JoinPath(dir, name), first, last));
    for (size_t i = first; i < last; ++i) weight_map[entries_[i].name] = name;
    first = last;
  }
  Json index = {{"metadata", {{"total_size", total_bytes}}}, {"weight_map", weight_map}};
  const std::string index_text = index.dump(2) + "\n";
  DXS_RETURN_IF_ERROR(WriteFileAtomically(index_path, {index_text}));
  // A stale single file would win over the index when the directory is opened.
  std::remove(single.c_str());
  return absl::OkStatus();
}

}  // namespace dxs
