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

int64_t KvCache::CapacityBlocks() const {
  return (capacity_tokens_ + block_size_ - 1) / block_size_;
}

absl::Status KvCache::Preallocate() { return Grow(CapacityBlocks()); }

absl::Status KvCache::Grow(int64_t blocks) {
  if (blocks <= num_blocks_) return absl::OkStatus();
  // Doubling keeps growths few; past the capacity it would only hold memory no slot can take.
  const int64_t grown = std::max(blocks, std::min(2 * num_blocks_, CapacityBlocks()));
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
  block_refs_.resize(grown, 0);
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
  Slot slot;
  slot.capacity = max_tokens;
  DXS_ASSIGN_OR_RETURN(slot.blocks, TakeBlocks((max_tokens + block_size_ - 1) / block_size_));
  const int id = next_slot_++;
  slots_.emplace(id, std::move(slot));
  reserved_tokens_ += max_tokens;
  return id;
}

absl::StatusOr<std::vector<int32_t>> KvCache::TakeBlocks(int64_t need) {
  if (static_cast<int64_t>(free_blocks_.size()) < need) {
    DXS_RETURN_IF_ERROR(Grow(num_blocks_ + need - static_cast<int64_t>(free_blocks_.size())));
  }
  std::vector<int32_t> blocks(free_blocks_.rbegin(), free_blocks_.rbegin() + need);
  free_blocks_.resize(free_blocks_.size() - need);
  for (int32_t b : blocks) block_refs_[b] = 1;
  return blocks;
}

absl::StatusOr<int> KvCache::Fork(int parent, int64_t shared_tokens, int64_t max_tokens) {
  auto it = slots_.find(parent);
  if (it == slots_.end())
    return absl::InvalidArgumentError(absl::StrCat("unknown KV slot ", parent));
  if (shared_tokens < 0 || shared_tokens > it->second.capacity || shared_tokens > max_tokens) {
    return absl::InvalidArgumentError(absl::StrCat("a fork of ", shared_tokens, " of slot ", parent,
                                                   "'s ", it->second.capacity, " positions into ",
                                                   max_tokens));
  }
  const int64_t whole = shared_tokens / block_size_;
  const int64_t own = max_tokens - whole * block_size_;  // positions in the child's own blocks
  if (reserved_tokens_ + own > capacity_tokens_) {
    return absl::ResourceExhaustedError(
        absl::StrCat("KV cache full: a fork needs ", own, " tokens, ",
                     capacity_tokens_ - reserved_tokens_, " of ", capacity_tokens_, " free"));
  }
  DXS_ASSIGN_OR_RETURN(std::vector<int32_t> fresh,
                       TakeBlocks((own + block_size_ - 1) / block_size_));
  const std::vector<int32_t>& from = it->second.blocks;
  if (shared_tokens % block_size_ != 0) {
    const int32_t src = from[whole], dst = fresh.front();
    for (int64_t l = 0; l < config_.num_hidden_layers; ++l) {
      for (Tensor* pool : {&keys_[l], &values_[l]}) {
        Tensor to = pool->Rows(dst, 1);
        DXS_RETURN_IF_ERROR(backend_->Copy(pool->Rows(src, 1), &to));
      }
    }
  }
  Slot slot;
  slot.capacity = max_tokens;
  slot.shared = whole * block_size_;
  slot.blocks.assign(from.begin(), from.begin() + whole);
  for (int32_t b : slot.blocks) ++block_refs_[b];
  slot.blocks.insert(slot.blocks.end(), fresh.begin(), fresh.end());
  const int id = next_slot_++;
  slots_.emplace(id, std::move(slot));
  reserved_tokens_ += own;
  return id;
}

void KvCache::Free(int slot) {
  auto it = slots_.find(slot);
  if (it == slots_.end()) return;
  reserved_tokens_ -= it->second.capacity - it->second.shared;
  const std::vector<int32_t>& blocks = it->second.blocks;
  for (auto b = blocks.rbegin(); b != blocks.rend(); ++b) {
    if (--block_refs_[*b] == 0) free_blocks_.push_back(*b);
  }
  slots_.erase(it);
}

}  // namespace dxs
