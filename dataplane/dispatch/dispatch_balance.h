// How evenly one dispatch spread its tokens over the EP ranks of its step: what the
// attention worker's dxs_ep_balance_ratio histogram observes per MoE layer. EPLB's
// measure of a placement over a window of load is router/control_plane/eplb.h's
// BalanceRatio; this one is of a single exchange, as the data plane sees it.
#pragma once

#include <cstdint>
#include <vector>

namespace dxs {

// The balance ratio of one dispatch: mean over max of the tokens sent to the EP ranks that
// take part in its step (in_step[r]; ranks past its end do not). A rank outside the step
// holds no expert of the step's placement (dead, drained, or joined and not yet rebalanced
// onto) and receives nothing by design, so it is not counted. 1 when nothing was sent.
double DispatchBalanceRatio(const std::vector<int64_t>& num_tokens_per_rank,
                            const std::vector<bool>& in_step);

}  // namespace dxs
