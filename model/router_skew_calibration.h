// CalibrateRouterSkew: refines a skewed preset's gate scales (model/router_skew.h) on the
// model itself. Starting from ZipfRouterScales, each round runs the single-process CPU
// engine on a fixed set of seeded random prompts, measures each expert's share of the
// routed pairs (all MoE layers together) and moves the scales multiplicatively towards
// ZipfRouterShares. The result is stored in preset->router_scales, so that the checkpoint
// (WriteRandomCheckpoint) and the in-place weights (RandomWeightSource) both use it.
//
// Determinism: the prompts and rounds are fixed and the CPU engine is deterministic, so one
// build gives the same scales every run; a different BLAS may round a near tie of the
// router the other way and move a scale in its 6th digit. Cost: `rounds` short runs of the
// model on the CPU; for a model too big for that (more than ~2e8 expert weights) the
// simulated scales are kept.
#pragma once

#include "absl/status/status.h"
#include "model/random_checkpoint.h"

namespace dxs {

absl::Status CalibrateRouterSkew(CheckpointPreset* preset, int rounds = 8);

}  // namespace dxs
