// Checks the disaggregated tests share: requests sent concurrently to a running
// ProcessCluster equal the single-process engine on the same checkpoint (greedy tokens
// identical, first-token logits within 1e-5 relative, or what EngineEquivalence says), and
// which experts computed what.
#pragma once

#include <chrono>
#include <cstdlib>
#include <functional>
#include <map>
#include <string>
#include <thread>
#include <vector>

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
};

// The single-process engine's result for `prompt` on the checkpoint in `dir`.
inline GenerationResult EngineReference(const std::string& dir, const std::vector<int32_t>& prompt,
                                        int max_new, const EngineOptions& options = {}) {
  auto engine = LocalEngine::Load(dir, options);
  EXPECT_TRUE(engine.ok()) << engine.status();
  if (!engine.ok()) return {};
  GenerationRequest r;
  r.prompt = prompt;
  r.max_new_tokens = max_new;
  auto out = (*engine)->GenerateBatch({r});
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
    const GenerationResult want =
        EngineReference(dir, ClusterPrompt(i, vocab), 6, reference.engine);
    EXPECT_EQ(results[i].tokens, want.tokens) << "request " << i;
    const std::vector<float> got = cluster->FirstLogits("req-" + std::to_string(i));
    ASSERT_EQ(got.size(), want.first_logits.size()) << "request " << i;
    EXPECT_LT(RelativeError(got, want.first_logits), reference.max_logit_error) << "request " << i;
    EXPECT_EQ(results[i].finish_reason, v1::FINISH_REASON_LENGTH);
  }
}

// Runs `num_requests` concurrent streams, request i `prompt(i)` for `max_tokens` tokens on
// DP rank i % num_attention, under `tag` + i; `during` runs once DP rank 0 has combined
// some tokens (the streams are under way). Every request must succeed and give the greedy
// tokens of its solo run on the single-process engine (`reference`; with
// `check_first_logits`, its first logits within reference.max_logit_error too).
inline void ExpectConcurrentStreamsMatchEngine(
    ProcessCluster* cluster, const std::string& dir, int num_attention, int num_requests,
    int max_tokens, const std::string& tag, const std::function<std::vector<int32_t>(int)>& prompt,
    const EngineEquivalence& reference, const std::function<void()>& during,
    bool check_first_logits = false) {
  std::vector<GenerateResult> results(num_requests);
  std::vector<std::thread> threads;
  for (int i = 0; i < num_requests; ++i) {
    threads.emplace_back([&, i] {
      results[i] = cluster->Generate(i % num_attention, tag + std::to_string(i), prompt(i),
                                     max_tokens, absl::Seconds(120));
    });
  }
  for (int i = 0; i < 500; ++i) {
    absl::StatusOr<std::string> text = Scrape(cluster->attention_metrics_address(0));
    if (text.ok() && SumOf(ParseSamples(*text), "dxs_tokens_combined_total") > 40) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  during();
  for (auto& t : threads) t.join();
  auto engine = LocalEngine::Load(dir, reference.engine);
  ASSERT_TRUE(engine.ok()) << engine.status();
  for (int i = 0; i < num_requests; ++i) {
    ASSERT_TRUE(results[i].status.ok())
        << "request " << i << ": " << results[i].status.error_message() << cluster->DumpLogs();
    GenerationRequest r;
    r.prompt = prompt(i);
    r.max_new_tokens = max_tokens;
    auto out = (*engine)->GenerateBatch({r});
    ASSERT_TRUE(out.ok()) << out.status();
    EXPECT_EQ(results[i].tokens, out->front().tokens) << "request " << i;
    if (!check_first_logits) continue;
    const std::vector<float> got = cluster->FirstLogits(tag + std::to_string(i));
    ASSERT_EQ(got.size(), out->front().first_logits.size()) << "request " << i;
    EXPECT_LT(RelativeError(got, out->front().first_logits), reference.max_logit_error)
        << "request " << i;
  }
}

// The router's current view; a test failure (and an empty view) if it sent none.
inline v1::ClusterView CurrentClusterView(const ProcessCluster& cluster) {
  absl::StatusOr<v1::ClusterView> view = cluster.WatchClusterOnce();
  EXPECT_TRUE(view.ok()) << view.status();
  return view.ok() ? *view : v1::ClusterView();
}

// Kills EP rank `rank` `after` a long request started on DP rank 0: the request fails with
// UNAVAILABLE within 5 s, never a hang; the expert comes back on its address and registers
// again, and the cluster serves results equal to `reference` without restarting anything
// else.
inline void ExpectKilledExpertFailsInFlightThenRecovers(ProcessCluster* cluster,
                                                        const std::string& dir, int num_attention,
                                                        int rank, absl::Duration after,
                                                        const EngineEquivalence& reference = {}) {
  GenerateResult long_run;
  std::thread client([&] {
    // Long enough to be in flight when the expert dies.
    long_run = cluster->Generate(0, "long", ClusterPrompt(1, 4096), 3000, absl::Seconds(90));
  });
  absl::SleepFor(after);
  const absl::Time killed_at = absl::Now();
  cluster->KillExpert(rank);
  client.join();
  const absl::Duration took = absl::Now() - killed_at;
  EXPECT_EQ(long_run.status.error_code(), grpc::StatusCode::UNAVAILABLE)
      << long_run.status.error_message() << cluster->DumpLogs();
  EXPECT_LT(took, absl::Seconds(5));
  EXPECT_FALSE(long_run.tokens.empty()) << "the request should have been running";

  ASSERT_TRUE(cluster->StartExpert(rank, dir, "").ok()) << cluster->DumpLogs();
  ASSERT_TRUE(cluster->WaitReady(absl::Seconds(60)).ok()) << cluster->DumpLogs();
  ExpectClusterMatchesEngine(cluster, dir, num_attention, 2, 4096, reference);
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
