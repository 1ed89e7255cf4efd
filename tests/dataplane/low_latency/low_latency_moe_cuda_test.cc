// The low-latency exchange through the Backend (dataplane/low_latency/low_latency_exchange.h):
// attention ranks (LowLatencyMoeExecutor) and expert ranks (LowLatencyExpertRounds over their
// ExpertShard) of one process, each rank a CUDA backend of its own (its own stream), against
// one shard holding every expert (the single-process engine's MoE) on the same weights.
// Empty-batch ranks on both sides, rounds replayed from a CUDA graph on the attention side,
// a peer that never answers (UNAVAILABLE, no hang), and bad shapes. Skips without a GPU;
// the CPU backend's UNIMPLEMENTED is in low_latency_exchange_test.
#include <stdlib.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "dataplane/low_latency/low_latency_exchange.h"
#include "dataplane/low_latency/low_latency_moe_executor.h"
#include "expert_service/local_low_latency_experts.h"
#include "expert_service/low_latency_expert_rounds.h"
#include "gtest/gtest.h"
#include "kernels/backend.h"
#include "kernels/make_backend.h"
#include "model/engine.h"
#include "model/expert_shard.h"
#include "model/random_checkpoint.h"
#include "model/weights.h"
#include "tests/model/test_util.h"

namespace dxs {
namespace {

#define ASSERT_OK(expr)                          \
  do {                                           \
    const absl::Status _s = (expr);              \
    ASSERT_TRUE(_s.ok()) << #expr << ": " << _s; \
  } while (0)

// Every rank of these tests lives in this one process, and a rank's wait spins on the
// device until another rank's kernels run. With CUDA's lazy module loading, the first
// launch of a kernel may wait for the whole context to go idle, spinning waits included:
// a deadlock until the wait's timeout (CUDA's programming guide, "Lazy Loading", concurrent
// execution). The modules are loaded eagerly here, before the runtime starts (the plugin
// loads it later). Services run one rank a process, where a rank's spin ends when another
// process sends, so there a first launch only stalls until then.
[[maybe_unused]] const bool kEagerModules = setenv("CUDA_MODULE_LOADING", "EAGER", 1) == 0;

constexpr int kHidden = 256, kInter = 128, kExperts = 16, kTopK = 4, kLayers = 2;
constexpr int kCapacity = 8;

ModelConfig Config() {
  ModelConfig c;
  c.hidden_size = kHidden;
  c.moe_intermediate_size = kInter;
  c.num_experts = kExperts;
  c.num_experts_per_tok = kTopK;
  c.num_hidden_layers = kLayers;
  return c;
}

// The exchange's shape between these ranks, for the model of Config().
LowLatencyShape Shape(int num_attention, int num_expert) {
  LowLatencyShape shape;
  shape.num_attention_ranks = num_attention;
  shape.num_expert_ranks = num_expert;
  shape.capacity = kCapacity;
  shape.hidden = kHidden;
  shape.top_k = kTopK;
  shape.num_experts = kExperts;
  return shape;
}

// Expert e of layer l's weights, the same on every backend (FillUniform is).
ExpertWeightMap Weights(Backend* backend, const std::vector<int>& experts) {
  ExpertWeightMap map;
  for (int l = 0; l < kLayers; ++l) {
    for (int e : experts) {
      ExpertWeights& w = map[{l, e}];
      const uint64_t seed = 1000 + 100 * l + e;
      w.gate_up_proj = *backend->Allocate({2 * kInter, kHidden}, DType::kBF16);
      w.down_proj = *backend->Allocate({kHidden, kInter}, DType::kBF16);
      EXPECT_TRUE(backend->FillUniform(&w.gate_up_proj, seed, 0, 0.1, DType::kBF16).ok());
      EXPECT_TRUE(backend->FillUniform(&w.down_proj, seed + 7, 0, 0.1, DType::kBF16).ok());
    }
  }
  return map;
}

// One attention rank's round: bf16 rows, top-k ids (distinct) and weights.
struct Batch {
  int64_t tokens = 0;
  std::vector<float> x;
  std::vector<int32_t> ids;
  std::vector<float> weights;
};

Batch RandomBatch(int64_t tokens, std::mt19937* rng) {
  Batch b;
  b.tokens = tokens;
  std::uniform_real_distribution<float> value(-1.f, 1.f);
  for (int64_t i = 0; i < tokens * kHidden; ++i) b.x.push_back(value(*rng));
  for (int64_t t = 0; t < tokens; ++t) {
    std::vector<int32_t> all(kExperts);
    for (int e = 0; e < kExperts; ++e) all[e] = e;
    std::shuffle(all.begin(), all.end(), *rng);
    float sum = 0;
    std::vector<float> w(kTopK);
    for (float& v : w) sum += (v = 0.1f + std::abs(value(*rng)));
    for (int k = 0; k < kTopK; ++k) {
      b.ids.push_back(all[k]);
      b.weights.push_back(w[k] / sum);
    }
  }
  return b;
}

// The batch's tensors on a backend.
struct BatchTensors {
  Tensor x, ids, weights, out;
};

BatchTensors Upload(Backend* backend, const Batch& b) {
  BatchTensors t;
  t.x = *backend->Allocate({b.tokens, kHidden}, DType::kBF16);
  t.ids = *backend->Allocate({b.tokens, kTopK}, DType::kI32);
  t.weights = *backend->Allocate({b.tokens, kTopK}, DType::kF32);
  t.out = *backend->Allocate({b.tokens, kHidden}, DType::kF32);
  if (b.tokens > 0) {
    EXPECT_TRUE(backend->CopyFromHost(b.x.data(), DType::kF32, &t.x).ok());
    EXPECT_TRUE(backend->CopyFromHost(b.ids.data(), DType::kI32, &t.ids).ok());
    EXPECT_TRUE(backend->CopyFromHost(b.weights.data(), DType::kF32, &t.weights).ok());
  }
  return t;
}

class LowLatencyMoeTest : public ::testing::Test {
 protected:
  void SetUp() override {
    absl::StatusOr<std::unique_ptr<Backend>> probe = MakeBackend("cuda");
    if (!probe.ok()) GTEST_SKIP() << "no GPU here: " << probe.status();
    reference_backend_ = *std::move(probe);
    std::vector<int> all(kExperts);
    for (int e = 0; e < kExperts; ++e) all[e] = e;
    reference_ = std::make_unique<ExpertShard>(Config(), Weights(reference_backend_.get(), all),
                                               reference_backend_.get());
  }

  // num_attention attention ranks and num_expert expert ranks, expert e on rank
  // owner[e]; every rank's backend its own.
  void MakeRanks(int num_attention, int num_expert, const std::vector<int32_t>& owner,
                 int64_t timeout_ns = 5'000'000'000) {
    LowLatencyShape shape = Shape(num_attention, num_expert);
    shape.timeout_ns = timeout_ns;
    for (int r = 0; r < num_attention; ++r) {
      Attention a;
      a.backend = *MakeBackend("cuda");
      auto exchange = MakeLowLatencyExchange(a.backend.get(), shape, LowLatencySide::kAttention, r);
      ASSERT_TRUE(exchange.ok()) << exchange.status();
      a.exchange = *std::move(exchange);
      Tensor owners = *a.backend->Allocate({kExperts}, DType::kI32);
      ASSERT_TRUE(a.backend->CopyFromHost(owner.data(), DType::kI32, &owners).ok());
      a.executor = std::make_unique<LowLatencyMoeExecutor>(a.exchange.get(), owners);
      attention_.push_back(std::move(a));
    }
    for (int r = 0; r < num_expert; ++r) {
      Expert x;
      x.backend = *MakeBackend("cuda");
      std::vector<int> held;
      for (int e = 0; e < kExperts; ++e) {
        if (owner[e] == r) held.push_back(e);
      }
      x.shard =
          std::make_unique<ExpertShard>(Config(), Weights(x.backend.get(), held), x.backend.get());
      auto exchange = MakeLowLatencyExchange(x.backend.get(), shape, LowLatencySide::kExpert, r);
      ASSERT_TRUE(exchange.ok()) << exchange.status();
      x.exchange = *std::move(exchange);
      experts_.push_back(std::move(x));
    }
    std::vector<std::string> attention_keys, expert_keys;
    for (auto& a : attention_) attention_keys.push_back(a.exchange->region_key());
    for (auto& x : experts_) expert_keys.push_back(x.exchange->region_key());
    for (auto& a : attention_) ASSERT_TRUE(a.exchange->Connect(expert_keys).ok());
    for (auto& x : experts_) {
      ASSERT_TRUE(x.exchange->Connect(attention_keys).ok());
      auto rounds = LowLatencyExpertRounds::Make(Config(), x.shard.get(), x.exchange.get());
      ASSERT_TRUE(rounds.ok()) << rounds.status();
      x.rounds = *std::move(rounds);
    }
  }

  // The single-process MoE of a batch, float32 on the host.
  std::vector<float> Reference(int layer, const Batch& b) {
    if (b.tokens == 0) return {};
    BatchTensors t = Upload(reference_backend_.get(), b);
    EXPECT_TRUE(reference_->ForwardRouted(layer, t.x, t.ids, t.weights, &t.out).ok());
    return *reference_backend_->Download(t.out);
  }

  struct Attention {
    std::unique_ptr<Backend> backend;
    std::unique_ptr<LowLatencyExchange> exchange;
    std::unique_ptr<LowLatencyMoeExecutor> executor;
  };
  struct Expert {
    std::unique_ptr<Backend> backend;
    std::unique_ptr<ExpertShard> shard;
    std::unique_ptr<LowLatencyExchange> exchange;
    std::unique_ptr<LowLatencyExpertRounds> rounds;
  };
  std::unique_ptr<Backend> reference_backend_;
  std::unique_ptr<ExpertShard> reference_;
  std::vector<Attention> attention_;
  std::vector<Expert> experts_;
  std::mt19937 rng_{11};
};

// Rounds of both layers with uneven batches, a rank with none, and an expert rank that
// holds nothing that was routed: each attention rank's output is the local experts' within
// bf16 rounding (the expert ranks' pre-sums are rounded to bf16 before the combine adds them).
TEST_F(LowLatencyMoeTest, RoundsMatchTheLocalExperts) {
  std::vector<int32_t> owner(kExperts);
  for (int e = 0; e < kExperts; ++e) owner[e] = e % 2;
  MakeRanks(2, 2, owner);
  if (HasFatalFailure() || attention_.empty()) return;
  const std::vector<std::vector<int64_t>> steps = {{5, 3}, {8, 0}, {0, 0}, {1, 7}};
  for (const auto& tokens : steps) {
    for (int layer = 0; layer < kLayers; ++layer) {
      std::vector<Batch> batches;
      std::vector<BatchTensors> tensors;
      for (size_t r = 0; r < attention_.size(); ++r) {
        batches.push_back(RandomBatch(tokens[r], &rng_));
        tensors.push_back(Upload(attention_[r].backend.get(), batches.back()));
      }
      // Everything is enqueued before anything waits on the host: the waits are the device's.
      for (size_t r = 0; r < attention_.size(); ++r) {
        BatchTensors& t = tensors[r];
        ASSERT_OK(attention_[r].executor->Run(layer, t.x, t.ids, t.weights, &t.out));
      }
      for (auto& x : experts_) ASSERT_OK(x.rounds->Round(layer));
      for (auto& x : experts_) ASSERT_OK(x.rounds->CheckStatus());
      for (size_t r = 0; r < attention_.size(); ++r) {
        ASSERT_OK(attention_[r].executor->CheckStatus());
        if (batches[r].tokens == 0) continue;
        const std::vector<float> got = *attention_[r].backend->Download(tensors[r].out);
        const std::vector<float> want = Reference(layer, batches[r]);
        EXPECT_LT(testing::RelativeError(got, want), 2e-2)
            << "layer " << layer << ", attention rank " << r << ", " << batches[r].tokens
            << " tokens";
      }
    }
  }
  // Every routed pair was counted where it ran.
  int64_t counted = 0;
  for (auto& x : experts_) {
    for (int64_t n : x.shard->tokens_per_expert_snapshot()) counted += n;
  }
  int64_t routed = 0;
  for (const auto& tokens : steps) routed += (tokens[0] + tokens[1]) * kTopK * kLayers;
  EXPECT_EQ(counted, routed);
}

// Every expert on rank 0: rank 1 receives no token in any round and still takes part.
TEST_F(LowLatencyMoeTest, ExpertRankWithNoTokens) {
  MakeRanks(1, 2, std::vector<int32_t>(kExperts, 0));
  if (HasFatalFailure() || attention_.empty()) return;
  for (int layer = 0; layer < kLayers; ++layer) {
    const Batch b = RandomBatch(kCapacity, &rng_);
    BatchTensors t = Upload(attention_[0].backend.get(), b);
    ASSERT_OK(attention_[0].executor->Run(layer, t.x, t.ids, t.weights, &t.out));
    for (auto& x : experts_) ASSERT_OK(x.rounds->Round(layer));
    for (auto& x : experts_) ASSERT_OK(x.rounds->CheckStatus());
    ASSERT_OK(attention_[0].executor->CheckStatus());
    EXPECT_LT(testing::RelativeError(*attention_[0].backend->Download(t.out), Reference(layer, b)),
              2e-2);
  }
  int64_t on_rank1 = 0;
  for (int64_t n : experts_[1].shard->tokens_per_expert_snapshot()) on_rank1 += n;
  EXPECT_EQ(on_rank1, 0);
}

// The attention side's rounds recorded in a CUDA graph once and replayed with new rows
// written in place: each replay's output is that round's, as eager rounds give it.
TEST_F(LowLatencyMoeTest, AttentionRoundsReplayFromAGraph) {
  std::vector<int32_t> owner(kExperts);
  for (int e = 0; e < kExperts; ++e) owner[e] = e < kExperts / 2 ? 0 : 1;
  MakeRanks(1, 2, owner);
  if (HasFatalFailure() || attention_.empty()) return;
  Backend* backend = attention_[0].backend.get();
  if (!backend->SupportsGraphs()) GTEST_SKIP() << "this build's CUDA backend has no graphs";
  Batch b = RandomBatch(6, &rng_);
  BatchTensors t = Upload(backend, b);
  // The capture runs the body once eagerly: that round needs its experts too.
  for (auto& x : experts_) ASSERT_TRUE(x.rounds->Round(0).ok());
  Tensor eager;
  absl::StatusOr<CapturedGraph> graph = backend->CaptureGraph(
      [&]() -> absl::StatusOr<Tensor> {
        absl::Status s = attention_[0].executor->Run(0, t.x, t.ids, t.weights, &t.out);
        if (!s.ok()) return s;
        return t.out;
      },
      &eager);
  ASSERT_TRUE(graph.ok()) << graph.status();
  for (auto& x : experts_) ASSERT_TRUE(x.rounds->CheckStatus().ok());
  ASSERT_TRUE(attention_[0].executor->CheckStatus().ok());
  EXPECT_LT(testing::RelativeError(*backend->Download(eager), Reference(0, b)), 2e-2);
  for (int replay = 0; replay < 3; ++replay) {
    const Batch next = RandomBatch(6, &rng_);
    ASSERT_TRUE(backend->CopyFromHost(next.x.data(), DType::kF32, &t.x).ok());
    ASSERT_TRUE(backend->CopyFromHost(next.ids.data(), DType::kI32, &t.ids).ok());
    ASSERT_TRUE(backend->CopyFromHost(next.weights.data(), DType::kF32, &t.weights).ok());
    ASSERT_TRUE(backend->Replay(graph->graph.get()).ok());
    for (auto& x : experts_) ASSERT_TRUE(x.rounds->Round(0).ok());
    for (auto& x : experts_) ASSERT_TRUE(x.rounds->CheckStatus().ok());
    ASSERT_TRUE(attention_[0].executor->CheckStatus().ok());
    EXPECT_LT(testing::RelativeError(*backend->Download(graph->output), Reference(0, next)), 2e-2)
        << "replay " << replay;
  }
}

// An expert rank reads its status (CheckStatus, between steps) while the attention rank's
// queue holds a copy to pageable host memory behind its wait for that rank's next round, as
// the engine copies a step's logits. In one process a pageable copy waits while another
// thread's waits in its stream: a status read by cudaMemcpy would wait behind that copy,
// which waits for this rank's next round, and the step would stall until the wait timed out
// (the LL engine test's stall, docs/gpu.md). The status is read without a copy
// (cuda::LlSnapshot).
TEST_F(LowLatencyMoeTest, StatusReadsDoNotWaitBehindTheAttentionRanksCopies) {
  // compute-sanitizer's own copies around each kernel wait behind that copy just the same.
  if (std::getenv("DXS_UNDER_COMPUTE_SANITIZER") != nullptr) {
    GTEST_SKIP() << "the sanitizer's own copies to the host wait behind the queued copy";
  }
  std::vector<int32_t> owner(kExperts);
  for (int e = 0; e < kExperts; ++e) owner[e] = e % 2;
  constexpr int64_t kTimeoutNs = 3'000'000'000;
  MakeRanks(1, 2, owner, kTimeoutNs);
  if (HasFatalFailure() || attention_.empty()) return;
  Backend* backend = attention_[0].backend.get();
  const Batch b = RandomBatch(5, &rng_);
  BatchTensors t = Upload(backend, b);
  ASSERT_TRUE(attention_[0].executor->Run(0, t.x, t.ids, t.weights, &t.out).ok());
  for (auto& x : experts_) ASSERT_TRUE(x.rounds->Round(0).ok());
  for (auto& x : experts_) ASSERT_TRUE(x.rounds->CheckStatus().ok());
  ASSERT_TRUE(attention_[0].executor->CheckStatus().ok());
  // The next round, and behind its wait a copy of its output to the host (another thread:
  // the copy returns only when the round is answered).
  ASSERT_TRUE(attention_[0].executor->Run(1, t.x, t.ids, t.weights, &t.out).ok());
  std::vector<float> copied(static_cast<size_t>(t.out.num_elements()));
  absl::Status copy;
  std::thread copier([&] { copy = backend->CopyToHost(t.out, DType::kF32, copied.data()); });
  std::this_thread::sleep_for(std::chrono::milliseconds(100));  // the copy is queued
  const auto start = std::chrono::steady_clock::now();
  for (auto& x : experts_) EXPECT_TRUE(x.rounds->CheckStatus().ok());
  const double read_ms =
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
  EXPECT_LT(read_ms, 500.0) << "an expert rank's status read waited behind the attention rank's "
                               "copy to the host";
  for (auto& x : experts_) ASSERT_TRUE(x.rounds->Round(1).ok());
  copier.join();
  ASSERT_TRUE(copy.ok()) << copy;
  for (auto& x : experts_) ASSERT_TRUE(x.rounds->CheckStatus().ok());
  const absl::Status attention = attention_[0].executor->CheckStatus();
  ASSERT_TRUE(attention.ok()) << attention;
  EXPECT_LT(testing::RelativeError(copied, Reference(1, b)), 2e-2);
}

// An expert rank that never runs its round: the attention rank's combine gives up after the
// timeout and says UNAVAILABLE naming it; the next round returns at once, still failing.
TEST_F(LowLatencyMoeTest, SilentExpertRankIsUnavailableNotAHang) {
  std::vector<int32_t> owner(kExperts);
  for (int e = 0; e < kExperts; ++e) owner[e] = e % 2;
  MakeRanks(1, 2, owner, /*timeout_ns=*/200'000'000);
  if (HasFatalFailure() || attention_.empty()) return;
  const Batch b = RandomBatch(4, &rng_);
  BatchTensors t = Upload(attention_[0].backend.get(), b);
  ASSERT_TRUE(attention_[0].executor->Run(0, t.x, t.ids, t.weights, &t.out).ok());
  ASSERT_TRUE(experts_[0].rounds->Round(0).ok());  // rank 1 stays silent
  ASSERT_TRUE(experts_[0].rounds->CheckStatus().ok());
  absl::Status s = attention_[0].executor->CheckStatus();
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable) << s;
  EXPECT_NE(s.message().find("expert rank 1's round 1 (its last round here: 0)"), std::string::npos)
      << s;
  // Where the rounds stand (read without waiting): the attention rank sent round 1 and its
  // wait ended (timed out) with rank 0's answer in and rank 1's not; rank 1 has the round
  // in its region and neither received nor answered it.
  absl::StatusOr<LowLatencyProgress> attention = attention_[0].exchange->Progress();
  ASSERT_TRUE(attention.ok()) << attention.status();
  EXPECT_EQ(attention->ToString(), "sent 1, received 1, arrived [1 0]");
  absl::StatusOr<LowLatencyProgress> answered = experts_[0].exchange->Progress();
  ASSERT_TRUE(answered.ok()) << answered.status();
  EXPECT_EQ(answered->ToString(), "sent 1, received 1, arrived [1]");
  absl::StatusOr<LowLatencyProgress> silent = experts_[1].exchange->Progress();
  ASSERT_TRUE(silent.ok()) << silent.status();
  EXPECT_EQ(silent->ToString(), "sent 0, received 0, arrived [1]");
  const auto start = std::chrono::steady_clock::now();
  ASSERT_TRUE(attention_[0].executor->Run(1, t.x, t.ids, t.weights, &t.out).ok());
  EXPECT_EQ(attention_[0].executor->CheckStatus().code(), absl::StatusCode::kUnavailable);
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::milliseconds(150));
}

// The attention rank routes every expert to expert rank 0, which holds only the even ones:
// rank 0 says FAILED_PRECONDITION after the step (the placements disagree) instead of
// computing with weights it does not have; the next step, routed right, is fine again.
TEST_F(LowLatencyMoeTest, PlacementsThatDisagreeAreFailedPrecondition) {
  std::vector<int32_t> owner(kExperts);
  for (int e = 0; e < kExperts; ++e) owner[e] = e % 2;
  MakeRanks(1, 2, owner);
  if (HasFatalFailure() || attention_.empty()) return;
  Backend* backend = attention_[0].backend.get();
  Tensor wrong = *backend->Zeros({kExperts}, DType::kI32);
  LowLatencyMoeExecutor misrouted(attention_[0].exchange.get(), wrong);
  const Batch b = RandomBatch(4, &rng_);
  BatchTensors t = Upload(backend, b);
  ASSERT_OK(misrouted.Run(0, t.x, t.ids, t.weights, &t.out));
  for (auto& x : experts_) ASSERT_OK(x.rounds->Round(0));
  const absl::Status s = experts_[0].rounds->CheckStatus();
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
  EXPECT_NE(s.message().find("does not hold"), std::string::npos) << s;
  ASSERT_OK(experts_[1].rounds->CheckStatus());
  ASSERT_OK(attention_[0].executor->CheckStatus());
  // Routed by the placement the ranks hold: right again.
  ASSERT_OK(attention_[0].executor->Run(1, t.x, t.ids, t.weights, &t.out));
  for (auto& x : experts_) ASSERT_OK(x.rounds->Round(1));
  for (auto& x : experts_) ASSERT_OK(x.rounds->CheckStatus());
  ASSERT_OK(attention_[0].executor->CheckStatus());
  EXPECT_LT(testing::RelativeError(*backend->Download(t.out), Reference(1, b)), 2e-2);
}

TEST_F(LowLatencyMoeTest, BadShapesAreInvalidArgument) {
  LowLatencyShape shape = Shape(1, 1);
  shape.hidden = 100;  // 200-byte rows: not a multiple of 16
  Backend* backend = reference_backend_.get();
  EXPECT_EQ(MakeLowLatencyExchange(backend, shape, LowLatencySide::kExpert, 0).status().code(),
            absl::StatusCode::kInvalidArgument);
  shape.hidden = kHidden;
  EXPECT_EQ(MakeLowLatencyExchange(backend, shape, LowLatencySide::kExpert, 1).status().code(),
            absl::StatusCode::kInvalidArgument);  // rank outside the side
  auto exchange = MakeLowLatencyExchange(backend, shape, LowLatencySide::kAttention, 0);
  ASSERT_TRUE(exchange.ok()) << exchange.status();
  // Before Connect; then a key that names nothing; then too many tokens.
  Batch b = RandomBatch(kCapacity + 1, &rng_);
  BatchTensors t = Upload(backend, b);
  Tensor owner = *backend->Zeros({kExperts}, DType::kI32);
  EXPECT_EQ((*exchange)->Dispatch(t.x, t.ids, t.weights, owner).code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ((*exchange)->Connect({"not a key"}).code(), absl::StatusCode::kInvalidArgument);
  auto expert = MakeLowLatencyExchange(backend, shape, LowLatencySide::kExpert, 0);
  ASSERT_TRUE(expert.ok());
  ASSERT_TRUE((*exchange)->Connect({(*expert)->region_key()}).ok());
  EXPECT_EQ((*exchange)->Dispatch(t.x, t.ids, t.weights, owner).code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ((*exchange)->Receive(owner, nullptr).code(), absl::StatusCode::kFailedPrecondition);
}

// FP8 rows (--wire-dtype fp8): the attention rank quantizes its bf16 rows into records per
// token and per 128 channels, the expert rank receives them dequantized, and its answers
// come back through the bf16 combine. The rows that arrive are bit for bit those the CPU
// backend's records of the same rows give; a hidden size whose records are not 16-byte
// vectors is refused.
TEST_F(LowLatencyMoeTest, Fp8RowsArriveAsTheCpuBackendsRecordsGive) {
  constexpr int kFp8Hidden = 512;  // records of 528 bytes
  constexpr int64_t kTokens = 5;
  LowLatencyShape shape = Shape(1, 1);
  shape.hidden = kFp8Hidden;
  shape.top_k = 1;
  shape.num_experts = 2;
  shape.fp8_rows = true;
  {
    LowLatencyShape narrow = shape;
    narrow.hidden = kHidden;  // records of 264 bytes
    auto refused =
        MakeLowLatencyExchange(reference_backend_.get(), narrow, LowLatencySide::kAttention, 0);
    EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(refused.status().message().find("512"), std::string::npos) << refused.status();
  }
  std::unique_ptr<Backend> a = *MakeBackend("cuda"), x = *MakeBackend("cuda");
  auto attention = MakeLowLatencyExchange(a.get(), shape, LowLatencySide::kAttention, 0);
  auto expert = MakeLowLatencyExchange(x.get(), shape, LowLatencySide::kExpert, 0);
  ASSERT_TRUE(attention.ok()) << attention.status();
  ASSERT_TRUE(expert.ok()) << expert.status();
  ASSERT_OK((*attention)->Connect({(*expert)->region_key()}));
  ASSERT_OK((*expert)->Connect({(*attention)->region_key()}));

  // Groups of very different magnitudes, so each group's scale matters.
  std::vector<float> rows(kTokens * kFp8Hidden);
  std::uniform_real_distribution<float> value(-1.f, 1.f);
  for (size_t i = 0; i < rows.size(); ++i) {
    rows[i] = value(rng_) * std::ldexp(1.f, static_cast<int>((i / 128) % 7) - 3);
  }
  const std::vector<int32_t> ids(kTokens, 0), owner(2, 0), held(2, 1);
  const std::vector<float> weights(kTokens, 1.f);
  Tensor tx = *a->Allocate({kTokens, kFp8Hidden}, DType::kBF16);
  Tensor tids = *a->Allocate({kTokens, 1}, DType::kI32);
  Tensor tweights = *a->Allocate({kTokens, 1}, DType::kF32);
  Tensor towner = *a->Allocate({2}, DType::kI32);
  Tensor theld = *x->Allocate({2}, DType::kI32);
  ASSERT_OK(a->CopyFromHost(rows.data(), DType::kF32, &tx));
  ASSERT_OK(a->CopyFromHost(ids.data(), DType::kI32, &tids));
  ASSERT_OK(a->CopyFromHost(weights.data(), DType::kF32, &tweights));
  ASSERT_OK(a->CopyFromHost(owner.data(), DType::kI32, &towner));
  ASSERT_OK(x->CopyFromHost(held.data(), DType::kI32, &theld));

  // One round, each rank's work enqueued on its own stream: the waits spin on the device.
  ASSERT_OK((*attention)->Dispatch(tx, tids, tweights, towner));
  LowLatencyPairs pairs;
  ASSERT_OK((*expert)->Receive(theld, &pairs));
  ASSERT_EQ(pairs.x.dtype(), DType::kBF16);
  ASSERT_EQ(pairs.x.row_size(), kFp8Hidden);
  // The answers: each slot's row as it arrived (the spare last row zero).
  Tensor y = *x->Zeros({kCapacity + 1, kFp8Hidden}, DType::kBF16);
  Tensor y_slots = y.Rows(0, kCapacity);
  ASSERT_OK(x->Copy(pairs.x, &y_slots));
  ASSERT_OK((*expert)->Send(y));
  Tensor out = *a->Allocate({kTokens, kFp8Hidden}, DType::kF32);
  ASSERT_OK((*attention)->Combine(tids, towner, &out));
  ASSERT_OK((*expert)->CheckStatus());
  ASSERT_OK((*attention)->CheckStatus());

  // The CPU backend's records of the same bf16 rows, dequantized into bf16.
  std::unique_ptr<Backend> cpu = MakeCpuBackend();
  Tensor cx = *cpu->Allocate({kTokens, kFp8Hidden}, DType::kBF16);
  ASSERT_OK(cpu->CopyFromHost(rows.data(), DType::kF32, &cx));
  std::vector<int32_t> iota(kTokens);
  for (int64_t i = 0; i < kTokens; ++i) iota[i] = static_cast<int32_t>(i);
  Tensor crows = *cpu->Allocate({kTokens}, DType::kI32);
  ASSERT_OK(cpu->CopyFromHost(iota.data(), DType::kI32, &crows));
  Tensor records = *cpu->Allocate({kTokens, Fp8RecordBytes(kFp8Hidden)}, DType::kF8E4M3);
  ASSERT_OK(cpu->QuantizeRowsFp8(cx, crows, &records));
  Tensor dequantized = *cpu->Allocate({kTokens, kFp8Hidden}, DType::kBF16);
  ASSERT_OK(cpu->DequantizeRowsFp8(records, &dequantized));
  const std::vector<float> want = *cpu->Download(dequantized);
  const std::vector<float> arrived = *x->Download(pairs.x.Rows(0, kTokens));
  const std::vector<float> combined = *a->Download(out);
  ASSERT_EQ(arrived.size(), want.size());
  EXPECT_EQ(arrived, want);
  EXPECT_EQ(combined, want);  // one rank's bf16 answer, widened
  // Not the rows themselves: FP8 lost precision on the way.
  EXPECT_NE(want, *cpu->Download(cx));
}

// A whole generation: the single-process engine's attention on one backend, its MoE the
// low-latency exchange to two expert ranks (expert e on rank e % 2) whose rounds a thread of
// their own enqueues step after step. Prefill (short prompts, within the capacity) and
// decode both go through it; decode steps replay CUDA graphs that hold every layer's
// exchange. Tokens equal the single-process engine's and first logits are within 2e-2.
TEST(LowLatencyEngineTest, GenerationEqualsTheSingleProcessEngine) {
  if (!MakeBackend("cuda").ok()) GTEST_SKIP() << "no GPU here";
  const CheckpointPreset preset = *GetPreset("default");
  const ModelConfig& config = preset.config;
  std::vector<GenerationRequest> requests;
  for (int i = 0; i < 3; ++i) {
    GenerationRequest r;
    for (int j = 0; j < 3 + 4 * i; ++j) r.prompt.push_back(5 + (i * 577 + j * 101) % 4000);
    r.max_new_tokens = 8;
    r.ignore_eos = true;
    requests.push_back(r);
  }
  EngineOptions options;
  options.device = "cuda";
  auto local = LocalEngine::LoadRandom(preset, options);
  ASSERT_TRUE(local.ok()) << local.status();
  auto want = (*local)->GenerateBatch(requests);
  ASSERT_TRUE(want.ok()) << want.status();

  RandomWeightSource source(preset);
  auto experts = LocalLowLatencyExperts::Make(config, source, /*ranks=*/2, /*capacity=*/64,
                                              [] { return MakeBackend("cuda"); });
  ASSERT_TRUE(experts.ok()) << experts.status();
  options.moe_factory = [&](const ModelConfig& c, Backend* backend) {
    return (*experts)->AttachAttention(c, backend);
  };
  auto remote = LocalEngine::LoadRandom(preset, options);
  ASSERT_TRUE(remote.ok()) << remote.status();
  (*experts)->Start();
  auto got = (*remote)->GenerateBatch(requests);
  const absl::Status stopped = (*experts)->Stop();
  // What the rig saw, for a failure's message: a stalled step's ranks as they stood while it
  // stalled.
  const std::string seen = (*experts)->StallReport();
  ASSERT_TRUE(stopped.ok()) << stopped << "; " << seen;
  ASSERT_TRUE(got.ok()) << got.status() << "; " << seen;
  // One prefill step (every prompt within the capacity) and 7 decode steps; Stop's empty
  // step on top when the ranks had begun one more.
  EXPECT_GE((*experts)->steps(), 8) << seen;
  const absl::Status attention_status = (*experts)->executor()->CheckStatus();
  ASSERT_TRUE(attention_status.ok()) << attention_status << "; " << seen;
  // Greedy tokens where the margin allows: every token the exchange's run chose is the
  // single-process engine's greedy choice on the same prefix, unless that position's top
  // two logits are within the tolerance (the expert ranks' pre-sums are rounded to bf16
  // before the combine adds them, which the single-process sum is not).
  int near_ties = 0;
  for (size_t i = 0; i < requests.size(); ++i) {
    EXPECT_LT(testing::RelativeError((*got)[i].first_logits, (*want)[i].first_logits), 2e-2)
        << "request " << i;
    ASSERT_EQ((*got)[i].tokens.size(), (*want)[i].tokens.size());
    for (size_t p = 0; p < (*got)[i].tokens.size(); ++p) {
      GenerationRequest prefix = requests[i];
      prefix.prompt.insert(prefix.prompt.end(), (*got)[i].tokens.begin(),
                           (*got)[i].tokens.begin() + p);
      prefix.max_new_tokens = 1;
      auto one = (*local)->GenerateBatch({prefix});
      ASSERT_TRUE(one.ok()) << one.status();
      const std::vector<float>& logits = (*one)[0].first_logits;
      const int32_t chosen = (*got)[i].tokens[p], greedy = (*one)[0].tokens[0];
      if (chosen == greedy) continue;
      float scale = 0;
      for (float v : logits) scale = std::max(scale, std::abs(v));
      EXPECT_LE(logits[greedy] - logits[chosen], 2e-2 * scale)
          << "request " << i << ", token " << p << ": " << chosen << " where the engine's greedy "
          << greedy << " leads by more than the tolerance";
      ++near_ties;
    }
  }
  EXPECT_LE(near_ties, 2) << "more near-ties than bf16 rounding explains";
  experts->reset();  // the attention side's exchange lives on the remote engine's backend
}

}  // namespace
}  // namespace dxs
