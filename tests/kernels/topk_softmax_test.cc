// Router top-k softmax: the empty-batch guard, argument checks, and the math.
#include "kernels/topk_softmax.h"

#include <cmath>
#include <cstdint>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/backend.h"

namespace dxs {
namespace {

TEST(TopKSoftmax, ZeroTokensReturnsAtOnceWithoutTouchingOutputs) {
  int32_t ids[1] = {-7};
  float weights[1] = {-7.f};
  EXPECT_TRUE(TopKSoftmaxCpu(nullptr, 0, 16, 4, true, ids, weights).ok());
  EXPECT_EQ(ids[0], -7);
  EXPECT_EQ(weights[0], -7.f);
  auto backend = MakeCpuBackend();
  Tensor logits = *backend->Allocate({0, 16}, DType::kF32);
  Tensor out_ids = *backend->Allocate({0, 4}, DType::kI32);
  Tensor out_w = *backend->Allocate({0, 4}, DType::kF32);
  EXPECT_TRUE(backend->TopKSoftmax(logits, 4, true, &out_ids, &out_w).ok());
  EXPECT_EQ(out_ids.num_elements(), 0);
  // Arguments are still checked on an empty batch.
  EXPECT_EQ(backend->TopKSoftmax(logits, 17, true, &out_ids, &out_w).code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(TopKSoftmax, RejectsNonPositiveExpertCount) {
  float logits[4] = {};
  int32_t ids[4];
  float w[4];
  for (int64_t experts : {0, -3}) {
    absl::Status s = TopKSoftmaxCpu(logits, 1, experts, 1, true, ids, w);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(s.message().find("num_experts"), std::string::npos) << s;
  }
}

TEST(TopKSoftmax, RejectsBadTopK) {
  float logits[4] = {};
  int32_t ids[8];
  float w[8];
  for (int64_t k : {0, -1, 5}) {
    absl::Status s = TopKSoftmaxCpu(logits, 1, 4, k, true, ids, w);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << k;
    EXPECT_NE(s.message().find("top_k"), std::string::npos) << s;
  }
}

TEST(TopKSoftmax, PicksLargestAndNormalises) {
  const float logits[2 * 4] = {0.f, 3.f, 1.f, 2.f, /**/ 5.f, 5.f, -1.f, 0.f};
  int32_t ids[4];
  float w[4];
  ASSERT_TRUE(TopKSoftmaxCpu(logits, 2, 4, 2, false, ids, w).ok());
  const double z0 = std::exp(0.) + std::exp(3.) + std::exp(1.) + std::exp(2.);
  EXPECT_EQ(ids[0], 1);
  EXPECT_EQ(ids[1], 3);
  EXPECT_NEAR(w[0], std::exp(3.) / z0, 1e-6);
  EXPECT_NEAR(w[1], std::exp(2.) / z0, 1e-6);
  EXPECT_EQ(ids[2], 0);  // tie goes to the lower id
  EXPECT_EQ(ids[3], 1);
  ASSERT_TRUE(TopKSoftmaxCpu(logits, 2, 4, 2, true, ids, w).ok());
  EXPECT_NEAR(w[0] + w[1], 1.0, 1e-6);
  EXPECT_NEAR(w[0] / w[1], std::exp(1.), 1e-5);
  EXPECT_NEAR(w[2], 0.5, 1e-6);
}

// A row with a NaN or +inf logit has NaN weights (a NaN sum, exp(inf - inf)) and its experts
// ranked by logit, NaN last wherever it is in the row (the GPU kernel's order), never picked
// 0, 1, 2...; a row of numbers ranks by probability, ties (underflows to 0 among them) to the
// lower id.
TEST(TopKSoftmax, RowsWithNanRankByLogitWithNanLast) {
  const float nan = std::nanf(""), inf = INFINITY;
  struct Case {
    std::vector<float> logits;
    std::vector<int32_t> ids;
    bool weights_nan;
  };
  const Case cases[] = {
      {{0.f, -300.f, -200.f}, {0, 1, 2}, false},  // exp(-200) and exp(-300) are both 0.f
      {{nan, 1.f, 3.f, 2.f}, {2, 3, 1}, true},    // NaN first in the row
      {{1.f, nan, 3.f, 2.f}, {2, 3, 0}, true},
      {{1.f, 3.f, 2.f, nan}, {1, 2, 0}, true},
      {{nan, nan, 0.f, nan}, {2, 0, 1}, true},  // NaNs last, by id
      {{0.f, inf, 1.f, -inf}, {1, 2, 0}, true},
      {{-inf, 0.f, -inf, 1.f}, {3, 1, 0}, false},  // -inf ranks last, by id, weight 0
  };
  for (const Case& c : cases) {
    const int64_t experts = static_cast<int64_t>(c.logits.size());
    std::vector<int32_t> ids(3);
    std::vector<float> w(3);
    ASSERT_TRUE(TopKSoftmaxCpu(c.logits.data(), 1, experts, 3, false, ids.data(), w.data()).ok());
    EXPECT_EQ(ids, c.ids) << "row " << ::testing::PrintToString(c.logits);
    for (float x : w) EXPECT_EQ(std::isnan(x), c.weights_nan) << x;
  }
}

}  // namespace
}  // namespace dxs
