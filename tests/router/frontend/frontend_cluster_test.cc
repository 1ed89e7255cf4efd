// dxs.v1.Frontend through a real dxs-router in front of real dxs-attention and dxs-expert
// processes on loopback (gRPC + UCX):
//  - streams are complete and in order, and greedy tokens equal the single-process engine;
//  - every bad input gets its code and a message naming the field, while a long request
//    on the same cluster runs undisturbed to the correct result;
//  - health is NOT_SERVING until the cluster is complete, SERVING after, and NOT_SERVING
//    again when a worker dies;
//  - Abort, client cancellation and a passed deadline end the request and free its KV;
//  - data_parallel_rank pins the rank; unpinned long requests spread over the ranks;
//  - --max-inflight bounds admission (RESOURCE_EXHAUSTED);
//  - the sampling features (log-probabilities, prompt scoring, penalties, logit_bias,
//    min_new_tokens, min_p) give what the single-process engine gives for the same
//    GenerationRequest, through the router (Serve) and a worker's Generate alike;
//  - n samples of one prompt: each equals a single request with its sample's seed, and an
//    Abort ends every sample.
#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <condition_variable>
#include <functional>
#include <limits>
#include <map>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "dxs/v1/frontend.grpc.pb.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "gtest/gtest.h"
#include "model/engine.h"
#include "nlohmann/json.hpp"
#include "router/frontend/generate_validation.h"
#include "tests/disagg/process_cluster.h"
#include "tests/model/test_util.h"

namespace dxs {
namespace {

using grpc::health::v1::HealthCheckRequest;
using grpc::health::v1::HealthCheckResponse;
using testing::ClusterSpec;
using testing::ProcessCluster;
using testing::TempDir;

// The router refuses what the engine would (it does not link the engine, so it keeps copies
// of these limits).
static_assert(GenerateLimits{}.max_top_logprobs == kMaxTopLogprobs);
static_assert(GenerateLimits{}.max_logprob_token_ids == kMaxLogprobTokenIds);
static_assert(GenerateLimits{}.max_samples == kMaxSamples);

constexpr int kVocab = 4096;    // the "default" preset
constexpr int kContext = 4096;  // its max_position_embeddings

std::vector<int32_t> Prompt(int i, int length) {
  std::vector<int32_t> p;
  for (int j = 0; j < length; ++j) p.push_back(5 + (i * 577 + j * 101) % (kVocab - 5));
  return p;
}

v1::GenerateRequest Request(const std::vector<int32_t>& prompt, int max_new_tokens,
                            const std::string& request_id = "") {
  v1::GenerateRequest r;
  r.set_request_id(request_id);
  for (int32_t t : prompt) r.add_prompt_token_ids(static_cast<uint32_t>(t));
  r.mutable_sampling_params()->set_max_new_tokens(max_new_tokens);
  r.mutable_sampling_params()->set_temperature(0.f);
  return r;
}

// A request that must still be running when the test acts on it: as long as the context
// allows, past EOS, so that no machine is fast enough to finish it first (the test then
// checks that it did not finish).
v1::GenerateRequest LongRequest(const std::vector<int32_t>& prompt,
                                const std::string& request_id = "") {
  v1::GenerateRequest r = Request(prompt, kContext - static_cast<int>(prompt.size()), request_id);
  r.mutable_sampling_params()->set_ignore_eos(true);
  return r;
}

std::vector<int32_t> Reference(LocalEngine* engine, const std::vector<int32_t>& prompt,
                               int max_new_tokens, bool ignore_eos = false) {
  GenerationRequest r;
  r.prompt = prompt;
  r.max_new_tokens = max_new_tokens;
  r.ignore_eos = ignore_eos;
  auto out = engine->GenerateBatch({r});
  EXPECT_TRUE(out.ok()) << out.status();
  return out.ok() ? out->front().tokens : std::vector<int32_t>{};
}

std::chrono::system_clock::time_point In(absl::Duration d) {
  return std::chrono::system_clock::now() + std::chrono::milliseconds(absl::ToInt64Milliseconds(d));
}

// One Generate call on its own thread, recording the whole stream.
class StreamCall {
 public:
  StreamCall(v1::Frontend::Stub* stub, v1::GenerateRequest request,
             absl::Duration deadline = absl::Seconds(120)) {
    context_.set_deadline(In(deadline));
    thread_ = std::thread([this, stub, request = std::move(request)] {
      auto reader = stub->Generate(&context_, request);
      v1::GenerateResponse message;
      while (reader->Read(&message)) {
        std::lock_guard<std::mutex> lock(mu_);
        ++num_messages_;
        if (request_id_.empty()) request_id_ = message.request_id();
        if (message.request_id() != request_id_) consistent_ids_ = false;
        if (complete_.has_value()) ++messages_after_complete_;
        if (message.has_chunk()) {
          // Each sample's chunks are in order; tokens_ holds sample 0's.
          const size_t sample = message.chunk().sample_index();
          if (sample >= sample_tokens_.size()) sample_tokens_.resize(sample + 1);
          std::vector<int32_t>& tokens = sample_tokens_[sample];
          if (message.chunk().index() != tokens.size()) in_order_ = false;
          if (message.chunk().token_ids_size() == 0) ++empty_chunks_;
          for (uint32_t t : message.chunk().token_ids()) tokens.push_back(static_cast<int>(t));
          tokens_ = sample_tokens_[0];
          chunks_.push_back(message.chunk());
        } else if (message.has_complete()) {
          complete_ = message.complete();
        }
        cv_.notify_all();
      }
      grpc::Status status = reader->Finish();
      std::lock_guard<std::mutex> lock(mu_);
      status_ = std::move(status);
      done_ = true;
      cv_.notify_all();
    });
  }
  ~StreamCall() { Join(); }

  // True once the stream has `n` tokens (or a first message, for n == 0) within `timeout`.
  bool WaitFor(size_t n, absl::Duration timeout = absl::Seconds(60)) {
    std::unique_lock<std::mutex> lock(mu_);
    return cv_.wait_for(lock, std::chrono::milliseconds(absl::ToInt64Milliseconds(timeout)),
                        [&] { return done_ || (num_messages_ > 0 && tokens_.size() >= n); }) &&
           num_messages_ > 0 && tokens_.size() >= n;
  }
  bool finished() {
    std::lock_guard<std::mutex> lock(mu_);
    return done_;
  }
  std::string request_id() {
    std::lock_guard<std::mutex> lock(mu_);
    return request_id_;
  }
  void Cancel() { context_.TryCancel(); }
  void Join() {
    if (thread_.joinable()) thread_.join();
  }

  // After Join.
  const std::vector<int32_t>& tokens() const { return tokens_; }
  const std::vector<v1::TokenChunk>& chunks() const { return chunks_; }
  const std::optional<v1::GenerateComplete>& complete() const { return complete_; }
  const grpc::Status& status() const { return status_; }
  bool in_order() const { return in_order_ && consistent_ids_ && messages_after_complete_ == 0; }
  int empty_chunks() const { return empty_chunks_; }

 private:
  grpc::ClientContext context_;
  std::thread thread_;
  std::mutex mu_;
  std::condition_variable cv_;
  int num_messages_ = 0;
  std::string request_id_;
  bool consistent_ids_ = true;
  bool in_order_ = true;
  int empty_chunks_ = 0;
  int messages_after_complete_ = 0;
  std::vector<int32_t> tokens_;
  std::vector<std::vector<int32_t>> sample_tokens_{1};
  std::vector<v1::TokenChunk> chunks_;
  std::optional<v1::GenerateComplete> complete_;
  grpc::Status status_;
  bool done_ = false;
};

// Runs a request to the end.
struct Outcome {
  grpc::Status status;
  std::vector<int32_t> tokens;
  std::optional<v1::GenerateComplete> complete;
  bool in_order = false;
  std::vector<v1::TokenChunk> chunks;
};
Outcome RunToEnd(v1::Frontend::Stub* stub, const v1::GenerateRequest& request,
                 absl::Duration deadline = absl::Seconds(120)) {
  StreamCall call(stub, request, deadline);
  call.Join();
  return {call.status(), call.tokens(), call.complete(), call.in_order(), call.chunks()};
}

// The same request straight to an attention worker's Generate (the router's fallback
// when a worker has no Serve), recorded the same way.
Outcome RunOnWorker(v1::AttentionWorker::Stub* worker, const v1::GenerateRequest& request) {
  grpc::ClientContext context;
  context.set_deadline(In(absl::Seconds(120)));
  auto reader = worker->Generate(&context, request);
  Outcome out;
  out.in_order = true;
  std::map<uint32_t, size_t> sample_tokens;  // tokens so far per sample
  v1::GenerateResponse message;
  while (reader->Read(&message)) {
    if (message.has_chunk()) {
      const v1::TokenChunk& chunk = message.chunk();
      size_t& sent = sample_tokens[chunk.sample_index()];
      out.in_order = out.in_order && chunk.index() == sent;
      sent += static_cast<size_t>(chunk.token_ids_size());
      if (chunk.sample_index() == 0) {
        for (uint32_t t : chunk.token_ids()) out.tokens.push_back(static_cast<int>(t));
      }
      out.chunks.push_back(message.chunk());
    } else if (message.has_complete()) {
      out.complete = message.complete();
    }
  }
  out.status = reader->Finish();
  return out;
}

// The engine request as the proto a client sends (ids and counts are in range here).
v1::GenerateRequest ProtoRequest(const GenerationRequest& r, const std::string& request_id) {
  v1::GenerateRequest out;
  out.set_request_id(request_id);
  for (int32_t t : r.prompt) out.add_prompt_token_ids(static_cast<uint32_t>(t));
  v1::SamplingParams* p = out.mutable_sampling_params();
  p->set_max_new_tokens(static_cast<int32_t>(r.max_new_tokens));
  p->set_temperature(r.sampling.temperature);
  p->set_top_p(r.sampling.top_p);
  p->set_top_k(r.sampling.top_k);
  p->set_seed(r.sampling.seed);
  for (int32_t t : r.stop_token_ids) p->add_stop_token_ids(static_cast<uint32_t>(t));
  p->set_ignore_eos(r.ignore_eos);
  p->set_min_p(r.sampling.min_p);
  p->set_frequency_penalty(r.sampling.frequency_penalty);
  p->set_presence_penalty(r.sampling.presence_penalty);
  p->set_repetition_penalty(r.sampling.repetition_penalty);
  for (const auto& [id, bias] : r.sampling.logit_bias) {
    (*p->mutable_logit_bias())[static_cast<uint32_t>(id)] = bias;
  }
  p->set_min_new_tokens(static_cast<uint32_t>(r.min_new_tokens));
  p->set_logprobs(r.logprobs);
  p->set_top_logprobs(static_cast<uint32_t>(r.top_logprobs));
  for (int32_t t : r.logprob_token_ids) p->add_logprob_token_ids(static_cast<uint32_t>(t));
  if (r.prompt_logprobs_start >= 0) {
    p->set_prompt_logprobs_start(static_cast<uint32_t>(r.prompt_logprobs_start));
  }
  if (r.n != 1) p->set_n(static_cast<uint32_t>(r.n));
  return out;
}

// Same CPU arithmetic on both sides, in batches of other shapes: the cluster's steps hold
// other requests than the engine's, and OpenBLAS orders a GEMM's sums by its shape, so the
// float32 values differ in their last bits. The bound is relative, as the cluster tests'
// 1e-5 on the logits (cluster_equivalence.h), with 1e-5 absolute below 1: a value of -2.81
// was seen 1.03e-5 off (3.6e-6 relative) in about 1 run in 20.
constexpr double kLogprobTolerance = 1e-5;
double LogprobBound(float want) {
  return kLogprobTolerance * std::max(1.0, std::fabs(static_cast<double>(want)));
}

void ExpectLogprobsNear(const v1::TokenLogprobs& got, const TokenLogprobs& want,
                        const std::string& where) {
  EXPECT_NEAR(got.logprob(), want.logprob, LogprobBound(want.logprob)) << where;
  ASSERT_EQ(static_cast<size_t>(got.top_logprobs_size()), want.top.size()) << where;
  for (size_t i = 0; i < want.top.size(); ++i) {
    EXPECT_EQ(got.top_logprobs(i).token_id(), static_cast<uint32_t>(want.top[i].first))
        << where << " top " << i;
    EXPECT_NEAR(got.top_logprobs(i).logprob(), want.top[i].second, LogprobBound(want.top[i].second))
        << where << " top " << i;
  }
  ASSERT_EQ(static_cast<size_t>(got.token_ids_logprobs_size()), want.named.size()) << where;
  for (size_t i = 0; i < want.named.size(); ++i) {
    EXPECT_NEAR(got.token_ids_logprobs(i), want.named[i], LogprobBound(want.named[i]))
        << where << " id " << i;
  }
}

// `out` (a whole stream) against the engine's result for the same request: the tokens
// exactly, each chunk's logprobs one per token, the prompt's scores in exactly one chunk
// (the first token's, or a tokenless one before the end), all values within the bound.
void ExpectEqualsEngine(const Outcome& out, const GenerationRequest& request,
                        const GenerationResult& want, const std::string& what) {
  ASSERT_TRUE(out.status.ok()) << what << ": " << out.status.error_message();
  EXPECT_TRUE(out.in_order) << what;
  EXPECT_EQ(out.tokens, want.tokens) << what;
  ASSERT_TRUE(out.complete.has_value()) << what;
  EXPECT_EQ(out.complete->completion_tokens(), want.tokens.size()) << what;
  std::vector<const v1::TokenLogprobs*> logprobs;
  std::vector<size_t> prompt_chunks;
  for (size_t c = 0; c < out.chunks.size(); ++c) {
    const v1::TokenChunk& chunk = out.chunks[c];
    EXPECT_EQ(chunk.logprobs_size(), request.WantsLogprobs() ? chunk.token_ids_size() : 0)
        << what << ": chunk " << c;
    for (const v1::TokenLogprobs& lp : chunk.logprobs()) logprobs.push_back(&lp);
    if (chunk.has_prompt_logprobs()) prompt_chunks.push_back(c);
  }
  ASSERT_EQ(logprobs.size(), want.logprobs.size()) << what;
  for (size_t i = 0; i < logprobs.size(); ++i) {
    ExpectLogprobsNear(*logprobs[i], want.logprobs[i], what + ": token " + std::to_string(i));
  }
  ASSERT_EQ(want.prompt_logprobs.has_value(), request.prompt_logprobs_start >= 0) << what;
  if (!want.prompt_logprobs.has_value()) {
    EXPECT_TRUE(prompt_chunks.empty()) << what;
    return;
  }
  ASSERT_EQ(prompt_chunks.size(), 1u) << what << ": the prompt's scores come once";
  const v1::TokenChunk& carrier = out.chunks[prompt_chunks[0]];
  if (request.max_new_tokens == 0) {
    EXPECT_EQ(carrier.token_ids_size(), 0) << what;
    EXPECT_EQ(prompt_chunks[0], out.chunks.size() - 1) << what << ": just before the end";
  } else {
    EXPECT_EQ(carrier.index(), 0u) << what << ": with the first token";
    EXPECT_GT(carrier.token_ids_size(), 0) << what;
  }
  const v1::PromptLogprobs& got = carrier.prompt_logprobs();
  const PromptLogprobs& p = *want.prompt_logprobs;
  EXPECT_EQ(got.first_position(), static_cast<uint32_t>(p.first_position)) << what;
  EXPECT_EQ(static_cast<int64_t>(got.first_position()),
            std::max<int64_t>(request.prompt_logprobs_start, 1))
      << what;
  ASSERT_EQ(static_cast<size_t>(got.positions_size()), p.positions.size()) << what;
  ASSERT_EQ(got.token_ids_size(), got.positions_size()) << what;
  EXPECT_EQ(p.positions.size(), request.prompt.size() - p.first_position) << what;
  for (size_t i = 0; i < p.positions.size(); ++i) {
    EXPECT_EQ(got.token_ids(i), static_cast<uint32_t>(request.prompt[p.first_position + i]))
        << what << ": prompt position " << i;
    ExpectLogprobsNear(got.positions(i), p.positions[i],
                       what + ": prompt position " + std::to_string(p.first_position + i));
  }
  ExpectLogprobsNear(got.next(), p.next, what + ": after the prompt");
}

absl::StatusOr<v1::GetLoadsResponse> Loads(v1::Frontend::Stub* stub) {
  grpc::ClientContext context;
  context.set_deadline(In(absl::Seconds(5)));
  v1::GetLoadsResponse response;
  grpc::Status s = stub->GetLoads(&context, v1::GetLoadsRequest(), &response);
  if (!s.ok())
    return absl::Status(static_cast<absl::StatusCode>(s.error_code()), s.error_message());
  return response;
}

// Waits until no rank holds KV cache and the router owes no tokens.
bool WaitAllFree(v1::Frontend::Stub* stub, absl::Duration timeout = absl::Seconds(30)) {
  const absl::Time deadline = absl::Now() + timeout;
  while (absl::Now() < deadline) {
    absl::StatusOr<v1::GetLoadsResponse> loads = Loads(stub);
    bool free = loads.ok() && loads->loads_size() > 0;
    if (loads.ok()) {
      for (const v1::RankLoad& l : loads->loads()) {
        free = free && l.kv_cache_used_tokens() == 0 && l.num_outstanding_tokens() == 0 &&
               l.num_running_requests() == 0 && l.num_queued_requests() == 0;
      }
    }
    if (free) return true;
    absl::SleepFor(absl::Milliseconds(50));
  }
  return false;
}

grpc::Status AbortCall(v1::Frontend::Stub* stub, const std::string& request_id) {
  grpc::ClientContext context;
  context.set_deadline(In(absl::Seconds(10)));
  v1::AbortRequest request;
  request.set_request_id(request_id);
  v1::AbortResponse response;
  return stub->Abort(&context, request, &response);
}

HealthCheckResponse::ServingStatus Health(const std::string& address, const std::string& name) {
  auto stub = grpc::health::v1::Health::NewStub(
      grpc::CreateChannel(address, grpc::InsecureChannelCredentials()));
  grpc::ClientContext context;
  context.set_deadline(In(absl::Seconds(5)));
  HealthCheckRequest request;
  request.set_service(name);
  HealthCheckResponse response;
  grpc::Status s = stub->Check(&context, request, &response);
  EXPECT_TRUE(s.ok()) << name << ": " << s.error_message();
  return response.status();
}

bool WaitHealth(const std::string& address, HealthCheckResponse::ServingStatus want,
                absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  while (absl::Now() < deadline) {
    if (Health(address, "") == want && Health(address, "dxs.v1.Frontend") == want) return true;
    absl::SleepFor(absl::Milliseconds(50));
  }
  return false;
}

class FrontendCluster : public ::testing::Test {
 protected:
  void StartCluster(int num_attention, int num_expert, std::vector<std::string> router_args = {},
                    std::vector<std::string> attention_args = {}) {
    dir_ = testing::WritePreset(tmp_, "default");
    cluster_ = std::make_unique<ProcessCluster>(tmp_.path());
    ClusterSpec spec{dir_, num_attention, num_expert, {}, "f32", std::move(attention_args)};
    cluster_->set_router_args(std::move(router_args));
    absl::Status started = cluster_->Start(spec);
    ASSERT_TRUE(started.ok()) << started << cluster_->DumpLogs();
    ASSERT_TRUE(
        WaitHealth(cluster_->router_address(), HealthCheckResponse::SERVING, absl::Seconds(30)))
        << cluster_->DumpLogs();
  }
  LocalEngine* engine() {
    if (!engine_) {
      auto engine = LocalEngine::Load(dir_);
      EXPECT_TRUE(engine.ok()) << engine.status();
      engine_ = std::move(*engine);
    }
    return engine_.get();
  }
  v1::Frontend::Stub* frontend() { return cluster_->frontend(); }
  // The single-process result of `r` (on `on`, default engine()).
  GenerationResult Want(const GenerationRequest& r, LocalEngine* on = nullptr) {
    auto out = (on != nullptr ? on : engine())->GenerateBatch({r});
    EXPECT_TRUE(out.ok()) << out.status();
    return out.ok() ? out->front() : GenerationResult{};
  }

  TempDir tmp_;
  std::string dir_;
  std::unique_ptr<ProcessCluster> cluster_;
  std::unique_ptr<LocalEngine> engine_;
};

// 1. Order, completeness and equality with the single-process engine; the assigned id
// arrives first, alone.
TEST_F(FrontendCluster, StreamsEqualTheSingleProcessEngine) {
  StartCluster(2, 2);
  struct Case {
    std::vector<int32_t> prompt;
    int max_new_tokens;
    std::string request_id;
  };
  const std::vector<Case> cases = {
      {Prompt(0, 2), 8, "mine-0"}, {Prompt(1, 17), 12, ""}, {Prompt(2, 40), 5, "mine-2"}};
  std::vector<std::unique_ptr<StreamCall>> calls;
  for (const Case& c : cases) {
    calls.push_back(std::make_unique<StreamCall>(
        frontend(), Request(c.prompt, c.max_new_tokens, c.request_id)));
  }
  for (size_t i = 0; i < cases.size(); ++i) {
    StreamCall& call = *calls[i];
    call.Join();
    ASSERT_TRUE(call.status().ok()) << call.status().error_message() << cluster_->DumpLogs();
    EXPECT_TRUE(call.in_order()) << "request " << i;
    EXPECT_EQ(call.tokens(), Reference(engine(), cases[i].prompt, cases[i].max_new_tokens))
        << "request " << i;
    ASSERT_TRUE(call.complete().has_value()) << "request " << i;
    const v1::GenerateComplete& complete = *call.complete();
    EXPECT_EQ(complete.finish_reason(), v1::FINISH_REASON_LENGTH);
    EXPECT_EQ(complete.prompt_tokens(), cases[i].prompt.size());
    EXPECT_EQ(complete.completion_tokens(), static_cast<uint32_t>(cases[i].max_new_tokens));
    EXPECT_LT(complete.data_parallel_rank(), 2u);
    EXPECT_GT(complete.timings().e2e_latency_ns(), 0u);
    EXPECT_GT(complete.timings().time_to_first_token_ns(), 0u);
    EXPECT_LE(complete.timings().time_to_first_token_ns(), complete.timings().e2e_latency_ns());
    if (cases[i].request_id.empty()) {
      EXPECT_EQ(call.request_id().rfind("r-", 0), 0u) << call.request_id();
      EXPECT_EQ(call.empty_chunks(), 1) << "the assigned id comes first, with no tokens";
    } else {
      EXPECT_EQ(call.request_id(), cases[i].request_id);
      EXPECT_EQ(call.empty_chunks(), 0);
    }
  }

  // Model info comes from the router's config.json.
  grpc::ClientContext context;
  v1::GetModelInfoResponse info;
  ASSERT_TRUE(frontend()->GetModelInfo(&context, v1::GetModelInfoRequest(), &info).ok());
  EXPECT_EQ(info.model_info().vocab_size(), 4096u);
  EXPECT_EQ(info.model_info().max_context_length(), 4096u);
  EXPECT_EQ(info.model_info().num_layers(), 4u);
  EXPECT_EQ(info.model_info().num_experts(), 16u);
  EXPECT_EQ(info.model_info().num_experts_per_token(), 4u);
  EXPECT_EQ(info.model_info().hidden_size(), 128u);
  ASSERT_EQ(info.model_info().eos_token_ids_size(), 1);
  EXPECT_EQ(info.model_info().eos_token_ids(0), 2u);
  EXPECT_EQ(info.model_info().model_path(), dir_);
  EXPECT_EQ(info.model_info().model_name(), "default");
  EXPECT_EQ(info.model_info().dtype(), v1::DTYPE_FLOAT32);
  EXPECT_EQ(info.model_info().checkpoint_dtype(), v1::DTYPE_FLOAT32);
  EXPECT_EQ(info.model_info().wire_dtype(), v1::DTYPE_FLOAT32);  // the registry's default
  EXPECT_EQ(info.model_info().fingerprint().checkpoint_fingerprint().size(), 16u);
  EXPECT_TRUE(WaitAllFree(frontend()));
}

// 2. Each bad input: its code and a message naming the field; the long request running
// meanwhile completes with the right tokens.
TEST_F(FrontendCluster, BadInputsAreRefusedWithoutDisturbingARunningRequest) {
  StartCluster(2, 1);
  const std::vector<int32_t> long_prompt = Prompt(3, 9);
  const v1::GenerateRequest long_request = LongRequest(long_prompt, "long-one");
  const int long_new_tokens = long_request.sampling_params().max_new_tokens();
  StreamCall running(frontend(), long_request, absl::Seconds(600));
  ASSERT_TRUE(running.WaitFor(1)) << cluster_->DumpLogs();

  const float nan = std::numeric_limits<float>::quiet_NaN();
  const float inf = std::numeric_limits<float>::infinity();
  struct Bad {
    std::string what;
    std::function<void(v1::GenerateRequest&)> edit;
    grpc::StatusCode code;
    std::string field;
  };
  const grpc::StatusCode kInvalid = grpc::StatusCode::INVALID_ARGUMENT;
  const std::vector<Bad> bad = {
      {"token id = vocab", [](auto& r) { r.set_prompt_token_ids(1, kVocab); }, kInvalid,
       "prompt_token_ids[1]"},
      {"huge token id", [](auto& r) { r.add_prompt_token_ids(0xffffffffu); }, kInvalid,
       "prompt_token_ids"},
      {"empty prompt", [](auto& r) { r.clear_prompt_token_ids(); }, kInvalid, "prompt_token_ids"},
      {"over the context",
       [](auto& r) { r.mutable_sampling_params()->set_max_new_tokens(kContext - 2); }, kInvalid,
       "max_new_tokens"},
      {"max_new_tokens 0", [](auto& r) { r.mutable_sampling_params()->set_max_new_tokens(0); },
       kInvalid, "max_new_tokens"},
      {"max_new_tokens < 0", [](auto& r) { r.mutable_sampling_params()->set_max_new_tokens(-4); },
       kInvalid, "max_new_tokens"},
      {"temperature < 0", [](auto& r) { r.mutable_sampling_params()->set_temperature(-0.5f); },
       kInvalid, "temperature"},
      {"temperature NaN", [&](auto& r) { r.mutable_sampling_params()->set_temperature(nan); },
       kInvalid, "temperature"},
      {"temperature inf", [&](auto& r) { r.mutable_sampling_params()->set_temperature(inf); },
       kInvalid, "temperature"},
      {"top_p 0", [](auto& r) { r.mutable_sampling_params()->set_top_p(0.f); }, kInvalid, "top_p"},
      {"top_p > 1", [](auto& r) { r.mutable_sampling_params()->set_top_p(1.5f); }, kInvalid,
       "top_p"},
      {"top_k < 0", [](auto& r) { r.mutable_sampling_params()->set_top_k(-1); }, kInvalid, "top_k"},
      {"unknown rank", [](auto& r) { r.set_data_parallel_rank(2); }, kInvalid,
       "data_parallel_rank"},
      {"stop id = vocab", [](auto& r) { r.mutable_sampling_params()->add_stop_token_ids(kVocab); },
       kInvalid, "sampling_params.stop_token_ids[0]"},
      {"min_p > 1", [](auto& r) { r.mutable_sampling_params()->set_min_p(1.5f); }, kInvalid,
       "sampling_params.min_p"},
      {"min_p < 0", [](auto& r) { r.mutable_sampling_params()->set_min_p(-0.1f); }, kInvalid,
       "sampling_params.min_p"},
      {"min_p NaN", [&](auto& r) { r.mutable_sampling_params()->set_min_p(nan); }, kInvalid,
       "sampling_params.min_p"},
      {"frequency_penalty > 2",
       [](auto& r) { r.mutable_sampling_params()->set_frequency_penalty(2.5f); }, kInvalid,
       "sampling_params.frequency_penalty"},
      {"frequency_penalty inf",
       [&](auto& r) { r.mutable_sampling_params()->set_frequency_penalty(-inf); }, kInvalid,
       "sampling_params.frequency_penalty"},
      {"presence_penalty < -2",
       [](auto& r) { r.mutable_sampling_params()->set_presence_penalty(-3.f); }, kInvalid,
       "sampling_params.presence_penalty"},
      {"presence_penalty NaN",
       [&](auto& r) { r.mutable_sampling_params()->set_presence_penalty(nan); }, kInvalid,
       "sampling_params.presence_penalty"},
      {"repetition_penalty 0",
       [](auto& r) { r.mutable_sampling_params()->set_repetition_penalty(0.f); }, kInvalid,
       "sampling_params.repetition_penalty"},
      {"repetition_penalty < 0",
       [](auto& r) { r.mutable_sampling_params()->set_repetition_penalty(-1.f); }, kInvalid,
       "sampling_params.repetition_penalty"},
      {"repetition_penalty inf",
       [&](auto& r) { r.mutable_sampling_params()->set_repetition_penalty(inf); }, kInvalid,
       "sampling_params.repetition_penalty"},
      {"logit_bias id = vocab",
       [](auto& r) { (*r.mutable_sampling_params()->mutable_logit_bias())[kVocab] = 1.f; },
       kInvalid, "sampling_params.logit_bias"},
      {"logit_bias > 100",
       [](auto& r) { (*r.mutable_sampling_params()->mutable_logit_bias())[5] = 100.5f; }, kInvalid,
       "sampling_params.logit_bias"},
      {"logit_bias < -100",
       [](auto& r) { (*r.mutable_sampling_params()->mutable_logit_bias())[5] = -101.f; }, kInvalid,
       "sampling_params.logit_bias"},
      {"logit_bias NaN",
       [&](auto& r) { (*r.mutable_sampling_params()->mutable_logit_bias())[5] = nan; }, kInvalid,
       "sampling_params.logit_bias"},
      {"top_logprobs > 20", [](auto& r) { r.mutable_sampling_params()->set_top_logprobs(21); },
       kInvalid, "sampling_params.top_logprobs"},
      {"logprob id = vocab",
       [](auto& r) { r.mutable_sampling_params()->add_logprob_token_ids(kVocab); }, kInvalid,
       "sampling_params.logprob_token_ids[0]"},
      {"129 logprob ids",
       [](auto& r) {
         for (int i = 0; i < 129; ++i) r.mutable_sampling_params()->add_logprob_token_ids(i);
       },
       kInvalid, "sampling_params.logprob_token_ids"},
      {"prompt_logprobs_start = prompt length",
       [](auto& r) { r.mutable_sampling_params()->set_prompt_logprobs_start(3); }, kInvalid,
       "sampling_params.prompt_logprobs_start"},
      {"min_new_tokens > max_new_tokens",
       [](auto& r) { r.mutable_sampling_params()->set_min_new_tokens(5); }, kInvalid,
       "sampling_params.min_new_tokens"},
      {"n = 65", [](auto& r) { r.mutable_sampling_params()->set_n(65); }, kInvalid,
       "sampling_params.n"},
      {"duplicate id", [](auto& r) { r.set_request_id("long-one"); },
       grpc::StatusCode::ALREADY_EXISTS, "request_id"},
  };
  for (const Bad& b : bad) {
    v1::GenerateRequest request = Request(Prompt(4, 3), 4, "bad-" + b.what);
    b.edit(request);
    Outcome out = RunToEnd(frontend(), request, absl::Seconds(10));
    EXPECT_EQ(out.status.error_code(), b.code) << b.what << ": " << out.status.error_message();
    EXPECT_NE(out.status.error_message().find(b.field), std::string::npos)
        << b.what << ": " << out.status.error_message();
    EXPECT_TRUE(out.tokens.empty()) << b.what;
  }
  // Abort: empty and unknown ids.
  grpc::Status s = AbortCall(frontend(), "");
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << s.error_message();
  EXPECT_NE(s.error_message().find("request_id"), std::string::npos) << s.error_message();
  s = AbortCall(frontend(), "no-such-request");
  EXPECT_EQ(s.error_code(), grpc::StatusCode::NOT_FOUND) << s.error_message();

  // Meanwhile a good request with every feature is served as the engine serves it.
  {
    GenerationRequest good;
    good.prompt = Prompt(4, 3);
    good.max_new_tokens = 4;
    good.min_new_tokens = 2;
    good.sampling.temperature = 0.f;
    good.sampling.min_p = 0.1f;
    good.sampling.repetition_penalty = 1.2f;
    good.sampling.frequency_penalty = 0.3f;
    good.sampling.presence_penalty = 0.3f;
    good.sampling.logit_bias = {{9, 2.f}};
    good.top_logprobs = 20;
    good.logprob_token_ids = {1, 2};
    good.prompt_logprobs_start = 1;
    ExpectEqualsEngine(RunToEnd(frontend(), ProtoRequest(good, "good-after-bad")), good, Want(good),
                       "good after the bad ones");
  }
  EXPECT_FALSE(running.finished()) << "the long request should outlast the bad ones";
  running.Join();
  ASSERT_TRUE(running.status().ok()) << running.status().error_message() << cluster_->DumpLogs();
  EXPECT_TRUE(running.in_order());
  EXPECT_EQ(running.tokens(), Reference(engine(), long_prompt, long_new_tokens, true));
  ASSERT_TRUE(running.complete().has_value());
  EXPECT_EQ(running.complete()->finish_reason(), v1::FINISH_REASON_LENGTH);
  EXPECT_TRUE(WaitAllFree(frontend()));
}

// 3. Health follows the registry: NOT_SERVING with the router alone, SERVING once every
// rank is registered, NOT_SERVING when an expert dies, SERVING when it returns.
TEST_F(FrontendCluster, HealthFollowsClusterCompleteness) {
  dir_ = testing::WritePreset(tmp_, "default");
  cluster_ = std::make_unique<ProcessCluster>(tmp_.path());
  ClusterSpec spec{dir_, 1, 2, {}, "f32"};
  ASSERT_TRUE(cluster_->StartRouter(spec).ok()) << cluster_->DumpLogs();
  const std::string& router = cluster_->router_address();
  EXPECT_EQ(Health(router, ""), HealthCheckResponse::NOT_SERVING);
  EXPECT_EQ(Health(router, "dxs.v1.Frontend"), HealthCheckResponse::NOT_SERVING);
  EXPECT_EQ(Health(router, "dxs.v1.ControlPlane"), HealthCheckResponse::SERVING);
  Outcome out = RunToEnd(frontend(), Request(Prompt(0, 3), 4), absl::Seconds(10));
  EXPECT_EQ(out.status.error_code(), grpc::StatusCode::UNAVAILABLE) << out.status.error_message();
  EXPECT_NE(out.status.error_message().find("incomplete"), std::string::npos);
  {
    grpc::ClientContext context;
    v1::GetModelInfoResponse info;
    EXPECT_EQ(frontend()->GetModelInfo(&context, v1::GetModelInfoRequest(), &info).error_code(),
              grpc::StatusCode::UNAVAILABLE);
  }
  absl::StatusOr<v1::GetLoadsResponse> loads = Loads(frontend());
  ASSERT_TRUE(loads.ok()) << loads.status();
  EXPECT_EQ(loads->loads_size(), 0);

  ASSERT_TRUE(cluster_->StartWorkers(spec).ok()) << cluster_->DumpLogs();
  EXPECT_TRUE(WaitHealth(router, HealthCheckResponse::SERVING, absl::Seconds(30)))
      << cluster_->DumpLogs();
  loads = Loads(frontend());
  ASSERT_TRUE(loads.ok()) << loads.status();
  ASSERT_EQ(loads->loads_size(), 1);
  EXPECT_EQ(loads->loads(0).rank(), 0u);
  EXPECT_EQ(loads->loads(0).state(), v1::WORKER_STATE_READY);
  EXPECT_GT(loads->loads(0).kv_cache_total_tokens(), 0u);
  EXPECT_GT(loads->cluster_view_version(), 1u);

  cluster_->KillExpert(1);  // its lease (2 s) runs out
  EXPECT_TRUE(WaitHealth(router, HealthCheckResponse::NOT_SERVING, absl::Seconds(30)))
      << cluster_->DumpLogs();
  out = RunToEnd(frontend(), Request(Prompt(0, 3), 4), absl::Seconds(10));
  EXPECT_EQ(out.status.error_code(), grpc::StatusCode::UNAVAILABLE) << out.status.error_message();

  const absl::Status restarted = cluster_->StartExpert(1, dir_, "");
  ASSERT_TRUE(restarted.ok()) << restarted << cluster_->DumpLogs();
  EXPECT_TRUE(WaitHealth(router, HealthCheckResponse::SERVING, absl::Seconds(30)))
      << cluster_->DumpLogs();
  ASSERT_TRUE(cluster_->WaitReady(absl::Seconds(30)).ok()) << cluster_->DumpLogs();
  out = RunToEnd(frontend(), Request(Prompt(5, 6), 7));
  ASSERT_TRUE(out.status.ok()) << out.status.error_message() << cluster_->DumpLogs();
  EXPECT_EQ(out.tokens, Reference(engine(), Prompt(5, 6), 7));
}

// 4. Abort (by the caller's id and by an assigned one, early), client cancellation and a
// passed deadline each end the request and free its KV cache.
TEST_F(FrontendCluster, AbortCancelAndDeadlineFreeTheKvCache) {
  StartCluster(2, 1);
  {
    const v1::GenerateRequest request = LongRequest(Prompt(6, 12), "to-abort");
    const int long_new_tokens = request.sampling_params().max_new_tokens();
    StreamCall call(frontend(), request);
    ASSERT_TRUE(call.WaitFor(3)) << cluster_->DumpLogs();
    absl::StatusOr<v1::GetLoadsResponse> loads = Loads(frontend());
    ASSERT_TRUE(loads.ok()) << loads.status();
    uint64_t used = 0, outstanding = 0;
    for (const v1::RankLoad& l : loads->loads()) {
      used += l.kv_cache_used_tokens();
      outstanding += l.num_outstanding_tokens();
    }
    EXPECT_GT(used, 0u);
    EXPECT_GT(outstanding, 0u);
    EXPECT_LE(outstanding, 12u + long_new_tokens);
    grpc::Status s = AbortCall(frontend(), "to-abort");
    EXPECT_TRUE(s.ok()) << s.error_message();
    call.Join();
    ASSERT_TRUE(call.status().ok()) << call.status().error_message();
    ASSERT_TRUE(call.complete().has_value());
    EXPECT_EQ(call.complete()->finish_reason(), v1::FINISH_REASON_ABORTED);
    EXPECT_LT(call.tokens().size(), static_cast<size_t>(long_new_tokens));
    EXPECT_EQ(call.complete()->completion_tokens(), call.tokens().size());
    EXPECT_TRUE(WaitAllFree(frontend())) << cluster_->DumpLogs();
    // Finished: no longer known.
    EXPECT_EQ(AbortCall(frontend(), "to-abort").error_code(), grpc::StatusCode::NOT_FOUND);
  }
  {
    // Abort on the assigned id, as soon as the first (empty) message arrives.
    const v1::GenerateRequest request = LongRequest(Prompt(7, 5));
    const int long_new_tokens = request.sampling_params().max_new_tokens();
    StreamCall call(frontend(), request);
    ASSERT_TRUE(call.WaitFor(0)) << cluster_->DumpLogs();
    const std::string id = call.request_id();
    ASSERT_FALSE(id.empty());
    grpc::Status s = AbortCall(frontend(), id);
    EXPECT_TRUE(s.ok()) << s.error_message();
    call.Join();
    ASSERT_TRUE(call.status().ok()) << call.status().error_message();
    ASSERT_TRUE(call.complete().has_value());
    EXPECT_EQ(call.complete()->finish_reason(), v1::FINISH_REASON_ABORTED);
    EXPECT_LT(call.tokens().size(), static_cast<size_t>(long_new_tokens));
    EXPECT_TRUE(WaitAllFree(frontend())) << cluster_->DumpLogs();
  }
  {
    const v1::GenerateRequest request = LongRequest(Prompt(8, 7), "to-cancel");
    const int long_new_tokens = request.sampling_params().max_new_tokens();
    StreamCall call(frontend(), request);
    ASSERT_TRUE(call.WaitFor(3)) << cluster_->DumpLogs();
    call.Cancel();
    call.Join();
    EXPECT_EQ(call.status().error_code(), grpc::StatusCode::CANCELLED);
    EXPECT_LT(call.tokens().size(), static_cast<size_t>(long_new_tokens));
    EXPECT_TRUE(WaitAllFree(frontend())) << cluster_->DumpLogs();
    EXPECT_EQ(AbortCall(frontend(), "to-cancel").error_code(), grpc::StatusCode::NOT_FOUND);
  }
  {
    // The deadline passes while the request runs: started at once, it needs far longer
    // than 700 ms for the whole context.
    const v1::GenerateRequest request = LongRequest(Prompt(9, 7), "short-deadline");
    const int long_new_tokens = request.sampling_params().max_new_tokens();
    StreamCall call(frontend(), request, absl::Milliseconds(700));
    call.Join();
    EXPECT_EQ(call.status().error_code(), grpc::StatusCode::DEADLINE_EXCEEDED)
        << call.status().error_message();
    EXPECT_LT(call.tokens().size(), static_cast<size_t>(long_new_tokens));
    EXPECT_TRUE(WaitAllFree(frontend())) << cluster_->DumpLogs();
  }
  // The cluster still serves correctly.
  Outcome out = RunToEnd(frontend(), Request(Prompt(10, 4), 6));
  ASSERT_TRUE(out.status.ok()) << out.status.error_message();
  EXPECT_EQ(out.tokens, Reference(engine(), Prompt(10, 4), 6));
}

// 5. data_parallel_rank pins; unpinned long requests go to the least-loaded rank.
TEST_F(FrontendCluster, PinningAndLeastLoadedPlacement) {
  StartCluster(2, 1);
  for (uint32_t rank : {1u, 0u, 1u}) {
    v1::GenerateRequest request = Request(Prompt(11, 4), 3);
    request.set_data_parallel_rank(rank);
    Outcome out = RunToEnd(frontend(), request);
    ASSERT_TRUE(out.status.ok()) << out.status.error_message();
    ASSERT_TRUE(out.complete.has_value());
    EXPECT_EQ(out.complete->data_parallel_rank(), rank);
    EXPECT_EQ(out.tokens, Reference(engine(), Prompt(11, 4), 3));
  }

  StreamCall first(frontend(), LongRequest(Prompt(12, 6), "spread-a"));
  ASSERT_TRUE(first.WaitFor(1)) << cluster_->DumpLogs();
  StreamCall second(frontend(), LongRequest(Prompt(13, 6), "spread-b"));
  ASSERT_TRUE(second.WaitFor(1)) << cluster_->DumpLogs();
  absl::StatusOr<v1::GetLoadsResponse> loads = Loads(frontend());
  ASSERT_TRUE(loads.ok()) << loads.status();
  ASSERT_EQ(loads->loads_size(), 2);
  for (const v1::RankLoad& l : loads->loads()) {
    EXPECT_GT(l.num_outstanding_tokens(), 0u) << "rank " << l.rank();
    EXPECT_GT(l.kv_cache_used_tokens(), 0u) << "rank " << l.rank();
    EXPECT_EQ(l.num_running_requests(), 1u) << "rank " << l.rank();
  }
  EXPECT_TRUE(AbortCall(frontend(), "spread-a").ok());
  EXPECT_TRUE(AbortCall(frontend(), "spread-b").ok());
  first.Join();
  second.Join();
  ASSERT_TRUE(first.complete().has_value() && second.complete().has_value())
      << first.status().error_message() << " / " << second.status().error_message();
  EXPECT_EQ(first.complete()->finish_reason(), v1::FINISH_REASON_ABORTED);
  EXPECT_EQ(second.complete()->finish_reason(), v1::FINISH_REASON_ABORTED);
  EXPECT_NE(first.complete()->data_parallel_rank(), second.complete()->data_parallel_rank());
  EXPECT_TRUE(WaitAllFree(frontend())) << cluster_->DumpLogs();
}

// --max-inflight 1: a second request while one runs is RESOURCE_EXHAUSTED; the slot frees
// when the first ends.
TEST_F(FrontendCluster, MaxInflightBoundsAdmission) {
  StartCluster(1, 1, {"--max-inflight", "1"});
  StreamCall running(frontend(), LongRequest(Prompt(14, 5), "holder"));
  ASSERT_TRUE(running.WaitFor(1)) << cluster_->DumpLogs();
  Outcome refused = RunToEnd(frontend(), Request(Prompt(15, 5), 4), absl::Seconds(10));
  EXPECT_EQ(refused.status.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED)
      << refused.status.error_message();
  EXPECT_NE(refused.status.error_message().find("max-inflight"), std::string::npos);
  ASSERT_TRUE(AbortCall(frontend(), "holder").ok());
  running.Join();
  EXPECT_TRUE(running.status().ok()) << running.status().error_message();
  ASSERT_TRUE(running.complete().has_value());
  EXPECT_EQ(running.complete()->finish_reason(), v1::FINISH_REASON_ABORTED);
  Outcome admitted = RunToEnd(frontend(), Request(Prompt(15, 5), 4));
  ASSERT_TRUE(admitted.status.ok()) << admitted.status.error_message();
  EXPECT_EQ(admitted.tokens, Reference(engine(), Prompt(15, 5), 4));
}

// 6. Log-probabilities and prompt scores equal the single-process engine's, through the
// router (the Serve stream) and through a worker's own Generate. The workers stream in
// chunks of 3 and prefill in chunks of 5, so held tokens leave with their held logprobs
// and a scored prompt spans several prefill steps.
TEST_F(FrontendCluster, LogprobsAndPromptScoresEqualTheSingleProcessEngine) {
  constexpr int kPrefillChunk = 5;
  StartCluster(2, 1, {},
               {"--stream-interval", "3", "--prefill-chunk", std::to_string(kPrefillChunk)});
  EngineOptions options;
  options.prefill_chunk_tokens = kPrefillChunk;
  auto chunked = LocalEngine::Load(dir_, options);
  ASSERT_TRUE(chunked.ok()) << chunked.status();

  struct Case {
    std::string what;
    GenerationRequest request;
  };
  std::vector<Case> cases;
  {
    GenerationRequest r;
    r.prompt = Prompt(20, 7);
    r.max_new_tokens = 8;
    r.sampling.temperature = 0.f;
    r.logprobs = true;
    r.top_logprobs = 5;
    r.logprob_token_ids = {3, 1000};
    cases.push_back({"greedy-logprobs", r});
    r.sampling.temperature = 0.8f;
    r.sampling.seed = 1234;
    cases.push_back({"sampled-logprobs", r});
  }
  {
    // Scored from position 4 of 13, then 3 tokens, top 3 and two named ids everywhere.
    GenerationRequest r;
    r.prompt = Prompt(21, 13);
    r.max_new_tokens = 3;
    r.sampling.temperature = 0.f;
    r.top_logprobs = 3;
    r.logprob_token_ids = {7, 9};
    r.prompt_logprobs_start = 4;
    cases.push_back({"prompt-from-4", r});
    // Prompt scoring alone, from the start: position 0 has no score, 1.. have.
    r.max_new_tokens = 0;
    r.prompt_logprobs_start = 0;
    r.top_logprobs = 2;
    r.logprob_token_ids = {};
    cases.push_back({"prompt-only", r});
    // The last position alone, and the logprob of the chosen tokens only.
    r.max_new_tokens = 2;
    r.prompt_logprobs_start = 12;
    r.top_logprobs = 0;
    r.logprobs = true;
    cases.push_back({"prompt-last-position", r});
  }
  // All at once through the router, so that they share steps.
  std::vector<std::unique_ptr<StreamCall>> calls;
  for (const Case& c : cases) {
    calls.push_back(std::make_unique<StreamCall>(frontend(), ProtoRequest(c.request, c.what)));
  }
  for (size_t i = 0; i < cases.size(); ++i) {
    StreamCall& call = *calls[i];
    call.Join();
    const Outcome out{call.status(), call.tokens(), call.complete(), call.in_order(),
                      call.chunks()};
    const GenerationResult want = Want(cases[i].request, chunked->get());
    ExpectEqualsEngine(out, cases[i].request, want, cases[i].what + " (router)");
    if (cases[i].request.max_new_tokens == 0) {
      ASSERT_TRUE(out.complete.has_value());
      EXPECT_EQ(out.complete->finish_reason(), v1::FINISH_REASON_LENGTH);
      EXPECT_EQ(out.complete->completion_tokens(), 0u);
    }
  }
  // The worker's Generate: its own sink path, one request at a time.
  for (const Case& c : cases) {
    const Outcome out = RunOnWorker(cluster_->attention(1), ProtoRequest(c.request, c.what));
    ExpectEqualsEngine(out, c.request, Want(c.request, chunked->get()), c.what + " (worker)");
  }
  EXPECT_TRUE(WaitAllFree(frontend())) << cluster_->DumpLogs();
}

// `got` has every key of `want` with equal integers and strings, and floats within the
// logprob bound.
void ExpectJsonNear(const nlohmann::json& got, const nlohmann::json& want, const std::string& at) {
  if (want.is_number_float() || got.is_number_float()) {
    ASSERT_TRUE(got.is_number()) << at << ": " << got;
    EXPECT_NEAR(got.get<double>(), want.get<double>(),
                LogprobBound(static_cast<float>(want.get<double>())))
        << at;
  } else if (want.is_object()) {
    ASSERT_TRUE(got.is_object()) << at;
    for (const auto& [key, value] : want.items()) {
      ASSERT_TRUE(got.contains(key)) << at << ": no " << key;
      ExpectJsonNear(got.at(key), value, at + "." + key);
    }
  } else if (want.is_array()) {
    ASSERT_TRUE(got.is_array()) << at;
    ASSERT_EQ(got.size(), want.size()) << at;
    for (size_t i = 0; i < want.size(); ++i) {
      ExpectJsonNear(got[i], want[i], at + "[" + std::to_string(i) + "]");
    }
  } else {
    EXPECT_EQ(got, want) << at;
  }
}

// `dxs generate` against the cluster prints what `dxs run` prints for the same flags.
TEST_F(FrontendCluster, DxsGeneratePrintsWhatDxsRunPrints) {
  StartCluster(1, 1);
  const std::string flags =
      " --prompt-ids 11,400,93,7,2048,5 --max-new-tokens 5 --format json --temperature 0.6"
      " --seed 9 --min-p 0.05 --repetition-penalty 1.15 --frequency-penalty 0.2"
      " --presence-penalty 0.1 --logit-bias 17:2.5,2:-100 --min-new-tokens 1 --logprobs"
      " --top-logprobs 4 --logprob-token-ids 3,17 --prompt-logprobs 2";
  const std::string generated =
      cluster_->RunDxs("generate --router " + cluster_->router_address() + flags);
  const std::string local = cluster_->RunDxs("run --model " + dir_ + flags);
  const nlohmann::json got = nlohmann::json::parse(generated, nullptr, /*allow_exceptions=*/false);
  const nlohmann::json want = nlohmann::json::parse(local, nullptr, /*allow_exceptions=*/false);
  ASSERT_FALSE(got.is_discarded()) << generated;
  ASSERT_FALSE(want.is_discarded()) << local;
  for (const char* key :
       {"tokens", "logprobs", "top_logprobs", "token_ids_logprobs", "prompt_logprobs"}) {
    ASSERT_TRUE(want.contains(key)) << key << ": " << local;
    ExpectJsonNear(got.value(key, nlohmann::json()), want.at(key), key);
  }
  // --n 3: the same "samples" list, one object per sample.
  const std::string sampled =
      cluster_->RunDxs("generate --router " + cluster_->router_address() + flags + " --n 3");
  const std::string sampled_local = cluster_->RunDxs("run --model " + dir_ + flags + " --n 3");
  const nlohmann::json got_n = nlohmann::json::parse(sampled, nullptr, false);
  const nlohmann::json want_n = nlohmann::json::parse(sampled_local, nullptr, false);
  ASSERT_FALSE(got_n.is_discarded()) << sampled;
  ASSERT_FALSE(want_n.is_discarded()) << sampled_local;
  ASSERT_EQ(want_n.value("samples", nlohmann::json()).size(), 3u) << sampled_local;
  ASSERT_EQ(got_n.value("samples", nlohmann::json()).size(), 3u) << sampled;
  for (size_t i = 0; i < 3; ++i) {
    for (const char* key : {"tokens", "logprobs", "top_logprobs", "token_ids_logprobs"}) {
      const std::string at = "samples[" + std::to_string(i) + "]." + key;
      ASSERT_TRUE(want_n["samples"][i].contains(key)) << at << ": " << sampled_local;
      ExpectJsonNear(got_n["samples"][i].value(key, nlohmann::json()), want_n["samples"][i][key],
                     at);
    }
    EXPECT_EQ(got_n["samples"][i].value("completion_tokens", 0u),
              want_n["samples"][i]["tokens"].size());
  }
  ExpectJsonNear(got_n.value("prompt_logprobs", nlohmann::json()), want.at("prompt_logprobs"),
                 "prompt_logprobs with --n 3");
  // A value the router refuses: the error names the field, exit status != 0.
  const std::string refused = cluster_->RunDxs("generate --router " + cluster_->router_address() +
                                               " --prompt-ids 1,2 --min-p 1.5");
  EXPECT_EQ(refused.rfind("exit status != 0: ", 0), 0u) << refused;
  EXPECT_NE(refused.find("INVALID_ARGUMENT: sampling_params.min_p"), std::string::npos) << refused;
}

// 7. Penalties, logit_bias, min_new_tokens and min_p equal the single-process engine,
// greedy and with seeded temperature sampling.
TEST_F(FrontendCluster, PenaltiesBiasAndMinTokensEqualTheSingleProcessEngine) {
  StartCluster(2, 1);
  constexpr int32_t kEos = 2;  // the "default" preset's
  std::vector<std::pair<std::string, GenerationRequest>> cases;
  {
    // EOS pushed up by 100 comes as soon as min_new_tokens allows it: five other tokens,
    // then EOS.
    GenerationRequest r;
    r.prompt = Prompt(30, 9);
    r.max_new_tokens = 12;
    r.min_new_tokens = 5;
    r.sampling.temperature = 0.f;
    r.sampling.logit_bias = {{kEos, 100.f}, {77, 3.5f}, {1234, -100.f}};
    r.sampling.repetition_penalty = 1.3f;
    r.sampling.frequency_penalty = 0.5f;
    r.sampling.presence_penalty = 0.4f;
    r.logprobs = true;  // the raw distribution, whatever the adjustments
    cases.push_back({"greedy-eos-after-min", r});
    // Without the EOS push: penalties over a longer output, past EOS.
    r.sampling.logit_bias = {{77, 3.5f}, {1234, -100.f}};
    r.max_new_tokens = 16;
    r.ignore_eos = true;
    r.logprobs = false;
    cases.push_back({"greedy-penalties", r});
    // Seeded temperature sampling with min_p on top.
    r.sampling.temperature = 0.9f;
    r.sampling.seed = 77;
    r.sampling.min_p = 0.05f;
    r.sampling.top_k = 50;
    r.sampling.repetition_penalty = 1.1f;
    r.sampling.frequency_penalty = -0.5f;
    r.sampling.presence_penalty = 1.f;
    cases.push_back({"sampled-min-p", r});
    r.sampling.seed = 78;
    r.sampling.min_p = 0.3f;
    r.sampling.top_k = 0;
    r.sampling.top_p = 0.9f;
    r.min_new_tokens = 16;
    r.stop_token_ids = {77};
    r.ignore_eos = false;
    cases.push_back({"sampled-min-tokens-stop", r});
  }
  std::vector<std::unique_ptr<StreamCall>> calls;
  for (const auto& [what, request] : cases) {
    calls.push_back(std::make_unique<StreamCall>(frontend(), ProtoRequest(request, what)));
  }
  for (size_t i = 0; i < cases.size(); ++i) {
    calls[i]->Join();
    const Outcome out{calls[i]->status(), calls[i]->tokens(), calls[i]->complete(),
                      calls[i]->in_order(), calls[i]->chunks()};
    const GenerationResult want = Want(cases[i].second);
    ExpectEqualsEngine(out, cases[i].second, want, cases[i].first);
    if (i == 0) {
      ASSERT_EQ(want.tokens.size(), 6u) << "EOS as soon as min_new_tokens allows";
      EXPECT_EQ(want.tokens.back(), kEos);
      EXPECT_EQ(std::count(want.tokens.begin(), want.tokens.end(), 1234), 0);
      ASSERT_TRUE(out.complete.has_value());
      EXPECT_EQ(out.complete->finish_reason(), v1::FINISH_REASON_STOP_EOS);
      EXPECT_EQ(out.complete->matched_stop_token_id(), static_cast<uint32_t>(kEos));
    }
    if (i == 3) {
      EXPECT_EQ(want.tokens.size(), 16u) << "no stop before min_new_tokens";
    }
  }
  EXPECT_TRUE(WaitAllFree(frontend())) << cluster_->DumpLogs();
}

v1::FinishReason ProtoReason(FinishReason r) {
  switch (r) {
    case FinishReason::kLength:
      return v1::FINISH_REASON_LENGTH;
    case FinishReason::kEos:
      return v1::FINISH_REASON_STOP_EOS;
    case FinishReason::kStopToken:
      return v1::FINISH_REASON_STOP_TOKEN;
    case FinishReason::kAborted:
      return v1::FINISH_REASON_ABORTED;
  }
  return v1::FINISH_REASON_UNSPECIFIED;
}

// Sample `i` of a whole n-sample stream as an Outcome of its own: its chunks (each
// sample's indices count from 0), its tokens, and its end (the top level for sample 0,
// its GenerateComplete.samples entry for the others).
Outcome SampleOf(const Outcome& all, uint32_t i) {
  Outcome out;
  out.status = all.status;
  out.in_order = all.in_order;
  for (const v1::TokenChunk& chunk : all.chunks) {
    if (chunk.sample_index() != i) continue;
    out.in_order = out.in_order && chunk.index() == out.tokens.size();
    for (uint32_t t : chunk.token_ids()) out.tokens.push_back(static_cast<int32_t>(t));
    out.chunks.push_back(chunk);
  }
  if (!all.complete.has_value()) return out;
  if (i == 0) {
    out.complete = *all.complete;
    return out;
  }
  for (const v1::SampleComplete& sample : all.complete->samples()) {
    if (sample.sample_index() != i) continue;
    v1::GenerateComplete c;
    c.set_finish_reason(sample.finish_reason());
    c.set_completion_tokens(sample.completion_tokens());
    if (sample.has_matched_stop_token_id()) {
      c.set_matched_stop_token_id(sample.matched_stop_token_id());
    }
    out.complete = c;
  }
  return out;
}

// The single request sample `i` of `r` equals: the seed SampleSeed(seed, i), one sample,
// and the prompt's scores with sample 0 only.
GenerationRequest SampleRequest(GenerationRequest r, int32_t i) {
  r.sampling.seed = SampleSeed(r.sampling.seed, i);
  r.n = 1;
  if (i > 0) r.prompt_logprobs_start = -1;
  return r;
}

// 8. n samples of one prompt: sample i of a request with n = 4 equals a single request with
// the seed SampleSeed(seed, i), tokens exactly and log-probabilities within the bound, on
// the router's Serve stream and a worker's Generate alike; the stream ends once, with every
// sample's end. An Abort ends every sample.
TEST_F(FrontendCluster, SamplesEqualSingleRequestsWithTheirSeeds) {
  // Chunks of 3 after the first: held tokens leave per sample, with their logprobs.
  StartCluster(2, 1, {}, {"--stream-interval", "3"});
  constexpr int32_t kEos = 2;  // the "default" preset's
  std::vector<std::pair<std::string, GenerationRequest>> cases;
  {
    GenerationRequest r;
    r.prompt = Prompt(40, 7);
    r.max_new_tokens = 10;
    r.ignore_eos = true;
    r.sampling.temperature = 0.9f;
    r.sampling.seed = 1234;
    r.n = 4;
    cases.push_back({"n4", r});
  }
  {
    // Log-probabilities of every sample; the prompt's scores with sample 0 only.
    GenerationRequest r;
    r.prompt = Prompt(41, 9);
    r.max_new_tokens = 8;
    r.sampling.temperature = 0.9f;
    r.sampling.top_k = 50;
    r.sampling.seed = 99;
    r.logprobs = true;
    r.top_logprobs = 3;
    r.logprob_token_ids = {3, 17};
    r.prompt_logprobs_start = 2;
    r.n = 4;
    cases.push_back({"n4-logprobs", r});
  }
  {
    // EOS pushed up: the samples end on their own, at different lengths.
    GenerationRequest r;
    r.prompt = Prompt(42, 5);
    r.max_new_tokens = 12;
    r.min_new_tokens = 1;
    r.sampling.temperature = 0.9f;
    r.sampling.seed = 5;
    r.sampling.logit_bias = {{kEos, 8.f}};
    r.logprobs = true;
    r.n = 4;
    cases.push_back({"n4-eos", r});
  }
  auto expect_samples = [&](const Outcome& out, const GenerationRequest& request,
                            const std::string& what) {
    ASSERT_TRUE(out.status.ok()) << what << ": " << out.status.error_message()
                                 << cluster_->DumpLogs();
    EXPECT_TRUE(out.in_order) << what;
    ASSERT_TRUE(out.complete.has_value()) << what;
    EXPECT_EQ(out.complete->prompt_tokens(), request.prompt.size()) << what;
    ASSERT_EQ(out.complete->samples_size(), request.n - 1) << what;
    std::set<std::vector<int32_t>> distinct;
    std::set<FinishReason> reasons;
    for (int32_t i = 0; i < request.n; ++i) {
      const std::string at = what + " sample " + std::to_string(i);
      if (i > 0) {
        EXPECT_EQ(out.complete->samples(i - 1).sample_index(), static_cast<uint32_t>(i)) << at;
      }
      const Outcome sample = SampleOf(out, static_cast<uint32_t>(i));
      const GenerationRequest single = SampleRequest(request, i);
      const GenerationResult want = Want(single);
      ExpectEqualsEngine(sample, single, want, at);
      ASSERT_TRUE(sample.complete.has_value()) << at;
      EXPECT_EQ(sample.complete->finish_reason(), ProtoReason(want.finish_reason)) << at;
      if (i > 0 && want.finish_reason == FinishReason::kEos) {
        EXPECT_EQ(sample.complete->matched_stop_token_id(), static_cast<uint32_t>(kEos)) << at;
      }
      distinct.insert(sample.tokens);
      reasons.insert(want.finish_reason);
    }
    EXPECT_GT(distinct.size(), 1u) << what << ": the samples draw from different streams";
    if (request.sampling.logit_bias.empty()) return;
    // Some samples stop at EOS (sample 0 before sample 1), others run to max_new_tokens.
    EXPECT_EQ(reasons, (std::set<FinishReason>{FinishReason::kEos, FinishReason::kLength})) << what;
  };
  // All at once through the router, so that they share steps.
  std::vector<std::unique_ptr<StreamCall>> calls;
  for (const auto& [what, request] : cases) {
    calls.push_back(std::make_unique<StreamCall>(frontend(), ProtoRequest(request, what)));
  }
  for (size_t c = 0; c < cases.size(); ++c) {
    calls[c]->Join();
    const Outcome out{calls[c]->status(), calls[c]->tokens(), calls[c]->complete(),
                      calls[c]->in_order(), calls[c]->chunks()};
    expect_samples(out, cases[c].second, cases[c].first + " (router)");
  }
  // The worker's Generate: its own sink path.
  for (const auto& [what, request] : cases) {
    expect_samples(RunOnWorker(cluster_->attention(1), ProtoRequest(request, what)), request,
                   what + " (worker)");
  }
  EXPECT_TRUE(WaitAllFree(frontend())) << cluster_->DumpLogs();

  // An Abort of a request with 3 samples mid-stream ends the stream once, with every
  // sample's end (ABORTED, its own token count), and frees the KV of every sample.
  GenerationRequest r;
  r.prompt = Prompt(43, 6);
  r.max_new_tokens = kContext - 6;
  r.ignore_eos = true;
  r.sampling.temperature = 0.9f;
  r.sampling.seed = 8;
  r.n = 3;
  for (const std::string id : {"abort-samples", ""}) {
    // By its id once sample 0 has tokens; and by an assigned id at once, likely before the
    // prompt's prefill ended (then no sample has tokens, and each ends all the same).
    StreamCall call(frontend(), ProtoRequest(r, id));
    ASSERT_TRUE(call.WaitFor(id.empty() ? 0 : 3)) << cluster_->DumpLogs();
    grpc::Status s = AbortCall(frontend(), call.request_id());
    EXPECT_TRUE(s.ok()) << s.error_message();
    call.Join();
    const std::string what = id.empty() ? "assigned id" : id;
    ASSERT_TRUE(call.status().ok()) << what << ": " << call.status().error_message();
    EXPECT_TRUE(call.in_order()) << what;
    ASSERT_TRUE(call.complete().has_value()) << what;
    const Outcome out{call.status(), call.tokens(), call.complete(), call.in_order(),
                      call.chunks()};
    EXPECT_EQ(out.complete->finish_reason(), v1::FINISH_REASON_ABORTED) << what;
    ASSERT_EQ(out.complete->samples_size(), 2) << what;
    for (uint32_t i = 0; i < 3; ++i) {
      const Outcome sample = SampleOf(out, i);
      ASSERT_TRUE(sample.complete.has_value()) << what << " sample " << i;
      EXPECT_EQ(sample.complete->finish_reason(), v1::FINISH_REASON_ABORTED)
          << what << " sample " << i;
      EXPECT_EQ(sample.complete->completion_tokens(), sample.tokens.size())
          << what << " sample " << i;
      EXPECT_LT(sample.tokens.size(), static_cast<size_t>(r.max_new_tokens))
          << what << " sample " << i;
    }
    EXPECT_TRUE(WaitAllFree(frontend())) << what << cluster_->DumpLogs();
  }
}

}  // namespace
}  // namespace dxs
