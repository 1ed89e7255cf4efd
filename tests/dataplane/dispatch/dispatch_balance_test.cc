// DispatchBalanceRatio (dataplane/dispatch/dispatch_balance.h): how evenly one dispatch
// spread its tokens over the EP ranks of its step.
#include "dataplane/dispatch/dispatch_balance.h"

#include "gtest/gtest.h"

namespace dxs {
namespace {

// The per-dispatch ratio counts only the step's EP ranks: over every EP rank the executor
// knew, after an elastic EP kill (or with a joined rank not yet rebalanced onto) a
// perfectly even dispatch over the ranks of the step would read (N-1)/N.
TEST(DispatchBalance, RatioCountsTheRanksOfTheStepOnly) {
  EXPECT_DOUBLE_EQ(DispatchBalanceRatio({10, 10, 0}, {true, true, false}), 1.0);
  EXPECT_DOUBLE_EQ(DispatchBalanceRatio({10, 0, 30}, {true, false, true}), 20.0 / 30.0);
  // A rank of the step that got nothing is an imbalance.
  EXPECT_DOUBLE_EQ(DispatchBalanceRatio({10, 0, 0}, {true, true, false}), 0.5);
  // Ranks past in_step's end (the executor grew) are outside the step.
  EXPECT_DOUBLE_EQ(DispatchBalanceRatio({8, 8, 0}, {true, true}), 1.0);
  EXPECT_DOUBLE_EQ(DispatchBalanceRatio({0, 0}, {true, true}), 1.0);
  EXPECT_DOUBLE_EQ(DispatchBalanceRatio({}, {}), 1.0);
}

}  // namespace
}  // namespace dxs
