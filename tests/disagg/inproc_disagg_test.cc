// Disaggregated MoE in one process (inproc transport): any M DP ranks x N EP ranks equals
// the single-process engine, empty DP/EP ranks and all-empty steps included, and the MoE
// output is reduced exactly once.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdio>
#include <functional>
#include <mutex>
#include <numeric>
#include <thread>

#include "absl/synchronization/notification.h"
#include "dataplane/dispatch/wire.h"
#include "gtest/gtest.h"
#include "model/engine.h"
#include "tests/disagg/cluster_harness.h"
#include "tests/model/test_util.h"

namespace dxs {
namespace {

using testing::InprocCluster;
using testing::RelativeError;
using testing::ResultSink;
using testing::TempDir;

std::vector<GenerationRequest> Requests(int n, int64_t max_new, int vocab) {
  std::vector<GenerationRequest> out;
  for (int i = 0; i < n; ++i) {
    GenerationRequest r;
    for (int j = 0; j < 3 + 4 * i; ++j) r.prompt.push_back(5 + (i * 977 + j * 131) % (vocab - 5));
    r.max_new_tokens = max_new;
    out.push_back(r);
  }
  return out;
}

// Runs `requests` on the cluster, request i on DP rank i % M, and compares with the engine.
void ExpectSameAsSingleProcess(const std::string& dir, int num_attention,
                               const Placement& placement,
                               const std::vector<GenerationRequest>& requests,
                               const std::function<void(const InprocCluster&)>& check = {}) {
  auto engine = LocalEngine::Load(dir);
  ASSERT_TRUE(engine.ok()) << engine.status();
  auto reference = (*engine)->GenerateBatch(requests);
  ASSERT_TRUE(reference.ok()) << reference.status();
  InprocCluster cluster(dir, num_attention, placement);
  std::vector<std::shared_ptr<ResultSink>> sinks;
  for (size_t i = 0; i < requests.size(); ++i) {
    sinks.push_back(std::make_shared<ResultSink>());
    ASSERT_TRUE(
        cluster.Submit(static_cast<int>(i % num_attention), i, requests[i], sinks.back()).ok());
  }
  ASSERT_TRUE(cluster.WaitAllDone(sinks, absl::Seconds(60))) << "cluster hung";
  for (size_t i = 0; i < requests.size(); ++i) {
    SCOPED_TRACE(::testing::Message() << "request " << i);
    ASSERT_TRUE(sinks[i]->status.ok()) << sinks[i]->status;
    EXPECT_EQ(sinks[i]->tokens, (*reference)[i].tokens);
    EXPECT_LT(RelativeError(sinks[i]->first_logits, (*reference)[i].first_logits), 1e-5);
  }
  // DP ranks without requests took part in every step with empty batches.
  for (int r = static_cast<int>(requests.size()); r < num_attention; ++r) {
    EXPECT_GT(cluster.attention_counters(r).empty_steps.load(), 0) << "DP rank " << r;
    EXPECT_EQ(cluster.attention_counters(r).empty_steps.load(),
              cluster.attention_counters(r).steps.load());
  }
  for (int r = 1; r < num_attention; ++r) {
    EXPECT_EQ(cluster.attention_counters(r).steps.load(),
              cluster.attention_counters(0).steps.load())
        << "DP ranks out of lockstep";
  }
  if (check) check(cluster);
}

class DisaggGrid : public ::testing::TestWithParam<std::tuple<int, int>> {};

TEST_P(DisaggGrid, EqualsSingleProcess) {
  const auto [m, n] = GetParam();
  TempDir tmp;
  const std::string dir = testing::WritePreset(tmp, "default");
  // Two requests: with M = 3 one DP rank gets none.
  ExpectSameAsSingleProcess(
      dir, m, Placement::Contiguous(16, n), Requests(2, 6, 4096), [n](const InprocCluster& c) {
        // The model builds each MoE input in the executor's region (StageBuffers): an EP
        // rank that takes every token of a step reads it there, and one EP rank holding
        // every expert answers into the model's MoE output itself.
        for (int r = 0; r < std::min(c.num_attention(), 2); ++r) {
          const DispatchCounters& d = c.dispatch_counters(r);
          EXPECT_GT(d.dispatches_from_staged_x.load(), 0) << "DP rank " << r;
          if (n == 1) {
            EXPECT_EQ(d.combines_into_staged_out.load(), d.dispatches_from_staged_x.load());
          }
        }
      });
}

INSTANTIATE_TEST_SUITE_P(MxN, DisaggGrid,
                         ::testing::Combine(::testing::Values(1, 2, 3), ::testing::Values(1, 2, 4)),
                         [](const auto& info) {
                           return "dp" + std::to_string(std::get<0>(info.param)) + "_ep" +
                                  std::to_string(std::get<1>(info.param));
                         });

// Decode steps in graph segments (AttentionStepLoop::PiecewiseDecode, run eagerly: the
// CPU has no graphs): padded to a batch bucket, the exchange between segments for the real
// rows only. Tokens equal the single-process engine on a model with a dense layer between
// MoE layers (odd: segments of two layers) and on the default one, with an empty DP rank;
// the EP ranks receive no padding row.
TEST(Disagg, PiecewiseDecodeStepsEqualSingleProcess) {
  for (const std::string preset : {"odd", "default"}) {
    SCOPED_TRACE(preset);
    TempDir tmp;
    const std::string dir = testing::WritePreset(tmp, preset);
    auto engine = LocalEngine::Load(dir);
    ASSERT_TRUE(engine.ok()) << engine.status();
    const int vocab = (*engine)->config().vocab_size, experts = (*engine)->config().num_experts;
    const std::vector<GenerationRequest> requests = Requests(4, 7, vocab);
    auto reference = (*engine)->GenerateBatch(requests);
    ASSERT_TRUE(reference.ok()) << reference.status();
    testing::ClusterOptions options;
    options.piecewise = AttentionStepLoop::PiecewiseDecode::kEager;
    InprocCluster cluster(dir, 3, Placement::Contiguous(experts, 2), options);
    std::vector<std::shared_ptr<ResultSink>> sinks;
    for (size_t i = 0; i < requests.size(); ++i) {
      sinks.push_back(std::make_shared<ResultSink>());
      // DP rank 0 gets three requests (decode batches of 3 padded to 4), rank 1 one, rank 2
      // none.
      ASSERT_TRUE(cluster.Submit(i == 3 ? 1 : 0, i, requests[i], sinks.back()).ok());
    }
    ASSERT_TRUE(cluster.WaitAllDone(sinks, absl::Seconds(60))) << "cluster hung";
    int64_t fed = 0;  // tokens that went through the model: the prompt, then all but the last
    for (size_t i = 0; i < requests.size(); ++i) {
      SCOPED_TRACE(::testing::Message() << "request " << i);
      ASSERT_TRUE(sinks[i]->status.ok()) << sinks[i]->status;
      EXPECT_EQ(sinks[i]->tokens, (*reference)[i].tokens);
      EXPECT_LT(RelativeError(sinks[i]->first_logits, (*reference)[i].first_logits), 1e-5);
      fed += static_cast<int64_t>(requests[i].prompt.size() + sinks[i]->tokens.size()) - 1;
    }
    EXPECT_GT(cluster.attention_counters(0).piecewise_steps.load(), 0);
    EXPECT_GT(cluster.attention_counters(1).piecewise_steps.load(), 0);
    EXPECT_EQ(cluster.attention_counters(2).piecewise_steps.load(), 0) << "an empty rank";
    // Each fed token's top-k experts computed it once per MoE layer: no padding row was
    // dispatched.
    const ModelConfig& c = (*engine)->config();
    int moe_layers = 0;
    for (int l = 0; l < c.num_hidden_layers; ++l) moe_layers += c.IsMoeLayer(l) ? 1 : 0;
    EXPECT_EQ(cluster.expert_pairs(0) + cluster.expert_pairs(1),
              fed * c.num_experts_per_tok * moe_layers);
  }
}

// Two-batch overlap: with enough tokens per step, every DP rank splits its steps into two
// micro-batches (prompts of several lengths, so the split is uneven and decode steps read
// KV written by either micro-batch). Outputs still equal the single-process engine, the
// ranks agree on every split, and each expert rank counts a split step once.
TEST(Disagg, TwoBatchOverlapEqualsSingleProcess) {
  TempDir tmp;
  const std::string dir = testing::WritePreset(tmp, "default");
  bool checked = false;
  ExpectSameAsSingleProcess(
      dir, 2, Placement::Contiguous(16, 2), Requests(10, 8, 4096),
      [&](const InprocCluster& cluster) {
        checked = true;
        const int64_t overlapped = cluster.attention_counters(0).overlapped_steps.load();
        EXPECT_GT(overlapped, 0) << "no step was split into micro-batches";
        EXPECT_EQ(cluster.attention_counters(1).overlapped_steps.load(), overlapped)
            << "DP ranks split different steps";
        const int64_t steps = cluster.attention_counters(0).steps.load();
        for (int r = 0; r < 2; ++r) {
          EXPECT_EQ(cluster.expert_counters(r).steps.load(), steps) << "EP rank " << r;
          // One round per MoE layer per micro-batch.
          EXPECT_EQ(cluster.expert_counters(r).rounds.load(), 4 * (steps + overlapped))
              << "EP rank " << r;
        }
      });
  EXPECT_TRUE(checked);
}

// The bf16 wire through the whole model: the executor narrows the float32 activations,
// rows land in the expert ranks' slots as bf16 and the experts compute from them, and the
// combine comes back bf16. Rounding to bf16 moves the logits (so the wire really is bf16)
// but keeps them within 2e-2 of the single-process float32 engine.
// Four requests over the two DP ranks of `cluster` on `dir`'s model, each answered with the
// float32 single-process engine's token count and first logits moved by more than 0 and
// less than `max_error` (relative): what a narrower wire does. Returns the largest move.
double ExpectCloseToSingleProcess(InprocCluster* cluster, const std::string& dir,
                                  double max_error) {
  const std::vector<GenerationRequest> requests = Requests(4, 6, 4096);
  auto engine = LocalEngine::Load(dir);
  EXPECT_TRUE(engine.ok()) << engine.status();
  if (!engine.ok()) return 0;
  auto reference = (*engine)->GenerateBatch(requests);
  EXPECT_TRUE(reference.ok()) << reference.status();
  if (!reference.ok()) return 0;
  std::vector<std::shared_ptr<ResultSink>> sinks;
  for (size_t i = 0; i < requests.size(); ++i) {
    sinks.push_back(std::make_shared<ResultSink>());
    EXPECT_TRUE(cluster->Submit(static_cast<int>(i % 2), i, requests[i], sinks.back()).ok());
  }
  EXPECT_TRUE(cluster->WaitAllDone(sinks, absl::Seconds(60))) << "cluster hung";
  double worst = 0;
  for (size_t i = 0; i < requests.size(); ++i) {
    SCOPED_TRACE(::testing::Message() << "request " << i);
    EXPECT_TRUE(sinks[i]->status.ok()) << sinks[i]->status;
    EXPECT_EQ(sinks[i]->tokens.size(), (*reference)[i].tokens.size());
    const double error = RelativeError(sinks[i]->first_logits, (*reference)[i].first_logits);
    EXPECT_GT(error, 0.0) << "the wire's rounding left the logits bit-identical";
    EXPECT_LT(error, max_error);
    worst = std::max(worst, error);
  }
  return worst;
}

// The bf16 wire through the whole model: the executor narrows the float32 activations,
// rows land in the expert ranks' slots as bf16 and the experts compute from them, and the
// combine comes back bf16. Rounding to bf16 moves the logits (so the wire really is bf16)
// but keeps them within 2e-2 of the single-process float32 engine.
TEST(Disagg, Bf16WireStaysCloseToSingleProcess) {
  TempDir tmp;
  const std::string dir = testing::WritePreset(tmp, "default");
  InprocCluster cluster(dir, 2, Placement::Contiguous(16, 2), DType::kBF16);
  ExpectCloseToSingleProcess(&cluster, dir, 2e-2);
  for (int r = 0; r < 2; ++r) {
    EXPECT_GT(cluster.expert_counters(r).rounds_in_place.load(), 0)
        << "EP rank " << r << " never computed from rows in its bf16 slots";
  }
}

// Counts a DP rank's exchange bytes by direction (every DP rank's, from their step threads).
class ExchangeByteCounter final : public DispatchObserver {
 public:
  void OnDispatch(const std::vector<int64_t>&, const std::vector<bool>&, double) override {}
  void OnCombine(const std::vector<int64_t>&, double) override {}
  void OnExchange(const Transfer* transfers, size_t n) override {
    for (size_t i = 0; i < n; ++i) {
      (transfers[i].kind == Transfer::Kind::kSend ? sent : received) += transfers[i].bytes;
    }
  }
  void OnMappedBytes(size_t s, size_t r) override {
    mapped_sent += static_cast<int64_t>(s);
    mapped_received += static_cast<int64_t>(r);
  }
  std::atomic<int64_t> sent{0}, received{0};
  std::atomic<int64_t> mapped_sent{0}, mapped_received{0};  // through the mapped regions
};

// --wire-dtype fp8: every dispatch row leaves as an FP8 record (hidden float8_e4m3 values
// and a float32 scale per 128 of them) and the answers come back bf16. Counted exactly: the
// DP ranks sent records and pairs (12 bytes each) and nothing else, and received bf16 rows.
// The quantization moves the first logits but keeps them within 0.2 (relative) of the float32
// single-process engine: e4m3 keeps 3 mantissa bits, about 3.6% RMS on each MoE input value
// (bf16 keeps 8: 16 times less), and over this preset's 4 layers of random weights the
// logits moved 2.5-12% (measured). That the experts compute on exactly the records' values
// is checked bit for bit in zero_copy_dispatch_test (Fp8DispatchTest); this test checks the
// path through the model and the bytes.
TEST(Disagg, Fp8WireSendsRecordsAndStaysCloseToSingleProcess) {
  TempDir tmp;
  const std::string dir = testing::WritePreset(tmp, "default");
  ExchangeByteCounter bytes;
  testing::ClusterOptions options;
  options.wire_dtype = DType::kF8E4M3;
  options.dispatch_observer = &bytes;
  options.mapped_regions = false;  // every record through the transport, counted there
  InprocCluster cluster(dir, 2, Placement::Contiguous(16, 2), options);
  const double worst = ExpectCloseToSingleProcess(&cluster, dir, 0.2);
  std::printf("fp8 wire: worst first-logit relative error %.3g\n", worst);
  const int64_t hidden = LoadModelConfig(dir)->hidden_size;
  int64_t tokens = 0, pairs = 0;
  for (int r = 0; r < 2; ++r) {
    for (const auto& n : cluster.dispatch_counters(r).tokens_dispatched) tokens += n.load();
    pairs += cluster.expert_pairs(r);
  }
  ASSERT_GT(tokens, 0);
  EXPECT_EQ(bytes.sent.load(), tokens * Fp8RecordBytes(hidden) + 12 * pairs);
  EXPECT_EQ(bytes.received.load(), tokens * hidden * 2);
}

// FP8 records through the regions the expert ranks map (the one-copy exchange, the default
// between processes of one host): the DP ranks quantize their rows into the region, the
// expert ranks read the records there and dequantize them as if they had arrived. The
// tokens and first logits are those of the same cluster with every record through the
// transport, bit for bit; the region bytes are counted exactly (records and pairs out, bf16
// answers back) and nothing but statuses goes through the transport.
TEST(Disagg, Fp8RecordsThroughMappedRegionsEqualThemThroughTheTransport) {
  TempDir tmp;
  const std::string dir = testing::WritePreset(tmp, "default");
  const std::vector<GenerationRequest> requests = Requests(4, 6, 4096);
  std::vector<std::shared_ptr<ResultSink>> runs[2];
  ExchangeByteCounter bytes[2];
  int64_t tokens = 0, pairs = 0, rows_mapped = 0;
  for (int mapped = 0; mapped < 2; ++mapped) {
    testing::ClusterOptions options;
    options.wire_dtype = DType::kF8E4M3;
    options.dispatch_observer = &bytes[mapped];
    options.mapped_regions = mapped == 1;
    options.held = true;  // the same batches in both runs
    InprocCluster cluster(dir, 2, Placement::Contiguous(16, 2), options);
    for (size_t i = 0; i < requests.size(); ++i) {
      runs[mapped].push_back(std::make_shared<ResultSink>());
      ASSERT_TRUE(
          cluster.Submit(static_cast<int>(i % 2), i, requests[i], runs[mapped].back()).ok());
    }
    cluster.Release();
    ASSERT_TRUE(cluster.WaitAllDone(runs[mapped], absl::Seconds(60))) << "cluster hung";
    if (mapped == 1) {
      for (int r = 0; r < 2; ++r) {
        for (const auto& n : cluster.dispatch_counters(r).tokens_dispatched) tokens += n.load();
        pairs += cluster.expert_pairs(r);
        rows_mapped += cluster.expert_counters(r).rows_mapped.load();
      }
    }
  }
  for (size_t i = 0; i < requests.size(); ++i) {
    SCOPED_TRACE(::testing::Message() << "request " << i);
    ASSERT_TRUE(runs[1][i]->status.ok()) << runs[1][i]->status;
    EXPECT_EQ(runs[1][i]->tokens, runs[0][i]->tokens);
    EXPECT_EQ(runs[1][i]->first_logits, runs[0][i]->first_logits);
  }
  const int64_t hidden = LoadModelConfig(dir)->hidden_size;
  ASSERT_GT(tokens, 0);
  EXPECT_EQ(rows_mapped, tokens) << "every row through a region";
  EXPECT_EQ(bytes[1].mapped_sent.load(), tokens * Fp8RecordBytes(hidden) + 12 * pairs);
  EXPECT_EQ(bytes[1].mapped_received.load(), tokens * hidden * 2);
  EXPECT_EQ(bytes[1].sent.load(), 0) << "rows through the transport as well";
  EXPECT_GT(bytes[0].sent.load(), 0);
  EXPECT_EQ(bytes[0].mapped_sent.load(), 0);
}

// One run of `requests` (request i on DP rank i % 2) on a 2 x 2 cluster with `wire`
// dispatch rows, every row through the transport: the sinks, and the dispatch row bytes
// per dispatched token (the bytes sent less the 12-byte pairs, over the tokens).
struct WireRun {
  std::vector<std::shared_ptr<ResultSink>> sinks;
  double row_bytes_per_token = 0;
};
WireRun RunOnWire(const std::string& dir, DType wire,
                  const std::vector<GenerationRequest>& requests) {
  ExchangeByteCounter bytes;
  testing::ClusterOptions options;
  options.wire_dtype = wire;
  options.dispatch_observer = &bytes;
  options.mapped_regions = false;
  InprocCluster cluster(dir, 2, Placement::Contiguous(16, 2), options);
  WireRun run;
  for (size_t i = 0; i < requests.size(); ++i) {
    run.sinks.push_back(std::make_shared<ResultSink>());
    EXPECT_TRUE(cluster.Submit(static_cast<int>(i % 2), i, requests[i], run.sinks.back()).ok());
  }
  EXPECT_TRUE(cluster.WaitAllDone(run.sinks, absl::Seconds(120))) << "cluster hung";
  int64_t tokens = 0, pairs = 0;
  for (int r = 0; r < 2; ++r) {
    for (const auto& n : cluster.dispatch_counters(r).tokens_dispatched) tokens += n.load();
    pairs += cluster.expert_pairs(r);
  }
  EXPECT_GT(tokens, 0);
  if (tokens > 0) {
    run.row_bytes_per_token = static_cast<double>(bytes.sent.load() - 12 * pairs) / tokens;
  }
  return run;
}

// --wire-dtype fp8 against the bf16 wire it replaces (both every row through the
// transport). Greedy tokens equal the bf16 wire's where the margin allows: where they first
// differ, the token the FP8 run took must be in the bf16 run's top 5 there, led by the bf16
// run's choice by at most twice the largest difference between the two runs' first logits
// (over the requests): FP8's rounding moves a logit by about that much, so a lead that small
// can flip and a larger one cannot. On this preset (4 layers of random weights, whose MoE
// inputs e4m3's 3 mantissa bits round by about 3.6% RMS) that difference was 1.85, 12% of
// the largest logit, and 34 of 96 tokens came before the first such near tie (measured).
// And the dispatch rows take (hidden + 4 * ceil(hidden / 128)) / (2 * hidden) of the bf16
// row's bytes per token: 0.516 at this preset's hidden size of 128, 0.502 at
// Qwen3-30B-A3B's 2048.
TEST(Disagg, Fp8WireGreedyTokensEqualTheBf16WiresAndHalveTheRowBytes) {
  TempDir tmp;
  const std::string dir = testing::WritePreset(tmp, "default");
  std::vector<GenerationRequest> requests = Requests(6, 16, 4096);
  for (GenerationRequest& r : requests) {
    r.logprobs = true;
    r.top_logprobs = 5;
  }
  const WireRun bf16 = RunOnWire(dir, DType::kBF16, requests);
  const WireRun fp8 = RunOnWire(dir, DType::kF8E4M3, requests);
  double max_logit_diff = 0;
  for (size_t i = 0; i < requests.size(); ++i) {
    const std::vector<float>&a = bf16.sinks[i]->first_logits, &b = fp8.sinks[i]->first_logits;
    ASSERT_EQ(a.size(), b.size());
    for (size_t v = 0; v < a.size(); ++v) {
      max_logit_diff = std::max(max_logit_diff, std::fabs(static_cast<double>(a[v]) - b[v]));
    }
  }
  EXPECT_GT(max_logit_diff, 0) << "the FP8 rows left the logits bit-identical";
  size_t equal = 0, total = 0;
  for (size_t i = 0; i < requests.size(); ++i) {
    SCOPED_TRACE(::testing::Message() << "request " << i);
    const ResultSink &want = *bf16.sinks[i], &got = *fp8.sinks[i];
    ASSERT_TRUE(want.status.ok()) << want.status;
    ASSERT_TRUE(got.status.ok()) << got.status;
    ASSERT_EQ(want.logprobs.size(), want.tokens.size());
    size_t d = 0;
    while (d < got.tokens.size() && d < want.tokens.size() && got.tokens[d] == want.tokens[d]) ++d;
    equal += d;
    total += want.tokens.size();
    if (d == want.tokens.size() && d == got.tokens.size()) continue;
    ASSERT_LT(d, std::min(got.tokens.size(), want.tokens.size())) << "lengths differ";
    // The first difference: a near tie of the bf16 run's.
    const TokenLogprobs& at = want.logprobs[d];
    double lead = -1;
    for (const auto& [token, logprob] : at.top) {
      if (token == got.tokens[d]) lead = at.logprob - logprob;
    }
    ASSERT_GE(lead, 0) << "token " << d << ": FP8 took " << got.tokens[d]
                       << ", outside the bf16 run's top 5";
    EXPECT_LE(lead, 2 * max_logit_diff)
        << "token " << d << ": FP8 took " << got.tokens[d] << ", which the bf16 run's "
        << want.tokens[d] << " leads by " << lead << " nats";
  }
  const int64_t hidden = LoadModelConfig(dir)->hidden_size;
  const double want_ratio =
      static_cast<double>(Fp8RecordBytes(hidden)) / static_cast<double>(2 * hidden);
  std::printf(
      "fp8 vs bf16 wire: %zu of %zu greedy tokens equal before a near tie (largest first-logit "
      "difference %.3g); row bytes per token %.1f vs %.1f (%.3f)\n",
      equal, total, max_logit_diff, fp8.row_bytes_per_token, bf16.row_bytes_per_token,
      fp8.row_bytes_per_token / bf16.row_bytes_per_token);
  EXPECT_DOUBLE_EQ(bf16.row_bytes_per_token, 2.0 * hidden);
  EXPECT_DOUBLE_EQ(fp8.row_bytes_per_token, static_cast<double>(Fp8RecordBytes(hidden)));
  EXPECT_LT(fp8.row_bytes_per_token / bf16.row_bytes_per_token, want_ratio + 1e-9);
}

TEST(Disagg, UnevenPlacementTwelveExpertsOnFiveRanks) {
  TempDir tmp;
  const std::string dir = testing::WritePreset(tmp, "odd");
  auto placement = Placement::FromRankExperts(12, {{0, 1, 2, 3}, {4, 5}, {6, 7, 8}, {9}, {10, 11}});
  ASSERT_TRUE(placement.ok()) << placement.status();
  ExpectSameAsSingleProcess(dir, 2, *placement, Requests(3, 5, 3001));
}

// A block-scaled FP8 checkpoint (gen-model --fp8): the attention and expert ranks load and
// dequantize it as the single process does, so the cluster equals it.
TEST(Disagg, Fp8CheckpointEqualsSingleProcess) {
  TempDir tmp;
  const std::string dir = testing::WritePreset(tmp, "odd", 0, /*fp8=*/true);
  ExpectSameAsSingleProcess(dir, 2, Placement::Contiguous(12, 2), Requests(3, 5, 3001));
}

TEST(Disagg, ExpertRankWithNoTokensIsCountedAndCorrect) {
  TempDir tmp;
  const std::string dir = testing::WritePreset(tmp, "default");
  // One prefill step (max_new_tokens 1): find the experts this prompt never selects.
  std::vector<GenerationRequest> requests = Requests(1, 1, 4096);
  requests[0].prompt.resize(1);  // 1 token x 4 MoE layers x top-4 leaves experts unused
  auto engine = LocalEngine::Load(dir);
  ASSERT_TRUE(engine.ok());
  ASSERT_TRUE((*engine)->GenerateBatch(requests).ok());
  const std::vector<int64_t> used = (*engine)->experts().tokens_per_expert_snapshot();
  std::vector<int> idle, busy;
  for (int e = 0; e < 16; ++e) (used[e] == 0 ? idle : busy).push_back(e);
  ASSERT_FALSE(idle.empty()) << "pick a shorter prompt: every expert is used";
  auto placement = Placement::FromRankExperts(16, {busy, idle});
  ASSERT_TRUE(placement.ok());
  auto reference = (*engine)->GenerateBatch(requests);
  InprocCluster cluster(dir, 2, *placement);
  auto sink = std::make_shared<ResultSink>();
  ASSERT_TRUE(cluster.Submit(0, 1, requests[0], sink).ok());
  ASSERT_TRUE(cluster.WaitAllDone({sink}, absl::Seconds(30)));
  EXPECT_EQ(sink->tokens, (*reference)[0].tokens);
  EXPECT_LT(RelativeError(sink->first_logits, (*reference)[0].first_logits), 1e-5);
  EXPECT_GE(cluster.expert_counters(1).empty_steps.load(), 1);
  EXPECT_EQ(cluster.expert_counters(1).rows_received.load(), 0);
  EXPECT_GT(cluster.expert_counters(0).rows_received.load(), 0);
}

TEST(Disagg, AllEmptyStepRunsEveryLayerWithoutHanging) {
  TempDir tmp;
  const std::string dir = testing::WritePreset(tmp, "default");
  InprocCluster cluster(dir, 3, Placement::Contiguous(16, 2));
  cluster.WakeAll();
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  while (cluster.attention_counters(0).all_empty_steps.load() == 0 && absl::Now() < deadline) {
    absl::SleepFor(absl::Milliseconds(5));
  }
  EXPECT_GE(cluster.attention_counters(0).all_empty_steps.load(), 1);
  // Experts saw every MoE layer of that step, all empty.
  const absl::Time d2 = absl::Now() + absl::Seconds(10);
  while (cluster.expert_counters(1).empty_steps.load() == 0 && absl::Now() < d2) {
    absl::SleepFor(absl::Milliseconds(5));
  }
  EXPECT_GE(cluster.expert_counters(0).empty_steps.load(), 1);
  EXPECT_GE(cluster.expert_counters(1).empty_rounds.load(), 4);
  // And the cluster still serves afterwards.
  auto sink = std::make_shared<ResultSink>();
  ASSERT_TRUE(cluster.Submit(2, 7, Requests(1, 3, 4096)[0], sink).ok());
  EXPECT_TRUE(cluster.WaitAllDone({sink}, absl::Seconds(30)));
  EXPECT_EQ(sink->tokens.size(), 3u);
}

// One MoE layer's inputs on the CPU backend, over the "default" preset: 9 token rows, 4
// routed experts each, and every expert's weights (the local executor's reference).
struct MoeLayerCase {
  TempDir tmp;
  ModelConfig config;
  std::unique_ptr<Checkpoint> ckpt;
  std::unique_ptr<Backend> backend;
  std::unique_ptr<ExpertShard> all_experts;
  Tensor x, ids, weights;
  int64_t tokens = 9;

  MoeLayerCase() {
    const std::string dir = testing::WritePreset(tmp, "default");
    config = *LoadModelConfig(dir);
    ckpt = *Checkpoint::Open(dir);
    backend = MakeCpuBackend();
    std::vector<int> all(16);
    std::iota(all.begin(), all.end(), 0);
    all_experts = std::make_unique<ExpertShard>(
        config, *LoadExpertWeights(*ckpt, config, all, backend.get()), backend.get());
    const int64_t h = config.hidden_size, k = 4;
    std::vector<float> xs(tokens * h);
    for (size_t i = 0; i < xs.size(); ++i) xs[i] = std::sin(0.37f * static_cast<float>(i));
    x = *backend->Upload(xs, {tokens, h});
    std::vector<int32_t> id_list;
    std::vector<float> weight_list;
    for (int64_t i = 0; i < tokens; ++i) {
      for (int j = 0; j < k; ++j) {
        id_list.push_back(static_cast<int32_t>((i * 5 + j * 3) % 16));
        weight_list.push_back(0.25f + 0.05f * static_cast<float>(j));
      }
    }
    ids = backend->UploadIndices(id_list)->Reshape({tokens, k});
    weights = *backend->Upload(weight_list, {tokens, k});
  }
  // The MoE layer's output through every expert in this process.
  std::vector<float> Reference(int layer) {
    LocalMoeExecutor local(all_experts.get());
    Tensor want = *backend->Allocate({tokens, config.hidden_size});
    EXPECT_TRUE(local.Run(layer, x, ids, weights, &want).ok());
    return *backend->Download(want);
  }
};

// The combine is the only reduction: one layer through the remote executor equals the
// local one, and a second reduction (e.g. an extra all-reduce that sums the combined
// output across ranks again) would double it and fail here.
TEST(Disagg, MoeOutputIsReducedExactlyOnce) {
  MoeLayerCase c;
  const ModelConfig& config = c.config;
  Backend* backend = c.backend.get();
  const Placement placement = Placement::Contiguous(16, 4);
  auto transports = MakeInprocTransportGroup(5);
  for (int i = 0; i < 5; ++i) ASSERT_TRUE(transports[i]->SetSelf(i).ok());
  std::vector<std::unique_ptr<ExpertShard>> shards;
  std::vector<std::unique_ptr<ShardCompute>> computes;
  std::vector<std::unique_ptr<ExpertStepServer>> servers;
  for (int r = 0; r < 4; ++r) {
    shards.push_back(std::make_unique<ExpertShard>(
        config, *LoadExpertWeights(*c.ckpt, config, placement.experts_of(r), backend), backend));
    computes.push_back(std::make_unique<ShardCompute>(shards.back().get()));
    servers.push_back(std::make_unique<ExpertStepServer>(
        transports[1 + r].get(), std::vector<int>{0}, computes.back().get(), config));
  }
  RemoteMoeExecutor remote(backend, transports[0].get(), {1, 2, 3, 4}, placement,
                           config.hidden_size, {});
  std::atomic<bool> stop{false};
  std::vector<std::thread> threads;
  for (auto& s : servers) {
    threads.emplace_back([&stop, srv = s.get()] {
      while (!stop) (void)srv->ServeRound(absl::Now() + absl::Milliseconds(20));
    });
  }
  Tensor got = *backend->Allocate({c.tokens, config.hidden_size});
  remote.set_step(1);
  ASSERT_TRUE(remote.Run(0, c.x, c.ids, c.weights, &got).ok());
  stop = true;
  for (auto& th : threads) th.join();
  std::vector<float> w = c.Reference(0), g = *backend->Download(got);
  EXPECT_LT(RelativeError(g, w), 1e-6);
  EXPECT_EQ(remote.counters().tokens_dispatched[0].load() +
                remote.counters().tokens_dispatched[1].load() +
                remote.counters().tokens_dispatched[2].load() +
                remote.counters().tokens_dispatched[3].load(),
            remote.counters().tokens_combined[0].load() +
                remote.counters().tokens_combined[1].load() +
                remote.counters().tokens_combined[2].load() +
                remote.counters().tokens_combined[3].load());
}

// Two DP ranks (transports 0 and 1) and one expert rank (2, every expert) whose view of
// the DP ranks is `live`/`dead`, newer than the one the DP ranks planned their step under
// (both DP ranks in it). DP rank 0 runs `layers` MoE layers of the step; DP rank 1 does what
// `second` says. Every header of the first layer is queued before the expert rank serves.
enum class SecondDp { kSilent, kDispatches, kDispatchesThenAbandons };
struct TwoDpStep {
  absl::Status dp0, dp1;
  float dp0_error = 1.0f;  // DP rank 0's last layer against the local executor's
};
TwoDpStep RunTwoDpStep(std::vector<bool> live, std::vector<bool> dead, SecondDp second,
                       int layers) {
  MoeLayerCase c;
  Backend* backend = c.backend.get();
  ShardCompute compute(c.all_experts.get());
  auto transports = MakeInprocTransportGroup(3);
  for (int i = 0; i < 3; ++i) EXPECT_TRUE(transports[i]->SetSelf(i).ok());
  ExpertStepServer server(transports[2].get(), {0, 1}, &compute, c.config);
  constexpr uint64_t kStep = 7, kStepView = 10, kExpertView = 20;
  server.set_dp_view(std::move(live), std::move(dead), kExpertView);
  const Placement placement = Placement::Contiguous(16, 1);
  const int64_t t = c.tokens, h = c.config.hidden_size;
  const Tensor &x = c.x, &id_t = c.ids, &weight_t = c.weights;
  std::vector<std::unique_ptr<RemoteMoeExecutor>> dp;
  std::vector<Tensor> out;
  for (int r = 0; r < 2; ++r) {
    dp.push_back(std::make_unique<RemoteMoeExecutor>(
        backend, transports[r].get(), std::vector<int>{2}, placement, h, DispatchOptions{}));
    dp.back()->set_step(kStep);
    dp.back()->set_dp_ranks(/*mask=*/0, kStepView);
    out.push_back(*backend->Allocate({t, h}));
  }
  TwoDpStep result;
  std::thread dp0([&] {
    for (int layer = 0; layer < layers && result.dp0.ok(); ++layer) {
      result.dp0 = dp[0]->Run(layer, x, id_t, weight_t, &out[0]);
    }
  });
  std::thread dp1;
  if (second != SecondDp::kSilent) {
    dp1 = std::thread([&] {
      result.dp1 = dp[1]->Run(0, x, id_t, weight_t, &out[1]);
      if (second == SecondDp::kDispatchesThenAbandons) {
        // What AttentionStepLoop::AbandonStep sends after its step failed.
        WireHeader abandon;
        abandon.kind = MessageKind::kStepAbandoned;
        abandon.step = kStep;
        EXPECT_TRUE(transports[1]->Send(2, abandon.Encode(), nullptr, 0).ok());
      }
    });
  }
  const absl::Time bound = absl::Now() + absl::Seconds(60);
  while (absl::Now() < bound && !(transports[2]->HasMessage(0) &&
                                  (second == SecondDp::kSilent || transports[2]->HasMessage(1)))) {
    (void)transports[2]->WaitForActivity(absl::Now() + absl::Milliseconds(50));
  }
  std::atomic<bool> stop{false};
  std::thread serve([&] {
    while (!stop) (void)server.ServeRound(absl::Now() + absl::Milliseconds(20));
  });
  dp0.join();
  if (dp1.joinable()) dp1.join();
  stop = true;
  serve.join();
  if (result.dp0.ok()) {
    result.dp0_error = RelativeError(*backend->Download(out[0]), c.Reference(layers - 1));
  }
  return result;
}

TEST(Disagg, DpRankAbsentFromANewerViewStillTakesPartInTheStepItWasNamedIn) {
  // After the router restarted, an expert rank's view lists a DP rank only once that rank
  // has registered again, while the DP ranks may still run a step they planned under the old
  // router's view with both in it. The expert rank waits for both headers: serving DP rank 0
  // alone would drop DP rank 1's header, and DP rank 1 would wait out its step timeout for a
  // combine that never comes.
  const TwoDpStep r =
      RunTwoDpStep(/*live=*/{true, false}, /*dead=*/{false, false}, SecondDp::kDispatches, 1);
  ASSERT_TRUE(r.dp0.ok()) << r.dp0;
  ASSERT_TRUE(r.dp1.ok()) << r.dp1;
  EXPECT_LT(r.dp0_error, 1e-6);
}

TEST(Disagg, DpRankDeadInTheExpertRanksViewHoldsUpNoRound) {
  // The step names both DP ranks, but DP rank 1 is DEAD in the expert rank's (newer) view:
  // DP rank 0's round is served without DP rank 1's header.
  const TwoDpStep r =
      RunTwoDpStep(/*live=*/{true, false}, /*dead=*/{false, true}, SecondDp::kSilent, 1);
  ASSERT_TRUE(r.dp0.ok()) << r.dp0;
  EXPECT_LT(r.dp0_error, 1e-6);
}

TEST(Disagg, DpRankThatAbandonsAStepHoldsUpNoneOfItsLaterRounds) {
  // Both DP ranks run layer 0 of the step; then DP rank 1 fails it (its own fence, say) and
  // says so (kStepAbandoned). DP rank 0's later layers are served without it instead of
  // waiting out the step timeout for DP rank 1's headers.
  const TwoDpStep r = RunTwoDpStep(/*live=*/{true, true}, /*dead=*/{false, false},
                                   SecondDp::kDispatchesThenAbandons, 3);
  ASSERT_TRUE(r.dp1.ok()) << r.dp1;
  ASSERT_TRUE(r.dp0.ok()) << r.dp0;
  EXPECT_LT(r.dp0_error, 1e-6);
}

// A DP rank that was out of the router's view (frozen, partitioned) and is back in it may not
// be reachable or stepping yet: its step thread can still be waiting out the step it was stuck
// in. A step exchange that fails on such a rank within
// AttentionStepLoop::kStepExchangeRetryWindow of its return is run again, and its requests
// keep their state. Here DP rank 0's view has rank 1 back while rank 1's step thread is held,
// and with `link_down` the link between the two is down too; both come back only once rank 0
// has run its step again, and the request then ends as the single-process engine's.
void ExpectStepRunAgainUntilTheReturningDpRankSteps(bool link_down) {
  TempDir tmp;
  const std::string dir = testing::WritePreset(tmp, "default");
  const std::vector<GenerationRequest> requests = Requests(1, 6, 4096);
  auto engine = LocalEngine::Load(dir);
  ASSERT_TRUE(engine.ok()) << engine.status();
  auto reference = (*engine)->GenerateBatch(requests);
  ASSERT_TRUE(reference.ok()) << reference.status();
  absl::Notification rank1_may_step;
  testing::ClusterOptions options;
  options.held = true;
  options.on_step_thread_start = [&rank1_may_step](int rank, AttentionStepLoop* loop) {
    if (rank == 0) {
      loop->set_dp_ranks({true, false}, 1);
      loop->set_dp_ranks({true, true}, 2);  // DP rank 1 registered again: back in view 2
    } else {
      rank1_may_step.WaitForNotificationWithTimeout(absl::Seconds(120));
    }
  };
  // The expert rank's view is the one rank 0's steps are planned in (the router sends it to
  // every rank).
  options.on_serve_thread_start = [](int, ExpertStepServer* server) {
    server->set_dp_view({true, true}, {false, false}, 2);
  };
  InprocCluster cluster(dir, 2, Placement::Contiguous(16, 1), options);
  // Declared after the cluster, so gone first: rank 1's thread is never left held.
  struct Unhold {
    absl::Notification* n;
    ~Unhold() {
      if (!n->HasBeenNotified()) n->Notify();
    }
  } unhold{&rank1_may_step};
  if (link_down) cluster.transport(0)->Disconnect(1);
  std::vector<std::shared_ptr<ResultSink>> sinks = {std::make_shared<ResultSink>()};
  ASSERT_TRUE(cluster.Submit(0, 0, requests[0], sinks[0]).ok());
  cluster.Release();
  const AttentionCounters& dp0 = cluster.attention_counters(0);
  const absl::Time bound = absl::Now() + absl::Seconds(60);
  while (dp0.retried_steps.load() == 0 && absl::Now() < bound) {
    {
      std::lock_guard<std::mutex> lock(sinks[0]->mu);
      if (sinks[0]->done) break;  // failed instead of run again
    }
    absl::SleepFor(absl::Milliseconds(5));
  }
  {
    std::lock_guard<std::mutex> lock(sinks[0]->mu);
    ASSERT_FALSE(sinks[0]->done) << "the step failed instead of being run again: "
                                 << sinks[0]->status;
  }
  ASSERT_GT(dp0.retried_steps.load(), 0) << "DP rank 0 never ran its step again";
  if (link_down) {
    ASSERT_TRUE(cluster.transport(0)->Connect(1, cluster.transport(1)->LocalAddress()).ok());
    ASSERT_TRUE(cluster.transport(1)->Connect(0, cluster.transport(0)->LocalAddress()).ok());
  }
  rank1_may_step.Notify();
  ASSERT_TRUE(InprocCluster::WaitSinksDone(sinks, absl::Now() + absl::Seconds(120)))
      << "the request did not end";
  ASSERT_TRUE(sinks[0]->status.ok()) << sinks[0]->status;
  EXPECT_EQ(sinks[0]->tokens, (*reference)[0].tokens);
  // Every failed step of DP rank 0 was one it ran again.
  EXPECT_EQ(dp0.failed_steps.load(), dp0.retried_steps.load());
  EXPECT_GT(cluster.attention_counters(1).steps.load(), 0);
}

TEST(Disagg, StepExchangeFailingOnADpRankJustBackInTheViewIsRunAgain) {
  // The link to the returning rank down: the exchange fails with UNAVAILABLE at once.
  ExpectStepRunAgainUntilTheReturningDpRankSteps(/*link_down=*/true);
}

TEST(Disagg, StepExchangeTimingOutOnADpRankJustBackInTheViewIsRunAgain) {
  // The link up, the returning rank silent: the exchange waits out the step timeout (5 s
  // here) and fails with DEADLINE_EXCEEDED.
  ExpectStepRunAgainUntilTheReturningDpRankSteps(/*link_down=*/false);
}

// A step that fails for good (no retry applies: the link between two DP ranks down, no
// elastic retry window) ends its requests with UNAVAILABLE, and the message keeps the
// failure's own code ("... failed on DP rank 0: UNAVAILABLE: ...") for whoever reads the log
// or the client's error: a transport's DEADLINE_EXCEEDED and UNAVAILABLE read differently.
TEST(Disagg, AStepFailingForGoodEndsItsRequestsNamingTheFailuresCode) {
  TempDir tmp;
  const std::string dir = testing::WritePreset(tmp, "default");
  const std::vector<GenerationRequest> requests = Requests(1, 6, 4096);
  testing::ClusterOptions options;
  options.held = true;
  InprocCluster cluster(dir, 2, Placement::Contiguous(16, 1), options);
  cluster.transport(0)->Disconnect(1);
  std::vector<std::shared_ptr<ResultSink>> sinks = {std::make_shared<ResultSink>()};
  ASSERT_TRUE(cluster.Submit(0, 0, requests[0], sinks[0]).ok());
  cluster.Release();
  ASSERT_TRUE(InprocCluster::WaitSinksDone(sinks, absl::Now() + absl::Seconds(120)))
      << "the request did not end";
  const absl::Status status = sinks[0]->status;
  EXPECT_TRUE(absl::IsUnavailable(status)) << status;
  EXPECT_NE(status.message().find("failed on DP rank 0: UNAVAILABLE: "), std::string::npos)
      << status;
  EXPECT_GT(cluster.attention_counters(0).failed_steps.load(), 0);
  EXPECT_EQ(cluster.attention_counters(0).retried_steps.load(), 0);
}

}  // namespace
}  // namespace dxs
