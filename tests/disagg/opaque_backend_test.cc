// The opaque test backend (kernels/opaque_backend.h): tensors the host cannot read. A host
// read of its memory crashes, and a whole generation on it (single process; 3 DP x 2 EP
// ranks over inproc and UCX, one DP rank and one EP rank empty) gives the CPU backend's
// tokens and logits bit for bit. That holds only if the model, the step loops, the
// dispatch/combine engine and the expert workers touch tensor data through the backend
// alone, which is what a CUDA backend needs.
#include "kernels/opaque_backend.h"

#include <functional>

#include "gtest/gtest.h"
#include "model/engine.h"
#include "tests/disagg/cluster_harness.h"
#include "tests/model/test_util.h"

namespace dxs {
namespace {

using testing::ClusterOptions;
using testing::InprocCluster;
using testing::ResultSink;
using testing::TempDir;

std::unique_ptr<Backend> Opaque() {
  absl::StatusOr<std::unique_ptr<Backend>> b = MakeOpaqueBackend(size_t{1} << 30);
  EXPECT_TRUE(b.ok()) << b.status();
  return std::move(*b);
}

std::vector<GenerationRequest> Requests() {
  std::vector<GenerationRequest> out;
  for (int i = 0; i < 2; ++i) {
    GenerationRequest r;
    for (int j = 0; j < 3 + 9 * i; ++j) r.prompt.push_back(7 + (i * 977 + j * 131) % 4000);
    r.max_new_tokens = 6;
    out.push_back(r);
  }
  return out;
}

TEST(OpaqueBackendDeathTest, HostReadOfItsMemoryCrashes) {
  std::unique_ptr<Backend> b = Opaque();
  Tensor t = *b->Upload({1.f, 2.f, 3.f}, {3});
  EXPECT_EQ(*b->Download(t), (std::vector<float>{1.f, 2.f, 3.f}));  // through the backend
  EXPECT_EQ(t.device(), Device::kOpaque);
  EXPECT_DEATH(
      {
        volatile float v = t.f32()[0];
        (void)v;
      },
      "");
}

TEST(OpaqueBackend, EngineGivesTheCpuBackendsTokens) {
  TempDir tmp;
  const std::string dir = testing::WritePreset(tmp, "default");
  auto cpu = LocalEngine::Load(dir);
  EngineOptions options;
  options.backend_factory = Opaque;
  options.prefill_chunk_tokens = 5;  // chunked prefill beside decode in one step
  auto opaque = LocalEngine::Load(dir, options);
  ASSERT_TRUE(cpu.ok() && opaque.ok());
  EngineOptions chunked;
  chunked.prefill_chunk_tokens = 5;
  auto cpu_chunked = LocalEngine::Load(dir, chunked);
  auto want = (*cpu_chunked)->GenerateBatch(Requests());
  auto got = (*opaque)->GenerateBatch(Requests());
  ASSERT_TRUE(want.ok()) << want.status();
  ASSERT_TRUE(got.ok()) << got.status();
  for (size_t i = 0; i < want->size(); ++i) {
    EXPECT_EQ((*got)[i].tokens, (*want)[i].tokens) << "request " << i;
    EXPECT_EQ((*got)[i].first_logits, (*want)[i].first_logits) << "request " << i;
  }
}

// Runs `requests` (request i on DP rank i) on 3 DP ranks over `placement`, every rank on
// the opaque backend, and checks the tokens against the CPU engine's.
void ExpectCpuTokens(const std::string& dir, const std::string& transport,
                     const Placement& placement, const std::vector<GenerationRequest>& requests,
                     const std::function<void(const InprocCluster&)>& check) {
  auto engine = LocalEngine::Load(dir);
  ASSERT_TRUE(engine.ok());
  auto want = (*engine)->GenerateBatch(requests);
  ASSERT_TRUE(want.ok());
  ClusterOptions options;
  options.transport = transport;
  options.backend_factory = Opaque;
  // Decode steps in graph segments (eagerly): the padded path touches no host memory either.
  options.piecewise = AttentionStepLoop::PiecewiseDecode::kEager;
  InprocCluster cluster(dir, 3, placement, options);  // DP rank 2 gets no request
  std::vector<std::shared_ptr<ResultSink>> sinks;
  for (size_t i = 0; i < requests.size(); ++i) {
    sinks.push_back(std::make_shared<ResultSink>());
    ASSERT_TRUE(cluster.Submit(static_cast<int>(i), i, requests[i], sinks.back()).ok());
  }
  ASSERT_TRUE(cluster.WaitAllDone(sinks, absl::Seconds(60))) << "cluster hung";
  for (size_t i = 0; i < requests.size(); ++i) {
    ASSERT_TRUE(sinks[i]->status.ok()) << sinks[i]->status;
    EXPECT_EQ(sinks[i]->tokens, (*want)[i].tokens) << "request " << i;
    EXPECT_LT(testing::RelativeError(sinks[i]->first_logits, (*want)[i].first_logits), 1e-5);
  }
  EXPECT_GT(cluster.attention_counters(2).steps.load(), 0);
  EXPECT_EQ(cluster.attention_counters(2).empty_steps.load(),
            cluster.attention_counters(2).steps.load());
  check(cluster);
}

class OpaqueDisagg : public ::testing::TestWithParam<std::string> {};

TEST_P(OpaqueDisagg, GivesTheCpuBackendsTokens) {
  TempDir tmp;
  const std::string dir = testing::WritePreset(tmp, "default");
  ExpectCpuTokens(dir, GetParam(), Placement::Contiguous(16, 2), Requests(),
                  [](const InprocCluster& c) {
                    EXPECT_GT(c.expert_counters(0).rows_received.load(), 0);
                    EXPECT_GT(c.expert_counters(1).rows_received.load(), 0);
                  });
}

TEST_P(OpaqueDisagg, AnExpertRankWithNoTokensTakesPart) {
  TempDir tmp;
  const std::string dir = testing::WritePreset(tmp, "default");
  // One 1-token prompt leaves experts unused (4 layers x top-4 of 16); EP rank 1 holds
  // only those.
  GenerationRequest r;
  r.prompt = {4097 % 4000};
  r.max_new_tokens = 1;
  auto engine = LocalEngine::Load(dir);
  ASSERT_TRUE(engine.ok());
  ASSERT_TRUE((*engine)->GenerateBatch({r}).ok());
  const std::vector<int64_t> used = (*engine)->experts().tokens_per_expert_snapshot();
  std::vector<int> busy, idle;
  for (int e = 0; e < 16; ++e) (used[e] == 0 ? idle : busy).push_back(e);
  ASSERT_FALSE(idle.empty()) << "every expert is used: pick another prompt";
  auto placement = Placement::FromRankExperts(16, {busy, idle});
  ASSERT_TRUE(placement.ok());
  ExpectCpuTokens(dir, GetParam(), *placement, {r}, [](const InprocCluster& c) {
    EXPECT_EQ(c.expert_counters(1).rows_received.load(), 0);
    EXPECT_GT(c.expert_counters(1).empty_steps.load(), 0);
    EXPECT_EQ(c.expert_counters(1).empty_steps.load(), c.expert_counters(1).steps.load());
  });
}

INSTANTIATE_TEST_SUITE_P(Transports, OpaqueDisagg, ::testing::Values("inproc", "ucx"));

}  // namespace
}  // namespace dxs
