// Serving through the router's front door: 64 concurrent streams of mixed lengths (one
// long enough to be prefilled in chunks while others decode) each produce exactly the
// tokens of the same request run alone in the single-process engine.
#include <grpcpp/grpcpp.h>

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

}  // namespace
}  // namespace dxs
