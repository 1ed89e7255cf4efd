// KvCache: per-sequence key/value storage for every layer, in fixed-capacity slots.
//
// A slot holds `capacity` positions of [kv_heads, head_dim] keys and values per layer.
// Capacity is counted in tokens over all live slots so that a server can refuse work that
// would not fit. Thread safety: not thread-safe; one scheduler thread owns it.
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
  KvCache(const ModelConfig& config, Backend* backend, int64_t capacity_tokens);

  // Reserves a slot for up to `max_tokens` positions; RESOURCE_EXHAUSTED if it can't fit.
  absl::StatusOr<int> Allocate(int64_t max_tokens);
  void Free(int slot);

  Tensor& keys(int slot, int layer) { return slots_.at(slot).keys[layer]; }
  Tensor& values(int slot, int layer) { return slots_.at(slot).values[layer]; }
  bool HasSlot(int slot) const { return slots_.count(slot) > 0; }
  int64_t slot_capacity(int slot) const { return slots_.at(slot).capacity; }

  int64_t capacity_tokens() const { return capacity_tokens_; }
  int64_t reserved_tokens() const { return reserved_tokens_; }
  size_t num_slots() const { return slots_.size(); }

 private:
  struct Slot {
    int64_t capacity;
    std::vector<Tensor> keys, values;
  };
  ModelConfig config_;
  Backend* backend_;
  int64_t capacity_tokens_;
  std::atomic<int64_t> reserved_tokens_{0};  // read by load reporting on other threads
  int next_slot_ = 0;
  std::map<int, Slot> slots_;
};

}  // namespace dxs
