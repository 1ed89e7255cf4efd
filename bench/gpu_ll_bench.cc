// gpu_ll_bench: the low-latency exchange's round trip (dataplane/low_latency/cuda/ll_exchange.cuh)
// between an attention rank and an expert rank of one process, each on its own stream (and, with
// --devices A,B, the attention rank on GPU A and the expert rank on GPU B, each storing
// into the other's memory through peer access: NVLink between two H200s) and each
// replaying its CUDA graph: dispatch send, the expert's wait and combine send (its experts
// are the identity: the combine returns the dispatched rows), the attention rank's wait
// and reduce. Beside it in the same run, the copy floor: the same bytes moved by two
// cudaMemcpyPeerAsync (there and back, between the same two GPUs). On one GPU both sides
// write HBM, not NVLink: the figure is the exchange's own cost (launches, flags, waits).
// Each size twice: bf16 rows, then FP8 rows (--wire-dtype fp8's records, quantized before
// the send and dequantized after the expert's wait, inside the graphs), the floor of each
// its own bytes. CUDA events, warm-up, medians, top-8 of 128 random experts.
//   gpu_ll_bench [--reps N] [--json FILE] [--devices A,B]   (default 0,0)
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "dataplane/low_latency/cuda/ll_exchange.cuh"
#include "kernels/cuda/ops.cuh"

namespace {

using dxs::cuda::ElemType;
using dxs::cuda::LlRegionLayout;
using dxs::cuda::LlSync;

#define CHECK_CUDA(expr)                                                                          \
  do {                                                                                            \
    const cudaError_t e_ = (expr);                                                                \
    if (e_ != cudaSuccess) {                                                                      \
      std::fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #expr, cudaGetErrorString(e_)); \
      std::exit(1);                                                                               \
    }                                                                                             \
  } while (0)

void* Zeroed(size_t bytes) {
  void* p = nullptr;
  CHECK_CUDA(cudaMalloc(&p, std::max<size_t>(bytes, 16)));
  CHECK_CUDA(cudaMemset(p, 0, std::max<size_t>(bytes, 16)));
  return p;
}

float Median(std::vector<float> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

struct Result {
  float ll_us, copy_us;
};

// bf16 bits as a float.
float Bf16(uint16_t bits) {
  const uint32_t u = static_cast<uint32_t>(bits) << 16;
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

// fp8: the rows go as FP8 records (--wire-dtype fp8's format: quantized per token and 128
// channels on the attention rank before the send, dequantized to bf16 on the expert rank
// after its wait, the combine bf16), as the services' FP8 low-latency steps do.
Result Measure(int tokens, int hidden, int reps, int num_sms, int dev_a, int dev_b, bool fp8) {
  constexpr int kTopK = 8, kExperts = 128;
  const int record_bytes = 4 * ((hidden + 127) / 128) + hidden;
  const LlRegionLayout d =
      fp8 ? dxs::cuda::MakeLlRecordRegionLayout(1, tokens, record_bytes, kTopK)
          : dxs::cuda::MakeLlRegionLayout(1, tokens, hidden, kTopK, ElemType::kBF16);
  const LlRegionLayout c = dxs::cuda::MakeLlRegionLayout(1, tokens, hidden, 0, ElemType::kBF16);
  // The expert rank's memory (its dispatch region, its sync, its peers' combine regions)
  // on GPU B; the attention rank's on GPU A.
  CHECK_CUDA(cudaSetDevice(dev_b));
  char* dispatch = static_cast<char*>(Zeroed(d.bytes));
  auto* expert_sync = static_cast<LlSync*>(Zeroed(sizeof(LlSync)));
  void** combine_peers = static_cast<void**>(Zeroed(sizeof(void*)));
  cudaStream_t expert;
  CHECK_CUDA(cudaStreamCreateWithFlags(&expert, cudaStreamNonBlocking));
  CHECK_CUDA(cudaSetDevice(dev_a));
  char* combine = static_cast<char*>(Zeroed(c.bytes));
  auto* attention_sync = static_cast<LlSync*>(Zeroed(sizeof(LlSync)));
  void** dispatch_peers = static_cast<void**>(Zeroed(sizeof(void*)));
  cudaStream_t attention;
  CHECK_CUDA(cudaStreamCreateWithFlags(&attention, cudaStreamNonBlocking));
  CHECK_CUDA(cudaMemcpy(dispatch_peers, &dispatch, sizeof(void*), cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemcpy(combine_peers, &combine, sizeof(void*), cudaMemcpyHostToDevice));
  // Random rows (never zeros), ids and weights; every expert on the one expert rank.
  std::mt19937 rng(tokens * 7919 + hidden);
  std::vector<uint16_t> x(static_cast<size_t>(tokens) * hidden);
  for (uint16_t& v : x) v = static_cast<uint16_t>(0x3c00 + rng() % 0x200);  // bf16 in [1/128, 2)
  std::vector<int32_t> ids(static_cast<size_t>(tokens) * kTopK);
  std::vector<float> weights(ids.size(), 0.125f);
  for (size_t i = 0; i < ids.size(); ++i) ids[i] = static_cast<int32_t>(rng() % kExperts);
  std::vector<int32_t> owner(kExperts, 0);
  void* x_d = Zeroed(x.size() * 2);
  void* ids_d = Zeroed(ids.size() * 4);
  void* w_d = Zeroed(weights.size() * 4);
  void* owner_d = Zeroed(owner.size() * 4);
  void* out_d = Zeroed(x.size() * 2);
  CHECK_CUDA(cudaMemcpy(x_d, x.data(), x.size() * 2, cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemcpy(ids_d, ids.data(), ids.size() * 4, cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemcpy(w_d, weights.data(), weights.size() * 4, cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemcpy(owner_d, owner.data(), owner.size() * 4, cudaMemcpyHostToDevice));
  // FP8: the attention rank's records before they go (rows 0..tokens of x), and the expert
  // rank's dequantized rows.
  void* records_d = nullptr;
  void* record_rows_d = nullptr;
  void* y_d = nullptr;
  if (fp8) {
    records_d = Zeroed(static_cast<size_t>(tokens) * record_bytes);
    std::vector<int32_t> rows(tokens);
    for (int t = 0; t < tokens; ++t) rows[t] = t;
    record_rows_d = Zeroed(rows.size() * 4);
    CHECK_CUDA(cudaMemcpy(record_rows_d, rows.data(), rows.size() * 4, cudaMemcpyHostToDevice));
    CHECK_CUDA(cudaSetDevice(dev_b));
    y_d = Zeroed(x.size() * 2);
    CHECK_CUDA(cudaSetDevice(dev_a));
  }
  std::string error;
  auto check = [&](cudaError_t e) {
    if (e != cudaSuccess) {
      std::fprintf(stderr, "%s (%s)\n", error.c_str(), cudaGetErrorString(e));
      std::exit(1);
    }
  };
  auto capture = [&](cudaStream_t s, auto&& body) {
    CHECK_CUDA(cudaStreamBeginCapture(s, cudaStreamCaptureModeRelaxed));
    body();
    cudaGraph_t g;
    CHECK_CUDA(cudaStreamEndCapture(s, &g));
    cudaGraphExec_t exec;
    CHECK_CUDA(cudaGraphInstantiate(&exec, g, 0));
    CHECK_CUDA(cudaGraphDestroy(g));
    return exec;
  };
  constexpr int64_t kTimeoutNs = 5'000'000'000;
  cudaGraphExec_t attention_graph = capture(attention, [&] {
    if (fp8) {
      check(dxs::cuda::LaunchQuantizeRowsFp8(x_d, ElemType::kBF16, tokens,
                                             static_cast<const int32_t*>(record_rows_d), tokens,
                                             hidden, records_d, attention));
    }
    dxs::cuda::LlDispatchSendArgs s;
    s.x = fp8 ? records_d : x_d;
    s.topk_ids = static_cast<const int32_t*>(ids_d);
    s.topk_weights = static_cast<const float*>(w_d);
    s.num_tokens = tokens;
    s.expert_owner = static_cast<const int32_t*>(owner_d);
    s.num_experts = kExperts;
    s.regions = dispatch_peers;
    s.num_ranks = 1;
    s.layout = d;
    s.sync = attention_sync;
    check(dxs::cuda::LaunchLlDispatchSend(s, num_sms, attention, &error));
    check(dxs::cuda::LaunchLlWait(combine, c, attention_sync, kTimeoutNs, attention, &error));
    dxs::cuda::LlCombineReduceArgs r;
    r.region = combine;
    r.layout = c;
    r.row_type = ElemType::kBF16;
    r.topk_ids = static_cast<const int32_t*>(ids_d);
    r.top_k = kTopK;
    r.expert_owner = static_cast<const int32_t*>(owner_d);
    r.num_experts = kExperts;
    r.num_tokens = tokens;
    r.out = out_d;
    r.out_type = ElemType::kBF16;
    check(dxs::cuda::LaunchLlCombineReduce(r, num_sms, attention, &error));
  });
  CHECK_CUDA(cudaSetDevice(dev_b));
  cudaGraphExec_t expert_graph = capture(expert, [&] {
    check(dxs::cuda::LaunchLlWait(dispatch, d, expert_sync, kTimeoutNs, expert, &error));
    if (fp8) {
      check(dxs::cuda::LaunchDequantizeRowsFp8(dispatch + d.rows, tokens, hidden, y_d,
                                               ElemType::kBF16, expert));
    }
    dxs::cuda::LlCombineSendArgs cs;
    cs.y = fp8 ? y_d : dispatch + d.rows;  // identity experts: the dispatched rows go back
    cs.dispatch_region = dispatch;
    cs.dispatch = d;
    cs.regions = combine_peers;
    cs.combine = c;
    cs.sync = expert_sync;
    check(dxs::cuda::LaunchLlCombineSend(cs, num_sms, expert, &error));
  });
  CHECK_CUDA(cudaSetDevice(dev_a));
  cudaEvent_t start, stop;
  CHECK_CUDA(cudaEventCreate(&start));
  CHECK_CUDA(cudaEventCreate(&stop));
  std::vector<float> ll, copy;
  for (int i = 0; i < 20 + reps; ++i) {
    CHECK_CUDA(cudaEventRecord(start, attention));
    CHECK_CUDA(cudaGraphLaunch(expert_graph, expert));
    CHECK_CUDA(cudaGraphLaunch(attention_graph, attention));
    CHECK_CUDA(cudaEventRecord(stop, attention));
    CHECK_CUDA(cudaStreamSynchronize(expert));
    CHECK_CUDA(cudaEventSynchronize(stop));
    float ms = 0;
    CHECK_CUDA(cudaEventElapsedTime(&ms, start, stop));
    if (i >= 20) ll.push_back(ms * 1000.f);
  }
  LlSync status = {};
  CHECK_CUDA(dxs::cuda::LlReadSync(attention_sync, &status));
  if (status.error != 0) {
    std::fprintf(stderr, "the exchange timed out\n");
    std::exit(1);
  }
  // The output must be the input: every token went to the one rank, as itself (FP8: within
  // e4m3's rounding, 2^-4 of a value, and bf16's of the result).
  std::vector<uint16_t> out(x.size());
  CHECK_CUDA(cudaMemcpy(out.data(), out_d, out.size() * 2, cudaMemcpyDeviceToHost));
  for (size_t i = 0; i < x.size(); ++i) {
    const float want = Bf16(x[i]), got = Bf16(out[i]);
    if (fp8 ? !(std::fabs(got - want) <= 0.07f * want) : out[i] != x[i]) {
      std::fprintf(stderr, "the round trip changed row %zu: %g, not %g\n", i / hidden, got, want);
      std::exit(1);
    }
  }
  // The floor: the bytes that crossed, there (bf16 rows or FP8 records) and back (bf16).
  const size_t bytes = x.size() * 2;
  const size_t there = fp8 ? static_cast<size_t>(tokens) * record_bytes : bytes;
  for (int i = 0; i < 20 + reps; ++i) {
    CHECK_CUDA(cudaEventRecord(start, attention));
    CHECK_CUDA(cudaMemcpyPeerAsync(dispatch + d.rows, dev_b, fp8 ? records_d : x_d, dev_a, there,
                                   attention));
    CHECK_CUDA(
        cudaMemcpyPeerAsync(out_d, dev_a, fp8 ? y_d : dispatch + d.rows, dev_b, bytes, attention));
    CHECK_CUDA(cudaEventRecord(stop, attention));
    CHECK_CUDA(cudaEventSynchronize(stop));
    float ms = 0;
    CHECK_CUDA(cudaEventElapsedTime(&ms, start, stop));
    if (i >= 20) copy.push_back(ms * 1000.f);
  }
  cudaGraphExecDestroy(attention_graph);
  cudaGraphExecDestroy(expert_graph);
  cudaStreamDestroy(attention);
  cudaStreamDestroy(expert);
  for (void* p : {static_cast<void*>(dispatch), static_cast<void*>(combine),
                  static_cast<void*>(attention_sync), static_cast<void*>(expert_sync),
                  static_cast<void*>(dispatch_peers), static_cast<void*>(combine_peers), x_d, ids_d,
                  w_d, owner_d, out_d, records_d, record_rows_d, y_d}) {
    if (p != nullptr) cudaFree(p);
  }
  return {Median(ll), Median(copy)};
}

}  // namespace

int main(int argc, char** argv) {
  int reps = 200;
  int dev_a = 0, dev_b = 0;
  std::string json;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--reps") == 0 && i + 1 < argc) reps = std::atoi(argv[++i]);
    if (std::strcmp(argv[i], "--json") == 0 && i + 1 < argc) json = argv[++i];
    if (std::strcmp(argv[i], "--devices") == 0 && i + 1 < argc &&
        std::sscanf(argv[++i], "%d,%d", &dev_a, &dev_b) != 2) {
      std::fprintf(stderr, "gpu_ll_bench: --devices takes A,B\n");
      return 2;
    }
  }
  int device_count = 0;
  if (cudaGetDeviceCount(&device_count) != cudaSuccess || device_count == 0) {
    std::fprintf(stderr, "gpu_ll_bench: no CUDA device\n");
    return 2;
  }
  if (dev_a < 0 || dev_b < 0 || dev_a >= device_count || dev_b >= device_count) {
    std::fprintf(stderr, "gpu_ll_bench: --devices %d,%d, but this machine has %d GPU(s)\n", dev_a,
                 dev_b, device_count);
    return 2;
  }
  if (dev_a != dev_b) {
    // Each rank stores into the other's memory: peer access both ways (NVLink on H200s).
    int can_ab = 0, can_ba = 0;
    CHECK_CUDA(cudaDeviceCanAccessPeer(&can_ab, dev_a, dev_b));
    CHECK_CUDA(cudaDeviceCanAccessPeer(&can_ba, dev_b, dev_a));
    if (!can_ab || !can_ba) {
      std::fprintf(stderr, "gpu_ll_bench: GPUs %d and %d have no peer access\n", dev_a, dev_b);
      return 2;
    }
    CHECK_CUDA(cudaSetDevice(dev_a));
    CHECK_CUDA(cudaDeviceEnablePeerAccess(dev_b, 0));
    CHECK_CUDA(cudaSetDevice(dev_b));
    CHECK_CUDA(cudaDeviceEnablePeerAccess(dev_a, 0));
  }
  int num_sms = 0;
  CHECK_CUDA(cudaDeviceGetAttribute(&num_sms, cudaDevAttrMultiProcessorCount, dev_a));
  FILE* out = json.empty() ? nullptr : std::fopen(json.c_str(), "w");
  std::printf(
      "LL exchange round trip, 1 attention rank (GPU %d) + 1 expert rank (GPU %d) of one "
      "process\n",
      dev_a, dev_b);
  for (int hidden : {2048, 7168}) {
    for (int tokens : {1, 128, 1024, 4096}) {
      const Result r = Measure(tokens, hidden, reps, num_sms, dev_a, dev_b, /*fp8=*/false);
      const Result f = Measure(tokens, hidden, reps, num_sms, dev_a, dev_b, /*fp8=*/true);
      std::printf(
          "hidden %5d tokens %5d: LL %8.1f us, copy floor %8.1f us, %.2fx the floor; FP8 rows "
          "%8.1f us (%.2fx bf16's), floor %8.1f us\n",
          hidden, tokens, r.ll_us, r.copy_us, r.ll_us / r.copy_us, f.ll_us, f.ll_us / r.ll_us,
          f.copy_us);
      if (out != nullptr) {
        std::fprintf(out,
                     "{\"section\": \"ll_exchange\", \"hidden\": %d, \"tokens\": %d, "
                     "\"devices\": [%d, %d], \"ll_us\": %.2f, \"copy_us\": %.2f, "
                     "\"ll_fp8_us\": %.2f, \"copy_fp8_us\": %.2f}\n",
                     hidden, tokens, dev_a, dev_b, r.ll_us, r.copy_us, f.ll_us, f.copy_us);
      }
    }
  }
  if (out != nullptr) std::fclose(out);
  return 0;
}
