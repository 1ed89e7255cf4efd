// Token sampling on the host: greedy, or temperature -> top-k -> top-p -> draw, as
// transformers' generate() orders its logits warpers. The one implementation behind the
// host sampler (model/sampler.h) and the CPU backend's SampleRows; the CUDA kernel
// (kernels/cuda/sampling.cu) is held to it in tests.
//
// Determinism: the draw is counter-based. Draw k of a request with seed s is
// SplitMix64 output k of s (common/splitmix64.h), computed on its own from (s, k), so a
// token depends only on its logits, its parameters and how many tokens the request has
// sampled before it: the same on every machine and backend, with no generator state.
#pragma once

#include <cstdint>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "kernels/sampling_row.h"

namespace dxs {

struct SamplingParams {
  float temperature = 0.f;  // 0 = greedy
  float top_p = 1.f;        // in (0, 1]
  int32_t top_k = 0;        // 0 = off
  uint64_t seed = 0;
};

absl::Status ValidateSamplingParams(const SamplingParams& p);

// The backend row of `p` for its draw number `draw`, and back.
SamplingRow ToSamplingRow(const SamplingParams& p, uint64_t draw);
SamplingParams FromSamplingRow(const SamplingRow& row);

// Index of the largest logit; ties go to the lowest id (as torch.argmax does).
int32_t Argmax(const float* logits, int64_t vocab);

// Uniform in [0, 1) (53 random bits) of draw `draw` of the stream seeded with `seed`.
double SamplingUniform(uint64_t seed, uint64_t draw);

// Reused between calls so that sampling allocates only when the vocabulary grows.
struct SamplingScratch {
  std::vector<std::pair<float, int32_t>> candidates;
  std::vector<double> weights;
};

// The token of one row of logits: Argmax when p.temperature is 0; else logits / temperature
// in float, candidates in descending order (ties by lower id), the top_k first (0: all),
// then the smallest prefix whose probability mass reaches top_p (at least one), and the
// first candidate whose cumulative weight exceeds SamplingUniform(seed, draw) * the kept
// weight. Weights are exp(l - max) in double, summed in candidate order. `p` must be valid.
int32_t SampleToken(const float* logits, int64_t vocab, const SamplingParams& p, uint64_t draw,
                    SamplingScratch* scratch);

}  // namespace dxs
