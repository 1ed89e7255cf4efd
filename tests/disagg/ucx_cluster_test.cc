// The disaggregated cluster as real processes on loopback: dxs-router, dxs-attention and
// dxs-expert over gRPC (control) and UCX (dispatch/combine). Outputs equal the
// single-process engine; mismatched workers are refused; a killed expert fails in-flight
// requests with UNAVAILABLE within 5 s and the cluster recovers when it comes back.
#include <thread>

#include "gtest/gtest.h"
#include "model/engine.h"
#include "tests/disagg/process_cluster.h"
#include "tests/model/test_util.h"

namespace dxs {
namespace {

using testing::ClusterSpec;
using testing::GenerateResult;
using testing::ProcessCluster;
using testing::TempDir;

std::vector<int32_t> Prompt(int i, int vocab) {
  std::vector<int32_t> p;
  for (int j = 0; j < 2 + 3 * i; ++j) p.push_back(5 + (i * 577 + j * 101) % (vocab - 5));
  return p;
}

GenerationResult Reference(const std::string& dir, const std::vector<int32_t>& prompt,
                           int max_new) {
  auto engine = LocalEngine::Load(dir);
  EXPECT_TRUE(engine.ok()) << engine.status();
  GenerationRequest r;
  r.prompt = prompt;
  r.max_new_tokens = max_new;
  auto out = (*engine)->GenerateBatch({r});
  EXPECT_TRUE(out.ok()) << out.status();
  return out->front();
}

// Sends requests 0..n-1 concurrently, request i to DP rank i % M, and checks each against
// the single-process engine: greedy tokens identical, first logits within 1e-5 relative.
void ExpectMatchesEngine(ProcessCluster* cluster, const std::string& dir, int num_attention,
                         int num_requests, int vocab) {
  std::vector<GenerateResult> results(num_requests);
  std::vector<std::thread> threads;
  for (int i = 0; i < num_requests; ++i) {
    threads.emplace_back([&, i] {
      results[i] =
          cluster->Generate(i % num_attention, "req-" + std::to_string(i), Prompt(i, vocab), 6);
    });
  }
  for (auto& t : threads) t.join();
  for (int i = 0; i < num_requests; ++i) {
    ASSERT_TRUE(results[i].status.ok()) << results[i].status.error_message() << cluster->DumpLogs();
    const GenerationResult want = Reference(dir, Prompt(i, vocab), 6);
    EXPECT_EQ(results[i].tokens, want.tokens) << "request " << i;
    const std::vector<float> got = cluster->FirstLogits("req-" + std::to_string(i));
    ASSERT_EQ(got.size(), want.first_logits.size()) << "request " << i;
    EXPECT_LT(testing::RelativeError(got, want.first_logits), 1e-5) << "request " << i;
    EXPECT_EQ(results[i].finish_reason, v1::FINISH_REASON_LENGTH);
  }
}

class UcxGrid : public ::testing::TestWithParam<std::tuple<int, int>> {};

TEST_P(UcxGrid, EqualsSingleProcess) {
  const auto [m, n] = GetParam();
  TempDir tmp;
  const std::string dir = testing::WritePreset(tmp, "default");
  ProcessCluster cluster(tmp.path());
  ClusterSpec spec{dir, m, n, {}};
  absl::Status started = cluster.Start(spec);
  ASSERT_TRUE(started.ok()) << started << cluster.DumpLogs();
  // Two requests: with M = 3 one DP rank has none and runs empty steps.
  ExpectMatchesEngine(&cluster, dir, m, 2, 4096);
}

INSTANTIATE_TEST_SUITE_P(MxN, UcxGrid,
                         ::testing::Combine(::testing::Values(1, 2, 3), ::testing::Values(1, 2, 4)),
                         [](const auto& info) {
                           return "dp" + std::to_string(std::get<0>(info.param)) + "_ep" +
                                  std::to_string(std::get<1>(info.param));
                         });

TEST(UcxCluster, UnevenPlacementTwelveExpertsOnFiveRanks) {
  TempDir tmp;
  const std::string dir = testing::WritePreset(tmp, "odd");
  ProcessCluster cluster(tmp.path());
  ClusterSpec spec{dir, 2, 5, {"0-3", "4-5", "6-8", "9", "10-11"}};
  absl::Status started = cluster.Start(spec);
  ASSERT_TRUE(started.ok()) << started << cluster.DumpLogs();
  ExpectMatchesEngine(&cluster, dir, 2, 3, 3001);
}

TEST(UcxCluster, MismatchedWorkersAreRefused) {
  TempDir tmp;
  const std::string dir = testing::WritePreset(tmp, "default");
  const std::string other = testing::WritePreset(tmp, "odd");
  ProcessCluster cluster(tmp.path());
  ClusterSpec spec{dir, 1, 2, {}};
  absl::Status started = cluster.Start(spec);
  ASSERT_TRUE(started.ok()) << started << cluster.DumpLogs();
  // A different checkpoint.
  absl::Status s = cluster.StartExpert(1, other, "", "different checkpoint");
  EXPECT_TRUE(s.ok()) << s << cluster.DumpLogs();
  // A duplicate rank (rank 0 is live at another address).
  s = cluster.StartExpert(0, dir, "", "held by a live worker");
  EXPECT_TRUE(s.ok()) << s << cluster.DumpLogs();
  // The cluster still serves.
  ExpectMatchesEngine(&cluster, dir, 1, 1, 4096);
}

TEST(UcxCluster, OverlappingExpertsAreRefused) {
  TempDir tmp;
  const std::string dir = testing::WritePreset(tmp, "default");
  ProcessCluster cluster(tmp.path());
  ClusterSpec spec{dir, 1, 2, {"0-9", "10-15"}};
  absl::Status started = cluster.Start(spec);
  ASSERT_TRUE(started.ok()) << started << cluster.DumpLogs();
  cluster.KillExpert(1);
  absl::SleepFor(absl::Seconds(3));  // rank 1's lease (2 s) runs out; its experts are free
  // A replacement claiming experts that rank 0 holds is refused.
  absl::Status s = cluster.StartExpert(1, dir, "8-15", "overlap");
  EXPECT_TRUE(s.ok()) << s << cluster.DumpLogs();
}

// Kills an expert while a long request runs: the request fails with UNAVAILABLE within
// 5 s, never a hang; the expert comes back on its address and registers again, and the
// cluster serves correct results without restarting anything else.
TEST(UcxCluster, KilledExpertFailsInFlightThenRecovers) {
  TempDir tmp;
  const std::string dir = testing::WritePreset(tmp, "default");
  ProcessCluster cluster(tmp.path());
  ClusterSpec spec{dir, 2, 2, {}};
  absl::Status started = cluster.Start(spec);
  ASSERT_TRUE(started.ok()) << started << cluster.DumpLogs();
  GenerateResult long_run;
  std::thread client([&] {
    // Long enough to be in flight when the expert dies.
    long_run = cluster.Generate(0, "long", Prompt(1, 4096), 3000, absl::Seconds(60));
  });
  absl::SleepFor(absl::Milliseconds(300));
  const absl::Time killed_at = absl::Now();
  cluster.KillExpert(1);
  client.join();
  const absl::Duration took = absl::Now() - killed_at;
  EXPECT_EQ(long_run.status.error_code(), grpc::StatusCode::UNAVAILABLE)
      << long_run.status.error_message() << cluster.DumpLogs();
  EXPECT_LT(took, absl::Seconds(5));
  EXPECT_FALSE(long_run.tokens.empty()) << "the request should have been running";

  ASSERT_TRUE(cluster.StartExpert(1, dir, "").ok()) << cluster.DumpLogs();
  ASSERT_TRUE(cluster.WaitReady(absl::Seconds(30)).ok()) << cluster.DumpLogs();
  ExpectMatchesEngine(&cluster, dir, 2, 2, 4096);
}

}  // namespace
}  // namespace dxs
