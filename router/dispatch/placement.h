// ExpertPlacement: which EP rank holds each expert. Versioned data published by the
// router; the same for every MoE layer. One owner per expert for now (the data path reads
// `owner(e)`; redundant replicas can later choose among several without changing it).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace dxs {

class Placement {
 public:
  Placement() = default;
  // Contiguous blocks: rank r holds experts [r * E / N, (r + 1) * E / N).
  static Placement Contiguous(int num_experts, int num_ranks, uint64_t version = 1);
  // From per-rank expert lists; every expert exactly once, else INVALID_ARGUMENT naming
  // the overlapping or missing experts.
  static absl::StatusOr<Placement> FromRankExperts(int num_experts,
                                                   const std::vector<std::vector<int>>& experts,
                                                   uint64_t version = 1);

  int num_experts() const { return static_cast<int>(owner_.size()); }
  int num_ranks() const { return static_cast<int>(rank_experts_.size()); }
  uint64_t version() const { return version_; }
  int owner(int expert) const { return owner_[expert]; }
  const std::vector<int>& experts_of(int rank) const { return rank_experts_[rank]; }
  std::string DebugString() const;

 private:
  uint64_t version_ = 0;
  std::vector<int> owner_;
  std::vector<std::vector<int>> rank_experts_;
};

// Parses "0-3,5,7-8" into expert ids.
absl::StatusOr<std::vector<int>> ParseExpertList(const std::string& text);

}  // namespace dxs
