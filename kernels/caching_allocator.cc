#include "kernels/caching_allocator.h"

#include <algorithm>

#include "absl/strings/str_cat.h"

namespace dxs {

CachingAllocator::CachingAllocator(Device device, SystemAlloc alloc, SystemFree free,
                                   size_t max_cached_bytes)
    : device_(device),
      system_alloc_(std::move(alloc)),
      system_free_(std::move(free)),
      max_cached_bytes_(max_cached_bytes) {}

std::shared_ptr<CachingAllocator> CachingAllocator::Create(Device device, SystemAlloc alloc,
                                                           SystemFree free,
                                                           size_t max_cached_bytes) {
  return std::shared_ptr<CachingAllocator>(
      new CachingAllocator(device, std::move(alloc), std::move(free), max_cached_bytes));
}

CachingAllocator::~CachingAllocator() { EmptyCache(); }

size_t CachingAllocator::SizeClass(size_t bytes) {
  constexpr size_t kSmallStep = 512, kSmallMax = 64 << 10;
  bytes = std::max<size_t>(bytes, 1);
  if (bytes <= kSmallMax) return (bytes + kSmallStep - 1) / kSmallStep * kSmallStep;
  // Four classes per octave: [2^k, 2^k * 5/4, 2^k * 6/4, 2^k * 7/4].
  size_t octave = kSmallMax;
  while (octave * 2 <= bytes) octave *= 2;
  const size_t quarter = octave / 4;
  return (bytes + quarter - 1) / quarter * quarter;
}

absl::StatusOr<std::shared_ptr<Buffer>> CachingAllocator::Allocate(size_t bytes) {
  const size_t size_class = SizeClass(bytes);
  void* p = nullptr;
  {
    absl::MutexLock lock(&mu_);
    auto it = free_.find(size_class);
    if (it != free_.end() && !it->second.empty()) {
      p = it->second.back().p;
      it->second.pop_back();
      if (it->second.empty()) free_.erase(it);
      stats_.bytes_cached -= static_cast<int64_t>(size_class);
      ++stats_.cache_hits;
    }
  }
  if (p == nullptr) {
    p = system_alloc_(size_class);
    if (p == nullptr) {
      EmptyCache();  // cached blocks of other classes may be what the system is missing
      p = system_alloc_(size_class);
    }
    if (p == nullptr) {
      std::vector<std::weak_ptr<CachingAllocator>> peers;
      {
        absl::MutexLock lock(&mu_);
        peers = peers_;
      }
      bool emptied = false;
      for (const std::weak_ptr<CachingAllocator>& weak : peers) {
        std::shared_ptr<CachingAllocator> peer = weak.lock();
        if (peer == nullptr || peer->stats().bytes_cached == 0) continue;
        peer->EmptyCache();
        emptied = true;
      }
      if (emptied) p = system_alloc_(size_class);
    }
    if (p == nullptr) {
      return absl::ResourceExhaustedError(
          absl::StrCat("out of ", device_ == Device::kCpu ? "host" : "device",
                       " memory allocating ", bytes, " bytes (", stats().bytes_in_use, " in use)"));
    }
    absl::MutexLock lock(&mu_);
    ++stats_.system_allocations;
  }
  {
    absl::MutexLock lock(&mu_);
    stats_.bytes_in_use += static_cast<int64_t>(size_class);
  }
  std::weak_ptr<CachingAllocator> pool = weak_from_this();
  return std::make_shared<Buffer>(device_, p, bytes, [pool, size_class](void* q) {
    if (std::shared_ptr<CachingAllocator> a = pool.lock()) a->Release(q, size_class);
  });
}

void CachingAllocator::Release(void* p, size_t size_class) {
  std::vector<std::pair<void*, size_t>> evicted;
  bool keep;
  {
    absl::MutexLock lock(&mu_);
    stats_.bytes_in_use -= static_cast<int64_t>(size_class);
    keep = size_class <= max_cached_bytes_;
    // Room for this block by giving back the blocks put back longest ago (the oldest of
    // each class is its deque's front; a few dozen classes to look through).
    while (keep && static_cast<size_t>(stats_.bytes_cached) + size_class > max_cached_bytes_) {
      auto oldest = free_.begin();
      for (auto it = free_.begin(); it != free_.end(); ++it) {
        if (it->second.front().released < oldest->second.front().released) oldest = it;
      }
      evicted.emplace_back(oldest->second.front().p, oldest->first);
      oldest->second.pop_front();
      stats_.bytes_cached -= static_cast<int64_t>(oldest->first);
      ++stats_.evicted_blocks;
      if (oldest->second.empty()) free_.erase(oldest);
    }
    if (keep) {
      free_[size_class].push_back({p, ++release_count_});
      stats_.bytes_cached += static_cast<int64_t>(size_class);
    }
  }
  if (!keep) system_free_(p, size_class);
  for (const auto& [q, q_class] : evicted) system_free_(q, q_class);
}

void CachingAllocator::EmptyCache() {
  std::map<size_t, std::deque<Cached>> blocks;
  {
    absl::MutexLock lock(&mu_);
    blocks.swap(free_);
    stats_.bytes_cached = 0;
  }
  for (auto& [size_class, cached] : blocks) {
    for (const Cached& c : cached) system_free_(c.p, size_class);
  }
}

void CachingAllocator::AddPeer(std::weak_ptr<CachingAllocator> peer) {
  absl::MutexLock lock(&mu_);
  peers_.push_back(std::move(peer));
}

CachingAllocator::Stats CachingAllocator::stats() const {
  absl::MutexLock lock(&mu_);
  return stats_;
}

}  // namespace dxs
