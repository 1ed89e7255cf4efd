// AttentionWorker.Serve, the one multiplexed stream the router keeps per attention rank,
// against real worker processes: many requests submitted at once on one stream get
// exactly the tokens of each request run alone, several requests' news share one message;
// the worker's refusals come back as events with Generate's codes; an abort on the stream,
// or the stream's end (the router gone), frees the KV cache; a request with n samples
// interleaves its samples' tagged chunks and ends once; and through the router, a worker
// killed mid-request fails its requests with UNAVAILABLE.
#include <grpcpp/grpcpp.h>

#include <map>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "dxs/v1/attention_worker.grpc.pb.h"
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
using ServeStream = grpc::ClientReaderWriter<v1::ServeRequest, v1::ServeEvents>;

constexpr int kContext = 4096;  // the "default" preset's max_position_embeddings

// How long a test waits for the worker to reach a state (a generous bound: the wait ends
// as soon as the state is reached).
constexpr absl::Duration kStateTimeout = absl::Seconds(30);

std::chrono::system_clock::time_point In(absl::Duration d) {
  return std::chrono::system_clock::now() + std::chrono::milliseconds(absl::ToInt64Milliseconds(d));
}

v1::ServeRequest Submit(const std::string& id, const std::vector<int32_t>& prompt,
                        int max_new_tokens, bool ignore_eos = false) {
  v1::ServeRequest r;
  v1::GenerateRequest* g = r.mutable_submit();
  g->set_request_id(id);
  for (int32_t t : prompt) g->add_prompt_token_ids(static_cast<uint32_t>(t));
  g->mutable_sampling_params()->set_max_new_tokens(max_new_tokens);
  g->mutable_sampling_params()->set_temperature(0.f);
  g->mutable_sampling_params()->set_ignore_eos(ignore_eos);
  return r;
}

v1::ServeRequest AbortRequest(const std::string& id) {
  v1::ServeRequest r;
  r.mutable_abort()->set_request_id(id);
  return r;
}

// Reads events until `until` holds for one of them; returns them all.
template <typename Pred>
std::vector<v1::ServeEvent> ReadUntil(ServeStream* stream, Pred until) {
  std::vector<v1::ServeEvent> got;
  v1::ServeEvents message;
  while (stream->Read(&message)) {
    for (const v1::ServeEvent& e : message.events()) {
      got.push_back(e);
      if (until(e)) return got;
    }
  }
  ADD_FAILURE() << "the stream ended first";
  return got;
}

v1::RankLoad Load(ProcessCluster& cluster) {
  grpc::ClientContext context;
  context.set_deadline(In(absl::Seconds(5)));
  v1::GetLoadResponse response;
  EXPECT_TRUE(cluster.attention(0)->GetLoad(&context, v1::GetLoadRequest(), &response).ok());
  return response.load();
}

// Polls until rank 0's load satisfies `done` (true) or kStateTimeout passes (false).
template <typename Pred>
bool WaitForLoad(ProcessCluster& cluster, Pred done) {
  const absl::Time deadline = absl::Now() + kStateTimeout;
  while (true) {
    if (done(Load(cluster))) return true;
    if (absl::Now() > deadline) return false;
    absl::SleepFor(absl::Milliseconds(25));
  }
}

// Polls until rank 0 runs nothing and holds no KV.
bool WaitForIdle(ProcessCluster& cluster) {
  return WaitForLoad(cluster, [](const v1::RankLoad& load) {
    return load.num_running_requests() == 0 && load.num_queued_requests() == 0 &&
           load.kv_cache_used_tokens() == 0;
  });
}

class ServeStreamTest : public ::testing::Test {
 protected:
  void StartCluster(std::vector<std::string> attention_args = {}) {
    dir_ = testing::WritePreset(tmp_, "default");
    cluster_ = std::make_unique<ProcessCluster>(tmp_.path());
    ClusterSpec spec{dir_, 1, 1, {}};
    spec.attention_args = std::move(attention_args);
    absl::Status started = cluster_->Start(spec);
    ASSERT_TRUE(started.ok()) << started << cluster_->DumpLogs();
  }

  TempDir tmp_;
  std::string dir_;
  std::unique_ptr<ProcessCluster> cluster_;
};

// The requests queue behind a holder request that reserves the whole KV cache (as long as
// the context allows, so it cannot end by itself first); aborting it admits them all at
// once, so their steps carry many requests each however fast the worker reads the stream.
TEST_F(ServeStreamTest, ManyRequestsOnOneStreamMatchRequestsRunAlone) {
  StartCluster({"--kv-tokens", std::to_string(kContext)});
  constexpr int kRequests = 24;
  std::vector<std::vector<int32_t>> prompts;
  std::vector<int> max_new;
  for (int i = 0; i < kRequests; ++i) {
    std::vector<int32_t> p;
    for (int j = 0; j < 1 + (i * 11) % 30; ++j) p.push_back(3 + (i * 577 + j * 61) % 4000);
    prompts.push_back(p);
    max_new.push_back(2 + (i * 5) % 17);
  }
  auto engine = LocalEngine::Load(dir_);
  ASSERT_TRUE(engine.ok()) << engine.status();

  grpc::ClientContext context;
  context.set_deadline(In(absl::Seconds(120)));
  std::unique_ptr<ServeStream> stream = cluster_->attention(0)->Serve(&context);
  const int holder_new_tokens = kContext - 1;
  ASSERT_TRUE(stream->Write(Submit("holder", {5}, holder_new_tokens, /*ignore_eos=*/true)));
  ASSERT_FALSE(
      ReadUntil(stream.get(), [](const v1::ServeEvent& e) { return e.has_chunk(); }).empty());
  for (int i = 0; i < kRequests; ++i) {
    ASSERT_TRUE(stream->Write(Submit("m" + std::to_string(i), prompts[i], max_new[i])));
  }
  ASSERT_TRUE(WaitForLoad(*cluster_,
                          [&](const v1::RankLoad& load) {
                            return load.num_queued_requests() == static_cast<uint32_t>(kRequests);
                          }))
      << "the requests did not all queue behind the holder: " << Load(*cluster_).DebugString()
      << cluster_->DumpLogs();
  ASSERT_TRUE(stream->Write(AbortRequest("holder")));
  std::optional<v1::GenerateComplete> holder_end;
  std::map<std::string, std::vector<int32_t>> tokens;
  std::map<std::string, v1::GenerateComplete> completes;
  int max_requests_per_message = 0;
  v1::ServeEvents message;
  while (static_cast<int>(completes.size()) < kRequests && stream->Read(&message)) {
    std::map<std::string, int> in_message;
    for (const v1::ServeEvent& e : message.events()) {
      if (e.request_id() == "holder") {
        ASSERT_FALSE(holder_end.has_value()) << "holder: event after the end";
        ASSERT_FALSE(e.has_error()) << "holder: " << e.error().message();
        if (e.has_complete()) holder_end = e.complete();
        continue;
      }
      ++in_message[e.request_id()];
      ASSERT_FALSE(completes.count(e.request_id())) << e.request_id() << ": event after the end";
      ASSERT_FALSE(e.has_error()) << e.request_id() << ": " << e.error().message();
      if (e.has_chunk()) {
        std::vector<int32_t>& t = tokens[e.request_id()];
        EXPECT_EQ(e.chunk().index(), t.size()) << e.request_id() << ": out of order";
        for (uint32_t id : e.chunk().token_ids()) t.push_back(static_cast<int32_t>(id));
      } else if (e.has_complete()) {
        completes[e.request_id()] = e.complete();
      }
    }
    max_requests_per_message = std::max<int>(max_requests_per_message, in_message.size());
  }
  ASSERT_EQ(static_cast<int>(completes.size()), kRequests) << cluster_->DumpLogs();
  ASSERT_TRUE(holder_end.has_value());
  EXPECT_EQ(holder_end->finish_reason(), v1::FINISH_REASON_ABORTED);
  EXPECT_LT(holder_end->completion_tokens(), static_cast<uint32_t>(holder_new_tokens));
  // One message per step carries the news of every request of the step.
  EXPECT_GT(max_requests_per_message, kRequests / 2);
  for (int i = 0; i < kRequests; ++i) {
    const std::string id = "m" + std::to_string(i);
    GenerationRequest r;
    r.prompt = prompts[i];
    r.max_new_tokens = max_new[i];
    auto want = (*engine)->GenerateBatch({r});
    ASSERT_TRUE(want.ok()) << want.status();
    EXPECT_EQ(tokens[id], want->front().tokens) << id;
    EXPECT_EQ(completes[id].completion_tokens(), tokens[id].size()) << id;
    EXPECT_EQ(completes[id].prompt_tokens(), prompts[i].size()) << id;
    EXPECT_EQ(completes[id].data_parallel_rank(), 0u) << id;
  }
  // The stream still takes requests after all that.
  ASSERT_TRUE(stream->Write(Submit("after", {5, 6, 7}, 3)));
  auto rest = ReadUntil(stream.get(), [](const v1::ServeEvent& e) { return e.has_complete(); });
  ASSERT_FALSE(rest.empty());
  EXPECT_EQ(rest.back().request_id(), "after");
  stream->WritesDone();
  EXPECT_TRUE(stream->Finish().ok());
}

TEST_F(ServeStreamTest, WorkerRefusalsComeBackWithTheirCodes) {
  // A KV cache smaller than the context, so that a request can fit the one and not the other.
  constexpr int kKvTokens = 4000;
  StartCluster({"--kv-tokens", std::to_string(kKvTokens)});
  grpc::ClientContext context;
  context.set_deadline(In(absl::Seconds(60)));
  std::unique_ptr<ServeStream> stream = cluster_->attention(0)->Serve(&context);
  auto error_for = [&](const v1::ServeRequest& r) {
    EXPECT_TRUE(stream->Write(r));
    auto got = ReadUntil(stream.get(), [&](const v1::ServeEvent& e) {
      return e.request_id() == r.submit().request_id() && (e.has_error() || e.has_complete());
    });
    return got.empty() ? v1::ServeError() : got.back().error();
  };
  // A long request in flight, for the duplicate: as long as the KV cache allows, so that it
  // is still running after the refusals on any machine.
  const int long_new_tokens = kKvTokens - 3;
  ASSERT_TRUE(stream->Write(Submit("long", {4, 5, 6}, long_new_tokens, /*ignore_eos=*/true)));
  auto first = ReadUntil(stream.get(), [](const v1::ServeEvent& e) { return e.has_chunk(); });
  ASSERT_FALSE(first.empty());

  EXPECT_EQ(error_for(Submit("", {1, 2}, 2)).code(), grpc::StatusCode::INVALID_ARGUMENT);
  v1::ServeRequest too_large = Submit("too-large", {1}, 2);
  too_large.mutable_submit()->add_prompt_token_ids(0x80000000u);
  const v1::ServeError bad_token = error_for(too_large);
  EXPECT_EQ(bad_token.code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(bad_token.message().find("too large"), std::string::npos) << bad_token.message();
  v1::ServeRequest other_rank = Submit("other-rank", {1, 2}, 2);
  other_rank.mutable_submit()->set_data_parallel_rank(3);
  EXPECT_EQ(error_for(other_rank).code(), grpc::StatusCode::INVALID_ARGUMENT);
  const v1::ServeError duplicate = error_for(Submit("long", {1, 2}, 2));
  EXPECT_EQ(duplicate.code(), grpc::StatusCode::ALREADY_EXISTS);
  EXPECT_NE(duplicate.message().find("already in flight"), std::string::npos);
  // Within the context, beyond the KV cache.
  EXPECT_EQ(error_for(Submit("huge", {1, 2}, kContext - 2)).code(),
            grpc::StatusCode::RESOURCE_EXHAUSTED);
  // One sample would fit the KV cache, three cannot; more than 64 samples is refused.
  v1::ServeRequest samples = Submit("three-samples", {1, 2}, 1500);
  samples.mutable_submit()->mutable_sampling_params()->set_n(3);
  EXPECT_EQ(error_for(samples).code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  samples.mutable_submit()->mutable_sampling_params()->set_max_new_tokens(2);
  samples.mutable_submit()->mutable_sampling_params()->set_n(65);
  const v1::ServeError too_many = error_for(samples);
  EXPECT_EQ(too_many.code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(too_many.message().rfind("n: ", 0), 0u) << too_many.message();

  // The refusals disturbed nothing: the long request runs on, and an abort ends it.
  ASSERT_TRUE(stream->Write(AbortRequest("long")));
  auto end = ReadUntil(stream.get(), [](const v1::ServeEvent& e) {
    return e.request_id() == "long" && (e.has_complete() || e.has_error());
  });
  ASSERT_FALSE(end.empty());
  ASSERT_TRUE(end.back().has_complete());
  EXPECT_EQ(end.back().complete().finish_reason(), v1::FINISH_REASON_ABORTED);
  EXPECT_LT(end.back().complete().completion_tokens(), static_cast<uint32_t>(long_new_tokens));
  EXPECT_TRUE(WaitForIdle(*cluster_)) << "the aborted request's KV was not freed";
  // An abort of an id that is not in flight is ignored.
  ASSERT_TRUE(stream->Write(AbortRequest("nobody")));
  stream->WritesDone();
  EXPECT_TRUE(stream->Finish().ok());
}

TEST_F(ServeStreamTest, TheStreamsEndAbortsItsRequestsAndFreesTheirKv) {
  StartCluster();
  {
    grpc::ClientContext context;
    context.set_deadline(In(absl::Seconds(60)));
    std::unique_ptr<ServeStream> stream = cluster_->attention(0)->Serve(&context);
    // As long as the context allows: all four still run when the stream ends.
    for (int i = 0; i < 4; ++i) {
      ASSERT_TRUE(stream->Write(Submit("gone" + std::to_string(i), {7, 8, 9}, kContext - 3, true)));
    }
    auto first = ReadUntil(stream.get(), [](const v1::ServeEvent& e) { return e.has_chunk(); });
    ASSERT_FALSE(first.empty());
    // The first chunk can come before the worker has read the other submits off the stream
    // (its first step starts at the first request): wait until it holds all four.
    v1::RankLoad busy;
    WaitForLoad(*cluster_, [&](const v1::RankLoad& load) {
      busy = load;
      return load.num_running_requests() + load.num_queued_requests() >= 4;
    });
    EXPECT_GT(busy.kv_cache_used_tokens(), 0u);
    EXPECT_EQ(busy.num_running_requests() + busy.num_queued_requests(), 4u) << cluster_->DumpLogs();
    context.TryCancel();  // the router went away
    stream->Finish();
  }
  EXPECT_TRUE(WaitForIdle(*cluster_)) << "the stream's requests still hold KV";
  // The ids are free again.
  grpc::ClientContext context;
  context.set_deadline(In(absl::Seconds(60)));
  std::unique_ptr<ServeStream> stream = cluster_->attention(0)->Serve(&context);
  ASSERT_TRUE(stream->Write(Submit("gone0", {7, 8, 9}, 2)));
  auto end = ReadUntil(stream.get(),
                       [](const v1::ServeEvent& e) { return e.has_complete() || e.has_error(); });
  ASSERT_FALSE(end.empty());
  EXPECT_TRUE(end.back().has_complete()) << end.back().error().message();
  stream->WritesDone();
  EXPECT_TRUE(stream->Finish().ok());
}

// A request with n = 3 on the stream: its samples' chunks interleave, each tagged and in
// order, each sample's tokens are a single request's with its seed, and one `complete`
// (with the other samples' ends) comes last. The stream's end stops every sample of a
// running one and frees their KV.
TEST_F(ServeStreamTest, SamplesInterleaveAndEndOnce) {
  StartCluster({"--stream-interval", "2"});
  auto engine = LocalEngine::Load(dir_);
  ASSERT_TRUE(engine.ok()) << engine.status();
  {
    grpc::ClientContext context;
    context.set_deadline(In(absl::Seconds(60)));
    std::unique_ptr<ServeStream> stream = cluster_->attention(0)->Serve(&context);
    v1::ServeRequest submit = Submit("three", {11, 400, 93, 7}, 7, /*ignore_eos=*/true);
    v1::SamplingParams* p = submit.mutable_submit()->mutable_sampling_params();
    p->set_temperature(0.9f);
    p->set_seed(3);
    p->set_n(3);
    ASSERT_TRUE(stream->Write(submit));
    auto events = ReadUntil(stream.get(), [](const v1::ServeEvent& e) {
      return e.request_id() == "three" && (e.has_complete() || e.has_error());
    });
    ASSERT_FALSE(events.empty());
    ASSERT_TRUE(events.back().has_complete()) << events.back().error().message();
    std::vector<std::vector<int32_t>> tokens(3);
    std::set<uint32_t> chunk_samples;
    for (size_t k = 0; k + 1 < events.size(); ++k) {
      ASSERT_TRUE(events[k].has_chunk()) << "only chunks before the one end";
      const v1::TokenChunk& chunk = events[k].chunk();
      ASSERT_LT(chunk.sample_index(), 3u);
      chunk_samples.insert(chunk.sample_index());
      std::vector<int32_t>& t = tokens[chunk.sample_index()];
      EXPECT_EQ(chunk.index(), t.size()) << "sample " << chunk.sample_index() << ": out of order";
      for (uint32_t id : chunk.token_ids()) t.push_back(static_cast<int32_t>(id));
    }
    EXPECT_EQ(chunk_samples.size(), 3u);
    const v1::GenerateComplete& end = events.back().complete();
    EXPECT_EQ(end.finish_reason(), v1::FINISH_REASON_LENGTH);
    EXPECT_EQ(end.completion_tokens(), tokens[0].size());
    EXPECT_EQ(end.prompt_tokens(), 4u);
    ASSERT_EQ(end.samples_size(), 2);
    for (int32_t i = 0; i < 3; ++i) {
      GenerationRequest r;
      r.prompt = {11, 400, 93, 7};
      r.max_new_tokens = 7;
      r.ignore_eos = true;
      r.sampling.temperature = 0.9f;
      r.sampling.seed = SampleSeed(3, i);
      auto want = (*engine)->GenerateBatch({r});
      ASSERT_TRUE(want.ok()) << want.status();
      EXPECT_EQ(tokens[i], want->front().tokens) << "sample " << i;
      if (i == 0) continue;
      EXPECT_EQ(end.samples(i - 1).sample_index(), static_cast<uint32_t>(i));
      EXPECT_EQ(end.samples(i - 1).finish_reason(), v1::FINISH_REASON_LENGTH);
      EXPECT_EQ(end.samples(i - 1).completion_tokens(), tokens[i].size());
    }
    // A long one, then the router goes away.
    v1::ServeRequest long_submit = Submit("three-long", {7, 8, 9}, kContext - 3, true);
    long_submit.mutable_submit()->mutable_sampling_params()->set_n(3);
    ASSERT_TRUE(stream->Write(long_submit));
    auto first = ReadUntil(stream.get(), [](const v1::ServeEvent& e) {
      return e.request_id() == "three-long" && e.has_chunk() && e.chunk().sample_index() == 2;
    });
    ASSERT_FALSE(first.empty());
    EXPECT_GT(Load(*cluster_).kv_cache_used_tokens(), 0u);
    context.TryCancel();
    stream->Finish();
  }
  EXPECT_TRUE(WaitForIdle(*cluster_)) << "the samples still hold KV";
}

// Through the router: killing the attention worker under a running request ends it with
// UNAVAILABLE naming the rank, within seconds.
TEST(ServeStreamRouterTest, KilledWorkerFailsItsRequestsWithUnavailable) {
  TempDir tmp;
  const std::string dir = testing::WritePreset(tmp, "default");
  ProcessCluster cluster(tmp.path());
  absl::Status started = cluster.Start(ClusterSpec{dir, 2, 1, {}});
  ASSERT_TRUE(started.ok()) << started << cluster.DumpLogs();
  std::vector<std::unique_ptr<grpc::ClientContext>> contexts;
  std::vector<std::unique_ptr<grpc::ClientReader<v1::GenerateResponse>>> readers;
  for (int i = 0; i < 3; ++i) {
    v1::GenerateRequest req;
    req.set_request_id("doomed" + std::to_string(i));
    req.add_prompt_token_ids(5);
    req.add_prompt_token_ids(6);
    // As long as the context allows: still running when the worker is killed.
    req.mutable_sampling_params()->set_max_new_tokens(kContext - 2);
    req.mutable_sampling_params()->set_ignore_eos(true);
    req.set_data_parallel_rank(1);
    contexts.push_back(std::make_unique<grpc::ClientContext>());
    contexts.back()->set_deadline(In(absl::Seconds(60)));
    readers.push_back(cluster.frontend()->Generate(contexts.back().get(), req));
  }
  v1::GenerateResponse m;
  for (auto& reader : readers) ASSERT_TRUE(reader->Read(&m));  // running
  const absl::Time killed_at = absl::Now();
  cluster.KillAttention(1);
  for (auto& reader : readers) {
    while (reader->Read(&m)) {
    }
    const grpc::Status s = reader->Finish();
    EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAVAILABLE) << s.error_message();
    EXPECT_NE(s.error_message().find("attention rank 1"), std::string::npos) << s.error_message();
    EXPECT_NE(s.error_message().find("safe to retry"), std::string::npos) << s.error_message();
  }
  EXPECT_LT(absl::Now() - killed_at, absl::Seconds(10));
}

}  // namespace
}  // namespace dxs
