// CachingAllocator's pool: reuse by size class, and which blocks go back to the system when
// the cache is at its cap (kernels/caching_allocator.h).
#include "kernels/caching_allocator.h"

#include <cstdlib>
#include <memory>
#include <mutex>
#include <random>
#include <set>
#include <thread>
#include <vector>

#include "gtest/gtest.h"

namespace dxs {
namespace {

constexpr size_t kMiB = size_t{1} << 20;

// A host pool whose system side counts what it was asked for.
struct CountingSystem {
  int64_t allocs = 0;
  std::set<void*> freed;

  std::shared_ptr<CachingAllocator> Pool(size_t max_cached_bytes) {
    return CachingAllocator::Create(
        Device::kCpu,
        [this](size_t bytes) {
          ++allocs;
          return std::malloc(bytes);
        },
        [this](void* p, size_t) {
          freed.insert(p);
          std::free(p);
        },
        max_cached_bytes);
  }
};

TEST(CachingAllocatorTest, AFreedBlockServesTheNextRequestOfItsClass) {
  CountingSystem sys;
  auto pool = sys.Pool(64 * kMiB);
  void* first = nullptr;
  {
    auto a = pool->Allocate(3 * kMiB);
    ASSERT_TRUE(a.ok());
    first = (*a)->data();
  }
  auto b = pool->Allocate(3 * kMiB - 100);  // the same class
  ASSERT_TRUE(b.ok());
  EXPECT_EQ((*b)->data(), first);
  EXPECT_EQ(sys.allocs, 1);
  EXPECT_EQ(pool->stats().cache_hits, 1);
}

// At the cap, the block put back longest ago goes back to the system to make room for the
// one put back now, not the other way round.
TEST(CachingAllocatorTest, AtTheCapTheOldestCachedBlockGoesBack) {
  CountingSystem sys;
  auto pool = sys.Pool(3 * kMiB);
  std::vector<void*> old;
  {
    std::vector<std::shared_ptr<Buffer>> held;
    for (int i = 0; i < 3; ++i) {
      held.push_back(*pool->Allocate(kMiB));
      old.push_back(held.back()->data());
    }
  }  // put back in order 0, 1, 2: the cache is full
  EXPECT_EQ(pool->stats().bytes_cached, static_cast<int64_t>(3 * kMiB));
  void* newer = nullptr;
  {
    auto a = pool->Allocate(kMiB / 2);  // another class: from the system
    ASSERT_TRUE(a.ok());
    newer = (*a)->data();
  }  // put back: block 0, the oldest, makes room
  EXPECT_EQ(sys.freed.count(old[0]), 1u);
  EXPECT_EQ(sys.freed.count(newer), 0u);
  EXPECT_EQ(pool->stats().evicted_blocks, 1);
  const int64_t allocs = sys.allocs;
  auto again = pool->Allocate(kMiB / 2);
  ASSERT_TRUE(again.ok());
  EXPECT_EQ((*again)->data(), newer);
  EXPECT_EQ(sys.allocs, allocs);
}

// A cache filled with a class nothing asks for any more (a finished batch's blocks) and then
// a loop of temporaries of new classes: after the first round they come from the cache, where
// refusing newly put-back blocks at the cap sent them to the system every round.
TEST(CachingAllocatorTest, StaleBlocksGiveWayToTheWorkingSet) {
  CountingSystem sys;
  auto pool = sys.Pool(16 * kMiB);
  {
    std::vector<std::shared_ptr<Buffer>> stale;
    for (int i = 0; i < 8; ++i) stale.push_back(*pool->Allocate(2 * kMiB));
  }
  EXPECT_EQ(pool->stats().bytes_cached, static_cast<int64_t>(16 * kMiB));
  const int64_t before = sys.allocs;
  for (int round = 0; round < 10; ++round) {
    auto x = pool->Allocate(3 * kMiB);
    auto y = pool->Allocate(5 * kMiB);
    ASSERT_TRUE(x.ok() && y.ok());
  }
  EXPECT_EQ(sys.allocs - before, 2) << "each temporary's class from the system once";
  EXPECT_LE(pool->stats().bytes_cached, static_cast<int64_t>(16 * kMiB));
}

// A block larger than the whole cap is never cached, and leaves the cached ones alone.
TEST(CachingAllocatorTest, ABlockOverTheCapGoesStraightBack) {
  CountingSystem sys;
  auto pool = sys.Pool(2 * kMiB);
  { auto small = pool->Allocate(kMiB); }
  void* big = nullptr;
  {
    auto a = pool->Allocate(4 * kMiB);
    ASSERT_TRUE(a.ok());
    big = (*a)->data();
  }
  EXPECT_EQ(sys.freed.count(big), 1u);
  EXPECT_EQ(pool->stats().bytes_cached, static_cast<int64_t>(kMiB));
  EXPECT_EQ(pool->stats().evicted_blocks, 0);
}

// Threads allocating and putting back blocks of several classes past the cap at once: every
// block the system gives back is one it handed out and has not had back (no double free, no
// stranger), the cap holds, and when the pool goes everything has gone back.
TEST(CachingAllocatorTest, ConcurrentUseUnderTheCapGivesEveryBlockBackOnce) {
  std::mutex mu;
  std::set<void*> live;  // handed out by the system, not given back yet
  int64_t bad_frees = 0;
  {
    auto pool = CachingAllocator::Create(
        Device::kCpu,
        [&](size_t bytes) {
          void* p = std::malloc(bytes);
          std::lock_guard<std::mutex> lock(mu);
          live.insert(p);
          return p;
        },
        [&](void* p, size_t) {
          {
            std::lock_guard<std::mutex> lock(mu);
            if (live.erase(p) == 0) ++bad_frees;
          }
          std::free(p);
        },
        4 * kMiB);
    std::vector<std::thread> threads;
    for (int t = 0; t < 4; ++t) {
      threads.emplace_back([&pool, t] {
        std::mt19937 rng(17 + t);
        const size_t sizes[] = {kMiB / 4, kMiB / 2, kMiB, 3 * kMiB / 2, 2 * kMiB, 3 * kMiB};
        std::vector<std::shared_ptr<Buffer>> held;
        for (int i = 0; i < 2000; ++i) {
          if (held.size() < 3 && rng() % 2 == 0) {
            auto b = pool->Allocate(sizes[rng() % 6]);
            if (b.ok()) held.push_back(*b);
          } else if (!held.empty()) {
            held.erase(held.begin() + rng() % held.size());
          }
        }
      });
    }
    for (std::thread& t : threads) t.join();
    const CachingAllocator::Stats stats = pool->stats();
    EXPECT_EQ(stats.bytes_in_use, 0);
    EXPECT_LE(stats.bytes_cached, static_cast<int64_t>(4 * kMiB));
    EXPECT_GT(stats.evicted_blocks, 0) << "the cap was never reached: the test tests nothing";
    EXPECT_GT(stats.cache_hits, 0);
  }
  EXPECT_EQ(bad_frees, 0);
  EXPECT_TRUE(live.empty()) << live.size() << " blocks never given back";
}

// Two pools of one device (a backend's main pool and its graphs' pool) over a system of 10 MiB:
// a block the first keeps cached is given back when the second cannot get memory otherwise,
// but only between peers.
TEST(CachingAllocatorTest, APeersCachedBlocksGoBackWhenTheSystemHasNoMemory) {
  struct Budget {
    size_t left = 10 * kMiB;
  };
  auto pool = [](std::shared_ptr<Budget> budget) {
    return CachingAllocator::Create(
        Device::kCpu,
        [budget](size_t bytes) -> void* {
          if (bytes > budget->left) return nullptr;
          budget->left -= bytes;
          return std::malloc(bytes);
        },
        [budget](void* p, size_t bytes) {
          budget->left += bytes;
          std::free(p);
        },
        64 * kMiB);
  };
  for (const bool peers : {false, true}) {
    SCOPED_TRACE(peers ? "peers" : "not peers");
    auto budget = std::make_shared<Budget>();
    auto main = pool(budget), graphs = pool(budget);
    if (peers) {
      main->AddPeer(graphs);
      graphs->AddPeer(main);
    }
    ASSERT_TRUE(main->Allocate(8 * kMiB).ok());  // freed at once: cached in main
    EXPECT_EQ(main->stats().bytes_cached, static_cast<int64_t>(8 * kMiB));
    auto block = graphs->Allocate(6 * kMiB);
    if (!peers) {
      EXPECT_EQ(block.status().code(), absl::StatusCode::kResourceExhausted);
      EXPECT_EQ(main->stats().bytes_cached, static_cast<int64_t>(8 * kMiB));
      continue;
    }
    ASSERT_TRUE(block.ok()) << block.status();
    EXPECT_EQ(main->stats().bytes_cached, 0);
    EXPECT_EQ(budget->left, 4 * kMiB);
  }
}

}  // namespace
}  // namespace dxs
