// EPLB: a placement from measured expert load. Two steps, as DeepSeek's EPLB
// frames the problem (this is our own greedy, not their code):
//   1. Replicate: the num_redundant extra slots go, one at a time, to the expert whose
//      replicas carry the most load each (load / copies; ties: the lower expert), never
//      more copies than ranks.
//   2. Pack: the replicas, heaviest first (ties: lower expert), each to the least-loaded
//      rank that does not hold that expert yet and has a free slot; ranks get
//      ceil((E + R) / N) or floor(...) slots, the larger ones to the lower ranks, so memory
//      stays even. A replica that finds no such rank (only ranks holding its expert have
//      slots left) takes the least-loaded rank without its expert, one slot over.
// A replica carries load / copies: the dispatch engine spreads an expert's pairs evenly
// over its replicas (Placement::ChooseRank). The primary of an expert is the rank its
// heaviest (first-placed) replica went to.
// Control plane: the router's rebalancer (rebalancer.h) runs it and publishes the result;
// the workers only follow the placement they are given (dataplane/dispatch/placement.h).
#pragma once

#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "dataplane/dispatch/placement.h"

namespace dxs {

// load[e]: tokens routed to expert e over the measured window (any non-negative scale).
// INVALID_ARGUMENT for no experts, no ranks, a negative or non-finite load, or
// num_redundant outside [0, E * (N - 1)].
absl::StatusOr<Placement> BalancedPlacement(const std::vector<double>& load, int num_ranks,
                                            int num_redundant, uint64_t version = 1);

// Per EP rank, the load a placement gives it (each expert's load split evenly over its
// replicas), and the balance ratio mean / max of those (1 when even; 1 when all are 0).
std::vector<double> RankLoads(const Placement& placement, const std::vector<double>& load);
double BalanceRatio(const std::vector<double>& rank_loads);

}  // namespace dxs
