#include "model/router_skew_calibration.h"

#include <algorithm>
#include <cmath>
#include <numeric>

#include "common/status_macros.h"
#include "model/engine.h"
#include "model/router_skew.h"

namespace dxs {
namespace {

constexpr int kPrompts = 24;
constexpr int kPromptTokens = 32;
constexpr double kStep = 0.5;  // damped: popularity saturates steeply near 1/k

double RoundSignificant(double x) {
  if (x == 0) return 0;
  const double p = std::pow(10.0, 5 - static_cast<int>(std::floor(std::log10(x))));
  return std::round(x * p) / p;
}

}  // namespace

absl::Status CalibrateRouterSkew(CheckpointPreset* preset, int rounds) {
  const ModelConfig& c = preset->config;
  const int e_count = static_cast<int>(c.num_experts), k = static_cast<int>(c.num_experts_per_tok);
  preset->router_scales.clear();
  if (preset->router_skew == 0) return absl::OkStatus();
  std::vector<double> scale = ZipfRouterScales(e_count, k, preset->router_skew);
  const double expert_weights =
      3.0 * c.num_experts * c.moe_intermediate_size * c.hidden_size * c.num_hidden_layers;
  if (expert_weights > 2e8 || k <= 0 || k >= e_count) {
    preset->router_scales = scale;
    return absl::OkStatus();
  }
  const std::vector<double> target = ZipfRouterShares(e_count, k, preset->router_skew);
  std::vector<GenerationRequest> requests(kPrompts);
  uint64_t x = 0x9e3779b97f4a7c15ull ^ preset->seed;
  for (GenerationRequest& r : requests) {
    for (int j = 0; j < kPromptTokens; ++j) {
      x = x * 6364136223846793005ull + 1442695040888963407ull;
      r.prompt.push_back(static_cast<int32_t>(3 + (x >> 33) % (c.vocab_size - 3)));
    }
    r.max_new_tokens = 1;
  }
  EngineOptions options;
  options.device = "cpu";
  for (int round = 0; round < rounds; ++round) {
    preset->router_scales = scale;
    DXS_ASSIGN_OR_RETURN(std::unique_ptr<LocalEngine> engine,
                         LocalEngine::LoadRandom(*preset, options));
    DXS_RETURN_IF_ERROR(engine->GenerateBatch(requests).status());
    const std::vector<int64_t> counts = engine->experts().tokens_per_expert_snapshot();
    const double total =
        static_cast<double>(std::accumulate(counts.begin(), counts.end(), int64_t{0}));
    if (total <= 0) break;
    double log_mean = 0;
    for (int e = 0; e < e_count; ++e) {
      const double share = std::max(static_cast<double>(counts[e]), 0.5) / total;
      scale[e] = std::clamp(scale[e] * std::pow(target[e] / share, kStep), 1e-3, 1e3);
      log_mean += std::log(scale[e]) / e_count;
    }
    for (double& s : scale) s *= std::exp(-log_mean);
  }
  for (double& s : scale) s = RoundSignificant(s);
  preset->router_scales = scale;
  return absl::OkStatus();
}

}  // namespace dxs
