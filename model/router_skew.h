// Router skew for random checkpoints (dxs gen-model --router-skew S): per-expert scales of
// each MoE layer's gate rows so that expert popularity follows a Zipf law of exponent S,
// expert 0 the most popular. Random weights route almost uniformly; EPLB needs skew to
// measure on.
//
// How: a token's gate logits are z_e = w_e . x. Over random rows they are, for one token,
// independent and alike up to the row norms; scaling row e by s_e widens z_e's spread, and
// the top-k picks the widest ones more often. ZipfRouterScales finds s by simulation:
// logits s_e * g_e (g iid standard normal, a fixed seeded sample) are routed top-k and the
// scales adjusted multiplicatively until each expert's share of the routed pairs is the
// target. The scales apply on top of the rows normalised to their mean norm.
//
// Targets: expert e's Zipf share (e + 1)^-S / sum_i (i + 1)^-S, except that no expert can
// take more than 1/k of the pairs (it is at most in every token's top-k): shares above 1/k
// are capped there and the rest renormalised (water-filling), so a large S on a top-8
// model saturates its first experts rather than failing.
//
// The real gate inputs are neither isotropic nor Gaussian (a shared component per sequence,
// heavier or lighter tails), so the simulated scales over- or undershoot; CalibrateRouterSkew
// (model/router_skew_calibration.h) refines them on the model itself, which gen-model does.
//
// Determinism: a fixed sample and iteration count, and scales rounded to 6 significant
// digits, so the same (E, k, S) gives the same scales run to run.
#pragma once

#include <vector>

namespace dxs {

// The target share of routed pairs per expert (sums to 1), as described above.
std::vector<double> ZipfRouterShares(int num_experts, int top_k, double skew);

// Per-expert gate-row scales realising ZipfRouterShares; all 1 when skew is 0.
std::vector<double> ZipfRouterScales(int num_experts, int top_k, double skew);

}  // namespace dxs
