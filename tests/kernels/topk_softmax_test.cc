// Router top-k softmax: the empty-batch guard, argument checks, and the math.
#include "kernels/topk_softmax.h"

#include <cmath>

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

}  // namespace
}  // namespace dxs
