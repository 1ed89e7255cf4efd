// Overlap scheduling on the attention workers (AttentionStepLoop::set_overlap_schedule): a
// DP rank queues a decode step behind the running one, its input tokens taken on the device
// from that step's samples, and streams the running step's tokens afterwards, while the
// other DP ranks and the expert ranks see ordinary steps. The cluster gives the same
// tokens, finish reasons and log-probabilities as without, greedy and seeded, for requests
// that stop early (a stop id, max_new_tokens, min_new_tokens), whose penalties count the
// token in flight on the device, on a rank with no requests, in steps split for
// two-batch overlap and in padded (piecewise) decode steps; an abort during an overlapped
// run ends its request and leaves the others as they were.
#include <memory>
#include <vector>

#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "model/engine.h"
#include "tests/disagg/cluster_harness.h"
#include "tests/model/overlap_requests.h"
#include "tests/model/recording_sink.h"
#include "tests/model/test_util.h"

namespace dxs {
namespace {

using testing::ClusterOptions;
using testing::GreedyRequest;
using testing::InprocCluster;
using testing::ResultSink;
using testing::TempDir;

struct ClusterRun {
  std::vector<std::shared_ptr<ResultSink>> sinks;
  std::vector<int64_t> steps_ahead;  // per DP rank
  std::vector<int64_t> split_steps;  // per DP rank: split for two-batch overlap
  std::vector<int64_t> piecewise_steps;
};

// Runs request i on DP rank rank_of[i] of a fresh cluster until every request is done.
ClusterRun RunCluster(const std::string& dir, int num_attention, int num_expert, bool overlap,
                      const std::vector<GenerationRequest>& requests,
                      const std::vector<int>& rank_of, ClusterOptions options = {}) {
  options.overlap_schedule = overlap;
  // Every request in its rank's first step: the same batches in both runs.
  options.held = true;
  InprocCluster cluster(dir, num_attention, Placement::Contiguous(16, num_expert), options);
  ClusterRun run;
  for (size_t i = 0; i < requests.size(); ++i) {
    run.sinks.push_back(std::make_shared<ResultSink>());
    absl::Status s = cluster.Submit(rank_of.at(i), i, requests[i], run.sinks.back());
    EXPECT_TRUE(s.ok()) << s;
  }
  cluster.Release();
  EXPECT_TRUE(cluster.WaitAllDone(run.sinks, absl::Seconds(120))) << "cluster hung";
  for (int r = 0; r < num_attention; ++r) {
    const AttentionCounters& c = cluster.attention_counters(r);
    run.steps_ahead.push_back(c.steps_ahead.load());
    run.split_steps.push_back(c.overlapped_steps.load());
    run.piecewise_steps.push_back(c.piecewise_steps.load());
  }
  return run;
}

void ExpectSameResults(const ClusterRun& got, const ClusterRun& want) {
  ASSERT_EQ(got.sinks.size(), want.sinks.size());
  for (size_t i = 0; i < got.sinks.size(); ++i) {
    SCOPED_TRACE(::testing::Message() << "request " << i);
    const ResultSink &a = *got.sinks[i], &b = *want.sinks[i];
    EXPECT_TRUE(a.status.ok()) << a.status;
    EXPECT_TRUE(b.status.ok()) << b.status;
    EXPECT_EQ(a.tokens, b.tokens);
    EXPECT_EQ(a.reason, b.reason);
    testing::ExpectSameLogprobs(a.logprobs, b.logprobs);
  }
}

class OverlapCluster : public ::testing::Test {
 protected:
  void SetUp() override { dir_ = testing::WritePreset(tmp_, "default"); }
  // The single-process engine's greedy tokens for `r` alone.
  std::vector<int32_t> EngineTokens(const GenerationRequest& r) {
    auto engine = LocalEngine::Load(dir_);
    EXPECT_TRUE(engine.ok()) << engine.status();
    if (!engine.ok()) return {};
    auto out = (*engine)->GenerateBatch({r});
    EXPECT_TRUE(out.ok()) << out.status();
    return out.ok() ? out->front().tokens : std::vector<int32_t>{};
  }
  TempDir tmp_;
  std::string dir_;
};

TEST_F(OverlapCluster, StepsGoAheadWithTheSameTokensAsWithout) {
  // Tokens of two requests alone, to stop them mid-stream on ids they do produce.
  const std::vector<int32_t> solo_stop = EngineTokens(GreedyRequest(testing::StopPrompt(), 12));
  const std::vector<int32_t> solo_min = EngineTokens(GreedyRequest(testing::MinNewPrompt(), 12));
  ASSERT_GE(solo_stop.size(), 6u);
  ASSERT_GE(solo_min.size(), 3u);
  std::vector<GenerationRequest> requests = testing::EarlyStopRequests(solo_stop, solo_min);
  // Enough plain decoders that the cluster's decode steps reach the two-batch-overlap
  // threshold (AttentionStepLoop::kDefaultOverlapMinTokens tokens over the DP ranks).
  for (int i = 0; i < 14; ++i) {
    requests.push_back(GreedyRequest({100 + 7 * i, 101 + 7 * i, 102 + 7 * i}, 12 + i % 7));
  }
  // DP ranks 0 and 1 take turns; rank 2 has no request and takes part with empty steps.
  std::vector<int> rank_of;
  for (size_t i = 0; i < requests.size(); ++i) rank_of.push_back(static_cast<int>(i % 2));

  const ClusterRun off = RunCluster(dir_, 3, 2, false, requests, rank_of);
  const ClusterRun on = RunCluster(dir_, 3, 2, true, requests, rank_of);
  ExpectSameResults(on, off);
  ASSERT_EQ(on.sinks.size(), requests.size());
  EXPECT_EQ(on.sinks[1]->reason, FinishReason::kStopToken);
  EXPECT_LE(on.sinks[1]->tokens.size(), 6u);
  EXPECT_EQ(on.sinks[3]->tokens.size(), 1u);
  EXPECT_GE(on.sinks[4]->tokens.size(), 4u);
  EXPECT_EQ(on.sinks[2]->logprobs.size(), on.sinks[2]->tokens.size());
  for (int r = 0; r < 3; ++r) EXPECT_EQ(off.steps_ahead[r], 0) << "DP rank " << r;
  // Rank 0's and rank 1's steps (the penalised request's among them) go ahead from their
  // second decode step.
  EXPECT_GT(on.steps_ahead[0], 0);
  EXPECT_GT(on.steps_ahead[1], 0);
  EXPECT_EQ(on.steps_ahead[2], 0) << "an empty rank has no step to go ahead of";
  EXPECT_GT(on.split_steps[0], 0) << "no step reached the two-batch-overlap threshold";
}

TEST_F(OverlapCluster, PiecewiseDecodeStepsGoAheadWithTheSameTokens) {
  std::vector<GenerationRequest> requests;
  for (int i = 0; i < 4; ++i) {
    requests.push_back(GreedyRequest({30 + 11 * i, 31 + 11 * i, 32 + 11 * i, 33}, 10));
  }
  ClusterOptions options;
  options.piecewise = AttentionStepLoop::PiecewiseDecode::kEager;
  const std::vector<int> rank_of = {0, 1, 0, 1};
  const ClusterRun off = RunCluster(dir_, 2, 2, false, requests, rank_of, options);
  const ClusterRun on = RunCluster(dir_, 2, 2, true, requests, rank_of, options);
  ExpectSameResults(on, off);
  for (int r = 0; r < 2; ++r) {
    EXPECT_GT(on.steps_ahead[r], 0) << "DP rank " << r;
    EXPECT_GT(on.piecewise_steps[r], 0) << "DP rank " << r;
    EXPECT_EQ(off.steps_ahead[r], 0) << "DP rank " << r;
  }
  // And the same as the single-process engine.
  for (size_t i = 0; i < requests.size(); ++i) {
    EXPECT_EQ(on.sinks[i]->tokens, EngineTokens(requests[i])) << "request " << i;
  }
}

TEST_F(OverlapCluster, AnAbortEndsItsRequestAndTheOthersGoOn) {
  const GenerationRequest kept = GreedyRequest({5, 6, 7, 8}, 40);
  const GenerationRequest other_rank = GreedyRequest({40, 41}, 30);
  const std::vector<int32_t> want_kept = EngineTokens(kept);
  const std::vector<int32_t> want_other = EngineTokens(other_rank);
  InprocCluster cluster(dir_, 2, Placement::Contiguous(16, 1), ClusterOptions{});
  auto aborted = std::make_shared<ResultSink>();
  auto sink_kept = std::make_shared<ResultSink>();
  auto sink_other = std::make_shared<ResultSink>();
  ASSERT_TRUE(cluster.Submit(0, 1, GreedyRequest({40, 41, 42}, 500), aborted).ok());
  ASSERT_TRUE(cluster.Submit(0, 2, kept, sink_kept).ok());
  ASSERT_TRUE(cluster.Submit(1, 3, other_rank, sink_other).ok());
  // Abort once the long request streams (its steps going ahead by then).
  const absl::Time deadline = absl::Now() + absl::Seconds(120);
  while (true) {
    {
      std::lock_guard<std::mutex> lock(aborted->mu);
      if (aborted->tokens.size() >= 5 || aborted->done) break;
    }
    ASSERT_LT(absl::Now(), deadline) << "the long request never streamed 5 tokens";
    absl::SleepFor(absl::Milliseconds(5));
  }
  EXPECT_TRUE(cluster.Abort(0, 1));
  ASSERT_TRUE(cluster.WaitAllDone({aborted, sink_kept, sink_other}, absl::Seconds(120)))
      << "cluster hung";
  EXPECT_TRUE(aborted->status.ok()) << aborted->status;
  EXPECT_EQ(aborted->reason, FinishReason::kAborted);
  EXPECT_LT(aborted->tokens.size(), 500u);
  EXPECT_TRUE(sink_kept->status.ok()) << sink_kept->status;
  EXPECT_EQ(sink_kept->reason, FinishReason::kLength);
  EXPECT_EQ(sink_kept->tokens, want_kept);
  EXPECT_TRUE(sink_other->status.ok()) << sink_other->status;
  EXPECT_EQ(sink_other->tokens, want_other);
  EXPECT_GT(cluster.attention_counters(0).steps_ahead.load(), 0);
  EXPECT_GT(cluster.attention_counters(1).steps_ahead.load(), 0);
}

}  // namespace
}  // namespace dxs
