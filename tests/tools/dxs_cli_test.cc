// The `dxs` command-line tool as a user runs it: a real process, its exit code and output.
#include <pty.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <fstream>
#include <sstream>
#include <thread>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "common/tunables.h"
#include "gtest/gtest.h"
#include "model/engine.h"
#include "nlohmann/json.hpp"
#include "tests/model/test_util.h"
#include "tests/tools/run_binary.h"

namespace dxs {
namespace {

using testing::TempDir;

using Output = testing::ProcessOutput;

// Runs `dxs <args>` to completion, capturing stdout and stderr.
Output RunDxs(const std::string& args, const TempDir& tmp) {
  return testing::RunBinary("dxs " + args, tmp);
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

// The JSON of a TokenLogprobs list against the engine's: "logprobs", "top_logprobs" (lists
// of [id, logprob]) and "token_ids_logprobs". The JSON holds each float as a double, so the
// values come back exactly.
void ExpectLogprobsJson(const nlohmann::json& j, const std::vector<TokenLogprobs>& want,
                        const std::string& what) {
  ASSERT_EQ(j.at("logprobs").size(), want.size()) << what;
  ASSERT_EQ(j.at("top_logprobs").size(), want.size()) << what;
  ASSERT_EQ(j.at("token_ids_logprobs").size(), want.size()) << what;
  for (size_t i = 0; i < want.size(); ++i) {
    EXPECT_EQ(j.at("logprobs")[i].get<float>(), want[i].logprob) << what << " " << i;
    ASSERT_EQ(j.at("top_logprobs")[i].size(), want[i].top.size()) << what << " " << i;
    for (size_t k = 0; k < want[i].top.size(); ++k) {
      EXPECT_EQ(j.at("top_logprobs")[i][k][0].get<int32_t>(), want[i].top[k].first);
      EXPECT_EQ(j.at("top_logprobs")[i][k][1].get<float>(), want[i].top[k].second);
    }
    EXPECT_EQ(j.at("token_ids_logprobs")[i].get<std::vector<float>>(), want[i].named);
  }
}

// The sampling features' flags reach the engine; the JSON has the log-probabilities the
// engine computed, for the output and the scored prompt.
TEST(DxsRun, SamplingFeaturesAndLogprobsMatchTheEngine) {
  TempDir tmp;
  const std::string dir = testing::WritePreset(tmp, "default");
  auto engine = LocalEngine::Load(dir);
  ASSERT_TRUE(engine.ok());
  GenerationRequest r;
  r.prompt = {9, 41, 7, 300, 12};
  r.max_new_tokens = 6;
  r.sampling.temperature = 0.7f;
  r.sampling.seed = 5;
  r.sampling.min_p = 0.1f;
  r.sampling.repetition_penalty = 1.2f;
  r.sampling.frequency_penalty = 0.5f;
  r.sampling.presence_penalty = -0.25f;
  r.sampling.logit_bias = {{2, -100.f}, {17, 4.f}};
  r.min_new_tokens = 2;
  r.logprobs = true;
  r.top_logprobs = 3;
  r.logprob_token_ids = {5, 6};
  r.prompt_logprobs_start = 2;
  Output o = RunDxs("run --model " + dir +
                        " --prompt-ids 9,41,7,300,12 --max-new-tokens 6 --format json"
                        " --temperature 0.7 --seed 5 --min-p 0.1 --repetition-penalty 1.2"
                        " --frequency-penalty 0.5 --presence-penalty -0.25"
                        " --logit-bias 2:-100,17:4 --min-new-tokens 2 --logprobs"
                        " --top-logprobs 3 --logprob-token-ids 5,6 --prompt-logprobs 2",
                    tmp);
  ASSERT_EQ(o.exit_code, 0) << o.err;
  const nlohmann::json j = nlohmann::json::parse(o.out);
  auto want = (*engine)->GenerateBatch({r});
  ASSERT_TRUE(want.ok()) << want.status();
  const GenerationResult& w = want->front();
  EXPECT_EQ(j.at("tokens").get<std::vector<int32_t>>(), w.tokens);
  ExpectLogprobsJson(j, w.logprobs, "output");
  ASSERT_TRUE(w.prompt_logprobs.has_value());
  const nlohmann::json& p = j.at("prompt_logprobs");
  EXPECT_EQ(p.at("first_position"), 2);
  EXPECT_EQ(p.at("token_ids").get<std::vector<int32_t>>(), (std::vector<int32_t>{7, 300, 12}));
  ExpectLogprobsJson(p, w.prompt_logprobs->positions, "prompt");
  ASSERT_EQ(p.at("next").at("top_logprobs").size(), 3u);
  EXPECT_EQ(p.at("next").at("top_logprobs")[0][0].get<int32_t>(),
            w.prompt_logprobs->next.top[0].first);
  EXPECT_EQ(p.at("next").at("token_ids_logprobs").get<std::vector<float>>(),
            w.prompt_logprobs->next.named);

  // Prompt scoring alone: no tokens, no per-token lists, the prompt from position 1.
  Output scored = RunDxs("run --model " + dir +
                             " --prompt-ids 9,41,7 --max-new-tokens 0 --prompt-logprobs 0"
                             " --format json",
                         tmp);
  ASSERT_EQ(scored.exit_code, 0) << scored.err;
  const nlohmann::json s = nlohmann::json::parse(scored.out);
  EXPECT_TRUE(s.at("tokens").empty());
  EXPECT_FALSE(s.contains("logprobs"));
  EXPECT_EQ(s.at("prompt_logprobs").at("first_position"), 1);
  EXPECT_EQ(s.at("prompt_logprobs").at("logprobs").size(), 2u);
  EXPECT_FALSE(s.at("prompt_logprobs").contains("top_logprobs"));
}

// --n 3: a "samples" list, one object per sample in sample order, each what a single
// request with that sample's seed (SampleSeed) gives; the top level stays sample 0's.
TEST(DxsRun, SamplesListOneObjectPerSample) {
  TempDir tmp;
  const std::string dir = testing::WritePreset(tmp, "default");
  auto engine = LocalEngine::Load(dir);
  ASSERT_TRUE(engine.ok());
  Output o = RunDxs("run --model " + dir +
                        " --prompt-ids 9,41,7,300 --max-new-tokens 6 --temperature 0.9 --seed 11"
                        " --n 3 --logprobs --top-logprobs 2 --prompt-logprobs 1 --format json",
                    tmp);
  ASSERT_EQ(o.exit_code, 0) << o.err;
  const nlohmann::json j = nlohmann::json::parse(o.out);
  ASSERT_TRUE(j.contains("samples")) << o.out;
  ASSERT_EQ(j.at("samples").size(), 3u) << o.out;
  for (int32_t i = 0; i < 3; ++i) {
    GenerationRequest r;
    r.prompt = {9, 41, 7, 300};
    r.max_new_tokens = 6;
    r.sampling.temperature = 0.9f;
    r.sampling.seed = SampleSeed(11, i);
    r.logprobs = true;
    r.top_logprobs = 2;
    auto want = (*engine)->GenerateBatch({r});
    ASSERT_TRUE(want.ok()) << want.status();
    const nlohmann::json& sample = j.at("samples")[i];
    const std::string what = "sample " + std::to_string(i);
    EXPECT_EQ(sample.at("tokens").get<std::vector<int32_t>>(), want->front().tokens) << what;
    EXPECT_EQ(sample.at("finish_reason"), FinishReasonName(want->front().finish_reason)) << what;
    ASSERT_EQ(sample.at("logprobs").size(), want->front().tokens.size()) << what;
    ASSERT_EQ(sample.at("top_logprobs").size(), want->front().tokens.size()) << what;
    for (size_t k = 0; k < want->front().logprobs.size(); ++k) {
      EXPECT_NEAR(sample.at("logprobs")[k].get<float>(), want->front().logprobs[k].logprob, 1e-5)
          << what << " " << k;
    }
    EXPECT_FALSE(sample.contains("prompt_logprobs")) << what << ": the prompt's stay on top";
  }
  // The top level is sample 0's, as with one sample.
  EXPECT_EQ(j.at("tokens"), j.at("samples")[0].at("tokens"));
  EXPECT_EQ(j.at("logprobs"), j.at("samples")[0].at("logprobs"));
  EXPECT_TRUE(j.contains("prompt_logprobs"));
  // One sample: no list, the output as before.
  Output one = RunDxs("run --model " + dir +
                          " --prompt-ids 9,41,7,300 --max-new-tokens 6 --temperature 0.9"
                          " --seed 11 --n 1 --format json",
                      tmp);
  ASSERT_EQ(one.exit_code, 0) << one.err;
  const nlohmann::json single = nlohmann::json::parse(one.out);
  EXPECT_FALSE(single.contains("samples"));
  EXPECT_EQ(single.at("tokens"), j.at("tokens"));
  // Text: a line per sample.
  Output text = RunDxs("run --model " + dir +
                           " --prompt-ids 9,41,7,300 --max-new-tokens 6 --temperature 0.9"
                           " --seed 11 --n 3",
                       tmp);
  ASSERT_EQ(text.exit_code, 0) << text.err;
  EXPECT_EQ(Lines(text.out), 3) << text.out;
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
      // The sampling features: malformed values name the flag, values out of range the
      // field (the engine's check).
      {"run --model " + dir + " --prompt-ids 1 --min-p x", "--min-p: 'x' is not a number"},
      {"run --model " + dir + " --prompt-ids 1 --min-p 1.5", "min_p"},
      {"run --model " + dir + " --prompt-ids 1 --frequency-penalty 3", "frequency_penalty"},
      {"run --model " + dir + " --prompt-ids 1 --presence-penalty -2.5", "presence_penalty"},
      {"run --model " + dir + " --prompt-ids 1 --repetition-penalty 0", "repetition_penalty"},
      {"run --model " + dir + " --prompt-ids 1 --logit-bias 5", "--logit-bias: '5' is not ID:BIAS"},
      {"run --model " + dir + " --prompt-ids 1 --logit-bias 5:1,5:2", "more than once"},
      {"run --model " + dir + " --prompt-ids 1 --logit-bias -1:1", "--logit-bias"},
      {"run --model " + dir + " --prompt-ids 1 --logit-bias 5:200", "logit_bias"},
      {"run --model " + dir + " --prompt-ids 1 --logit-bias 99999:1", "logit_bias"},
      {"run --model " + dir + " --prompt-ids 1 --max-new-tokens 4 --min-new-tokens 5",
       "min_new_tokens"},
      {"run --model " + dir + " --prompt-ids 1 --min-new-tokens -1", "--min-new-tokens"},
      {"run --model " + dir + " --prompt-ids 1 --format json --top-logprobs 21", "top_logprobs"},
      {"run --model " + dir + " --prompt-ids 1 --format json --top-logprobs -1",
       "--top-logprobs must be >= 0"},
      {"run --model " + dir + " --prompt-ids 1 --format json --logprob-token-ids 1,-2",
       "--logprob-token-ids"},
      {"run --model " + dir + " --prompt-ids 1 --format json --logprob-token-ids 99999",
       "logprob_token_ids"},
      {"run --model " + dir + " --prompt-ids 1,2 --format json --prompt-logprobs 2",
       "prompt_logprobs_start"},
      {"run --model " + dir + " --prompt-ids 1 --logprobs", "--format json"},
      {"run --model " + dir + " --prompt-ids 1 --n 0", "--n must be >= 1"},
      {"run --model " + dir + " --prompt-ids 1 --n x", "--n"},
      {"run --model " + dir + " --prompt-ids 1 --n 65", "n: must be in [1, 64]"},
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

// --preset makes the checkpoint in place; the tokens equal --model on the written one.
// --device names a backend, and a GPU that is not there is one line and exit status 1.
TEST(DxsRun, PresetMadeInPlaceAndDeviceErrors) {
  TempDir tmp;
  const std::string dir = testing::WritePreset(tmp, "bf16-sharded");
  const std::string prompt = " --prompt-ids 5,6,7 --max-new-tokens 4 --format json";
  Output disk = RunDxs("run --model " + dir + prompt, tmp);
  Output in_place = RunDxs("run --preset bf16-sharded" + prompt, tmp);
  ASSERT_EQ(disk.exit_code, 0) << disk.err;
  ASSERT_EQ(in_place.exit_code, 0) << in_place.err;
  EXPECT_EQ(nlohmann::json::parse(in_place.out).at("tokens"),
            nlohmann::json::parse(disk.out).at("tokens"));
  Output cpu = RunDxs("run --model " + dir + prompt + " --device cpu", tmp);
  EXPECT_EQ(cpu.out, disk.out);
  for (const auto& [args, code, message] : std::vector<std::tuple<std::string, int, std::string>>{
           {"run --model " + dir + prompt + " --device tpu", 2, "expected cpu, cuda or cuda:N"},
           {"run --model " + dir + prompt + " --device cuda:64", 1, "--device cuda"},
           {"run --model " + dir + " --preset default" + prompt, 2, "not both"}}) {
    Output o = RunDxs(args, tmp);
    EXPECT_EQ(o.exit_code, code) << args << " -> " << o.err;
    EXPECT_NE(o.err.find(message), std::string::npos) << args << " -> " << o.err;
    EXPECT_EQ(Lines(o.err), 1) << o.err;
    EXPECT_TRUE(o.out.empty()) << args;
  }
}

// Every subcommand answers --help (and -h, and `dxs help CMD`) with its own usage on stdout
// and exit status 0, whatever else is on the line; an unknown command is exit 2.
TEST(DxsHelp, EverySubcommandPrintsItsUsage) {
  TempDir tmp;
  for (const std::string cmd : {"run", "gen-model", "fingerprint", "up", "generate", "status",
                                "rebalance", "drain", "bench", "tunables"}) {
    for (const std::string& form :
         {cmd + " --help", cmd + " -h", "help " + cmd, cmd + " --max-new-tokens 3 --help"}) {
      Output o = RunDxs(form, tmp);
      EXPECT_EQ(o.exit_code, 0) << form << " -> " << o.err;
      EXPECT_EQ(o.out.rfind("usage: dxs " + cmd + " [flags]\n", 0), 0u) << form << " -> " << o.out;
      EXPECT_TRUE(o.err.empty()) << form << " -> " << o.err;
    }
  }
  Output all = RunDxs("--help", tmp);
  EXPECT_EQ(all.exit_code, 0);
  for (const char* cmd : {"run", "up", "bench", "drain"}) {
    EXPECT_NE(all.out.find(std::string("\n  ") + cmd + " "), std::string::npos) << all.out;
  }
  Output unknown = RunDxs("help nosuch", tmp);
  EXPECT_EQ(unknown.exit_code, 2);
  EXPECT_NE(unknown.err.find("unknown command 'nosuch'"), std::string::npos) << unknown.err;
}

// dxs tunables lists every DXS_* variable (with the value set here); --markdown is the table
// of docs/tunables.md. A bad value stops any command before it runs: one line, exit 2.
TEST(DxsTunables, ListTableAndBadValue) {
  TempDir tmp;
  Output md = RunDxs("tunables --markdown", tmp);
  EXPECT_EQ(md.exit_code, 0) << md.err;
  EXPECT_EQ(md.out, tunables::MarkdownTable());
  setenv("DXS_GROUPED_GEMM_TILES", "small", 1);
  Output list = RunDxs("tunables", tmp);
  EXPECT_EQ(list.exit_code, 0) << list.err;
  for (const tunables::Tunable* t : tunables::All()) {
    EXPECT_NE(list.out.find(std::string(t->name) + "  "), std::string::npos) << t->name;
  }
  EXPECT_NE(list.out.find("(default auto)  set: small\n"), std::string::npos) << list.out;
  setenv("DXS_GROUPED_GEMM_TILES", "huge", 1);
  for (const char* cmd : {"tunables", "run --max-new-tokens 1", "help"}) {
    Output bad = RunDxs(cmd, tmp);
    EXPECT_EQ(bad.exit_code, 2) << cmd;
    EXPECT_EQ(bad.err,
              "dxs: DXS_GROUPED_GEMM_TILES=huge: expected auto, small, large, wide1 or wide\n")
        << cmd;
    EXPECT_TRUE(bad.out.empty()) << cmd << ": " << bad.out;
  }
  unsetenv("DXS_GROUPED_GEMM_TILES");
  EXPECT_EQ(RunDxs("tunables extra", tmp).exit_code, 2);
}

// gen-model --layers N keeps the preset's shape with N layers; out of range is exit 2.
TEST(DxsGenModel, LayersCutThePreset) {
  TempDir tmp;
  const std::string dir = tmp.path() + "/two";
  Output made = RunDxs("gen-model --preset default --layers 2 --out " + dir, tmp);
  ASSERT_EQ(made.exit_code, 0) << made.err;
  std::ifstream f(dir + "/config.json");
  const nlohmann::json config = nlohmann::json::parse(f);
  EXPECT_EQ(config.at("num_hidden_layers"), 2);
  EXPECT_EQ(config.at("hidden_size"), 128);
  Output run = RunDxs("run --model " + dir + " --prompt-ids 5,6,7 --max-new-tokens 2", tmp);
  EXPECT_EQ(run.exit_code, 0) << run.err;
  for (const char* layers : {"0", "5"}) {
    Output o = RunDxs(std::string("gen-model --preset default --layers ") + layers + " --out " +
                          tmp.path() + "/bad",
                      tmp);
    EXPECT_EQ(o.exit_code, 2) << o.err;
    EXPECT_NE(o.err.find("--layers must be in [1, 4]"), std::string::npos) << o.err;
  }
}

// dxs up --gpus: a list of GPU numbers, with --device cuda (which it implies); anything else
// is one line and exit status 2 before a process starts.
TEST(DxsUp, GpusFlagErrors) {
  TempDir tmp;
  const std::string dir = testing::WritePreset(tmp, "default");
  for (const auto& [args, message] : std::vector<std::pair<std::string, std::string>>{
           {"--gpus 0,x", "'x' is not a GPU number"},
           {"--gpus 0,-1", "'-1' is not a GPU number"},
           {"--gpus 0 --device cpu", "goes with --device cuda, not --device cpu"},
           {"--gpus 0 --device cuda:1", "goes with --device cuda, not --device cuda:1"},
           {"--transport nccl", "it needs --device cuda or cuda:N, not --device cpu"},
           {"--transport tcp --device cuda", "--transport must be ucx or nccl, got 'tcp'"}}) {
    Output o = RunDxs("up --model " + dir + " --log-dir " + tmp.path() + "/logs " + args, tmp);
    EXPECT_EQ(o.exit_code, 2) << args << " -> " << o.err;
    EXPECT_NE(o.err.find(message), std::string::npos) << args << " -> " << o.err;
    EXPECT_EQ(Lines(o.err), 1) << o.err;
  }
}

TEST(DxsUp, GatewayFlagErrors) {
  TempDir tmp;
  const std::string dir = testing::WritePreset(tmp, "default");
  for (const auto& [args, message] : std::vector<std::pair<std::string, std::string>>{
           {"--gateway-port 0", "--gateway-port must be in 1..65535"},
           {"--gateway-port 70000", "--gateway-port must be in 1..65535"},
           {"--gateway-port 8000 --gateway-metrics-port -1",
            "--gateway-metrics-port must be in 0..65535"},
           {"--gateway-port 8000 --smg /no/such/smg",
            "--smg: '/no/such/smg' is not an executable"}}) {
    Output o = RunDxs("up --model " + dir + " --log-dir " + tmp.path() + "/logs " + args, tmp);
    EXPECT_NE(o.exit_code, 0) << args << " -> " << o.err;
    EXPECT_NE(o.err.find(message), std::string::npos) << args << " -> " << o.err;
    EXPECT_EQ(Lines(o.err), 1) << o.err;
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

// A log gets one line per 10% of the requests, not carriage-return redraws piling up into
// one line.
TEST(DxsBench, ProgressIsALinePerTenthWhenStderrIsNotATerminal) {
  TempDir tmp;
  const std::string dir = testing::WritePreset(tmp, "default");
  Output o = RunDxs("bench --local " + dir +
                        " --requests 20 --concurrency 3 --prompt-len 4 --output-len 2 "
                        "--format json",
                    tmp);
  ASSERT_EQ(o.exit_code, 0) << o.err;
  EXPECT_EQ(o.err.find('\r'), std::string::npos) << o.err;
  std::vector<std::string> bars;
  for (absl::string_view line : absl::StrSplit(o.err, '\n')) {
    if (absl::StartsWith(line, "[")) bars.emplace_back(line);
  }
  ASSERT_EQ(bars.size(), 10u) << o.err;
  EXPECT_NE(bars.front().find("] 2/20 requests"), std::string::npos) << bars.front();
  EXPECT_NE(bars.back().find("] 20/20 requests"), std::string::npos) << bars.back();
}

// The closed loop against --local goes through the serving loop (LocalServer), so its
// requests stream: TTFT and ITL are measured as against a router. The warm-up (one request
// a lane by default) runs first, untimed and outside the counts.
TEST(DxsBench, LocalClosedLoopStreamsThroughTheServingLoopAfterAWarmUp) {
  TempDir tmp;
  const std::string dir = testing::WritePreset(tmp, "default");
  const std::string flags =
      " --requests 6 --concurrency 3 --prompt-len 4 --output-len 5 "
      "--format json";
  Output o = RunDxs("bench --local " + dir + flags, tmp);
  ASSERT_EQ(o.exit_code, 0) << o.err;
  nlohmann::json j = nlohmann::json::parse(o.out);
  EXPECT_EQ(j.at("warmup_requests"), 3);
  EXPECT_EQ(j.at("warmup_errors"), 0);
  EXPECT_EQ(j.at("requests"), 6);
  EXPECT_EQ(j.at("output_tokens"), 6 * 5);  // the warm-up's tokens are not counted
  EXPECT_EQ(j.at("errors").size(), 0u);
  EXPECT_GT(j.at("ttft_ms").at("p50").get<double>(), 0);
  EXPECT_GT(j.at("itl_ms").at("p50").get<double>(), 0);
  EXPECT_LE(j.at("ttft_ms").at("p50").get<double>(), j.at("e2e_ms").at("p50").get<double>());

  o = RunDxs("bench --local " + dir + flags + " --warmup-requests 0", tmp);
  ASSERT_EQ(o.exit_code, 0) << o.err;
  j = nlohmann::json::parse(o.out);
  EXPECT_EQ(j.at("warmup_requests"), 0);
  EXPECT_EQ(j.at("output_tokens"), 6 * 5);

  o = RunDxs("bench --local " + dir + flags + " --warmup-requests -1", tmp);
  EXPECT_EQ(o.exit_code, 2);
  EXPECT_NE(o.err.find("--warmup-requests"), std::string::npos) << o.err;
}

// On a terminal the bar is redrawn in place.
TEST(DxsBench, ProgressRedrawsInPlaceOnATerminal) {
  TempDir tmp;
  const std::string dir = testing::WritePreset(tmp, "default");
  const std::string dxs = std::string(DXS_TEST_BIN_DIR) + "/dxs";
  int master = -1;
  const pid_t pid = forkpty(&master, nullptr, nullptr, nullptr);
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    execl(dxs.c_str(), dxs.c_str(), "bench", "--local", dir.c_str(), "--requests", "5",
          "--concurrency", "1", "--prompt-len", "4", "--output-len", "2", "--format", "json",
          static_cast<char*>(nullptr));
    _exit(127);
  }
  std::string output;
  char buf[4096];
  for (ssize_t n; (n = read(master, buf, sizeof(buf))) > 0;) output.append(buf, n);
  close(master);
  int status = 0;
  ASSERT_EQ(waitpid(pid, &status, 0), pid);
  ASSERT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << output;
  EXPECT_NE(output.find("\r[######"), std::string::npos) << output;
  EXPECT_NE(output.find("] 5/5 requests"), std::string::npos) << output;
}

}  // namespace
}  // namespace dxs
