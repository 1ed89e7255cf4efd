// dxs GPU benchmark (a benchmark, not a test): the CUDA backend on one GPU, each figure
// beside the ceiling it is judged against, measured in the same run. Timing: CUDA events
// on the backend's stream, after warm-up, medians; inputs are seeded random values.
//
//   [rates]     HBM device-to-device copy rate and the bf16 GEMM rate (cuBLAS, 8192^3)
//   [ffn]       the grouped expert FFN (gate, up, SiLU*mul, down) on Qwen3-30B-A3B expert
//               shapes (128 experts, hidden 2048, inter 768, top-8): time, TFLOP/s, and the
//               rate its weights are read at against the copy rate
//   [attention] paged decode attention (32 heads, 4 KV heads, d 128): against the floor of
//               reading the KV cache once at the copy rate
//   [decode]    decode tokens/s of the whole Qwen3-30B-A3B shape (48 layers, random bf16
//               made on the GPU) at batch 1/32/128, context 1k, against the HBM floor
//               (active weights + KV read per step at the copy rate)
//   [prefill]   one 4096-token prompt: tokens/s and the fraction of the GEMM rate
//
// Usage: gpu_bench [--quick] [--layers N] [--json FILE] [--profile WHAT [--batch N]]
//   --layers N: the decode/prefill model with N layers instead of 48 (quick checks).
//   --profile attention|decode|prefill: only that part, with one call of it between
//     cudaProfilerStart/Stop, for `ncu --profile-from-start off` (decode at --batch N).
//   --json: one JSON object per figure, for bench/gpu/report.py.
//   --low-latency: only [decode-ll], the decode steps with the MoE over the low-latency
//     exchange to expert ranks of this process, beside local experts.
//   --sampling: only [sampling], the engine's generation loop with OpenAI-style sampling
//     features on every request (penalties, min_p, top-20 logprobs) beside plain sampling.
//   --fp8: only [rates], [fp8-linear] and [fp8-ffn]: Linear and the experts' grouped FFN of
//     block-scaled FP8 weights beside bf16 weights, decode to prefill sizes (with --profile
//     ffn: one bf16 and one FP8 grouped FFN call at --batch tokens, nothing else timed).
//   --fp8-decode: only [rates] and [decode-fp8]: the whole model's decode and prefill with
//     bf16 weights, then with FP8 projections (with --profile decode: the FP8 decode step
//     alone, at --batch; with --profile prefill: the FP8 engine's 4096-token prompt alone;
//     --decode-batches 128: only those batches).
#include <cuda_profiler_api.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <numeric>
#include <optional>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "common/status_macros.h"
#include "dataplane/low_latency/cuda/cuda_low_latency_exchange.h"
#include "kernels/backend.h"
#include "kernels/cuda/cuda_backend.h"
#if DXS_HAVE_FLASHINFER
#include "kernels/cuda/flashinfer_attention.cuh"
#endif
#include "expert_service/local_low_latency_experts.h"
#include "model/engine.h"
#include "model/random_checkpoint.h"
#include "model/sampler.h"
#include "model/weights.h"
#include "nlohmann/json.hpp"

namespace dxs {
namespace {

#define BENCH_CHECK(expr)                                                        \
  do {                                                                           \
    if (auto _s = (expr); !_s.ok()) {                                            \
      std::fprintf(stderr, "gpu_bench: %s: %s\n", #expr, _s.ToString().c_str()); \
      std::exit(1);                                                              \
    }                                                                            \
  } while (0)

template <typename T>
T Must(absl::StatusOr<T> v, const char* what) {
  if (!v.ok()) {
    std::fprintf(stderr, "gpu_bench: %s: %s\n", what, v.status().ToString().c_str());
    std::exit(1);
  }
  return std::move(*v);
}

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// Median milliseconds of `body` over `reps` runs after `warmup`, timed with CUDA events on
// `stream` (the body enqueues on it).
double TimeMs(cudaStream_t stream, int warmup, int reps, const std::function<void()>& body) {
  for (int i = 0; i < warmup; ++i) body();
  cudaEvent_t start, stop;
  cudaEventCreate(&start);
  cudaEventCreate(&stop);
  std::vector<double> ms;
  for (int i = 0; i < reps; ++i) {
    cudaEventRecord(start, stream);
    body();
    cudaEventRecord(stop, stream);
    cudaEventSynchronize(stop);
    float t = 0;
    cudaEventElapsedTime(&t, start, stop);
    ms.push_back(t);
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  return Median(ms);
}

class Report {
 public:
  explicit Report(const std::string& path) {
    if (!path.empty()) out_.open(path);
  }
  void Add(nlohmann::json row) {
    if (out_.is_open()) out_ << row.dump() << "\n" << std::flush;
  }

 private:
  std::ofstream out_;
};

Tensor RandomTensor(Backend* b, std::vector<int64_t> shape, uint64_t seed, double half_width,
                    DType dtype = DType::kBF16) {
  Tensor t = Must(b->Allocate(std::move(shape), dtype), "allocate");
  BENCH_CHECK(b->FillUniform(&t, seed, 0.0, half_width, dtype));
  return t;
}

struct Rates {
  double copy_bytes_per_s = 0;  // read + write bytes per second of a D2D copy
  double gemm_flops = 0;        // bf16 8192^3
};

#if DXS_HAVE_FLASHINFER
// FlashInfer's arguments for the step that PagedAttention(q [tokens, heads, d], kc, ...,
// meta) runs, for calling its kernels directly.
cuda::PagedAttentionArgs FlashInferArgs(const Tensor& q, const Tensor& kc,
                                        const PagedAttentionMeta& meta) {
  cuda::PagedAttentionArgs args;
  args.num_seqs = meta.num_seqs;
  args.num_tokens = q.dim(0);
  args.num_heads = q.dim(1);
  args.num_kv_heads = kc.dim(2);
  args.head_dim = q.dim(2);
  args.block_size = meta.block_size;
  args.max_blocks_per_seq = meta.max_blocks_per_seq;
  args.max_query_len = meta.max_query_len;
  args.max_context_len = meta.max_context_len;
  args.num_blocks = kc.dim(0);
  args.query_start = meta.query_start.i32();
  args.context_lens = meta.context_lens.i32();
  args.block_tables = meta.block_tables.i32();
  return args;
}
#endif

Rates MeasureRates(Backend* b, cudaStream_t stream, bool quick, Report* report) {
  Rates r;
  const int64_t n = int64_t{1} << (quick ? 28 : 30);  // bytes
  Tensor src = RandomTensor(b, {n / 2}, 1, 1.0), dst = Must(b->Allocate({n / 2}, DType::kBF16), "");
  const double copy_ms = TimeMs(stream, 3, 10, [&] { BENCH_CHECK(b->Copy(src, &dst)); });
  r.copy_bytes_per_s = 2.0 * n / (copy_ms * 1e-3);
  const int64_t m = 8192;
  Tensor x = RandomTensor(b, {m, m}, 2, 1.0), w = RandomTensor(b, {m, m}, 3, 0.01);
  Tensor y = Must(b->Allocate({m, m}, DType::kBF16), "");
  const double gemm_ms =
      TimeMs(stream, 2, quick ? 3 : 10, [&] { BENCH_CHECK(b->Linear(x, w, nullptr, &y)); });
  r.gemm_flops = 2.0 * m * m * m / (gemm_ms * 1e-3);
  std::printf("[rates]\n  HBM copy (read + write)   %8.2f TB/s  (%.0f MiB)\n",
              r.copy_bytes_per_s / 1e12, n / 1048576.0);
  std::printf("  bf16 GEMM 8192^3 (cuBLAS) %8.1f TFLOP/s\n", r.gemm_flops / 1e12);
  report->Add({{"section", "rates"},
               {"copy_tbps", r.copy_bytes_per_s / 1e12},
               {"gemm_tflops", r.gemm_flops / 1e12}});
  return r;
}

// `b` runs the backend's default grouped GEMM (CUTLASS where built); `cublas`, on the same
// GPU and the same tensors, the per-expert cuBLAS path it replaces (null: not measured).
void GroupedFfn(Backend* b, cudaStream_t stream, Backend* cublas, const Rates& rates, bool quick,
                Report* report) {
  const int64_t experts = 128, hidden = 2048, inter = 768, top_k = 8;
  // Per expert the packed gate_up [2 * inter, hidden] weight and down, as loaded.
  std::vector<Tensor> gate_up, down;
  for (int64_t e = 0; e < experts; ++e) {
    gate_up.push_back(RandomTensor(b, {2 * inter, hidden}, 100 + 3 * e, std::sqrt(3.0 / hidden)));
    down.push_back(RandomTensor(b, {hidden, inter}, 102 + 3 * e, std::sqrt(3.0 / inter)));
  }
  std::vector<const Tensor*> gu, d;
  for (int64_t e = 0; e < experts; ++e) {
    gu.push_back(&gate_up[e]);
    d.push_back(&down[e]);
  }
  std::printf("\n[ffn] grouped expert FFN, 128 experts, hidden 2048, inter 768, top-8, bf16\n");
  std::printf("  %7s %10s %10s %12s %10s %12s\n", "tokens", "us", "TFLOP/s", "weights TB/s",
              "of copy", "cuBLAS us");
  std::vector<int64_t> sizes = {16, 64, 256, 1024, 4096, 16384};
  if (quick) sizes = {16, 1024};
  for (int64_t tokens : sizes) {
    const int64_t pairs = tokens * top_k;
    // Random top-8 routing, sorted by expert on the host (the sort is not what is timed).
    SplitMix64 rng(tokens);
    std::vector<std::vector<int32_t>> by_expert(experts);
    for (int64_t t = 0; t < tokens; ++t) {
      std::vector<int32_t> pick(experts);
      std::iota(pick.begin(), pick.end(), 0);
      for (int64_t k = 0; k < top_k; ++k) {
        std::swap(pick[k], pick[k + rng.Next() % (experts - k)]);
        by_expert[pick[k]].push_back(static_cast<int32_t>(t));
      }
    }
    std::vector<int32_t> rows, offsets = {0};
    int64_t used_experts = 0;
    for (const auto& v : by_expert) {
      rows.insert(rows.end(), v.begin(), v.end());
      offsets.push_back(static_cast<int32_t>(rows.size()));
      used_experts += v.empty() ? 0 : 1;
    }
    Tensor x = RandomTensor(b, {tokens, hidden}, 7, 1.0);
    Tensor row_t = Must(b->UploadIndices(rows), ""), off_t = Must(b->UploadIndices(offsets), "");
    Tensor y = Must(b->Allocate({pairs, hidden}, DType::kF32), "");
    const double ms = TimeMs(stream, 3, quick ? 5 : 20,
                             [&] { BENCH_CHECK(b->GroupedSwiGlu(x, &row_t, off_t, gu, d, &y)); });
    double cublas_ms = 0;
    if (cublas != nullptr) {
      BENCH_CHECK(b->Synchronize());  // the inputs were written on b's stream
      cublas_ms = TimeMs(CudaStreamOf(cublas), 2, quick ? 3 : 10,
                         [&] { BENCH_CHECK(cublas->GroupedSwiGlu(x, &row_t, off_t, gu, d, &y)); });
    }
    const double flops = 2.0 * 3 * hidden * inter * pairs;
    const double weight_bytes = 3.0 * hidden * inter * 2 * used_experts;
    const double wbps = weight_bytes / (ms * 1e-3);
    std::printf("  %7ld %10.1f %10.1f %12.2f %9.0f%% %12.1f\n", static_cast<long>(tokens), ms * 1e3,
                flops / (ms * 1e-3) / 1e12, wbps / 1e12, 100 * wbps / rates.copy_bytes_per_s,
                cublas_ms * 1e3);
    report->Add({{"section", "ffn"},
                 {"tokens", tokens},
                 {"us", ms * 1e3},
                 {"tflops", flops / (ms * 1e-3) / 1e12},
                 {"weights_tbps", wbps / 1e12},
                 {"cublas_us", cublas_ms * 1e3}});
  }
}

// What --profile NAME brackets with cudaProfilerStart/Stop for `ncu --profile-from-start
// off`: one call of each attention shape, one decode step (graph replay) or one prefill.
struct Profile {
  std::string what;   // "", "attention", "decode", "prefill" or (with --fp8) "ffn"
  int64_t batch = 1;  // the decode batch profiled; the FFN's tokens
  void Once(const std::string& name, const std::function<void()>& body) const {
    if (what != name) return;
    cudaProfilerStart();
    body();
    cudaDeviceSynchronize();
    cudaProfilerStop();
  }
};

void DecodeAttention(Backend* b, cudaStream_t stream, const Rates& rates, bool quick,
                     const Profile& profile, Report* report) {
  const int64_t heads = 32, kv_heads = 4, d = 128, bs = 16;
  std::printf("\n[attention] paged decode, 32 heads, 4 KV heads, d 128, block 16, bf16\n");
  std::printf("  %6s %8s %10s %10s %8s %10s %12s\n", "batch", "context", "graph us", "floor us",
              "of floor", "1 call us", "FlashInfer us");
  std::vector<int64_t> batches = {1, 8, 32, 128}, contexts = {1024, 4096, 16384};
  if (quick) batches = {1, 32}, contexts = {1024};
  for (int64_t batch : batches) {
    for (int64_t ctx : contexts) {
      const int64_t blocks_per_seq = (ctx + bs - 1) / bs, num_blocks = batch * blocks_per_seq;
      Tensor kc = RandomTensor(b, {num_blocks, bs, kv_heads, d}, 11, 1.0);
      Tensor vc = RandomTensor(b, {num_blocks, bs, kv_heads, d}, 12, 1.0);
      Tensor q = RandomTensor(b, {batch, heads, d}, 13, 1.0);
      Tensor out = Must(b->Allocate({batch, heads * d}, DType::kBF16), "");
      std::vector<int32_t> qs(batch + 1), lens(batch, static_cast<int32_t>(ctx)), tables;
      std::vector<int64_t> slots(batch);
      for (int64_t s = 0; s <= batch; ++s) qs[s] = static_cast<int32_t>(s);
      // Blocks interleaved across sequences, as a pool that has been churned.
      for (int64_t s = 0; s < batch; ++s) {
        for (int64_t k = 0; k < blocks_per_seq; ++k) {
          tables.push_back(static_cast<int32_t>(k * batch + s));
        }
        slots[s] = int64_t{tables[s * blocks_per_seq + (ctx - 1) / bs]} * bs + (ctx - 1) % bs;
      }
      PagedAttentionMeta meta;
      meta.num_seqs = batch;
      meta.block_size = bs;
      meta.max_blocks_per_seq = blocks_per_seq;
      meta.max_query_len = 1;
      meta.max_context_len = ctx;
      meta.query_start = Must(b->UploadIndices(qs), "");
      meta.context_lens = Must(b->UploadIndices(lens), "");
      meta.block_tables = Must(b->UploadIndices(tables), "");
      meta.slot_mapping = Must(b->Allocate({batch}, DType::kI64), "");
      BENCH_CHECK(b->CopyFromHost(slots.data(), DType::kI64, &meta.slot_mapping));
      // One call as the host issues it: launch latency and the host's checks included.
      const double eager_ms = TimeMs(stream, 3, quick ? 5 : 20, [&] {
        BENCH_CHECK(b->PagedAttention(q, kc, vc, meta, 0.088f, &out));
      });
      // As a decode step runs it: inside a CUDA graph, with a cold L2 (the layer's weights
      // pass through it between two attention calls). The graph holds kRepsInGraph calls
      // cycling over enough copies of the cache to exceed the 50 MB L2.
      const double kv_bytes = 2.0 * batch * ctx * kv_heads * d * 2;
      const int copies = static_cast<int>(std::clamp(std::ceil(256e6 / kv_bytes), 1.0, 16.0));
      std::vector<Tensor> kcs = {kc}, vcs = {vc};
      for (int i = 1; i < copies; ++i) {
        kcs.push_back(RandomTensor(b, {num_blocks, bs, kv_heads, d}, 11 + 2 * i, 1.0));
        vcs.push_back(RandomTensor(b, {num_blocks, bs, kv_heads, d}, 12 + 2 * i, 1.0));
      }
      constexpr int kRepsInGraph = 32;
      Tensor unused;
      CapturedGraph graph =
          Must(b->CaptureGraph(
                   [&]() -> absl::StatusOr<Tensor> {
                     for (int r = 0; r < kRepsInGraph; ++r) {
                       DXS_RETURN_IF_ERROR(b->PagedAttention(q, kcs[r % copies], vcs[r % copies],
                                                             meta, 0.088f, &out));
                     }
                     return out;
                   },
                   &unused),
               "attention graph");
      const double ms =
          TimeMs(stream, 2, quick ? 5 : 15, [&] { BENCH_CHECK(b->Replay(graph.graph.get())); }) /
          kRepsInGraph;
      profile.Once("attention",
                   [&] { BENCH_CHECK(b->PagedAttention(q, kc, vc, meta, 0.088f, &out)); });
      // FlashInfer's kernel on the same step the same way: its plan is made by the first
      // (eager) call and reused by the recorded ones, as a graph would need.
      double fi_ms = 0;
#if DXS_HAVE_FLASHINFER
      {
        std::unique_ptr<cuda::FlashInferAttention, void (*)(cuda::FlashInferAttention*)> fi(
            cuda::CreateFlashInferAttention(), cuda::DestroyFlashInferAttention);
        const cuda::PagedAttentionArgs args = FlashInferArgs(q, kc, meta);
        auto call = [&](int r) -> absl::Status {
          const cudaError_t e = cuda::LaunchFlashInferAttention(
              fi.get(), q.raw(), kcs[r % copies].raw(), vcs[r % copies].raw(), args, qs.data(),
              lens.data(), 0.088f, out.raw(), stream);
          return e == cudaSuccess ? absl::OkStatus()
                                  : absl::InternalError(cuda::FlashInferAttentionError(fi.get()));
        };
        BENCH_CHECK(call(0));
        CapturedGraph fi_graph = Must(b->CaptureGraph(
                                          [&]() -> absl::StatusOr<Tensor> {
                                            for (int r = 0; r < kRepsInGraph; ++r) {
                                              DXS_RETURN_IF_ERROR(call(r));
                                            }
                                            return out;
                                          },
                                          &unused),
                                      "flashinfer attention graph");
        fi_ms = TimeMs(stream, 2, quick ? 5 : 15,
                       [&] { BENCH_CHECK(b->Replay(fi_graph.graph.get())); }) /
                kRepsInGraph;
        profile.Once("attention", [&] { BENCH_CHECK(call(0)); });
      }
#endif
      // The floor: K and V of every position read once, at the copy rate (as ANCHORS.md).
      const double floor_ms = kv_bytes / rates.copy_bytes_per_s * 1e3;
      std::printf("  %6ld %8ld %10.1f %10.1f %7.0f%% %10.1f %12.1f\n", static_cast<long>(batch),
                  static_cast<long>(ctx), ms * 1e3, floor_ms * 1e3, 100 * floor_ms / ms,
                  eager_ms * 1e3, fi_ms * 1e3);
      report->Add({{"section", "attention"},
                   {"batch", batch},
                   {"context", ctx},
                   {"us", ms * 1e3},
                   {"eager_us", eager_ms * 1e3},
                   {"flashinfer_us", fi_ms * 1e3},
                   {"floor_us", floor_ms * 1e3}});
    }
  }
}

// Causal attention of one prompt over itself (prefill): dxs's kernel, FlashInfer's FA2 and
// SM90 (FA3-style) kernels called directly, and what the backend runs by default (the SM90
// kernel for these prompts on sm_90, DXS_CUDA_PREFILL_SM90=auto), each one eager call (long
// enough that launch costs do not show).
void PrefillAttention(Backend* b, cudaStream_t stream, const Rates& rates, bool quick,
                      Report* report) {
  const int64_t heads = 32, kv_heads = 4, d = 128, bs = 16;
  std::printf("\n[prefill attention] one causal prompt, 32 heads, 4 KV heads, d 128, bf16\n");
  std::printf("  %8s %10s %8s %10s %8s %12s %8s %8s %11s\n", "prompt", "dxs us", "TFLOP/s",
              "FA2 us", "TFLOP/s", "FA3 sm90 us", "TFLOP/s", "vs FA2", "default us");
  std::vector<int64_t> prompts = {1024, 4096, 16384};
  if (quick) prompts = {4096};
  for (int64_t prompt : prompts) {
    const int64_t blocks = (prompt + bs - 1) / bs;
    Tensor kc = RandomTensor(b, {blocks, bs, kv_heads, d}, 21, 1.0);
    Tensor vc = RandomTensor(b, {blocks, bs, kv_heads, d}, 22, 1.0);
    Tensor q = RandomTensor(b, {prompt, heads, d}, 23, 1.0);
    Tensor out = Must(b->Allocate({prompt, heads * d}, DType::kBF16), "");
    std::vector<int32_t> tables(blocks);
    std::iota(tables.begin(), tables.end(), 0);
    PagedAttentionMeta meta;
    meta.num_seqs = 1;
    meta.block_size = bs;
    meta.max_blocks_per_seq = blocks;
    meta.max_query_len = prompt;
    meta.max_context_len = prompt;
    meta.query_start = Must(b->UploadIndices({0, static_cast<int32_t>(prompt)}), "");
    meta.context_lens = Must(b->UploadIndices({static_cast<int32_t>(prompt)}), "");
    meta.block_tables = Must(b->UploadIndices(tables), "");
    meta.slot_mapping = Must(b->Allocate({prompt}, DType::kI64), "");
    // Without host lengths the backend runs its own kernel; with them FlashInfer's.
    const double ms = TimeMs(stream, 2, quick ? 3 : 10, [&] {
      BENCH_CHECK(b->PagedAttention(q, kc, vc, meta, 0.088f, &out));
    });
    const std::vector<int32_t> host_qs = {0, static_cast<int32_t>(prompt)};
    const std::vector<int32_t> host_lens = {static_cast<int32_t>(prompt)};
    meta.host_query_start = host_qs.data();
    meta.host_context_lens = host_lens.data();
    double fi_ms = 0, sm90_ms = 0, default_ms = 0;
#if DXS_HAVE_FLASHINFER
    {
      // Each FlashInfer kernel forced, on its own plan (made by the warm-up calls).
      std::unique_ptr<cuda::FlashInferAttention, void (*)(cuda::FlashInferAttention*)> fi(
          cuda::CreateFlashInferAttention(), cuda::DestroyFlashInferAttention);
      const cuda::PagedAttentionArgs args = FlashInferArgs(q, kc, meta);
      auto call = [&](cuda::FlashInferKernel kernel) {
        const cudaError_t e = cuda::LaunchFlashInferAttention(
            fi.get(), q.raw(), kc.raw(), vc.raw(), args, host_qs.data(), host_lens.data(), 0.088f,
            out.raw(), stream, /*graph_plan=*/false, kernel);
        BENCH_CHECK(e == cudaSuccess
                        ? absl::OkStatus()
                        : absl::InternalError(cuda::FlashInferAttentionError(fi.get())));
      };
      fi_ms = TimeMs(stream, 2, quick ? 3 : 10, [&] { call(cuda::FlashInferKernel::kFa2); });
      if (cuda::FlashInferSm90Available()) {
        sm90_ms = TimeMs(stream, 2, quick ? 3 : 10, [&] { call(cuda::FlashInferKernel::kSm90); });
      }
    }
    default_ms = TimeMs(stream, 2, quick ? 3 : 10,
                        [&] { BENCH_CHECK(b->PagedAttention(q, kc, vc, meta, 0.088f, &out)); });
#endif
    const double flops = 4.0 * heads * d * prompt * (prompt + 1) / 2;  // QK^T and PV, causal
    auto tflops = [&](double t_ms) { return t_ms > 0 ? flops / (t_ms * 1e-3) / 1e12 : 0.0; };
    std::printf("  %8ld %10.1f %8.1f %10.1f %8.1f %12.1f %8.1f %7.2fx %11.1f\n",
                static_cast<long>(prompt), ms * 1e3, tflops(ms), fi_ms * 1e3, tflops(fi_ms),
                sm90_ms * 1e3, tflops(sm90_ms), sm90_ms > 0 ? fi_ms / sm90_ms : 0.0,
                default_ms * 1e3);
    report->Add({{"section", "prefill_attention"},
                 {"prompt", prompt},
                 {"us", ms * 1e3},
                 {"flashinfer_us", fi_ms * 1e3},
                 {"sm90_us", sm90_ms * 1e3},
                 {"default_us", default_ms * 1e3},
                 {"tflops", tflops(ms)},
                 {"flashinfer_tflops", tflops(fi_ms)},
                 {"sm90_tflops", tflops(sm90_ms)}});
  }
  (void)rates;
}

// Weight bytes one decode step reads at `batch`: everything but the experts, plus the
// experts a batch of random routing touches in expectation, per layer. The projections
// (attention's and the experts') at `projection_bytes` a weight (1 with FP8 weights), the
// router and lm_head at 2 (bf16).
double ActiveWeightBytes(const ModelConfig& c, int64_t batch, double attention_bytes = 2.0,
                         double expert_bytes = 2.0) {
  const double h = c.hidden_size, d = c.head_dim;
  const double attn = h * d * (2.0 * c.num_attention_heads + 2.0 * c.num_key_value_heads);
  const double router = h * c.num_experts;
  const double expert = 3.0 * h * c.moe_intermediate_size;
  const double e = c.num_experts, k = c.num_experts_per_tok;
  const double touched = e * (1 - std::pow(1 - k / e, static_cast<double>(batch)));
  return (attention_bytes * attn + expert_bytes * touched * expert) * c.num_hidden_layers +
         2.0 * (router * c.num_hidden_layers + h * c.vocab_size);  // + lm_head
}

// `batch` sequences of a `ctx`-token context prefilled on `engine` (2048 tokens a step), then
// decode steps of one token each, eager or through CUDA graphs (ForwardDecode records the
// first of a shape).
struct DecodeBatch {
  DecodeBatch(LocalEngine* engine, int64_t batch, int64_t ctx)
      : engine(engine), kv(engine->config(), engine->backend(), batch * (ctx + 64)), seqs(batch) {
    // The whole pool at once: grown slot by slot it would hold the old pool and one twice as
    // large at its last growth, room batch 128 of the bf16 model does not have on an 80 GB GPU.
    BENCH_CHECK(kv.Preallocate());
    for (int64_t s = 0; s < batch; ++s) {
      seqs[s].kv_slot = Must(kv.Allocate(ctx + 64), "kv slot");
      for (int64_t i = 0; i < ctx; ++i) {
        seqs[s].tokens.push_back(static_cast<int32_t>(3 + (s * 7919 + i * 104729) % 150000));
      }
    }
    // At most 2048 prompt tokens a forward: the prefill's temporaries beside the model and a
    // batch-128 pool must fit in what an 80 GB GPU has left (8192 a forward did not).
    const int64_t per_forward = std::max<int64_t>(1, 2048 / std::max<int64_t>(ctx, 1));
    for (int64_t first = 0; first < batch; first += per_forward) {
      std::vector<SequenceChunk> part(seqs.begin() + first,
                                      seqs.begin() + std::min<int64_t>(batch, first + per_forward));
      Must(engine->model().Forward(part, &kv), "prefill");
    }
    BENCH_CHECK(engine->backend()->Synchronize());
    for (auto& s : seqs) s.start_position = ctx;
  }
  void Step(bool graphs) {
    for (size_t s = 0; s < seqs.size(); ++s) {
      seqs[s].tokens = {static_cast<int32_t>(5 + (s * 31 + steps * 17) % 150000)};
    }
    if (graphs) {
      Must(engine->model().ForwardDecode(seqs, &kv, /*use_graph=*/true), "decode");
    } else {
      Must(engine->model().Forward(seqs, &kv), "decode");
    }
    for (auto& s : seqs) ++s.start_position;
    ++steps;
  }
  double StepMs(cudaStream_t stream, bool graphs, bool quick) {
    return TimeMs(stream, 2, quick ? 4 : 16, [&] { Step(graphs); });
  }
  LocalEngine* engine;
  KvCache kv;
  std::vector<SequenceChunk> seqs;
  int64_t steps = 0;
};

void ModelBenches(const Rates& rates, bool quick, int layers, const Profile& profile,
                  Report* report) {
  CheckpointPreset preset = Must(GetPreset("qwen3-30b-a3b"), "preset");
  preset.config.num_hidden_layers = layers;
  EngineOptions options;
  // The backend linked into this binary, not the plugin MakeBackend would load: CudaStreamOf
  // (the events' stream) recognises only its own.
  options.backend_factory = [] { return Must(MakeCudaBackend(0), "no GPU"); };
  options.kv_capacity_tokens = 1;  // the benchmark makes its own cache
  std::unique_ptr<LocalEngine> engine = Must(LocalEngine::LoadRandom(preset, options), "model");
  const ModelConfig& c = engine->config();
  Backend* b = engine->backend();
  cudaStream_t stream = CudaStreamOf(b);
  std::printf(
      "\n[decode] Qwen3-30B-A3B shape, %d layers, random bf16 made on the GPU, "
      "context 1024\n",
      layers);
  std::printf("  %6s %12s %10s %10s %12s %8s %10s\n", "batch", "tokens/s", "step ms", "us/layer",
              "floor ms", "of floor", "eager ms");
  const int64_t ctx = 1024;
  std::vector<int64_t> batches = {1, 32, 128};
  if (quick) batches = {1, 32};
  if (profile.what == "decode") batches = {profile.batch};
  if (profile.what == "prefill") batches = {};
  for (int64_t batch : batches) {
    DecodeBatch d(engine.get(), batch, ctx);
    const double eager_ms = d.StepMs(stream, /*graphs=*/false, quick);
    const double ms = d.StepMs(stream, /*graphs=*/true, quick);
    const int64_t step = d.steps;
    auto decode = [&] { d.Step(/*graphs=*/true); };
    profile.Once("decode", decode);
    const double kv_bytes =
        2.0 * batch * (ctx + step) * c.num_key_value_heads * c.head_dim * 2 * c.num_hidden_layers;
    const double floor_ms = (ActiveWeightBytes(c, batch) + kv_bytes) / rates.copy_bytes_per_s * 1e3;
    std::printf("  %6ld %12.1f %10.2f %10.1f %12.2f %7.0f%% %10.2f\n", static_cast<long>(batch),
                batch / (ms * 1e-3), ms, ms * 1e3 / layers, floor_ms, 100 * floor_ms / ms,
                eager_ms);
    report->Add({{"section", "decode"},
                 {"layers", layers},
                 {"batch", batch},
                 {"tokens_per_s", batch / (ms * 1e-3)},
                 {"step_ms", ms},
                 {"eager_step_ms", eager_ms},
                 {"floor_ms", floor_ms}});
  }
  if (profile.what == "decode") return;
  // Prefill: one 4096-token prompt per step.
  const int64_t prompt = 4096;
  KvCache kv(c, b, 4 * prompt);
  int64_t round = 0;
  auto prefill = [&] {
    SequenceChunk chunk;
    chunk.kv_slot = Must(kv.Allocate(prompt), "kv slot");
    for (int64_t i = 0; i < prompt; ++i) {
      chunk.tokens.push_back(static_cast<int32_t>(3 + (round * 131 + i * 7919) % 150000));
    }
    Must(engine->model().Forward({chunk}, &kv), "prefill");
    kv.Free(chunk.kv_slot);
    ++round;
  };
  const double ms = TimeMs(stream, 1, quick ? 2 : 5, prefill);
  profile.Once("prefill", prefill);
  const double h = c.hidden_size, d = c.head_dim;
  const double active_params =
      c.num_hidden_layers *
      (h * d * (2.0 * c.num_attention_heads + 2.0 * c.num_key_value_heads) + h * c.num_experts +
       c.num_experts_per_tok * 3.0 * h * c.moe_intermediate_size);
  const double attn_flops =
      2.0 * c.num_hidden_layers * c.num_attention_heads * d * prompt * prompt;  // causal QK+PV
  const double flops = 2.0 * active_params * prompt + attn_flops + 2.0 * h * c.vocab_size;
  std::printf("\n[prefill] one %ld-token prompt, %d layers\n", static_cast<long>(prompt), layers);
  std::printf("  %10.1f tokens/s, %8.2f ms, %7.1f TFLOP/s = %4.0f%% of the GEMM rate\n",
              prompt / (ms * 1e-3), ms, flops / (ms * 1e-3) / 1e12,
              100 * flops / (ms * 1e-3) / rates.gemm_flops);
  report->Add({{"section", "prefill"},
               {"layers", layers},
               {"tokens", prompt},
               {"tokens_per_s", prompt / (ms * 1e-3)},
               {"tflops", flops / (ms * 1e-3) / 1e12}});
}

// The MoE of a decode step that runs on local experts for prefill (the exchange's capacity
// is a decode batch) and over the low-latency exchange for decode.
// The LL engine's MoE: until `remote`, the MoE answers zeros (the prefill that fills the
// KV cache: its values do not change a decode step's work, and holding every expert here
// as well as on the expert ranks does not fit the GPU at batch 128); then the exchange.
class PrefillHereDecodeThere final : public MoeExecutor {
 public:
  PrefillHereDecodeThere(Backend* backend, std::unique_ptr<MoeExecutor> ll)
      : backend_(backend), ll_(std::move(ll)) {}
  absl::Status Run(int layer, const Tensor& x, const Tensor& ids, const Tensor& weights,
                   Tensor* out) override {
    return remote ? ll_->Run(layer, x, ids, weights, out) : backend_->Fill(out, 0.f);
  }
  bool remote = false;

 private:
  Backend* backend_;
  std::unique_ptr<MoeExecutor> ll_;
};

// [decode-ll]: decode steps of the Qwen3-30B-A3B shape whose MoE goes over the low-latency
// exchange to 2 expert ranks of this process (LocalLowLatencyExperts: a backend and stream
// each, expert e on rank e % 2, the one GPU time-sliced), each beside the same engine with
// its experts local, measured in the same run (CUDA graphs, context 1k). The difference per
// layer is what the exchange adds: five launches, two flag hand-offs, and the expert side's
// capacity-sized pair list.
void LowLatencyDecode(bool quick, int layers, Report* report) {
  CheckpointPreset preset = Must(GetPreset("qwen3-30b-a3b"), "preset");
  preset.config.num_hidden_layers = layers;
  const ModelConfig& c = preset.config;
  RandomWeightSource source(preset);
  std::printf(
      "\n[decode-ll] Qwen3-30B-A3B shape, %d layers, 1 attention + 2 expert ranks in "
      "one process (one GPU), context 1024\n",
      layers);
  std::printf("  %6s %9s %10s %10s %9s %14s\n", "batch", "capacity", "local ms", "ll ms",
              "ll/local", "added us/layer");
  std::vector<std::pair<int64_t, int>> rows = {{1, 1}, {1, 128}, {32, 32}, {128, 128}};
  if (quick) rows = {{1, 1}, {32, 32}};
  auto make_backend = [] { return MakeCudaBackend(0); };
  for (const auto& [batch, capacity] : rows) {
    EngineOptions options;
    options.backend_factory = [] { return Must(MakeCudaBackend(0), "no GPU"); };
    options.kv_capacity_tokens = 1;
    double local_ms = 0;
    {
      std::unique_ptr<LocalEngine> engine = Must(LocalEngine::LoadRandom(preset, options), "model");
      DecodeBatch d(engine.get(), batch, 1024);
      local_ms = d.StepMs(CudaStreamOf(engine->backend()), /*graphs=*/true, quick);
    }
    std::unique_ptr<LocalLowLatencyExperts> experts =
        Must(LocalLowLatencyExperts::Make(c, source, 2, capacity, make_backend), "expert ranks");
    PrefillHereDecodeThere* moe = nullptr;
    options.moe_factory = [&](const ModelConfig& config,
                              Backend* backend) -> absl::StatusOr<std::unique_ptr<MoeExecutor>> {
      DXS_ASSIGN_OR_RETURN(std::unique_ptr<MoeExecutor> ll,
                           experts->AttachAttention(config, backend));
      auto hybrid = std::make_unique<PrefillHereDecodeThere>(backend, std::move(ll));
      moe = hybrid.get();
      return std::unique_ptr<MoeExecutor>(std::move(hybrid));
    };
    std::unique_ptr<LocalEngine> engine = Must(LocalEngine::LoadRandom(preset, options), "model");
    double ll_ms = 0;
    {
      DecodeBatch d(engine.get(), batch, 1024);
      // One decode step of this shape without the exchange, its graph then dropped: the
      // graph pool then holds the step's blocks before the expert ranks start. In one
      // process a device allocation during a step can wait for the GPU to go idle, which
      // the ranks' spinning waits for that very step never let it (a stall until they time
      // out); between processes (the services) it cannot.
      d.Step(/*graphs=*/true);
      engine->model().DropDecodeGraphs();
      moe->remote = true;
      experts->Start();
      ll_ms = d.StepMs(CudaStreamOf(engine->backend()), /*graphs=*/true, quick);
      BENCH_CHECK(experts->Stop());
      BENCH_CHECK(experts->executor()->CheckStatus());
    }
    experts.reset();  // the attention side's exchange lives on the engine's backend
    std::printf("  %6ld %9d %10.3f %10.3f %9.2f %14.1f\n", static_cast<long>(batch), capacity,
                local_ms, ll_ms, ll_ms / local_ms, (ll_ms - local_ms) * 1e3 / layers);
    report->Add({{"section", "decode-ll"},
                 {"layers", layers},
                 {"batch", batch},
                 {"capacity", capacity},
                 {"local_step_ms", local_ms},
                 {"ll_step_ms", ll_ms}});
  }
}

// [sampling]: LocalEngine::GenerateBatch of `batch` requests (16-token prompts, 64 new
// tokens, the Qwen3-30B-A3B shape) with plain seeded sampling (temperature, top-p), and with
// every request also asking for repetition, frequency and presence penalties, min_p and
// the top 20 logprobs, interleaved rounds, in one run. The whole loop is timed on the host
// clock (each GenerateBatch ends with its tokens on the host): the features' cost is both
// the device's (adjusted keys, LogprobRows) and the host's (the adjustment lists, the
// downloads), so a stream-only timing would miss half of it.
void SamplingOverhead(bool quick, int layers, Report* report) {
  CheckpointPreset preset = Must(GetPreset("qwen3-30b-a3b"), "preset");
  preset.config.num_hidden_layers = layers;
  EngineOptions options;
  options.backend_factory = [] { return Must(MakeCudaBackend(0), "no GPU"); };
  options.kv_capacity_tokens = 128 * 96;
  std::unique_ptr<LocalEngine> engine = Must(LocalEngine::LoadRandom(preset, options), "model");
  std::printf("\n[sampling] Qwen3-30B-A3B shape, %d layers, 16-token prompts, 64 new tokens\n",
              layers);
  std::printf("  %6s %14s %14s %17s %14s %8s %17s %8s\n", "batch", "greedy tok/s", "plain tok/s",
              "features tok/s", "plain/greedy", "ratio", "no-logprobs tok/s", "ratio");
  const int64_t new_tokens = 64;
  for (const int64_t batch : {int64_t{32}, int64_t{128}}) {
    std::vector<GenerationRequest> plain(batch), features;
    for (int64_t i = 0; i < batch; ++i) {
      GenerationRequest& r = plain[i];
      for (int64_t t = 0; t < 16; ++t)
        r.prompt.push_back(static_cast<int32_t>(3 + (i * 977 + t * 131) % 150000));
      r.max_new_tokens = new_tokens;
      r.ignore_eos = true;
      r.sampling.temperature = 0.8f;
      r.sampling.top_p = 0.95f;
      r.sampling.seed = static_cast<uint64_t>(i);
    }
    // Greedy: the same requests at temperature 0 (argmax on the device, no sort): what
    // sampling costs over it.
    std::vector<GenerationRequest> greedy = plain;
    for (GenerationRequest& r : greedy) r.sampling.temperature = 0.f;
    features = plain;
    for (GenerationRequest& r : features) {
      r.sampling.repetition_penalty = 1.1f;
      r.sampling.frequency_penalty = 0.2f;
      r.sampling.presence_penalty = 0.2f;
      r.sampling.min_p = 0.05f;
      r.logprobs = true;
      r.top_logprobs = 20;
    }
    auto seconds = [&](const std::vector<GenerationRequest>& requests) {
      const auto start = std::chrono::steady_clock::now();
      Must(engine->GenerateBatch(requests), "generate");
      return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    };
    // The features without the log-probabilities: which share of their cost is the top 20.
    std::vector<GenerationRequest> no_logprobs = features;
    for (GenerationRequest& r : no_logprobs) {
      r.logprobs = false;
      r.top_logprobs = 0;
    }
    seconds(greedy);  // warm-up: graphs recorded, workspaces grown
    seconds(plain);
    seconds(features);
    seconds(no_logprobs);
    std::vector<double> greedy_s, plain_s, features_s, no_logprobs_s;
    for (int round = 0; round < (quick ? 2 : 5); ++round) {
      greedy_s.push_back(seconds(greedy));
      plain_s.push_back(seconds(plain));
      features_s.push_back(seconds(features));
      no_logprobs_s.push_back(seconds(no_logprobs));
    }
    const double tokens = static_cast<double>(batch * new_tokens);
    const double greedy_rate = tokens / Median(greedy_s), plain_rate = tokens / Median(plain_s),
                 features_rate = tokens / Median(features_s),
                 no_logprobs_rate = tokens / Median(no_logprobs_s);
    std::printf("  %6ld %14.1f %14.1f %17.1f %14.3f %8.3f %17.1f %8.3f\n", static_cast<long>(batch),
                greedy_rate, plain_rate, features_rate, plain_rate / greedy_rate,
                features_rate / plain_rate, no_logprobs_rate, no_logprobs_rate / plain_rate);
    report->Add({{"section", "sampling"},
                 {"batch", batch},
                 {"greedy_tokens_per_s", greedy_rate},
                 {"plain_tokens_per_s", plain_rate},
                 {"features_tokens_per_s", features_rate},
                 {"features_without_logprobs_tokens_per_s", no_logprobs_rate}});
  }
  // n samples: time to first token of one 2048-token prompt (its prefill and the first
  // token of every sample: GenerateBatch with max_new_tokens 1), n = 1 against n = 8.
  GenerationRequest r;
  for (int64_t t = 0; t < 2048; ++t)
    r.prompt.push_back(static_cast<int32_t>(3 + (t * 7919) % 150000));
  r.max_new_tokens = 1;
  r.ignore_eos = true;
  r.sampling.temperature = 0.8f;
  r.sampling.top_p = 0.95f;
  GenerationRequest eight = r;
  eight.n = 8;
  auto seconds = [&](const GenerationRequest& request) {
    const auto start = std::chrono::steady_clock::now();
    Must(engine->GenerateBatch({request}), "generate");
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  };
  seconds(r);
  seconds(eight);
  std::vector<double> one_s, eight_s;
  for (int round = 0; round < (quick ? 2 : 5); ++round) {
    one_s.push_back(seconds(r));
    eight_s.push_back(seconds(eight));
  }
  const int64_t before = engine->prefill_tokens();
  seconds(eight);
  std::printf(
      "  n samples of a 2048-token prompt: TTFT n=1 %.2f ms, n=8 %.2f ms, ratio %.3f; "
      "n=8 prefilled %ld prompt tokens\n",
      1e3 * Median(one_s), 1e3 * Median(eight_s), Median(eight_s) / Median(one_s),
      static_cast<long>(engine->prefill_tokens() - before));
  report->Add({{"section", "sampling_n"},
               {"ttft_n1_ms", 1e3 * Median(one_s)},
               {"ttft_n8_ms", 1e3 * Median(eight_s)}});
}

// A backend made under `env` (NAME=VALUE pairs), the caller's environment restored after.
std::unique_ptr<Backend> BackendWith(const std::vector<std::pair<const char*, const char*>>& env) {
  std::vector<std::pair<const char*, std::optional<std::string>>> saved;
  for (const auto& [name, value] : env) {
    const char* old = std::getenv(name);
    saved.emplace_back(name, old != nullptr ? std::optional<std::string>(old) : std::nullopt);
    setenv(name, value, 1);
  }
  std::unique_ptr<Backend> b = Must(MakeCudaBackend(0), "backend");
  for (const auto& [name, old] : saved) {
    if (old.has_value()) {
      setenv(name, old->c_str(), 1);
    } else {
      unsetenv(name);
    }
  }
  return b;
}

// Random e4m3 bytes (no NaN codes) and scales near 1e-3: an FP8 weight that is never zeros.
Tensor RandomFp8Weight(Backend* b, int64_t n, int64_t k, uint64_t seed) {
  std::vector<uint8_t> bytes(static_cast<size_t>(n * k));
  uint64_t x = seed * 0x9E3779B97F4A7C15ull + 1;
  for (uint8_t& v : bytes) {
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    v = static_cast<uint8_t>(x);
    if ((v & 0x7f) == 0x7f) v ^= 0x01;  // 0x7f / 0xff are e4m3's NaN
  }
  std::vector<float> scales(static_cast<size_t>((n / 128) * (k / 128)));
  for (size_t i = 0; i < scales.size(); ++i) scales[i] = 1e-3f * (1 + (i * 37 % 100) / 100.f);
  return Must(MakeBlockScaledWeight(bytes.data(), scales.data(), {n, k}, b), "fp8 weight");
}

// [fp8]: block-scaled FP8 weights (kernels/cuda/fp8_linear.cc, moe_fp8.cu) beside the bf16
// weights they stand for, on Qwen3-30B-A3B's shapes:
// - Linear at q_proj and o_proj, decode- to prefill-sized x: bf16 takes gemv.cu up to 8 rows
//   and cuBLAS past them; "fp8" is the default (its GEMV up to 8 rows, then CUTLASS's blockwise
//   FP8 GEMM), "cutlass" and "cublaslt" each GEMM at every size (DXS_CUDA_GEMV=off), the
//   libraries the GEMV is measured against. Each time is the median of 20-call runs / 20.
// - The experts' grouped SwiGLU FFN (128 experts, hidden 2048, inter 768, top-8, the pairs
//   spread evenly), 16 to 16384 tokens: bf16 against FP8 (CUTLASS's FP8 grouped GEMMs with the
//   quantization passes).
// - [fp8-qkv-graph]: a layer's q, k and v (Linears) recorded in a graph as a decode step
//   runs them, bf16 beside FP8 with k and v on side streams (the default) and on one stream
//   (DXS_CUDA_FP8_SIDE_STREAMS=off) (QkvGraphBench).
// - [fp8-gemv-features]: the FP8 dense GEMV at 1-8 rows with 1, 2 and 4 output features a
//   warp (Fp8GemvFeatures).
// Weights are random (FP8: random bytes and scales), never zeros.
// [fp8-ffn]'s experts: Qwen3-30B-A3B's shape.
constexpr int64_t kFfnExperts = 128, kFfnHidden = 2048, kFfnInter = 768, kFfnTopK = 8;

// Every expert's gate_up and down on b, bf16 or FP8 (random, seeded per expert), with the
// pointer tables GroupedSwiGlu takes.
struct FfnExperts {
  std::vector<Tensor> gate_up, down;
  std::vector<const Tensor*> gate_up_ptrs, down_ptrs;
};
FfnExperts MakeFfnExperts(Backend* b, bool fp8) {
  FfnExperts x;
  for (int64_t e = 0; e < kFfnExperts; ++e) {
    x.gate_up.push_back(fp8 ? RandomFp8Weight(b, 2 * kFfnInter, kFfnHidden, 500 + e)
                            : RandomTensor(b, {2 * kFfnInter, kFfnHidden}, 100 + e, 0.05));
    x.down.push_back(fp8 ? RandomFp8Weight(b, kFfnHidden, kFfnInter, 700 + e)
                         : RandomTensor(b, {kFfnHidden, kFfnInter}, 300 + e, 0.05));
  }
  for (int64_t e = 0; e < kFfnExperts; ++e) {
    x.gate_up_ptrs.push_back(&x.gate_up[e]);
    x.down_ptrs.push_back(&x.down[e]);
  }
  return x;
}

// GroupedSwiGlu's expert offsets on b: `pairs` spread evenly over the experts.
Tensor EvenExpertOffsets(Backend* b, int64_t pairs) {
  std::vector<int32_t> offsets(kFfnExperts + 1);
  for (int64_t e = 0; e <= kFfnExperts; ++e) {
    offsets[e] = static_cast<int32_t>(pairs * e / kFfnExperts);
  }
  Tensor off = Must(b->Allocate({kFfnExperts + 1}, DType::kI32), "offsets");
  BENCH_CHECK(b->CopyFromHost(offsets.data(), DType::kI32, &off));
  return off;
}

// --fp8 --profile ffn: the experts' grouped SwiGLU FFN (Fp8Benches' shape, pairs spread
// evenly) at profile.batch tokens, once with bf16 weights and once with FP8 weights, each
// warmed up and then called once between cudaProfilerStart/Stop: ncu's per-kernel times show
// which of the FP8 path's kernels (the quantization passes, the two grouped GEMMs, the
// combine) holds it against bf16's.
void Fp8FfnProfile(Backend* b, const Profile& profile) {
  const int64_t pairs = profile.batch * kFfnTopK;
  const FfnExperts bf16 = MakeFfnExperts(b, false), fp8 = MakeFfnExperts(b, true);
  const Tensor off = EvenExpertOffsets(b, pairs);
  Tensor xs = RandomTensor(b, {pairs, kFfnHidden}, 17, 1.0);
  Tensor y = Must(b->Allocate({pairs, kFfnHidden}, DType::kBF16), "y");
  std::printf("\n[fp8-ffn profile] %ld tokens, %ld pairs: bf16 then fp8, one call each\n",
              static_cast<long>(profile.batch), static_cast<long>(pairs));
  for (const FfnExperts* experts : {&bf16, &fp8}) {
    const auto& gu = experts->gate_up_ptrs;
    const auto& dn = experts->down_ptrs;
    BENCH_CHECK(b->GroupedSwiGlu(xs, nullptr, off, gu, dn, &y));  // warm-up: tables, workspaces
    BENCH_CHECK(b->Synchronize());
    profile.Once("ffn", [&] { BENCH_CHECK(b->GroupedSwiGlu(xs, nullptr, off, gu, dn, &y)); });
  }
}

// --fp8's [fp8-qkv-graph]: Qwen3-30B-A3B's q, k and v (4096, 512 and 512 rows of 2048) on one
// x, kReps Linears calls recorded in one graph and replayed (no host work in the times, as
// in a decode step), us per call: bf16 weights, FP8 weights, and FP8 on a backend without the
// side streams.
void QkvGraphBench(Backend* b, bool quick, Report* report) {
  std::unique_ptr<Backend> one_stream = BackendWith({{"DXS_CUDA_FP8_SIDE_STREAMS", "off"}});
  constexpr int64_t kHidden = 2048;
  const int64_t rows[3] = {4096, 512, 512};
  constexpr int kReps = 20;
  auto time = [&](Backend* be, bool fp8, int64_t m) {
    std::vector<Tensor> w, y;
    for (int i = 0; i < 3; ++i) {
      w.push_back(fp8 ? RandomFp8Weight(be, rows[i], kHidden, 31 + i)
                      : RandomTensor(be, {rows[i], kHidden}, 31 + i, 0.05));
      y.push_back(Must(be->Allocate({m, rows[i]}, DType::kBF16), "y"));
    }
    const Tensor x = RandomTensor(be, {m, kHidden}, 37, 1.0);
    Tensor unused;
    CapturedGraph graph = Must(
        be->CaptureGraph(
            [&]() -> absl::StatusOr<Tensor> {
              for (int r = 0; r < kReps; ++r) {
                DXS_RETURN_IF_ERROR(be->Linears(x, {&w[0], &w[1], &w[2]}, {&y[0], &y[1], &y[2]}));
              }
              return y[0];
            },
            &unused),
        "q/k/v graph");
    return 1e3 / kReps * TimeMs(CudaStreamOf(be), 2, quick ? 5 : 15, [&] {
             BENCH_CHECK(be->Replay(graph.graph.get()));
           });
  };
  std::printf(
      "\n[fp8-qkv-graph] q, k, v of one x in a graph (4096, 512, 512 rows of 2048), us a call\n");
  std::printf("  %6s %9s %9s %11s %9s %11s\n", "m", "bf16", "fp8", "fp8 1-strm", "fp8/bf16",
              "1-strm/fp8");
  for (int64_t m : {1, 8, 32, 128}) {
    const double bf16_us = time(b, false, m), fp8_us = time(b, true, m),
                 one_us = time(one_stream.get(), true, m);
    std::printf("  %6ld %9.2f %9.2f %11.2f %9.2f %11.2f\n", static_cast<long>(m), bf16_us, fp8_us,
                one_us, bf16_us / fp8_us, one_us / fp8_us);
    report->Add({{"section", "fp8_qkv_graph"},
                 {"m", m},
                 {"bf16_us", bf16_us},
                 {"fp8_us", fp8_us},
                 {"fp8_one_stream_us", one_us}});
  }
}

// --fp8's [fp8-gemv-features]: the FP8 dense GEMV (LaunchGemvsFp8) at 1 to 8 rows with 1, 2
// and 4 output features a warp (DXS_CUDA_GEMV_FP8_FEATURES, a backend each), eager, us per
// call: q_proj and o_proj by Linear, q, k and v by Linears (one launch for the three).
void Fp8GemvFeatures(bool quick, Report* report) {
  const char* const kCounts[] = {"1", "2", "4"};
  std::unique_ptr<Backend> bs[3];
  for (int i = 0; i < 3; ++i) bs[i] = BackendWith({{"DXS_CUDA_GEMV_FP8_FEATURES", kCounts[i]}});
  std::printf("\n[fp8-gemv-features] FP8 GEMV, output features a warp; us per call\n");
  std::printf("  %-8s %6s %9s %9s %9s %9s %9s\n", "weight", "m", "1", "2", "4", "1/2", "1/4");
  struct Shape {
    const char* name;
    std::vector<int64_t> ns;  // several: Linears of one x
    int64_t k;
  };
  constexpr int kCalls = 20;
  for (const Shape& s : {Shape{"q_proj", {4096}, 2048}, Shape{"o_proj", {2048}, 4096},
                         Shape{"q,k,v", {4096, 512, 512}, 2048}}) {
    std::vector<Tensor> ws[3];
    for (int i = 0; i < 3; ++i) {
      for (size_t j = 0; j < s.ns.size(); ++j) {
        ws[i].push_back(RandomFp8Weight(bs[i].get(), s.ns[j], s.k, 31 + j));
      }
    }
    for (int64_t m = 1; m <= 8; ++m) {
      if (quick && m != 1 && m != 2 && m != 4 && m != 8) continue;
      double us[3];
      for (int i = 0; i < 3; ++i) {
        Backend* be = bs[i].get();
        const Tensor x = RandomTensor(be, {m, s.k}, 33, 1.0);
        std::vector<Tensor> ys;
        std::vector<Tensor*> y_ptrs;
        std::vector<const Tensor*> w_ptrs;
        for (size_t j = 0; j < s.ns.size(); ++j) {
          ys.push_back(Must(be->Allocate({m, s.ns[j]}, DType::kBF16), "y"));
          w_ptrs.push_back(&ws[i][j]);
        }
        for (Tensor& y : ys) y_ptrs.push_back(&y);
        us[i] = 1e3 / kCalls * TimeMs(CudaStreamOf(be), 2, quick ? 5 : 15, [&] {
                  for (int c = 0; c < kCalls; ++c) {
                    if (ys.size() == 1) {
                      BENCH_CHECK(be->Linear(x, *w_ptrs[0], nullptr, y_ptrs[0]));
                    } else {
                      BENCH_CHECK(be->Linears(x, w_ptrs, y_ptrs));
                    }
                  }
                });
      }
      std::printf("  %-8s %6ld %9.2f %9.2f %9.2f %9.2f %9.2f\n", s.name, static_cast<long>(m),
                  us[0], us[1], us[2], us[0] / us[1], us[0] / us[2]);
      report->Add({{"section", "fp8_gemv_features"},
                   {"weight", s.name},
                   {"m", m},
                   {"features1_us", us[0]},
                   {"features2_us", us[1]},
                   {"features4_us", us[2]}});
    }
  }
}

void Fp8Benches(const Rates& rates, bool quick, const Profile& profile, Report* report) {
  std::unique_ptr<Backend> b = BackendWith({});
  if (!b->capabilities().fp8_block_weights) {
    std::printf("\n[fp8] skipped: this GPU keeps no FP8 weights\n");
    return;
  }
  if (profile.what == "ffn") {
    Fp8FfnProfile(b.get(), profile);
    return;
  }
  std::unique_ptr<Backend> cutlass =
      BackendWith({{"DXS_CUDA_GEMV", "off"}, {"DXS_CUDA_FP8_GEMM", "cutlass"}});
  std::unique_ptr<Backend> cublaslt =
      BackendWith({{"DXS_CUDA_GEMV", "off"}, {"DXS_CUDA_FP8_GEMM", "cublaslt"}});
  std::printf("\n[fp8-linear] y = x w^T, bf16 x and y; us per call\n");
  std::printf("  %-8s %6s %9s %9s %9s %9s %9s %10s %9s\n", "weight", "m", "bf16", "fp8", "cutlass",
              "cublaslt", "fp8/bf16", "gemv/best", "fp8 floor");
  struct Shape {
    const char* name;
    int64_t n, k;
  };
  std::vector<int64_t> ms = {1, 2, 4, 8, 16, 64, 256, 1024, 4096};
  if (quick) ms = {1, 4, 8, 32, 128, 1024, 4096};
  constexpr int kCalls = 20;
  auto time = [&](Backend* be, const Tensor& x, const Tensor& w, Tensor* y) {
    return 1e3 / kCalls * TimeMs(CudaStreamOf(be), 2, quick ? 5 : 15, [&] {
             for (int i = 0; i < kCalls; ++i) BENCH_CHECK(be->Linear(x, w, nullptr, y));
           });
  };
  for (const Shape& s : {Shape{"q_proj", 4096, 2048}, Shape{"o_proj", 2048, 4096}}) {
    Tensor w16 = RandomTensor(b.get(), {s.n, s.k}, 12, 0.05);
    Backend* backends[3] = {b.get(), cutlass.get(), cublaslt.get()};
    Tensor w8[3];
    for (int i = 0; i < 3; ++i) w8[i] = RandomFp8Weight(backends[i], s.n, s.k, 11);
    for (int64_t m : ms) {
      double us[3];
      for (int i = 0; i < 3; ++i) {
        Tensor x = RandomTensor(backends[i], {m, s.k}, 13, 1.0);
        Tensor y = Must(backends[i]->Allocate({m, s.n}, DType::kBF16), "y");
        us[i] = time(backends[i], x, w8[i], &y);
      }
      Tensor x = RandomTensor(b.get(), {m, s.k}, 13, 1.0);
      Tensor y = Must(b->Allocate({m, s.n}, DType::kBF16), "y");
      const double bf16_us = time(b.get(), x, w16, &y);
      const double floor_us = (s.n * s.k + 2.0 * m * (s.k + s.n)) / rates.copy_bytes_per_s * 1e6;
      std::printf("  %-8s %6ld %9.2f %9.2f %9.2f %9.2f %9.2f %10.2f %8.0f%%\n", s.name,
                  static_cast<long>(m), bf16_us, us[0], us[1], us[2], bf16_us / us[0],
                  m <= 8 ? std::min(us[1], us[2]) / us[0] : 1.0, 100 * floor_us / us[0]);
      report->Add({{"section", "fp8_linear"},
                   {"weight", s.name},
                   {"n", s.n},
                   {"k", s.k},
                   {"m", m},
                   {"bf16_us", bf16_us},
                   {"fp8_us", us[0]},
                   {"fp8_cutlass_us", us[1]},
                   {"fp8_cublaslt_us", us[2]},
                   {"fp8_floor_us", floor_us}});
    }
  }
  cutlass.reset();
  cublaslt.reset();

  std::printf("\n[fp8-ffn] grouped SwiGLU FFN, %ld experts, hidden %ld, inter %ld, top-%ld\n",
              static_cast<long>(kFfnExperts), static_cast<long>(kFfnHidden),
              static_cast<long>(kFfnInter), static_cast<long>(kFfnTopK));
  // "fp8 gemm": the same FP8 experts on a backend without the GEMVs (the quantization passes
  // and CUTLASS's grouped GEMMs at every size), where the default takes gemv.cu's FP8 path
  // (up to kGemvMaxPairs pairs).
  std::printf("  %7s %7s %10s %10s %10s %9s %10s\n", "tokens", "pairs", "bf16 us", "fp8 us",
              "fp8 gemm", "fp8/bf16", "gemv/gemm");
  std::unique_ptr<Backend> gemm_only = BackendWith({{"DXS_CUDA_GEMV", "off"}});
  const FfnExperts bf16 = MakeFfnExperts(b.get(), false), fp8 = MakeFfnExperts(b.get(), true);
  const FfnExperts fp8_gemm = MakeFfnExperts(gemm_only.get(), true);
  std::vector<int64_t> token_counts = {1, 4, 16, 128, 1024, 4096, 16384};
  if (quick) token_counts = {1, 4, 16, 1024, 16384};
  for (int64_t tokens : token_counts) {
    const int64_t pairs = tokens * kFfnTopK;
    const Tensor off = EvenExpertOffsets(b.get(), pairs);
    Tensor xs = RandomTensor(b.get(), {pairs, kFfnHidden}, 17, 1.0);
    Tensor y = Must(b->Allocate({pairs, kFfnHidden}, DType::kBF16), "y");
    cudaStream_t stream = CudaStreamOf(b.get());
    const int reps = quick ? 3 : 7;
    const double bf16_us =
        1e3 * TimeMs(stream, 1, reps, [&] {
          BENCH_CHECK(b->GroupedSwiGlu(xs, nullptr, off, bf16.gate_up_ptrs, bf16.down_ptrs, &y));
        });
    const double fp8_us =
        1e3 * TimeMs(stream, 1, reps, [&] {
          BENCH_CHECK(b->GroupedSwiGlu(xs, nullptr, off, fp8.gate_up_ptrs, fp8.down_ptrs, &y));
        });
    Backend* g = gemm_only.get();
    const Tensor off_g = EvenExpertOffsets(g, pairs);
    Tensor xs_g = RandomTensor(g, {pairs, kFfnHidden}, 17, 1.0);
    Tensor y_g = Must(g->Allocate({pairs, kFfnHidden}, DType::kBF16), "y");
    const double gemm_us =
        1e3 * TimeMs(CudaStreamOf(g), 1, reps, [&] {
          BENCH_CHECK(g->GroupedSwiGlu(xs_g, nullptr, off_g, fp8_gemm.gate_up_ptrs,
                                       fp8_gemm.down_ptrs, &y_g));
        });
    std::printf("  %7ld %7ld %10.1f %10.1f %10.1f %9.2f %10.2f\n", static_cast<long>(tokens),
                static_cast<long>(pairs), bf16_us, fp8_us, gemm_us, bf16_us / fp8_us,
                gemm_us / fp8_us);
    report->Add({{"section", "fp8_ffn"},
                 {"tokens", tokens},
                 {"pairs", pairs},
                 {"bf16_us", bf16_us},
                 {"fp8_us", fp8_us},
                 {"fp8_gemm_us", gemm_us}});
  }
  QkvGraphBench(b.get(), quick, report);
  Fp8GemvFeatures(quick, report);
}

// Which projections an engine of [decode-fp8] keeps in FP8 (--fp8-parts): none (the bf16
// baseline), all of them, as a Qwen3-FP8 checkpoint has it, or only the attention's (q, k, v,
// o) or only the experts' (gate, up, down), the others bf16; the partial ones attribute FP8's
// step time to its dense GEMVs or its expert GEMVs in one call.
struct Fp8Parts {
  std::string label;  // the dtype column: bf16, fp8, fp8-a, fp8-e
  bool attention = true, experts = true;
  bool any() const { return attention || experts; }
};

absl::StatusOr<Fp8Parts> ParseFp8Part(const std::string& part) {
  if (part == "all") return Fp8Parts{"fp8", true, true};
  if (part == "attention") return Fp8Parts{"fp8-a", true, false};
  if (part == "experts") return Fp8Parts{"fp8-e", false, true};
  return absl::InvalidArgumentError(
      absl::StrCat("--fp8-parts: \"", part, "\" is not all, attention or experts"));
}

// The preset's weights (RandomWeightSource, made in place), except each projection of
// `parts` that can stay FP8 (KeepsFp8Weight): random e4m3 bytes and scales (RandomFp8Weight),
// distinct per tensor. The values mean nothing as a model; the bytes and the work are the
// FP8 model's. (A --fp8 preset quantizes its projections on the host, minutes for the
// 48-layer experts.)
class RandomFp8BenchSource final : public WeightSource {
 public:
  RandomFp8BenchSource(const CheckpointPreset& preset, Fp8Parts parts)
      : base_(preset), parts_(std::move(parts)) {}
  absl::StatusOr<Tensor> Load(const std::string& name, std::vector<int64_t> shape,
                              Backend* backend) const override {
    return base_.Load(name, std::move(shape), backend);
  }
  absl::StatusOr<Tensor> LoadProjection(const std::string& name, std::vector<int64_t> shape,
                                        Backend* backend) const override {
    const bool expert = absl::StrContains(name, ".mlp.experts.");
    if (!(expert ? parts_.experts : parts_.attention) || !KeepsFp8Weight(*backend, shape)) {
      return base_.Load(name, std::move(shape), backend);
    }
    return RandomFp8Weight(backend, shape[0], shape[1], std::hash<std::string>{}(name));
  }

 private:
  RandomWeightSource base_;
  Fp8Parts parts_;
};

// [decode-fp8]: the whole Qwen3-30B-A3B shape with bf16 weights, then with its projections
// in FP8 (RandomFp8BenchSource), one engine at a time (both do not fit an 80 GB GPU): decode
// steps through CUDA graphs at batch 1, 8, 32 and 128 (--quick: to 32; context 1024) against
// each one's HBM floor (active weights and the KV read at the copy rate), and one 4096-token
// prompt.
// With --profile decode: the FP8 engine's decode step alone, at --batch, once; with --profile
// prefill: its 4096-token prompt alone, once (after the timed ones).
void Fp8ModelBenches(const Rates& rates, bool quick, int layers, const Profile& profile,
                     const std::vector<int64_t>& only_batches,
                     const std::vector<Fp8Parts>& fp8_parts, Report* report) {
  CheckpointPreset preset = Must(GetPreset("qwen3-30b-a3b"), "preset");
  preset.config.num_hidden_layers = layers;
  EngineOptions options;
  options.backend_factory = [] { return Must(MakeCudaBackend(0), "no GPU"); };
  options.kv_capacity_tokens = 1;
  std::printf(
      "\n[decode-fp8] Qwen3-30B-A3B shape, %d layers, context 1024: bf16 against FP8 "
      "projections\n",
      layers);
  std::printf("  %-5s %6s %12s %10s %12s %8s\n", "dtype", "batch", "tokens/s", "step ms",
              "floor ms", "of floor");
  std::vector<int64_t> batches = {1, 8, 32, 128};
  if (quick) batches = {1, 8, 32};
  if (!only_batches.empty()) batches = only_batches;
  // --profile decode: the FP8 engine's step at --batch; --profile prefill: its prompt alone.
  const bool profiling = profile.what == "decode" || profile.what == "prefill";
  if (profile.what == "decode") batches = {profile.batch};
  if (profile.what == "prefill") batches = {};
  // The bf16 engine, then one FP8 engine for each entry of fp8_parts (by default all
  // projections in FP8), one at a time.
  std::vector<Fp8Parts> engines = {{"bf16", false, false}};
  engines.insert(engines.end(), fp8_parts.begin(), fp8_parts.end());
  std::map<std::pair<std::string, int64_t>, double> tok_s;
  std::map<std::string, double> prefill_tok_s;
  for (const Fp8Parts& parts : engines) {
    const bool fp8 = parts.any();
    const std::string& dtype = parts.label;
    if (profiling && !fp8) continue;
    std::unique_ptr<LocalEngine> engine =
        fp8 ? Must(LocalEngine::LoadWeights(preset.config, RandomFp8BenchSource(preset, parts),
                                            options),
                   "fp8 model")
            : Must(LocalEngine::LoadRandom(preset, options), "bf16 model");
    if (fp8 && !engine->backend()->capabilities().fp8_block_weights) {
      std::printf("  skipped: this GPU keeps no FP8 weights\n");
      return;
    }
    const ModelConfig& c = engine->config();
    cudaStream_t stream = CudaStreamOf(engine->backend());
    for (int64_t batch : batches) {
      DecodeBatch d(engine.get(), batch, 1024);
      d.StepMs(stream, /*graphs=*/false, quick);  // the eager first steps record nothing
      const double ms = d.StepMs(stream, /*graphs=*/true, quick);
      profile.Once("decode", [&] { d.Step(/*graphs=*/true); });
      const double kv_bytes = 2.0 * batch * (1024 + d.steps) * c.num_key_value_heads * c.head_dim *
                              2 * c.num_hidden_layers;
      const double weights =
          ActiveWeightBytes(c, batch, parts.attention ? 1.0 : 2.0, parts.experts ? 1.0 : 2.0);
      const double floor_ms = (weights + kv_bytes) / rates.copy_bytes_per_s * 1e3;
      tok_s[{dtype, batch}] = batch / (ms * 1e-3);
      std::printf("  %-5s %6ld %12.1f %10.2f %12.2f %7.0f%%\n", dtype.c_str(),
                  static_cast<long>(batch), batch / (ms * 1e-3), ms, floor_ms, 100 * floor_ms / ms);
      report->Add({{"section", "decode_fp8"},
                   {"dtype", dtype},
                   {"layers", layers},
                   {"batch", batch},
                   {"tokens_per_s", batch / (ms * 1e-3)},
                   {"step_ms", ms},
                   {"floor_ms", floor_ms}});
      // Each batch's graphs hold their private pool's blocks: gone before the next batch's
      // KV, so that batch 128 has the room (the bf16 model on an 80 GB GPU is within a few
      // hundred MB of it).
      engine->model().DropDecodeGraphs();
    }
    if (profile.what == "decode") return;
    const int64_t prompt = 4096;
    KvCache kv(c, engine->backend(), 2 * prompt);
    auto prefill = [&] {
      SequenceChunk chunk;
      chunk.kv_slot = Must(kv.Allocate(prompt), "kv slot");
      for (int64_t i = 0; i < prompt; ++i) {
        chunk.tokens.push_back(static_cast<int32_t>(3 + (i * 7919) % 150000));
      }
      Must(engine->model().Forward({chunk}, &kv), "prefill");
      kv.Free(chunk.kv_slot);
    };
    const int64_t mallocs_before = CudaSystemAllocations(engine->backend());
    const double ms = TimeMs(stream, 1, quick ? 2 : 5, prefill);
    const int64_t mallocs = CudaSystemAllocations(engine->backend()) - mallocs_before;
    profile.Once("prefill", prefill);
    if (profiling) return;
    prefill_tok_s[dtype] = prompt / (ms * 1e-3);
    // cudaMallocs in the timed prompts: more than the first one's means the pool gives its
    // blocks back and takes them again (a device synchronisation each), i.e. too little free
    // memory beside the model for a prompt's temporaries.
    std::printf("  %-5s prefill of %ld tokens: %.1f tokens/s, %.2f ms (%ld cudaMallocs)\n",
                dtype.c_str(), static_cast<long>(prompt), prompt / (ms * 1e-3), ms,
                static_cast<long>(mallocs));
    report->Add({{"section", "prefill_fp8"},
                 {"dtype", dtype},
                 {"layers", layers},
                 {"tokens_per_s", prompt / (ms * 1e-3)}});
  }
  for (const Fp8Parts& parts : fp8_parts) {
    const char* label = parts.label.c_str();
    for (int64_t batch : batches) {
      std::printf("  %s / bf16 at batch %ld: %.2fx\n", label, static_cast<long>(batch),
                  tok_s[{parts.label, batch}] / tok_s[{"bf16", batch}]);
    }
    std::printf("  %s / bf16 prefill: %.2fx\n", label,
                prefill_tok_s[parts.label] / prefill_tok_s["bf16"]);
  }
}

int Main(int argc, char** argv) {
  bool quick = false, ffn_only = false, low_latency = false, sampling = false, fp8 = false,
       fp8_decode = false;
  Profile profile;
  int layers = 48;
  std::string json;
  std::vector<int64_t> decode_batches;  // --fp8-decode's batches, when given
  std::vector<Fp8Parts> fp8_parts;      // --fp8-decode's FP8 engines (all, when not given)
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--quick") {
      quick = true;
    } else if (a == "--layers" && i + 1 < argc) {
      layers = std::atoi(argv[++i]);
    } else if (a == "--low-latency") {
      low_latency = true;  // [decode-ll] alone
    } else if (a == "--sampling") {
      sampling = true;  // [sampling] alone
    } else if (a == "--fp8-decode") {
      fp8_decode = true;  // [rates] and [decode-fp8] alone
    } else if (a == "--fp8") {
      fp8 = true;  // [rates], [fp8-linear] and [fp8-ffn] alone
    } else if (a == "--ffn-only") {
      ffn_only = true;  // [rates] and [ffn] alone, for tile experiments
    } else if (a == "--profile" && i + 1 < argc) {
      profile.what = argv[++i];
    } else if (a == "--batch" && i + 1 < argc) {
      profile.batch = std::atoi(argv[++i]);
    } else if (a == "--json" && i + 1 < argc) {
      json = argv[++i];
    } else if (a == "--fp8-parts" && i + 1 < argc) {
      const std::vector<std::string> list = absl::StrSplit(argv[++i], ',', absl::SkipEmpty());
      for (const std::string& part : list) {
        absl::StatusOr<Fp8Parts> parts = ParseFp8Part(part);
        if (!parts.ok()) {
          std::fprintf(stderr, "gpu_bench: %s\n", std::string(parts.status().message()).c_str());
          return 2;
        }
        fp8_parts.push_back(*std::move(parts));
      }
    } else if (a == "--decode-batches" && i + 1 < argc) {
      const std::vector<std::string> list = absl::StrSplit(argv[++i], ',', absl::SkipEmpty());
      for (const std::string& b : list) {
        decode_batches.push_back(std::atoll(b.c_str()));
      }
    } else {
      std::fprintf(stderr,
                   "usage: gpu_bench [--quick] [--ffn-only | --low-latency | --sampling | --fp8 | "
                   "--fp8-decode [--decode-batches 1,8,32,128]\n"
                   "                 [--fp8-parts all,attention,experts]]\n"
                   "                 [--layers N]\n"
                   "                 [--json FILE]\n"
                   "                 [--profile attention|decode|prefill|ffn [--batch N]]\n");
      return 2;
    }
  }
  if (low_latency) {
    // Every rank of [decode-ll] is in this process, where a lazily loaded kernel's first
    // launch can wait for the ranks' spinning waits (expert_service/local_low_latency_experts.h):
    // load every module up front, before the runtime starts.
    setenv("CUDA_MODULE_LOADING", "EAGER", 1);
    Report report(json);
    LowLatencyDecode(quick, layers, &report);
    return 0;
  }
  if (sampling) {
    Report report(json);
    SamplingOverhead(quick, layers, &report);
    return 0;
  }
  std::unique_ptr<Backend> backend = Must(MakeCudaBackend(0), "no GPU");
  cudaDeviceProp prop;
  cudaGetDeviceProperties(&prop, 0);
  std::printf("dxs gpu_bench: %s, %d SMs, %.0f GiB\n", prop.name, prop.multiProcessorCount,
              prop.totalGlobalMem / 1073741824.0);
  Report report(json);
  report.Add({{"section", "device"}, {"name", prop.name}, {"sms", prop.multiProcessorCount}});
  cudaStream_t stream = CudaStreamOf(backend.get());
  const Rates rates = MeasureRates(backend.get(), stream, quick, &report);
  if (fp8) {
    Fp8Benches(rates, quick, profile, &report);
    return 0;
  }
  if (fp8_decode) {
    backend.reset();
    if (fp8_parts.empty()) fp8_parts.push_back(*ParseFp8Part("all"));
    Fp8ModelBenches(rates, quick, layers, profile, decode_batches, fp8_parts, &report);
    return 0;
  }
  // The per-expert cuBLAS grouped FFN, for the choice between it and CUTLASS (at every
  // size: without gemv.cu's decode-sized path, which would take the small batches).
  // The caller's DXS_CUDA_GEMV stays for every other backend (run_device.sh gemv sets it).
  std::unique_ptr<Backend> cublas =
      BackendWith({{"DXS_CUDA_GROUPED_GEMM", "cublas"}, {"DXS_CUDA_GEMV", "off"}});
  if (profile.what.empty()) GroupedFfn(backend.get(), stream, cublas.get(), rates, quick, &report);
  cublas.reset();
  if (ffn_only) return 0;
  if (profile.what.empty() || profile.what == "attention") {
    DecodeAttention(backend.get(), stream, rates, quick, profile, &report);
  }
  if (profile.what.empty() || profile.what == "attention") {
    PrefillAttention(backend.get(), stream, rates, quick, &report);
  }
  if (profile.what == "attention") return 0;
  backend.reset();  // the model below makes its own backend and needs the memory
  ModelBenches(rates, quick, layers, profile, &report);
  return 0;
}

}  // namespace
}  // namespace dxs

int main(int argc, char** argv) {
  // This binary links the CUDA backend in: its low-latency exchange too (not the plugin's).
  dxs::UseInProcessLowLatencyExchange(dxs::MakeCudaLowLatencyExchange);
  return dxs::Main(argc, argv);
}
