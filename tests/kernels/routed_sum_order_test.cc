#include "kernels/routed_sum_order.h"

#include <algorithm>
#include <cstdint>
#include <numeric>
#include <random>
#include <vector>

#include "gtest/gtest.h"

namespace dxs {
namespace {

// The counted pairs (expert >= 0) in a stable sort by expert: the sorted path's order.
std::vector<int> StableOrder(const std::vector<int32_t>& experts) {
  std::vector<int> order;
  for (int j = 0; j < static_cast<int>(experts.size()); ++j) {
    if (experts[j] >= 0) order.push_back(j);
  }
  std::stable_sort(order.begin(), order.end(),
                   [&](int a, int b) { return experts[a] < experts[b]; });
  return order;
}

void ExpectRanksFollowTheStableSort(const std::vector<int32_t>& experts) {
  const std::vector<int> order = StableOrder(experts);
  const int pairs = static_cast<int>(experts.size());
  for (int r = 0; r < static_cast<int>(order.size()); ++r) {
    EXPECT_EQ(RoutedSumRank(experts.data(), pairs, order[r]), r)
        << "pair " << order[r] << " of expert " << experts[order[r]];
  }
}

TEST(RoutedSumRank, DistinctExpertsInAscendingOrder) {
  ExpectRanksFollowTheStableSort({17, 3, 120, 64, 5, 99, 0, 42});
  ExpectRanksFollowTheStableSort({7});
}

TEST(RoutedSumRank, RepeatedExpertsKeepPairOrderAndMissingOnesAreLeftOut) {
  // A padded row's repeated picks, and pairs of no expert (-1) between them.
  ExpectRanksFollowTheStableSort({5, -1, 5, 2, -1, 2, 5, 0});
  ExpectRanksFollowTheStableSort({-1, 4, -1});
  const std::vector<int32_t> one_left = {-1, -1, 9, -1};
  EXPECT_EQ(RoutedSumRank(one_left.data(), 4, 2), 0);
}

TEST(RoutedSumRank, RandomRowsUpToSixteenPairs) {
  std::mt19937 rng(11);
  for (int trial = 0; trial < 2000; ++trial) {
    const int pairs = 1 + trial % 16;
    std::uniform_int_distribution<int32_t> expert(-1, trial % 3 == 0 ? 3 : 127);
    std::vector<int32_t> experts(pairs);
    for (int32_t& e : experts) e = expert(rng);
    SCOPED_TRACE(trial);
    ExpectRanksFollowTheStableSort(experts);
  }
}

}  // namespace
}  // namespace dxs
