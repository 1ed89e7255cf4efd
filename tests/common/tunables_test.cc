#include "common/tunables.h"

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <optional>
#include <set>
#include <sstream>
#include <string>

#include "absl/strings/match.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/common/scoped_env.h"

namespace dxs::tunables {
namespace {

using ::dxs::testing::ScopedEnv;
using ::testing::HasSubstr;

std::string SourceDir() {
  const char* d = std::getenv("DXS_SOURCE_DIR");
  return d != nullptr ? d : DXS_TEST_SOURCE_DIR;
}

std::string ReadFile(const std::filesystem::path& path) {
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

TEST(Tunables, TableIsWellFormed) {
  std::set<std::string> names;
  for (const Tunable* t : All()) {
    SCOPED_TRACE(t->name);
    EXPECT_TRUE(absl::StartsWith(t->name, "DXS_"));
    EXPECT_TRUE(names.insert(t->name).second) << "declared twice";
    EXPECT_FALSE(std::string(t->doc).empty());
    // The docs table is Markdown: a '|' or a line break would break its row.
    for (const char* text : {t->doc, t->default_value}) {
      EXPECT_EQ(std::string(text).find_first_of("|\n"), std::string::npos) << text;
    }
    if (t->type == Type::kEnum) {
      const std::vector<std::string> accepted = AcceptedValues(*t);
      EXPECT_GE(accepted.size(), 2u);
      EXPECT_THAT(accepted, ::testing::Contains(std::string(t->default_value)));
    } else {
      EXPECT_STREQ(t->values, "");
      EXPECT_FALSE(std::string(t->default_value).empty()) << "say what is used when unset";
    }
  }
  EXPECT_EQ(names.size(), All().size());
}

TEST(Tunables, UnsetAndEmptyTakeTheDefault) {
  for (const Tunable* t : All()) {
    SCOPED_TRACE(t->name);
    const std::string want = t->type == Type::kEnum ? t->default_value : "";
    EXPECT_EQ(*Parse(*t, nullptr), want);
    EXPECT_EQ(*Parse(*t, ""), want);
  }
}

TEST(Tunables, EveryAcceptedValueParses) {
  for (const Tunable* t : All()) {
    for (const std::string& v : AcceptedValues(*t)) {
      absl::StatusOr<std::string> got = Parse(*t, v.c_str());
      ASSERT_TRUE(got.ok()) << t->name << "=" << v << ": " << got.status();
      EXPECT_EQ(*got, v);
    }
  }
  EXPECT_EQ(*Parse(kCacheDir, "/some/where"), "/some/where");
}

TEST(Tunables, BadValueNamesVariableValueAndWhatIsAccepted) {
  absl::StatusOr<std::string> got = Parse(kCudaPdl, "sideways");
  EXPECT_EQ(got.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(got.status().message(), "DXS_CUDA_PDL=sideways: expected auto or off");
  got = Parse(kCudaAttention, "Auto");  // case matters, as it always has
  EXPECT_EQ(got.status().message(), "DXS_CUDA_ATTENTION=Auto: expected auto, dxs or flashinfer");
  // This one used to fall back to auto silently.
  got = Parse(kGroupedGemmTiles, "huge");
  EXPECT_EQ(got.status().message(),
            "DXS_GROUPED_GEMM_TILES=huge: expected auto, small, large, wide1 or wide");
  got = Parse(kCudaGemvEarly, "3");
  EXPECT_EQ(got.status().message(), "DXS_CUDA_GEMV_EARLY=3: expected 2 or 4");
}

TEST(Tunables, ReadAndOnFollowTheEnvironment) {
  {
    ScopedEnv env("DXS_CUDA_GEMV", nullptr);
    EXPECT_EQ(*Read(kCudaGemv), "auto");
    EXPECT_TRUE(On(kCudaGemv));
  }
  {
    ScopedEnv env("DXS_CUDA_GEMV", "off");
    EXPECT_EQ(*Read(kCudaGemv), "off");
    EXPECT_FALSE(On(kCudaGemv));
    EXPECT_EQ(Get(kCudaGemv), "off");
  }
  ScopedEnv env("DXS_NCCL_LIBRARY", "/opt/nccl/libnccl.so.2");
  EXPECT_EQ(Get(kNcclLibrary), "/opt/nccl/libnccl.so.2");
}

TEST(Tunables, ValidateNamesEveryBadVariable) {
  EXPECT_TRUE(Validate().ok()) << Validate();
  ScopedEnv a("DXS_CUDA_GEMV", "sideways");
  ScopedEnv b("DXS_CUDA_NORM_EARLY_TRIGGER", "auto");
  const absl::Status s = Validate();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("DXS_CUDA_GEMV=sideways: expected auto or off"));
  EXPECT_THAT(s.message(), HasSubstr("DXS_CUDA_NORM_EARLY_TRIGGER=auto: expected on or off"));
}

TEST(TunablesDeathTest, ValidateOrDieExitsTwoWithTheMessage) {
  ScopedEnv env("DXS_CUDA_PREFILL_SM90", "fast");
  EXPECT_EXIT(ValidateOrDie("dxs-test"), ::testing::ExitedWithCode(2),
              "dxs-test: DXS_CUDA_PREFILL_SM90=fast: expected auto or off");
  EXPECT_EXIT(Get(kCudaPrefillSm90), ::testing::ExitedWithCode(2),
              "DXS_CUDA_PREFILL_SM90=fast: expected auto or off");
}

TEST(TunablesDeathTest, ValidateOrDieReturnsWhenAllIsWell) {
  ScopedEnv env("DXS_CUDA_PREFILL_SM90", "off");
  ValidateOrDie("dxs-test");
}

// docs/tunables.md holds MarkdownTable() verbatim (`dxs tunables --markdown` prints it), so
// the docs and the code cannot drift apart.
TEST(Tunables, DocsTableIsTheCodeTable) {
  const std::string docs = ReadFile(std::filesystem::path(SourceDir()) / "docs" / "tunables.md");
  ASSERT_FALSE(docs.empty()) << "docs/tunables.md not found under " << SourceDir();
  EXPECT_THAT(docs, HasSubstr(MarkdownTable()))
      << "docs/tunables.md is out of date: replace its table with `dxs tunables --markdown`";
}

// Nothing outside the table reads a DXS_* variable itself: a getenv("DXS_...") in product
// code (tests and benchmarks set and read their own) is a tunable missing from the table.
TEST(Tunables, NoAdHocReadsInProductCode) {
  namespace fs = std::filesystem;
  const fs::path root = SourceDir();
  for (const char* dir : {"attention_service", "common", "expert_service", "kernels", "model",
                          "proto", "router", "tools", "worker"}) {
    if (!fs::exists(root / dir)) continue;
    for (const fs::directory_entry& e : fs::recursive_directory_iterator(root / dir)) {
      const std::string ext = e.path().extension().string();
      if (!e.is_regular_file() || (ext != ".cc" && ext != ".h" && ext != ".cu" && ext != ".cuh")) {
        continue;
      }
      const std::string text = ReadFile(e.path());
      EXPECT_EQ(text.find("getenv(\"DXS_"), std::string::npos) << e.path();
    }
  }
}

}  // namespace
}  // namespace dxs::tunables
