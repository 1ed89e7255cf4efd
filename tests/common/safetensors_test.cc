#include "common/safetensors.h"

#include <sys/stat.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"

namespace dxs {
namespace {

using ::testing::AllOf;
using ::testing::ElementsAre;
using ::testing::HasSubstr;
using Json = nlohmann::json;

// A fresh directory under /tmp, removed with its contents at the end of the test.
class TempDir {
 public:
  TempDir() {
    std::string pattern = "/tmp/dxs_safetensors_test_XXXXXX";
    char* made = ::mkdtemp(pattern.data());
    EXPECT_NE(made, nullptr);
    path_ = pattern;
  }
  ~TempDir() { std::filesystem::remove_all(path_); }
  const std::string& path() const { return path_; }
  std::string File(const std::string& name) const { return path_ + "/" + name; }

 private:
  std::string path_;
};

void WriteBytes(const std::string& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  ASSERT_TRUE(out.good()) << path;
}

std::string ReadBytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

std::string LengthPrefix(uint64_t n) {
  std::string s(8, '\0');
  for (int i = 0; i < 8; ++i) s[i] = static_cast<char>((n >> (8 * i)) & 0xff);
  return s;
}

// A safetensors image with the given header text and `data_bytes` zero bytes of data.
std::string Image(const std::string& header, size_t data_bytes) {
  return LengthPrefix(header.size()) + header + std::string(data_bytes, '\0');
}

std::vector<float> Iota(size_t n, float scale = 0.25f) {
  std::vector<float> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = (static_cast<float>(i) - n / 2.0f) * scale;
  return v;
}

std::vector<float> RoundTrip(DType dtype, const std::vector<float>& values) {
  std::vector<uint8_t> bytes(values.size() * DTypeSize(dtype));
  NarrowFromFloat32(dtype, values.data(), values.size(), bytes.data());
  std::vector<float> out(values.size());
  WidenToFloat32(dtype, bytes.data(), values.size(), out.data());
  return out;
}

// ------------------------------------------------------------------------------------------
// Round trips

class RoundTripTest : public ::testing::TestWithParam<DType> {};

TEST_P(RoundTripTest, WriteThenRead) {
  const DType dtype = GetParam();
  TempDir dir;
  SafetensorsWriter writer;
  const std::vector<float> embed = Iota(7 * 5, 0.125f);
  const std::vector<float> norm = {1.0f, -2.5f, 3.0f, 0.0078125f, 1000.0f};
  writer.Add("model.embed_tokens.weight", dtype, {7, 5}, embed);
  writer.Add("model.norm.weight", dtype, {5}, norm);
  writer.Add("scalar", dtype, {}, {42.0f});
  writer.Add("empty", dtype, {0, 3}, {});
  ASSERT_TRUE(writer.WriteDirectory(dir.path()).ok());

  // Header is padded with spaces to a multiple of 8 and carries {"format": "pt"}.
  const std::string raw = ReadBytes(dir.File("model.safetensors"));
  ASSERT_GE(raw.size(), 8u);
  uint64_t header_bytes = 0;
  for (int i = 7; i >= 0; --i) header_bytes = (header_bytes << 8) | static_cast<uint8_t>(raw[i]);
  EXPECT_EQ(header_bytes % 8, 0u);
  const Json header = Json::parse(raw.substr(8, header_bytes));
  EXPECT_EQ(header["__metadata__"], Json({{"format", "pt"}}));
  EXPECT_EQ(header["model.norm.weight"]["dtype"], std::string(DTypeName(dtype)));
  EXPECT_FALSE(std::filesystem::exists(dir.File("model.safetensors.index.json")));

  absl::StatusOr<std::unique_ptr<Checkpoint>> ckpt = Checkpoint::Open(dir.path());
  ASSERT_TRUE(ckpt.ok()) << ckpt.status();
  EXPECT_THAT((*ckpt)->TensorNames(),
              ElementsAre("empty", "model.embed_tokens.weight", "model.norm.weight", "scalar"));
  EXPECT_TRUE((*ckpt)->Has("model.norm.weight"));
  EXPECT_FALSE((*ckpt)->Has("model.missing"));
  EXPECT_EQ((*ckpt)->FileOf("model.norm.weight"), dir.File("model.safetensors"));

  absl::StatusOr<std::vector<float>> got =
      (*ckpt)->ReadFloat32("model.embed_tokens.weight", {7, 5});
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(*got, RoundTrip(dtype, embed));
  got = (*ckpt)->ReadFloat32("model.norm.weight", {5});
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(*got, RoundTrip(dtype, norm));
  if (dtype == DType::kF32) {
    EXPECT_EQ(*got, norm);
  }
  got = (*ckpt)->ReadFloat32("scalar", {});
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_THAT(*got, ElementsAre(42.0f));
  got = (*ckpt)->ReadFloat32("empty", {0, 3});
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_TRUE(got->empty());

  absl::StatusOr<const TensorView*> view = (*ckpt)->Find("model.embed_tokens.weight");
  ASSERT_TRUE(view.ok());
  EXPECT_EQ((*view)->dtype, dtype);
  EXPECT_THAT((*view)->shape, ElementsAre(7, 5));
  EXPECT_EQ((*view)->num_elements(), 35);
  EXPECT_EQ((*view)->num_bytes, 35 * DTypeSize(dtype));

  absl::StatusOr<std::unique_ptr<SafetensorsFile>> file =
      SafetensorsFile::Open(dir.File("model.safetensors"));
  ASSERT_TRUE(file.ok()) << file.status();
  EXPECT_EQ((*file)->metadata().at("format"), "pt");
  EXPECT_EQ((*file)->tensors().size(), 4u);
}

INSTANTIATE_TEST_SUITE_P(AllDTypes, RoundTripTest,
                         ::testing::Values(DType::kF32, DType::kF16, DType::kBF16),
                         [](const ::testing::TestParamInfo<DType>& info) {
                           return std::string(DTypeName(info.param));
                         });

TEST(ShardedTest, ThreeShards) {
  TempDir dir;
  SafetensorsWriter writer;
  struct Spec {
    std::string name;
    DType dtype;
    std::vector<int64_t> shape;
  };
  std::vector<Spec> specs;
  for (int layer = 0; layer < 4; ++layer) {
    const std::string prefix = absl::StrCat("model.layers.", layer, ".");
    specs.push_back({prefix + "input_layernorm.weight", DType::kF32, {16}});
    specs.push_back({prefix + "self_attn.q_proj.weight", DType::kBF16, {32, 16}});
    specs.push_back({prefix + "mlp.gate.weight", DType::kF16, {4, 16}});
  }
  specs.push_back({"lm_head.weight", DType::kBF16, {50, 16}});
  specs.push_back({"zero_sized_last", DType::kF32, {0, 16}});  // midpoint at the very end
  uint64_t total = 0;
  uint64_t largest = 0;
  for (const Spec& s : specs) {
    int64_t n = 1;
    for (int64_t d : s.shape) n *= d;
    writer.Add(s.name, s.dtype, s.shape, Iota(static_cast<size_t>(n), 0.5f));
    total += n * DTypeSize(s.dtype);
    largest = std::max<uint64_t>(largest, n * DTypeSize(s.dtype));
  }
  ASSERT_TRUE(writer.WriteDirectory(dir.path(), 3).ok());

  EXPECT_FALSE(std::filesystem::exists(dir.File("model.safetensors")));
  const Json index = Json::parse(ReadBytes(dir.File("model.safetensors.index.json")));
  EXPECT_EQ(index["metadata"]["total_size"].get<uint64_t>(), total);
  ASSERT_EQ(index["weight_map"].size(), specs.size());
  std::map<std::string, uint64_t> bytes_per_shard;
  std::string previous_shard;
  for (const Spec& s : specs) {
    const std::string shard = index["weight_map"][s.name].get<std::string>();
    // Insertion order is kept: shard names never go back.
    EXPECT_GE(shard, previous_shard) << s.name;
    previous_shard = shard;
    int64_t n = 1;
    for (int64_t d : s.shape) n *= d;
    bytes_per_shard[shard] += n * DTypeSize(s.dtype);
  }
  EXPECT_THAT(bytes_per_shard, ElementsAre(testing::Key("model-00001-of-00003.safetensors"),
                                           testing::Key("model-00002-of-00003.safetensors"),
                                           testing::Key("model-00003-of-00003.safetensors")));
  for (const auto& [shard, bytes] : bytes_per_shard) {
    EXPECT_TRUE(std::filesystem::exists(dir.File(shard)));
    EXPECT_GT(bytes, 0u) << shard;
    EXPECT_LE(bytes, total / 3 + largest) << shard;  // roughly even
  }

  absl::StatusOr<std::unique_ptr<Checkpoint>> ckpt = Checkpoint::Open(dir.path());
  ASSERT_TRUE(ckpt.ok()) << ckpt.status();
  EXPECT_EQ((*ckpt)->TensorNames().size(), specs.size());
  for (const Spec& s : specs) {
    int64_t n = 1;
    for (int64_t d : s.shape) n *= d;
    absl::StatusOr<std::vector<float>> got = (*ckpt)->ReadFloat32(s.name, s.shape);
    ASSERT_TRUE(got.ok()) << got.status();
    EXPECT_EQ(*got, RoundTrip(s.dtype, Iota(static_cast<size_t>(n), 0.5f))) << s.name;
    EXPECT_EQ((*ckpt)->FileOf(s.name), dir.File(index["weight_map"][s.name].get<std::string>()));
  }

  // Rewriting the same directory unsharded removes the index, and vice versa.
  ASSERT_TRUE(writer.WriteDirectory(dir.path(), 1).ok());
  EXPECT_FALSE(std::filesystem::exists(dir.File("model.safetensors.index.json")));
  ASSERT_TRUE(writer.WriteDirectory(dir.path(), 3).ok());
  EXPECT_FALSE(std::filesystem::exists(dir.File("model.safetensors")));
}

TEST(ShardedTest, EveryShardGetsATensorWhateverTheSizes) {
  const std::vector<std::vector<size_t>> patterns = {
      {1000, 1, 1, 1}, {1, 1, 1, 1000}, {1, 1000, 1},          {0, 0, 0, 0},
      {5, 0, 0, 0, 5}, {1, 2, 3},       {7, 7, 7, 7, 7, 7, 7},
  };
  for (const std::vector<size_t>& sizes : patterns) {
    for (int shards = 2; shards <= static_cast<int>(sizes.size()); ++shards) {
      SCOPED_TRACE(absl::StrCat(sizes.size(), " tensors, ", shards, " shards, first ", sizes[0]));
      TempDir dir;
      SafetensorsWriter writer;
      for (size_t i = 0; i < sizes.size(); ++i) {
        writer.Add(absl::StrCat("t", i), DType::kF32, {static_cast<int64_t>(sizes[i])},
                   Iota(sizes[i]));
      }
      ASSERT_TRUE(writer.WriteDirectory(dir.path(), shards).ok());
      const Json index = Json::parse(ReadBytes(dir.File("model.safetensors.index.json")));
      ASSERT_EQ(index["weight_map"].size(), sizes.size());
      std::set<std::string> used;
      std::string previous;
      for (size_t i = 0; i < sizes.size(); ++i) {
        const std::string shard = index["weight_map"][absl::StrCat("t", i)].get<std::string>();
        EXPECT_GE(shard, previous);
        previous = shard;
        used.insert(shard);
      }
      EXPECT_EQ(used.size(), static_cast<size_t>(shards));
      absl::StatusOr<std::unique_ptr<Checkpoint>> ckpt = Checkpoint::Open(dir.path());
      ASSERT_TRUE(ckpt.ok()) << ckpt.status();
      EXPECT_EQ((*ckpt)->TensorNames().size(), sizes.size());
    }
  }
}

TEST(ShardedTest, MoreShardsThanTensorsIsAnError) {
  TempDir dir;
  SafetensorsWriter writer;
  writer.Add("a", DType::kF32, {1}, {1.0f});
  writer.Add("b", DType::kF32, {1}, {2.0f});
  absl::Status status = writer.WriteDirectory(dir.path(), 3);
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(writer.WriteDirectory(dir.path(), 0).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(writer.WriteDirectory(dir.path(), 2).ok());
}

TEST(WriterTest, MisuseIsReported) {
  TempDir dir;
  SafetensorsWriter duplicate;
  duplicate.Add("w", DType::kF32, {1}, {1.0f});
  duplicate.Add("w", DType::kF32, {1}, {2.0f});
  absl::Status status = duplicate.WriteDirectory(dir.path());
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(status.message(), AllOf(HasSubstr("'w'"), HasSubstr("twice")));

  SafetensorsWriter mismatch;
  mismatch.Add("x", DType::kBF16, {2, 3}, {1.0f, 2.0f});
  status = mismatch.WriteDirectory(dir.path());
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(status.message(), AllOf(HasSubstr("'x'"), HasSubstr("[2, 3]")));
}

// ------------------------------------------------------------------------------------------
// Malformed files: each gives INVALID_ARGUMENT naming the file (and the tensor, if any).

struct BadCase {
  std::string label;
  std::string bytes;
  std::string tensor;    // expected in the message when not empty
  std::string fragment;  // expected in the message
};

std::string Entry(const std::string& dtype, const std::string& shape, const std::string& offsets) {
  return absl::StrCat(R"({"dtype": ")", dtype, R"(", "shape": )", shape, R"(, "data_offsets": )",
                      offsets, "}");
}

std::vector<BadCase> BadCases() {
  const std::string w = "model.norm.weight";
  auto one = [&](const std::string& entry, size_t data) {
    return Image(absl::StrCat(R"({")", w, R"(": )", entry, "}"), data);
  };
  std::vector<BadCase> cases = {
      {"empty file", "", "", "shorter than the 8-byte header"},
      {"seven bytes", std::string("\x02\0\0\0\0\0\0", 7), "", "shorter than the 8-byte header"},
      {"header longer than file", LengthPrefix(1000) + "{}", "", "exceeds the file size"},
      {"absurd header length", LengthPrefix(uint64_t{1} << 40) + "{}", "", "absurd"},
      {"header just above 100 MB", LengthPrefix(100'000'001) + "{}", "", "absurd"},
      {"header not json", Image("{not json", 0), "", "not valid JSON"},
      {"header truncated json", Image(R"({"a": {"dtype": "F32")", 0), "", "not valid JSON"},
      {"header is array", Image("[1, 2]", 0), "", "must be a JSON object"},
      {"header is string", Image(R"("hello")", 0), "", "must be a JSON object"},
      {"entry not object", one("[1, 2]", 0), w, "entry must be a JSON object"},
      {"missing dtype", one(R"({"shape": [1], "data_offsets": [0, 4]})", 4), w, "missing 'dtype'"},
      {"missing shape", one(R"({"dtype": "F32", "data_offsets": [0, 4]})", 4), w,
       "missing 'shape'"},
      {"missing data_offsets", one(R"({"dtype": "F32", "shape": [1]})", 4), w,
       "missing 'data_offsets'"},
      {"dtype not string", one(R"({"dtype": 3, "shape": [1], "data_offsets": [0, 4]})", 4), w,
       "'dtype' must be a string"},
      {"unsupported dtype I64", one(Entry("I64", "[1]", "[0, 8]"), 8), w, "unsupported dtype"},
      {"unsupported dtype F64", one(Entry("F64", "[1]", "[0, 8]"), 8), w, "unsupported dtype"},
      {"shape not array", one(Entry("F32", R"("1")", "[0, 4]"), 4), w, "'shape' must be an array"},
      {"shape float", one(Entry("F32", "[1.5]", "[0, 4]"), 4), w, "'shape' must hold integers"},
      {"shape string dim", one(Entry("F32", R"([1, "2"])", "[0, 8]"), 8), w,
       "'shape' must hold integers"},
      {"negative dim", one(Entry("F32", "[2, -1]", "[0, 4]"), 4), w, "negative dimension -1"},
      {"dim above int64", one(Entry("F32", "[18446744073709551615]", "[0, 4]"), 4), w, "too large"},
      {"shape product overflow", one(Entry("F32", "[4294967296, 4294967296, 4]", "[0, 4]"), 4), w,
       "too many elements"},
      {"byte count overflow", one(Entry("F32", "[4611686018427387904, 2]", "[0, 4]"), 4), w,
       "too many elements"},
      {"offsets not array", one(Entry("F32", "[1]", R"("0-4")"), 4), w,
       "'data_offsets' must be two non-negative integers"},
      {"offsets one element", one(Entry("F32", "[1]", "[4]"), 4), w,
       "'data_offsets' must be two non-negative integers"},
      {"offsets three elements", one(Entry("F32", "[1]", "[0, 4, 8]"), 4), w,
       "'data_offsets' must be two non-negative integers"},
      {"offsets negative", one(Entry("F32", "[1]", "[-4, 0]"), 4), w,
       "'data_offsets' must be two non-negative integers"},
      {"offsets float", one(Entry("F32", "[1]", "[0.0, 4]"), 4), w,
       "'data_offsets' must be two non-negative integers"},
      {"offsets descending", one(Entry("F32", "[1]", "[8, 4]"), 8), w, "not ascending"},
      {"offsets beyond data", one(Entry("F32", "[20]", "[0, 80]"), 64), w,
       "data_offsets [0, 80] exceed data block of 64 bytes"},
      {"offsets huge", one(Entry("F32", "[1]", "[18446744073709551612, 18446744073709551615]"), 4),
       w, "exceed data block of 4 bytes"},
      {"byte length mismatch", one(Entry("BF16", "[3]", "[0, 8]"), 8), w,
       "hold 8 bytes but shape [3] of BF16 needs 6 bytes"},
      {"overlap",
       Image(absl::StrCat(R"({"a": )", Entry("F32", "[4]", "[0, 16]"), R"(, "b": )",
                          Entry("F32", "[2]", "[8, 16]"), "}"),
             16),
       "b", "overlap tensor 'a'"},
      {"identical ranges",
       Image(absl::StrCat(R"({"a": )", Entry("F32", "[2]", "[0, 8]"), R"(, "b": )",
                          Entry("F32", "[2]", "[0, 8]"), "}"),
             8),
       "b", "overlap"},
      {"hole",
       Image(absl::StrCat(R"({"a": )", Entry("F32", "[1]", "[0, 4]"), R"(, "b": )",
                          Entry("F32", "[1]", "[8, 12]"), "}"),
             12),
       "b", "unused"},
      {"trailing bytes", one(Entry("F32", "[1]", "[0, 4]"), 12), "", "trailing bytes"},
      {"duplicate tensor",
       Image(absl::StrCat(R"({"a": )", Entry("F32", "[1]", "[0, 4]"), R"(, "a": )",
                          Entry("F32", "[1]", "[4, 8]"), "}"),
             8),
       "a", "more than once"},
      {"metadata not object", Image(R"({"__metadata__": ["pt"]})", 0), "",
       "'__metadata__' must be an object of strings"},
      {"metadata value not string", Image(R"({"__metadata__": {"format": 1}})", 0), "",
       "'__metadata__' entry 'format' must be a string"},
      {"metadata nested", Image(R"({"__metadata__": {"format": {"a": "b"}}})", 0), "",
       "must be a string"},
  };
  return cases;
}

TEST(MalformedTest, EveryCaseIsInvalidArgumentNamingFileAndTensor) {
  TempDir dir;
  for (const BadCase& c : BadCases()) {
    SCOPED_TRACE(c.label);
    const std::string path = dir.File("model.safetensors");
    WriteBytes(path, c.bytes);
    absl::StatusOr<std::unique_ptr<SafetensorsFile>> file = SafetensorsFile::Open(path);
    ASSERT_FALSE(file.ok());
    EXPECT_EQ(file.status().code(), absl::StatusCode::kInvalidArgument) << file.status();
    EXPECT_THAT(file.status().message(), HasSubstr(path));
    EXPECT_THAT(file.status().message(), HasSubstr(c.fragment));
    if (!c.tensor.empty()) {
      EXPECT_THAT(file.status().message(), HasSubstr("tensor '" + c.tensor + "'"));
    }
    // The in-memory path gives the same answer.
    absl::StatusOr<std::unique_ptr<SafetensorsFile>> mem =
        SafetensorsFile::FromBytes(c.bytes, "model.safetensors");
    ASSERT_FALSE(mem.ok());
    EXPECT_EQ(mem.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(mem.status().message(), HasSubstr("model.safetensors: "));
    // And a checkpoint directory holding it fails the same way.
    absl::StatusOr<std::unique_ptr<Checkpoint>> ckpt = Checkpoint::Open(dir.path());
    ASSERT_FALSE(ckpt.ok());
    EXPECT_EQ(ckpt.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(ckpt.status().message(), HasSubstr(c.fragment));
  }
}

TEST(MalformedTest, ExampleMessage) {
  const std::string bytes = Image(
      R"({"model.norm.weight": {"dtype": "F32", "shape": [20], "data_offsets": [0, 80]}})", 64);
  absl::StatusOr<std::unique_ptr<SafetensorsFile>> file =
      SafetensorsFile::FromBytes(bytes, "model.safetensors");
  ASSERT_FALSE(file.ok());
  EXPECT_EQ(file.status().message(),
            "model.safetensors: tensor 'model.norm.weight': data_offsets [0, 80] exceed data "
            "block of 64 bytes");
}

TEST(MalformedTest, ValidSmallCasesAreAccepted) {
  // Sanity checks for the helpers above: the same shapes, well formed, are accepted.
  EXPECT_TRUE(SafetensorsFile::FromBytes(Image("{}", 0), "x").ok());
  EXPECT_TRUE(SafetensorsFile::FromBytes(Image(R"({"__metadata__": null})", 0), "x").ok());
  EXPECT_TRUE(SafetensorsFile::FromBytes(Image("{}   ", 0), "x").ok());
  absl::StatusOr<std::unique_ptr<SafetensorsFile>> file = SafetensorsFile::FromBytes(
      Image(absl::StrCat(R"({"a": )", Entry("F32", "[1]", "[0, 4]"), R"(, "b": )",
                         Entry("BF16", "[2, 1]", "[4, 8]"), R"(, "e": )",
                         Entry("F16", "[0]", "[8, 8]"), "}"),
            8),
      "x");
  ASSERT_TRUE(file.ok()) << file.status();
  EXPECT_EQ((*file)->tensors().size(), 3u);
  absl::StatusOr<const TensorView*> missing = (*file)->Find("zzz");
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(missing.status().message(), AllOf(HasSubstr("x: "), HasSubstr("'zzz'")));
}

TEST(MalformedTest, TruncatedFile) {
  TempDir dir;
  SafetensorsWriter writer;
  writer.Add("model.embed_tokens.weight", DType::kBF16, {16, 8}, Iota(128));
  writer.Add("model.norm.weight", DType::kF32, {8}, Iota(8));
  ASSERT_TRUE(writer.WriteDirectory(dir.path()).ok());
  const std::string path = dir.File("model.safetensors");
  const std::string full = ReadBytes(path);
  WriteBytes(path, full.substr(0, full.size() / 2));
  absl::StatusOr<std::unique_ptr<SafetensorsFile>> file = SafetensorsFile::Open(path);
  ASSERT_FALSE(file.ok());
  EXPECT_EQ(file.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(file.status().message(), HasSubstr(path));

  // Every proper prefix is rejected; only the whole file is accepted.
  for (size_t n = 0; n < full.size(); ++n) {
    EXPECT_FALSE(SafetensorsFile::FromBytes(full.substr(0, n), "cut").ok()) << n;
  }
  EXPECT_TRUE(SafetensorsFile::FromBytes(full, "whole").ok());
}

TEST(OpenTest, MissingFileIsNotFound) {
  TempDir dir;
  absl::StatusOr<std::unique_ptr<SafetensorsFile>> file =
      SafetensorsFile::Open(dir.File("nope.safetensors"));
  EXPECT_EQ(file.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(file.status().message(), HasSubstr("nope.safetensors"));
  file = SafetensorsFile::Open(dir.path());
  EXPECT_EQ(file.status().code(), absl::StatusCode::kInvalidArgument);
}

// ------------------------------------------------------------------------------------------
// Checkpoint directories

class CheckpointTest : public ::testing::Test {
 protected:
  // Two shards: a.safetensors holds x, b.safetensors holds y.
  void SetUp() override {
    SafetensorsWriter a;
    a.Add("x", DType::kF32, {2}, {1.0f, 2.0f});
    ASSERT_TRUE(a.WriteDirectory(dir_.File("a")).ok());
    std::filesystem::rename(dir_.File("a/model.safetensors"), dir_.File("a.safetensors"));
    SafetensorsWriter b;
    b.Add("y", DType::kBF16, {3}, {1.0f, 2.0f, 3.0f});
    ASSERT_TRUE(b.WriteDirectory(dir_.File("b")).ok());
    std::filesystem::rename(dir_.File("b/model.safetensors"), dir_.File("b.safetensors"));
  }
  void WriteIndex(const std::string& text) {
    WriteBytes(dir_.File("model.safetensors.index.json"), text);
  }
  absl::Status OpenStatus() { return Checkpoint::Open(dir_.path()).status(); }

  TempDir dir_;
};

TEST_F(CheckpointTest, HandWrittenIndexOpens) {
  WriteIndex(R"({"metadata": {}, "weight_map": {"x": "a.safetensors", "y": "b.safetensors"}})");
  absl::StatusOr<std::unique_ptr<Checkpoint>> ckpt = Checkpoint::Open(dir_.path());
  ASSERT_TRUE(ckpt.ok()) << ckpt.status();
  EXPECT_THAT((*ckpt)->TensorNames(), ElementsAre("x", "y"));
  EXPECT_EQ((*ckpt)->FileOf("y"), dir_.File("b.safetensors"));
  EXPECT_EQ((*ckpt)->FileOf("nope"), "");
  absl::StatusOr<std::vector<float>> y = (*ckpt)->ReadFloat32("y", {3});
  ASSERT_TRUE(y.ok()) << y.status();
  EXPECT_THAT(*y, ElementsAre(1.0f, 2.0f, 3.0f));

  absl::StatusOr<std::vector<float>> wrong = (*ckpt)->ReadFloat32("y", {1, 3});
  EXPECT_EQ(wrong.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(wrong.status().message(), AllOf(HasSubstr("b.safetensors"), HasSubstr("'y'"),
                                              HasSubstr("[3]"), HasSubstr("[1, 3]")));
  wrong = (*ckpt)->ReadFloat32("y", {4});
  EXPECT_EQ(wrong.status().code(), absl::StatusCode::kInvalidArgument);

  absl::StatusOr<std::vector<float>> missing = (*ckpt)->ReadFloat32("model.z", {3});
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(missing.status().message(), AllOf(HasSubstr(dir_.path()), HasSubstr("'model.z'")));
}

TEST_F(CheckpointTest, EmptyDirectoryIsNotFound) {
  absl::Status status = OpenStatus();
  EXPECT_EQ(status.code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(status.message(), AllOf(HasSubstr(dir_.path()), HasSubstr("model.safetensors"),
                                      HasSubstr("model.safetensors.index.json")));
  status = Checkpoint::Open(dir_.File("does-not-exist")).status();
  EXPECT_EQ(status.code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(status.message(), HasSubstr("does-not-exist"));
  status = Checkpoint::Open(dir_.File("a.safetensors")).status();
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
}

TEST_F(CheckpointTest, MissingShardIsNotFound) {
  WriteIndex(R"({"weight_map": {"x": "a.safetensors", "y": "c.safetensors"}})");
  absl::Status status = OpenStatus();
  EXPECT_EQ(status.code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(status.message(), AllOf(HasSubstr("model.safetensors.index.json"),
                                      HasSubstr("'c.safetensors'"), HasSubstr("'y'")));
}

TEST_F(CheckpointTest, TensorNotInItsShard) {
  WriteIndex(R"({"weight_map": {"x": "a.safetensors", "y": "a.safetensors"}})");
  absl::Status status = OpenStatus();
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(status.message(), AllOf(HasSubstr("'y'"), HasSubstr("a.safetensors")));
}

TEST_F(CheckpointTest, BadIndexFiles) {
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"{", "not valid JSON"},
      {"[]", "must be a JSON object"},
      {R"({"metadata": {}})", "missing 'weight_map'"},
      {R"({"weight_map": []})", "'weight_map' must be an object"},
      {R"({"weight_map": {"x": 1}})", "'x'"},
      {R"({"weight_map": {"x": "/etc/passwd"}})", "relative path"},
      {R"({"weight_map": {"x": "../a.safetensors"}})", "relative path"},
  };
  for (const auto& [text, fragment] : cases) {
    SCOPED_TRACE(text);
    WriteIndex(text);
    absl::Status status = OpenStatus();
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(status.message(),
                AllOf(HasSubstr("model.safetensors.index.json"), HasSubstr(fragment)));
  }
}

TEST_F(CheckpointTest, BrokenShardNamesTheShard) {
  WriteBytes(dir_.File("b.safetensors"), Image("{oops", 0));
  WriteIndex(R"({"weight_map": {"x": "a.safetensors", "y": "b.safetensors"}})");
  absl::Status status = OpenStatus();
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(status.message(), HasSubstr("b.safetensors"));
}

// ---------------------------------------------------------------------------------------------
// Block-scaled FP8 checkpoints (quantization_config "fp8", 128x128 blocks).

constexpr char kFp8Weight[] = "model.layers.0.mlp.experts.3.down_proj.weight";
constexpr char kFp8Scale[] = "model.layers.0.mlp.experts.3.down_proj.weight_scale_inv";

Json Fp8Config() {
  return Json::parse(R"({"model_type": "qwen3_moe", "torch_dtype": "bfloat16",
      "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme":
      "dynamic", "weight_block_size": [128, 128], "modules_to_not_convert": ["lm_head"]}})");
}

class Fp8CheckpointTest : public ::testing::Test {
 protected:
  // A [200, 130] weight: 2 x 2 blocks, the last ones partial. Code (r + 3c) % 126 (finite,
  // both signs) and block scale 1 + block index / 4.
  void Write(const Json& config, bool with_scale = true, std::vector<int64_t> scale_shape = {2, 2},
             DType scale_dtype = DType::kF32, int num_shards = 1) {
    std::vector<float> w(200 * 130);
    for (int r = 0; r < 200; ++r) {
      for (int c = 0; c < 130; ++c) {
        const int code = (r + 3 * c) % 126;
        w[r * 130 + c] = Fp8E4m3ToFloat(static_cast<uint8_t>((r % 2) ? code | 0x80 : code));
      }
    }
    SafetensorsWriter writer;
    writer.Add("model.embed_tokens.weight", DType::kBF16, {2, 2}, {1, 2, 3, 4});
    writer.Add(kFp8Weight, DType::kF8E4M3, {200, 130}, w);
    if (with_scale) {
      int64_t n = 1;
      for (int64_t d : scale_shape) n *= d;
      std::vector<float> scale(n);
      for (int64_t i = 0; i < n; ++i) scale[i] = 1.0f + i / 4.0f;
      writer.Add(kFp8Scale, scale_dtype, scale_shape, scale);
    }
    ASSERT_TRUE(writer.WriteDirectory(dir_.path(), num_shards).ok());
    WriteBytes(dir_.File("config.json"), config.dump());
    weight_ = w;
  }
  absl::Status OpenStatus() { return Checkpoint::Open(dir_.path()).status(); }
  void ExpectError(const std::string& what, const std::vector<std::string>& substrings) {
    absl::Status status = OpenStatus();
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << what << ": " << status;
    for (const std::string& s : substrings) {
      EXPECT_THAT(status.message(), HasSubstr(s)) << what;
    }
  }

  TempDir dir_;
  std::vector<float> weight_;
};

TEST_F(Fp8CheckpointTest, DequantizesByBlock) {
  for (int shards : {1, 2}) {
    Write(Fp8Config(), true, {2, 2}, DType::kF32, shards);
    absl::StatusOr<std::unique_ptr<Checkpoint>> ckpt = Checkpoint::Open(dir_.path());
    ASSERT_TRUE(ckpt.ok()) << ckpt.status();
    ASSERT_TRUE((*ckpt)->fp8().has_value());
    EXPECT_THAT((*ckpt)->fp8()->modules_to_not_convert, ElementsAre("lm_head"));
    EXPECT_EQ((*ckpt)->dequantized_dtype(), DType::kBF16);
    absl::StatusOr<std::vector<float>> w = (*ckpt)->ReadFloat32(kFp8Weight, {200, 130});
    ASSERT_TRUE(w.ok()) << w.status();
    for (int r = 0; r < 200; ++r) {
      for (int c = 0; c < 130; ++c) {
        const float scale = 1.0f + ((r / 128) * 2 + c / 128) / 4.0f;
        ASSERT_EQ((*w)[r * 130 + c], weight_[r * 130 + c] * scale) << r << " " << c;
      }
    }
    // Unquantized tensors read as before.
    EXPECT_THAT(*(*ckpt)->ReadFloat32("model.embed_tokens.weight", {2, 2}),
                ElementsAre(1.0f, 2.0f, 3.0f, 4.0f));
  }
}

TEST_F(Fp8CheckpointTest, QwenConfigWithoutFmtLoads) {
  Json config = Fp8Config();
  config["quantization_config"].erase("fmt");
  Write(config);
  EXPECT_TRUE(OpenStatus().ok()) << OpenStatus();
}

TEST_F(Fp8CheckpointTest, ScaleOfTheWrongShape) {
  Write(Fp8Config(), true, {2, 1});
  ExpectError("shape", {kFp8Scale, "[2, 1]", "[2, 2]", "128x128"});
  Write(Fp8Config(), true, {4});
  ExpectError("1-D", {kFp8Scale, "[4]"});
}

TEST_F(Fp8CheckpointTest, ScaleOfTheWrongDtype) {
  Write(Fp8Config(), true, {2, 2}, DType::kF8E4M3);
  ExpectError("dtype", {kFp8Scale, "F8_E4M3", "expected F32"});
}

TEST_F(Fp8CheckpointTest, MissingScale) {
  Write(Fp8Config(), false);
  ExpectError("missing", {kFp8Weight, kFp8Scale, "no scale tensor"});
}

TEST_F(Fp8CheckpointTest, BlockSizeOtherThan128) {
  Json config = Fp8Config();
  config["quantization_config"]["weight_block_size"] = {256, 256};
  Write(config);
  ExpectError("256", {"config.json", "weight_block_size", "[256,256]", "[128, 128]"});
  config["quantization_config"].erase("weight_block_size");
  Write(config);
  ExpectError("absent", {"weight_block_size", "missing"});
}

TEST_F(Fp8CheckpointTest, UnknownFmtOrMethod) {
  Json config = Fp8Config();
  config["quantization_config"]["fmt"] = "e5m2";
  Write(config);
  ExpectError("fmt", {"config.json", "quantization_config.fmt", "'e5m2'"});
  config = Fp8Config();
  config["quantization_config"]["quant_method"] = "awq";
  Write(config);
  ExpectError("method", {"quantization_config.quant_method", "'awq'"});
  config = Fp8Config();
  config["quantization_config"]["activation_scheme"] = "static";
  Write(config);
  ExpectError("static", {"quantization_config.activation_scheme", "'static'"});
  config = Fp8Config();
  config["quantization_config"]["modules_to_not_convert"] = "lm_head";
  Write(config);
  ExpectError("modules", {"modules_to_not_convert"});
}

TEST_F(Fp8CheckpointTest, Fp8WithoutQuantizationConfig) {
  Json config = Fp8Config();
  config.erase("quantization_config");
  Write(config);
  ExpectError("no config", {kFp8Weight, "no fp8 quantization_config"});
}

}  // namespace
}  // namespace dxs
