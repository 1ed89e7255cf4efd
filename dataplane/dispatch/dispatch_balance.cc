#include "dataplane/dispatch/dispatch_balance.h"

#include <algorithm>

namespace dxs {

double DispatchBalanceRatio(const std::vector<int64_t>& num_tokens_per_rank,
                            const std::vector<bool>& in_step) {
  int64_t sum = 0, most = 0, num_ranks = 0;
  for (size_t r = 0; r < num_tokens_per_rank.size() && r < in_step.size(); ++r) {
    if (!in_step[r]) continue;
    ++num_ranks;
    sum += num_tokens_per_rank[r];
    most = std::max(most, num_tokens_per_rank[r]);
  }
  if (most <= 0) return 1;
  return static_cast<double>(sum) / static_cast<double>(num_ranks) / static_cast<double>(most);
}

}  // namespace dxs
