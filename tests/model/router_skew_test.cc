// dxs gen-model --router-skew S (model/router_skew.h): the Zipf targets, and the routed
// distribution the CPU engine measures on a skewed (and calibrated) checkpoint, whose first
// experts take the share of the routed pairs Zipf predicts for them; S = 0 writes the
// checkpoint bit for bit as before (its fingerprint is the golden one).
#include "model/router_skew.h"

#include <fstream>
#include <numeric>

#include "gtest/gtest.h"
#include "model/engine.h"
#include "model/random_checkpoint.h"
#include "model/router_skew_calibration.h"
#include "nlohmann/json.hpp"
#include "tests/model/test_util.h"

namespace dxs {
namespace {

TEST(RouterSkewTest, ZipfSharesSumToOneFallAndCapAtOneOverK) {
  for (auto [e, k, s] :
       {std::tuple{16, 4, 0.0}, {16, 4, 0.5}, {16, 4, 2.0}, {12, 3, 1.0}, {128, 8, 1.2}}) {
    const std::vector<double> share = ZipfRouterShares(e, k, s);
    ASSERT_EQ(static_cast<int>(share.size()), e);
    EXPECT_NEAR(std::accumulate(share.begin(), share.end(), 0.0), 1.0, 1e-12);
    for (int i = 0; i < e; ++i) {
      EXPECT_LE(share[i], 1.0 / k + 1e-12);
      if (i > 0) EXPECT_LE(share[i], share[i - 1] + 1e-15);
    }
    if (s == 0) EXPECT_NEAR(share[0], 1.0 / e, 1e-12);
  }
  // Uncapped, it is Zipf: share_0 / share_1 = 2^S.
  const std::vector<double> z = ZipfRouterShares(12, 3, 1.0);
  EXPECT_NEAR(z[0] / z[1], 2.0, 1e-9);
  EXPECT_NEAR(z[0],
              1.0 / (1 + 1 / 2. + 1 / 3. + 1 / 4. + 1 / 5. + 1 / 6. + 1 / 7. + 1 / 8. + 1 / 9. +
                     1 / 10. + 1 / 11. + 1 / 12.),
              1e-9);
  // Capped: S = 2 on top-4 of 16 saturates expert 0 (1/1.64 > 1/4).
  EXPECT_DOUBLE_EQ(ZipfRouterShares(16, 4, 2.0)[0], 0.25);
}

TEST(RouterSkewTest, ScalesAreOneWithoutSkewAndDeterministic) {
  for (double s : ZipfRouterScales(16, 4, 0.0)) EXPECT_EQ(s, 1.0);
  EXPECT_EQ(ZipfRouterScales(16, 4, 1.0), ZipfRouterScales(16, 4, 1.0));
  const std::vector<double> s = ZipfRouterScales(16, 4, 1.0);
  for (size_t i = 1; i < s.size(); ++i) EXPECT_GE(s[i - 1], s[i]) << i;
}

TEST(RouterSkewTest, ZeroSkewIsTheGoldenCheckpoint) {
  testing::TempDir tmp;
  absl::StatusOr<CheckpointPreset> preset = GetPreset("default");
  ASSERT_TRUE(preset.ok());
  preset->router_skew = 0;
  const std::string dir = tmp.path() + "/zero";
  ASSERT_TRUE(WriteRandomCheckpoint(*preset, dir).ok());
  std::ifstream f(testing::SourceDir() + "/tests/golden/default.json");
  const nlohmann::json golden = nlohmann::json::parse(f);
  EXPECT_EQ(*CheckpointFingerprint(dir), golden.at("fingerprint").get<std::string>());
  // A skewed one differs only in the gates.
  preset->router_skew = 1.0;
  for (const RandomTensorSpec& spec : RandomTensorSpecs(*preset)) {
    EXPECT_EQ(spec.row_scale.empty(), spec.name.find("mlp.gate.weight") == std::string::npos)
        << spec.name;
  }
}

// Share of routed pairs per expert, over all MoE layers, for prompts run on the CPU engine.
std::vector<double> MeasuredShares(const std::string& dir) {
  auto engine = LocalEngine::Load(dir);
  EXPECT_TRUE(engine.ok()) << engine.status();
  if (!engine.ok()) return {};
  const int vocab = static_cast<int>((*engine)->config().vocab_size);
  std::vector<GenerationRequest> requests;
  for (int i = 0; i < 16; ++i) {
    GenerationRequest r;
    for (int j = 0; j < 48; ++j) r.prompt.push_back(3 + (i * 7919 + j * 104729) % (vocab - 3));
    r.max_new_tokens = 4;
    requests.push_back(r);
  }
  auto out = (*engine)->GenerateBatch(requests);
  EXPECT_TRUE(out.ok()) << out.status();
  const std::vector<int64_t> counts = (*engine)->experts().tokens_per_expert_snapshot();
  const double total =
      static_cast<double>(std::accumulate(counts.begin(), counts.end(), int64_t{0}));
  std::vector<double> shares;
  for (int64_t c : counts) shares.push_back(c / total);
  return shares;
}

TEST(RouterSkewTest, EngineRoutesAsZipfPredicts) {
  for (auto [name, skew] : {std::pair{"odd", 1.0}, {"default", 0.6}}) {
    testing::TempDir tmp;
    absl::StatusOr<CheckpointPreset> preset = GetPreset(name);
    ASSERT_TRUE(preset.ok());
    const int e = static_cast<int>(preset->config.num_experts);
    const int k = static_cast<int>(preset->config.num_experts_per_tok);
    const std::vector<double> flat = MeasuredShares(testing::WritePreset(tmp, name));
    preset->router_skew = skew;
    ASSERT_TRUE(CalibrateRouterSkew(&*preset).ok());  // as dxs gen-model does
    const std::string dir = tmp.path() + "/skewed";
    ASSERT_TRUE(WriteRandomCheckpoint(*preset, dir).ok());
    const std::vector<double> got = MeasuredShares(dir);
    const std::vector<double> want = ZipfRouterShares(e, k, skew);
    ASSERT_EQ(got.size(), want.size());
    std::string table;
    for (int i = 0; i < e; ++i) {
      table += std::to_string(i) + ": " + std::to_string(got[i]) + " (zipf " +
               std::to_string(want[i]) + ", unskewed " + std::to_string(flat[i]) + ")\n";
    }
    // The popularity law (shares sorted, whichever expert holds each). Measured, the head
    // (the first quarter of the experts) takes Zipf's total within 25%, but its experts
    // share it more evenly than Zipf (scaling rows saturates near 1/k): the most popular
    // one gets at least 70% of Zipf's share. Far above the unskewed checkpoint's maximum.
    std::vector<double> sorted = got;
    std::sort(sorted.rbegin(), sorted.rend());
    EXPECT_GE(sorted[0], 0.7 * want[0]) << name << "\n" << table;
    EXPECT_LE(sorted[0], 1.0 / k + 1e-9) << name << "\n" << table;
    double head = 0, want_head = 0;
    for (int i = 0; i < e / 4; ++i) {
      head += sorted[i];
      want_head += want[i];
    }
    EXPECT_NEAR(head, want_head, 0.25 * want_head) << name << "\n" << table;
    EXPECT_GT(sorted[0], 1.3 * *std::max_element(flat.begin(), flat.end())) << name << "\n"
                                                                            << table;
    // The first experts are the hot ones, as asked.
    EXPECT_GE(std::accumulate(got.begin(), got.begin() + e / 4, 0.0), 0.8 * want_head)
        << name << "\n"
        << table;
  }
}

}  // namespace
}  // namespace dxs
