#include "model/sampler.h"

#include <algorithm>
#include <cmath>

#include "absl/strings/str_cat.h"

namespace dxs {

absl::Status ValidateSamplingParams(const SamplingParams& p) {
  if (!(p.temperature >= 0.f) || std::isinf(p.temperature)) {
    return absl::InvalidArgumentError(
        absl::StrCat("temperature must be a finite value >= 0, got ", p.temperature));
  }
  if (!(p.top_p > 0.f && p.top_p <= 1.f)) {
    return absl::InvalidArgumentError(absl::StrCat("top_p must be in (0, 1], got ", p.top_p));
  }
  if (p.top_k < 0) {
    return absl::InvalidArgumentError(absl::StrCat("top_k must be >= 0, got ", p.top_k));
  }
  return absl::OkStatus();
}

int32_t Argmax(const float* logits, int64_t vocab) {
  int64_t best = 0;
  for (int64_t i = 1; i < vocab; ++i) {
    if (logits[i] > logits[best]) best = i;
  }
  return static_cast<int32_t>(best);
}

int32_t Sampler::Sample(const float* logits, int64_t vocab) {
  if (params_.temperature == 0.f) return Argmax(logits, vocab);
  scratch_.resize(vocab);
  for (int64_t i = 0; i < vocab; ++i) {
    scratch_[i] = {logits[i] / params_.temperature, static_cast<int32_t>(i)};
  }
  // Descending by logit, ties by id, so the candidate order is fully determined.
  auto by_logit = [](const std::pair<float, int32_t>& a, const std::pair<float, int32_t>& b) {
    return a.first > b.first || (a.first == b.first && a.second < b.second);
  };
  int64_t keep = vocab;
  if (params_.top_k > 0 && params_.top_k < vocab) {
    keep = params_.top_k;
    std::partial_sort(scratch_.begin(), scratch_.begin() + keep, scratch_.end(), by_logit);
  } else {
    std::sort(scratch_.begin(), scratch_.end(), by_logit);
  }
  const float max_logit = scratch_[0].first;
  std::vector<double> probs(keep);
  double sum = 0;
  for (int64_t i = 0; i < keep; ++i) {
    probs[i] = std::exp(static_cast<double>(scratch_[i].first - max_logit));
    sum += probs[i];
  }
  // Top-p: the smallest prefix whose mass reaches top_p (at least one token).
  if (params_.top_p < 1.f) {
    double mass = 0;
    int64_t cut = keep;
    for (int64_t i = 0; i < keep; ++i) {
      mass += probs[i] / sum;
      if (mass >= params_.top_p) {
        cut = i + 1;
        break;
      }
    }
    keep = cut;
    sum = 0;
    for (int64_t i = 0; i < keep; ++i) sum += probs[i];
  }
  const double r = rng_.NextDouble() * sum;
  double acc = 0;
  for (int64_t i = 0; i < keep; ++i) {
    acc += probs[i];
    if (r < acc) return scratch_[i].second;
  }
  return scratch_[keep - 1].second;
}

}  // namespace dxs
