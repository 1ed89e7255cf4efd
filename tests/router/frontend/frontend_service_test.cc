// FrontendService in one process, in front of scripted fake attention workers over real
// gRPC on loopback: the paths a real cluster rarely hits on cue. Messages are relayed
// unchanged; a caller's cancellation reaches the worker while no token flows; Abort of a
// request the worker does not know yet still ends with FINISH_REASON_ABORTED (every
// sample's end, with n samples); a rank whose worker dies fails its requests with
// UNAVAILABLE; an unreachable rank is UNAVAILABLE; GetLoads merges the worker's numbers
// with the router's (a request's n samples owe max_new_tokens each); Shutdown ends every
// stream.
// Those fakes implement only Generate, so the router falls back to it; fakes with Serve
// check the multiplexed path: concurrent requests share one stream per rank, worker errors
// keep their code, cancellation, deadlines and Abort travel on the stream as aborts, and a
// stream broken mid-request is UNAVAILABLE.
#include "router/frontend/frontend_service.h"

#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <atomic>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/synchronization/notification.h"
#include "common/grpc/metadata.h"
#include "common/grpc/server.h"
#include "dxs/v1/attention_worker.grpc.pb.h"
#include "gtest/gtest.h"
#include "router/frontend/cluster_watcher.h"
#include "router/frontend/model_info.h"

namespace dxs {
namespace {

// How long a test waits for a fake worker to see what it expects (a generous bound: every
// wait ends as soon as it does).
constexpr absl::Duration kWaitTimeout = absl::Seconds(30);

std::chrono::system_clock::time_point In(absl::Duration d) {
  return std::chrono::system_clock::now() + std::chrono::milliseconds(absl::ToInt64Milliseconds(d));
}

// Serves `service` on a kernel-chosen loopback port; sets *address to reach it.
std::unique_ptr<grpc::Server> ServeOnLoopback(grpc::Service* service, std::string* address) {
  GrpcServerOptions options;
  options.address = "127.0.0.1:0";
  absl::StatusOr<GrpcServer> server = StartGrpcServer(options, {service});
  EXPECT_TRUE(server.ok()) << server.status();
  if (!server.ok()) return nullptr;
  *address = "127.0.0.1:" + std::to_string(server->port);
  return std::move(server->server);
}

// A chunk of `tokens` from `index` as a worker sends it for a request that asked for
// log-probabilities (made-up values, distinct per token) and, with `prompt`, the prompt's
// scores: what the router must relay untouched.
v1::TokenChunk ScoredChunk(uint32_t index, const std::vector<uint32_t>& tokens, bool prompt) {
  v1::TokenChunk chunk;
  chunk.set_index(index);
  for (uint32_t t : tokens) {
    chunk.add_token_ids(t);
    v1::TokenLogprobs* lp = chunk.add_logprobs();
    lp->set_logprob(-0.1f * static_cast<float>(t));
    v1::TopLogprob* top = lp->add_top_logprobs();
    top->set_token_id(t + 1);
    top->set_logprob(-0.01f * static_cast<float>(t));
    lp->add_token_ids_logprobs(-3.5f);
  }
  if (prompt) {
    v1::PromptLogprobs* p = chunk.mutable_prompt_logprobs();
    p->set_first_position(1);
    p->add_token_ids(4);
    p->add_positions()->set_logprob(-2.25f);
    p->mutable_next()->add_token_ids_logprobs(-1.5f);
  }
  return chunk;
}

// A scripted AttentionWorker. kStream: two chunks (ScoredChunk, the prompt's scores in the
// first) then a complete. kHold: sends nothing
// until cancelled, or until Abort (when it knows ids), then a complete ABORTED.
class FakeWorker final : public v1::AttentionWorker::Service {
 public:
  enum class Mode { kStream, kHold };
  FakeWorker(int rank, Mode mode, bool knows_ids) : rank_(rank), mode_(mode), knows_(knows_ids) {
    server_ = ServeOnLoopback(this, &address_);
  }
  ~FakeWorker() override { Stop(); }
  void Stop() {
    if (server_) server_->Shutdown(In(absl::Milliseconds(100)));
    server_.reset();
  }

  grpc::Status Generate(grpc::ServerContext* context, const v1::GenerateRequest* request,
                        grpc::ServerWriter<v1::GenerateResponse>* writer) override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      last_request_ = *request;
    }
    started_.Notify();
    if (mode_ == Mode::kStream) {
      v1::GenerateResponse m;
      m.set_request_id(request->request_id());
      *m.mutable_chunk() = ScoredChunk(0, {7, 8}, /*prompt=*/true);
      writer->Write(m);
      *m.mutable_chunk() = ScoredChunk(2, {9}, /*prompt=*/false);
      writer->Write(m);
      m.mutable_complete()->set_finish_reason(v1::FINISH_REASON_LENGTH);
      m.mutable_complete()->set_prompt_tokens(request->prompt_token_ids_size());
      m.mutable_complete()->set_completion_tokens(3);
      m.mutable_complete()->set_data_parallel_rank(rank_);
      m.mutable_complete()->mutable_timings()->set_queue_time_ns(1234);
      writer->Write(m);
      return grpc::Status::OK;
    }
    while (!context->IsCancelled() && !aborted_) absl::SleepFor(absl::Milliseconds(5));
    if (aborted_) {
      v1::GenerateResponse m;
      m.set_request_id(request->request_id());
      m.mutable_complete()->set_finish_reason(v1::FINISH_REASON_ABORTED);
      m.mutable_complete()->set_data_parallel_rank(rank_);
      writer->Write(m);
      return grpc::Status::OK;
    }
    cancelled_.Notify();
    return grpc::Status::CANCELLED;
  }
  grpc::Status Abort(grpc::ServerContext*, const v1::AbortRequest*, v1::AbortResponse*) override {
    if (!knows_) return grpc::Status(grpc::StatusCode::NOT_FOUND, "not here");
    aborted_ = true;
    return grpc::Status::OK;
  }
  grpc::Status GetLoad(grpc::ServerContext*, const v1::GetLoadRequest*,
                       v1::GetLoadResponse* response) override {
    v1::RankLoad* load = response->mutable_load();
    load->set_rank(rank_);
    load->set_num_running_requests(3);
    load->set_kv_cache_used_tokens(40);
    load->set_kv_cache_total_tokens(1000);
    load->set_state(v1::WORKER_STATE_READY);
    return grpc::Status::OK;
  }

  const std::string& address() const { return address_; }
  absl::Notification& started() { return started_; }
  absl::Notification& cancelled() { return cancelled_; }
  v1::GenerateRequest last_request() {
    std::lock_guard<std::mutex> lock(mu_);
    return last_request_;
  }

 private:
  const int rank_;
  const Mode mode_;
  const bool knows_;
  std::unique_ptr<grpc::Server> server_;
  std::string address_;
  absl::Notification started_, cancelled_;
  std::atomic<bool> aborted_{false};
  std::mutex mu_;
  v1::GenerateRequest last_request_;
};

// A scripted AttentionWorker that implements Serve (and not Generate). Per submitted id:
// "refuse..." gets a RESOURCE_EXHAUSTED error event; "hold..." nothing until aborted, then
// a complete ABORTED; any other two chunks (7 8, 9, as ScoredChunk) and a complete LENGTH.
class FakeServeWorker final : public v1::AttentionWorker::Service {
 public:
  explicit FakeServeWorker(int rank) : rank_(rank) { server_ = ServeOnLoopback(this, &address_); }
  ~FakeServeWorker() override {
    if (server_) server_->Shutdown(In(absl::Milliseconds(100)));
  }

  grpc::Status Serve(grpc::ServerContext* context,
                     grpc::ServerReaderWriter<v1::ServeEvents, v1::ServeRequest>* stream) override {
    ++serve_calls_;
    context->AddInitialMetadata(kServeAcceptedMetadataKey, "1");  // as the real worker
    stream->SendInitialMetadata();
    v1::ServeRequest request;
    while (stream->Read(&request)) {
      v1::ServeEvents out;
      if (request.has_abort()) {
        const std::string& id = request.abort().request_id();
        {
          std::lock_guard<std::mutex> lock(mu_);
          aborted_.push_back(id);
          if (held_.erase(id) == 0) continue;
        }
        v1::ServeEvent* e = out.add_events();
        e->set_request_id(id);
        e->mutable_complete()->set_finish_reason(v1::FINISH_REASON_ABORTED);
        e->mutable_complete()->set_data_parallel_rank(rank_);
      } else {
        const std::string& id = request.submit().request_id();
        if (id.rfind("hold", 0) == 0) {
          std::lock_guard<std::mutex> lock(mu_);
          held_.insert(id);
          continue;
        }
        if (id.rfind("refuse", 0) == 0) {
          v1::ServeEvent* e = out.add_events();
          e->set_request_id(id);
          e->mutable_error()->set_code(grpc::StatusCode::RESOURCE_EXHAUSTED);
          e->mutable_error()->set_message("queue full");
        } else {
          v1::ServeEvent* e = out.add_events();
          e->set_request_id(id);
          *e->mutable_chunk() = ScoredChunk(0, {7, 8}, /*prompt=*/true);
          e = out.add_events();
          e->set_request_id(id);
          *e->mutable_chunk() = ScoredChunk(2, {9}, /*prompt=*/false);
          e = out.add_events();
          e->set_request_id(id);
          e->mutable_complete()->set_finish_reason(v1::FINISH_REASON_LENGTH);
          e->mutable_complete()->set_completion_tokens(3);
          e->mutable_complete()->set_data_parallel_rank(rank_);
        }
      }
      if (!stream->Write(out)) break;
    }
    return grpc::Status::OK;
  }

  const std::string& address() const { return address_; }
  int serve_calls() const { return serve_calls_; }
  bool holds(const std::string& id) {
    std::lock_guard<std::mutex> lock(mu_);
    return held_.count(id) > 0;
  }
  // Waits up to kWaitTimeout until the worker holds `id`.
  bool WaitUntilHeld(const std::string& id) {
    const absl::Time deadline = absl::Now() + kWaitTimeout;
    while (!holds(id) && absl::Now() < deadline) absl::SleepFor(absl::Milliseconds(5));
    return holds(id);
  }
  // Waits up to kWaitTimeout for an abort of `id`.
  bool WaitForAbort(const std::string& id) {
    const absl::Time deadline = absl::Now() + kWaitTimeout;
    while (true) {
      {
        std::lock_guard<std::mutex> lock(mu_);
        if (std::find(aborted_.begin(), aborted_.end(), id) != aborted_.end()) return true;
      }
      if (absl::Now() > deadline) return false;
      absl::SleepFor(absl::Milliseconds(10));
    }
  }

 private:
  const int rank_;
  std::unique_ptr<grpc::Server> server_;
  std::string address_;
  std::atomic<int> serve_calls_{0};
  std::mutex mu_;
  std::set<std::string> held_;
  std::vector<std::string> aborted_;
};

class FrontendServiceTest : public ::testing::Test {
 protected:
  // Two attention ranks served by `workers` (an address with nothing behind it where null),
  // one expert rank.
  void Start(std::vector<FakeWorker*> workers, int64_t max_inflight = 16) {
    std::vector<std::string> addresses;
    for (FakeWorker* w : workers) addresses.push_back(w ? w->address() : "127.0.0.1:1");
    StartAt(addresses, max_inflight);
  }
  // Frontend.Abort of `id`, which must succeed; returns the stream's next message.
  v1::GenerateResponse AbortAndReadNext(grpc::ClientReader<v1::GenerateResponse>* reader,
                                        const std::string& id) {
    grpc::ClientContext abort_context;
    v1::AbortRequest abort;
    abort.set_request_id(id);
    v1::AbortResponse abort_response;
    EXPECT_TRUE(stub_->Abort(&abort_context, abort, &abort_response).ok()) << id;
    v1::GenerateResponse last;
    EXPECT_TRUE(reader->Read(&last)) << id;
    return last;
  }
  void StartAt(const std::vector<std::string>& addresses, int64_t max_inflight = 16) {
    ClusterRegistryOptions options;
    options.num_attention_ranks = 2;
    options.num_expert_ranks = 1;
    options.num_experts = 4;
    options.transport_backend = "inproc";
    options.now = [this] {
      std::lock_guard<std::mutex> lock(clock_mu_);
      return now_;
    };
    registry_ = std::make_unique<ClusterRegistry>(options);
    ModelConfig config;
    config.vocab_size = 100;
    config.max_position_embeddings = 64;
    config.num_experts = 4;
    FrontendOptions frontend_options;
    frontend_options.max_inflight = max_inflight;
    service_ = std::make_unique<FrontendService>(
        registry_.get(), config, MakeModelInfo(config, "/models/tiny/", {}), frontend_options);
    GrpcServerOptions server_options;
    server_options.address = "127.0.0.1:0";
    absl::StatusOr<GrpcServer> server = StartGrpcServer(server_options, {service_.get()});
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = std::move(server->server);
    stub_ = v1::Frontend::NewStub(grpc::CreateChannel("127.0.0.1:" + std::to_string(server->port),
                                                      grpc::InsecureChannelCredentials()));
    watcher_ = std::make_unique<ClusterWatcher>(
        registry_.get(),
        [this](const v1::ClusterView& view, bool) { service_->OnClusterView(view); });
    for (int r = 0; r < 2; ++r) {
      v1::RegisterRequest request;
      request.set_role(v1::ROLE_ATTENTION);
      request.set_rank(r);
      request.set_grpc_address(addresses[r]);
      ASSERT_TRUE(registry_->Register(request).ok());
    }
    v1::RegisterRequest expert;
    expert.set_role(v1::ROLE_EXPERT);
    expert.set_grpc_address("127.0.0.1:2");
    ASSERT_TRUE(registry_->Register(expert).ok());
    ASSERT_TRUE(registry_->IsComplete());
  }
  void TearDown() override {
    if (watcher_) watcher_->Stop();
    if (service_) service_->Shutdown();
    if (server_) server_->Shutdown(In(absl::Seconds(1)));
  }

  v1::GenerateRequest Request(int pinned_rank = -1, const std::string& id = "") {
    v1::GenerateRequest r;
    r.set_request_id(id);
    r.add_prompt_token_ids(3);
    r.add_prompt_token_ids(4);
    r.mutable_sampling_params()->set_max_new_tokens(10);
    if (pinned_rank >= 0) r.set_data_parallel_rank(pinned_rank);
    return r;
  }

  std::mutex clock_mu_;
  absl::Time now_ = absl::FromUnixSeconds(1000000);
  std::unique_ptr<ClusterRegistry> registry_;
  std::unique_ptr<FrontendService> service_;
  std::unique_ptr<grpc::Server> server_;
  std::unique_ptr<v1::Frontend::Stub> stub_;
  std::unique_ptr<ClusterWatcher> watcher_;
};

TEST_F(FrontendServiceTest, RelaysMessagesUnchanged) {
  FakeWorker w0(0, FakeWorker::Mode::kStream, true), w1(1, FakeWorker::Mode::kStream, true);
  Start({&w0, &w1});
  grpc::ClientContext context;
  v1::GenerateRequest request = Request(1, "id-1");
  request.mutable_sampling_params()->set_temperature(0.25f);
  request.mutable_sampling_params()->add_stop_token_ids(5);
  // The sampling features travel as sent (one logit_bias entry: map order is not stable).
  v1::SamplingParams* p = request.mutable_sampling_params();
  p->set_min_p(0.05f);
  p->set_repetition_penalty(1.1f);
  p->set_frequency_penalty(0.5f);
  p->set_presence_penalty(-0.5f);
  (*p->mutable_logit_bias())[11] = -7.f;
  p->set_min_new_tokens(2);
  p->set_logprobs(true);
  p->set_top_logprobs(4);
  p->add_logprob_token_ids(12);
  p->set_prompt_logprobs_start(1);
  auto reader = stub_->Generate(&context, request);
  std::vector<v1::GenerateResponse> got;
  v1::GenerateResponse m;
  while (reader->Read(&m)) got.push_back(m);
  ASSERT_TRUE(reader->Finish().ok());
  // The worker saw the caller's request as sent.
  EXPECT_EQ(w1.last_request().SerializeAsString(), request.SerializeAsString());
  ASSERT_EQ(got.size(), 3u);
  EXPECT_EQ(got[0].request_id(), "id-1");
  // Chunks, log-probabilities and prompt scores included, byte for byte.
  EXPECT_EQ(got[0].chunk().SerializeAsString(), ScoredChunk(0, {7, 8}, true).SerializeAsString());
  EXPECT_EQ(got[1].chunk().SerializeAsString(), ScoredChunk(2, {9}, false).SerializeAsString());
  const v1::GenerateComplete& complete = got[2].complete();
  EXPECT_EQ(complete.finish_reason(), v1::FINISH_REASON_LENGTH);
  EXPECT_EQ(complete.completion_tokens(), 3u);
  EXPECT_EQ(complete.data_parallel_rank(), 1u);
  EXPECT_EQ(complete.timings().queue_time_ns(), 1234u);  // the worker's, kept
  EXPECT_GT(complete.timings().e2e_latency_ns(), 0u);    // the router's, added
}

TEST_F(FrontendServiceTest, CallerCancellationReachesTheWorkerWhileNoTokenFlows) {
  FakeWorker w0(0, FakeWorker::Mode::kHold, true), w1(1, FakeWorker::Mode::kHold, true);
  Start({&w0, &w1});
  grpc::ClientContext context;
  auto reader = stub_->Generate(&context, Request(0, "quiet"));
  ASSERT_TRUE(w0.started().WaitForNotificationWithTimeout(kWaitTimeout));
  context.TryCancel();
  EXPECT_TRUE(w0.cancelled().WaitForNotificationWithTimeout(kWaitTimeout));
  EXPECT_EQ(reader->Finish().error_code(), grpc::StatusCode::CANCELLED);
}

TEST_F(FrontendServiceTest, AbortBeforeTheWorkerKnowsTheRequestEndsAborted) {
  FakeWorker w0(0, FakeWorker::Mode::kHold, /*knows_ids=*/false);
  FakeWorker w1(1, FakeWorker::Mode::kHold, false);
  Start({&w0, &w1});
  grpc::ClientContext context;
  auto reader = stub_->Generate(&context, Request(1));
  v1::GenerateResponse first;
  ASSERT_TRUE(reader->Read(&first));  // the assigned id, no tokens
  EXPECT_EQ(first.chunk().token_ids_size(), 0);
  ASSERT_FALSE(first.request_id().empty());
  // The router's call has reached the worker (which does not know the id): an abort that
  // overtook it would cancel a call the worker's handler never ran, and nothing would be
  // there to see the cancellation (a race this test lost once under load in CI).
  ASSERT_TRUE(w1.started().WaitForNotificationWithTimeout(kWaitTimeout));
  v1::GenerateResponse last = AbortAndReadNext(reader.get(), first.request_id());
  EXPECT_EQ(last.request_id(), first.request_id());
  EXPECT_EQ(last.complete().finish_reason(), v1::FINISH_REASON_ABORTED);
  EXPECT_EQ(last.complete().prompt_tokens(), 2u);
  EXPECT_EQ(last.complete().data_parallel_rank(), 1u);
  EXPECT_FALSE(reader->Read(&last));
  EXPECT_TRUE(reader->Finish().ok());
  EXPECT_TRUE(w1.cancelled().WaitForNotificationWithTimeout(kWaitTimeout));
}

// With n samples, the router's own end of an aborted request ends every sample.
TEST_F(FrontendServiceTest, AbortBeforeTheWorkerKnowsEndsEverySample) {
  FakeWorker w0(0, FakeWorker::Mode::kHold, /*knows_ids=*/false);
  FakeWorker w1(1, FakeWorker::Mode::kHold, false);
  Start({&w0, &w1});
  grpc::ClientContext context;
  v1::GenerateRequest request = Request(0, "three-samples");
  request.mutable_sampling_params()->set_n(3);
  auto reader = stub_->Generate(&context, request);
  ASSERT_TRUE(w0.started().WaitForNotificationWithTimeout(kWaitTimeout));
  EXPECT_EQ(w0.last_request().sampling_params().n(), 3u);
  const v1::GenerateResponse last = AbortAndReadNext(reader.get(), "three-samples");
  const v1::GenerateComplete& complete = last.complete();
  EXPECT_EQ(complete.finish_reason(), v1::FINISH_REASON_ABORTED);
  EXPECT_EQ(complete.completion_tokens(), 0u);
  ASSERT_EQ(complete.samples_size(), 2);
  for (int i = 0; i < 2; ++i) {
    EXPECT_EQ(complete.samples(i).sample_index(), static_cast<uint32_t>(i + 1));
    EXPECT_EQ(complete.samples(i).finish_reason(), v1::FINISH_REASON_ABORTED);
    EXPECT_EQ(complete.samples(i).completion_tokens(), 0u);
  }
  EXPECT_TRUE(reader->Finish().ok());
}

TEST_F(FrontendServiceTest, AbortForwardedToTheWorker) {
  FakeWorker w0(0, FakeWorker::Mode::kHold, true), w1(1, FakeWorker::Mode::kHold, true);
  Start({&w0, &w1});
  grpc::ClientContext context;
  auto reader = stub_->Generate(&context, Request(0, "abort-me"));
  ASSERT_TRUE(w0.started().WaitForNotificationWithTimeout(kWaitTimeout));
  const v1::GenerateResponse last = AbortAndReadNext(reader.get(), "abort-me");
  EXPECT_EQ(last.complete().finish_reason(), v1::FINISH_REASON_ABORTED);
  EXPECT_TRUE(reader->Finish().ok());
  EXPECT_FALSE(w0.cancelled().HasBeenNotified());  // the worker ended it, not a cancel
}

TEST_F(FrontendServiceTest, DeadRankFailsItsRequestsWithUnavailable) {
  FakeWorker w0(0, FakeWorker::Mode::kHold, true), w1(1, FakeWorker::Mode::kHold, true);
  Start({&w0, &w1});
  grpc::ClientContext context;
  auto reader = stub_->Generate(&context, Request(1, "on-rank-1"));
  ASSERT_TRUE(w1.started().WaitForNotificationWithTimeout(kWaitTimeout));
  absl::Time later;
  {
    std::lock_guard<std::mutex> lock(clock_mu_);
    later = now_ += absl::Seconds(10);
  }
  registry_->ExpireLeases(later);  // every worker's lease runs out
  const grpc::Status s = reader->Finish();
  EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAVAILABLE) << s.error_message();
  EXPECT_NE(s.error_message().find("attention rank 1"), std::string::npos) << s.error_message();
  EXPECT_TRUE(w1.cancelled().WaitForNotificationWithTimeout(kWaitTimeout));
  // And new requests wait for a complete cluster.
  grpc::ClientContext again;
  auto refused = stub_->Generate(&again, Request());
  v1::GenerateResponse m;
  EXPECT_FALSE(refused->Read(&m));
  EXPECT_EQ(refused->Finish().error_code(), grpc::StatusCode::UNAVAILABLE);
}

TEST_F(FrontendServiceTest, UnreachableRankIsUnavailable) {
  FakeWorker w0(0, FakeWorker::Mode::kStream, true);
  Start({&w0, nullptr});  // rank 1's address has nothing behind it
  grpc::ClientContext context;
  context.set_deadline(In(absl::Seconds(20)));
  auto reader = stub_->Generate(&context, Request(1, "nowhere"));
  v1::GenerateResponse m;
  while (reader->Read(&m)) {
  }
  const grpc::Status s = reader->Finish();
  EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAVAILABLE) << s.error_message();
  EXPECT_NE(s.error_message().find("attention rank 1 (127.0.0.1:1)"), std::string::npos)
      << s.error_message();
}

TEST_F(FrontendServiceTest, GetLoadsMergesWorkerAndRouterNumbers) {
  FakeWorker w0(0, FakeWorker::Mode::kHold, true), w1(1, FakeWorker::Mode::kHold, true);
  Start({&w0, &w1});
  grpc::ClientContext context;
  auto reader = stub_->Generate(&context, Request(1, "held"));
  ASSERT_TRUE(w1.started().WaitForNotificationWithTimeout(kWaitTimeout));
  // Three samples owe their prompt once and max_new_tokens each.
  grpc::ClientContext samples_context;
  v1::GenerateRequest samples = Request(0, "held-samples");
  samples.mutable_sampling_params()->set_n(3);
  auto samples_reader = stub_->Generate(&samples_context, samples);
  ASSERT_TRUE(w0.started().WaitForNotificationWithTimeout(kWaitTimeout));
  grpc::ClientContext loads_context;
  v1::GetLoadsResponse loads;
  ASSERT_TRUE(stub_->GetLoads(&loads_context, v1::GetLoadsRequest(), &loads).ok());
  EXPECT_EQ(loads.cluster_view_version(), registry_->version());
  ASSERT_EQ(loads.loads_size(), 2);
  EXPECT_EQ(loads.loads(0).rank(), 0u);
  EXPECT_EQ(loads.loads(0).num_outstanding_tokens(), 32u);  // 2 prompt + 3 x 10 new
  EXPECT_EQ(loads.loads(1).num_outstanding_tokens(), 12u);  // 2 prompt + 10 new
  EXPECT_EQ(loads.loads(1).kv_cache_used_tokens(), 40u);    // the worker's
  EXPECT_EQ(loads.loads(1).num_running_requests(), 3u);
  EXPECT_EQ(loads.loads(1).state(), v1::WORKER_STATE_READY);
  EXPECT_GT(loads.loads(1).sampled_at_unix_ns(), 0u);
  context.TryCancel();
  reader->Finish();
  samples_context.TryCancel();
  samples_reader->Finish();

  grpc::ClientContext info_context;
  v1::GetModelInfoResponse info;
  ASSERT_TRUE(stub_->GetModelInfo(&info_context, v1::GetModelInfoRequest(), &info).ok());
  EXPECT_EQ(info.model_info().model_name(), "tiny");
  EXPECT_EQ(info.model_info().vocab_size(), 100u);
  EXPECT_EQ(info.model_info().max_context_length(), 64u);
}

TEST_F(FrontendServiceTest, ShutdownEndsStreamsWithUnavailable) {
  FakeWorker w0(0, FakeWorker::Mode::kHold, true), w1(1, FakeWorker::Mode::kHold, true);
  Start({&w0, &w1});
  grpc::ClientContext context;
  auto reader = stub_->Generate(&context, Request(0, "busy"));
  ASSERT_TRUE(w0.started().WaitForNotificationWithTimeout(kWaitTimeout));
  service_->Shutdown();
  const grpc::Status s = reader->Finish();
  EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAVAILABLE) << s.error_message();
  EXPECT_TRUE(w0.cancelled().WaitForNotificationWithTimeout(kWaitTimeout));
  grpc::ClientContext again;
  auto refused = stub_->Generate(&again, Request());
  v1::GenerateResponse m;
  EXPECT_FALSE(refused->Read(&m));
  EXPECT_EQ(refused->Finish().error_code(), grpc::StatusCode::UNAVAILABLE);
}

// Workers with Serve: every request to a rank goes over one stream, concurrently.
TEST_F(FrontendServiceTest, ServeStreamCarriesConcurrentRequests) {
  FakeServeWorker w0(0), w1(1);
  StartAt({w0.address(), w1.address()}, /*max_inflight=*/64);
  constexpr int kRequests = 32;
  std::vector<std::thread> threads;
  std::vector<std::vector<uint32_t>> tokens(kRequests);
  std::vector<v1::GenerateComplete> completes(kRequests);
  std::vector<grpc::Status> status(kRequests);
  for (int i = 0; i < kRequests; ++i) {
    threads.emplace_back([&, i] {
      grpc::ClientContext context;
      context.set_deadline(In(absl::Seconds(20)));
      auto reader = stub_->Generate(&context, Request(i % 2, "many-" + std::to_string(i)));
      v1::GenerateResponse m;
      while (reader->Read(&m)) {
        EXPECT_EQ(m.request_id(), "many-" + std::to_string(i));
        if (m.has_chunk()) {
          EXPECT_EQ(m.chunk().index(), tokens[i].size());
          // Relayed as the worker sent it, log-probabilities and prompt scores included.
          EXPECT_EQ(m.chunk().SerializeAsString(),
                    (tokens[i].empty() ? ScoredChunk(0, {7, 8}, true) : ScoredChunk(2, {9}, false))
                        .SerializeAsString());
          tokens[i].insert(tokens[i].end(), m.chunk().token_ids().begin(),
                           m.chunk().token_ids().end());
        }
        if (m.has_complete()) completes[i] = m.complete();
      }
      status[i] = reader->Finish();
    });
  }
  for (auto& t : threads) t.join();
  for (int i = 0; i < kRequests; ++i) {
    ASSERT_TRUE(status[i].ok()) << i << ": " << status[i].error_message();
    EXPECT_EQ(tokens[i], (std::vector<uint32_t>{7, 8, 9})) << i;
    EXPECT_EQ(completes[i].finish_reason(), v1::FINISH_REASON_LENGTH) << i;
    EXPECT_EQ(completes[i].data_parallel_rank(), static_cast<uint32_t>(i % 2)) << i;
    EXPECT_GT(completes[i].timings().e2e_latency_ns(), 0u) << i;  // the router's
    EXPECT_GT(completes[i].timings().time_to_first_token_ns(), 0u) << i;
  }
  EXPECT_EQ(w0.serve_calls(), 1);
  EXPECT_EQ(w1.serve_calls(), 1);
}

TEST_F(FrontendServiceTest, ServeErrorsKeepTheirCodeWithTheRank) {
  FakeServeWorker w0(0), w1(1);
  StartAt({w0.address(), w1.address()});
  grpc::ClientContext context;
  auto reader = stub_->Generate(&context, Request(1, "refuse-1"));
  v1::GenerateResponse m;
  EXPECT_FALSE(reader->Read(&m));
  const grpc::Status s = reader->Finish();
  EXPECT_EQ(s.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << s.error_message();
  EXPECT_EQ(s.error_message(), "attention rank 1 (" + w1.address() + "): queue full");
}

TEST_F(FrontendServiceTest, CallerCancellationAndDeadlineSendAnAbortOnTheStream) {
  FakeServeWorker w0(0), w1(1);
  StartAt({w0.address(), w1.address()});
  grpc::ClientContext context;
  auto reader = stub_->Generate(&context, Request(0, "hold-cancel"));
  ASSERT_TRUE(w0.WaitUntilHeld("hold-cancel"));
  context.TryCancel();
  EXPECT_EQ(reader->Finish().error_code(), grpc::StatusCode::CANCELLED);
  EXPECT_TRUE(w0.WaitForAbort("hold-cancel"));

  grpc::ClientContext short_context;
  short_context.set_deadline(In(absl::Milliseconds(300)));
  auto late = stub_->Generate(&short_context, Request(0, "hold-deadline"));
  v1::GenerateResponse m;
  while (late->Read(&m)) {
  }
  EXPECT_EQ(late->Finish().error_code(), grpc::StatusCode::DEADLINE_EXCEEDED);
  EXPECT_TRUE(w0.WaitForAbort("hold-deadline"));
}

TEST_F(FrontendServiceTest, AbortTravelsOnTheServeStream) {
  FakeServeWorker w0(0), w1(1);
  StartAt({w0.address(), w1.address()});
  grpc::ClientContext context;
  auto reader = stub_->Generate(&context, Request(1, "hold-abort"));
  ASSERT_TRUE(w1.WaitUntilHeld("hold-abort"));
  const v1::GenerateResponse last = AbortAndReadNext(reader.get(), "hold-abort");
  EXPECT_EQ(last.complete().finish_reason(), v1::FINISH_REASON_ABORTED);
  EXPECT_TRUE(reader->Finish().ok());
  EXPECT_TRUE(w1.WaitForAbort("hold-abort"));
}

// A worker that goes away under a request held on its stream: UNAVAILABLE, safe to retry.
TEST_F(FrontendServiceTest, ServeStreamBrokenMidRequestIsUnavailable) {
  auto w0 = std::make_unique<FakeServeWorker>(0);
  FakeServeWorker w1(1);
  StartAt({w0->address(), w1.address()});
  grpc::ClientContext context;
  context.set_deadline(In(absl::Seconds(20)));
  auto reader = stub_->Generate(&context, Request(0, "hold-lost"));
  ASSERT_TRUE(w0->WaitUntilHeld("hold-lost"));
  w0.reset();  // the server shuts down, cancelling the stream
  v1::GenerateResponse m;
  while (reader->Read(&m)) {
  }
  const grpc::Status s = reader->Finish();
  EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAVAILABLE) << s.error_message();
  EXPECT_NE(s.error_message().find("attention rank 0"), std::string::npos) << s.error_message();
  EXPECT_NE(s.error_message().find("safe to retry"), std::string::npos) << s.error_message();
}

}  // namespace
}  // namespace dxs
