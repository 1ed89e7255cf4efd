// Elastic EP on a real cluster (dxs-router --elastic-ep; dxs-attention and dxs-expert
// processes over gRPC and UCX), under concurrent streams:
//  - an EP rank is killed while every expert it held has a replica on the other rank: no
//    request fails, and every output equals its solo run of the single-process engine;
//  - an EP rank holding the only copy of its experts is killed: they are reloaded on the
//    live rank, the requests wait and then finish, equal to their solo runs;
//  - `dxs drain --rank 1`: its experts move to rank 0, it exits by itself, no request fails;
//  - a new EP rank joins under 24 streams (dxs-expert --rank N): it is taken in and
//    rebalanced onto, receives tokens, and no request fails; then, under 16 streams, it is
//    drained again and exits, and no request fails.
// "Under load" holds on a machine of any speed: the streams go on sending requests until
// the event (kill, drain, join) and what it must cause (recovery, experts moved, rows on
// the new rank) has happened (testing::ExpectConcurrentStreamsMatchEngine).
#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <cstdio>
#include <functional>
#include <thread>

#include "absl/strings/str_cat.h"
#include "dxs/v1/control_plane.grpc.pb.h"
#include "dxs/v1/expert_worker.grpc.pb.h"
#include "gtest/gtest.h"
#include "model/engine.h"
#include "tests/disagg/cluster_equivalence.h"
#include "tests/disagg/metrics_util.h"
#include "tests/disagg/process_cluster.h"
#include "tests/model/test_util.h"

namespace dxs {
namespace {

using testing::ClusterSpec;
using testing::GenerateResult;
using testing::ProcessCluster;
using testing::TempDir;

constexpr int kVocab = 4096;
constexpr int kNumExperts = 16;  // the default preset

std::vector<int32_t> Prompt(int i) {
  std::vector<int32_t> p;
  for (int j = 0; j < 3 + (i * 5) % 11; ++j) p.push_back(7 + (i * 389 + j * 131) % (kVocab - 7));
  return p;
}

double RouterValue(const ProcessCluster& cluster, const std::string& name) {
  absl::StatusOr<std::string> text = testing::Scrape(cluster.router_metrics_address());
  EXPECT_TRUE(text.ok()) << text.status();
  return text.ok() ? testing::Value(testing::ParseSamples(*text), name) : -1;
}

// `num_streams` streams (stream s on DP rank s % M) sending requests until `during`, run once
// they are under way, has returned. Every request must succeed and equal its solo run.
testing::StreamsRun RunThrough(ProcessCluster* cluster, const std::string& dir, int num_attention,
                               int num_streams, int max_tokens, const std::string& tag,
                               const std::function<void()>& during) {
  return testing::ExpectConcurrentStreamsMatchEngine(cluster, dir, num_attention, num_streams,
                                                     max_tokens, tag, Prompt, {}, during);
}

std::vector<int> ExpertsOf(const v1::ClusterView& view, uint32_t rank) {
  std::vector<int> out;
  for (int e = 0; e < view.placement().expert_to_rank_size(); ++e) {
    for (uint32_t r : view.placement().expert_to_rank(e).ep_ranks()) {
      if (r == rank) out.push_back(e);
    }
  }
  return out;
}

// Polls the router's view (every 20 ms, up to `timeout`) until `done` holds; whether it did.
bool WaitForView(const ProcessCluster& cluster, absl::Duration timeout,
                 const std::function<bool(const v1::ClusterView&)>& done) {
  for (const absl::Time end = absl::Now() + timeout; absl::Now() < end;) {
    absl::StatusOr<v1::ClusterView> view = cluster.WatchClusterOnce();
    if (view.ok() && done(*view)) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return false;
}

// RunThrough with EP rank 1 killed once the streams are under way, the streams going on
// until the router has recovered from it; how long after the kill the last stream finished
// (also recorded as the test property finished_after_kill_ms).
absl::Duration RunThroughAKill(ProcessCluster* cluster, const std::string& dir, int num_attention,
                               int num_streams, const std::string& tag) {
  absl::Time killed_at;
  const testing::StreamsRun run =
      RunThrough(cluster, dir, num_attention, num_streams, 48, tag, [&] {
        killed_at = absl::Now();
        cluster->KillExpert(1);
        const bool recovered =
            WaitForView(*cluster, absl::Seconds(60),
                        [](const v1::ClusterView& v) { return ExpertsOf(v, 1).empty(); });
        EXPECT_TRUE(recovered) << "EP rank 1 still holds experts 60 s after its kill"
                               << cluster->DumpLogs();
      });
  const absl::Duration took = run.streams_ended - killed_at;
  ::testing::Test::RecordProperty("finished_after_kill_ms",
                                  static_cast<int>(absl::ToInt64Milliseconds(took)));
  return took;
}

std::vector<int> AllExperts() {
  std::vector<int> all;
  for (int e = 0; e < kNumExperts; ++e) all.push_back(e);
  return all;
}

TEST(ElasticCluster, KilledExpertWithReplicasFailsNoRequest) {
  TempDir tmp;
  const std::string dir = testing::WritePreset(tmp, "default");
  ProcessCluster cluster(tmp.path());
  // Every expert on both EP ranks.
  cluster.set_router_args(
      {"--elastic-ep", "--num-redundant-experts", "16", "--heartbeat-ms", "100"});
  ClusterSpec spec{dir, 2, 2, {}};
  absl::Status started = cluster.Start(spec);
  ASSERT_TRUE(started.ok()) << started << cluster.DumpLogs();
  RunThroughAKill(&cluster, dir, 2, 8, "covered-");
  const v1::ClusterView view = testing::CurrentClusterView(cluster);
  EXPECT_EQ(ExpertsOf(view, 0), AllExperts());
  EXPECT_TRUE(ExpertsOf(view, 1).empty());
  EXPECT_EQ(RouterValue(cluster, "dxs_eplb_recoveries_total"), 1) << cluster.DumpLogs();
  // And the cluster serves on with one EP rank.
  RunThrough(&cluster, dir, 2, 2, 4, "after-", [] {});
}

// Was disabled (hung in about one run of three on UCX 1.13, before the switch to 1.22 and
// before a dispatch whose placement holds a failed EP rank sent nothing to anyone). On
// this tree both ways the failure is seen (at the dispatch header, and in the combine wait
// of a round the dead rank had taken) recover: over 70 runs, up to 3 copies at once or beside 3
// busy loops on 2 cores, 24 streams with the kill at random times included.
TEST(ElasticCluster, KilledExpertWithoutReplicaIsReloadedAndRequestsWait) {
  TempDir tmp;
  const std::string dir = testing::WritePreset(tmp, "default");
  ProcessCluster cluster(tmp.path());
  cluster.set_router_args({"--elastic-ep", "--heartbeat-ms", "100"});
  ClusterSpec spec{dir, 1, 2, {}};
  absl::Status started = cluster.Start(spec);
  ASSERT_TRUE(started.ok()) << started << cluster.DumpLogs();
  const absl::Duration took = RunThroughAKill(&cluster, dir, 1, 6, "uncovered-");
  EXPECT_LT(took, absl::Seconds(10)) << cluster.DumpLogs();
  const v1::ClusterView view = testing::CurrentClusterView(cluster);
  EXPECT_EQ(ExpertsOf(view, 0), AllExperts());
  EXPECT_EQ(RouterValue(cluster, "dxs_eplb_recoveries_total"), 1) << cluster.DumpLogs();
  const double seconds = RouterValue(cluster, "dxs_eplb_recovery_duration_seconds_sum");
  RecordProperty("recovery_ms", static_cast<int>(seconds * 1000));
  EXPECT_GT(seconds, 0);
  EXPECT_LT(seconds, 10);
  absl::StatusOr<std::string> text = testing::Scrape(cluster.router_metrics_address());
  ASSERT_TRUE(text.ok()) << text.status();
  const testing::PromtoolResult check = testing::CheckMetrics(*text);
  EXPECT_EQ(check.exit_code, 0) << check.output;
}

TEST(ElasticCluster, DrainMovesExpertsOffThenTheRankExits) {
  TempDir tmp;
  const std::string dir = testing::WritePreset(tmp, "default");
  ProcessCluster cluster(tmp.path());
  cluster.set_router_args({"--elastic-ep", "--heartbeat-ms", "100"});
  ClusterSpec spec{dir, 1, 2, {}};
  absl::Status started = cluster.Start(spec);
  ASSERT_TRUE(started.ok()) << started << cluster.DumpLogs();
  std::string drain_out;
  RunThrough(&cluster, dir, 1, 6, 48, "drain-", [&] {
    drain_out = cluster.RunDxs("drain --router " + cluster.router_address() + " --rank 1");
    // The streams go on until the experts have moved off.
    const bool moved = WaitForView(cluster, absl::Seconds(60), [](const v1::ClusterView& v) {
      return ExpertsOf(v, 1).empty();
    });
    EXPECT_TRUE(moved) << "EP rank 1 still holds experts 60 s after the drain"
                       << cluster.DumpLogs();
  });
  EXPECT_EQ(drain_out.rfind("expert rank 1 draining", 0), 0u) << drain_out;
  absl::StatusOr<int> exited = cluster.WaitExpertExit(1, absl::Seconds(20));
  ASSERT_TRUE(exited.ok()) << exited.status() << cluster.DumpLogs();
  EXPECT_EQ(*exited, 0);
  const v1::ClusterView view = testing::CurrentClusterView(cluster);
  EXPECT_EQ(ExpertsOf(view, 0), AllExperts());
  EXPECT_TRUE(ExpertsOf(view, 1).empty());
  // Drained, not lost: no recovery.
  EXPECT_EQ(RouterValue(cluster, "dxs_eplb_recoveries_total"), 0);
  RunThrough(&cluster, dir, 1, 2, 4, "after-", [] {});
}

// Requests running or queued on the attention ranks now.
int InFlight(ProcessCluster* cluster, int num_attention) {
  int n = 0;
  for (int r = 0; r < num_attention; ++r) {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(2));
    v1::GetLoadResponse load;
    if (cluster->attention(r)->GetLoad(&ctx, {}, &load).ok()) {
      n += static_cast<int>(load.load().num_running_requests() + load.load().num_queued_requests());
    }
  }
  return n;
}

double ExpertRowsReceived(const ProcessCluster& cluster, int rank) {
  absl::StatusOr<std::string> text = testing::Scrape(cluster.expert_metrics_address(rank));
  return text.ok() ? testing::SumOf(testing::ParseSamples(*text), "dxs_tokens_received_total") : -1;
}

// Elastic EP: a worker started with the next rank number joins a running cluster under load.
// The router grows to 3 EP ranks, the Rebalancer loads experts on the new rank (evenly: the
// tokens measured so far are the load), publishes, and the old ranks free what moved; the
// attention ranks connect to it from the view and dispatch to it once both DP ranks have the
// placement. No request fails and every output equals its solo run. Then the joined rank is
// drained under load: its experts move back, it exits, and again no request fails.
TEST(ElasticCluster, ANewExpertRankJoinsUnderLoadIsRebalancedOntoAndDrains) {
  TempDir tmp;
  const std::string dir = testing::WritePreset(tmp, "default");
  ProcessCluster cluster(tmp.path());
  cluster.set_router_args({"--elastic-ep", "--heartbeat-ms", "100"});
  ClusterSpec spec{dir, 2, 2, {}};
  absl::Status started = cluster.Start(spec);
  ASSERT_TRUE(started.ok()) << started << cluster.DumpLogs();

  // Numbers beyond the next one are refused, and the worker exits saying which would do.
  ASSERT_TRUE(cluster.StartExpert(3, dir, "", "the next one to join is rank 2").ok())
      << cluster.DumpLogs();

  absl::Duration to_placed = absl::InfiniteDuration(), to_tokens = absl::InfiniteDuration();
  int in_flight_when_placed = 0;
  RunThrough(&cluster, dir, 2, 24, 96, "join-", [&] {
    const absl::Time start = absl::Now();
    absl::Status joined = cluster.StartExpert(2, dir, "");
    ASSERT_TRUE(joined.ok()) << joined << cluster.DumpLogs();
    const bool placed = WaitForView(cluster, absl::Seconds(60), [](const v1::ClusterView& v) {
      return v.num_expert_ranks() == 3 && !ExpertsOf(v, 2).empty();
    });
    ASSERT_TRUE(placed) << cluster.DumpLogs();
    to_placed = absl::Now() - start;
    in_flight_when_placed = InFlight(&cluster, 2);
    // The streams go on until rows have been routed to it.
    for (const absl::Time end = absl::Now() + absl::Seconds(60); absl::Now() < end;) {
      if (ExpertRowsReceived(cluster, 2) > 0) {
        to_tokens = absl::Now() - start;
        break;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    ASSERT_LT(to_tokens, absl::InfiniteDuration())
        << "no rows reached the new EP rank within 60 s of its placement" << cluster.DumpLogs();
  });
  RecordProperty("join_to_placed_ms", static_cast<int>(absl::ToInt64Milliseconds(to_placed)));
  RecordProperty("join_to_first_tokens_ms", static_cast<int>(absl::ToInt64Milliseconds(to_tokens)));
  std::fprintf(stderr, "join: placed after %s, first rows after %s, %d requests in flight\n",
               absl::FormatDuration(to_placed).c_str(), absl::FormatDuration(to_tokens).c_str(),
               in_flight_when_placed);
  EXPECT_GT(in_flight_when_placed, 0) << "the join should happen under load";

  // Taken in: three EP ranks, each holding experts, every expert placed, rank 2 listed by
  // `dxs status`, and each rank's resident experts exactly its own (the moved ones freed).
  const v1::ClusterView view = testing::CurrentClusterView(cluster);
  ASSERT_EQ(view.num_expert_ranks(), 3u);
  std::vector<int> copies(kNumExperts, 0);
  for (uint32_t r = 0; r < 3; ++r) {
    EXPECT_FALSE(ExpertsOf(view, r).empty()) << "EP rank " << r;
    for (int e : ExpertsOf(view, r)) ++copies[e];
  }
  for (int e = 0; e < kNumExperts; ++e) EXPECT_GE(copies[e], 1) << "expert " << e;
  const std::string status = cluster.RunDxs("status --router " + cluster.router_address());
  EXPECT_NE(status.find("3 expert ranks"), std::string::npos) << status;
  EXPECT_NE(status.find("expert 2  READY"), std::string::npos) << status;
  EXPECT_NE(status.find("ep 2: " + std::to_string(ExpertsOf(view, 2).size()) + " experts"),
            std::string::npos)
      << status;
  for (const v1::WorkerInfo& w : view.workers()) {
    if (w.role() != v1::ROLE_EXPERT) continue;
    const std::vector<int> resident = testing::WaitForResidentExperts(w, ExpertsOf(view, w.rank()));
    EXPECT_EQ(resident, ExpertsOf(view, w.rank())) << "EP rank " << w.rank();
  }

  // It computes: in a run after the join, rows arrive at each of the three EP ranks and
  // rank 2's experts count tokens.
  double rows_before[3], tokens_before = 0;
  for (int r = 0; r < 3; ++r) rows_before[r] = ExpertRowsReceived(cluster, r);
  for (const auto& [e, tokens] : testing::ExpertTokens(cluster, 2)) tokens_before += tokens;
  RunThrough(&cluster, dir, 2, 4, 8, "joined-", [] {});
  for (int r = 0; r < 3; ++r) {
    EXPECT_GT(ExpertRowsReceived(cluster, r), rows_before[r])
        << "EP rank " << r << cluster.DumpLogs();
  }
  double tokens_after = 0;
  for (const auto& [e, tokens] : testing::ExpertTokens(cluster, 2)) tokens_after += tokens;
  EXPECT_GT(tokens_after, tokens_before);

  // Drained under load: its experts move back to ranks 0 and 1, it exits, nothing fails.
  int in_flight_when_moved = 0;
  std::string drain_out;
  RunThrough(&cluster, dir, 2, 16, 96, "drain-joined-", [&] {
    drain_out = cluster.RunDxs("drain --router " + cluster.router_address() + " --rank 2");
    const bool moved = WaitForView(cluster, absl::Seconds(60), [](const v1::ClusterView& v) {
      return ExpertsOf(v, 2).empty();
    });
    ASSERT_TRUE(moved) << cluster.DumpLogs();
    in_flight_when_moved = InFlight(&cluster, 2);
  });
  EXPECT_EQ(drain_out.rfind("expert rank 2 draining", 0), 0u) << drain_out;
  EXPECT_GT(in_flight_when_moved, 0) << "the drain should happen under load";
  absl::StatusOr<int> exited = cluster.WaitExpertExit(2, absl::Seconds(20));
  ASSERT_TRUE(exited.ok()) << exited.status() << cluster.DumpLogs();
  EXPECT_EQ(*exited, 0);
  const v1::ClusterView drained = testing::CurrentClusterView(cluster);
  std::vector<int> held;
  for (uint32_t r = 0; r < 2; ++r) {
    for (int e : ExpertsOf(drained, r)) held.push_back(e);
  }
  std::sort(held.begin(), held.end());
  held.erase(std::unique(held.begin(), held.end()), held.end());
  EXPECT_EQ(held, AllExperts());
  EXPECT_EQ(RouterValue(cluster, "dxs_eplb_recoveries_total"), 0);
  RunThrough(&cluster, dir, 2, 2, 4, "after-", [] {});
}

}  // namespace
}  // namespace dxs
