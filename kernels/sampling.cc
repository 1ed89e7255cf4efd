#include "kernels/sampling.h"

#include <algorithm>
#include <cmath>

#include "absl/strings/str_cat.h"
#include "common/splitmix64.h"

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

SamplingRow ToSamplingRow(const SamplingParams& p, uint64_t draw) {
  return SamplingRow{p.temperature, p.top_p, p.top_k, 0, p.seed, draw};
}

SamplingParams FromSamplingRow(const SamplingRow& row) {
  return SamplingParams{row.temperature, row.top_p, row.top_k, row.seed};
}

int32_t Argmax(const float* logits, int64_t vocab) {
  int64_t best = 0;
  for (int64_t i = 1; i < vocab; ++i) {
    if (logits[i] > logits[best]) best = i;
  }
  return static_cast<int32_t>(best);
}

double SamplingUniform(uint64_t seed, uint64_t draw) {
  return SplitMix64Unit(SplitMix64At(seed, draw));
}

int32_t SampleToken(const float* logits, int64_t vocab, const SamplingParams& p, uint64_t draw,
                    SamplingScratch* scratch) {
  if (p.temperature == 0.f) return Argmax(logits, vocab);
  std::vector<std::pair<float, int32_t>>& cand = scratch->candidates;
  cand.resize(vocab);
  for (int64_t i = 0; i < vocab; ++i) {
    cand[i] = {logits[i] / p.temperature, static_cast<int32_t>(i)};
  }
  // Descending by logit, ties by id, so the candidate order is fully determined.
  auto by_logit = [](const std::pair<float, int32_t>& a, const std::pair<float, int32_t>& b) {
    return a.first > b.first || (a.first == b.first && a.second < b.second);
  };
  int64_t keep = vocab;
  if (p.top_k > 0 && p.top_k < vocab) {
    keep = p.top_k;
    std::partial_sort(cand.begin(), cand.begin() + keep, cand.end(), by_logit);
  } else {
    std::sort(cand.begin(), cand.end(), by_logit);
  }
  const float max_logit = cand[0].first;
  std::vector<double>& w = scratch->weights;
  w.resize(keep);
  double sum = 0;
  for (int64_t i = 0; i < keep; ++i) {
    w[i] = std::exp(static_cast<double>(cand[i].first - max_logit));
    sum += w[i];
  }
  // Top-p: the smallest prefix whose mass reaches top_p (at least one token).
  if (p.top_p < 1.f) {
    double mass = 0;
    int64_t cut = keep;
    for (int64_t i = 0; i < keep; ++i) {
      mass += w[i] / sum;
      if (mass >= p.top_p) {
        cut = i + 1;
        break;
      }
    }
    keep = cut;
    sum = 0;
    for (int64_t i = 0; i < keep; ++i) sum += w[i];
  }
  const double r = SamplingUniform(p.seed, draw) * sum;
  double acc = 0;
  for (int64_t i = 0; i < keep; ++i) {
    acc += w[i];
    if (r < acc) return cand[i].second;
  }
  return cand[keep - 1].second;
}

}  // namespace dxs
