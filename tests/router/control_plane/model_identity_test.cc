// ModelIdentity: 16 hex digits, stable, sensitive to config.json and to safetensors
// headers, blind to tensor data (it never reads it), and clear errors for bad directories.
#include "router/control_plane/model_identity.h"

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <string>

#include "common/safetensors.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace dxs {
namespace {

using ::testing::HasSubstr;
using ::testing::MatchesRegex;

class ModelIdentityTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = std::filesystem::path(::testing::TempDir()) /
           ("model_identity_" + std::to_string(::getpid()) + "_" +
            ::testing::UnitTest::GetInstance()->current_test_info()->name());
    std::filesystem::remove_all(dir_);
    std::filesystem::create_directories(dir_);
    Write("config.json", R"({"model_type": "qwen3_moe", "num_experts": 8})");
    WriteSafetensors("model-00001-of-00002.safetensors", R"({"a": {"dtype": "F32"}})", "abcd");
    WriteSafetensors("model-00002-of-00002.safetensors", R"({"b": {"dtype": "F32"}})", "efgh");
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }

  void Write(const std::string& name, const std::string& bytes) {
    std::ofstream out(dir_ / name, std::ios::binary | std::ios::trunc);
    out << bytes;
  }
  void WriteSafetensors(const std::string& name, const std::string& header,
                        const std::string& data) {
    std::string bytes;
    uint64_t n = header.size();
    for (int i = 0; i < 8; ++i) bytes.push_back(static_cast<char>(n >> (8 * i)));
    Write(name, bytes + header + data);
  }
  v1::ModelFingerprint Identity() {
    absl::StatusOr<v1::ModelFingerprint> fp = ModelIdentity(dir_.string());
    EXPECT_TRUE(fp.ok()) << fp.status();
    return fp.ok() ? *fp : v1::ModelFingerprint();
  }

  std::filesystem::path dir_;
};

TEST_F(ModelIdentityTest, SixteenHexDigitsAndStable) {
  v1::ModelFingerprint a = Identity();
  EXPECT_THAT(a.checkpoint_fingerprint(), MatchesRegex("[0-9a-f]{16}"));
  EXPECT_THAT(a.config_fingerprint(), MatchesRegex("[0-9a-f]{16}"));
  EXPECT_NE(a.checkpoint_fingerprint(), a.config_fingerprint());
  v1::ModelFingerprint b = Identity();
  EXPECT_EQ(a.checkpoint_fingerprint(), b.checkpoint_fingerprint());
  EXPECT_EQ(a.config_fingerprint(), b.config_fingerprint());
  // Other files do not matter.
  Write("README.md", "hello");
  EXPECT_EQ(Identity().checkpoint_fingerprint(), a.checkpoint_fingerprint());
}

TEST_F(ModelIdentityTest, ConfigChangesBoth) {
  v1::ModelFingerprint a = Identity();
  Write("config.json", R"({"model_type": "qwen3_moe", "num_experts": 16})");
  v1::ModelFingerprint b = Identity();
  EXPECT_NE(a.checkpoint_fingerprint(), b.checkpoint_fingerprint());
  EXPECT_NE(a.config_fingerprint(), b.config_fingerprint());
}

TEST_F(ModelIdentityTest, HeadersChangeTheCheckpointOnlyAndDataIsNotRead) {
  v1::ModelFingerprint a = Identity();
  WriteSafetensors("model-00002-of-00002.safetensors", R"({"b": {"dtype": "F32"}})", "zzzz");
  EXPECT_EQ(Identity().checkpoint_fingerprint(), a.checkpoint_fingerprint());

  WriteSafetensors("model-00002-of-00002.safetensors", R"({"b": {"dtype": "BF16"}})", "efgh");
  v1::ModelFingerprint b = Identity();
  EXPECT_NE(b.checkpoint_fingerprint(), a.checkpoint_fingerprint());
  EXPECT_EQ(b.config_fingerprint(), a.config_fingerprint());

  // A renamed shard is a different checkpoint.
  WriteSafetensors("model-00002-of-00002.safetensors", R"({"b": {"dtype": "F32"}})", "efgh");
  std::filesystem::rename(dir_ / "model-00002-of-00002.safetensors", dir_ / "z.safetensors");
  EXPECT_NE(Identity().checkpoint_fingerprint(), a.checkpoint_fingerprint());
}

TEST_F(ModelIdentityTest, BadDirectories) {
  WriteSafetensors("broken.safetensors", std::string(100, 'x'), "");
  Write("broken.safetensors", std::string("\xff\xff\xff\xff\x00\x00\x00\x00{}", 10));
  absl::StatusOr<v1::ModelFingerprint> fp = ModelIdentity(dir_.string());
  ASSERT_FALSE(fp.ok());
  EXPECT_EQ(fp.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(fp.status().message()), HasSubstr("broken.safetensors"));

  Write("broken.safetensors", "abc");
  EXPECT_EQ(ModelIdentity(dir_.string()).status().code(), absl::StatusCode::kInvalidArgument);

  fp = ModelIdentity((dir_ / "nope").string());
  ASSERT_FALSE(fp.ok());
  EXPECT_EQ(fp.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(std::string(fp.status().message()), HasSubstr("config.json"));
}

// An in-place checkpoint (common/safetensors.h: kInPlaceWeightsFile, no safetensors)
// is identified by its recipe: another seed is another model to the router, as it is to
// every worker's CheckpointFingerprint.
TEST_F(ModelIdentityTest, AnInPlaceRecipeIsPartOfTheCheckpoint) {
  std::filesystem::remove(dir_ / "model-00001-of-00002.safetensors");
  std::filesystem::remove(dir_ / "model-00002-of-00002.safetensors");
  Write(kInPlaceWeightsFile, R"({"preset": "default", "seed": 1})");
  v1::ModelFingerprint a = Identity();
  Write(kInPlaceWeightsFile, R"({"preset": "default", "seed": 2})");
  v1::ModelFingerprint b = Identity();
  EXPECT_NE(a.checkpoint_fingerprint(), b.checkpoint_fingerprint());
  EXPECT_EQ(a.config_fingerprint(), b.config_fingerprint());
}

}  // namespace
}  // namespace dxs
