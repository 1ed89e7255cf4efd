// CPU backend operations against straightforward reference loops.
#include <cmath>

#include "gtest/gtest.h"
#include "kernels/backend.h"

namespace dxs {
namespace {

class CpuBackendTest : public ::testing::Test {
 protected:
  std::unique_ptr<Backend> b_ = MakeCpuBackend();
};

TEST_F(CpuBackendTest, LinearMatchesNaiveProduct) {
  const int64_t m = 3, k = 5, n = 4;
  std::vector<float> x(m * k), w(n * k), bias(n);
  for (size_t i = 0; i < x.size(); ++i) x[i] = 0.1f * static_cast<float>(i) - 0.7f;
  for (size_t i = 0; i < w.size(); ++i) w[i] = 0.05f * static_cast<float>(i % 7) - 0.2f;
  for (size_t i = 0; i < bias.size(); ++i) bias[i] = static_cast<float>(i);
  Tensor tx = b_->Upload(x, {m, k}), tw = b_->Upload(w, {n, k}), tb = b_->Upload(bias, {n});
  Tensor ty = b_->Allocate({m, n});
  b_->Linear(tx, tw, &tb, &ty);
  std::vector<float> y = b_->Download(ty);
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t j = 0; j < n; ++j) {
      double ref = bias[j];
      for (int64_t p = 0; p < k; ++p) ref += x[i * k + p] * w[j * k + p];
      EXPECT_NEAR(y[i * n + j], ref, 1e-5);
    }
  }
}

TEST_F(CpuBackendTest, ZeroRowOperationsAreNoOps) {
  Tensor x = b_->Allocate({0, 8}), w = b_->Upload(std::vector<float>(32, 1.f), {4, 8});
  Tensor y = b_->Allocate({0, 4});
  b_->Linear(x, w, nullptr, &y);
  Tensor norm_w = b_->Upload(std::vector<float>(8, 1.f), {8});
  Tensor xn = b_->Allocate({0, 8});
  b_->RmsNorm(x, norm_w, 1e-6f, &xn);
  b_->GatherRows(x, {}, &xn);
  b_->ScaleAddRows(x, {}, {}, &xn);
  EXPECT_EQ(y.num_elements(), 0);
}

TEST_F(CpuBackendTest, RmsNormAndRope) {
  Tensor x = b_->Upload({3.f, 4.f}, {1, 2});
  Tensor w = b_->Upload({1.f, 2.f}, {2});
  Tensor y = b_->Allocate({1, 2});
  b_->RmsNorm(x, w, 0.f, &y);
  const float rms = std::sqrt((9.f + 16.f) / 2.f);
  EXPECT_NEAR(b_->Download(y)[0], 3.f / rms, 1e-6);
  EXPECT_NEAR(b_->Download(y)[1], 2.f * 4.f / rms, 1e-6);
  // RoPE at position 0 is the identity; at p rotates pairs (i, i + d/2) by p * theta^(-2i/d).
  Tensor r = b_->Upload({1.f, 0.f, 0.f, 1.f}, {1, 1, 4});
  b_->Rope(&r, {0}, 10000.0);
  EXPECT_EQ(b_->Download(r), (std::vector<float>{1.f, 0.f, 0.f, 1.f}));
  Tensor s = b_->Upload({1.f, 0.f, 0.f, 0.f}, {1, 1, 4});
  b_->Rope(&s, {2}, 10000.0);
  std::vector<float> v = b_->Download(s);
  EXPECT_NEAR(v[0], std::cos(2.0), 1e-6);
  EXPECT_NEAR(v[2], std::sin(2.0), 1e-6);
}

TEST_F(CpuBackendTest, AttentionIsCausalAndGrouped) {
  // Two heads share one KV head. Query 0 sees only position 0 -> output is v[0].
  Tensor q = b_->Upload({1.f, 0.f, 0.f, 1.f, 1.f, 0.f, 0.f, 1.f}, {2, 2, 2});
  Tensor k = b_->Upload({1.f, 0.f, 0.f, 1.f}, {2, 1, 2});
  Tensor v = b_->Upload({10.f, 20.f, 30.f, 40.f}, {2, 1, 2});
  Tensor out = b_->Allocate({2, 2, 2});
  b_->Attention(q, k, v, 0, 1.f, &out);
  std::vector<float> o = b_->Download(out);
  EXPECT_FLOAT_EQ(o[0], 10.f);
  EXPECT_FLOAT_EQ(o[3], 20.f);
  // Query 1, head 0 = (1, 0): scores (1, 0) over positions 0, 1.
  const double w0 = std::exp(1.0) / (std::exp(1.0) + 1.0);
  EXPECT_NEAR(o[4], w0 * 10 + (1 - w0) * 30, 1e-4);
}

}  // namespace
}  // namespace dxs
