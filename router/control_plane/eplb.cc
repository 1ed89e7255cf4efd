#include "router/control_plane/eplb.h"

#include <algorithm>
#include <cmath>
#include <numeric>

#include "absl/strings/str_cat.h"

namespace dxs {

absl::StatusOr<Placement> BalancedPlacement(const std::vector<double>& load, int num_ranks,
                                            int num_redundant, uint64_t version) {
  const int num_experts = static_cast<int>(load.size());
  if (num_experts == 0 || num_ranks <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("eplb: ", num_experts, " experts over ", num_ranks, " ranks"));
  }
  for (int e = 0; e < num_experts; ++e) {
    if (!(load[e] >= 0) || std::isinf(load[e])) {
      return absl::InvalidArgumentError(absl::StrCat("eplb: expert ", e, " has load ", load[e]));
    }
  }
  const int64_t max_redundant = int64_t{num_experts} * (num_ranks - 1);
  if (num_redundant < 0 || num_redundant > max_redundant) {
    return absl::InvalidArgumentError(absl::StrCat("eplb: ", num_redundant,
                                                   " redundant experts, at most ", max_redundant,
                                                   " for ", num_experts, " over ", num_ranks));
  }
  // 1. Replicate.
  std::vector<int> copies(num_experts, 1);
  for (int k = 0; k < num_redundant; ++k) {
    int best = -1;
    for (int e = 0; e < num_experts; ++e) {
      if (copies[e] >= num_ranks) continue;
      if (best < 0 || load[e] / copies[e] > load[best] / copies[best]) best = e;
    }
    ++copies[best];  // exists: fewer than E * N slots are taken
  }
  // 2. Pack, heaviest replica first.
  struct Item {
    double weight;
    int expert;
  };
  std::vector<Item> items;
  for (int e = 0; e < num_experts; ++e) {
    for (int c = 0; c < copies[e]; ++c) items.push_back({load[e] / copies[e], e});
  }
  std::stable_sort(items.begin(), items.end(), [](const Item& a, const Item& b) {
    return a.weight > b.weight || (a.weight == b.weight && a.expert < b.expert);
  });
  const int slots = static_cast<int>(items.size());
  std::vector<int> capacity(num_ranks, slots / num_ranks);
  for (int r = 0; r < slots % num_ranks; ++r) ++capacity[r];
  std::vector<double> rank_load(num_ranks, 0);
  std::vector<int> used(num_ranks, 0);
  std::vector<std::vector<int>> ranks(num_experts);  // per expert, in placing order
  auto holds = [&](int r, int e) {
    return std::find(ranks[e].begin(), ranks[e].end(), r) != ranks[e].end();
  };
  for (const Item& item : items) {
    int best = -1;
    for (bool respect_capacity : {true, false}) {
      for (int r = 0; r < num_ranks; ++r) {
        if (holds(r, item.expert) || (respect_capacity && used[r] >= capacity[r])) continue;
        if (best < 0 || rank_load[r] < rank_load[best] ||
            (rank_load[r] == rank_load[best] && used[r] < used[best])) {
          best = r;
        }
      }
      if (best >= 0) break;
    }
    // A rank without the expert always exists: copies[e] <= num_ranks.
    ranks[item.expert].push_back(best);
    rank_load[best] += item.weight;
    ++used[best];
  }
  return Placement::FromExpertRanks(num_ranks, ranks, version);
}

std::vector<double> RankLoads(const Placement& placement, const std::vector<double>& load) {
  std::vector<double> out(placement.num_ranks(), 0);
  for (int e = 0; e < placement.num_experts() && e < static_cast<int>(load.size()); ++e) {
    const double share = load[e] / placement.num_replicas(e);
    for (int r : placement.replicas(e)) out[r] += share;
  }
  return out;
}

double BalanceRatio(const std::vector<double>& rank_loads) {
  if (rank_loads.empty()) return 1;
  const double max = *std::max_element(rank_loads.begin(), rank_loads.end());
  if (max <= 0) return 1;
  const double mean =
      std::accumulate(rank_loads.begin(), rank_loads.end(), 0.0) / rank_loads.size();
  return mean / max;
}

}  // namespace dxs
