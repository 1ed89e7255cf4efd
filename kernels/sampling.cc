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
  if (!(p.min_p >= 0.f && p.min_p <= 1.f)) {
    return absl::InvalidArgumentError(absl::StrCat("min_p must be in [0, 1], got ", p.min_p));
  }
  if (!(p.repetition_penalty > 0.f) || std::isinf(p.repetition_penalty)) {
    return absl::InvalidArgumentError(
        absl::StrCat("repetition_penalty must be a finite value > 0, got ", p.repetition_penalty));
  }
  if (!(p.frequency_penalty >= -2.f && p.frequency_penalty <= 2.f)) {
    return absl::InvalidArgumentError(
        absl::StrCat("frequency_penalty must be in [-2, 2], got ", p.frequency_penalty));
  }
  if (!(p.presence_penalty >= -2.f && p.presence_penalty <= 2.f)) {
    return absl::InvalidArgumentError(
        absl::StrCat("presence_penalty must be in [-2, 2], got ", p.presence_penalty));
  }
  return absl::OkStatus();
}

absl::Status ValidateLogitBias(const SamplingParams& p, int64_t vocab) {
  std::vector<int32_t> ids;
  for (const auto& [id, bias] : p.logit_bias) {
    if (id < 0 || id >= vocab) {
      return absl::InvalidArgumentError(
          absl::StrCat("logit_bias: token id ", id, " is outside the vocabulary [0, ", vocab, ")"));
    }
    if (!(bias >= -100.f && bias <= 100.f)) {
      return absl::InvalidArgumentError(absl::StrCat("logit_bias: the bias of token ", id,
                                                     " must be in [-100, 100], got ", bias));
    }
    ids.push_back(id);
  }
  std::sort(ids.begin(), ids.end());
  if (auto dup = std::adjacent_find(ids.begin(), ids.end()); dup != ids.end()) {
    return absl::InvalidArgumentError(
        absl::StrCat("logit_bias: token id ", *dup, " is given more than once"));
  }
  return absl::OkStatus();
}

void ApplyLogitAdjustments(const SamplingParams& p, const LogitAdjustment* adjustments, size_t n,
                           float* row) {
  for (size_t i = 0; i < n; ++i) {
    const LogitAdjustment& a = adjustments[i];
    float& l = row[a.token];
    if (a.flags & kAdjustBanned) {
      l = -INFINITY;
      continue;
    }
    l += a.bias;
    if ((a.flags & kAdjustSeen) && p.repetition_penalty != 1.f) {
      l = l > 0.f ? l / p.repetition_penalty : l * p.repetition_penalty;
    }
    l -= p.frequency_penalty * static_cast<float>(a.output_count);
    if (a.output_count > 0) l -= p.presence_penalty;
  }
}

void CountPendingToken(int32_t token, LogitAdjustment* adjustments, size_t n) {
  if (n == 0 || (adjustments[n - 1].flags & kAdjustPending) == 0) return;
  for (size_t i = 0; i + 1 < n; ++i) {
    if (adjustments[i].token == token) {
      ++adjustments[i].output_count;
      adjustments[i].flags |= kAdjustSeen;
      return;
    }
  }
  adjustments[n - 1] = LogitAdjustment{token, 1, 0.f, kAdjustSeen};
}

SamplingRow ToSamplingRow(const SamplingParams& p, uint64_t draw, int32_t adjust_begin,
                          int32_t adjust_count) {
  SamplingRow row{};
  row.temperature = p.temperature;
  row.top_p = p.top_p;
  row.top_k = p.top_k;
  row.min_p = p.min_p;
  row.repetition_penalty = p.repetition_penalty;
  row.frequency_penalty = p.frequency_penalty;
  row.presence_penalty = p.presence_penalty;
  row.adjust_begin = adjust_begin;
  row.adjust_count = adjust_count;
  row.seed = p.seed;
  row.draw = draw;
  return row;
}

SamplingParams FromSamplingRow(const SamplingRow& row) {
  SamplingParams p;
  p.temperature = row.temperature;
  p.top_p = row.top_p;
  p.top_k = row.top_k;
  p.seed = row.seed;
  p.min_p = row.min_p;
  p.repetition_penalty = row.repetition_penalty;
  p.frequency_penalty = row.frequency_penalty;
  p.presence_penalty = row.presence_penalty;
  return p;
}

int32_t Argmax(const float* logits, int64_t vocab) {
  int64_t best = 0;
  for (int64_t i = 1; i < vocab; ++i) {
    if (logits[i] > logits[best]) best = i;
  }
  return static_cast<int32_t>(best);
}

uint64_t SampleSeed(uint64_t seed, int32_t sample) {
  if (sample == 0) return seed;
  return SplitMix64At(seed, (uint64_t{1} << 63) + static_cast<uint64_t>(sample));
}

double SamplingUniform(uint64_t seed, uint64_t draw) {
  return SplitMix64Unit(SplitMix64At(seed, draw));
}

int32_t SampleToken(const float* logits, int64_t vocab, const SamplingParams& p, uint64_t draw,
                    SamplingScratch* scratch) {
  if (p.temperature == 0.f) return Argmax(logits, vocab);
  PrepareCandidates(logits, vocab, p, scratch);
  return DrawCandidate(*scratch, p, draw);
}

void PrepareCandidates(const float* logits, int64_t vocab, const SamplingParams& p,
                       SamplingScratch* scratch) {
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
  // Min-p: the weights are probabilities over the most likely one's (w[0] = 1), so the kept
  // candidates are the prefix whose weight reaches min_p.
  if (p.min_p > 0.f) {
    int64_t cut = 1;
    while (cut < keep && w[cut] >= static_cast<double>(p.min_p)) ++cut;
    keep = cut;
    sum = 0;
    for (int64_t i = 0; i < keep; ++i) sum += w[i];
  }
  scratch->keep = keep;
  scratch->kept_weight = sum;
}

int32_t DrawCandidate(const SamplingScratch& scratch, const SamplingParams& p, uint64_t draw) {
  const double r = SamplingUniform(p.seed, draw) * scratch.kept_weight;
  double acc = 0;
  for (int64_t i = 0; i < scratch.keep; ++i) {
    acc += scratch.weights[i];
    if (r < acc) return scratch.candidates[i].second;
  }
  return scratch.candidates[scratch.keep - 1].second;
}

void RowLogprobs(const float* logits, int64_t vocab, int32_t token, int32_t top_n,
                 const std::vector<int32_t>& named, TokenLogprobs* out) {
  float max = -INFINITY;
  for (int64_t i = 0; i < vocab; ++i) max = std::max(max, logits[i]);
  // exp in float (each term within 1 ulp; a row of Qwen3's 152k is a double exp's tenth of
  // the time), summed in double.
  double sum = 0;
  for (int64_t i = 0; i < vocab; ++i) sum += std::exp(logits[i] - max);
  const double lse = max + std::log(sum);
  auto logprob = [&](int64_t i) { return static_cast<float>(logits[i] - lse); };
  out->token = token;
  out->logprob = token >= 0 ? logprob(token) : 0.f;
  out->top.clear();
  const int64_t n = std::min<int64_t>(top_n, vocab);
  if (n > 0) {
    // A bounded selection: the n best seen so far, kept sorted (n <= kMaxTopLogprobs).
    auto better = [&](int64_t a, int64_t b) {
      return logits[a] > logits[b] || (logits[a] == logits[b] && a < b);
    };
    std::vector<int64_t> best;
    best.reserve(n + 1);
    for (int64_t i = 0; i < vocab; ++i) {
      if (static_cast<int64_t>(best.size()) == n && !better(i, best.back())) continue;
      best.insert(std::upper_bound(best.begin(), best.end(), i, better), i);
      if (static_cast<int64_t>(best.size()) > n) best.pop_back();
    }
    for (int64_t i : best) out->top.push_back({static_cast<int32_t>(i), logprob(i)});
  }
  out->named.clear();
  for (int32_t id : named) out->named.push_back(logprob(id));
}

}  // namespace dxs
