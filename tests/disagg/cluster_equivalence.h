// Checks the disaggregated tests share: requests sent concurrently to a running
// ProcessCluster equal the single-process engine on the same checkpoint (greedy tokens
// identical, first-token logits within 1e-5 relative, or what EngineEquivalence says), and
// which experts computed what.
#pragma once

#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdlib>
#include <functional>
#include <iostream>
#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "dxs/v1/expert_worker.grpc.pb.h"
#include "gtest/gtest.h"
#include "model/engine.h"
#include "tests/disagg/metrics_util.h"
#include "tests/disagg/process_cluster.h"
#include "tests/model/test_util.h"

namespace dxs::testing {

// Request i's prompt (2 + 3i tokens of a vocabulary of `vocab`).
inline std::vector<int32_t> ClusterPrompt(int i, int vocab) {
  std::vector<int32_t> p;
  for (int j = 0; j < 2 + 3 * i; ++j) p.push_back(5 + (i * 577 + j * 101) % (vocab - 5));
  return p;
}

// What the cluster is compared with: the single-process engine on `engine.device`, its
// first-token logits within `max_logit_error` (relative to the largest).
struct EngineEquivalence {
  EngineOptions engine;
  double max_logit_error = 1e-5;
  // Greedy tokens must equal the reference's up to a near tie: where they first differ,
  // the token taken must be among the reference's top 5 there, within this many nats of its
  // choice, and the rest is not compared (a different token changes every later input).
  // 0: every token equal. On the GPU, the cluster computes other batch shapes than the solo
  // reference (the step's other sequences, micro-batches, EP ranks' partial sums on a bf16
  // wire), whose rounding can decide a tie that close: vLLM's tests compare the same way
  // (tests/models/utils.py, check_logprobs_close).
  double max_near_tie_gap = 0;
  // Added to max_near_tie_gap: this many times the reference's largest first-token logit
  // (absolute). For computations whose logits carry an error relative to the largest, as
  // max_logit_error bounds it (FP8 activations): two logits each off by up to e * L can swap
  // wherever they are within 2 * e * L of each other.
  double near_tie_gap_of_largest_logit = 0;
  bool AllowsNearTies() const { return max_near_tie_gap > 0 || near_tie_gap_of_largest_logit > 0; }
};

// `got` against the reference's greedy tokens (`want`, with its top-5 logprobs when
// reference.max_near_tie_gap > 0), as EngineEquivalence::max_near_tie_gap says.
inline ::testing::AssertionResult TokensMatchReference(const std::vector<int32_t>& got,
                                                       const GenerationResult& want,
                                                       const EngineEquivalence& reference) {
  size_t i = 0;
  while (i < got.size() && i < want.tokens.size() && got[i] == want.tokens[i]) ++i;
  if (i == got.size() && i == want.tokens.size()) return ::testing::AssertionSuccess();
  std::string gap_note;
  if (reference.AllowsNearTies() && i < got.size() && i < want.tokens.size() &&
      i < want.logprobs.size()) {
    double largest_logit = 0;
    for (const float v : want.first_logits)
      largest_logit = std::max<double>(largest_logit, std::fabs(v));
    const double allowed =
        reference.max_near_tie_gap + reference.near_tie_gap_of_largest_logit * largest_logit;
    const TokenLogprobs& at = want.logprobs[i];
    for (const auto& [token, logprob] : at.top) {
      if (token != got[i]) continue;
      const double gap = at.logprob - logprob;
      if (gap <= allowed) {
        std::cout << "near tie at token " << i << ": " << got[i] << " taken, the reference's "
                  << want.tokens[i] << " is " << gap << " nats more likely there\n";
        return ::testing::AssertionSuccess();
      }
      gap_note = absl::StrCat(" (the reference's choice is ", gap, " nats more likely; ", allowed,
                              " allowed)");
    }
  }
  return ::testing::AssertionFailure()
         << "tokens differ from token " << i << " on: got " << ::testing::PrintToString(got)
         << ", the reference " << ::testing::PrintToString(want.tokens) << gap_note;
}

// The reference's request for `prompt`: greedy, with the top-5 logprobs that
// TokensMatchReference reads when near ties are allowed.
inline GenerationRequest ReferenceRequest(const std::vector<int32_t>& prompt, int max_new,
                                          const EngineEquivalence& reference) {
  GenerationRequest r;
  r.prompt = prompt;
  r.max_new_tokens = max_new;
  if (reference.AllowsNearTies()) r.top_logprobs = 5;
  return r;
}

// The single-process engine's result for `prompt` on the checkpoint in `dir`.
inline GenerationResult EngineReference(const std::string& dir, const std::vector<int32_t>& prompt,
                                        int max_new, const EngineEquivalence& reference = {}) {
  auto engine = LocalEngine::Load(dir, reference.engine);
  EXPECT_TRUE(engine.ok()) << engine.status();
  if (!engine.ok()) return {};
  auto out = (*engine)->GenerateBatch({ReferenceRequest(prompt, max_new, reference)});
  EXPECT_TRUE(out.ok()) << out.status();
  return out.ok() ? out->front() : GenerationResult();
}

// Sends requests 0..n-1 ("req-i", ClusterPrompt(i), 6 tokens) concurrently, request i to
// DP rank i % num_attention, and checks each against the single-process engine.
inline void ExpectClusterMatchesEngine(ProcessCluster* cluster, const std::string& dir,
                                       int num_attention, int num_requests, int vocab,
                                       const EngineEquivalence& reference = {}) {
  std::vector<GenerateResult> results(num_requests);
  std::vector<std::thread> threads;
  for (int i = 0; i < num_requests; ++i) {
    threads.emplace_back([&, i] {
      results[i] = cluster->Generate(i % num_attention, "req-" + std::to_string(i),
                                     ClusterPrompt(i, vocab), 6);
    });
  }
  for (auto& t : threads) t.join();
  for (int i = 0; i < num_requests; ++i) {
    ASSERT_TRUE(results[i].status.ok()) << results[i].status.error_message() << cluster->DumpLogs();
    const GenerationResult want = EngineReference(dir, ClusterPrompt(i, vocab), 6, reference);
    EXPECT_TRUE(TokensMatchReference(results[i].tokens, want, reference)) << "request " << i;
    const std::vector<float> got = cluster->FirstLogits("req-" + std::to_string(i));
    ASSERT_EQ(got.size(), want.first_logits.size()) << "request " << i;
    EXPECT_LT(RelativeError(got, want.first_logits), reference.max_logit_error) << "request " << i;
    EXPECT_EQ(results[i].finish_reason, v1::FINISH_REASON_LENGTH);
  }
}

// A load that lasts until `during` is done, so that whatever `during` does happens under
// load on a machine of any speed: `num_streams` client threads, stream s on DP rank
// s % num_attention, each sending requests for `prompt(s)` (`max_tokens` tokens, request id
// tag + s + "." + k for its k-th) one after another. `during` runs once the load is under way
// (DP rank 0 has combined 40 tokens more than before the streams started; a failure if that
// does not happen within 120 s); when it returns, each stream finishes the request it has in
// flight and stops. Every request must succeed and give the greedy tokens of its stream's
// solo run on the single-process engine (`reference`; with `check_first_logits`, its first
// logits within reference.max_logit_error too).
struct StreamsRun {
  int requests = 0;          // sent, over all streams
  absl::Time streams_ended;  // when the last stream's last request ended
};
inline StreamsRun ExpectConcurrentStreamsMatchEngine(
    ProcessCluster* cluster, const std::string& dir, int num_attention, int num_streams,
    int max_tokens, const std::string& tag, const std::function<std::vector<int32_t>(int)>& prompt,
    const EngineEquivalence& reference, const std::function<void()>& during,
    bool check_first_logits = false) {
  const auto combined = [&] {
    absl::StatusOr<std::string> text = Scrape(cluster->attention_metrics_address(0));
    return text.ok() ? SumOf(ParseSamples(*text), "dxs_tokens_combined_total") : -1.0;
  };
  const double combined_before = combined();
  EXPECT_GE(combined_before, 0) << "DP rank 0's metrics cannot be scraped";
  std::atomic<bool> stop{false};
  std::vector<std::vector<GenerateResult>> results(num_streams);
  std::vector<std::thread> threads;
  for (int s = 0; s < num_streams; ++s) {
    threads.emplace_back([&, s] {
      do {
        const std::string id = tag + std::to_string(s) + "." + std::to_string(results[s].size());
        results[s].push_back(
            cluster->Generate(s % num_attention, id, prompt(s), max_tokens, absl::Seconds(120)));
      } while (!stop.load() && results[s].back().status.ok());
    });
  }
  bool under_way = false;
  for (const absl::Time end = absl::Now() + absl::Seconds(120); absl::Now() < end;) {
    if (combined() >= combined_before + 40) {
      under_way = true;
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  EXPECT_TRUE(under_way) << "the streams did not get under way within 120 s" << cluster->DumpLogs();
  if (under_way) during();
  stop = true;
  for (auto& t : threads) t.join();
  StreamsRun run;
  run.streams_ended = absl::Now();
  int logs_dumped = 0;
  auto engine = LocalEngine::Load(dir, reference.engine);
  EXPECT_TRUE(engine.ok()) << engine.status();
  if (!engine.ok()) return run;
  for (int s = 0; s < num_streams; ++s) {
    auto out = (*engine)->GenerateBatch({ReferenceRequest(prompt(s), max_tokens, reference)});
    EXPECT_TRUE(out.ok()) << out.status();
    if (!out.ok()) return run;
    for (size_t k = 0; k < results[s].size(); ++k, ++run.requests) {
      const std::string id = tag + std::to_string(s) + "." + std::to_string(k);
      const GenerateResult& got = results[s][k];
      EXPECT_TRUE(got.status.ok())
          << "request " << id << ": " << got.status.error_message() << cluster->DumpLogs();
      if (!got.status.ok()) continue;
      // The workers' logs with the first mismatch: they say which steps failed and ran
      // again around it.
      const ::testing::AssertionResult tokens =
          TokensMatchReference(got.tokens, out->front(), reference);
      EXPECT_TRUE(tokens) << "request " << id
                          << (!tokens && !logs_dumped++ ? cluster->DumpLogs() : "");
      if (!check_first_logits) continue;
      const std::vector<float> logits = cluster->FirstLogits(id);
      EXPECT_EQ(logits.size(), out->front().first_logits.size()) << "request " << id;
      if (logits.size() != out->front().first_logits.size()) continue;
      EXPECT_LT(RelativeError(logits, out->front().first_logits), reference.max_logit_error)
          << "request " << id;
    }
  }
  return run;
}

// The router's current view; a test failure (and an empty view) if it sent none.
inline v1::ClusterView CurrentClusterView(const ProcessCluster& cluster) {
  absl::StatusOr<v1::ClusterView> view = cluster.WatchClusterOnce();
  EXPECT_TRUE(view.ok()) << view.status();
  return view.ok() ? *view : v1::ClusterView();
}

// Kills EP rank `rank` once a long request on DP rank 0 has streamed tokens: the request
// fails with UNAVAILABLE within 5 s, never a hang; the expert comes back on its address and
// registers again (a new incarnation, live in the router's view), and the cluster serves
// results equal to `reference` without restarting anything else.
inline void ExpectKilledExpertFailsInFlightThenRecovers(ProcessCluster* cluster,
                                                        const std::string& dir, int num_attention,
                                                        int rank,
                                                        const EngineEquivalence& reference = {}) {
  const auto incarnation_of = [&](const v1::ClusterView& view) -> uint64_t {
    for (const v1::WorkerInfo& w : view.workers()) {
      if (w.role() == v1::ROLE_EXPERT && static_cast<int>(w.rank()) == rank &&
          w.state() != v1::WORKER_STATE_DEAD) {
        return w.incarnation();
      }
    }
    return 0;
  };
  const uint64_t incarnation_before = incarnation_of(CurrentClusterView(*cluster));
  ASSERT_NE(incarnation_before, 0u) << "EP rank " << rank << " is not live" << cluster->DumpLogs();
  // As long as the context allows, so that no machine finishes it before the kill.
  constexpr int kMaxNewTokens = 4000;
  std::mutex mu;
  std::condition_variable streamed;
  size_t tokens_so_far = 0;
  GenerateResult long_run;
  std::thread client([&] {
    long_run = cluster->Generate(0, "long", ClusterPrompt(1, 4096), kMaxNewTokens,
                                 absl::Seconds(120), [&](size_t n) {
                                   std::lock_guard<std::mutex> lock(mu);
                                   tokens_so_far = n;
                                   streamed.notify_all();
                                 });
    std::lock_guard<std::mutex> lock(mu);
    streamed.notify_all();
  });
  {
    std::unique_lock<std::mutex> lock(mu);
    streamed.wait_for(lock, std::chrono::seconds(60), [&] { return tokens_so_far >= 4; });
  }
  const absl::Time killed_at = absl::Now();
  cluster->KillExpert(rank);
  client.join();
  const absl::Duration took = absl::Now() - killed_at;
  ASSERT_GE(long_run.tokens.size(), 4u) << "the request should have been running"
                                        << long_run.status.error_message() << cluster->DumpLogs();
  EXPECT_EQ(long_run.status.error_code(), grpc::StatusCode::UNAVAILABLE)
      << long_run.status.error_message() << cluster->DumpLogs();
  EXPECT_LT(long_run.tokens.size(), static_cast<size_t>(kMaxNewTokens));
  EXPECT_LT(took, absl::Seconds(5));

  const absl::Status restarted = cluster->StartExpert(rank, dir, "");
  ASSERT_TRUE(restarted.ok()) << restarted << cluster->DumpLogs();
  // The restarted rank is in the view before the attention ranks are asked whether they are
  // READY (which they still are from before the kill once they have seen it come back).
  bool back = false;
  for (const absl::Time end = absl::Now() + absl::Seconds(60); !back && absl::Now() < end;) {
    absl::StatusOr<v1::ClusterView> view = cluster->WatchClusterOnce();
    back = view.ok() && incarnation_of(*view) != 0 && incarnation_of(*view) != incarnation_before;
    if (!back) absl::SleepFor(absl::Milliseconds(20));
  }
  ASSERT_TRUE(back) << "EP rank " << rank << " not registered again within 60 s"
                    << cluster->DumpLogs();
  ASSERT_TRUE(cluster->WaitReady(absl::Seconds(60)).ok()) << cluster->DumpLogs();
  ExpectClusterMatchesEngine(cluster, dir, num_attention, 2, 4096, reference);
}

// The experts EP worker `w` holds resident, polled (every 50 ms, up to 60 s) until they are
// `want`; what it last reported (a test failure where it could not be asked).
inline std::vector<int> WaitForResidentExperts(const v1::WorkerInfo& w,
                                               const std::vector<int>& want) {
  auto expert = v1::ExpertWorker::NewStub(
      grpc::CreateChannel(w.grpc_address(), grpc::InsecureChannelCredentials()));
  std::vector<int> resident;
  for (const absl::Time end = absl::Now() + absl::Seconds(60); absl::Now() < end;) {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
    v1::GetExpertStatusResponse status;
    const grpc::Status s = expert->GetStatus(&ctx, {}, &status);
    EXPECT_TRUE(s.ok()) << "EP rank " << w.rank() << ": " << s.error_message();
    if (!s.ok()) break;
    resident.assign(status.loaded_experts().begin(), status.loaded_experts().end());
    if (resident == want) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  return resident;
}

// Per expert, the token rows expert rank `rank` computed for it (its dxs_expert_tokens_total
// series: one per expert it holds, from start-up on).
inline std::map<int, double> ExpertTokens(const ProcessCluster& cluster, int rank) {
  std::map<int, double> out;
  absl::StatusOr<std::string> text = Scrape(cluster.expert_metrics_address(rank));
  EXPECT_TRUE(text.ok()) << text.status();
  if (!text.ok()) return out;
  const std::string prefix = "dxs_expert_tokens_total{";
  for (const auto& [series, value] : ParseSamples(*text)) {
    if (series.rfind(prefix, 0) != 0) continue;
    const size_t at = series.find("expert=\"");
    if (at == std::string::npos) continue;
    out[std::atoi(series.c_str() + at + 8)] = value;
  }
  return out;
}

}  // namespace dxs::testing
