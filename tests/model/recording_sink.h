// RecordingSink: what one request's TokenSink saw (its tokens, how it ended), filled on the
// step thread and awaited (bounded) by the test thread; a token after the end, or a second
// end, is a test failure. GreedyRequest: the requests such tests stream.
#pragma once

#include <cstdint>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "gtest/gtest.h"
#include "model/scheduler.h"

namespace dxs::testing {

struct RecordingSink {
  absl::Mutex mu;
  std::vector<int32_t> tokens ABSL_GUARDED_BY(mu);
  bool done ABSL_GUARDED_BY(mu) = false;
  absl::Status status ABSL_GUARDED_BY(mu);
  FinishReason reason ABSL_GUARDED_BY(mu) = FinishReason::kLength;

  TokenSink Sink() {
    TokenSink sink;
    sink.on_token = [this](int32_t token, const float*) {
      absl::MutexLock lock(&mu);
      EXPECT_FALSE(done) << "a token after the request ended";
      tokens.push_back(token);
    };
    sink.on_done = [this](const absl::Status& s, FinishReason r) {
      absl::MutexLock lock(&mu);
      EXPECT_FALSE(done) << "the request ended twice";
      status = s;
      reason = r;
      done = true;
    };
    return sink;
  }
  // Waits (up to 120 s) until at least `n` tokens came or the request ended.
  bool WaitTokens(size_t n) {
    absl::MutexLock lock(&mu);
    auto ready = [this, n]() ABSL_SHARED_LOCKS_REQUIRED(mu) { return tokens.size() >= n || done; };
    return mu.AwaitWithTimeout(absl::Condition(&ready), absl::Seconds(120));
  }
  // Waits (up to 120 s) until the request ended.
  bool WaitDone() {
    absl::MutexLock lock(&mu);
    return mu.AwaitWithTimeout(absl::Condition(&done), absl::Seconds(120));
  }
};

// A greedy request of `max_new_tokens` tokens past EOS (each runs to its length).
inline GenerationRequest GreedyRequest(std::vector<int32_t> prompt, int64_t max_new_tokens) {
  GenerationRequest r;
  r.prompt = std::move(prompt);
  r.max_new_tokens = max_new_tokens;
  r.ignore_eos = true;
  return r;
}

}  // namespace dxs::testing
