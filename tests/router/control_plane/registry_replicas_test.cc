// ClusterRegistry with redundant experts (ClusterRegistryOptions::num_redundant_experts):
// default claims are Placement::WithRedundantExperts's blocks, the published placement
// lists every replica (distinct ranks, every expert covered), overlapping claims are
// replicas, and R = 0 publishes exactly what it did before replicas.
#include <algorithm>
#include <set>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "dataplane/dispatch/placement.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "router/control_plane/cluster_registry.h"

namespace dxs {
namespace {

using ::testing::HasSubstr;

ClusterRegistryOptions Options(int n, int e, int r) {
  ClusterRegistryOptions o;
  o.num_attention_ranks = 1;
  o.num_expert_ranks = n;
  o.num_experts = e;
  o.num_redundant_experts = r;
  o.transport_backend = "inproc";
  return o;
}

v1::RegisterRequest Expert(uint32_t rank, const std::vector<uint32_t>& experts = {}) {
  v1::RegisterRequest req;
  req.set_role(v1::ROLE_EXPERT);
  req.set_rank(rank);
  req.set_grpc_address(absl::StrCat("127.0.0.1:", 7000 + rank));
  for (uint32_t e : experts) req.add_loaded_experts(e);
  return req;
}

std::vector<std::vector<int>> Replicas(const v1::ExpertPlacement& p) {
  std::vector<std::vector<int>> out;
  for (const v1::ExpertReplicas& r : p.expert_to_rank()) {
    out.emplace_back(r.ep_ranks().begin(), r.ep_ranks().end());
  }
  return out;
}

TEST(RegistryReplicasTest, DefaultClaimsFollowTheRedundantPlacement) {
  for (auto [n, e, r] : {std::tuple{2, 16, 16}, {2, 16, 5}, {4, 12, 7}, {3, 8, 16}}) {
    const std::string what = absl::StrCat("N=", n, " E=", e, " R=", r);
    ClusterRegistry reg(Options(n, e, r));
    for (int rank = 0; rank < n; ++rank) {
      absl::StatusOr<v1::RegisterResponse> resp = reg.Register(Expert(rank));
      ASSERT_TRUE(resp.ok()) << what << ": " << resp.status();
    }
    const v1::ExpertPlacement p = reg.View().placement();
    const Placement want = *Placement::WithRedundantExperts(e, n, r);
    int slots = 0;
    const std::vector<std::vector<int>> got = Replicas(p);
    ASSERT_EQ(static_cast<int>(got.size()), e) << what;
    for (int x = 0; x < e; ++x) {
      // The primary (its contiguous block's rank) first, then the others ascending.
      std::vector<int> expect = want.replicas(x);
      std::sort(expect.begin() + 1, expect.end());
      EXPECT_EQ(got[x], expect) << what << " expert " << x;
      EXPECT_EQ(got[x][0], Placement::Contiguous(e, n).owner(x)) << what;
      EXPECT_EQ(std::set<int>(got[x].begin(), got[x].end()).size(), got[x].size()) << what;
      slots += static_cast<int>(got[x].size());
    }
    EXPECT_EQ(slots, e + r) << what;
    if (r >= e) {
      for (int x = 0; x < e; ++x) EXPECT_GE(got[x].size(), 2u) << what << " expert " << x;
    }
    EXPECT_GT(p.version(), 0u);
    // The data path's view of it.
    absl::StatusOr<Placement> parsed = Placement::FromExpertRanks(n, got, p.version());
    ASSERT_TRUE(parsed.ok()) << parsed.status();
    EXPECT_EQ(parsed->num_slots(), e + r);
  }
}

TEST(RegistryReplicasTest, ZeroRedundantPublishesOneOwnerEach) {
  ClusterRegistry reg(Options(2, 16, 0));
  ASSERT_TRUE(reg.Register(Expert(0)).ok());
  ASSERT_TRUE(reg.Register(Expert(1)).ok());
  const std::vector<std::vector<int>> got = Replicas(reg.View().placement());
  for (int x = 0; x < 16; ++x) EXPECT_EQ(got[x], std::vector<int>{x < 8 ? 0 : 1});
  // Overlaps are still refused.
  ClusterRegistry other(Options(2, 16, 0));
  ASSERT_TRUE(other.Register(Expert(0, {0, 1, 2, 3, 4, 5, 6, 7, 8})).ok());
  absl::StatusOr<v1::RegisterResponse> refused =
      other.Register(Expert(1, {8, 9, 10, 11, 12, 13, 14, 15}));
  ASSERT_FALSE(refused.ok());
  EXPECT_THAT(std::string(refused.status().message()), HasSubstr("overlapping"));
}

TEST(RegistryReplicasTest, OverlappingClaimsAreReplicas) {
  ClusterRegistry reg(Options(2, 4, 2));
  ASSERT_TRUE(reg.Register(Expert(0, {0, 1, 2})).ok());
  ASSERT_TRUE(reg.Register(Expert(1, {2, 3, 0})).ok());
  // Primaries first: experts 0-1 are rank 0's block, 2-3 rank 1's.
  EXPECT_EQ(Replicas(reg.View().placement()),
            (std::vector<std::vector<int>>{{0, 1}, {0}, {1, 0}, {1}}));
  // Coverage is still required of the last rank.
  ClusterRegistry gap(Options(2, 4, 2));
  ASSERT_TRUE(gap.Register(Expert(0, {0, 1})).ok());
  absl::StatusOr<v1::RegisterResponse> refused = gap.Register(Expert(1, {0, 1, 2}));
  ASSERT_FALSE(refused.ok());
  EXPECT_THAT(std::string(refused.status().message()), HasSubstr("experts missing: 3"));
}

// EPLB's publish step: SetPlacement makes each EP rank's claim its experts in the new
// placement and bumps the placement version once; refused while an EP rank is not live or
// for a placement of another shape.
TEST(RegistryReplicasTest, SetPlacementPublishesTheNewMap) {
  ClusterRegistry reg(Options(2, 4, 1));
  ASSERT_TRUE(reg.Register(Expert(0)).ok());
  const Placement balanced = *Placement::FromExpertRanks(2, {{1}, {0, 1}, {0}, {0}}, 7);
  absl::StatusOr<v1::ClusterView> refused = reg.SetPlacement(balanced);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kFailedPrecondition) << refused.status();
  ASSERT_TRUE(reg.Register(Expert(1)).ok());
  const v1::ClusterView before = reg.View();
  absl::StatusOr<v1::ClusterView> view = reg.SetPlacement(balanced);
  ASSERT_TRUE(view.ok()) << view.status();
  EXPECT_EQ(view->version(), before.version() + 1);
  EXPECT_EQ(view->placement().version(), before.placement().version() + 1);
  std::vector<std::vector<int>> got = Replicas(view->placement());
  for (auto& ranks : got) std::sort(ranks.begin(), ranks.end());
  EXPECT_EQ(got, (std::vector<std::vector<int>>{{1}, {0, 1}, {0}, {0}}));
  // The same map again changes nothing but the view version.
  absl::StatusOr<v1::ClusterView> again = reg.SetPlacement(balanced);
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(again->placement().version(), view->placement().version());
  EXPECT_EQ(reg.SetPlacement(*Placement::FromExpertRanks(3, {{0}, {1}, {2}, {0}})).status().code(),
            absl::StatusCode::kInvalidArgument);
  // A restarted EP rank without a claim takes its experts of the published placement back.
  v1::DeregisterRequest leave;
  leave.mutable_worker()->set_role(v1::ROLE_EXPERT);
  leave.mutable_worker()->set_rank(1);
  ASSERT_TRUE(reg.Deregister(leave).ok());
  absl::StatusOr<v1::RegisterResponse> back = reg.Register(Expert(1));
  ASSERT_TRUE(back.ok()) << back.status();
  got = Replicas(back->placement());
  for (auto& ranks : got) std::sort(ranks.begin(), ranks.end());
  EXPECT_EQ(got, (std::vector<std::vector<int>>{{1}, {0, 1}, {0}, {0}}));
}

TEST(RegistryReplicasTest, ValidatesTheCount) {
  EXPECT_TRUE(Options(2, 16, 16).Validate().ok());
  EXPECT_FALSE(Options(2, 16, 17).Validate().ok());
  EXPECT_FALSE(Options(2, 16, -1).Validate().ok());
  absl::Status one_rank = Options(1, 16, 1).Validate();
  EXPECT_FALSE(one_rank.ok());
  EXPECT_THAT(std::string(one_rank.message()), HasSubstr("num_redundant_experts must be in 0..0"));
}

}  // namespace
}  // namespace dxs
