// Token sampling: greedy, or temperature -> top-k -> top-p -> draw, as transformers'
// generate() orders its logits warpers. A seeded sampler is deterministic: the same seed
// and logits give the same tokens on every machine (own PRNG, no std distributions).
#pragma once

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "common/splitmix64.h"

namespace dxs {

struct SamplingParams {
  float temperature = 0.f;  // 0 = greedy
  float top_p = 1.f;        // in (0, 1]
  int32_t top_k = 0;        // 0 = off
  uint64_t seed = 0;
};

absl::Status ValidateSamplingParams(const SamplingParams& p);

// SplitMix64: small, fast, and the same everywhere.
class SplitMix64 {
 public:
  explicit SplitMix64(uint64_t seed) : state_(seed) {}
  uint64_t Next() { return SplitMix64Next(&state_); }
  // Uniform in [0, 1) with 53 random bits.
  double NextDouble() { return static_cast<double>(Next() >> 11) * 0x1.0p-53; }

 private:
  uint64_t state_;
};

class Sampler {
 public:
  explicit Sampler(const SamplingParams& params) : params_(params), rng_(params.seed) {}
  int32_t Sample(const float* logits, int64_t vocab);

 private:
  SamplingParams params_;
  SplitMix64 rng_;
  std::vector<std::pair<float, int32_t>> scratch_;
};

// Index of the largest logit; ties go to the lowest id (as torch.argmax does).
int32_t Argmax(const float* logits, int64_t vocab);

}  // namespace dxs
