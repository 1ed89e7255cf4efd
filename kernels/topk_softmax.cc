#include "kernels/topk_softmax.h"

#include <cmath>
#include <cstdint>
#include <vector>

#include "absl/strings/str_cat.h"

namespace dxs {

absl::Status ValidateTopKArgs(int64_t num_tokens, int64_t num_experts, int64_t top_k) {
  if (num_tokens < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("top-k softmax: num_tokens ", num_tokens, " is negative"));
  }
  if (num_experts <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("top-k softmax: num_experts must be positive, got ", num_experts));
  }
  if (top_k <= 0 || top_k > num_experts) {
    return absl::InvalidArgumentError(absl::StrCat(
        "top-k softmax: top_k must be in [1, num_experts=", num_experts, "], got ", top_k));
  }
  return absl::OkStatus();
}

absl::Status TopKSoftmaxCpu(const float* logits, int64_t num_tokens, int64_t num_experts,
                            int64_t top_k, bool normalize, int32_t* ids, float* weights) {
  if (absl::Status s = ValidateTopKArgs(num_tokens, num_experts, top_k); !s.ok()) return s;
  if (num_tokens == 0) return absl::OkStatus();  // empty batch: nothing to route, no work
  // Experts are ranked by probability, ties to the lower id. A row with a NaN or +inf logit
  // has NaN probabilities (a NaN sum, exp(inf - inf)), which rank nothing: its experts are
  // ranked by logit instead, NaN last, ties to the lower id, as the GPU kernel ranks every row
  // (kernels/cuda/topk_softmax_warp.cuh), rather than picked 0, 1, 2... The kernel's logit
  // order differs from this one only where exp rounds distinct logits to one probability
  // (both underflow to 0): gen-model --router-skew's calibration counts on the ties there
  // going to the lower id.
  std::vector<float> probs(num_experts);
  std::vector<bool> taken(num_experts);
  for (int64_t t = 0; t < num_tokens; ++t) {
    const float* row = logits + t * num_experts;
    float max_logit = -INFINITY;  // fmax skips NaN, as the kernel's fmaxf does
    for (int64_t e = 0; e < num_experts; ++e) max_logit = std::fmax(max_logit, row[e]);
    float sum = 0.f;
    for (int64_t e = 0; e < num_experts; ++e) {
      probs[e] = std::exp(row[e] - max_logit);
      sum += probs[e];
    }
    for (int64_t e = 0; e < num_experts; ++e) probs[e] /= sum;
    const bool by_logit = std::isnan(sum);
    auto key = [&](int64_t e) {
      if (!by_logit) return probs[e];
      return std::isnan(row[e]) ? -INFINITY : row[e];
    };
    std::fill(taken.begin(), taken.end(), false);
    float picked_sum = 0.f;
    for (int64_t k = 0; k < top_k; ++k) {
      int64_t best = -1;
      for (int64_t e = 0; e < num_experts; ++e) {
        if (!taken[e] && (best < 0 || key(e) > key(best))) best = e;
      }
      taken[best] = true;
      ids[t * top_k + k] = static_cast<int32_t>(best);
      weights[t * top_k + k] = probs[best];
      picked_sum += probs[best];
    }
    if (normalize) {
      for (int64_t k = 0; k < top_k; ++k) weights[t * top_k + k] /= picked_sum;
    }
  }
  return absl::OkStatus();
}

}  // namespace dxs
