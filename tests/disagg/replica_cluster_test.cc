// Redundant experts on a real cluster (dxs-router --num-redundant-experts R, dxs-attention
// and dxs-expert processes over gRPC and UCX): outputs equal the single-process engine
// token for token and in first-token logits, whatever the placement with replicas; the
// expert workers load their replicas and the replicas compute.
#include <set>
#include <thread>

#include "absl/strings/str_cat.h"
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

// R = E on two EP ranks: every expert on both, and each token goes whole to one of them.
TEST(ReplicaCluster, EveryExpertOnBothRanks) {
  TempDir tmp;
  const std::string dir = testing::WritePreset(tmp, "default");
  ProcessCluster cluster(tmp.path());
  cluster.set_router_args({"--num-redundant-experts", "16"});
  ClusterSpec spec{dir, 2, 2, {}};
  absl::Status started = cluster.Start(spec);
  ASSERT_TRUE(started.ok()) << started << cluster.DumpLogs();
  testing::ExpectClusterMatchesEngine(&cluster, dir, 2, 4, 4096);
  for (int rank = 0; rank < 2; ++rank) {
    const std::map<int, double> tokens = testing::ExpertTokens(cluster, rank);
    EXPECT_EQ(tokens.size(), 16u) << "EP rank " << rank << " holds every expert";
    // The replicas outside the rank's own contiguous block computed too.
    double replica_rows = 0;
    for (const auto& [e, n] : tokens) {
      if ((e < 8) != (rank == 0)) replica_rows += n;
    }
    EXPECT_GT(replica_rows, 0) << "EP rank " << rank;
  }
  // The router's view: 16 copies on each rank, 8 of them replicas.
  absl::StatusOr<std::string> text = testing::Scrape(cluster.router_metrics_address());
  ASSERT_TRUE(text.ok()) << text.status();
  const std::map<std::string, double> router = testing::ParseSamples(*text);
  for (const char* rank : {"0", "1"}) {
    EXPECT_EQ(testing::Value(router, absl::StrCat(R"(dxs_placement_experts{rank=")", rank, "\"}")),
              16);
    EXPECT_EQ(testing::Value(router, absl::StrCat(R"(dxs_placement_replicas{rank=")", rank, "\"}")),
              8);
  }
  EXPECT_GT(testing::Value(router, "dxs_placement_version"), 0);
}

// Uneven: 12 experts on 3 ranks with 5 redundant slots (some experts have two copies,
// some one), top-3 routing, one DP rank.
TEST(ReplicaCluster, UnevenRedundantSlots) {
  TempDir tmp;
  const std::string dir = testing::WritePreset(tmp, "odd");
  ProcessCluster cluster(tmp.path());
  cluster.set_router_args({"--num-redundant-experts", "5"});
  ClusterSpec spec{dir, 1, 3, {}};
  absl::Status started = cluster.Start(spec);
  ASSERT_TRUE(started.ok()) << started << cluster.DumpLogs();
  testing::ExpectClusterMatchesEngine(&cluster, dir, 1, 3, 3001);
  size_t slots = 0;
  for (int rank = 0; rank < 3; ++rank) slots += testing::ExpertTokens(cluster, rank).size();
  EXPECT_EQ(slots, 12u + 5u);
  absl::StatusOr<std::string> text = testing::Scrape(cluster.router_metrics_address());
  ASSERT_TRUE(text.ok()) << text.status();
  const std::map<std::string, double> router = testing::ParseSamples(*text);
  EXPECT_EQ(testing::SumOf(router, "dxs_placement_experts"), 17);
  EXPECT_EQ(testing::SumOf(router, "dxs_placement_replicas"), 5);
}

// More redundant slots than the ranks can hold: the router refuses to start.
TEST(ReplicaCluster, TooManyRedundantExpertsIsRefused) {
  TempDir tmp;
  const std::string dir = testing::WritePreset(tmp, "default");
  ProcessCluster cluster(tmp.path());
  cluster.set_router_args({"--num-redundant-experts", "17"});
  ClusterSpec spec{dir, 1, 2, {}};
  absl::Status started = cluster.StartRouter(spec, absl::Seconds(10));
  EXPECT_FALSE(started.ok());
  EXPECT_NE(started.message().find("num_redundant_experts must be in 0..16"), std::string::npos)
      << started;
}

}  // namespace
}  // namespace dxs
