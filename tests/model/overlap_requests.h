// What the overlap-scheduling tests share (the single-process engine's,
// tests/model/overlap_schedule_test.cc, and the attention worker's,
// tests/disagg/overlap_cluster_test.cc): requests that stop early or whose sampling depends
// on every token before, and the comparison of two runs' log-probabilities.
#pragma once

#include <cstdint>
#include <vector>

#include "gtest/gtest.h"
#include "model/scheduler.h"
#include "tests/model/recording_sink.h"

namespace dxs::testing {

// The prompts of the two requests EarlyStopRequests stops on tokens they produce: run them
// alone (greedy, 12 tokens) for `solo_stop` and `solo_min`.
inline std::vector<int32_t> StopPrompt() { return {9, 10, 11}; }
inline std::vector<int32_t> MinNewPrompt() { return {300, 301}; }

// Six requests: to max_new_tokens; stopped by a stop id at its 6th token or before (its
// solo tokens: solo_stop, at least 6); seeded top-p/top-k with 3 alternatives a token; done
// with its first token; min_new_tokens 4 with a stop id it produces at its 3rd token
// (solo_min, at least 3); seeded with presence and repetition penalties (its steps go ahead
// too: the backend counts the token in flight, Backend::CountPendingTokens).
inline std::vector<GenerationRequest> EarlyStopRequests(const std::vector<int32_t>& solo_stop,
                                                        const std::vector<int32_t>& solo_min) {
  std::vector<GenerationRequest> requests;
  requests.push_back(GreedyRequest({5, 6, 7, 8}, 16));
  GenerationRequest stop = GreedyRequest(StopPrompt(), 12);
  stop.stop_token_ids = {solo_stop.at(5)};
  requests.push_back(stop);
  GenerationRequest seeded = GreedyRequest({20, 21, 22, 23, 24}, 14);
  seeded.sampling.temperature = 0.9f;
  seeded.sampling.top_p = 0.95f;
  seeded.sampling.top_k = 50;
  seeded.sampling.seed = 7;
  seeded.logprobs = true;
  seeded.top_logprobs = 3;
  requests.push_back(seeded);
  requests.push_back(GreedyRequest({60}, 1));
  GenerationRequest min_new = GreedyRequest(MinNewPrompt(), 12);
  min_new.min_new_tokens = 4;  // the mask lifts after the 4th token
  min_new.stop_token_ids = {solo_min.at(2)};
  requests.push_back(min_new);
  GenerationRequest penalised = GreedyRequest({70, 71, 72}, 10);
  penalised.sampling.temperature = 0.7f;
  penalised.sampling.seed = 3;
  penalised.sampling.presence_penalty = 0.5f;
  penalised.sampling.repetition_penalty = 1.2f;
  requests.push_back(penalised);
  return requests;
}

// Two runs' log-probabilities of one request: the same tokens and alternatives, the values
// within 4 ulps.
inline void ExpectSameLogprobs(const std::vector<TokenLogprobs>& got,
                               const std::vector<TokenLogprobs>& want) {
  ASSERT_EQ(got.size(), want.size());
  for (size_t t = 0; t < got.size(); ++t) {
    const TokenLogprobs &a = got[t], &b = want[t];
    EXPECT_EQ(a.token, b.token) << "token " << t;
    EXPECT_FLOAT_EQ(a.logprob, b.logprob) << "token " << t;
    ASSERT_EQ(a.top.size(), b.top.size()) << "token " << t;
    for (size_t k = 0; k < a.top.size(); ++k) {
      EXPECT_EQ(a.top[k].first, b.top[k].first) << "token " << t;
      EXPECT_FLOAT_EQ(a.top[k].second, b.top[k].second) << "token " << t;
    }
  }
}

}  // namespace dxs::testing
