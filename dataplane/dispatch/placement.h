// ExpertPlacement: which EP ranks hold each expert. Versioned data published by the
// router; the same for every MoE layer. An expert has one or more replicas on distinct
// ranks; the first is its primary (`owner(e)`). With one replica each (no redundant
// experts) every pair goes to the owner, as before replicas existed.
//
// Replica choice (the dispatch engine's rule, the same on every DP rank and every
// backend): the pair of token row t with expert e goes to
//     S_e[t mod |S_e|],  S_e = e's replicas' ranks in ascending order.
// It depends only on the row within the step's batch and the expert, so each pair reaches
// exactly one replica (the single reduction stage stays single), runs repeat, and the
// tokens of a batch spread evenly over an expert's replicas. Because the index depends on
// the row and not on the top-k slot, and the ranks are taken in rank order whatever the
// primary, a token whose experts have the same replica set goes to one rank for all of
// them (one row on the wire, not one per replica).
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
  // From per-expert replica lists (ExpertReplicas.ep_ranks: the primary first). Every expert
  // needs at least one rank, all below num_ranks and distinct, else INVALID_ARGUMENT.
  static absl::StatusOr<Placement> FromExpertRanks(int num_ranks,
                                                   const std::vector<std::vector<int>>& ranks,
                                                   uint64_t version = 1);
  // The contiguous blocks plus `num_redundant` extra expert slots (vLLM's
  // --num-redundant-experts), placed deterministically, slot by slot: among the experts
  // with the fewest copies, the one whose emptiest rank not holding it has the fewest
  // experts gets a copy there (ties: the lower expert, then the lower rank). So replicas
  // spread evenly over experts and ranks, replicas of one expert are on distinct ranks,
  // and with num_redundant >= num_experts every expert has a copy on a second rank.
  // 0 <= num_redundant <= E * (N - 1) (every rank holding every expert), else
  // INVALID_ARGUMENT. Load-blind: EPLB replaces it with a placement by measured load.
  static absl::StatusOr<Placement> WithRedundantExperts(int num_experts, int num_ranks,
                                                        int num_redundant, uint64_t version = 1);

  int num_experts() const { return static_cast<int>(replicas_.size()); }
  int num_ranks() const { return static_cast<int>(rank_experts_.size()); }
  uint64_t version() const { return version_; }
  // The primary replica's rank.
  int owner(int expert) const { return replicas_[expert][0]; }
  // EP ranks holding `expert`, primary first.
  const std::vector<int>& replicas(int expert) const { return replicas_[expert]; }
  int num_replicas(int expert) const { return static_cast<int>(replicas_[expert].size()); }
  // The most replicas any expert has (1 without redundant experts; 0 when empty).
  int max_replicas() const;
  // Physical expert slots: the sum of num_replicas over experts.
  int num_slots() const;
  // Experts held by `rank` (primaries and replicas), ascending.
  const std::vector<int>& experts_of(int rank) const { return rank_experts_[rank]; }
  // The replica choice above: the rank that computes the pair (row, expert).
  int ChooseRank(int64_t row, int expert) const {
    const std::vector<int>& r = choice_[expert];
    return r[static_cast<size_t>(row % static_cast<int64_t>(r.size()))];
  }
  // What ComputeDispatchLayout takes as expert_owner: [E] (the owners) when every expert
  // has one replica, else [E, max_replicas] row-major, each row the expert's ranks in
  // ascending order, then -1.
  std::vector<int32_t> RankTable() const;
  std::string DebugString() const;

 private:
  uint64_t version_ = 0;
  std::vector<std::vector<int>> replicas_;  // primary first
  std::vector<std::vector<int>> choice_;    // the same, ascending: the replica choice's order
  std::vector<std::vector<int>> rank_experts_;
};

// Parses "0-3,5,7-8" into expert ids.
absl::StatusOr<std::vector<int>> ParseExpertList(const std::string& text);

}  // namespace dxs
