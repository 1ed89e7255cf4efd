#include "model/kv_cache.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"

namespace dxs {

KvCache::KvCache(const ModelConfig& config, Backend* backend, int64_t capacity_tokens,
                 int64_t block_size)
    : config_(config),
      backend_(backend),
      capacity_tokens_(capacity_tokens),
      block_size_(std::max<int64_t>(block_size, 1)),
      keys_(config.num_hidden_layers),
      values_(config.num_hidden_layers) {}

absl::Status KvCache::Grow(int64_t blocks) {
  if (blocks <= num_blocks_) return absl::OkStatus();
  const int64_t grown = std::max(blocks, 2 * num_blocks_);
  const std::vector<int64_t> shape = {grown, block_size_, config_.num_key_value_heads,
                                      config_.head_dim};
  for (int64_t l = 0; l < config_.num_hidden_layers; ++l) {
    for (Tensor* pool : {&keys_[l], &values_[l]}) {
      DXS_ASSIGN_OR_RETURN(Tensor bigger, backend_->Allocate(shape));
      if (num_blocks_ > 0) {
        Tensor head = bigger.Rows(0, num_blocks_);
        DXS_RETURN_IF_ERROR(backend_->Copy(*pool, &head));
      }
      *pool = std::move(bigger);
    }
  }
  for (int64_t b = grown - 1; b >= num_blocks_; --b)
    free_blocks_.push_back(static_cast<int32_t>(b));
  num_blocks_ = grown;
  return absl::OkStatus();
}

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
  const int64_t need = (max_tokens + block_size_ - 1) / block_size_;
  if (static_cast<int64_t>(free_blocks_.size()) < need) {
    DXS_RETURN_IF_ERROR(Grow(num_blocks_ + need - static_cast<int64_t>(free_blocks_.size())));
  }
  Slot slot;
  slot.capacity = max_tokens;
  slot.blocks.assign(free_blocks_.end() - need, free_blocks_.end());
  std::reverse(slot.blocks.begin(), slot.blocks.end());
  free_blocks_.resize(free_blocks_.size() - need);
  const int id = next_slot_++;
  slots_.emplace(id, std::move(slot));
  reserved_tokens_ += max_tokens;
  return id;
}

void KvCache::Free(int slot) {
  auto it = slots_.find(slot);
  if (it == slots_.end()) return;
  reserved_tokens_ -= it->second.capacity;
  const std::vector<int32_t>& blocks = it->second.blocks;
  free_blocks_.insert(free_blocks_.end(), blocks.rbegin(), blocks.rend());
  slots_.erase(it);
}

}  // namespace dxs
