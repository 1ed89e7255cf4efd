// LocalServer: the single-process engine serving requests as they arrive. Requests that
// join a running batch get the tokens GenerateBatch gives them alone; a bad request is
// refused without disturbing the others; stopping ends what is live with CANCELLED.
#include "model/local_server.h"

#include <memory>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "gtest/gtest.h"
#include "tests/model/recording_sink.h"
#include "tests/model/test_util.h"

namespace dxs {
namespace {

using testing::TempDir;

using Seen = testing::RecordingSink;

using testing::GreedyRequest;

TEST(LocalServer, RequestsJoiningARunningBatchEqualGenerateBatchAlone) {
  TempDir tmp;
  absl::StatusOr<std::unique_ptr<LocalEngine>> engine =
      LocalEngine::Load(testing::WritePreset(tmp, "default"));
  ASSERT_TRUE(engine.ok()) << engine.status();
  std::vector<GenerationRequest> requests;
  for (int i = 0; i < 6; ++i) {
    std::vector<int32_t> prompt;
    for (int j = 0; j < 3 + 2 * i; ++j) prompt.push_back(5 + 37 * i + 11 * j);
    requests.push_back(GreedyRequest(prompt, 6 + 3 * i));
  }
  std::vector<std::vector<int32_t>> want;
  for (const GenerationRequest& r : requests) {
    absl::StatusOr<std::vector<GenerationResult>> alone = (*engine)->GenerateBatch({r});
    ASSERT_TRUE(alone.ok()) << alone.status();
    want.push_back((*alone)[0].tokens);
  }

  std::vector<std::unique_ptr<Seen>> seen;
  for (size_t i = 0; i < requests.size(); ++i) seen.push_back(std::make_unique<Seen>());
  {
    LocalServer server(engine->get());
    // Two first; the rest once the first is decoding, so they join a batch mid-flight.
    for (int i = 0; i < 2; ++i) ASSERT_TRUE(server.Submit(i, requests[i], seen[i]->Sink()).ok());
    ASSERT_TRUE(seen[0]->WaitTokens(2));
    for (size_t i = 2; i < requests.size(); ++i) {
      ASSERT_TRUE(server.Submit(i, requests[i], seen[i]->Sink()).ok());
    }
    for (auto& s : seen) ASSERT_TRUE(s->WaitDone());
  }
  for (size_t i = 0; i < requests.size(); ++i) {
    absl::MutexLock lock(&seen[i]->mu);
    EXPECT_TRUE(seen[i]->status.ok()) << seen[i]->status;
    EXPECT_EQ(seen[i]->tokens, want[i]) << "request " << i;
  }
}

TEST(LocalServer, BadRequestIsRefusedAndTheOthersGoOn) {
  TempDir tmp;
  absl::StatusOr<std::unique_ptr<LocalEngine>> engine =
      LocalEngine::Load(testing::WritePreset(tmp, "default"));
  ASSERT_TRUE(engine.ok()) << engine.status();
  LocalServer server(engine->get());
  Seen good;
  ASSERT_TRUE(server.Submit(1, GreedyRequest({5, 6, 7}, 8), good.Sink()).ok());
  Seen bad;
  const int32_t out_of_vocab = static_cast<int32_t>((*engine)->config().vocab_size);
  absl::Status refused = server.Submit(2, GreedyRequest({5, out_of_vocab}, 4), bad.Sink());
  EXPECT_EQ(refused.code(), absl::StatusCode::kInvalidArgument) << refused;
  Seen duplicate;
  EXPECT_EQ(server.Submit(1, GreedyRequest({9}, 2), duplicate.Sink()).code(),
            absl::StatusCode::kAlreadyExists);
  ASSERT_TRUE(good.WaitDone());
  absl::MutexLock lock(&good.mu);
  EXPECT_TRUE(good.status.ok()) << good.status;
  EXPECT_EQ(good.tokens.size(), 8u);
}

// Stopping ends live requests with CANCELLED and leaves the engine usable, though it
// stopped with a decode step queued (overlap scheduling, on by default, queues most of a
// long request's steps): the next batch gets its tokens.
TEST(LocalServer, StoppingEndsLiveRequestsCancelled) {
  TempDir tmp;
  absl::StatusOr<std::unique_ptr<LocalEngine>> engine =
      LocalEngine::Load(testing::WritePreset(tmp, "default"));
  ASSERT_TRUE(engine.ok()) << engine.status();
  const GenerationRequest after = GreedyRequest({8, 9, 10}, 12);
  absl::StatusOr<std::vector<GenerationResult>> want = (*engine)->GenerateBatch({after});
  ASSERT_TRUE(want.ok()) << want.status();
  Seen long_one;
  {
    LocalServer server(engine->get());
    ASSERT_TRUE(server.Submit(1, GreedyRequest({5, 6, 7}, 4000), long_one.Sink()).ok());
    ASSERT_TRUE(long_one.WaitTokens(5));
  }
  {
    absl::MutexLock lock(&long_one.mu);
    EXPECT_TRUE(long_one.done);
    EXPECT_EQ(long_one.status.code(), absl::StatusCode::kCancelled) << long_one.status;
    EXPECT_LT(long_one.tokens.size(), 4000u);
  }
  absl::StatusOr<std::vector<GenerationResult>> again = (*engine)->GenerateBatch({after});
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(again->front().tokens, want->front().tokens);
}

}  // namespace
}  // namespace dxs
