// The host sampler: one request's SamplingParams applied to logits rows on the host
// (kernels/sampling.h has the semantics). Stateless apart from scratch: the caller names
// which draw of the request's stream a token uses (the number it sampled before), so the
// same token comes whether a step samples here or on the backend (Backend::SampleRows).
#pragma once

#include <cstdint>

#include "common/splitmix64.h"
#include "kernels/sampling.h"

namespace dxs {

// SplitMix64 as a sequential generator: small, fast, and the same everywhere.
class SplitMix64 {
 public:
  explicit SplitMix64(uint64_t seed) : state_(seed) {}
  uint64_t Next() { return SplitMix64Next(&state_); }
  // Uniform in [0, 1) with 53 random bits.
  double NextDouble() { return SplitMix64Unit(Next()); }

 private:
  uint64_t state_;
};

class Sampler {
 public:
  explicit Sampler(const SamplingParams& params) : params_(params) {}
  // The token of `logits` for draw number `draw` of the request (SampleToken).
  int32_t Sample(const float* logits, int64_t vocab, uint64_t draw) {
    return SampleToken(logits, vocab, params_, draw, &scratch_);
  }
  const SamplingParams& params() const { return params_; }

 private:
  SamplingParams params_;
  SamplingScratch scratch_;
};

}  // namespace dxs
