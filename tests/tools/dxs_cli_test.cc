// The `dxs` command-line tool as a user runs it: a real process, its exit code and output.
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <fstream>
#include <sstream>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "gtest/gtest.h"
#include "model/engine.h"
#include "nlohmann/json.hpp"
#include "tests/model/test_util.h"

namespace dxs {
namespace {

using testing::TempDir;

struct Output {
  int exit_code = -1;
  std::string out, err;
};

std::string Slurp(const std::string& path) {
  std::ifstream f(path);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

// Runs `dxs <args>` to completion, capturing stdout and stderr.
Output RunDxs(const std::string& args, const TempDir& tmp) {
  const std::string out = tmp.path() + "/out.txt", err = tmp.path() + "/err.txt";
  const std::string cmd = absl::StrCat(DXS_TEST_BIN_DIR, "/dxs ", args, " >", out, " 2>", err);
  const int status = std::system(cmd.c_str());
  return {WIFEXITED(status) ? WEXITSTATUS(status) : -1, Slurp(out), Slurp(err)};
}

int Lines(const std::string& s) { return static_cast<int>(std::count(s.begin(), s.end(), '\n')); }

TEST(DxsRun, JsonOutputMatchesTheEngine) {
  TempDir tmp;
  const std::string dir = testing::WritePreset(tmp, "default");
  Output o = RunDxs(
      "run --model " + dir + " --prompt-ids 9,41,7 --max-new-tokens 5 --dump-logits --format json",
      tmp);
  ASSERT_EQ(o.exit_code, 0) << o.err;
  nlohmann::json j = nlohmann::json::parse(o.out);
  auto engine = LocalEngine::Load(dir);
  ASSERT_TRUE(engine.ok());
  GenerationRequest r;
  r.prompt = {9, 41, 7};
  r.max_new_tokens = 5;
  auto want = (*engine)->GenerateBatch({r});
  ASSERT_TRUE(want.ok());
  EXPECT_EQ(j.at("tokens").get<std::vector<int32_t>>(), want->front().tokens);
  EXPECT_EQ(j.at("first_logits").size(), 4096u);
  EXPECT_EQ(j.at("finish_reason"), "length");
}

TEST(DxsRun, BadFlagsAndBadModelGiveOneLineAndNonZeroExit) {
  TempDir tmp;
  const std::string dir = testing::WritePreset(tmp, "default");
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"run --model " + dir + " --prompt-ids 1,2 --bogus 3", "unknown flag --bogus"},
      {"run --model " + dir + " --prompt-ids 1,x", "not an integer"},
      {"run --model " + dir + " --prompt-ids 1 --max-new-tokens 0", "max_new_tokens"},
      {"run --model " + dir + " --prompt-ids 99999", "vocabulary"},
      {"run --model " + dir + " --prompt-ids 1 --top-p 1.5", "top_p"},
      {"run --model " + dir + " --prompt-ids 1 --format yaml", "--format"},
      {"run --model " + dir, "--prompt-ids is required"},
      {"run --model " + tmp.path() + "/missing --prompt-ids 1", "missing"},
      {"frobnicate", "unknown command"},
  };
  for (const auto& [args, message] : cases) {
    Output o = RunDxs(args, tmp);
    EXPECT_NE(o.exit_code, 0) << args;
    EXPECT_NE(o.err.find(message), std::string::npos) << args << " -> " << o.err;
    if (args != "frobnicate") {
      EXPECT_EQ(Lines(o.err), 1) << args << " -> " << o.err;
    }
    EXPECT_TRUE(o.out.empty()) << args;
  }
}

TEST(DxsRun, CorruptCheckpointNamesTheFile) {
  TempDir tmp;
  const std::string dir = testing::WritePreset(tmp, "default");
  std::ofstream(dir + "/model.safetensors", std::ios::trunc) << "not a checkpoint";
  Output o = RunDxs("run --model " + dir + " --prompt-ids 1", tmp);
  EXPECT_NE(o.exit_code, 0);
  EXPECT_NE(o.err.find("model.safetensors"), std::string::npos) << o.err;
  EXPECT_EQ(Lines(o.err), 1) << o.err;
}

}  // namespace
}  // namespace dxs
