// The paged KV cache: token accounting as before (capacity in tokens over live slots), whole
// blocks per slot, blocks reused after Free, and a pool that grows with its contents kept.
#include "model/kv_cache.h"

#include <algorithm>
#include <set>

#include "gtest/gtest.h"

namespace dxs {
namespace {

ModelConfig SmallConfig() {
  ModelConfig c;
  c.num_hidden_layers = 2;
  c.num_key_value_heads = 1;
  c.head_dim = 2;
  return c;
}

TEST(KvCacheTest, AccountsTokensAndHandsOutWholeBlocks) {
  std::unique_ptr<Backend> backend = MakeCpuBackend();
  KvCache kv(SmallConfig(), backend.get(), /*capacity_tokens=*/40, /*block_size=*/4);
  absl::StatusOr<int> a = kv.Allocate(10), b = kv.Allocate(30);
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_EQ(kv.reserved_tokens(), 40);
  EXPECT_EQ(kv.block_table(*a).size(), 3u);  // ceil(10 / 4)
  EXPECT_EQ(kv.block_table(*b).size(), 8u);
  // Tokens, not blocks, bound the cache: 40 of 40 are reserved.
  EXPECT_EQ(kv.Allocate(1).status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(kv.Allocate(0).status().code(), absl::StatusCode::kInvalidArgument);
  // No block is shared.
  std::set<int32_t> blocks(kv.block_table(*a).begin(), kv.block_table(*a).end());
  for (int32_t x : kv.block_table(*b)) EXPECT_TRUE(blocks.insert(x).second) << x;
  EXPECT_LE(static_cast<int64_t>(blocks.size()), kv.num_blocks());
  // Freed blocks go to the next slot; the pool does not grow for it.
  const std::vector<int32_t> freed = kv.block_table(*a);
  const int64_t pool = kv.num_blocks();
  kv.Free(*a);
  EXPECT_EQ(kv.reserved_tokens(), 30);
  absl::StatusOr<int> c = kv.Allocate(8);
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(kv.num_blocks(), pool);
  for (int32_t x : kv.block_table(*c)) {
    EXPECT_NE(std::find(freed.begin(), freed.end(), x), freed.end()) << x;
  }
}

TEST(KvCacheTest, GrowingThePoolKeepsWrittenPages) {
  std::unique_ptr<Backend> backend = MakeCpuBackend();
  KvCache kv(SmallConfig(), backend.get(), 1 << 20, /*block_size=*/2);
  absl::StatusOr<int> a = kv.Allocate(4);
  ASSERT_TRUE(a.ok());
  // Write a recognisable value into every row of the first slot's pages, every layer.
  const int64_t row = 2;  // kv_heads * head_dim
  for (int layer = 0; layer < 2; ++layer) {
    std::vector<float> keys = *backend->Download(kv.keys(layer));
    for (int32_t block : kv.block_table(*a)) {
      for (int64_t i = 0; i < 2 * row; ++i) keys[block * 2 * row + i] = 100.f * layer + block;
    }
    ASSERT_TRUE(backend->CopyFromHost(keys.data(), DType::kF32, &kv.keys(layer)).ok());
  }
  const int64_t before = kv.num_blocks();
  ASSERT_TRUE(kv.Allocate(1000).ok());  // forces growth
  EXPECT_GT(kv.num_blocks(), before);
  for (int layer = 0; layer < 2; ++layer) {
    const std::vector<float> keys = *backend->Download(kv.keys(layer));
    for (int32_t block : kv.block_table(*a)) {
      EXPECT_EQ(keys[block * 2 * row], 100.f * layer + block) << "layer " << layer;
    }
  }
}

// Doubling stops at the capacity: a pool of 100 tokens in blocks of 4 is never more than its 25
// blocks, where doubling from 16 would have made 32; Preallocate takes them all at once, and no
// Allocate within the capacity grows the pool after it.
TEST(KvCacheTest, ThePoolNeverGrowsPastTheCapacity) {
  std::unique_ptr<Backend> backend = MakeCpuBackend();
  {
    KvCache kv(SmallConfig(), backend.get(), /*capacity_tokens=*/100, /*block_size=*/4);
    std::vector<int> slots;
    for (int i = 0; i < 25; ++i) {
      absl::StatusOr<int> s = kv.Allocate(4);
      ASSERT_TRUE(s.ok()) << s.status();
      EXPECT_LE(kv.num_blocks(), 25) << "after " << i + 1 << " slots";
    }
    EXPECT_EQ(kv.num_blocks(), 25);
    EXPECT_EQ(kv.keys(0).rows(), 25);
  }
  {
    // Slots that round up to whole blocks may need more blocks than capacity / block size:
    // the pool grows to exactly what they need.
    KvCache kv(SmallConfig(), backend.get(), /*capacity_tokens=*/20, /*block_size=*/4);
    for (int i = 0; i < 4; ++i) ASSERT_TRUE(kv.Allocate(5).ok());  // 2 blocks each
    EXPECT_EQ(kv.num_blocks(), 8);
  }
  KvCache kv(SmallConfig(), backend.get(), /*capacity_tokens=*/100, /*block_size=*/4);
  ASSERT_TRUE(kv.Preallocate().ok());
  EXPECT_EQ(kv.num_blocks(), 25);
  for (int layer = 0; layer < 2; ++layer) EXPECT_EQ(kv.values(layer).rows(), 25);
  for (int i = 0; i < 5; ++i) ASSERT_TRUE(kv.Allocate(20).ok());
  EXPECT_EQ(kv.num_blocks(), 25);
}

// A fork shares the parent's whole blocks (counted once), copies its partial block, and
// takes its own blocks for the rest; a shared block goes back to the free list only when
// the last slot holding it is freed.
TEST(KvCacheTest, ForkSharesWholeBlocksAndCopiesThePartialOne) {
  std::unique_ptr<Backend> backend = MakeCpuBackend();
  KvCache kv(SmallConfig(), backend.get(), /*capacity_tokens=*/100, /*block_size=*/4);
  absl::StatusOr<int> parent = kv.Allocate(14);  // 10 prompt + 4 new: blocks 0..3
  ASSERT_TRUE(parent.ok());
  const int64_t row = 2;  // kv_heads * head_dim
  for (int layer = 0; layer < 2; ++layer) {
    for (Tensor* pool : {&kv.keys(layer), &kv.values(layer)}) {
      std::vector<float> v = *backend->Download(*pool);
      for (int32_t block : kv.block_table(*parent)) {
        for (int64_t i = 0; i < 4 * row; ++i) v[block * 4 * row + i] = 10.f * layer + block + 0.5f;
      }
      ASSERT_TRUE(backend->CopyFromHost(v.data(), DType::kF32, pool).ok());
    }
  }
  absl::StatusOr<int> child = kv.Fork(*parent, /*shared_tokens=*/10, /*max_tokens=*/14);
  ASSERT_TRUE(child.ok()) << child.status();
  const std::vector<int32_t>& p = kv.block_table(*parent);
  const std::vector<int32_t>& c = kv.block_table(*child);
  ASSERT_EQ(c.size(), 4u);
  EXPECT_EQ(c[0], p[0]);  // positions 0..7: shared
  EXPECT_EQ(c[1], p[1]);
  EXPECT_NE(c[2], p[2]);  // positions 8..9 copied into the child's own block
  EXPECT_NE(c[3], p[3]);
  EXPECT_EQ(kv.reserved_tokens(), 14 + 6);  // the child counts only past the shared blocks
  for (int layer = 0; layer < 2; ++layer) {
    for (Tensor* pool : {&kv.keys(layer), &kv.values(layer)}) {
      const std::vector<float> v = *backend->Download(*pool);
      for (int64_t i = 0; i < 4 * row; ++i) {
        EXPECT_EQ(v[c[2] * 4 * row + i], 10.f * layer + p[2] + 0.5f) << "layer " << layer;
      }
    }
  }
  // Freeing the parent keeps the shared blocks for the child.
  const int32_t shared = p[0];
  kv.Free(*parent);
  EXPECT_EQ(kv.reserved_tokens(), 6);
  absl::StatusOr<int> other = kv.Allocate(60);
  ASSERT_TRUE(other.ok());
  for (int32_t b : kv.block_table(*other)) EXPECT_NE(b, shared);
  kv.Free(*child);
  kv.Free(*other);
  EXPECT_EQ(kv.reserved_tokens(), 0);
  // Now every block is free again: one slot of the whole pool takes no new one.
  const int64_t pool_blocks = kv.num_blocks();
  ASSERT_TRUE(kv.Allocate(pool_blocks * 4 > 100 ? 100 : pool_blocks * 4).ok());
  EXPECT_EQ(kv.num_blocks(), pool_blocks);
  EXPECT_EQ(kv.Fork(12345, 1, 2).status().code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace dxs
