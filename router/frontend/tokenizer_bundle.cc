#include "router/frontend/tokenizer_bundle.h"

#include <zip.h>

#include <filesystem>
#include <fstream>
#include <memory>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "openssl/evp.h"

namespace dxs {
namespace {

absl::StatusOr<std::string> ReadFile(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat(path.string(), ": cannot be read"));
  std::ostringstream bytes;
  bytes << in.rdbuf();
  return bytes.str();
}

absl::StatusOr<std::string> Sha256Hex(const std::string& bytes) {
  unsigned char digest[EVP_MAX_MD_SIZE];
  unsigned int length = 0;
  if (EVP_Digest(bytes.data(), bytes.size(), digest, &length, EVP_sha256(), nullptr) != 1) {
    return absl::InternalError("SHA-256 failed");
  }
  static constexpr char kHex[] = "0123456789abcdef";
  std::string hex;
  for (unsigned int i = 0; i < length; ++i) {
    hex += kHex[digest[i] >> 4];
    hex += kHex[digest[i] & 15];
  }
  return hex;
}

absl::Status ZipError(const char* what, zip_error_t* error) {
  return absl::InternalError(
      absl::StrCat("tokenizer zip: ", what, ": ", zip_error_strerror(error)));
}

}  // namespace

absl::StatusOr<TokenizerBundle> MakeTokenizerBundle(const std::string& model_dir) {
  const std::filesystem::path dir(model_dir);
  std::vector<std::pair<std::string, std::string>> contents;
  bool has_tokenizer = false;
  for (const char* name : kTokenizerBundleFiles) {
    const std::filesystem::path path = dir / name;
    std::error_code ec;
    if (!std::filesystem::is_regular_file(path, ec)) continue;
    absl::StatusOr<std::string> bytes = ReadFile(path);
    if (!bytes.ok()) return bytes.status();
    const std::string file(name);
    if (file == "tokenizer.json" || file == "vocab.json" || file == "tokenizer.model") {
      has_tokenizer = true;
    }
    contents.emplace_back(file, *std::move(bytes));
  }
  if (!has_tokenizer) {
    return absl::NotFoundError(
        absl::StrCat(model_dir,
                     " has no tokenizer (tokenizer.json, vocab.json + merges.txt, or "
                     "tokenizer.model); `dxs gen-model` writes one beside the weights"));
  }

  // The archive is built in memory: a zip_source over an empty buffer that libzip grows.
  zip_error_t error;
  zip_error_init(&error);
  zip_source_t* buffer = zip_source_buffer_create(nullptr, 0, 0, &error);
  if (buffer == nullptr) return ZipError("buffer", &error);
  zip_t* archive = zip_open_from_source(buffer, ZIP_TRUNCATE, &error);
  if (archive == nullptr) {
    zip_source_free(buffer);
    return ZipError("open", &error);
  }
  // Keep the buffer alive after zip_close so the bytes can be read back.
  zip_source_keep(buffer);
  TokenizerBundle bundle;
  for (const auto& [name, bytes] : contents) {
    zip_source_t* file = zip_source_buffer(archive, bytes.data(), bytes.size(), 0);
    if (file == nullptr || zip_file_add(archive, name.c_str(), file, ZIP_FL_ENC_UTF_8) < 0) {
      if (file != nullptr) zip_source_free(file);
      absl::Status s = ZipError(name.c_str(), zip_get_error(archive));
      zip_discard(archive);
      zip_source_free(buffer);
      return s;
    }
    bundle.files.push_back(name);
  }
  if (zip_close(archive) < 0) {
    absl::Status s = ZipError("close", zip_get_error(archive));
    zip_discard(archive);
    zip_source_free(buffer);
    return s;
  }
  zip_stat_t stat;
  if (zip_source_stat(buffer, &stat) < 0 || zip_source_open(buffer) < 0) {
    absl::Status s = ZipError("read back", zip_source_error(buffer));
    zip_source_free(buffer);
    return s;
  }
  bundle.zip.resize(static_cast<size_t>(stat.size));
  const zip_int64_t read = zip_source_read(buffer, bundle.zip.data(), stat.size);
  zip_source_close(buffer);
  zip_source_free(buffer);
  if (read != static_cast<zip_int64_t>(stat.size)) {
    return absl::InternalError("tokenizer zip: short read of the archive");
  }
  absl::StatusOr<std::string> sha = Sha256Hex(bundle.zip);
  if (!sha.ok()) return sha.status();
  bundle.sha256 = *std::move(sha);
  return bundle;
}

}  // namespace dxs
