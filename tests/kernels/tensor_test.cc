// Tensor's block scales (kernels/tensor.h): a block-scaled FP8 weight's views keep the scale
// rows of their own 128-row blocks, and a view that would split a block is a programming
// error (abort), as a view outside a tensor is. Host tensors: no backend needed.
#include "kernels/tensor.h"

#include <cstring>

#include "gtest/gtest.h"

namespace dxs {
namespace {

// An FP8 weight [n, k] whose scale (b, c) is 100 * b + c.
Tensor ScaledWeight(int64_t n, int64_t k) {
  Tensor w = AllocateHostTensor(DType::kF8E4M3, {n, k});
  std::memset(w.raw(), 0x38, w.num_bytes());
  Tensor scales = AllocateHostTensor(DType::kF32, {n / 128, BlockScaleStride(k)});
  for (int64_t b = 0; b < scales.rows(); ++b) {
    for (int64_t c = 0; c < scales.row_size(); ++c) {
      scales.f32()[b * scales.row_size() + c] = static_cast<float>(100 * b + c);
    }
  }
  return w.WithBlockScales(scales);
}

TEST(TensorBlockScales, StrideIsWholeBlocksRoundedUpToFour) {
  EXPECT_EQ(BlockScaleStride(128), 4);
  EXPECT_EQ(BlockScaleStride(512), 4);
  EXPECT_EQ(BlockScaleStride(768), 8);
  EXPECT_EQ(BlockScaleStride(2048), 16);
  EXPECT_EQ(BlockScaleStride(2176), 20);
}

TEST(TensorBlockScales, RowsOfWholeBlocksKeepTheirScaleRows) {
  const Tensor w = ScaledWeight(384, 768);
  ASSERT_NE(w.block_scales(), nullptr);
  const Tensor v = w.Rows(128, 256);
  ASSERT_NE(v.block_scales(), nullptr);
  EXPECT_EQ(v.block_scales()->shape(), (std::vector<int64_t>{2, 8}));
  EXPECT_EQ(v.block_scales()->f32()[0], 100.f);      // block row 1, column 0
  EXPECT_EQ(v.block_scales()->f32()[8 + 5], 205.f);  // block row 2, column 5
  EXPECT_EQ(static_cast<const uint8_t*>(v.raw()) - static_cast<const uint8_t*>(w.raw()), 128 * 768);
  // A view of a view, and the last block.
  EXPECT_EQ(v.Rows(128, 128).block_scales()->f32()[0], 200.f);
  EXPECT_EQ(w.Rows(256, 128).block_scales()->rows(), 1);
}

TEST(TensorBlockScales, ReshapeKeepsThemOnlyForTheSameShape) {
  const Tensor w = ScaledWeight(256, 256);
  EXPECT_NE(w.Reshape({256, 256}).block_scales(), nullptr);
  EXPECT_EQ(w.Reshape({128, 512}).block_scales(), nullptr);
  EXPECT_EQ(w.Reshape({65536}).block_scales(), nullptr);
}

TEST(TensorBlockScales, OtherTensorsHaveNone) {
  const Tensor t = AllocateHostTensor(DType::kBF16, {300, 64});
  EXPECT_EQ(t.block_scales(), nullptr);
  EXPECT_EQ(t.Rows(7, 100).block_scales(), nullptr);  // any rows: no blocks to keep
}

TEST(TensorBlockScalesDeathTest, AViewSplittingABlockAborts) {
  const Tensor w = ScaledWeight(256, 128);
  EXPECT_DEATH(w.Rows(64, 128), "");
  EXPECT_DEATH(w.Rows(0, 100), "");
}

}  // namespace
}  // namespace dxs
