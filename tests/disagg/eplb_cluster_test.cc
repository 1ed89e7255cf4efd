// EPLB live on a real cluster (dxs-router --enable-eplb / ControlPlane.Rebalance, dxs-attention
// and dxs-expert processes over gRPC and UCX): rebalancing under concurrent streams leaves
// every output equal to a solo run of the single-process engine, and a rebalance by hand
// bumps the placement version and puts BalancedPlacement's map of the measured load in
// effect (the experts' new ranks compute them).
#include <grpcpp/grpcpp.h>

#include <atomic>
#include <functional>
#include <map>
#include <thread>

#include "absl/strings/str_cat.h"
#include "dxs/v1/control_plane.grpc.pb.h"
#include "dxs/v1/expert_worker.grpc.pb.h"
#include "gtest/gtest.h"
#include "model/engine.h"
#include "model/random_checkpoint.h"
#include "router/control_plane/eplb.h"
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

// The default preset with Zipf-skewed routing, so that measured load is uneven.
std::string WriteSkewedModel(const TempDir& tmp) {
  return testing::WritePreset(tmp, "default", 1.2);
}

std::vector<int32_t> Prompt(int i) {
  std::vector<int32_t> p;
  for (int j = 0; j < 2 + (i * 7) % 13; ++j) p.push_back(5 + (i * 577 + j * 101) % (kVocab - 5));
  return p;
}

// `num_streams` streams (stream s on DP rank s % M) sending requests until `during`, run
// once they are under way, has returned; each request equals a solo run of the
// single-process engine: greedy tokens identical, first logits within 1e-5 relative.
void ExpectSoloOutputs(
    ProcessCluster* cluster, const std::string& dir, int num_attention, int num_streams,
    int max_tokens, const std::string& tag, const std::function<void()>& during = [] {}) {
  testing::ExpectConcurrentStreamsMatchEngine(cluster, dir, num_attention, num_streams, max_tokens,
                                              tag, Prompt, {}, during,
                                              /*check_first_logits=*/true);
}

std::vector<std::vector<int>> RankExperts(const v1::ClusterView& view) {
  std::vector<std::vector<int>> out(view.num_expert_ranks());
  for (int e = 0; e < view.placement().expert_to_rank_size(); ++e) {
    for (uint32_t r : view.placement().expert_to_rank(e).ep_ranks()) out[r].push_back(e);
  }
  return out;
}

double RouterCounter(const ProcessCluster& cluster, const std::string& name) {
  absl::StatusOr<std::string> text = testing::Scrape(cluster.router_metrics_address());
  EXPECT_TRUE(text.ok()) << text.status();
  return text.ok() ? testing::Value(testing::ParseSamples(*text), name) : -1;
}

// --enable-eplb every 3 steps under 32 concurrent streams: the placement changes while
// requests decode (the streams last until it has), and every output equals its solo run.
TEST(EplbCluster, LiveRebalanceUnderConcurrentStreamsKeepsOutputs) {
  TempDir tmp;
  const std::string dir = WriteSkewedModel(tmp);
  ProcessCluster cluster(tmp.path());
  cluster.set_router_args({"--num-redundant-experts", "2", "--enable-eplb", "--eplb-interval", "3",
                           "--heartbeat-ms", "50"});
  ClusterSpec spec{dir, 2, 2, {}};
  absl::Status started = cluster.Start(spec);
  ASSERT_TRUE(started.ok()) << started << cluster.DumpLogs();
  const uint64_t version_before = testing::CurrentClusterView(cluster).placement().version();
  // The streams go on until a new placement is published, so it is published while they run.
  bool switched_midway = false;
  ExpectSoloOutputs(&cluster, dir, 2, 32, 64, "live-", [&] {
    for (const absl::Time end = absl::Now() + absl::Seconds(120); absl::Now() < end;) {
      if (testing::CurrentClusterView(cluster).placement().version() > version_before) {
        switched_midway = true;
        return;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
  });
  EXPECT_TRUE(switched_midway) << "no placement was published within 120 s of streaming"
                               << cluster.DumpLogs();
  const double rebalances = RouterCounter(cluster, "dxs_eplb_rebalances_total");
  RecordProperty("rebalances", static_cast<int>(rebalances));
  EXPECT_GE(rebalances, 1) << cluster.DumpLogs();
  EXPECT_GT(testing::CurrentClusterView(cluster).placement().version(), version_before);
  // No stall: no step failed or was run again across the switches (a switch that made a
  // step wait for weights, or sent a pair to a rank without its expert, would).
  for (int r = 0; r < 2; ++r) {
    absl::StatusOr<std::string> text = testing::Scrape(cluster.attention_metrics_address(r));
    ASSERT_TRUE(text.ok()) << text.status();
    const std::map<std::string, double> samples = testing::ParseSamples(*text);
    EXPECT_GT(testing::SumOf(samples, "dxs_steps_total"), 0) << "DP rank " << r;
    EXPECT_EQ(
        testing::Value(samples,
                       absl::StrCat("dxs_failed_steps_total{role=\"attention\",rank=\"", r, "\"}")),
        0)
        << "DP rank " << r << cluster.DumpLogs();
  }
  // And after the switches settled, once more.
  ExpectSoloOutputs(&cluster, dir, 2, 4, 6, "after-");
}

// ControlPlane.Rebalance (dxs rebalance) on one DP and two EP ranks: the version goes up
// by one, the map is BalancedPlacement's of the load the experts counted, the new holders
// compute, and outputs still equal the engine's.
TEST(EplbCluster, RebalanceByHandPublishesBalancedPlacement) {
  TempDir tmp;
  const std::string dir = WriteSkewedModel(tmp);
  ProcessCluster cluster(tmp.path());
  ClusterSpec spec{dir, 1, 2, {}};
  absl::Status started = cluster.Start(spec);
  ASSERT_TRUE(started.ok()) << started << cluster.DumpLogs();
  ExpectSoloOutputs(&cluster, dir, 1, 6, 6, "warm-");
  std::vector<double> load(kNumExperts, 0);
  for (int r = 0; r < 2; ++r) {
    for (const auto& [e, n] : testing::ExpertTokens(cluster, r)) load[e] += n;
  }
  const v1::ClusterView before = testing::CurrentClusterView(cluster);

  auto cp = v1::ControlPlane::NewStub(
      grpc::CreateChannel(cluster.router_address(), grpc::InsecureChannelCredentials()));
  grpc::ClientContext ctx;
  v1::RebalanceResponse response;
  grpc::Status s = cp->Rebalance(&ctx, v1::RebalanceRequest(), &response);
  ASSERT_TRUE(s.ok()) << s.error_message() << cluster.DumpLogs();

  absl::StatusOr<Placement> want = BalancedPlacement(load, 2, 0, before.placement().version() + 1);
  ASSERT_TRUE(want.ok()) << want.status();
  const v1::ClusterView after = testing::CurrentClusterView(cluster);
  const std::vector<std::vector<int>> got = RankExperts(after);
  const bool moves = got.size() == 2 && (RankExperts(before)[0] != want->experts_of(0) ||
                                         RankExperts(before)[1] != want->experts_of(1));
  ASSERT_TRUE(moves) << "the skewed load should move experts";
  EXPECT_EQ(response.placement_version(), before.placement().version() + 1);
  EXPECT_EQ(after.placement().version(), before.placement().version() + 1);
  EXPECT_EQ(got[0], want->experts_of(0));
  EXPECT_EQ(got[1], want->experts_of(1));
  EXPECT_GT(response.experts_moved(), 0u);
  EXPECT_GE(response.balance_ratio_after(), response.balance_ratio_before());
  EXPECT_EQ(RouterCounter(cluster, "dxs_eplb_rebalances_total"), 1);
  EXPECT_EQ(RouterCounter(cluster, "dxs_eplb_experts_moved_total"), response.experts_moved());
  absl::StatusOr<std::string> text = testing::Scrape(cluster.router_metrics_address());
  ASSERT_TRUE(text.ok()) << text.status();
  const testing::PromtoolResult check = testing::CheckMetrics(*text);
  EXPECT_EQ(check.exit_code, 0) << check.output;
  EXPECT_EQ(check.output, "") << *text;
  // Once the attention rank runs the new placement, the EP ranks free what they no longer
  // hold: each ends with exactly its new experts resident.
  for (const v1::WorkerInfo& w : after.workers()) {
    if (w.role() != v1::ROLE_EXPERT) continue;
    const std::vector<int> resident =
        testing::WaitForResidentExperts(w, want->experts_of(static_cast<int>(w.rank())));
    EXPECT_EQ(resident, want->experts_of(static_cast<int>(w.rank()))) << "EP rank " << w.rank();
  }

  const std::map<int, double> tokens_before[2] = {testing::ExpertTokens(cluster, 0),
                                                  testing::ExpertTokens(cluster, 1)};
  ExpectSoloOutputs(&cluster, dir, 1, 6, 6, "moved-");
  // An expert that moved to a rank computes there now.
  int moved_and_computed = 0;
  const std::vector<std::vector<int>> held_before = RankExperts(before);
  for (int r = 0; r < 2; ++r) {
    const std::map<int, double> tokens = testing::ExpertTokens(cluster, r);
    for (int e : want->experts_of(r)) {
      const std::vector<int>& old = held_before[r];
      if (std::find(old.begin(), old.end(), e) != old.end()) continue;
      auto it = tokens.find(e);
      auto was = tokens_before[r].find(e);
      const double was_n = was == tokens_before[r].end() ? 0 : was->second;
      if (it != tokens.end() && it->second > was_n) ++moved_and_computed;
    }
  }
  EXPECT_GT(moved_and_computed, 0);

  // The same by hand from the command line, and `dxs status` shows the placement.
  const std::string out =
      cluster.RunDxs(absl::StrCat("rebalance --router ", cluster.router_address()));
  EXPECT_EQ(out.rfind("placement v", 0), 0u) << out;
  const uint64_t version = testing::CurrentClusterView(cluster).placement().version();
  EXPECT_GE(version, after.placement().version());
  const std::string status =
      cluster.RunDxs(absl::StrCat("status --router ", cluster.router_address()));
  EXPECT_NE(status.find(absl::StrCat("placement v", version, "\n")), std::string::npos) << status;
  EXPECT_NE(status.find("  ep 1: "), std::string::npos) << status;
}

// Before every rank is up there is nothing to rebalance: FAILED_PRECONDITION.
TEST(EplbCluster, RebalanceOfAnIncompleteClusterIsAFailedPrecondition) {
  TempDir tmp;
  const std::string dir = testing::WritePreset(tmp, "default");
  ProcessCluster cluster(tmp.path());
  ClusterSpec spec{dir, 1, 2, {}};
  absl::Status started = cluster.StartRouter(spec, absl::Seconds(30));
  ASSERT_TRUE(started.ok()) << started << cluster.DumpLogs();
  auto cp = v1::ControlPlane::NewStub(
      grpc::CreateChannel(cluster.router_address(), grpc::InsecureChannelCredentials()));
  grpc::ClientContext ctx;
  v1::RebalanceResponse response;
  const grpc::Status s = cp->Rebalance(&ctx, v1::RebalanceRequest(), &response);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::FAILED_PRECONDITION) << s.error_message();
}

}  // namespace
}  // namespace dxs
