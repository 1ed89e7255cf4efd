// The single-process engine on the CUDA backend against the same engine on the CPU backend
// (itself checked against transformers by golden_test), on the golden presets' shapes and
// prompts, stored in bf16 so that both compute with the same weights:
// - first-token logits within 2e-2 of the largest CPU logit (bf16 weights and activations
//   against float32), unless the two engines routed a token of the prefill to different
//   experts (a near tie that rounding rightly tips; their tokens per expert are compared
//   when the logits differ more);
// - greedy tokens identical up to the first step where the CPU engine's top-2 margin is
//   within the bf16 error, past which the two may rightly part.
// Whole-prompt, chunked and batched prefill. Without a GPU every case skips, saying why.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <set>

#include "absl/strings/str_cat.h"
#include "common/safetensors.h"
#include "gtest/gtest.h"
#include "kernels/make_backend.h"
#include "model/engine.h"
#include "model/random_checkpoint.h"
#include "model/weights.h"
#include "nlohmann/json.hpp"
#include "tests/common/scoped_env.h"
#include "tests/model/decode_sampling_check.h"
#include "tests/model/test_util.h"

namespace dxs {
namespace {

using testing::RelativeError;
using testing::TempDir;

constexpr double kLogitTolerance = 2e-2;
// The same for a block-scaled FP8 checkpoint ("default-fp8"): both engines read the same FP8
// weights (the CPU dequantized to float32, the GPU's kept FP8), but the GPU's GEMMs past 8
// rows (prefill of a batch, the experts' grouped FFN) quantize their activations per token
// and 128 channels to e4m3, as the FP8 recipe does: a relative error of up to 2^-4 per
// activation (3 mantissa bits), through 7 projections in each of 4 layers of a random model.
// Measured on an H100: up to 0.03 where a step's projections take the GEMV (8 rows or fewer,
// bf16 activations) and up to 0.15 through the GEMMs (BatchedRequests' 3-prompt prefill).
constexpr double kFp8LogitTolerance = 0.2;

// `preset` as a block-scaled FP8 checkpoint whose projections are all whole 128-blocks, so
// that the GPU keeps them FP8 (KeepsFp8Weight): hidden 256, q 4 x 64 and k, v 2 x 64
// ([256 | 128, 256]), the experts' 128-wide FFN, and a dense layer (1) with a 256-wide MLP.
void MakeFp8BlockShapes(CheckpointPreset* preset) {
  preset->fp8 = true;
  preset->config.hidden_size = 256;
  preset->config.head_dim = 64;
  preset->config.intermediate_size = 256;
  preset->config.moe_intermediate_size = 128;
  preset->config.mlp_only_layers = {1};
}

std::vector<std::vector<int32_t>> GoldenPrompts(const std::string& preset, int64_t* max_new) {
  std::ifstream f(testing::SourceDir() + "/tests/golden/" + preset + ".json");
  EXPECT_TRUE(f.good()) << "missing golden file for " << preset;
  nlohmann::json j = nlohmann::json::parse(f);
  std::vector<std::vector<int32_t>> prompts;
  for (const auto& c : j.at("cases")) {
    prompts.push_back(c.at("prompt_ids").get<std::vector<int32_t>>());
    *max_new = c.at("max_new_tokens").get<int64_t>();
  }
  return prompts;
}

// The gap between the two largest logits.
float TopTwoMargin(const std::vector<float>& logits) {
  std::vector<float> v = logits;
  std::partial_sort(v.begin(), v.begin() + 2, v.end(), std::greater<float>());
  return v[0] - v[1];
}

float MaxAbs(const std::vector<float>& v) {
  float m = 0.f;
  for (float x : v) m = std::max(m, std::fabs(x));
  return m;
}

class CudaEngineTest : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    absl::StatusOr<std::unique_ptr<Backend>> probe = MakeBackend("cuda");
    if (!probe.ok()) GTEST_SKIP() << "no GPU here: " << probe.status().message();
    // Stored in bf16, the dtype the CUDA backend keeps weights in, so that both engines
    // compute with the very same weights: the comparison measures the arithmetic (bf16
    // activations, fp32 accumulation), not the rounding of f32 weights at load.
    // "NAME-fp8": preset NAME written as a block-scaled FP8 checkpoint (gen-model --fp8), its
    // projections whole 128-blocks so that the GPU keeps them FP8 (KeepsFp8Weight), with a
    // dense layer so that the dense MLP's are FP8 too.
    std::string name = GetParam();
    const bool fp8 = name.size() > 4 && name.substr(name.size() - 4) == "-fp8";
    if (fp8) name = name.substr(0, name.size() - 4);
    absl::StatusOr<CheckpointPreset> preset = GetPreset(name);
    ASSERT_TRUE(preset.ok());
    preset->storage_dtype = DType::kBF16;
    if (fp8) {
      MakeFp8BlockShapes(&*preset);
      tolerance_ = kFp8LogitTolerance;
    }
    model_dir_ = tmp_.path() + "/" + GetParam();
    ASSERT_TRUE(WriteRandomCheckpoint(*preset, model_dir_).ok());
    prompts_ = GoldenPrompts(name, &max_new_);
    ASSERT_FALSE(prompts_.empty());
  }

  std::vector<GenerationResult> Generate(const std::string& device, int64_t chunk, bool batched,
                                         const std::vector<std::vector<int32_t>>& prompts,
                                         int64_t max_new) {
    EngineOptions options;
    options.device = device;
    options.prefill_chunk_tokens = chunk;
    auto engine = LocalEngine::Load(model_dir_, options);
    EXPECT_TRUE(engine.ok()) << engine.status();
    if (!engine.ok()) return {};
    std::vector<GenerationRequest> requests;
    for (const std::vector<int32_t>& p : prompts) {
      GenerationRequest r;
      r.prompt = p;
      r.max_new_tokens = max_new;
      r.ignore_eos = true;
      requests.push_back(r);
    }
    std::vector<GenerationResult> results;
    if (batched) {
      auto out = (*engine)->GenerateBatch(requests);
      EXPECT_TRUE(out.ok()) << out.status();
      if (out.ok()) results = *out;
      return results;
    }
    for (const GenerationRequest& r : requests) {
      auto out = (*engine)->GenerateBatch({r});
      EXPECT_TRUE(out.ok()) << out.status();
      if (out.ok()) results.push_back(out->front());
    }
    return results;
  }

  std::vector<GenerationResult> GenerateRequests(const std::string& device,
                                                 const std::vector<GenerationRequest>& requests) {
    EngineOptions options;
    options.device = device;
    auto engine = LocalEngine::Load(model_dir_, options);
    EXPECT_TRUE(engine.ok()) << engine.status();
    if (!engine.ok()) return {};
    auto out = (*engine)->GenerateBatch(requests);
    EXPECT_TRUE(out.ok()) << out.status();
    return out.ok() ? *out : std::vector<GenerationResult>{};
  }

  void CheckAgainstCpu(int64_t chunk, bool batched) {
    const std::vector<GenerationResult> cpu = Generate("cpu", chunk, batched, prompts_, max_new_);
    const std::vector<GenerationResult> gpu = Generate("cuda", chunk, batched, prompts_, max_new_);
    ASSERT_EQ(cpu.size(), prompts_.size());
    ASSERT_EQ(gpu.size(), prompts_.size());
    for (size_t i = 0; i < prompts_.size(); ++i) {
      SCOPED_TRACE(::testing::Message()
                   << "prompt " << i << " of " << prompts_[i].size() << " tokens");
      ASSERT_EQ(gpu[i].first_logits.size(), cpu[i].first_logits.size());
      const double first_error = RelativeError(gpu[i].first_logits, cpu[i].first_logits);
      std::printf("prompt %zu: first-token logits within %.3g of the CPU's\n", i, first_error);
      if (first_error >= tolerance_) {
        // Allowed only where the two engines routed some token of the prefill to different
        // experts (a near tie that bf16 rounding rightly tips): the prompt alone through
        // both, then their tokens per expert (summed over layers) compared.
        const std::vector<int64_t> cpu_load = PrefillExpertLoad("cpu", prompts_[i]);
        const std::vector<int64_t> gpu_load = PrefillExpertLoad("cuda", prompts_[i]);
        EXPECT_NE(cpu_load, gpu_load)
            << "first-token logits " << first_error << " from the CPU engine's with the "
            << "same routing";
        if (cpu_load != gpu_load) {
          std::printf(
              "prompt %zu: first-token logits %.3g from the CPU's, where the engines "
              "routed a token of the prefill to different experts\n",
              i, first_error);
        }
      }
      // Tokens agree until the CPU's choice was within the bf16 error of the runner-up.
      const size_t n = std::min(cpu[i].tokens.size(), gpu[i].tokens.size());
      size_t step = 0;
      while (step < n && cpu[i].tokens[step] == gpu[i].tokens[step]) ++step;
      if (step == n) {
        EXPECT_EQ(gpu[i].tokens.size(), cpu[i].tokens.size());
        continue;
      }
      // The CPU engine's logits at the step that differs: the prompt plus the agreed tokens.
      std::vector<int32_t> prefix = prompts_[i];
      prefix.insert(prefix.end(), cpu[i].tokens.begin(), cpu[i].tokens.begin() + step);
      const std::vector<GenerationResult> at = Generate("cpu", 0, false, {prefix}, 1);
      ASSERT_EQ(at.size(), 1u);
      const float margin = TopTwoMargin(at[0].first_logits);
      const float bf16_error = 2 * tolerance_ * MaxAbs(at[0].first_logits);
      EXPECT_LT(margin, bf16_error)
          << "greedy tokens differ at step " << step << " where the CPU's top-2 margin " << margin
          << " exceeds the bf16 error " << bf16_error;
    }
  }

  // Tokens per expert (over all layers) of the prefill of `prompt` alone on `device`.
  std::vector<int64_t> PrefillExpertLoad(const std::string& device,
                                         const std::vector<int32_t>& prompt) {
    EngineOptions options;
    options.device = device;
    auto engine = LocalEngine::Load(model_dir_, options);
    EXPECT_TRUE(engine.ok()) << engine.status();
    if (!engine.ok()) return {};
    GenerationRequest r;
    r.prompt = prompt;
    r.max_new_tokens = 1;
    r.ignore_eos = true;
    EXPECT_TRUE((*engine)->GenerateBatch({r}).ok());
    return (*engine)->experts().tokens_per_expert_snapshot();
  }

  TempDir tmp_;
  std::string model_dir_;
  std::vector<std::vector<int32_t>> prompts_;
  int64_t max_new_ = 0;
  double tolerance_ = kLogitTolerance;
};

TEST_P(CudaEngineTest, WholePromptPrefillThenDecode) { CheckAgainstCpu(0, false); }

// Log-probabilities, penalties, logit_bias, min_new_tokens, min_p and prompt scoring through
// the CUDA engine (SampleRows with adjustments and LogprobRows after the first token) against
// the CPU engine on the same bf16 weights. The kernels equal the CPU's on the same logits
// (sampling_cuda_test); here the plumbing is checked: each request gets its own rows, ids and
// order. So log-probabilities agree with the CPU engine's while the tokens agree, within the
// bf16 error of the logits plus 10%, except in a request where the two engines route some
// token of it to different experts (a near tie that bf16 rounding rightly tips, which moves
// whole logits rows: CheckAgainstCpu's rule); and each GPU result is consistent in itself:
// the chosen and named ids read the same value as the top list where they appear in it, and
// the top list falls. The banned and -100-biased ids never appear while they are masked.
TEST_P(CudaEngineTest, SamplingFeaturesMatchTheCpu) {
  std::vector<GenerationRequest> requests;
  for (size_t i = 0; i < prompts_.size(); ++i) {
    GenerationRequest r;
    r.prompt = prompts_[i];
    r.max_new_tokens = 8;
    r.logprobs = true;
    r.top_logprobs = 5;
    r.logprob_token_ids = {3, 7};
    switch (i % 3) {
      case 0:  // greedy with every adjustment
        r.sampling.repetition_penalty = 1.3f;
        r.sampling.frequency_penalty = 0.5f;
        r.sampling.presence_penalty = 0.25f;
        r.sampling.logit_bias = {{5, 4.f}, {9, -100.f}};
        r.min_new_tokens = 4;
        r.stop_token_ids = {5};
        break;
      case 1:  // seeded sampling with min_p and penalties
        r.sampling = {0.8f, 0.95f, 40, 99 + i};
        r.sampling.min_p = 0.05f;
        r.sampling.frequency_penalty = 0.3f;
        break;
      default:  // prompt scoring
        r.prompt_logprobs_start = std::min<int64_t>(2, static_cast<int64_t>(r.prompt.size()) - 1);
        break;
    }
    requests.push_back(r);
  }
  const std::vector<GenerationResult> cpu = GenerateRequests("cpu", requests);
  const std::vector<GenerationResult> gpu = GenerateRequests("cuda", requests);
  ASSERT_EQ(cpu.size(), requests.size());
  ASSERT_EQ(gpu.size(), requests.size());
  // The bf16 error of a log-probability: that of the logits it comes from (twice, for the
  // log-sum-exp), relative to their largest magnitude.
  auto tolerance = [&](const GenerationResult& r) {
    return 2 * tolerance_ * MaxAbs(r.first_logits) + 1e-4;
  };
  // Values beyond the error, per request: allowed only where routing differs (below).
  std::vector<std::string> far(requests.size());
  size_t current = 0;
  auto check = [&](double g, double c, double tol, const char* what) {
    if (std::fabs(g - c) > tol + 0.1 * std::fabs(c)) {
      far[current] += absl::StrCat(what, " ", g, " vs the CPU's ", c, "; ");
    }
  };
  auto expect_near = [&](const TokenLogprobs& g, const TokenLogprobs& c, double tol) {
    check(g.logprob, c.logprob, tol, "logprob");
    ASSERT_EQ(g.named.size(), c.named.size());
    for (size_t j = 0; j < c.named.size(); ++j) check(g.named[j], c.named[j], tol, "named");
    ASSERT_EQ(g.top.size(), c.top.size());
    for (size_t j = 0; j < c.top.size(); ++j) {
      // The ids may swap where two log-probabilities are within the error; the values not.
      check(g.top[j].second, c.top[j].second, tol, "top");
    }
    // In itself: the top list falls, and the ids in it read the same values elsewhere.
    const std::vector<int32_t> named_ids = {3, 7};
    for (size_t j = 0; j < g.top.size(); ++j) {
      if (j > 0) EXPECT_LE(g.top[j].second, g.top[j - 1].second);
      if (g.top[j].first == g.token) EXPECT_FLOAT_EQ(g.logprob, g.top[j].second);
      for (size_t k = 0; k < named_ids.size(); ++k) {
        if (g.top[j].first == named_ids[k]) EXPECT_FLOAT_EQ(g.named[k], g.top[j].second);
      }
    }
  };
  for (size_t i = 0; i < requests.size(); ++i) {
    SCOPED_TRACE(::testing::Message() << "request " << i);
    current = i;
    const double tol = tolerance(cpu[i]);
    ASSERT_EQ(gpu[i].logprobs.size(), gpu[i].tokens.size());
    ASSERT_EQ(cpu[i].logprobs.size(), cpu[i].tokens.size());
    const size_t n = std::min(cpu[i].tokens.size(), gpu[i].tokens.size());
    for (size_t t = 0; t < n; ++t) {
      EXPECT_EQ(gpu[i].logprobs[t].token, gpu[i].tokens[t]);
      if (gpu[i].tokens[t] != cpu[i].tokens[t]) break;  // bf16 tipped a near tie
      expect_near(gpu[i].logprobs[t], cpu[i].logprobs[t], tol);
    }
    if (requests[i].min_new_tokens > 0) {
      for (int64_t t = 0; t < requests[i].min_new_tokens; ++t) {
        EXPECT_NE(gpu[i].tokens.at(t), 5) << "a stop id before min_new_tokens";
      }
    }
    for (size_t t = 0; t < gpu[i].tokens.size(); ++t) EXPECT_NE(gpu[i].tokens[t], 9) << "bias -100";
    ASSERT_EQ(gpu[i].prompt_logprobs.has_value(), cpu[i].prompt_logprobs.has_value());
    if (cpu[i].prompt_logprobs) {
      const PromptLogprobs& g = *gpu[i].prompt_logprobs;
      const PromptLogprobs& c = *cpu[i].prompt_logprobs;
      EXPECT_EQ(g.first_position, c.first_position);
      ASSERT_EQ(g.positions.size(), c.positions.size());
      for (size_t p = 0; p < c.positions.size(); ++p) {
        EXPECT_EQ(g.positions[p].token, c.positions[p].token);
        expect_near(g.positions[p], c.positions[p], tol);
      }
      expect_near(g.next, c.next, tol);
    }
  }
  for (size_t i = 0; i < requests.size(); ++i) {
    if (far[i].empty()) continue;
    // The prompt and the tokens both engines generated, prefilled through each: their
    // tokens per expert must differ for the values to be allowed to.
    std::vector<int32_t> sequence = requests[i].prompt;
    for (size_t t = 0; t < std::min(cpu[i].tokens.size(), gpu[i].tokens.size()); ++t) {
      if (gpu[i].tokens[t] != cpu[i].tokens[t]) break;
      sequence.push_back(cpu[i].tokens[t]);
    }
    const bool routed_apart =
        PrefillExpertLoad("cpu", sequence) != PrefillExpertLoad("cuda", sequence);
    EXPECT_TRUE(routed_apart) << "request " << i << " with the same routing: " << far[i];
    if (routed_apart) {
      std::printf(
          "request %zu: log-probabilities beyond the bf16 error where the engines routed "
          "a token to different experts: %s\n",
          i, far[i].c_str());
    }
  }
}
TEST_P(CudaEngineTest, ChunkedPrefill) { CheckAgainstCpu(3, false); }
TEST_P(CudaEngineTest, BatchedRequests) { CheckAgainstCpu(5, true); }

INSTANTIATE_TEST_SUITE_P(Presets, CudaEngineTest,
                         ::testing::Values("default", "odd", "bf16-sharded", "default-fp8"),
                         [](const auto& info) {
                           std::string n = info.param;
                           std::replace(n.begin(), n.end(), '-', '_');
                           return n;
                         });

// Decode steps replayed from CUDA graphs equal the same padded steps run eagerly, bit for
// bit, across buckets (3 and 5 sequences pad to 4 and 8) and as contexts grow; the KV
// caches written both ways stay equal, so every later step compares like with like.
// The default preset with Qwen3-30B-A3B's attention shape (head_dim 128, GQA 4).
std::string WriteHeadDim128(const TempDir& tmp) {
  absl::StatusOr<CheckpointPreset> preset = GetPreset("default");
  EXPECT_TRUE(preset.ok());
  preset->config.head_dim = 128;
  preset->config.num_attention_heads = 8;
  preset->config.num_key_value_heads = 2;
  const std::string out = tmp.path() + "/default-d128";
  EXPECT_TRUE(WriteRandomCheckpoint(*preset, out).ok());
  return out;
}

// Decode steps of `dir`'s model replayed from graphs against the same padded steps run
// eagerly (see ReplayEqualsEagerExecutionBitForBit).
void ReplayEqualsEager(const std::string& dir) {
  EngineOptions options;
  options.device = "cuda";
  auto graphed = LocalEngine::Load(dir, options);
  auto eager = LocalEngine::Load(dir, options);
  ASSERT_TRUE(graphed.ok() && eager.ok());
  for (int batch : {3, 5}) {
    SCOPED_TRACE(batch);
    KvCache kv_g((*graphed)->config(), (*graphed)->backend(), 4096);
    KvCache kv_e((*eager)->config(), (*eager)->backend(), 4096);
    std::vector<SequenceChunk> g(batch), e(batch);
    for (int s = 0; s < batch; ++s) {
      g[s].kv_slot = *kv_g.Allocate(200);
      e[s].kv_slot = *kv_e.Allocate(200);
      for (int i = 0; i < 20 + 7 * s; ++i) g[s].tokens.push_back(3 + (s * 31 + i * 17) % 500);
      e[s].tokens = g[s].tokens;
    }
    ASSERT_TRUE((*graphed)->model().Forward(g, &kv_g).ok());
    ASSERT_TRUE((*eager)->model().Forward(e, &kv_e).ok());
    for (int step = 0; step < 6; ++step) {
      for (int s = 0; s < batch; ++s) {
        g[s].start_position += static_cast<int64_t>(g[s].tokens.size());
        e[s].start_position = g[s].start_position;
        g[s].tokens = e[s].tokens = {static_cast<int32_t>(7 + (step * 13 + s) % 400)};
      }
      auto lg = (*graphed)->model().ForwardDecode(g, &kv_g, /*use_graph=*/true);
      auto le = (*eager)->model().ForwardDecode(e, &kv_e, /*use_graph=*/false);
      ASSERT_TRUE(lg.ok()) << lg.status();
      ASSERT_TRUE(le.ok()) << le.status();
      auto hg = (*graphed)->backend()->Download(*lg);
      auto he = (*eager)->backend()->Download(*le);
      ASSERT_TRUE(hg.ok() && he.ok());
      ASSERT_EQ(*hg, *he) << "step " << step;
    }
  }
  EXPECT_EQ((*graphed)->model().num_graphs(), 2u);  // one per bucket
  EXPECT_EQ((*eager)->model().num_graphs(), 0u);
}

TEST(CudaGraphs, ReplayEqualsEagerExecutionBitForBit) {
  if (!MakeBackend("cuda").ok()) GTEST_SKIP() << "no GPU here";
  TempDir tmp;
  // The odd preset (head_dim 24: dxs's own attention kernel), and the default preset with
  // Qwen3's head_dim 128 and GQA 4 (FlashInfer's, with its graph plan recorded or not).
  for (const std::string& dir : {testing::WritePreset(tmp, "odd"), WriteHeadDim128(tmp)}) {
    SCOPED_TRACE(dir);
    ReplayEqualsEager(dir);
  }
}

// DXS_CUDA_L2_PREFETCH=all: the recorded graphs carry the prefetch branch (the o-projection
// beside attention, the next layer's q, k and v beside the experts), which must be joined
// before each capture ends (an unjoined branch fails the capture) and change no bit of the
// replays against the eager steps, which take no hints. bf16 and FP8 weights.
TEST(CudaGraphs, L2PrefetchBranchesChangeNoBits) {
  if (!MakeBackend("cuda").ok()) GTEST_SKIP() << "no GPU here";
  testing::ScopedEnv prefetch("DXS_CUDA_L2_PREFETCH", "all");
  TempDir tmp;
  absl::StatusOr<CheckpointPreset> fp8 = GetPreset("default");
  ASSERT_TRUE(fp8.ok());
  MakeFp8BlockShapes(&*fp8);
  const std::string fp8_dir = tmp.path() + "/default-fp8";
  ASSERT_TRUE(WriteRandomCheckpoint(*fp8, fp8_dir).ok());
  for (const std::string& dir : {WriteHeadDim128(tmp), fp8_dir}) {
    SCOPED_TRACE(dir);
    ReplayEqualsEager(dir);
  }
}

// A decode step's sampling recorded in its graph and replayed equals the same sampling run
// after the step on its logits (tests/model/decode_sampling_check.h).
TEST(CudaGraphs, SamplingInTheGraphEqualsSamplingAfterIt) {
  if (!MakeBackend("cuda").ok()) GTEST_SKIP() << "no GPU here";
  TempDir tmp;
  EngineOptions options;
  options.device = "cuda";
  auto engine = LocalEngine::Load(testing::WritePreset(tmp, "default"), options);
  ASSERT_TRUE(engine.ok()) << engine.status();
  testing::DecodeSamplingEqualsSamplingAfterTheStep(engine->get(), /*use_graph=*/true);
  // One graph per kind of sampling: without and with log-probabilities, at each adjustment
  // capacity the growing lists reach.
  EXPECT_GE((*engine)->model().num_graphs(), 3u);
}

// The engine on CUDA over `dir`, with graphs or without (null, and a failure, if it does not
// load).
std::unique_ptr<LocalEngine> CudaEngine(const std::string& dir, bool graphs) {
  EngineOptions options;
  options.device = "cuda";
  options.graphs = graphs;
  auto engine = LocalEngine::Load(dir, options);
  EXPECT_TRUE(engine.ok()) << engine.status();
  return engine.ok() ? *std::move(engine) : nullptr;
}

// Three greedy requests of 3-token prompts, `max_new` tokens each, past EOS.
std::vector<GenerationRequest> ThreeRequests(int64_t max_new) {
  std::vector<GenerationRequest> requests(3);
  for (int i = 0; i < 3; ++i) {
    requests[i].prompt = {static_cast<int32_t>(11 + i), 40, 2};
    requests[i].max_new_tokens = max_new;
    requests[i].ignore_eos = true;
  }
  return requests;
}

// Graphs on and off give the same greedy tokens through the engine.
TEST(CudaGraphs, EngineTokensDoNotDependOnGraphs) {
  if (!MakeBackend("cuda").ok()) GTEST_SKIP() << "no GPU here";
  TempDir tmp;
  const std::string dir = testing::WritePreset(tmp, "default");
  std::vector<std::vector<int32_t>> tokens;
  for (bool graphs : {true, false}) {
    std::unique_ptr<LocalEngine> engine = CudaEngine(dir, graphs);
    ASSERT_NE(engine, nullptr);
    auto out = engine->GenerateBatch(ThreeRequests(12));
    ASSERT_TRUE(out.ok()) << out.status();
    for (const auto& r : *out) tokens.push_back(r.tokens);
  }
  for (int i = 0; i < 3; ++i) EXPECT_EQ(tokens[i], tokens[i + 3]) << i;
}

// Seeded sampling on the device through the engine (Backend::SampleRows after the first
// token): reproducible, seed-sensitive, and top-k 1 is greedy, graphs on or off.
// Overlap scheduling on the GPU (EngineOptions::overlap_schedule: a decode step queued
// behind the running one, its input ids copied on the device from that step's samples, in
// graphs and eagerly): the same tokens, finish reasons and log-probabilities as without.
// The requests end by length (known ahead), so both runs compute the same batches.
TEST(CudaOverlapSchedule, TokensEqualTheEngineWithout) {
  if (!MakeBackend("cuda").ok()) GTEST_SKIP() << "no GPU here";
  TempDir tmp;
  const std::string dir = testing::WritePreset(tmp, "default");
  std::vector<GenerationRequest> requests = ThreeRequests(20);
  GenerationRequest seeded = requests[0];
  seeded.prompt = {70, 71, 72, 73};
  seeded.sampling.temperature = 0.8f;
  seeded.sampling.top_p = 0.9f;
  seeded.sampling.seed = 5;
  seeded.logprobs = true;
  seeded.top_logprobs = 2;
  requests.push_back(seeded);
  for (bool graphs : {true, false}) {
    std::vector<GenerationResult> results[2];
    int64_t overlapped[2] = {0, 0};
    for (int overlap = 0; overlap < 2; ++overlap) {
      EngineOptions options;
      options.device = "cuda";
      options.graphs = graphs;
      options.overlap_schedule = overlap == 1;
      auto engine = LocalEngine::Load(dir, options);
      ASSERT_TRUE(engine.ok()) << engine.status();
      auto out = (*engine)->GenerateBatch(requests);
      ASSERT_TRUE(out.ok()) << out.status();
      results[overlap] = *std::move(out);
      overlapped[overlap] = (*engine)->overlapped_steps();
    }
    EXPECT_EQ(overlapped[0], 0);
    EXPECT_GE(overlapped[1], 15) << "graphs " << graphs;
    for (size_t i = 0; i < requests.size(); ++i) {
      const GenerationResult &on = results[1][i], &off = results[0][i];
      EXPECT_EQ(on.tokens, off.tokens) << "graphs " << graphs << ", request " << i;
      EXPECT_EQ(on.finish_reason, off.finish_reason);
      ASSERT_EQ(on.logprobs.size(), off.logprobs.size());
      for (size_t t = 0; t < on.logprobs.size(); ++t) {
        EXPECT_EQ(on.logprobs[t].logprob, off.logprobs[t].logprob) << "token " << t;
      }
    }
  }
  // A request that stops on a stop id mid-run: its tokens up to it, nothing after.
  std::unique_ptr<LocalEngine> engine = CudaEngine(dir, true);
  ASSERT_NE(engine, nullptr);
  GenerationRequest stop = ThreeRequests(20)[1];
  auto full = engine->GenerateBatch({stop});
  ASSERT_TRUE(full.ok()) << full.status();
  ASSERT_GE(full->front().tokens.size(), 8u);
  stop.stop_token_ids = {full->front().tokens[7]};
  auto stopped = engine->GenerateBatch({stop});
  ASSERT_TRUE(stopped.ok()) << stopped.status();
  const std::vector<int32_t>& all = full->front().tokens;
  const auto first = std::find(all.begin(), all.end(), all[7]);
  EXPECT_EQ(stopped->front().tokens, std::vector<int32_t>(all.begin(), first + 1));
  EXPECT_EQ(stopped->front().finish_reason, FinishReason::kStopToken);
}

TEST(CudaEngineSampling, SeededTokensAreReproducibleAndTopKOneIsGreedy) {
  if (!MakeBackend("cuda").ok()) GTEST_SKIP() << "no GPU here";
  TempDir tmp;
  const std::string dir = testing::WritePreset(tmp, "default");
  for (bool graphs : {true, false}) {
    std::unique_ptr<LocalEngine> engine = CudaEngine(dir, graphs);
    ASSERT_NE(engine, nullptr);
    std::vector<GenerationRequest> requests = ThreeRequests(16);
    requests[1].sampling = {1.0f, 0.9f, 50, 1234};
    requests[2].sampling = {0.8f, 1.0f, 0, 1234};
    auto a = engine->GenerateBatch(requests);
    auto b = engine->GenerateBatch(requests);
    // Top-k 1 gives the greedy tokens, so the whole batch is unchanged.
    requests[0].sampling = {0.7f, 1.0f, 1, 5};
    auto c = engine->GenerateBatch(requests);
    requests[1].sampling.seed = 1235;
    auto d = engine->GenerateBatch(requests);
    ASSERT_TRUE(a.ok() && b.ok() && c.ok() && d.ok());
    for (int i = 0; i < 3; ++i) {
      EXPECT_EQ((*a)[i].tokens, (*b)[i].tokens) << i;
      EXPECT_EQ((*a)[i].tokens, (*c)[i].tokens) << i;
    }
    EXPECT_NE((*d)[1].tokens, (*a)[1].tokens);
  }
}

// n samples on the device: the forked slots read the prompt's shared blocks and the copied
// partial block (a device copy), so greedy samples of one request, decoded side by side in
// one batch, are the same tokens as sample 0, and seeded ones follow their own streams.
TEST(CudaEngineSampling, ForkedSamplesShareThePromptsKv) {
  if (!MakeBackend("cuda").ok()) GTEST_SKIP() << "no GPU here";
  TempDir tmp;
  const std::string dir = testing::WritePreset(tmp, "default");
  std::unique_ptr<LocalEngine> engine = CudaEngine(dir, /*graphs=*/true);
  ASSERT_NE(engine, nullptr);
  GenerationRequest r = ThreeRequests(10)[0];
  r.prompt = {11, 40, 2,  7,  19, 23,  5,  8,  300, 41,
              12, 9,  99, 14, 3,  600, 21, 22, 4};  // 19: partial
  r.n = 4;
  auto greedy = engine->GenerateBatch({r});
  ASSERT_TRUE(greedy.ok()) << greedy.status();
  ASSERT_EQ(greedy->front().samples.size(), 3u);
  for (const GenerationResult& s : greedy->front().samples) {
    EXPECT_EQ(s.tokens, greedy->front().tokens);
  }
  r.sampling = {0.9f, 1.0f, 0, 4242};
  const int64_t before = engine->prefill_tokens();
  auto sampled = engine->GenerateBatch({r});
  ASSERT_TRUE(sampled.ok()) << sampled.status();
  EXPECT_EQ(engine->prefill_tokens() - before, static_cast<int64_t>(r.prompt.size()));
  std::set<std::vector<int32_t>> distinct = {sampled->front().tokens};
  for (const GenerationResult& s : sampled->front().samples) distinct.insert(s.tokens);
  EXPECT_GT(distinct.size(), 1u);
}

// Asking for a GPU that is not there is a clear error, never a crash.
TEST(CudaEngineDevice, MissingGpuIsAClearError) {
  EngineOptions options;
  options.device = "cuda:64";
  TempDir tmp;
  const std::string dir = testing::WritePreset(tmp, "default");
  auto engine = LocalEngine::Load(dir, options);
  ASSERT_FALSE(engine.ok());
  EXPECT_EQ(engine.status().code(), absl::StatusCode::kFailedPrecondition) << engine.status();
  options.device = "tpu";
  engine = LocalEngine::Load(dir, options);
  ASSERT_FALSE(engine.ok());
  EXPECT_EQ(engine.status().code(), absl::StatusCode::kInvalidArgument) << engine.status();
}

// An FP8 checkpoint's projections stay FP8 on the GPU, each with its block scales (what the
// "default-fp8" engine cases above compute with), and DXS_CUDA_FP8_WEIGHTS=off dequantizes
// them to bf16 when loaded (the A/B baseline). The router and the embeddings stay bf16; the
// experts stay FP8 where the FP8 grouped GEMM runs.
TEST(CudaEngineFp8, ProjectionsStayFp8UnlessSwitchedOff) {
  if (!MakeBackend("cuda").ok()) GTEST_SKIP() << "no GPU here";
  TempDir tmp;
  absl::StatusOr<CheckpointPreset> preset = GetPreset("default");
  ASSERT_TRUE(preset.ok());
  MakeFp8BlockShapes(&*preset);
  ASSERT_TRUE(WriteRandomCheckpoint(*preset, tmp.path()).ok());
  absl::StatusOr<std::unique_ptr<Checkpoint>> ckpt = Checkpoint::Open(tmp.path());
  ASSERT_TRUE(ckpt.ok()) << ckpt.status();
  for (const bool on : {true, false}) {
    SCOPED_TRACE(on ? "fp8 weights" : "DXS_CUDA_FP8_WEIGHTS=off");
    if (!on) setenv("DXS_CUDA_FP8_WEIGHTS", "off", 1);
    absl::StatusOr<std::unique_ptr<Backend>> gpu = MakeBackend("cuda");
    unsetenv("DXS_CUDA_FP8_WEIGHTS");
    ASSERT_TRUE(gpu.ok()) << gpu.status();
    if (on && !(*gpu)->capabilities().fp8_block_weights) {
      GTEST_SKIP() << "this GPU keeps no FP8 weights (sm_90 and later)";
    }
    absl::StatusOr<AttentionWeights> w = LoadAttentionWeights(**ckpt, preset->config, gpu->get());
    ASSERT_TRUE(w.ok()) << w.status();
    const DType want = on ? DType::kF8E4M3 : DType::kBF16;
    for (const Tensor* t :
         {&w->layers[0].q_proj, &w->layers[0].k_proj, &w->layers[0].v_proj, &w->layers[0].o_proj,
          &w->layers[1].dense_gate, &w->layers[1].dense_up, &w->layers[1].dense_down}) {
      EXPECT_EQ(t->dtype(), want);
      EXPECT_EQ(t->block_scales() != nullptr, on);
    }
    EXPECT_EQ(w->layers[0].router.dtype(), DType::kBF16);
    EXPECT_EQ(w->embed_tokens.dtype(), DType::kBF16);
    // The experts too, where the FP8 grouped GEMM runs (CUTLASS's SM90 kernels).
    absl::StatusOr<ExpertWeightMap> experts =
        LoadExpertWeights(**ckpt, preset->config, {0, 3}, gpu->get());
    ASSERT_TRUE(experts.ok()) << experts.status();
    const bool fp8_experts = on && (*gpu)->capabilities().fp8_expert_weights;
    for (const auto& [key, ew] : *experts) {
      EXPECT_EQ(ew.gate_up_proj.dtype(), fp8_experts ? DType::kF8E4M3 : DType::kBF16);
      EXPECT_EQ(ew.gate_up_proj.block_scales() != nullptr, fp8_experts);
      EXPECT_EQ(ew.down_proj.dtype(), fp8_experts ? DType::kF8E4M3 : DType::kBF16);
    }
  }
}

}  // namespace
}  // namespace dxs
