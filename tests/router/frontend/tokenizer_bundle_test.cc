// MakeTokenizerBundle: the zip holds exactly the model directory's known tokenizer files, at
// its root, byte for byte; the SHA-256 is the archive's; a directory without a tokenizer is
// NOT_FOUND naming it. The archive is read back with libzip, the hash recomputed with OpenSSL.
#include "router/frontend/tokenizer_bundle.h"

#include <unistd.h>
#include <zip.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "openssl/evp.h"

namespace dxs {
namespace {

namespace fs = std::filesystem;

class TempDir {
 public:
  TempDir() {
    std::string pattern = (fs::temp_directory_path() / "dxs-tokenizer-bundle-XXXXXX").string();
    char* made = mkdtemp(pattern.data());
    EXPECT_NE(made, nullptr);
    path_ = pattern;
  }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path_, ec);
  }
  const fs::path& path() const { return path_; }
  void Write(const std::string& name, const std::string& bytes) const {
    std::ofstream out(path_ / name, std::ios::binary);
    out << bytes;
    ASSERT_TRUE(out.good()) << name;
  }

 private:
  fs::path path_;
};

// Every entry of a zip archive held in memory: name -> bytes, in archive order via `order`.
std::map<std::string, std::string> ReadZip(const std::string& bytes,
                                           std::vector<std::string>* order) {
  std::map<std::string, std::string> entries;
  zip_error_t error;
  zip_error_init(&error);
  zip_source_t* source = zip_source_buffer_create(bytes.data(), bytes.size(), 0, &error);
  EXPECT_NE(source, nullptr) << zip_error_strerror(&error);
  if (source == nullptr) return entries;
  zip_t* archive = zip_open_from_source(source, ZIP_RDONLY | ZIP_CHECKCONS, &error);
  EXPECT_NE(archive, nullptr) << zip_error_strerror(&error);
  if (archive == nullptr) {
    zip_source_free(source);
    zip_error_fini(&error);
    return entries;
  }
  const zip_int64_t n = zip_get_num_entries(archive, 0);
  for (zip_int64_t i = 0; i < n; ++i) {
    zip_stat_t stat;
    zip_stat_init(&stat);
    EXPECT_EQ(zip_stat_index(archive, static_cast<zip_uint64_t>(i), 0, &stat), 0);
    std::string content(static_cast<size_t>(stat.size), '\0');
    zip_file_t* file = zip_fopen_index(archive, static_cast<zip_uint64_t>(i), 0);
    EXPECT_NE(file, nullptr) << stat.name;
    if (file == nullptr) continue;
    EXPECT_EQ(zip_fread(file, content.data(), stat.size), static_cast<zip_int64_t>(stat.size));
    zip_fclose(file);
    if (order != nullptr) order->push_back(stat.name);
    entries[stat.name] = std::move(content);
  }
  zip_discard(archive);  // read-only: frees the source too
  zip_error_fini(&error);
  return entries;
}

std::string Sha256Hex(const std::string& bytes) {
  unsigned char digest[EVP_MAX_MD_SIZE];
  unsigned int length = 0;
  EXPECT_EQ(EVP_Digest(bytes.data(), bytes.size(), digest, &length, EVP_sha256(), nullptr), 1);
  std::string hex;
  char buffer[3];
  for (unsigned int i = 0; i < length; ++i) {
    std::snprintf(buffer, sizeof(buffer), "%02x", digest[i]);
    hex += buffer;
  }
  return hex;
}

TEST(TokenizerBundle, ZipsExactlyTheKnownFilesAtTheRoot) {
  TempDir dir;
  // Bytes that a text-mode copy would change (CR LF, NUL, high bytes), and a larger file
  // that compresses.
  const std::map<std::string, std::string> known = {
      {"tokenizer.json", std::string("{\"version\":\"1.0\",\r\n\"model\":{}}\0\xff\xfe", 33) +
                             std::string(20000, 'a')},
      {"tokenizer_config.json", "{\"chat_template\": \"{{ messages }}\"}\n"},
      {"config.json", "{\"eos_token_id\": 2}"},
  };
  for (const auto& [name, bytes] : known) dir.Write(name, bytes);
  dir.Write("model.safetensors", "weights, not a tokenizer file");
  dir.Write("README.md", "unrelated");
  fs::create_directory(dir.path() / "vocab.txt.d");  // a directory: never archived

  absl::StatusOr<TokenizerBundle> bundle = MakeTokenizerBundle(dir.path().string());
  ASSERT_TRUE(bundle.ok()) << bundle.status();

  std::vector<std::string> order;
  const std::map<std::string, std::string> entries = ReadZip(bundle->zip, &order);
  EXPECT_EQ(entries, known);
  // In kTokenizerBundleFiles order, which `files` reports.
  EXPECT_EQ(order,
            (std::vector<std::string>{"tokenizer.json", "tokenizer_config.json", "config.json"}));
  EXPECT_EQ(bundle->files, order);

  // The hash is the archive's, 64 lowercase hex digits.
  EXPECT_EQ(bundle->sha256.size(), 64u);
  EXPECT_EQ(bundle->sha256, Sha256Hex(bundle->zip));
  // The same directory gives the same bytes (the gateway caches by hash).
  absl::StatusOr<TokenizerBundle> again = MakeTokenizerBundle(dir.path().string());
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(ReadZip(again->zip, nullptr), known);
}

TEST(TokenizerBundle, Sha256MatchesSha256sum) {
  TempDir dir;
  dir.Write("tokenizer.json", "{}");
  absl::StatusOr<TokenizerBundle> bundle = MakeTokenizerBundle(dir.path().string());
  ASSERT_TRUE(bundle.ok()) << bundle.status();
  const fs::path zip = dir.path() / "bundle.zip";
  dir.Write("bundle.zip", bundle->zip);
  const std::string command = "sha256sum '" + zip.string() + "'";
  FILE* pipe = popen(command.c_str(), "r");
  ASSERT_NE(pipe, nullptr);
  char line[256] = {};
  const bool read = std::fgets(line, sizeof(line), pipe) != nullptr;
  const int rc = pclose(pipe);
  if (!read || rc != 0) GTEST_SKIP() << "sha256sum is not available";
  EXPECT_EQ(std::string(line).substr(0, 64), bundle->sha256);
}

TEST(TokenizerBundle, OtherTokenizerFormsAreAccepted) {
  {
    TempDir dir;
    dir.Write("vocab.json", "{\"a\": 0}");
    dir.Write("merges.txt", "#version: 0.2\n");
    absl::StatusOr<TokenizerBundle> bundle = MakeTokenizerBundle(dir.path().string());
    ASSERT_TRUE(bundle.ok()) << bundle.status();
    EXPECT_EQ(bundle->files, (std::vector<std::string>{"vocab.json", "merges.txt"}));
    EXPECT_EQ(ReadZip(bundle->zip, nullptr).size(), 2u);
  }
  {
    TempDir dir;
    dir.Write("tokenizer.model", std::string("\x0a\x00\x01", 3));
    absl::StatusOr<TokenizerBundle> bundle = MakeTokenizerBundle(dir.path().string());
    ASSERT_TRUE(bundle.ok()) << bundle.status();
    EXPECT_EQ(ReadZip(bundle->zip, nullptr).at("tokenizer.model"), std::string("\x0a\x00\x01", 3));
  }
}

TEST(TokenizerBundle, ADirectoryWithoutATokenizerIsNotFoundNamingIt) {
  TempDir dir;
  dir.Write("config.json", "{}");
  dir.Write("tokenizer_config.json", "{}");  // config alone is no tokenizer
  dir.Write("merges.txt", "");
  absl::StatusOr<TokenizerBundle> bundle = MakeTokenizerBundle(dir.path().string());
  ASSERT_FALSE(bundle.ok());
  EXPECT_EQ(bundle.status().code(), absl::StatusCode::kNotFound);
  EXPECT_NE(bundle.status().message().find(dir.path().string()), std::string::npos)
      << bundle.status();

  const std::string missing = (dir.path() / "no-such-dir").string();
  bundle = MakeTokenizerBundle(missing);
  ASSERT_FALSE(bundle.ok());
  EXPECT_EQ(bundle.status().code(), absl::StatusCode::kNotFound);
  EXPECT_NE(bundle.status().message().find(missing), std::string::npos) << bundle.status();
}

}  // namespace
}  // namespace dxs
