#include "model/router_skew.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numeric>

namespace dxs {
namespace {

constexpr int kSamples = 8192;
constexpr int kIterations = 80;
constexpr double kMaxScale = 1e3;

// SplitMix64: the sample must not depend on the standard library's distributions.
class Rng {
 public:
  explicit Rng(uint64_t seed) : state_(seed) {}
  double NextOpenUnit() {  // (0, 1)
    state_ += 0x9e3779b97f4a7c15ull;
    uint64_t z = state_;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    z ^= z >> 31;
    return (static_cast<double>(z >> 11) + 0.5) / 9007199254740992.0;
  }
  double NextNormal() {  // Box-Muller
    const double u = NextOpenUnit(), v = NextOpenUnit();
    return std::sqrt(-2.0 * std::log(u)) * std::cos(6.283185307179586 * v);
  }

 private:
  uint64_t state_;
};

double RoundSignificant(double x, int digits) {
  if (x == 0) return 0;
  const double p = std::pow(10.0, digits - 1 - static_cast<int>(std::floor(std::log10(x))));
  return std::round(x * p) / p;
}

}  // namespace

std::vector<double> ZipfRouterShares(int num_experts, int top_k, double skew) {
  const int e_count = std::max(num_experts, 1);
  const double cap = 1.0 / std::clamp(top_k, 1, e_count);
  std::vector<double> zipf(e_count);
  for (int e = 0; e < e_count; ++e) zipf[e] = std::pow(e + 1.0, -skew);
  // Water-filling: cap the first experts at 1/k, share what is left by Zipf weight.
  std::vector<double> share(e_count);
  int capped = 0;
  while (true) {
    double rest = 0;
    for (int e = capped; e < e_count; ++e) rest += zipf[e];
    const double left = 1.0 - capped * cap;
    for (int e = capped; e < e_count; ++e) share[e] = zipf[e] / rest * left;
    if (capped == e_count || share[capped] <= cap) break;
    share[capped++] = cap;  // shares fall with e: the next one over the cap is this one
  }
  for (int e = 0; e < capped; ++e) share[e] = cap;
  return share;
}

std::vector<double> ZipfRouterScales(int num_experts, int top_k, double skew) {
  std::vector<double> scale(std::max(num_experts, 0), 1.0);
  if (skew == 0 || num_experts <= 1 || top_k <= 0 || top_k >= num_experts) return scale;
  const std::vector<double> target = ZipfRouterShares(num_experts, top_k, skew);
  std::vector<double> g(static_cast<size_t>(kSamples) * num_experts);
  Rng rng(0x5eed0f2195ull ^ static_cast<uint64_t>(num_experts) * 131 ^
          static_cast<uint64_t>(top_k));
  for (double& v : g) v = rng.NextNormal();
  std::vector<int> order(num_experts);
  std::vector<double> z(num_experts), count(num_experts);
  for (int it = 0; it < kIterations; ++it) {
    std::fill(count.begin(), count.end(), 0.0);
    for (int n = 0; n < kSamples; ++n) {
      for (int e = 0; e < num_experts; ++e)
        z[e] = scale[e] * g[static_cast<size_t>(n) * num_experts + e];
      std::iota(order.begin(), order.end(), 0);
      std::partial_sort(order.begin(), order.begin() + top_k, order.end(),
                        [&](int a, int b) { return z[a] > z[b] || (z[a] == z[b] && a < b); });
      for (int j = 0; j < top_k; ++j) count[order[j]] += 1;
    }
    double log_mean = 0;
    for (int e = 0; e < num_experts; ++e) {
      const double share = std::max(count[e], 0.5) / (static_cast<double>(kSamples) * top_k);
      scale[e] =
          std::clamp(scale[e] * std::pow(target[e] / share, 0.7), 1.0 / kMaxScale, kMaxScale);
      log_mean += std::log(scale[e]);
    }
    // Only ratios matter to the top-k; keep the geometric mean at 1 so that the logits'
    // overall spread (and the softmax weights' sharpness) stays about what it was.
    log_mean /= num_experts;
    for (double& s : scale) s *= std::exp(-log_mean);
  }
  for (double& s : scale) s = RoundSignificant(s, 6);
  return scale;
}

}  // namespace dxs
