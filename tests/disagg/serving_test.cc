// Serving through the router's front door: 64 concurrent streams of mixed lengths (one
// long enough to be prefilled in chunks while others decode) each produce exactly the
// tokens of the same request run alone in the single-process engine.
#include <grpcpp/grpcpp.h>

#include <filesystem>
#include <thread>

#include "dxs/v1/frontend.grpc.pb.h"
#include "gtest/gtest.h"
#include "model/engine.h"
#include "tests/disagg/process_cluster.h"
#include "tests/model/test_util.h"

namespace dxs {
namespace {

using testing::ClusterSpec;
using testing::ProcessCluster;
using testing::TempDir;

struct Case {
  std::vector<int32_t> prompt;
  int max_new_tokens;
};

TEST(Serving, SixtyFourConcurrentStreamsMatchRequestsRunAlone) {
  TempDir tmp;
  const std::string dir = testing::WritePreset(tmp, "default");
  std::vector<Case> cases;
  for (int i = 0; i < 64; ++i) {
    Case c;
    // Mixed lengths; request 7 has 600 prompt tokens (the workers prefill 256 per step).
    const int len = i == 7 ? 600 : 1 + (i * 13) % 40;
    for (int j = 0; j < len; ++j) c.prompt.push_back(3 + (i * 331 + j * 97) % 4090);
    c.max_new_tokens = 1 + (i * 7) % 24;
    cases.push_back(c);
  }
  auto engine = LocalEngine::Load(dir);
  ASSERT_TRUE(engine.ok()) << engine.status();
  std::vector<std::vector<int32_t>> want;
  for (const Case& c : cases) {
    GenerationRequest r;
    r.prompt = c.prompt;
    r.max_new_tokens = c.max_new_tokens;
    auto out = (*engine)->GenerateBatch({r});  // alone
    ASSERT_TRUE(out.ok()) << out.status();
    want.push_back(out->front().tokens);
  }

  ProcessCluster cluster(tmp.path());
  absl::Status started = cluster.Start(ClusterSpec{dir, 2, 2, {}});
  ASSERT_TRUE(started.ok()) << started << cluster.DumpLogs();
  auto stub = v1::Frontend::NewStub(
      grpc::CreateChannel(cluster.router_address(), grpc::InsecureChannelCredentials()));
  std::vector<std::vector<int32_t>> got(cases.size());
  std::vector<grpc::Status> status(cases.size());
  std::vector<std::thread> threads;
  for (size_t i = 0; i < cases.size(); ++i) {
    threads.emplace_back([&, i] {
      v1::GenerateRequest req;
      for (int32_t t : cases[i].prompt) req.add_prompt_token_ids(static_cast<uint32_t>(t));
      req.mutable_sampling_params()->set_max_new_tokens(cases[i].max_new_tokens);
      req.mutable_sampling_params()->set_temperature(0.f);
      grpc::ClientContext ctx;
      ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(120));
      auto reader = stub->Generate(&ctx, req);
      v1::GenerateResponse resp;
      uint32_t expect_index = 0;
      while (reader->Read(&resp)) {
        if (!resp.has_chunk()) continue;
        EXPECT_EQ(resp.chunk().index(), expect_index) << "request " << i << ": out of order";
        for (uint32_t t : resp.chunk().token_ids()) got[i].push_back(static_cast<int32_t>(t));
        expect_index += static_cast<uint32_t>(resp.chunk().token_ids_size());
      }
      status[i] = reader->Finish();
    });
  }
  for (auto& t : threads) t.join();
  for (size_t i = 0; i < cases.size(); ++i) {
    ASSERT_TRUE(status[i].ok()) << "request " << i << ": " << status[i].error_message()
                                << cluster.DumpLogs();
    EXPECT_EQ(got[i], want[i]) << "request " << i;
  }
}

// --stream-interval 3 (SGLang's and vLLM's knob): the first token goes out at once, then
// chunks of at least three (the last may be shorter); the tokens are those of the engine.
// With the default interval of 1 the same request streams one token per message.
TEST(Serving, StreamIntervalChunksTokensAfterTheFirst) {
  TempDir tmp;
  const std::string dir = testing::WritePreset(tmp, "default");
  const std::vector<int32_t> prompt = {9, 41, 7, 300, 12};
  constexpr int kNewTokens = 11;
  auto engine = LocalEngine::Load(dir);
  ASSERT_TRUE(engine.ok()) << engine.status();
  GenerationRequest r;
  r.prompt = prompt;
  r.max_new_tokens = kNewTokens;
  r.ignore_eos = true;
  auto want = (*engine)->GenerateBatch({r});
  ASSERT_TRUE(want.ok()) << want.status();

  for (int interval : {1, 3}) {
    SCOPED_TRACE(::testing::Message() << "stream interval " << interval);
    const std::string work = tmp.path() + "/interval" + std::to_string(interval);
    std::filesystem::create_directories(work);
    ProcessCluster cluster(work);
    ClusterSpec spec{dir, 1, 1, {}};
    spec.attention_args = {"--stream-interval", std::to_string(interval)};
    absl::Status started = cluster.Start(spec);
    ASSERT_TRUE(started.ok()) << started << cluster.DumpLogs();
    v1::GenerateRequest req;
    req.set_request_id("interval");
    for (int32_t t : prompt) req.add_prompt_token_ids(static_cast<uint32_t>(t));
    req.mutable_sampling_params()->set_max_new_tokens(kNewTokens);
    req.mutable_sampling_params()->set_temperature(0.f);
    req.mutable_sampling_params()->set_ignore_eos(true);
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
    auto reader = cluster.frontend()->Generate(&ctx, req);
    v1::GenerateResponse resp;
    std::vector<int> chunk_sizes;
    std::vector<int32_t> got;
    while (reader->Read(&resp)) {
      if (!resp.has_chunk() || resp.chunk().token_ids_size() == 0) continue;
      EXPECT_EQ(resp.chunk().index(), got.size());
      chunk_sizes.push_back(resp.chunk().token_ids_size());
      for (uint32_t t : resp.chunk().token_ids()) got.push_back(static_cast<int32_t>(t));
    }
    ASSERT_TRUE(reader->Finish().ok());
    EXPECT_EQ(got, want->front().tokens);
    ASSERT_FALSE(chunk_sizes.empty());
    // The handler may wake late and find more tokens, never fewer than the interval.
    for (size_t i = 1; i + 1 < chunk_sizes.size(); ++i) EXPECT_GE(chunk_sizes[i], interval);
    if (interval == 1) {
      EXPECT_GT(chunk_sizes.size(), 3u) << "the default should stream token by token";
    } else {
      EXPECT_LE(chunk_sizes.size(), 1u + (kNewTokens - 1 + interval - 1) / interval);
    }
  }
}

}  // namespace
}  // namespace dxs
