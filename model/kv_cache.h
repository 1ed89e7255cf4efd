// KvCache: paged key/value storage for every layer, the layout of vLLM's and FlashInfer's
// paged attention.
//
// Per layer, one pool of blocks [num_blocks, block_size, kv_heads, head_dim] for keys and
// one for values. A slot (one sequence) reserves room for up to `max_tokens` positions as
// whole blocks, listed in its block table; position p lives in block table[p / block_size],
// row p % block_size. Capacity is counted in tokens over all live slots, so that a server
// refuses work that would not fit; the pool itself grows (doubling, contents kept) as slots
// need blocks, so memory follows use rather than the configured capacity.
//
// Thread safety: not thread-safe; one scheduler thread owns it. reserved_tokens() may be
// read from any thread.
#pragma once

#include <atomic>
#include <cstdint>
#include <map>
#include <vector>

#include "absl/status/statusor.h"
#include "common/model_config.h"
#include "kernels/backend.h"

namespace dxs {

class KvCache {
 public:
  static constexpr int64_t kDefaultBlockSize = 16;

  KvCache(const ModelConfig& config, Backend* backend, int64_t capacity_tokens,
          int64_t block_size = kDefaultBlockSize);

  // Reserves a slot for up to `max_tokens` positions; RESOURCE_EXHAUSTED if it can't fit.
  absl::StatusOr<int> Allocate(int64_t max_tokens);
  // Makes the pools hold the whole capacity now (ceil(capacity / block size) blocks), so that
  // no later Allocate grows them: growing copies the pools into ones twice as large, holding
  // both at once, and a pool sized to fill a GPU would not have that room. RESOURCE_EXHAUSTED
  // (from the backend) when the capacity does not fit.
  absl::Status Preallocate();
  // A slot for up to `max_tokens` positions whose first `shared_tokens` hold `parent`'s (its
  // prompt, for another sample of it): the parent's whole blocks among them are shared,
  // counted once (in the parent's reservation), and its last partial block is copied, as both
  // sequences write past it (copy-on-write, done at the fork). The parent must not write below
  // shared_tokens again.
  absl::StatusOr<int> Fork(int parent, int64_t shared_tokens, int64_t max_tokens);
  void Free(int slot);

  bool HasSlot(int slot) const { return slots_.count(slot) > 0; }
  int64_t slot_capacity(int slot) const { return slots_.at(slot).capacity; }
  const std::vector<int32_t>& block_table(int slot) const { return slots_.at(slot).blocks; }
  int64_t block_size() const { return block_size_; }
  // The layer's pools, [num_blocks, block_size, kv_heads, head_dim]. Valid until the next
  // Allocate (which may grow them).
  Tensor& keys(int layer) { return keys_[layer]; }
  Tensor& values(int layer) { return values_[layer]; }

  int64_t capacity_tokens() const { return capacity_tokens_; }
  int64_t reserved_tokens() const { return reserved_tokens_; }
  size_t num_slots() const { return slots_.size(); }
  int64_t num_blocks() const { return num_blocks_; }

 private:
  struct Slot {
    int64_t capacity;
    int64_t shared = 0;  // leading positions in blocks shared with the slot it forked from
    std::vector<int32_t> blocks;
  };
  // ceil(capacity / block size): the blocks the capacity fills.
  int64_t CapacityBlocks() const;
  // `need` blocks off the free list (growing the pools), each referenced once.
  absl::StatusOr<std::vector<int32_t>> TakeBlocks(int64_t need);
  // Makes the pools hold at least `blocks` blocks: twice as many as now where that is
  // needed, but never more than the capacity's blocks unless `blocks` itself is more (slots
  // round up to whole blocks).
  absl::Status Grow(int64_t blocks);

  ModelConfig config_;
  Backend* backend_;
  int64_t capacity_tokens_;
  int64_t block_size_;
  std::atomic<int64_t> reserved_tokens_{0};  // read by load reporting on other threads
  int next_slot_ = 0;
  std::map<int, Slot> slots_;
  int64_t num_blocks_ = 0;
  std::vector<int32_t> free_blocks_;  // a stack: the most recently freed first
  std::vector<int32_t> block_refs_;   // slots holding each block
  std::vector<Tensor> keys_, values_;
};

}  // namespace dxs
