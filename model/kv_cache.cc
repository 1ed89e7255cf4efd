#include "model/kv_cache.h"

#include "absl/strings/str_cat.h"

namespace dxs {

KvCache::KvCache(const ModelConfig& config, Backend* backend, int64_t capacity_tokens)
    : config_(config), backend_(backend), capacity_tokens_(capacity_tokens) {}

absl::StatusOr<int> KvCache::Allocate(int64_t max_tokens) {
  if (max_tokens <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("KV slot size must be positive, got ", max_tokens));
  }
  if (reserved_tokens_ + max_tokens > capacity_tokens_) {
    return absl::ResourceExhaustedError(
        absl::StrCat("KV cache full: ", max_tokens, " tokens requested, ",
                     capacity_tokens_ - reserved_tokens_, " of ", capacity_tokens_, " free"));
  }
  Slot slot;
  slot.capacity = max_tokens;
  for (int64_t l = 0; l < config_.num_hidden_layers; ++l) {
    slot.keys.push_back(
        backend_->Allocate({max_tokens, config_.num_key_value_heads, config_.head_dim}));
    slot.values.push_back(
        backend_->Allocate({max_tokens, config_.num_key_value_heads, config_.head_dim}));
  }
  const int id = next_slot_++;
  slots_.emplace(id, std::move(slot));
  reserved_tokens_ += max_tokens;
  return id;
}

void KvCache::Free(int slot) {
  auto it = slots_.find(slot);
  if (it == slots_.end()) return;
  reserved_tokens_ -= it->second.capacity;
  slots_.erase(it);
}

}  // namespace dxs
