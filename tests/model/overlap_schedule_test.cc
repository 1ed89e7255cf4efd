// Overlap scheduling (EngineOptions::overlap_schedule, Scheduler::BuildStepAhead): the
// engine queues a decode step behind the running one, its input tokens taken on the device
// from that step's samples, and hands out the running step's tokens afterwards. The tokens,
// finish reasons and log-probabilities equal those of the engine without it, greedy and
// seeded, for requests that stop early (a stop id, max_new_tokens, min_new_tokens) and for
// requests with penalties (the token in flight counted on the backend); an abort
// during an overlapped run ends the request and leaves the others as they were. (A server
// stopped with a step queued: local_server_test's StoppingEndsLiveRequestsCancelled.)
#include <memory>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "gtest/gtest.h"
#include "model/engine.h"
#include "model/local_server.h"
#include "tests/model/overlap_requests.h"
#include "tests/model/recording_sink.h"
#include "tests/model/test_util.h"

namespace dxs {
namespace {

using testing::TempDir;

struct EngineRun {
  std::vector<GenerationResult> results;
  int64_t overlapped_steps = 0;
};

EngineRun Generate(const std::string& dir, bool overlap,
                   const std::vector<GenerationRequest>& requests) {
  EngineOptions options;
  options.overlap_schedule = overlap;
  auto engine = LocalEngine::Load(dir, options);
  EXPECT_TRUE(engine.ok()) << engine.status();
  if (!engine.ok()) return {};
  auto results = (*engine)->GenerateBatch(requests);
  EXPECT_TRUE(results.ok()) << results.status();
  if (!results.ok()) return {};
  return {*std::move(results), (*engine)->overlapped_steps()};
}

using testing::GreedyRequest;

void ExpectSameResults(const std::vector<GenerationResult>& got,
                       const std::vector<GenerationResult>& want) {
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < got.size(); ++i) {
    EXPECT_EQ(got[i].tokens, want[i].tokens) << "request " << i;
    EXPECT_EQ(got[i].finish_reason, want[i].finish_reason) << "request " << i;
    SCOPED_TRACE(::testing::Message() << "request " << i);
    testing::ExpectSameLogprobs(got[i].logprobs, want[i].logprobs);
  }
}

class OverlapSchedule : public ::testing::Test {
 protected:
  void SetUp() override { dir_ = testing::WritePreset(tmp_, "default"); }
  TempDir tmp_;
  std::string dir_;
};

TEST_F(OverlapSchedule, DecodeStepsGoAheadAndGiveTheSameTokens) {
  const std::vector<GenerationRequest> requests = {GreedyRequest({5, 6, 7, 8}, 24),
                                                   GreedyRequest({40, 41, 42}, 20)};
  const EngineRun off = Generate(dir_, false, requests);
  const EngineRun on = Generate(dir_, true, requests);
  ExpectSameResults(on.results, off.results);
  EXPECT_EQ(off.overlapped_steps, 0);
  // Every decode step but the first (it goes ahead of nothing) and the last of each request
  // (nothing follows it) is queued behind the one before.
  EXPECT_GE(on.overlapped_steps, 15);
}

TEST_F(OverlapSchedule, EarlyStopsSamplingAndLogprobsEqualTheEngineWithout) {
  // Tokens of the requests alone, to stop them mid-stream on ids they do produce.
  const EngineRun solo = Generate(
      dir_, false,
      {GreedyRequest(testing::StopPrompt(), 12), GreedyRequest(testing::MinNewPrompt(), 12)});
  ASSERT_EQ(solo.results.size(), 2u);
  const std::vector<GenerationRequest> requests =
      testing::EarlyStopRequests(solo.results[0].tokens, solo.results[1].tokens);
  const GenerationRequest& penalised = requests.back();

  const EngineRun off = Generate(dir_, false, requests);
  const EngineRun on = Generate(dir_, true, requests);
  ExpectSameResults(on.results, off.results);
  ASSERT_EQ(on.results.size(), requests.size());
  EXPECT_EQ(on.results[1].finish_reason, FinishReason::kStopToken);
  EXPECT_LE(on.results[1].tokens.size(), 6u);
  EXPECT_EQ(on.results[3].tokens.size(), 1u);
  EXPECT_GE(on.results[4].tokens.size(), 4u);
  EXPECT_GT(on.overlapped_steps, 0);
  // Alone, the penalised request goes ahead too: its next row's penalties count the token
  // in flight on the backend.
  const EngineRun alone = Generate(dir_, true, {penalised});
  ASSERT_EQ(alone.results.size(), 1u);
  ExpectSameResults(alone.results, {off.results.back()});
  EXPECT_GE(alone.overlapped_steps, 7);
}

// Penalties with sampling: a step built ahead counts the step before's token on the backend
// (Backend::CountPendingTokens), so the tokens equal the engine's without overlap; were that
// token left out of the penalties, the draws would differ (the distribution they come from
// would). Each penalty alone, and the three together.
TEST_F(OverlapSchedule, PenaltiesCountTheTokenInFlight) {
  std::vector<GenerationRequest> requests;
  for (int kind = 0; kind < 4; ++kind) {
    GenerationRequest r = GreedyRequest({70 + kind, 71, 72}, 24);
    r.sampling.temperature = 1.f;
    r.sampling.seed = 17 + kind;
    if (kind == 0 || kind == 3) r.sampling.repetition_penalty = 5.f;
    if (kind == 1 || kind == 3) r.sampling.frequency_penalty = 2.f;
    if (kind == 2 || kind == 3) r.sampling.presence_penalty = 2.f;
    requests.push_back(r);
  }
  const EngineRun off = Generate(dir_, false, requests);
  const EngineRun on = Generate(dir_, true, requests);
  ExpectSameResults(on.results, off.results);
  EXPECT_GE(on.overlapped_steps, 20);
  // The penalties do move the draws: the same requests without them sample other tokens.
  std::vector<GenerationRequest> plain = requests;
  for (GenerationRequest& r : plain) {
    r.sampling.repetition_penalty = 1.f;
    r.sampling.frequency_penalty = r.sampling.presence_penalty = 0.f;
  }
  const EngineRun unpenalised = Generate(dir_, true, plain);
  ASSERT_EQ(unpenalised.results.size(), requests.size());
  for (size_t i = 0; i < requests.size(); ++i) {
    EXPECT_NE(unpenalised.results[i].tokens, off.results[i].tokens) << "request " << i;
  }
}

TEST_F(OverlapSchedule, SamplesOfOneRequestEqualTheEngineWithout) {
  GenerationRequest r = GreedyRequest({12, 13, 14}, 10);
  r.n = 3;
  r.sampling.temperature = 1.0f;
  r.sampling.seed = 11;
  const EngineRun off = Generate(dir_, false, {r});
  const EngineRun on = Generate(dir_, true, {r});
  ASSERT_EQ(on.results.size(), 1u);
  ASSERT_EQ(off.results.size(), 1u);
  ExpectSameResults({on.results[0]}, {off.results[0]});
  ExpectSameResults(on.results[0].samples, off.results[0].samples);
  EXPECT_GT(on.overlapped_steps, 0);
}

using Stream = testing::RecordingSink;

TEST_F(OverlapSchedule, AnAbortEndsItsRequestAndTheOthersGoOn) {
  EngineOptions options;
  options.overlap_schedule = true;
  auto engine = LocalEngine::Load(dir_, options);
  ASSERT_TRUE(engine.ok()) << engine.status();
  const GenerationRequest kept = GreedyRequest({5, 6, 7, 8}, 40);
  auto want = (*engine)->GenerateBatch({kept});
  ASSERT_TRUE(want.ok()) << want.status();
  Stream aborted, other;
  {
    LocalServer server(engine->get());
    ASSERT_TRUE(server.Submit(1, GreedyRequest({40, 41, 42}, 200), aborted.Sink()).ok());
    ASSERT_TRUE(server.Submit(2, kept, other.Sink()).ok());
    ASSERT_TRUE(aborted.WaitTokens(5));
    EXPECT_TRUE(server.Abort(1));
    ASSERT_TRUE(aborted.WaitDone());
    ASSERT_TRUE(other.WaitDone());
  }
  absl::MutexLock a(&aborted.mu), o(&other.mu);
  EXPECT_TRUE(aborted.status.ok()) << aborted.status;
  EXPECT_EQ(aborted.reason, FinishReason::kAborted);
  EXPECT_LT(aborted.tokens.size(), 200u);
  EXPECT_TRUE(other.status.ok()) << other.status;
  EXPECT_EQ(other.reason, FinishReason::kLength);
  EXPECT_EQ(other.tokens, want->front().tokens);
  EXPECT_GT((*engine)->overlapped_steps(), 0);
}

}  // namespace
}  // namespace dxs
