// BalancedPlacement (router/control_plane/eplb.h): the placement EPLB computes from measured
// expert load, on Zipf-skewed loads like `dxs gen-model --router-skew` makes.
#include "router/control_plane/eplb.h"

#include <cmath>
#include <cstdio>
#include <set>
#include <vector>

#include "gtest/gtest.h"

namespace dxs {
namespace {

// Tokens per expert when popularity follows Zipf(s): expert e gets a share ~ 1 / (e+1)^s.
std::vector<double> ZipfLoad(int experts, double s, double tokens = 1e6) {
  std::vector<double> w(experts);
  double sum = 0;
  for (int e = 0; e < experts; ++e) sum += w[e] = 1 / std::pow(e + 1, s);
  for (double& x : w) x = std::round(tokens * x / sum);
  return w;
}

void ExpectWellFormed(const Placement& p, int experts, int ranks, int redundant) {
  ASSERT_EQ(p.num_experts(), experts);
  ASSERT_EQ(p.num_ranks(), ranks);
  EXPECT_EQ(p.num_slots(), experts + redundant);
  const int most = (experts + redundant + ranks - 1) / ranks;
  for (int e = 0; e < experts; ++e) {
    const std::vector<int>& r = p.replicas(e);
    ASSERT_FALSE(r.empty()) << "expert " << e;
    EXPECT_EQ(std::set<int>(r.begin(), r.end()).size(), r.size()) << "expert " << e;
  }
  for (int r = 0; r < ranks; ++r) {
    // Slots stay even: at most one over the even share, where packing had to.
    EXPECT_LE(static_cast<int>(p.experts_of(r).size()), most + 1) << "rank " << r;
  }
}

TEST(Eplb, PackingAloneBalancesAModestSkew) {
  const std::vector<double> load = ZipfLoad(128, 1.0);
  const double contiguous = BalanceRatio(RankLoads(Placement::Contiguous(128, 4), load));
  absl::StatusOr<Placement> p = BalancedPlacement(load, 4, 0);
  ASSERT_TRUE(p.ok()) << p.status();
  ExpectWellFormed(*p, 128, 4, 0);
  const double balanced = BalanceRatio(RankLoads(*p, load));
  std::printf("Zipf 1.0, 128 experts, 4 ranks: balance ratio contiguous %.3f, EPLB R=0 %.3f\n",
              contiguous, balanced);
  EXPECT_LT(contiguous, 0.6);  // the popular experts are one rank's contiguous block
  EXPECT_GE(balanced, 0.95) << "contiguous " << contiguous;
}

TEST(Eplb, ReplicasOfTheHottestExpertsBalanceAStrongSkew) {
  // Zipf 1.5: expert 0 alone has more than a quarter of the tokens, so no packing of
  // single copies can even 4 ranks out; replicas of the hottest can.
  const std::vector<double> load = ZipfLoad(128, 1.5);
  absl::StatusOr<Placement> single = BalancedPlacement(load, 4, 0);
  ASSERT_TRUE(single.ok());
  EXPECT_LT(BalanceRatio(RankLoads(*single, load)), 0.9);
  for (int redundant : {4, 8, 32, 128}) {
    SCOPED_TRACE(redundant);
    absl::StatusOr<Placement> p = BalancedPlacement(load, 4, redundant);
    ASSERT_TRUE(p.ok()) << p.status();
    ExpectWellFormed(*p, 128, 4, redundant);
    const double ratio = BalanceRatio(RankLoads(*p, load));
    std::printf("Zipf 1.5, 128 experts, 4 ranks, R=%d: balance ratio %.3f (R=0: %.3f)\n", redundant,
                ratio, BalanceRatio(RankLoads(*single, load)));
    EXPECT_GE(ratio, 0.9);
    EXPECT_GT(p->num_replicas(0), 1);  // the hottest expert is replicated
  }
}

TEST(Eplb, FullCoverAndEveryRankHoldingEverything) {
  const std::vector<double> load = ZipfLoad(16, 1.2);
  // R = E: not necessarily every expert twice (load decides), but well formed.
  absl::StatusOr<Placement> p = BalancedPlacement(load, 2, 16);
  ASSERT_TRUE(p.ok()) << p.status();
  ExpectWellFormed(*p, 16, 2, 16);
  // R = E * (N - 1): every rank holds every expert.
  absl::StatusOr<Placement> all = BalancedPlacement(load, 3, 32);
  ASSERT_TRUE(all.ok()) << all.status();
  for (int e = 0; e < 16; ++e) EXPECT_EQ(all->num_replicas(e), 3);
  EXPECT_DOUBLE_EQ(BalanceRatio(RankLoads(*all, load)), 1.0);
}

TEST(Eplb, DeterministicAndEvenWithoutLoad) {
  const std::vector<double> zero(12, 0.0);
  absl::StatusOr<Placement> a = BalancedPlacement(zero, 3, 3, 7);
  absl::StatusOr<Placement> b = BalancedPlacement(zero, 3, 3, 7);
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_EQ(a->DebugString(), b->DebugString());
  EXPECT_EQ(a->version(), 7u);
  ExpectWellFormed(*a, 12, 3, 3);
  for (int r = 0; r < 3; ++r) EXPECT_EQ(a->experts_of(r).size(), 5u);
  EXPECT_DOUBLE_EQ(BalanceRatio(RankLoads(*a, zero)), 1.0);
}

TEST(Eplb, BadInputIsInvalidArgument) {
  EXPECT_EQ(BalancedPlacement({}, 2, 0).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(BalancedPlacement({1, 2}, 0, 0).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(BalancedPlacement({1, -2}, 2, 0).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(BalancedPlacement({1, NAN}, 2, 0).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(BalancedPlacement({1, 2}, 2, 3).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(BalancedPlacement({1, 2}, 2, -1).status().code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace dxs
