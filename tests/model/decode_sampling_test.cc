// A decode step's sampling inside ForwardDecode equals the sampling run after the step
// (tests/model/decode_sampling_check.h), on the CPU (eager padded steps); cuda_engine_test
// runs the same check with graphs recorded and replayed.
#include "gtest/gtest.h"
#include "model/engine.h"
#include "tests/model/decode_sampling_check.h"
#include "tests/model/test_util.h"

namespace dxs {
namespace {

TEST(DecodeSampling, InTheStepEqualsAfterTheStepOnTheCpu) {
  testing::TempDir tmp;
  const std::string dir = testing::WritePreset(tmp, "default");
  EngineOptions options;
  options.device = "cpu";
  absl::StatusOr<std::unique_ptr<LocalEngine>> engine = LocalEngine::Load(dir, options);
  ASSERT_TRUE(engine.ok()) << engine.status();
  testing::DecodeSamplingEqualsSamplingAfterTheStep(engine->get(), /*use_graph=*/false);
}

}  // namespace
}  // namespace dxs
