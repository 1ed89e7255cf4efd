// CachingAllocator: the memory pool behind a backend's Allocate.
//
// The step loop allocates the same few shapes every layer of every step. Going to the
// system (aligned_alloc, cudaMalloc) each time costs page faults on the host and a device
// synchronisation on CUDA, so freed blocks are kept in size classes and handed out again,
// as PyTorch's and vLLM's caching allocators do. A Buffer from Allocate puts its block back
// when its last Tensor goes. At most `max_cached_bytes` stay cached: past it the blocks put
// back longest ago go back to the system first, so that a cache filled with classes nothing
// asks for any more (a finished batch's KV, an earlier prompt's temporaries) does not send
// every new class to the system (cudaMalloc and cudaFree, a device synchronisation each) on
// each use.
//
// Size classes: multiples of 512 bytes up to 64 KiB, then four classes per power of two
// (at most 25% slack), so a block is reused for any request of its class.
//
// Thread safety: every method is thread-safe. The pool lives as long as its last Buffer,
// so tensors may outlive the backend that made them.
#pragma once

#include <cstddef>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "kernels/tensor.h"

namespace dxs {

class CachingAllocator : public std::enable_shared_from_this<CachingAllocator> {
 public:
  // Raw memory from the system: null on failure. `free` gets the pointer and its size.
  using SystemAlloc = std::function<void*(size_t bytes)>;
  using SystemFree = std::function<void(void* p, size_t bytes)>;

  struct Stats {
    int64_t system_allocations = 0;  // blocks taken from the system, ever
    int64_t cache_hits = 0;          // allocations served from cached blocks
    int64_t bytes_in_use = 0;
    int64_t bytes_cached = 0;    // free blocks held for reuse
    int64_t evicted_blocks = 0;  // cached blocks given back to make room for newer ones
  };

  static std::shared_ptr<CachingAllocator> Create(Device device, SystemAlloc alloc, SystemFree free,
                                                  size_t max_cached_bytes);
  ~CachingAllocator();

  // At least `bytes` bytes (0 is fine), uninitialised. RESOURCE_EXHAUSTED when the system
  // has no memory even after the cache and the peers' caches are emptied.
  absl::StatusOr<std::shared_ptr<Buffer>> Allocate(size_t bytes);
  // Returns every cached block to the system.
  void EmptyCache();
  // Another pool of the same device (a backend's pool for recorded graphs beside its main
  // one): when the system has no memory for a block even after this pool's cache is emptied,
  // the peers' cached blocks go back too before Allocate gives up. A graph's warm-up after a
  // prefill then gets the memory that the prefill's temporaries left cached in the main pool.
  void AddPeer(std::weak_ptr<CachingAllocator> peer);
  Stats stats() const;

  static size_t SizeClass(size_t bytes);

 private:
  CachingAllocator(Device device, SystemAlloc alloc, SystemFree free, size_t max_cached_bytes);
  void Release(void* p, size_t size_class);

  const Device device_;
  const SystemAlloc system_alloc_;
  const SystemFree system_free_;
  const size_t max_cached_bytes_;
  mutable absl::Mutex mu_;
  struct Cached {
    void* p;
    uint64_t released;  // release_count_ when it was put back: older blocks go first
  };
  // Per size class, oldest first; Allocate takes the newest.
  std::map<size_t, std::deque<Cached>> free_ ABSL_GUARDED_BY(mu_);
  std::vector<std::weak_ptr<CachingAllocator>> peers_ ABSL_GUARDED_BY(mu_);
  uint64_t release_count_ ABSL_GUARDED_BY(mu_) = 0;
  Stats stats_ ABSL_GUARDED_BY(mu_);
};

}  // namespace dxs
