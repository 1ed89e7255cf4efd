// The disaggregated cluster on the GPU: dxs-router, dxs-attention --device cuda and
// dxs-expert --device cuda as real processes sharing one GPU (time-sliced), the rows moving
// between them in device memory over UCX's cuda_ipc. Outputs equal the single-process CUDA
// engine; an uneven placement, an empty DP rank and an EP rank with no rows take part in
// every step; a killed expert gives UNAVAILABLE and the cluster recovers; the exchange's
// rows never touch host memory (dxs_exchange_bytes_total). And what one GPU can run of the
// four-GPU issue (DP2 x EP2, as four processes time-slicing it over UCX; its NCCL runs need
// four GPUs): EPLB rebalancing live on CUDA experts, and a killed expert with full replica
// cover failing no request. Skips without a GPU.

#include "gtest/gtest.h"
#include "kernels/make_backend.h"
#include "model/engine.h"
#include "tests/disagg/cluster_equivalence.h"
#include "tests/disagg/metrics_util.h"
#include "tests/disagg/process_cluster.h"
#include "tests/model/test_util.h"

namespace dxs {
namespace {

using testing::ClusterSpec;
using testing::EngineEquivalence;
using testing::ProcessCluster;
using testing::TempDir;

// The single-process CUDA engine, first-token logits within the CUDA engine test's bound;
// greedy tokens equal up to a near tie (EngineEquivalence::max_near_tie_gap).
EngineEquivalence CudaReference() {
  EngineEquivalence e;
  e.engine.device = "cuda";
  e.max_logit_error = 2e-2;
  e.max_near_tie_gap = 0.25;
  return e;
}

double ExchangeBytes(const std::map<std::string, double>& samples, const std::string& role,
                     int rank, const std::string& direction, const std::string& memory) {
  return testing::Value(samples, "dxs_exchange_bytes_total{role=\"" + role + "\",rank=\"" +
                                     std::to_string(rank) + "\",direction=\"" + direction +
                                     "\",memory=\"" + memory + "\"}");
}

// DP rank 0's MoE layers with the input (or output) in place (dxs_moe_in_place_total).
double InPlace(const std::map<std::string, double>& samples, const std::string& buffer) {
  return testing::Value(samples, "dxs_moe_in_place_total{rank=\"0\",buffer=\"" + buffer + "\"}");
}

std::map<std::string, double> Samples(const std::string& address) {
  absl::StatusOr<std::string> text = testing::Scrape(address);
  EXPECT_TRUE(text.ok()) << text.status();
  return text.ok() ? testing::ParseSamples(*text) : std::map<std::string, double>();
}

class GpuCluster : public ::testing::Test {
 protected:
  void SetUp() override {
    absl::StatusOr<std::unique_ptr<Backend>> probe = MakeBackend("cuda");
    if (!probe.ok()) GTEST_SKIP() << "no GPU here: " << probe.status().message();
  }
  // A cluster whose workers compute on the GPU.
  static void OnGpu(ProcessCluster* cluster) { cluster->set_worker_args({"--device", "cuda"}); }
  // 1 attention + 1 expert process on the GPU (bf16 wire, the default preset) with these
  // dxs-attention flags, checked against the single-process CUDA engine; then each rank's
  // metrics.
  static void RunOneByOne(const std::vector<std::string>& attention_args,
                          std::map<std::string, double>* attention,
                          std::map<std::string, double>* expert) {
    TempDir tmp;
    const std::string dir = testing::WritePreset(tmp, "default");
    ProcessCluster cluster(tmp.path());
    OnGpu(&cluster);
    ClusterSpec spec{dir, 1, 1, {}};
    spec.wire_dtype = "bf16";
    spec.attention_args = attention_args;
    absl::Status started = cluster.Start(spec);
    ASSERT_TRUE(started.ok()) << started << cluster.DumpLogs();
    testing::ExpectClusterMatchesEngine(&cluster, dir, 1, 3, 4096, CudaReference());
    *attention = Samples(cluster.attention_metrics_address(0));
    *expert = Samples(cluster.expert_metrics_address(0));
  }
};

// The default exchange on GPUs is the one-copy exchange: the expert rank opens the
// attention rank's GPU region (CUDA IPC), reads its rows and pairs there and writes its
// answers there; only 4-byte statuses cross the transport, in host memory.
TEST_F(GpuCluster, OneAttentionOneExpertEqualsCudaEngine) {
  std::map<std::string, double> attention, expert;
  ASSERT_NO_FATAL_FAILURE(RunOneByOne({}, &attention, &expert));
  EXPECT_GT(ExchangeBytes(attention, "attention", 0, "send", "mapped"), 0);
  EXPECT_GT(ExchangeBytes(attention, "attention", 0, "recv", "mapped"), 0);
  EXPECT_EQ(ExchangeBytes(attention, "attention", 0, "send", "mapped"),
            ExchangeBytes(expert, "expert", 0, "recv", "mapped"));
  EXPECT_EQ(ExchangeBytes(attention, "attention", 0, "recv", "mapped"),
            ExchangeBytes(expert, "expert", 0, "send", "mapped"));
  for (const char* direction : {"send", "recv"}) {
    EXPECT_EQ(ExchangeBytes(attention, "attention", 0, direction, "device"), 0);
    EXPECT_EQ(ExchangeBytes(expert, "expert", 0, direction, "device"), 0);
  }
  EXPECT_EQ(ExchangeBytes(attention, "attention", 0, "send", "host"), 0);
  EXPECT_EQ(ExchangeBytes(expert, "expert", 0, "recv", "host"), 0);
  // Decode steps ran in recorded graph segments (--piecewise-graphs, the default), built
  // ahead of the tokens of the step before (--overlap-schedule, the default).
  EXPECT_GT(testing::Value(attention, R"(dxs_piecewise_decode_steps_total{rank="0"})"), 0);
  EXPECT_GT(testing::Value(attention, R"(dxs_steps_built_ahead_total{rank="0"})"), 0);
  // The prefill's MoE layers (bf16 activations on the bf16 wire): the model's norm wrote x
  // into the region the expert rank opened, and the expert rank answered into the model's
  // MoE output (StageBuffers).
  EXPECT_GT(InPlace(attention, "input"), 0);
  EXPECT_GT(InPlace(attention, "output"), 0);
}

// --mapped-exchange=false: the rows go through UCX device to device; nothing either rank
// posted lay in host memory (the expert rank receives the routed pairs on the device too
// and checks them there).
TEST_F(GpuCluster, CopyExchangeKeepsRowsOnTheDevice) {
  std::map<std::string, double> attention, expert;
  ASSERT_NO_FATAL_FAILURE(RunOneByOne({"--mapped-exchange=false"}, &attention, &expert));
  EXPECT_GT(ExchangeBytes(attention, "attention", 0, "send", "device"), 0);
  EXPECT_GT(ExchangeBytes(attention, "attention", 0, "recv", "device"), 0);
  EXPECT_EQ(ExchangeBytes(attention, "attention", 0, "send", "host"), 0);
  EXPECT_EQ(ExchangeBytes(attention, "attention", 0, "recv", "host"), 0);
  EXPECT_GT(ExchangeBytes(expert, "expert", 0, "recv", "device"), 0);
  EXPECT_GT(ExchangeBytes(expert, "expert", 0, "send", "device"), 0);
  EXPECT_EQ(ExchangeBytes(expert, "expert", 0, "send", "host"), 0);
  EXPECT_EQ(ExchangeBytes(expert, "expert", 0, "recv", "host"), 0);
  EXPECT_EQ(ExchangeBytes(attention, "attention", 0, "send", "mapped"), 0);
  EXPECT_EQ(InPlace(attention, "input"), 0);
}

// The same cluster with --piecewise-graphs=false: every step eager, the same answers.
TEST_F(GpuCluster, EagerDecodeStepsEqualCudaEngine) {
  std::map<std::string, double> attention, expert;
  ASSERT_NO_FATAL_FAILURE(RunOneByOne({"--piecewise-graphs=false"}, &attention, &expert));
  EXPECT_EQ(testing::Value(attention, R"(dxs_piecewise_decode_steps_total{rank="0"})"), 0);
  // Every step's MoE layers with x and out staged in the region, decode steps included.
  EXPECT_GT(InPlace(attention, "output"), 0);
  EXPECT_EQ(InPlace(attention, "input"), InPlace(attention, "output"));
}

// --overlap-schedule=false, the A/B baseline of the default: every step's tokens read
// before the next step is built; the same answers, and no step built ahead.
TEST_F(GpuCluster, OverlapScheduleOffEqualsCudaEngine) {
  std::map<std::string, double> attention, expert;
  ASSERT_NO_FATAL_FAILURE(RunOneByOne({"--overlap-schedule=false"}, &attention, &expert));
  EXPECT_EQ(testing::Value(attention, R"(dxs_steps_built_ahead_total{rank="0"})"), 0);
  EXPECT_GT(testing::Value(attention, R"(dxs_piecewise_decode_steps_total{rank="0"})"), 0);
}

// --wire-dtype fp8 on the GPU: the attention rank quantizes its rows into FP8 records on
// the device (QuantizeRowsFp8), the expert rank dequantizes them there; through the one-copy
// region (the default) and device to device over UCX (--mapped-exchange=false) the tokens
// are the same, and the records' bytes are counted exactly where they went.
TEST_F(GpuCluster, Fp8WireRecordsThroughTheRegionAndTheTransportGiveTheSameTokens) {
  TempDir tmp;
  const std::string dir = testing::WritePreset(tmp, "default");
  const int64_t hidden = LoadModelConfig(dir)->hidden_size;
  std::vector<std::vector<int32_t>> tokens[2];
  for (const bool mapped : {true, false}) {
    const std::string memory = mapped ? "mapped" : "device";
    SCOPED_TRACE("memory=" + memory);
    TempDir work;
    ProcessCluster cluster(work.path());
    OnGpu(&cluster);
    ClusterSpec spec{dir, 1, 1, {}};
    spec.wire_dtype = "fp8";
    spec.attention_args = {mapped ? "--mapped-exchange=true" : "--mapped-exchange=false"};
    absl::Status started = cluster.Start(spec);
    ASSERT_TRUE(started.ok()) << started << cluster.DumpLogs();
    for (int i = 0; i < 3; ++i) {
      const testing::GenerateResult r =
          cluster.Generate(0, "fp8-" + std::to_string(i), testing::ClusterPrompt(i, 4096), 8);
      ASSERT_TRUE(r.status.ok()) << r.status.error_message() << cluster.DumpLogs();
      tokens[mapped ? 0 : 1].push_back(r.tokens);
    }
    double sent = 0, dispatched = 0, pairs = 0;
    for (const absl::Time give_up = absl::Now() + absl::Seconds(30); absl::Now() < give_up;) {
      const auto attention = Samples(cluster.attention_metrics_address(0));
      const auto expert = Samples(cluster.expert_metrics_address(0));
      sent = ExchangeBytes(attention, "attention", 0, "send", memory);
      dispatched = testing::SumOf(attention, "dxs_tokens_dispatched_total");
      pairs = testing::SumOf(expert, "dxs_expert_tokens_total");
      if (dispatched > 0 && sent == dispatched * Fp8RecordBytes(hidden) + 12 * pairs) break;
      absl::SleepFor(absl::Milliseconds(100));
    }
    ASSERT_GT(dispatched, 0);
    EXPECT_EQ(sent, dispatched * Fp8RecordBytes(hidden) + 12 * pairs);
  }
  EXPECT_EQ(tokens[0], tokens[1]);
}

double LowLatencySteps(const std::map<std::string, double>& samples, const std::string& role,
                       int rank) {
  return testing::Value(samples, "dxs_low_latency_steps_total{role=\"" + role + "\",rank=\"" +
                                     std::to_string(rank) + "\"}");
}

// --low-latency-capacity: decode steps whose padded batch fits go over the low-latency
// exchange between the two processes (each side's region opened by the other through CUDA
// IPC, a step one graph replay on each side), prefill by the host-driven exchange; the same
// answers as the engine, and every low-latency step of the attention rank served once by
// the expert rank.
TEST_F(GpuCluster, LowLatencyDecodeStepsEqualCudaEngine) {
  std::map<std::string, double> attention, expert;
  ASSERT_NO_FATAL_FAILURE(RunOneByOne({"--low-latency-capacity", "8"}, &attention, &expert));
  const double ll = LowLatencySteps(attention, "attention", 0);
  EXPECT_GT(ll, 0);
  EXPECT_EQ(LowLatencySteps(expert, "expert", 0), ll);
  EXPECT_GT(testing::Value(attention, R"(dxs_steps_total{role="attention",rank="0"})"), ll);
  EXPECT_EQ(testing::Value(attention, R"(dxs_failed_steps_total{role="attention",rank="0"})"), 0);
}

// --wire-dtype fp8 with --low-latency-capacity, on the default preset widened to hidden 512
// (FP8 records of 528 bytes: 16-byte vectors, which the low-latency exchange moves): decode
// steps go over the low-latency exchange with FP8 rows (quantized in the attention rank's
// step graph, dequantized in the expert rank's), with the same tokens as the host-driven
// exchange's FP8 rows, which quantize and dequantize with the same kernels.
TEST_F(GpuCluster, Fp8WireLowLatencyStepsGiveTheHostDrivenFp8RowsTokens) {
  TempDir tmp;
  absl::StatusOr<CheckpointPreset> preset = GetPreset("default");
  ASSERT_TRUE(preset.ok()) << preset.status();
  preset->config.hidden_size = 512;
  const std::string dir = tmp.path() + "/hidden512";
  ASSERT_TRUE(WriteRandomCheckpoint(*preset, dir).ok());
  std::vector<std::vector<int32_t>> tokens[2];
  for (const bool low_latency : {false, true}) {
    SCOPED_TRACE(low_latency ? "low-latency" : "host-driven");
    TempDir work;
    ProcessCluster cluster(work.path());
    OnGpu(&cluster);
    ClusterSpec spec{dir, 1, 1, {}};
    spec.wire_dtype = "fp8";
    if (low_latency) spec.attention_args = {"--low-latency-capacity", "8"};
    absl::Status started = cluster.Start(spec);
    ASSERT_TRUE(started.ok()) << started << cluster.DumpLogs();
    for (int i = 0; i < 3; ++i) {
      const testing::GenerateResult r =
          cluster.Generate(0, "fp8-ll-" + std::to_string(i), testing::ClusterPrompt(i, 4096), 8);
      ASSERT_TRUE(r.status.ok()) << r.status.error_message() << cluster.DumpLogs();
      tokens[low_latency ? 1 : 0].push_back(r.tokens);
    }
    const auto attention = Samples(cluster.attention_metrics_address(0));
    const double ll = LowLatencySteps(attention, "attention", 0);
    if (low_latency) {
      EXPECT_GT(ll, 0) << cluster.DumpLogs();
      EXPECT_EQ(LowLatencySteps(Samples(cluster.expert_metrics_address(0)), "expert", 0), ll);
      EXPECT_EQ(testing::Value(attention, R"(dxs_failed_steps_total{role="attention",rank="0"})"),
                0);
    } else {
      EXPECT_EQ(ll, 0);
    }
  }
  EXPECT_EQ(tokens[0], tokens[1]);
}

// A block-scaled FP8 checkpoint (gen-model --fp8) whose projections and experts are whole
// 128-blocks, so that both workers keep them FP8 on the GPU (the attention side's Linear, the
// expert side's FP8 grouped GEMM): 1 + 1 on the GPU against the single-process CUDA engine on
// the same files. Both compute with the same FP8 kernels on the same rows; the logit bound is
// cuda_engine_test's for FP8 (0.2: the GEMMs quantize activations to e4m3, and the cluster's
// steps can take the GEMMs where the solo reference takes the GEMV, or the reverse).
TEST_F(GpuCluster, Fp8CheckpointKeptFp8EqualsCudaEngine) {
  TempDir tmp;
  absl::StatusOr<CheckpointPreset> preset = GetPreset("default");
  ASSERT_TRUE(preset.ok()) << preset.status();
  preset->fp8 = true;
  preset->storage_dtype = DType::kBF16;
  preset->config.hidden_size = 256;
  preset->config.head_dim = 64;
  preset->config.moe_intermediate_size = 128;
  const std::string dir = tmp.path() + "/fp8";
  ASSERT_TRUE(WriteRandomCheckpoint(*preset, dir).ok());
  TempDir work;
  ProcessCluster cluster(work.path());
  OnGpu(&cluster);
  ClusterSpec spec{dir, 1, 1, {}};
  spec.wire_dtype = "bf16";
  absl::Status started = cluster.Start(spec);
  ASSERT_TRUE(started.ok()) << started << cluster.DumpLogs();
  // cuda_engine_test's "default-fp8" bound: the FP8 GEMMs quantize activations to e4m3 (3
  // mantissa bits), so logits carry up to 0.2 of the largest. The cluster batches its three
  // requests into those GEMMs where the solo reference's few rows may take the decode GEMVs
  // (activations not quantized), so a greedy choice within twice that may tip.
  EngineEquivalence reference = CudaReference();
  reference.max_logit_error = 0.2;
  reference.near_tie_gap_of_largest_logit = 2 * reference.max_logit_error;
  testing::ExpectClusterMatchesEngine(&cluster, dir, 1, 3, 4096, reference);
}

// Two DP ranks over the low-latency exchange, requests to rank 0 only: rank 1 takes part
// in every low-latency step with zero rows. EP rank 1 holds one expert of 16, so some of
// its steps receive nothing (counted empty from its experts' counts).
TEST_F(GpuCluster, LowLatencyWithEmptyDpRankAndEpRankWithoutRows) {
  TempDir tmp;
  const std::string dir = testing::WritePreset(tmp, "default");
  ProcessCluster cluster(tmp.path());
  OnGpu(&cluster);
  ClusterSpec spec{dir, 2, 2, {"0-14", "15"}};
  spec.wire_dtype = "bf16";
  spec.attention_args = {"--low-latency-capacity", "8"};
  absl::Status started = cluster.Start(spec);
  ASSERT_TRUE(started.ok()) << started << cluster.DumpLogs();
  testing::ExpectClusterMatchesEngine(&cluster, dir, 1, 2, 4096, CudaReference());
  const auto dp0 = Samples(cluster.attention_metrics_address(0));
  const auto dp1 = Samples(cluster.attention_metrics_address(1));
  const double ll = LowLatencySteps(dp0, "attention", 0);
  EXPECT_GT(ll, 0) << cluster.DumpLogs();
  EXPECT_EQ(LowLatencySteps(dp1, "attention", 1), ll);
  EXPECT_GT(testing::Value(dp1, "dxs_empty_batch_steps_total{role=\"attention\",rank=\"1\"}"), 0);
  for (int r = 0; r < 2; ++r) {
    const auto ep = Samples(cluster.expert_metrics_address(r));
    EXPECT_EQ(LowLatencySteps(ep, "expert", r), ll) << "EP rank " << r;
  }
}

// As KilledExpertFailsInFlightThenRecovers, with decode over the low-latency exchange: the
// attention rank's wait for the dead rank gives up (UNAVAILABLE), and the restarted rank
// gets a new exchange (a new generation) once it is back.
TEST_F(GpuCluster, LowLatencyKilledExpertFailsInFlightThenRecovers) {
  TempDir tmp;
  const std::string dir = testing::WritePreset(tmp, "default");
  ProcessCluster cluster(tmp.path());
  OnGpu(&cluster);
  ClusterSpec spec{dir, 1, 2, {}};
  spec.wire_dtype = "bf16";
  spec.attention_args = {"--low-latency-capacity", "8"};
  absl::Status started = cluster.Start(spec);
  ASSERT_TRUE(started.ok()) << started << cluster.DumpLogs();
  testing::ExpectKilledExpertFailsInFlightThenRecovers(&cluster, dir, 1, 1, CudaReference());
  EXPECT_GT(LowLatencySteps(Samples(cluster.attention_metrics_address(0)), "attention", 0), 0)
      << cluster.DumpLogs();
}

TEST_F(GpuCluster, UnevenPlacementOnTwoExperts) {
  TempDir tmp;
  const std::string dir = testing::WritePreset(tmp, "odd");
  ProcessCluster cluster(tmp.path());
  OnGpu(&cluster);
  ClusterSpec spec{dir, 1, 2, {"0-8", "9-11"}};
  absl::Status started = cluster.Start(spec);
  ASSERT_TRUE(started.ok()) << started << cluster.DumpLogs();
  testing::ExpectClusterMatchesEngine(&cluster, dir, 1, 3, 3001, CudaReference());
}

// Two DP ranks, requests to rank 0 only: rank 1 runs empty steps. EP rank 1 holds one
// expert of 16 (top-4), so some of its layer rounds carry no rows. Both take part in every
// step, and the outputs are right.
TEST_F(GpuCluster, EmptyDpRankAndEpRankWithoutRows) {
  TempDir tmp;
  const std::string dir = testing::WritePreset(tmp, "default");
  ProcessCluster cluster(tmp.path());
  OnGpu(&cluster);
  ClusterSpec spec{dir, 2, 2, {"0-14", "15"}};
  absl::Status started = cluster.Start(spec);
  ASSERT_TRUE(started.ok()) << started << cluster.DumpLogs();
  testing::ExpectClusterMatchesEngine(&cluster, dir, 1, 2, 4096, CudaReference());
  const auto dp1 = Samples(cluster.attention_metrics_address(1));
  EXPECT_GT(testing::Value(dp1, "dxs_empty_batch_steps_total{role=\"attention\",rank=\"1\"}"), 0);
  const auto ep1 = Samples(cluster.expert_metrics_address(1));
  EXPECT_GT(testing::Value(ep1, "dxs_empty_layer_rounds_total{rank=\"1\"}"), 0);
  EXPECT_GT(testing::Value(ep1, "dxs_layer_rounds_total{rank=\"1\"}"),
            testing::Value(ep1, "dxs_empty_layer_rounds_total{rank=\"1\"}"));
}

// As UcxCluster.KilledExpertFailsInFlightThenRecovers, on the GPU.
TEST_F(GpuCluster, KilledExpertFailsInFlightThenRecovers) {
  TempDir tmp;
  const std::string dir = testing::WritePreset(tmp, "default");
  ProcessCluster cluster(tmp.path());
  OnGpu(&cluster);
  ClusterSpec spec{dir, 1, 2, {}};
  absl::Status started = cluster.Start(spec);
  ASSERT_TRUE(started.ok()) << started << cluster.DumpLogs();
  testing::ExpectKilledExpertFailsInFlightThenRecovers(&cluster, dir, 1, 1, CudaReference());
}

// Streams of varied prompt lengths (3 to 13 tokens).
std::vector<int32_t> StreamPrompt(int i) {
  std::vector<int32_t> p;
  for (int j = 0; j < 3 + (i * 5) % 11; ++j) p.push_back(7 + (i * 389 + j * 131) % (4096 - 7));
  return p;
}

double RouterValue(const ProcessCluster& cluster, const std::string& name) {
  return testing::Value(Samples(cluster.router_metrics_address()), name);
}

// EPLB on the GPU path: the skewed model on DP2 x EP2 CUDA workers, --enable-eplb every 3
// steps with 2 redundant slots, under 16 streams. Placements change while requests decode
// (the new holders load their experts' weights onto the GPU), no step fails, and every
// output equals its solo run on the single-process CUDA engine.
TEST_F(GpuCluster, EplbRebalancesLiveOnCudaExperts) {
  TempDir tmp;
  const std::string dir = testing::WritePreset(tmp, "default", 1.2);
  ProcessCluster cluster(tmp.path());
  OnGpu(&cluster);
  cluster.set_router_args({"--num-redundant-experts", "2", "--enable-eplb", "--eplb-interval", "3",
                           "--heartbeat-ms", "50"});
  ClusterSpec spec{dir, 2, 2, {}};
  absl::Status started = cluster.Start(spec);
  ASSERT_TRUE(started.ok()) << started << cluster.DumpLogs();
  const uint64_t version_before = testing::CurrentClusterView(cluster).placement().version();
  testing::ExpectConcurrentStreamsMatchEngine(&cluster, dir, 2, 16, 24, "eplb-", StreamPrompt,
                                              CudaReference(), [] {});
  EXPECT_GT(testing::CurrentClusterView(cluster).placement().version(), version_before)
      << cluster.DumpLogs();
  EXPECT_GE(RouterValue(cluster, "dxs_eplb_rebalances_total"), 1) << cluster.DumpLogs();
  for (int r = 0; r < 2; ++r) {
    const auto samples = Samples(cluster.attention_metrics_address(r));
    EXPECT_EQ(testing::Value(samples, "dxs_failed_steps_total{role=\"attention\",rank=\"" +
                                          std::to_string(r) + "\"}"),
              0)
        << "DP rank " << r << cluster.DumpLogs();
  }
}

// Elastic EP on the GPU path: every expert on both EP ranks (16 redundant slots), EP rank 1
// killed while 8 streams decode. No request fails, each equals its solo run on the CUDA
// engine, and the router counts one recovery.
TEST_F(GpuCluster, KilledExpertWithReplicasFailsNoRequest) {
  TempDir tmp;
  const std::string dir = testing::WritePreset(tmp, "default");
  ProcessCluster cluster(tmp.path());
  OnGpu(&cluster);
  cluster.set_router_args(
      {"--elastic-ep", "--num-redundant-experts", "16", "--heartbeat-ms", "100"});
  ClusterSpec spec{dir, 2, 2, {}};
  absl::Status started = cluster.Start(spec);
  ASSERT_TRUE(started.ok()) << started << cluster.DumpLogs();
  testing::ExpectConcurrentStreamsMatchEngine(&cluster, dir, 2, 8, 32, "covered-", StreamPrompt,
                                              CudaReference(), [&] { cluster.KillExpert(1); });
  EXPECT_EQ(RouterValue(cluster, "dxs_eplb_recoveries_total"), 1) << cluster.DumpLogs();
}

}  // namespace
}  // namespace dxs
