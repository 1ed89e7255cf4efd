// The single-process engine beyond the reference: a non-degenerate embedded model, empty
// steps, request validation, sampling determinism, and malformed checkpoints.
#include "model/engine.h"

#include <filesystem>
#include <fstream>
#include <set>

#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/model/test_util.h"

namespace dxs {
namespace {

using testing::TempDir;

class EngineTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = testing::WritePreset(tmp_, "default");
    auto e = LocalEngine::Load(dir_);
    ASSERT_TRUE(e.ok()) << e.status();
    engine_ = std::move(*e);
  }
  GenerationRequest Request(std::vector<int32_t> prompt, int64_t n) {
    GenerationRequest r;
    r.prompt = std::move(prompt);
    r.max_new_tokens = n;
    return r;
  }
  TempDir tmp_;
  std::string dir_;
  std::unique_ptr<LocalEngine> engine_;
};

TEST_F(EngineTest, RoutingSpreadsOverExperts) {
  std::vector<int32_t> prompt;
  for (int i = 0; i < 64; ++i) prompt.push_back(5 + i * 61 % 4000);
  ASSERT_TRUE(engine_->GenerateBatch({Request(prompt, 1)}).ok());
  const std::vector<int64_t> per_expert = engine_->experts().tokens_per_expert_snapshot();
  const int64_t total = 64 * 4 /*layers*/ * 4 /*top-k*/;
  int64_t sum = 0, max = 0;
  int used = 0;
  for (int64_t n : per_expert) {
    sum += n;
    max = std::max(max, n);
    used += n > 0;
  }
  EXPECT_EQ(sum, total);
  EXPECT_EQ(used, 16) << "every expert should receive tokens";
  EXPECT_LT(max, total / 4) << "one expert takes too large a share";
}

TEST_F(EngineTest, GreedyOutputIsNotOneRepeatedToken) {
  auto out = engine_->GenerateBatch({Request({9, 41, 7, 300, 12}, 32)});
  ASSERT_TRUE(out.ok()) << out.status();
  std::set<int32_t> distinct(out->front().tokens.begin(), out->front().tokens.end());
  EXPECT_GE(distinct.size(), 8u) << "greedy output is degenerate";
}

TEST_F(EngineTest, EmptyStepRunsEveryLayerAndReturnsNoLogits) {
  KvCache kv(engine_->config(), engine_->backend(), 1024);
  auto logits = engine_->model().Forward({}, &kv);
  ASSERT_TRUE(logits.ok()) << logits.status();
  EXPECT_EQ(logits->rows(), 0);
  EXPECT_EQ(logits->row_size(), engine_->config().vocab_size);
}

// Two-batch overlap splits a step into two micro-batches that go through the layers
// interleaved. Prefill of several sequences, then decode steps that read the KV written
// by either micro-batch: logits match the one-batch forward pass, token by token.
TEST_F(EngineTest, TwoMicroBatchesGiveTheSameLogitsAsOne) {
  const ModelConfig& config = engine_->config();
  KvCache one(config, engine_->backend(), 4096), two(config, engine_->backend(), 4096);
  const std::vector<std::vector<int32_t>> prompts = {
      {9, 41, 7, 300, 12}, {5}, {1000, 2000, 3000}, {17, 18, 19, 20, 21, 22, 23, 24}, {77, 78}};
  std::vector<SequenceChunk> step;
  for (const auto& prompt : prompts) {
    auto slot_one = one.Allocate(64);
    auto slot_two = two.Allocate(64);
    ASSERT_TRUE(slot_one.ok() && slot_two.ok());
    ASSERT_EQ(*slot_one, *slot_two);
    step.push_back({*slot_one, 0, prompt});
  }
  for (int s = 0; s < 6; ++s) {
    auto a = engine_->model().Forward(step, &one, 1);
    auto b = engine_->model().Forward(step, &two, 2);
    ASSERT_TRUE(a.ok()) << a.status();
    ASSERT_TRUE(b.ok()) << b.status();
    ASSERT_EQ(a->rows(), static_cast<int64_t>(step.size()));
    ASSERT_EQ(b->rows(), a->rows());
    const std::vector<float> va = *engine_->backend()->Download(*a);
    const std::vector<float> vb = *engine_->backend()->Download(*b);
    EXPECT_LT(testing::RelativeError(vb, va), 1e-5) << "step " << s;
    // Next step: every sequence decodes its greedy token (from the one-batch logits).
    for (size_t i = 0; i < step.size(); ++i) {
      const float* row = va.data() + i * config.vocab_size;
      const int32_t next =
          static_cast<int32_t>(std::max_element(row, row + config.vocab_size) - row);
      step[i].start_position += static_cast<int64_t>(step[i].tokens.size());
      step[i].tokens = {next};
    }
    if (s == 3) step.resize(1);  // one chunk: the second micro-batch is empty
  }
  auto empty = engine_->model().Forward({}, &two, 2);
  ASSERT_TRUE(empty.ok()) << empty.status();
  EXPECT_EQ(empty->rows(), 0);
  EXPECT_FALSE(engine_->model().Forward(step, &two, 3).ok()) << "3 micro-batches is not a mode";
}

// A random preset made in place (Backend::FillUniform) is the checkpoint on disk, value for
// value: the same tokens and bit-identical logits, in f32 and bf16 storage.
TEST(RandomWeightsTest, InPlaceModelEqualsTheWrittenCheckpoint) {
  for (const std::string name : {"default", "bf16-sharded", "odd"}) {
    SCOPED_TRACE(name);
    TempDir tmp;
    auto from_disk = LocalEngine::Load(testing::WritePreset(tmp, name));
    ASSERT_TRUE(from_disk.ok()) << from_disk.status();
    absl::StatusOr<CheckpointPreset> preset = GetPreset(name);
    ASSERT_TRUE(preset.ok());
    auto in_place = LocalEngine::LoadRandom(*preset);
    ASSERT_TRUE(in_place.ok()) << in_place.status();
    GenerationRequest r;
    r.prompt = {3, 141, 59, 26};
    r.max_new_tokens = 6;
    auto a = (*from_disk)->GenerateBatch({r});
    auto b = (*in_place)->GenerateBatch({r});
    ASSERT_TRUE(a.ok() && b.ok());
    EXPECT_EQ(a->front().tokens, b->front().tokens);
    EXPECT_EQ(a->front().first_logits, b->front().first_logits);
  }
}

// An in-place directory (gen-model --in-place: config.json and the recipe, no safetensors)
// opens as the written checkpoint, value for value, a skewed gate and a cut layer count
// included; its fingerprint is its own and follows the recipe.
TEST(RandomWeightsTest, InPlaceDirectoryEqualsTheWrittenCheckpoint) {
  for (const std::string name : {"default", "odd"}) {
    SCOPED_TRACE(name);
    TempDir tmp;
    absl::StatusOr<CheckpointPreset> preset = GetPreset(name);
    ASSERT_TRUE(preset.ok());
    preset->seed = 77;
    preset->config.num_hidden_layers -= 1;
    preset->router_skew = 1.0;
    preset->router_scales.assign(preset->config.num_experts, 1.0);
    preset->router_scales[0] = 3.0;  // expert 0 hot: the scales must travel in the recipe
    const std::string disk = tmp.path() + "/disk", recipe = tmp.path() + "/recipe";
    ASSERT_TRUE(WriteRandomCheckpoint(*preset, disk).ok());
    ASSERT_TRUE(WriteInPlaceCheckpoint(*preset, recipe).ok());
    EXPECT_FALSE(std::filesystem::exists(recipe + "/model.safetensors"));
    absl::StatusOr<CheckpointPreset> read = ReadInPlaceCheckpoint(recipe);
    ASSERT_TRUE(read.ok()) << read.status();
    EXPECT_EQ(read->seed, 77u);
    EXPECT_EQ(read->router_scales, preset->router_scales);
    EXPECT_EQ(read->config.num_hidden_layers, preset->config.num_hidden_layers);
    auto from_disk = LocalEngine::Load(disk);
    ASSERT_TRUE(from_disk.ok()) << from_disk.status();
    auto in_place = LocalEngine::Load(recipe);
    ASSERT_TRUE(in_place.ok()) << in_place.status();
    GenerationRequest r;
    r.prompt = {3, 141, 59, 26};
    r.max_new_tokens = 6;
    auto a = (*from_disk)->GenerateBatch({r});
    auto b = (*in_place)->GenerateBatch({r});
    ASSERT_TRUE(a.ok() && b.ok());
    EXPECT_EQ(a->front().tokens, b->front().tokens);
    EXPECT_EQ(a->front().first_logits, b->front().first_logits);

    absl::StatusOr<std::string> fp = CheckpointFingerprint(recipe);
    ASSERT_TRUE(fp.ok());
    preset->seed = 78;
    const std::string other = tmp.path() + "/other";
    ASSERT_TRUE(WriteInPlaceCheckpoint(*preset, other).ok());
    absl::StatusOr<std::string> other_fp = CheckpointFingerprint(other);
    ASSERT_TRUE(other_fp.ok());
    EXPECT_NE(*fp, *other_fp) << "the seed is part of the model's identity";
  }
}

// gen-model --fp8: every *_proj.weight is F8_E4M3 with its block scales and the rest is as
// before; the checkpoint (one file or sharded) and its in-place recipe (and LoadRandom) give
// the same model value for value, and it stays close to the unquantized one.
TEST(RandomWeightsTest, Fp8CheckpointInPlaceAndOnDiskAgree) {
  for (const std::string name : {"odd", "bf16-sharded"}) {
    SCOPED_TRACE(name);
    TempDir tmp;
    absl::StatusOr<CheckpointPreset> preset = GetPreset(name);
    ASSERT_TRUE(preset.ok());
    preset->fp8 = true;
    const std::string disk = tmp.path() + "/disk", recipe = tmp.path() + "/recipe";
    ASSERT_TRUE(WriteRandomCheckpoint(*preset, disk).ok());
    ASSERT_TRUE(WriteInPlaceCheckpoint(*preset, recipe).ok());
    absl::StatusOr<CheckpointPreset> read = ReadInPlaceCheckpoint(recipe);
    ASSERT_TRUE(read.ok()) << read.status();
    EXPECT_TRUE(read->fp8);
    auto ckpt = Checkpoint::Open(disk);
    ASSERT_TRUE(ckpt.ok()) << ckpt.status();
    ASSERT_TRUE((*ckpt)->fp8().has_value());
    int quantized = 0;
    for (const std::string& t : (*ckpt)->TensorNames()) {
      const TensorView* view = *(*ckpt)->Find(t);
      if (IsFp8QuantizedTensor(t)) {
        EXPECT_EQ(view->dtype, DType::kF8E4M3) << t;
        EXPECT_TRUE((*ckpt)->Has(t + kFp8ScaleSuffix)) << t;
        ++quantized;
      } else if (t.find(kFp8ScaleSuffix) == std::string::npos) {
        EXPECT_EQ(view->dtype, preset->storage_dtype) << t;
      }
    }
    EXPECT_GT(quantized, 0);

    auto from_disk = LocalEngine::Load(disk);
    ASSERT_TRUE(from_disk.ok()) << from_disk.status();
    auto in_place = LocalEngine::Load(recipe);
    ASSERT_TRUE(in_place.ok()) << in_place.status();
    auto random = LocalEngine::LoadRandom(*preset);
    ASSERT_TRUE(random.ok()) << random.status();
    auto unquantized = LocalEngine::Load(testing::WritePreset(tmp, name));
    ASSERT_TRUE(unquantized.ok()) << unquantized.status();
    GenerationRequest r;
    r.prompt = {3, 141, 59, 26};
    r.max_new_tokens = 6;
    auto a = (*from_disk)->GenerateBatch({r});
    auto b = (*in_place)->GenerateBatch({r});
    auto c = (*random)->GenerateBatch({r});
    auto u = (*unquantized)->GenerateBatch({r});
    ASSERT_TRUE(a.ok() && b.ok() && c.ok() && u.ok());
    EXPECT_EQ(a->front().tokens, b->front().tokens);
    EXPECT_EQ(a->front().first_logits, b->front().first_logits);
    EXPECT_EQ(a->front().first_logits, c->front().first_logits);
    // FP8 moves the logits, but not far: e4m3 keeps 3 mantissa bits, up to 1/16 relative
    // error per weight (about 0.1 of the logits' scale after these few layers).
    EXPECT_NE(a->front().first_logits, u->front().first_logits);
    EXPECT_LT(testing::RelativeError(a->front().first_logits, u->front().first_logits), 0.25);
  }
}

TEST(RandomWeightsTest, ABadRecipeIsAClearError) {
  TempDir tmp;
  absl::StatusOr<CheckpointPreset> preset = GetPreset("default");
  ASSERT_TRUE(preset.ok());
  const std::string dir = tmp.path() + "/recipe";
  ASSERT_TRUE(WriteInPlaceCheckpoint(*preset, dir).ok());
  for (const std::string text :
       {std::string("{not json"), std::string(R"({"format": "something else"})"),
        std::string(R"({"format": "dxs in-place random weights", "format_version": 1,)"
                    R"( "preset": "default", "seed": 1, "storage_dtype": "int3"})")}) {
    SCOPED_TRACE(text);
    std::ofstream(dir + "/" + kInPlaceWeightsFile) << text;
    auto engine = LocalEngine::Load(dir);
    ASSERT_FALSE(engine.ok());
    EXPECT_EQ(engine.status().code(), absl::StatusCode::kInvalidArgument) << engine.status();
  }
}

TEST_F(EngineTest, RejectsBadRequestsNamingTheField) {
  struct Case {
    GenerationRequest r;
    std::string field;
  };
  std::vector<Case> cases;
  cases.push_back({Request({}, 4), "prompt"});
  cases.push_back({Request({1, 4096}, 4), "prompt"});
  cases.push_back({Request({1, -1}, 4), "prompt"});
  cases.push_back({Request({1}, 0), "max_new_tokens"});
  cases.push_back({Request({1}, 4096), "max_new_tokens"});
  GenerationRequest t = Request({1}, 4);
  t.sampling.temperature = -1;
  cases.push_back({t, "temperature"});
  GenerationRequest p = Request({1}, 4);
  p.sampling.top_p = 0;
  cases.push_back({p, "top_p"});
  GenerationRequest k = Request({1}, 4);
  k.sampling.top_k = -2;
  cases.push_back({k, "top_k"});
  for (const Case& c : cases) {
    auto out = engine_->GenerateBatch({c.r});
    ASSERT_FALSE(out.ok()) << c.field;
    EXPECT_EQ(out.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(out.status().message().find(c.field), std::string::npos) << out.status();
  }
  // The engine still works after rejecting.
  EXPECT_TRUE(engine_->GenerateBatch({Request({1, 2, 3}, 2)}).ok());
}

TEST_F(EngineTest, KvCapacityIsEnforced) {
  EngineOptions options;
  options.kv_capacity_tokens = 8;
  auto small = LocalEngine::Load(dir_, options);
  ASSERT_TRUE(small.ok());
  auto out = (*small)->GenerateBatch({Request({1, 2, 3, 4, 5}, 4)});
  ASSERT_FALSE(out.ok());
  EXPECT_EQ(out.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_TRUE((*small)->GenerateBatch({Request({1, 2, 3}, 4)}).ok());
}

// n samples of one prompt: the prompt is prefilled once (the engine's counter) and each
// sample equals a single request with its derived seed (SampleSeed), also with penalties,
// logprobs and chunked prefill; greedy samples are all the greedy tokens.
TEST_F(EngineTest, NSamplesEqualSingleRequestsWithDerivedSeeds) {
  for (const int64_t chunk : {int64_t{0}, int64_t{3}}) {
    EngineOptions options;
    options.prefill_chunk_tokens = chunk;
    auto engine = LocalEngine::Load(dir_, options);
    ASSERT_TRUE(engine.ok()) << engine.status();
    GenerationRequest r = Request({9, 41, 7, 300, 12, 5, 77, 1000, 3, 18, 64}, 12);
    r.ignore_eos = true;
    r.sampling.temperature = 0.9f;
    r.sampling.top_k = 40;
    r.sampling.seed = 77;
    r.sampling.frequency_penalty = 0.4f;
    r.logprobs = true;
    r.top_logprobs = 3;
    r.n = 4;
    const int64_t before = (*engine)->prefill_tokens();
    auto group = (*engine)->GenerateBatch({r, Request({5, 6}, 3)});
    ASSERT_TRUE(group.ok()) << group.status();
    EXPECT_EQ((*engine)->prefill_tokens() - before, 11 + 2) << "the prompt prefilled once";
    const GenerationResult& g = group->front();
    ASSERT_EQ(g.samples.size(), 3u);
    std::set<std::vector<int32_t>> distinct;
    for (int32_t i = 0; i < 4; ++i) {
      SCOPED_TRACE(::testing::Message() << "chunk " << chunk << " sample " << i);
      const GenerationResult& got = i == 0 ? g : g.samples[i - 1];
      GenerationRequest single = r;
      single.n = 1;
      single.sampling.seed = SampleSeed(r.sampling.seed, i);
      auto want = (*engine)->GenerateBatch({single});
      ASSERT_TRUE(want.ok()) << want.status();
      EXPECT_EQ(got.tokens, want->front().tokens);
      EXPECT_EQ(got.finish_reason, want->front().finish_reason);
      ASSERT_EQ(got.logprobs.size(), want->front().logprobs.size());
      for (size_t t = 0; t < got.logprobs.size(); ++t) {
        EXPECT_EQ(got.logprobs[t].logprob, want->front().logprobs[t].logprob);
        EXPECT_EQ(got.logprobs[t].top, want->front().logprobs[t].top);
      }
      distinct.insert(got.tokens);
    }
    EXPECT_GT(distinct.size(), 1u) << "the samples draw from different streams";
  }
  GenerationRequest greedy = Request({9, 41, 7}, 6);
  const auto one = engine_->GenerateBatch({greedy});
  greedy.n = 3;
  const auto three = engine_->GenerateBatch({greedy});
  ASSERT_TRUE(one.ok() && three.ok());
  EXPECT_EQ(three->front().tokens, one->front().tokens);
  for (const GenerationResult& s : three->front().samples) EXPECT_EQ(s.tokens, one->front().tokens);
  greedy.n = kMaxSamples + 1;
  EXPECT_EQ(engine_->GenerateBatch({greedy}).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST_F(EngineTest, SeededSamplingIsReproducibleAndSeedSensitive) {
  GenerationRequest r = Request({9, 41, 7}, 24);
  r.sampling.temperature = 1.0f;
  r.sampling.top_p = 0.9f;
  r.sampling.top_k = 50;
  r.sampling.seed = 1234;
  auto a = engine_->GenerateBatch({r});
  auto b = engine_->GenerateBatch({r});
  r.sampling.seed = 1235;
  auto c = engine_->GenerateBatch({r});
  ASSERT_TRUE(a.ok() && b.ok() && c.ok());
  EXPECT_EQ(a->front().tokens, b->front().tokens);
  EXPECT_NE(a->front().tokens, c->front().tokens);
}

// Seeded tokens are pinned: the draw of token k of a request is SplitMix64 output k of its
// seed, whether the step samples on the host or on the backend, batched with greedy
// requests or not. The values were recorded with the host sampler.
TEST_F(EngineTest, SeededSamplingTokensArePinned) {
  std::vector<GenerationRequest> batch;
  batch.push_back(Request({9, 41, 7}, 12));  // greedy
  batch.push_back(Request({9, 41, 7}, 12));
  batch.back().sampling = {1.0f, 0.9f, 50, 1234};
  batch.push_back(Request({100, 200, 300, 400}, 12));
  batch.back().sampling = {0.8f, 1.0f, 0, 7};
  batch.push_back(Request({5, 6}, 12));
  batch.back().sampling = {1.3f, 0.5f, 0, 99};
  batch.push_back(Request({77}, 12));
  batch.back().sampling = {2.0f, 1.0f, 20, 0xdeadbeefcafef00dull};
  auto out = engine_->GenerateBatch(batch);
  ASSERT_TRUE(out.ok()) << out.status();
  const std::vector<std::vector<int32_t>> want = {
      {313, 2917, 2375, 1051, 1238, 2621, 747, 1192, 2155, 2291, 3617, 3257},
      {1463, 4013, 802, 1576, 414, 2575, 3870, 1576, 899, 2351, 4038, 3884},
      {194, 2927, 1349, 1624, 1515, 467, 2184, 2268, 1871, 3996, 1468, 2904},
      {3969, 1043, 3066, 3808, 1940, 936, 2255, 3511, 3528, 625, 3171, 3296},
      {1529, 3145, 1984, 1683, 221, 3273, 3951, 3504, 1165, 382, 1511, 3473}};
  ASSERT_EQ(out->size(), want.size());
  for (size_t i = 0; i < want.size(); ++i) EXPECT_EQ((*out)[i].tokens, want[i]) << "request " << i;
}

TEST_F(EngineTest, TopKOneSamplingEqualsGreedy) {
  GenerationRequest greedy = Request({100, 200, 300}, 12);
  GenerationRequest sampled = greedy;
  sampled.sampling.temperature = 0.7f;
  sampled.sampling.top_k = 1;
  sampled.sampling.seed = 5;
  auto g = engine_->GenerateBatch({greedy});
  auto s = engine_->GenerateBatch({sampled});
  ASSERT_TRUE(g.ok() && s.ok());
  EXPECT_EQ(g->front().tokens, s->front().tokens);
}

TEST_F(EngineTest, StopsOnStopTokenAndEos) {
  auto first = engine_->GenerateBatch({Request({9, 41, 7}, 8)});
  ASSERT_TRUE(first.ok());
  const std::vector<int32_t> tokens = first->front().tokens;
  GenerationRequest r = Request({9, 41, 7}, 8);
  r.stop_token_ids = {tokens[2]};
  auto stopped = engine_->GenerateBatch({r});
  ASSERT_TRUE(stopped.ok());
  EXPECT_EQ(stopped->front().finish_reason, FinishReason::kStopToken);
  EXPECT_EQ(stopped->front().tokens, std::vector<int32_t>(tokens.begin(), tokens.begin() + 3));
  EXPECT_EQ(first->front().finish_reason, FinishReason::kLength);
}

// Malformed checkpoints fail to load with an error naming the file and the tensor.
class MalformedCheckpointTest : public ::testing::Test {
 protected:
  void SetUp() override { dir_ = testing::WritePreset(tmp_, "default"); }
  TempDir tmp_;
  std::string dir_;
};

TEST_F(MalformedCheckpointTest, TruncatedFile) {
  const std::string f = dir_ + "/model.safetensors";
  std::filesystem::resize_file(f, std::filesystem::file_size(f) / 2);
  auto e = LocalEngine::Load(dir_);
  ASSERT_FALSE(e.ok());
  EXPECT_NE(e.status().message().find("model.safetensors"), std::string::npos) << e.status();
}

TEST_F(MalformedCheckpointTest, MissingExpertTensor) {
  // Rewrite the checkpoint with one expert tensor gone.
  auto preset = GetPreset("default");
  ASSERT_TRUE(preset.ok());
  auto ckpt = Checkpoint::Open(dir_);
  ASSERT_TRUE(ckpt.ok());
  SafetensorsWriter w;
  const std::string gone = "model.layers.2.mlp.experts.5.up_proj.weight";
  for (const std::string& name : (*ckpt)->TensorNames()) {
    if (name == gone) continue;
    const TensorView* t = *(*ckpt)->Find(name);
    w.Add(name, t->dtype, t->shape, *(*ckpt)->ReadFloat32(name, t->shape));
  }
  TempDir other;
  ASSERT_TRUE(w.WriteDirectory(other.path()).ok());
  std::filesystem::copy_file(dir_ + "/config.json", other.path() + "/config.json");
  auto e = LocalEngine::Load(other.path());
  ASSERT_FALSE(e.ok());
  EXPECT_EQ(e.status().code(), absl::StatusCode::kNotFound);
  EXPECT_NE(e.status().message().find(gone), std::string::npos) << e.status();
}

TEST_F(MalformedCheckpointTest, WrongShapeInConfig) {
  // The config says hidden 96, the tensors are 128 wide.
  std::ifstream in(dir_ + "/config.json");
  nlohmann::json cfg = nlohmann::json::parse(in);
  cfg["hidden_size"] = 96;
  std::ofstream(dir_ + "/config.json") << cfg.dump();
  auto e = LocalEngine::Load(dir_);
  ASSERT_FALSE(e.ok());
  EXPECT_EQ(e.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(e.status().message().find("model.embed_tokens.weight"), std::string::npos)
      << e.status();
  EXPECT_NE(e.status().message().find("model.safetensors"), std::string::npos) << e.status();
}

TEST_F(MalformedCheckpointTest, MissingDirectory) {
  auto e = LocalEngine::Load(tmp_.path() + "/nope");
  ASSERT_FALSE(e.ok());
  EXPECT_NE(e.status().message().find("nope"), std::string::npos) << e.status();
}

}  // namespace
}  // namespace dxs
