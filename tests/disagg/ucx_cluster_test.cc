// The disaggregated cluster as real processes on loopback: dxs-router, dxs-attention and
// dxs-expert over gRPC (control) and UCX (dispatch/combine). Outputs equal the
// single-process engine; mismatched workers are refused; a killed expert fails in-flight
// requests with UNAVAILABLE within 5 s and the cluster recovers when it comes back.

#include "gtest/gtest.h"
#include "model/engine.h"
#include "model/random_checkpoint.h"
#include "tests/disagg/cluster_equivalence.h"
#include "tests/disagg/metrics_util.h"
#include "tests/disagg/process_cluster.h"
#include "tests/model/test_util.h"

namespace dxs {
namespace {

using testing::ClusterSpec;
using testing::ProcessCluster;
using testing::TempDir;

class UcxGrid : public ::testing::TestWithParam<std::tuple<int, int>> {};

TEST_P(UcxGrid, EqualsSingleProcess) {
  const auto [m, n] = GetParam();
  TempDir tmp;
  const std::string dir = testing::WritePreset(tmp, "default");
  ProcessCluster cluster(tmp.path());
  ClusterSpec spec{dir, m, n, {}};
  absl::Status started = cluster.Start(spec);
  ASSERT_TRUE(started.ok()) << started << cluster.DumpLogs();
  // Two requests: with M = 3 one DP rank has none and runs empty steps.
  testing::ExpectClusterMatchesEngine(&cluster, dir, m, 2, 4096);
}

INSTANTIATE_TEST_SUITE_P(MxN, UcxGrid,
                         ::testing::Combine(::testing::Values(1, 2, 3), ::testing::Values(1, 2, 4)),
                         [](const auto& info) {
                           return "dp" + std::to_string(std::get<0>(info.param)) + "_ep" +
                                  std::to_string(std::get<1>(info.param));
                         });

// The default is the one-copy exchange (mapped regions; metrics_test sees its bytes); the
// exchange that sends every row through the transport gives the same tokens.
TEST(UcxCluster, CopyExchangeEqualsSingleProcess) {
  TempDir tmp;
  const std::string dir = testing::WritePreset(tmp, "default");
  ProcessCluster cluster(tmp.path());
  ClusterSpec spec{dir, 2, 2, {}};
  spec.attention_args = {"--mapped-exchange=false"};
  absl::Status started = cluster.Start(spec);
  ASSERT_TRUE(started.ok()) << started << cluster.DumpLogs();
  testing::ExpectClusterMatchesEngine(&cluster, dir, 2, 2, 4096);
}

// --low-latency-capacity on the CPU, whose backend has no low-latency exchange: the
// attention ranks say so once and every step goes by the host-driven exchange, with the
// same tokens and no low-latency step counted.
TEST(UcxCluster, LowLatencyCapacityOnTheCpuKeepsTheHostDrivenExchange) {
  TempDir tmp;
  const std::string dir = testing::WritePreset(tmp, "default");
  ProcessCluster cluster(tmp.path());
  ClusterSpec spec{dir, 2, 1, {}};
  spec.attention_args = {"--low-latency-capacity", "8"};
  absl::Status started = cluster.Start(spec);
  ASSERT_TRUE(started.ok()) << started << cluster.DumpLogs();
  testing::ExpectClusterMatchesEngine(&cluster, dir, 2, 2, 4096);
  for (int r = 0; r < 2; ++r) {
    absl::StatusOr<std::string> text = testing::Scrape(cluster.attention_metrics_address(r));
    ASSERT_TRUE(text.ok()) << text.status();
    const auto samples = testing::ParseSamples(*text);
    const std::string rank = "rank=\"" + std::to_string(r) + "\"";
    EXPECT_EQ(
        testing::Value(samples, "dxs_low_latency_steps_total{role=\"attention\"," + rank + "}"), 0);
    EXPECT_GT(testing::Value(samples, "dxs_steps_total{role=\"attention\"," + rank + "}"), 0);
  }
}

// Overlap scheduling in dxs-attention (--overlap-schedule, on by default): the cluster
// equals the single-process engine with it and without, and dxs_steps_built_ahead_total
// counts steps built ahead on every DP rank with it and none without.
TEST(UcxCluster, OverlapScheduleOnAndOffEqualSingleProcess) {
  TempDir tmp;
  const std::string dir = testing::WritePreset(tmp, "default");
  for (const bool overlap : {true, false}) {
    const std::string flag = overlap ? "--overlap-schedule=true" : "--overlap-schedule=false";
    SCOPED_TRACE(flag);
    TempDir work;
    ProcessCluster cluster(work.path());
    ClusterSpec spec{dir, 2, 2, {}};
    spec.attention_args = {flag};
    absl::Status started = cluster.Start(spec);
    ASSERT_TRUE(started.ok()) << started << cluster.DumpLogs();
    testing::ExpectClusterMatchesEngine(&cluster, dir, 2, 4, 4096);
    for (int r = 0; r < 2; ++r) {
      absl::StatusOr<std::string> text = testing::Scrape(cluster.attention_metrics_address(r));
      ASSERT_TRUE(text.ok()) << text.status();
      const double ahead =
          testing::Value(testing::ParseSamples(*text),
                         "dxs_steps_built_ahead_total{rank=\"" + std::to_string(r) + "\"}");
      if (overlap) {
        EXPECT_GT(ahead, 0) << "DP rank " << r;
      } else {
        EXPECT_EQ(ahead, 0) << "DP rank " << r;
      }
    }
  }
}

TEST(UcxCluster, UnevenPlacementTwelveExpertsOnFiveRanks) {
  TempDir tmp;
  const std::string dir = testing::WritePreset(tmp, "odd");
  ProcessCluster cluster(tmp.path());
  ClusterSpec spec{dir, 2, 5, {"0-3", "4-5", "6-8", "9", "10-11"}};
  absl::Status started = cluster.Start(spec);
  ASSERT_TRUE(started.ok()) << started << cluster.DumpLogs();
  testing::ExpectClusterMatchesEngine(&cluster, dir, 2, 3, 3001);
}

// An in-place model directory (gen-model --in-place: no safetensors): the router and every
// worker make the same weights themselves, and the cluster equals the engine on the
// checkpoint written from the same preset. An EP rank's experts load from the recipe.
TEST(UcxCluster, InPlaceModelEqualsTheWrittenCheckpoint) {
  TempDir tmp;
  const std::string written = testing::WritePreset(tmp, "odd");
  absl::StatusOr<CheckpointPreset> preset = GetPreset("odd");
  ASSERT_TRUE(preset.ok());
  const std::string in_place = tmp.path() + "/odd-in-place";
  ASSERT_TRUE(WriteInPlaceCheckpoint(*preset, in_place).ok());
  ProcessCluster cluster(tmp.path());
  ClusterSpec spec{in_place, 1, 2, {}};
  absl::Status started = cluster.Start(spec);
  ASSERT_TRUE(started.ok()) << started << cluster.DumpLogs();
  testing::ExpectClusterMatchesEngine(&cluster, written, 1, 2, 3001);
}

// A block-scaled FP8 checkpoint (gen-model --fp8): dxs-attention and dxs-expert dequantize
// it on load as the single process does, so a 2 + 2 cluster equals it; the model info says
// what was loaded and what travels (FP8 stored, served in the config's dtype, f32 wire).
TEST(UcxCluster, Fp8CheckpointEqualsSingleProcess) {
  TempDir tmp;
  const std::string dir = testing::WritePreset(tmp, "odd", 0, /*fp8=*/true);
  ProcessCluster cluster(tmp.path());
  ClusterSpec spec{dir, 2, 2, {}};
  absl::Status started = cluster.Start(spec);
  ASSERT_TRUE(started.ok()) << started << cluster.DumpLogs();
  testing::ExpectClusterMatchesEngine(&cluster, dir, 2, 3, 3001);
  grpc::ClientContext context;
  v1::GetModelInfoResponse info;
  ASSERT_TRUE(cluster.frontend()->GetModelInfo(&context, v1::GetModelInfoRequest(), &info).ok());
  EXPECT_EQ(info.model_info().checkpoint_dtype(), v1::DTYPE_FLOAT8_E4M3);
  EXPECT_EQ(info.model_info().dtype(), v1::DTYPE_FLOAT32);
  EXPECT_EQ(info.model_info().wire_dtype(), v1::DTYPE_FLOAT32);
}

// --wire-dtype fp8 across processes: every request answered, the model info says what
// travels, and the attention ranks' exchange bytes are exactly FP8 records and pairs out
// (Fp8RecordBytes(hidden) a row, against 2 * hidden for bf16 rows) and bf16 rows back:
// through the transport (--mapped-exchange=false: memory="host"), and through the regions
// the expert ranks map (the default on one host: memory="mapped", the records written
// there and read in place). The counters settle with the last step; the test waits for
// that (30 s bound) before it compares.
TEST(UcxCluster, Fp8WireSendsRecordsAndBf16Answers) {
  TempDir tmp;
  const std::string dir = testing::WritePreset(tmp, "default");
  const int64_t hidden = LoadModelConfig(dir)->hidden_size;
  for (const bool mapped : {false, true}) {
    const std::string memory = mapped ? "mapped" : "host", other = mapped ? "host" : "mapped";
    SCOPED_TRACE("memory=" + memory);
    TempDir work;
    ProcessCluster cluster(work.path());
    ClusterSpec spec{dir, 2, 2, {}};
    spec.wire_dtype = "fp8";
    spec.attention_args = {mapped ? "--mapped-exchange=true" : "--mapped-exchange=false"};
    absl::Status started = cluster.Start(spec);
    ASSERT_TRUE(started.ok()) << started << cluster.DumpLogs();
    for (int i = 0; i < 4; ++i) {
      const testing::GenerateResult r =
          cluster.Generate(i % 2, "fp8-" + std::to_string(i), {5 + i, 6, 7, 8}, 6);
      ASSERT_TRUE(r.status.ok()) << r.status.error_message() << cluster.DumpLogs();
      EXPECT_EQ(r.tokens.size(), 6u);
    }
    grpc::ClientContext context;
    v1::GetModelInfoResponse info;
    ASSERT_TRUE(cluster.frontend()->GetModelInfo(&context, v1::GetModelInfoRequest(), &info).ok());
    EXPECT_EQ(info.model_info().wire_dtype(), v1::DTYPE_FLOAT8_E4M3);
    double tokens = 0, pairs = 0, sent = 0, received = 0, sent_other = 0;
    const absl::Time give_up = absl::Now() + absl::Seconds(30);
    do {
      tokens = pairs = sent = received = sent_other = 0;
      for (int r = 0; r < 2; ++r) {
        const std::string rank = "rank=\"" + std::to_string(r) + "\"";
        absl::StatusOr<std::string> a = testing::Scrape(cluster.attention_metrics_address(r));
        absl::StatusOr<std::string> e = testing::Scrape(cluster.expert_metrics_address(r));
        ASSERT_TRUE(a.ok() && e.ok());
        const auto as = testing::ParseSamples(*a), es = testing::ParseSamples(*e);
        tokens += testing::SumOf(as, "dxs_tokens_dispatched_total");
        pairs += testing::SumOf(es, "dxs_expert_tokens_total");
        const std::string series = "dxs_exchange_bytes_total{role=\"attention\"," + rank;
        sent += testing::Value(as, series + ",direction=\"send\",memory=\"" + memory + "\"}");
        received += testing::Value(as, series + ",direction=\"recv\",memory=\"" + memory + "\"}");
        sent_other += testing::Value(as, series + ",direction=\"send\",memory=\"" + other + "\"}");
      }
      if (tokens > 0 && sent == tokens * Fp8RecordBytes(hidden) + 12 * pairs) break;
      absl::SleepFor(absl::Milliseconds(100));
    } while (absl::Now() < give_up);
    ASSERT_GT(tokens, 0);
    EXPECT_EQ(sent, tokens * Fp8RecordBytes(hidden) + 12 * pairs)
        << tokens << " tokens, " << pairs << " pairs";
    EXPECT_EQ(received, tokens * hidden * 2);
    EXPECT_EQ(sent_other, 0);
    std::printf("fp8 wire (%s): %.0f dispatch row bytes for %.0f tokens, %.3f of bf16 rows'\n",
                memory.c_str(), sent - 12 * pairs, tokens,
                (sent - 12 * pairs) / (tokens * hidden * 2));
  }
}

TEST(UcxCluster, MismatchedWorkersAreRefused) {
  TempDir tmp;
  const std::string dir = testing::WritePreset(tmp, "default");
  const std::string other = testing::WritePreset(tmp, "odd");
  ProcessCluster cluster(tmp.path());
  ClusterSpec spec{dir, 1, 2, {}};
  absl::Status started = cluster.Start(spec);
  ASSERT_TRUE(started.ok()) << started << cluster.DumpLogs();
  // A different checkpoint.
  absl::Status s = cluster.StartExpert(1, other, "", "different checkpoint");
  EXPECT_TRUE(s.ok()) << s << cluster.DumpLogs();
  // A duplicate rank (rank 0 is live at another address).
  s = cluster.StartExpert(0, dir, "", "held by a live worker");
  EXPECT_TRUE(s.ok()) << s << cluster.DumpLogs();
  // The cluster still serves.
  testing::ExpectClusterMatchesEngine(&cluster, dir, 1, 1, 4096);
}

TEST(UcxCluster, OverlappingExpertsAreRefused) {
  TempDir tmp;
  const std::string dir = testing::WritePreset(tmp, "default");
  ProcessCluster cluster(tmp.path());
  ClusterSpec spec{dir, 1, 2, {"0-9", "10-15"}};
  absl::Status started = cluster.Start(spec);
  ASSERT_TRUE(started.ok()) << started << cluster.DumpLogs();
  cluster.KillExpert(1);
  // Once rank 1's lease has run out (the router marks it dead), its experts are free.
  const absl::Status dead = cluster.WaitExpertDead(1);
  ASSERT_TRUE(dead.ok()) << dead << cluster.DumpLogs();
  // A replacement claiming experts that rank 0 holds is refused.
  absl::Status s = cluster.StartExpert(1, dir, "8-15", "overlap");
  EXPECT_TRUE(s.ok()) << s << cluster.DumpLogs();
}

// Kills an expert while a long request runs: the request fails with UNAVAILABLE within
// 5 s, never a hang; the expert comes back on its address and registers again, and the
// cluster serves correct results without restarting anything else.
TEST(UcxCluster, KilledExpertFailsInFlightThenRecovers) {
  TempDir tmp;
  const std::string dir = testing::WritePreset(tmp, "default");
  ProcessCluster cluster(tmp.path());
  ClusterSpec spec{dir, 2, 2, {}};
  absl::Status started = cluster.Start(spec);
  ASSERT_TRUE(started.ok()) << started << cluster.DumpLogs();
  testing::ExpectKilledExpertFailsInFlightThenRecovers(&cluster, dir, 2, 1);
}

}  // namespace
}  // namespace dxs
