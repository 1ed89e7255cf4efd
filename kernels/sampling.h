// Token sampling on the host: the request's logit adjustments (logit_bias, the
// min_new_tokens mask, then the repetition, frequency and presence penalties, in vLLM's
// order), then greedy, or temperature -> top-k -> top-p -> min_p -> draw, as transformers'
// generate() orders its logits warpers. The one implementation behind the host sampler
// (model/sampler.h) and the CPU backend's SampleRows; the CUDA kernel
// (kernels/cuda/sampling.cu) is held to it in tests.
//
// Log-probabilities (TokenLogprobs) are the model's own distribution: log_softmax of the
// raw logits, before adjustments, temperature and truncation (vLLM's default,
// "raw_logprobs"), so that a score does not depend on how the token was sampled.
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
  // Keep tokens whose probability (after temperature) is at least min_p times the most
  // likely one's. In [0, 1]; 0 = off.
  float min_p = 0.f;
  // Multiplicative, over prompt and output (transformers' and SGLang's): a seen token's
  // logit l becomes l / r if l > 0, else l * r. > 0; 1 = off.
  float repetition_penalty = 1.f;
  // OpenAI's, over the output: l -= frequency_penalty * count + presence_penalty * (count > 0).
  // Each in [-2, 2]; 0 = off.
  float frequency_penalty = 0.f;
  float presence_penalty = 0.f;
  // token id -> bias added to its logit, in [-100, 100]; ids distinct and in the vocabulary
  // (ValidateLogitBias).
  std::vector<std::pair<int32_t, float>> logit_bias;

  // Whether sampling reads anything but the raw logits and the first four fields.
  bool HasAdjustments() const {
    return min_p != 0.f || repetition_penalty != 1.f || frequency_penalty != 0.f ||
           presence_penalty != 0.f || !logit_bias.empty();
  }
};

// INVALID_ARGUMENT naming the field for a value outside its domain (NaN and inf included).
absl::Status ValidateSamplingParams(const SamplingParams& p);
// The logit_bias ids against the vocabulary, and their biases: INVALID_ARGUMENT naming the id.
absl::Status ValidateLogitBias(const SamplingParams& p, int64_t vocab);

// The row's logits changed in place by `adjustments` (distinct tokens, in the vocabulary):
// a banned token becomes -inf; otherwise, in this order, bias is added, the repetition
// penalty applies to a seen token, and the frequency and presence penalties subtract.
void ApplyLogitAdjustments(const SamplingParams& p, const LogitAdjustment* adjustments, size_t n,
                           float* row);

// Backend::CountPendingTokens for one row, its adjustments [0, n): when the last is
// kAdjustPending, `token` is counted into its entry among the others (output count + 1,
// seen), or the pending entry becomes its entry (count 1, seen). Otherwise nothing changes.
void CountPendingToken(int32_t token, LogitAdjustment* adjustments, size_t n);

// The backend row of `p` for its draw number `draw` (with the row's adjustments at
// [adjust_begin, adjust_begin + adjust_count) of the step's list), and back (without
// logit_bias, which travels in the adjustments).
SamplingRow ToSamplingRow(const SamplingParams& p, uint64_t draw, int32_t adjust_begin = 0,
                          int32_t adjust_count = 0);
SamplingParams FromSamplingRow(const SamplingRow& row);

// Index of the largest logit; ties go to the lowest id (as torch.argmax does).
int32_t Argmax(const float* logits, int64_t vocab);

// The seed of sample `sample` of a request with n samples: `seed` itself for sample 0 (so
// n = 1 is unchanged), else SplitMix64 output 2^63 + sample of `seed`'s stream (an output
// no request ever draws: it would take 2^63 tokens).
uint64_t SampleSeed(uint64_t seed, int32_t sample);

// Uniform in [0, 1) (53 random bits) of draw `draw` of the stream seeded with `seed`.
double SamplingUniform(uint64_t seed, uint64_t draw);

// Reused between calls so that sampling allocates only when the vocabulary grows.
struct SamplingScratch {
  std::vector<std::pair<float, int32_t>> candidates;
  std::vector<double> weights;
  int64_t keep = 0;          // candidates kept by the cuts (PrepareCandidates)
  double kept_weight = 0.0;  // their summed weight
};

// The token of one row of logits (already adjusted): Argmax when p.temperature is 0; else
// logits / temperature in float, candidates in descending order (ties by lower id), the
// top_k first (0: all), then the smallest prefix whose probability mass reaches top_p (at
// least one), then those whose weight is at least min_p times the first's, and the first
// candidate whose cumulative weight exceeds SamplingUniform(seed, draw) * the kept weight.
// Weights are exp(l - max) in double, summed in candidate order. `p` must be valid.
int32_t SampleToken(const float* logits, int64_t vocab, const SamplingParams& p, uint64_t draw,
                    SamplingScratch* scratch);
// SampleToken's two halves for a temperature > 0: the row's kept candidates and weights,
// which do not depend on the seed or the draw (so samples of one row, differing only in
// their streams, prepare once), and the draw from them.
void PrepareCandidates(const float* logits, int64_t vocab, const SamplingParams& p,
                       SamplingScratch* scratch);
int32_t DrawCandidate(const SamplingScratch& scratch, const SamplingParams& p, uint64_t draw);

// The most alternatives a request may ask for per position (OpenAI's limit).
inline constexpr int32_t kMaxTopLogprobs = 20;

// Log-probabilities at one position, from the raw logits (log_softmax, computed in double).
struct TokenLogprobs {
  int32_t token = -1;  // the chosen token (-1: none, a distribution only)
  float logprob = 0.f;
  // The top_n most likely tokens, most likely first (equal ones by lower id).
  std::vector<std::pair<int32_t, float>> top;
  // The request's logprob_token_ids, in its order.
  std::vector<float> named;
};

// log_softmax of `logits` at `token` (if >= 0), its top_n and the `named` ids, into `out`.
void RowLogprobs(const float* logits, int64_t vocab, int32_t token, int32_t top_n,
                 const std::vector<int32_t>& named, TokenLogprobs* out);

}  // namespace dxs
