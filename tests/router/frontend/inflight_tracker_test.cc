// InflightTracker: admission order of refusals, least-outstanding-tokens placement and
// pinning, token accounting, and stops (abort, lost rank, shutdown) reaching the cancel
// callback exactly when attached.
#include "router/frontend/inflight_tracker.h"

#include <vector>

#include "gtest/gtest.h"

namespace dxs {
namespace {

std::vector<RankCandidate> AllEligible(int n) {
  std::vector<RankCandidate> c(n);
  for (int r = 0; r < n; ++r) {
    c[r].eligible = true;
    c[r].incarnation = 10 + r;
  }
  return c;
}

TEST(InflightTracker, PicksLeastOutstandingTokens) {
  InflightTracker t(3, 100);
  const auto c = AllEligible(3);
  EXPECT_EQ(*t.Admit("a", 100, std::nullopt, c), 0);
  EXPECT_EQ(*t.Admit("b", 50, std::nullopt, c), 1);
  EXPECT_EQ(*t.Admit("c", 10, std::nullopt, c), 2);
  EXPECT_EQ(*t.Admit("d", 10, std::nullopt, c), 2);  // 20 < 50 < 100
  t.RecordTokens("a", 95, absl::Now());              // rank 0 owes 5 now
  EXPECT_EQ(*t.Admit("e", 1, std::nullopt, c), 0);
  const std::vector<RankTraffic> traffic = t.Traffic(absl::Now());
  EXPECT_EQ(traffic[0].num_outstanding_tokens, 6);
  EXPECT_EQ(traffic[0].num_requests, 2);
  EXPECT_EQ(traffic[1].num_outstanding_tokens, 50);
  EXPECT_EQ(traffic[2].num_outstanding_tokens, 20);
  EXPECT_GT(traffic[0].tokens_per_second, 0);
  t.Release("a");
  t.Release("e");
  EXPECT_EQ(t.Traffic(absl::Now())[0].num_outstanding_tokens, 0);
  EXPECT_EQ(t.size(), 3u);
}

TEST(InflightTracker, TiesGoToFewerRequestsThenLowerRank) {
  InflightTracker t(2, 100);
  const auto c = AllEligible(2);
  EXPECT_EQ(*t.Admit("a", 0, std::nullopt, c), 0);
  EXPECT_EQ(*t.Admit("b", 0, std::nullopt, c), 1);
  EXPECT_EQ(*t.Admit("c", 0, std::nullopt, c), 0);
}

TEST(InflightTracker, PinningAndIneligibleRanks) {
  InflightTracker t(2, 100);
  auto c = AllEligible(2);
  EXPECT_EQ(*t.Admit("a", 1000, 0, c), 0);
  EXPECT_EQ(*t.Admit("b", 1000, 0, c), 0);  // pinned, whatever the load
  c[1].eligible = false;
  c[1].why_not = "state DEAD";
  EXPECT_EQ(*t.Admit("c", 1, std::nullopt, c), 0);  // the only eligible rank
  absl::StatusOr<int> pinned = t.Admit("d", 1, 1, c);
  EXPECT_EQ(pinned.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_NE(pinned.status().message().find("state DEAD"), std::string::npos);
  c[0].eligible = false;
  EXPECT_EQ(t.Admit("e", 1, std::nullopt, c).status().code(), absl::StatusCode::kUnavailable);
}

TEST(InflightTracker, DuplicatesAndCapacity) {
  InflightTracker t(1, 2);
  const auto c = AllEligible(1);
  ASSERT_TRUE(t.Admit("a", 1, std::nullopt, c).ok());
  EXPECT_EQ(t.Admit("a", 1, std::nullopt, c).status().code(), absl::StatusCode::kAlreadyExists);
  ASSERT_TRUE(t.Admit("b", 1, std::nullopt, c).ok());
  EXPECT_EQ(t.Admit("c", 1, std::nullopt, c).status().code(), absl::StatusCode::kResourceExhausted);
  // A duplicate is a duplicate even when full.
  EXPECT_EQ(t.Admit("b", 1, std::nullopt, c).status().code(), absl::StatusCode::kAlreadyExists);
  t.Release("a");
  EXPECT_TRUE(t.Admit("c", 1, std::nullopt, c).ok());
  EXPECT_EQ(*t.RankOf("c"), 0);
  EXPECT_EQ(t.RankOf("a").status().code(), absl::StatusCode::kNotFound);
}

TEST(InflightTracker, StopsReachTheAttachedCallback) {
  InflightTracker t(2, 10);
  const auto c = AllEligible(2);
  ASSERT_TRUE(t.Admit("early", 1, 0, c).ok());
  // Stopped before the upstream call exists: the cancel runs as soon as it is attached.
  EXPECT_TRUE(t.Stop("early", StopReason::kAbort));
  int early_cancels = 0;
  EXPECT_EQ(t.AttachUpstream("early", [&] { ++early_cancels; }), StopReason::kAbort);
  EXPECT_EQ(early_cancels, 1);

  ASSERT_TRUE(t.Admit("x", 1, 0, c).ok());
  ASSERT_TRUE(t.Admit("y", 1, 1, c).ok());
  int x_cancels = 0, y_cancels = 0;
  EXPECT_EQ(t.AttachUpstream("x", [&] { ++x_cancels; }), StopReason::kNone);
  EXPECT_EQ(t.AttachUpstream("y", [&] { ++y_cancels; }), StopReason::kNone);
  // Rank 1's worker was replaced (new incarnation); rank 0's is unchanged.
  EXPECT_EQ(t.StopLostRanks({10, 99}), 1);
  EXPECT_EQ(x_cancels, 0);
  EXPECT_EQ(y_cancels, 1);
  EXPECT_EQ(t.stop_reason("y"), StopReason::kRankLost);
  EXPECT_EQ(t.StopLostRanks({10, 99}), 0);  // already stopped

  t.DetachUpstream("x");
  t.StopAll(StopReason::kShutdown);
  EXPECT_EQ(x_cancels, 0);  // detached: nothing to cancel
  EXPECT_EQ(t.stop_reason("x"), StopReason::kShutdown);
  EXPECT_EQ(t.stop_reason("y"), StopReason::kRankLost);  // the first reason sticks
  EXPECT_FALSE(t.Stop("unknown", StopReason::kAbort));
}

}  // namespace
}  // namespace dxs
