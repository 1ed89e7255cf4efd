// The low-latency exchange (dataplane/low_latency/cuda/ll_exchange.cuh) between attention and
// expert ranks that live in one process on one GPU, each on its own stream (the regions are plain
// device memory here; between processes they are CUDA IPC mappings, the same kernels): rounds of
// dispatch, stand-in experts and combine against a host reference computed the same way, bit
// for bit; empty-batch ranks on both sides; the same rounds replayed from CUDA graphs with
// the token count on the device; a peer that never answers gives an error, not a hang.
#include <cuda_bf16.h>
#include <cuda_runtime_api.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "dataplane/low_latency/cuda/ll_exchange.cuh"
#include "gtest/gtest.h"
#include "tests/dataplane/low_latency/ll_exchange_test_experts.h"
#include "tests/dataplane/transport/pipe_io.h"
#include "tests/kernels/cuda/cuda_test_util.h"

namespace dxs {
namespace {

using cuda::ElemType;
using cuda::LlRegionLayout;
using cuda::LlSync;

constexpr int64_t kWaitNs = 5'000'000'000;  // the exchange's 5 s

uint16_t ToBf16Bits(float v) {  // round to nearest even (no NaNs here)
  uint32_t u;
  std::memcpy(&u, &v, 4);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}
float FromBf16Bits(uint16_t b) {
  const uint32_t u = static_cast<uint32_t>(b) << 16;
  float v;
  std::memcpy(&v, &u, 4);
  return v;
}

template <typename T>
T* DeviceAlloc(size_t count, std::vector<void*>* owned) {
  void* p = nullptr;
  EXPECT_EQ(cudaMalloc(&p, std::max<size_t>(count * sizeof(T), 16)), cudaSuccess);
  EXPECT_EQ(cudaMemset(p, 0, std::max<size_t>(count * sizeof(T), 16)), cudaSuccess);
  owned->push_back(p);
  return static_cast<T*>(p);
}

// One round's input of an attention rank.
struct RankInput {
  int64_t tokens = 0;
  std::vector<uint16_t> x;   // bf16 bits [tokens, hidden]
  std::vector<int32_t> ids;  // [tokens, top_k]
  std::vector<float> weights;
};

// What an attention rank's output must be: per token, the stand-in experts' bf16 row of each
// expert rank it went to, summed in ascending rank order; rows past the tokens untouched
// (the NaN bits of the poisoned output).
std::vector<float> ReferenceOutput(const RankInput& in, const std::vector<int32_t>& owner,
                                   int expert_ranks, int top_k, int experts, int hidden,
                                   int capacity) {
  std::vector<float> out(static_cast<size_t>(capacity) * hidden);
  const uint32_t nan_bits = 0xffffffffu;
  for (float& v : out) std::memcpy(&v, &nan_bits, 4);
  for (int64_t t = 0; t < in.tokens; ++t) {
    for (int h = 0; h < hidden; ++h) {
      const float xv = FromBf16Bits(in.x[t * hidden + h]);
      float sum = 0.f;
      for (int r = 0; r < expert_ranks; ++r) {
        float acc = 0.f;
        bool here = false;
        for (int k = 0; k < top_k; ++k) {
          const int32_t x = in.ids[t * top_k + k];
          if (x < 0 || x >= experts || owner[x] != r) continue;
          here = true;
          const float coef = in.weights[t * top_k + k] * (static_cast<float>(x + 1) / 16.f);
          acc = std::fma(coef, xv, acc);
        }
        if (here) sum += FromBf16Bits(ToBf16Bits(acc));
      }
      out[t * hidden + h] = sum;
    }
  }
  return out;
}

// A attention ranks and E expert ranks in one process, each with its stream and regions.
class LlCluster {
 public:
  LlCluster(int attention, int experts_ranks, int capacity, int hidden, int top_k, int experts)
      : a_(attention),
        e_(experts_ranks),
        cap_(capacity),
        hidden_(hidden),
        k_(top_k),
        experts_(experts) {
    d_ = cuda::MakeLlRegionLayout(a_, cap_, hidden_, k_, ElemType::kBF16);
    c_ = cuda::MakeLlRegionLayout(e_, cap_, hidden_, 0, ElemType::kBF16);
    EXPECT_GT(d_.bytes, 0u);
    EXPECT_GT(c_.bytes, 0u);
    int device = 0;
    cudaGetDevice(&device);
    cudaDeviceGetAttribute(&num_sms_, cudaDevAttrMultiProcessorCount, device);
    // Experts [0, 10) on expert rank 0, the rest spread over the others (uneven).
    for (int x = 0; x < experts_; ++x) owner_.push_back(e_ == 1 || x < 10 ? 0 : 1 + x % (e_ - 1));
    owner_d_ = Upload(owner_);
    for (int r = 0; r < a_ + e_; ++r) {
      cudaStream_t s = nullptr;
      EXPECT_EQ(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), cudaSuccess);
      streams_.push_back(s);
      syncs_.push_back(DeviceAlloc<LlSync>(1, &owned_));
    }
    for (int r = 0; r < a_; ++r) combine_.push_back(DeviceAlloc<char>(c_.bytes, &owned_));
    for (int r = 0; r < e_; ++r) dispatch_.push_back(DeviceAlloc<char>(d_.bytes, &owned_));
    dispatch_peers_ = Upload(std::vector<void*>(dispatch_.begin(), dispatch_.end()));
    combine_peers_ = Upload(std::vector<void*>(combine_.begin(), combine_.end()));
    for (int r = 0; r < a_; ++r) {
      x_.push_back(DeviceAlloc<uint16_t>(static_cast<size_t>(cap_) * hidden_, &owned_));
      ids_.push_back(DeviceAlloc<int32_t>(static_cast<size_t>(cap_) * k_, &owned_));
      w_.push_back(DeviceAlloc<float>(static_cast<size_t>(cap_) * k_, &owned_));
      count_.push_back(DeviceAlloc<int32_t>(1, &owned_));
      out_.push_back(DeviceAlloc<float>(static_cast<size_t>(cap_) * hidden_, &owned_));
    }
    for (int r = 0; r < e_; ++r) {
      y_.push_back(DeviceAlloc<uint16_t>(static_cast<size_t>(a_) * cap_ * hidden_, &owned_));
    }
  }
  ~LlCluster() {
    cudaDeviceSynchronize();
    for (cudaGraphExec_t g : graphs_) cudaGraphExecDestroy(g);
    for (cudaStream_t s : streams_) cudaStreamDestroy(s);
    for (void* p : owned_) cudaFree(p);
  }

  const std::vector<int32_t>& owner() const { return owner_; }
  int num_sms() const { return num_sms_; }
  LlSync* attention_sync(int a) const { return syncs_[a]; }
  cudaStream_t attention_stream(int a) const { return streams_[a]; }

  // Writes each rank's input into its fixed buffers and poisons its output (NaN bits).
  void Stage(const std::vector<RankInput>& in) {
    for (int a = 0; a < a_; ++a) {
      const RankInput& r = in[a];
      ASSERT_EQ(cudaMemcpy(x_[a], r.x.data(), r.x.size() * 2, cudaMemcpyHostToDevice), cudaSuccess);
      ASSERT_EQ(cudaMemcpy(ids_[a], r.ids.data(), r.ids.size() * 4, cudaMemcpyHostToDevice),
                cudaSuccess);
      ASSERT_EQ(cudaMemcpy(w_[a], r.weights.data(), r.weights.size() * 4, cudaMemcpyHostToDevice),
                cudaSuccess);
      const int32_t n = static_cast<int32_t>(r.tokens);
      ASSERT_EQ(cudaMemcpy(count_[a], &n, 4, cudaMemcpyHostToDevice), cudaSuccess);
      ASSERT_EQ(cudaMemset(out_[a], 0xff, static_cast<size_t>(cap_) * hidden_ * 4), cudaSuccess);
    }
  }

  // The three parts of a round, on each rank's stream. `tokens` < 0: the count is read on
  // the device (graphs); otherwise it is the host's.
  void EnqueueDispatch(int a, int64_t tokens) {
    cuda::LlDispatchSendArgs s;
    s.x = x_[a];
    s.topk_ids = ids_[a];
    s.topk_weights = w_[a];
    s.num_tokens_device = tokens < 0 ? count_[a] : nullptr;
    s.num_tokens = tokens < 0 ? cap_ : tokens;
    s.expert_owner = owner_d_;
    s.num_experts = experts_;
    s.regions = dispatch_peers_;
    s.num_ranks = e_;
    s.source = a;
    s.layout = d_;
    s.sync = syncs_[a];
    std::string error;
    ASSERT_EQ(cuda::LaunchLlDispatchSend(s, num_sms_, streams_[a], &error), cudaSuccess) << error;
  }
  void EnqueueExperts(int e) {
    std::string error;
    cudaStream_t s = streams_[a_ + e];
    ASSERT_EQ(cuda::LaunchLlWait(dispatch_[e], d_, syncs_[a_ + e], kWaitNs, s, &error), cudaSuccess)
        << error;
    ASSERT_EQ(testing::LaunchStandInExperts(dispatch_[e], d_, y_[e], s), cudaSuccess);
    cuda::LlCombineSendArgs c;
    c.y = y_[e];
    c.dispatch_region = dispatch_[e];
    c.dispatch = d_;
    c.regions = combine_peers_;
    c.combine = c_;
    c.source = e;
    c.sync = syncs_[a_ + e];
    ASSERT_EQ(cuda::LaunchLlCombineSend(c, num_sms_, s, &error), cudaSuccess) << error;
  }
  void EnqueueCombine(int a, int64_t tokens, int64_t timeout_ns = kWaitNs) {
    std::string error;
    ASSERT_EQ(cuda::LaunchLlWait(combine_[a], c_, syncs_[a], timeout_ns, streams_[a], &error),
              cudaSuccess)
        << error;
    cuda::LlCombineReduceArgs r;
    r.region = combine_[a];
    r.layout = c_;
    r.row_type = ElemType::kBF16;
    r.topk_ids = ids_[a];
    r.top_k = k_;
    r.expert_owner = owner_d_;
    r.num_experts = experts_;
    r.num_tokens_device = tokens < 0 ? count_[a] : nullptr;
    r.num_tokens = tokens < 0 ? cap_ : tokens;
    r.out = out_[a];
    r.out_type = ElemType::kF32;
    ASSERT_EQ(cuda::LaunchLlCombineReduce(r, num_sms_, streams_[a], &error), cudaSuccess) << error;
  }

  // An eager round over staged inputs.
  void RunEager(const std::vector<RankInput>& in) {
    for (int a = 0; a < a_; ++a) ASSERT_NO_FATAL_FAILURE(EnqueueDispatch(a, in[a].tokens));
    for (int e = 0; e < e_; ++e) ASSERT_NO_FATAL_FAILURE(EnqueueExperts(e));
    for (int a = 0; a < a_; ++a) ASSERT_NO_FATAL_FAILURE(EnqueueCombine(a, in[a].tokens));
    ASSERT_NO_FATAL_FAILURE(SyncAll());
  }

  // Captures each rank's part of a round (device token counts) as its own graph.
  void Capture() {
    auto capture = [&](int rank, auto&& body) {
      cudaStream_t s = streams_[rank];
      ASSERT_EQ(cudaStreamBeginCapture(s, cudaStreamCaptureModeRelaxed), cudaSuccess);
      body();
      cudaGraph_t graph = nullptr;
      ASSERT_EQ(cudaStreamEndCapture(s, &graph), cudaSuccess);
      cudaGraphExec_t exec = nullptr;
      ASSERT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);
      cudaGraphDestroy(graph);
      graphs_.push_back(exec);
      graph_rank_.push_back(rank);
    };
    for (int a = 0; a < a_; ++a) {
      ASSERT_NO_FATAL_FAILURE(capture(a, [&] {
        EnqueueDispatch(a, -1);
        EnqueueCombine(a, -1);
      }));
    }
    for (int e = 0; e < e_; ++e)
      ASSERT_NO_FATAL_FAILURE(capture(a_ + e, [&] { EnqueueExperts(e); }));
  }
  void RunGraphs() {
    for (size_t g = 0; g < graphs_.size(); ++g) {
      ASSERT_EQ(cudaGraphLaunch(graphs_[g], streams_[graph_rank_[g]]), cudaSuccess);
    }
    ASSERT_NO_FATAL_FAILURE(SyncAll());
  }

  void SyncAll() {
    for (cudaStream_t s : streams_) ASSERT_EQ(cudaStreamSynchronize(s), cudaSuccess);
    for (int r = 0; r < a_ + e_; ++r) {
      cuda::LlSync sync = {};
      ASSERT_EQ(cuda::LlReadSync(syncs_[r], &sync), cudaSuccess);
      ASSERT_EQ(sync.error, 0) << "rank " << r << " timed out waiting for source "
                               << sync.error_source;
    }
  }

  std::vector<float> Output(int a) const {
    std::vector<float> out(static_cast<size_t>(cap_) * hidden_);
    EXPECT_EQ(cudaMemcpy(out.data(), out_[a], out.size() * 4, cudaMemcpyDeviceToHost), cudaSuccess);
    return out;
  }

  std::vector<float> Reference(const RankInput& in) const {
    return ReferenceOutput(in, owner_, e_, k_, experts_, hidden_, cap_);
  }

 private:
  template <typename T>
  T* Upload(const std::vector<T>& v) {
    T* d = DeviceAlloc<T>(v.size(), &owned_);
    EXPECT_EQ(cudaMemcpy(d, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice), cudaSuccess);
    return d;
  }

  int a_, e_, cap_, hidden_, k_, experts_;
  int num_sms_ = 1;
  LlRegionLayout d_, c_;
  std::vector<int32_t> owner_;
  int32_t* owner_d_ = nullptr;
  std::vector<cudaStream_t> streams_;
  std::vector<LlSync*> syncs_;  // attention ranks, then expert ranks
  std::vector<char*> dispatch_, combine_;
  void** dispatch_peers_ = nullptr;
  void** combine_peers_ = nullptr;
  std::vector<uint16_t*> x_;
  std::vector<int32_t*> ids_;
  std::vector<float*> w_;
  std::vector<int32_t*> count_;
  std::vector<float*> out_;
  std::vector<uint16_t*> y_;
  std::vector<cudaGraphExec_t> graphs_;
  std::vector<int> graph_rank_;
  std::vector<void*> owned_;
};

// `tokens` tokens of top-k distinct experts out of `experts` (only those below
// `expert_limit`), some tokens padding (every id -1) when `padding`.
RankInput MakeInput(int64_t tokens, int hidden, int top_k, int experts, int expert_limit,
                    bool padding, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> unit(-1.f, 1.f), weight(0.05f, 1.f);
  RankInput in;
  in.tokens = tokens;
  for (int64_t i = 0; i < tokens * hidden; ++i) in.x.push_back(ToBf16Bits(unit(rng)));
  for (int64_t t = 0; t < tokens; ++t) {
    std::vector<int32_t> pool(expert_limit);
    for (int x = 0; x < expert_limit; ++x) pool[x] = x;
    std::shuffle(pool.begin(), pool.end(), rng);
    const bool pad = padding && t % 3 == 1;
    for (int k = 0; k < top_k; ++k) {
      in.ids.push_back(pad ? -1 : pool[k]);
      in.weights.push_back(weight(rng));
    }
  }
  (void)experts;
  return in;
}

void ExpectBits(const std::vector<float>& got, const std::vector<float>& want, const char* what) {
  ASSERT_EQ(got.size(), want.size());
  int shown = 0;
  for (size_t i = 0; i < got.size() && shown < 8; ++i) {
    if (std::memcmp(&got[i], &want[i], 4) != 0) {
      ADD_FAILURE() << what << ": element " << i << " got " << got[i] << ", want " << want[i];
      ++shown;
    }
  }
}

TEST(LlExchangeGuard, LayoutsAndLaunchersRejectBadArguments) {
  // No device needed: every check comes before CUDA.
  EXPECT_EQ(cuda::MakeLlRegionLayout(1, 8, 12, 8, ElemType::kBF16).bytes, 0u);  // 24-byte rows
  EXPECT_EQ(cuda::MakeLlRegionLayout(33, 8, 2048, 8, ElemType::kBF16).bytes, 0u);
  EXPECT_EQ(cuda::MakeLlRegionLayout(1, 0, 2048, 8, ElemType::kBF16).bytes, 0u);
  EXPECT_EQ(cuda::MakeLlRegionLayout(1, 8, 2048, 33, ElemType::kBF16).bytes, 0u);
  EXPECT_EQ(cuda::MakeLlRegionLayout(1, 8, 2048, 8, ElemType::kI32).bytes, 0u);
  const LlRegionLayout d = cuda::MakeLlRegionLayout(2, 64, 2048, 8, ElemType::kBF16);
  ASSERT_GT(d.bytes, 0u);
  EXPECT_EQ(d.rows % 256, 0u);
  EXPECT_GE(d.bytes, d.rows + size_t{2} * 64 * 4096);
  cuda::LlDispatchSendArgs s;
  s.layout = d;
  s.num_ranks = 1;
  s.num_tokens = 65;
  std::string error;
  EXPECT_EQ(cuda::LaunchLlDispatchSend(s, 132, nullptr, &error), cudaErrorInvalidValue);
  EXPECT_NE(error.find("65 tokens, the capacity is 64"), std::string::npos) << error;
  s.num_tokens = 1;
  s.source = 2;
  EXPECT_EQ(cuda::LaunchLlDispatchSend(s, 132, nullptr, &error), cudaErrorInvalidValue);
  EXPECT_NE(error.find("source 2 outside"), std::string::npos) << error;
  s.source = 0;
  EXPECT_EQ(cuda::LaunchLlDispatchSend(s, 132, nullptr, &error), cudaErrorInvalidValue);
  EXPECT_NE(error.find("null pointer"), std::string::npos) << error;
  EXPECT_EQ(cuda::LaunchLlWait(nullptr, d, nullptr, kWaitNs, nullptr, &error),
            cudaErrorInvalidValue);
  cuda::LlCombineSendArgs c;
  c.dispatch = d;
  c.combine = d;  // has meta: not a combine region
  EXPECT_EQ(cuda::LaunchLlCombineSend(c, 132, nullptr, &error), cudaErrorInvalidValue);
  EXPECT_NE(error.find("no meta"), std::string::npos) << error;
  cuda::LlCombineReduceArgs r;
  r.layout = cuda::MakeLlRegionLayout(2, 64, 2048, 0, ElemType::kBF16);
  r.row_type = ElemType::kF32;  // the region's rows are bf16
  EXPECT_EQ(cuda::LaunchLlCombineReduce(r, 132, nullptr, &error), cudaErrorInvalidValue);
  EXPECT_NE(error.find("row type"), std::string::npos) << error;
}

TEST(LlExchangeGpu, TwoAttentionAndTwoExpertRanksEagerThenGraphs) {
  SKIP_WITHOUT_GPU();
  constexpr int kCap = 64, kHidden = 2048, kTopK = 8, kExperts = 16;
  LlCluster cluster(2, 2, kCap, kHidden, kTopK, kExperts);
  auto round = [&](int64_t t0, int64_t t1, int limit, bool padding, uint32_t seed) {
    return std::vector<RankInput>{
        MakeInput(t0, kHidden, kTopK, kExperts, limit, padding, seed),
        MakeInput(t1, kHidden, kTopK, kExperts, limit, padding, seed + 1)};
  };
  // Eager rounds: attention rank 1 empty; then only expert rank 0's experts (expert rank 1
  // receives nothing); then padding tokens and a full rank.
  const std::vector<std::vector<RankInput>> rounds = {round(37, 0, kExperts, false, 1),
                                                      round(kCap, 5, 10, false, 3),
                                                      round(1, kCap, kExperts, true, 5)};
  std::vector<std::vector<std::vector<float>>> eager_out;
  for (size_t i = 0; i < rounds.size(); ++i) {
    SCOPED_TRACE(::testing::Message() << "eager round " << i);
    ASSERT_NO_FATAL_FAILURE(cluster.Stage(rounds[i]));
    ASSERT_NO_FATAL_FAILURE(cluster.RunEager(rounds[i]));
    eager_out.emplace_back();
    for (int a = 0; a < 2; ++a) {
      eager_out.back().push_back(cluster.Output(a));
      ExpectBits(eager_out.back()[a], cluster.Reference(rounds[i][a]), "eager");
    }
  }
  // The same rounds from graphs (counts on the device), then both attention ranks empty,
  // then new inputs: each equal to the reference, and the replays to the eager bits.
  ASSERT_NO_FATAL_FAILURE(cluster.Capture());
  std::vector<std::vector<RankInput>> replays = rounds;
  replays.push_back(round(0, 0, kExperts, false, 7));
  replays.push_back(round(20, 33, kExperts, true, 9));
  for (size_t i = 0; i < replays.size(); ++i) {
    SCOPED_TRACE(::testing::Message() << "graph round " << i);
    ASSERT_NO_FATAL_FAILURE(cluster.Stage(replays[i]));
    ASSERT_NO_FATAL_FAILURE(cluster.RunGraphs());
    for (int a = 0; a < 2; ++a) {
      const std::vector<float> got = cluster.Output(a);
      ExpectBits(got, cluster.Reference(replays[i][a]), "graph");
      if (i < eager_out.size()) ExpectBits(got, eager_out[i][a], "graph against eager");
    }
  }
}

TEST(LlExchangeGpu, AnExpertRankThatNeverAnswersTimesOutWithoutHanging) {
  SKIP_WITHOUT_GPU();
  LlCluster cluster(1, 2, 8, 256, 4, 16);
  const std::vector<RankInput> in = {MakeInput(3, 256, 4, 16, 16, false, 11)};
  ASSERT_NO_FATAL_FAILURE(cluster.Stage(in));
  // Expert rank 1 never runs: the attention rank's combine wait gives up after 50 ms.
  ASSERT_NO_FATAL_FAILURE(cluster.EnqueueDispatch(0, 3));
  ASSERT_NO_FATAL_FAILURE(cluster.EnqueueExperts(0));
  const auto start = std::chrono::steady_clock::now();
  ASSERT_NO_FATAL_FAILURE(cluster.EnqueueCombine(0, 3, 50'000'000));
  // A later round on the failed rank returns at once, whatever its timeout.
  ASSERT_NO_FATAL_FAILURE(cluster.EnqueueDispatch(0, 3));
  ASSERT_NO_FATAL_FAILURE(cluster.EnqueueCombine(0, 3, 60'000'000'000));
  ASSERT_EQ(cudaStreamSynchronize(cluster.attention_stream(0)), cudaSuccess);
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_LT(seconds, 5.0);
  cuda::LlSync sync = {};
  ASSERT_EQ(cuda::LlReadSync(cluster.attention_sync(0), &sync), cudaSuccess);
  EXPECT_EQ(sync.error, 1);
  EXPECT_EQ(sync.error_source, 1);
  // The first wait gave up on round 1, of which rank 1 had sent nothing (epoch 0).
  EXPECT_EQ(sync.error_round, 1u);
  EXPECT_EQ(sync.error_arrived, 0u);
}

// ---- Across two processes: the regions mapped through CUDA IPC ----
//
// The parent is the attention rank, a child process (this binary again, running only
// LlExchangeIpcChild.ExpertRank) the expert rank. They trade region handles over pipes, then
// run kIpcRounds rounds; the child learns each round's tokens from its region alone. On one
// GPU the two processes' kernels take turns (time slices), so a round is slow; the
// exchange's memory and flags are what this checks.
constexpr int kIpcCap = 16, kIpcHidden = 256, kIpcTopK = 4, kIpcExperts = 8, kIpcRounds = 4;
constexpr char kIpcChildEnv[] = "DXS_LL_IPC_CHILD_FDS";

using testing::ReadAll;
using testing::WriteAll;

TEST(LlExchangeIpcChild, ExpertRank) {
  const char* fds = std::getenv(kIpcChildEnv);
  if (fds == nullptr) {
    GTEST_SKIP() << "runs only as the child of LlExchangeGpu.AcrossTwoProcessesThroughCudaIpc";
  }
  int in = -1, out = -1;
  ASSERT_EQ(std::sscanf(fds, "%d,%d", &in, &out), 2);
  const LlRegionLayout d =
      cuda::MakeLlRegionLayout(1, kIpcCap, kIpcHidden, kIpcTopK, ElemType::kBF16);
  const LlRegionLayout c = cuda::MakeLlRegionLayout(1, kIpcCap, kIpcHidden, 0, ElemType::kBF16);
  std::vector<void*> owned;
  char* dispatch = DeviceAlloc<char>(d.bytes, &owned);
  LlSync* sync = DeviceAlloc<LlSync>(1, &owned);
  void* y = DeviceAlloc<uint16_t>(static_cast<size_t>(kIpcCap) * kIpcHidden, &owned);
  void** peers = DeviceAlloc<void*>(1, &owned);
  cuda::LlRegionHandle mine, theirs;
  ASSERT_EQ(cuda::LlExportRegion(dispatch, &mine), cudaSuccess);
  ASSERT_TRUE(WriteAll(out, &mine, sizeof(mine)));
  ASSERT_TRUE(ReadAll(in, &theirs, sizeof(theirs)));
  void* combine = nullptr;
  ASSERT_EQ(cuda::LlOpenRegion(theirs, &combine), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(peers, &combine, sizeof(void*), cudaMemcpyHostToDevice), cudaSuccess);
  cudaStream_t stream = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
  std::string error;
  for (int round = 0; round < kIpcRounds; ++round) {
    ASSERT_EQ(cuda::LaunchLlWait(dispatch, d, sync, kWaitNs, stream, &error), cudaSuccess) << error;
    ASSERT_EQ(testing::LaunchStandInExperts(dispatch, d, y, stream), cudaSuccess);
    cuda::LlCombineSendArgs a;
    a.y = y;
    a.dispatch_region = dispatch;
    a.dispatch = d;
    a.regions = peers;
    a.combine = c;
    a.sync = sync;
    ASSERT_EQ(cuda::LaunchLlCombineSend(a, 8, stream, &error), cudaSuccess) << error;
  }
  ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
  cuda::LlSync status = {};
  ASSERT_EQ(cuda::LlReadSync(sync, &status), cudaSuccess);
  EXPECT_EQ(status.error, 0) << "the expert rank timed out waiting for its source";
  const char done = 'd';
  EXPECT_TRUE(WriteAll(out, &done, 1));
  cudaStreamDestroy(stream);
  EXPECT_EQ(cuda::LlCloseRegion(combine), cudaSuccess);
  for (void* p : owned) cudaFree(p);
}

TEST(LlExchangeGpu, AcrossTwoProcessesThroughCudaIpc) {
  SKIP_WITHOUT_GPU();
  int to_child[2], from_child[2];
  ASSERT_EQ(pipe(to_child), 0);
  ASSERT_EQ(pipe(from_child), 0);
  const std::string fds = std::to_string(to_child[0]) + "," + std::to_string(from_child[1]);
  std::vector<std::string> env_strings;
  for (char** e = environ; *e != nullptr; ++e) env_strings.emplace_back(*e);
  env_strings.push_back(std::string(kIpcChildEnv) + "=" + fds);
  std::vector<char*> env;
  for (std::string& e : env_strings) env.push_back(e.data());
  env.push_back(nullptr);
  std::string self = "/proc/self/exe", filter = "--gtest_filter=LlExchangeIpcChild.ExpertRank";
  char* argv[] = {self.data(), filter.data(), nullptr};
  pid_t child = -1;
  ASSERT_EQ(posix_spawn(&child, "/proc/self/exe", nullptr, nullptr, argv, env.data()), 0);
  close(to_child[0]);
  close(from_child[1]);
  struct Reap {
    pid_t pid;
    int in, out;
    ~Reap() {
      close(in);
      close(out);
      int status = 0;
      // The child exits after its rounds (or its own timeouts); never wait past that.
      for (int i = 0; i < 200 && waitpid(pid, &status, WNOHANG) == 0; ++i) usleep(50'000);
      if (waitpid(pid, &status, WNOHANG) == 0) {
        kill(pid, SIGKILL);
        waitpid(pid, &status, 0);
      }
    }
  } reap{child, to_child[1], from_child[0]};

  const LlRegionLayout d =
      cuda::MakeLlRegionLayout(1, kIpcCap, kIpcHidden, kIpcTopK, ElemType::kBF16);
  const LlRegionLayout c = cuda::MakeLlRegionLayout(1, kIpcCap, kIpcHidden, 0, ElemType::kBF16);
  std::vector<void*> owned;
  char* combine = DeviceAlloc<char>(c.bytes, &owned);
  LlSync* sync = DeviceAlloc<LlSync>(1, &owned);
  void** peers = DeviceAlloc<void*>(1, &owned);
  uint16_t* x = DeviceAlloc<uint16_t>(static_cast<size_t>(kIpcCap) * kIpcHidden, &owned);
  int32_t* ids = DeviceAlloc<int32_t>(kIpcCap * kIpcTopK, &owned);
  float* w = DeviceAlloc<float>(kIpcCap * kIpcTopK, &owned);
  float* out = DeviceAlloc<float>(static_cast<size_t>(kIpcCap) * kIpcHidden, &owned);
  const std::vector<int32_t> owner(kIpcExperts, 0);
  int32_t* owner_d = DeviceAlloc<int32_t>(kIpcExperts, &owned);
  ASSERT_EQ(cudaMemcpy(owner_d, owner.data(), kIpcExperts * 4, cudaMemcpyHostToDevice),
            cudaSuccess);
  cuda::LlRegionHandle mine, theirs;
  ASSERT_EQ(cuda::LlExportRegion(combine, &mine), cudaSuccess);
  ASSERT_TRUE(WriteAll(reap.in, &mine, sizeof(mine)));
  ASSERT_TRUE(ReadAll(reap.out, &theirs, sizeof(theirs))) << "the child sent no handle";
  void* dispatch = nullptr;
  ASSERT_EQ(cuda::LlOpenRegion(theirs, &dispatch), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(peers, &dispatch, sizeof(void*), cudaMemcpyHostToDevice), cudaSuccess);
  cudaStream_t stream = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
  std::string error;
  const int64_t tokens[kIpcRounds] = {5, 0, kIpcCap, 1};  // an empty batch among them
  for (int round = 0; round < kIpcRounds; ++round) {
    SCOPED_TRACE(::testing::Message() << "round " << round);
    const RankInput in = MakeInput(tokens[round], kIpcHidden, kIpcTopK, kIpcExperts, kIpcExperts,
                                   round == 3, 20 + round);
    if (in.tokens > 0) {
      ASSERT_EQ(cudaMemcpy(x, in.x.data(), in.x.size() * 2, cudaMemcpyHostToDevice), cudaSuccess);
      ASSERT_EQ(cudaMemcpy(ids, in.ids.data(), in.ids.size() * 4, cudaMemcpyHostToDevice),
                cudaSuccess);
      ASSERT_EQ(cudaMemcpy(w, in.weights.data(), in.weights.size() * 4, cudaMemcpyHostToDevice),
                cudaSuccess);
    }
    ASSERT_EQ(cudaMemset(out, 0xff, static_cast<size_t>(kIpcCap) * kIpcHidden * 4), cudaSuccess);
    cuda::LlDispatchSendArgs s;
    s.x = x;
    s.topk_ids = ids;
    s.topk_weights = w;
    s.num_tokens = in.tokens;
    s.expert_owner = owner_d;
    s.num_experts = kIpcExperts;
    s.regions = peers;
    s.num_ranks = 1;
    s.layout = d;
    s.sync = sync;
    ASSERT_EQ(cuda::LaunchLlDispatchSend(s, 8, stream, &error), cudaSuccess) << error;
    ASSERT_EQ(cuda::LaunchLlWait(combine, c, sync, kWaitNs, stream, &error), cudaSuccess) << error;
    cuda::LlCombineReduceArgs r;
    r.region = combine;
    r.layout = c;
    r.topk_ids = ids;
    r.top_k = kIpcTopK;
    r.expert_owner = owner_d;
    r.num_experts = kIpcExperts;
    r.num_tokens = in.tokens;
    r.out = out;
    r.out_type = ElemType::kF32;
    ASSERT_EQ(cuda::LaunchLlCombineReduce(r, 8, stream, &error), cudaSuccess) << error;
    ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
    cuda::LlSync status = {};
    ASSERT_EQ(cuda::LlReadSync(sync, &status), cudaSuccess);
    ASSERT_EQ(status.error, 0) << "timed out waiting for the child's combine";
    std::vector<float> got(static_cast<size_t>(kIpcCap) * kIpcHidden);
    ASSERT_EQ(cudaMemcpy(got.data(), out, got.size() * 4, cudaMemcpyDeviceToHost), cudaSuccess);
    ExpectBits(got, ReferenceOutput(in, owner, 1, kIpcTopK, kIpcExperts, kIpcHidden, kIpcCap),
               "across processes");
  }
  char done = 0;
  EXPECT_TRUE(ReadAll(reap.out, &done, 1));
  EXPECT_EQ(done, 'd');
  cudaStreamDestroy(stream);
  EXPECT_EQ(cuda::LlCloseRegion(dispatch), cudaSuccess);
  for (void* p : owned) cudaFree(p);
}

}  // namespace
}  // namespace dxs
