// dxs model benchmark (a benchmark, not a test): prints
//  1. single-process decode tokens/s on the embedded model at batch 1 and 16, and
//  2. the GEMM rate of one Qwen3-30B-A3B-shaped MoE layer (hidden 2048, 128 experts,
//     moe_intermediate 768, top-8) against the BLAS's own rate on a large square GEMM,
//     measured in the same run, with the ratio.
// Usage: model_bench [--quick]
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <numeric>
#include <thread>

#include "expert_service/expert_compute.h"
#include "kernels/backend.h"
#include "model/engine.h"
#include "model/expert_shard.h"
#include "model/random_checkpoint.h"
#include "model/sampler.h"

namespace dxs {
namespace {

using Clock = std::chrono::steady_clock;

double Seconds(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

std::vector<float> Random(int64_t n, uint64_t seed, float scale) {
  SplitMix64 rng(seed);
  std::vector<float> v(n);
  for (auto& x : v) x = static_cast<float>((2 * rng.NextDouble() - 1) * scale);
  return v;
}

// Decode tokens/s at `batch` sequences, each with a 16-token prompt, over `steps` steps.
double DecodeTokensPerSecond(LocalEngine* engine, int batch, int steps) {
  const ModelConfig& c = engine->config();
  KvCache kv(c, engine->backend(), int64_t{1} << 22);
  std::vector<SequenceChunk> chunks(batch);
  for (int b = 0; b < batch; ++b) {
    chunks[b].kv_slot = *kv.Allocate(16 + steps + 1);
    for (int i = 0; i < 16; ++i) chunks[b].tokens.push_back(3 + (b * 131 + i * 17) % 4000);
  }
  auto logits = engine->model().Forward(chunks, &kv);  // prefill
  std::vector<double> step_s;
  for (int s = 0; s < steps; ++s) {
    for (int b = 0; b < batch; ++b) {
      chunks[b].start_position += static_cast<int64_t>(chunks[b].tokens.size());
      chunks[b].tokens = {Argmax(logits->f32() + b * c.vocab_size, c.vocab_size)};
    }
    auto t0 = Clock::now();
    logits = engine->model().Forward(chunks, &kv);
    step_s.push_back(Seconds(t0, Clock::now()));
  }
  return batch / Median(step_s);
}

// GFLOP/s of one MoE layer's expert GEMMs at `tokens` tokens, top-8 of 128 experts.
double MoeLayerGflops(ExpertShard* shard, Backend* backend, int64_t tokens, int reps) {
  const int64_t hidden = 2048, inter = 768, experts = 128, top_k = 8;
  Tensor x = *backend->Upload(Random(tokens * hidden, 11, 1.f), {tokens, hidden});
  Tensor out = *backend->Allocate({tokens, hidden});
  SplitMix64 rng(tokens);
  ShardCompute compute(shard);  // what an expert worker runs
  RoutedPairs pairs;
  for (int64_t t = 0; t < tokens; ++t) {
    std::vector<int> pick(experts);
    std::iota(pick.begin(), pick.end(), 0);
    for (int k = 0; k < top_k; ++k) {
      std::swap(pick[k], pick[k + rng.Next() % (experts - k)]);
      pairs.Add(static_cast<int32_t>(t), pick[k], 1.f / top_k);
    }
  }
  const RoutedPairTensors on_backend = *UploadRoutedPairs(pairs, backend);
  std::vector<double> times;
  for (int r = 0; r < reps; ++r) {
    auto t0 = Clock::now();
    (void)compute.Forward(0, x, on_backend, &out);
    times.push_back(Seconds(t0, Clock::now()));
  }
  const double flops = 2.0 * 3 * hidden * inter * tokens * top_k;
  return flops / Median(times) / 1e9;
}

double SquareGemmGflops(Backend* backend, int64_t n, int reps) {
  Tensor a = *backend->Upload(Random(n * n, 1, 1.f), {n, n});
  Tensor b = *backend->Upload(Random(n * n, 2, 1.f), {n, n});
  Tensor c = *backend->Allocate({n, n});
  std::vector<double> times;
  for (int r = 0; r < reps; ++r) {
    auto t0 = Clock::now();
    (void)backend->Linear(a, b, nullptr, &c);
    times.push_back(Seconds(t0, Clock::now()));
  }
  return 2.0 * n * n * n / Median(times) / 1e9;
}

int Main(bool quick) {
  std::printf("dxs model_bench: CPU, %u hardware threads, float32, OpenBLAS\n",
              std::thread::hardware_concurrency());
  const std::string dir =
      (std::filesystem::temp_directory_path() / "dxs_bench_default_model").string();
  auto preset = GetPreset("default");
  if (!preset.ok() || !WriteRandomCheckpoint(*preset, dir).ok()) return 1;
  auto engine = LocalEngine::Load(dir);
  if (!engine.ok()) {
    std::fprintf(stderr, "%s\n", engine.status().ToString().c_str());
    return 1;
  }
  const int steps = quick ? 8 : 48;
  std::printf("\n[decode] embedded model (4 layers, 16 experts top-4, hidden 128)\n");
  for (int batch : {1, 16}) {
    std::printf("  batch %2d: %8.1f tokens/s (median step of %d)\n", batch,
                DecodeTokensPerSecond(engine->get(), batch, steps), steps);
  }

  std::printf("\n[moe layer] Qwen3-30B-A3B shape: hidden 2048, 128 experts, inter 768, top-8\n");
  auto backend = MakeCpuBackend();
  ModelConfig c = GetPreset("qwen3-30b-a3b")->config;
  c.num_hidden_layers = 1;
  ExpertWeightMap weights;
  for (int e = 0; e < 128; ++e) {
    const float s = 1.f / std::sqrt(2048.f);
    std::vector<float> gate_up = Random(768 * 2048, 3 * e, s);
    const std::vector<float> up = Random(768 * 2048, 3 * e + 1, s);
    gate_up.insert(gate_up.end(), up.begin(), up.end());
    weights[{0, e}] =
        ExpertWeights{*backend->Upload(gate_up, {2 * 768, 2048}),
                      *backend->Upload(Random(2048 * 768, 3 * e + 2, s), {2048, 768})};
  }
  ExpertShard shard(c, std::move(weights), backend.get());
  const int reps = quick ? 2 : 5;
  const double square = SquareGemmGflops(backend.get(), quick ? 1024 : 2048, reps);
  std::printf("  BLAS square sgemm %d^3: %8.1f GFLOP/s\n", quick ? 1024 : 2048, square);
  for (int64_t tokens : {16, 256, 2048}) {
    if (quick && tokens > 256) break;
    const double moe = MoeLayerGflops(&shard, backend.get(), tokens, reps);
    std::printf("  MoE layer, %5lld tokens: %8.1f GFLOP/s  = %.2fx of square sgemm\n",
                static_cast<long long>(tokens), moe, moe / square);
  }
  return 0;
}

}  // namespace
}  // namespace dxs

int main(int argc, char** argv) {
  const bool quick = argc > 1 && std::strcmp(argv[1], "--quick") == 0;
  return dxs::Main(quick);
}
