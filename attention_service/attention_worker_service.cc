#include "attention_service/attention_worker_service.h"

#include <algorithm>
#include <chrono>
#include <deque>
#include <fstream>
#include <optional>
#include <random>
#include <set>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/grpc/metadata.h"
#include "common/grpc/status_conversion.h"

namespace dxs {

absl::StatusOr<GenerationRequest> FromProto(const v1::GenerateRequest& req) {
  GenerationRequest r;
  for (uint32_t id : req.prompt_token_ids()) {
    if (id > static_cast<uint32_t>(INT32_MAX)) {
      return absl::InvalidArgumentError(absl::StrCat("prompt: token id ", id, " is too large"));
    }
    r.prompt.push_back(static_cast<int32_t>(id));
  }
  const v1::SamplingParams& p = req.sampling_params();
  r.max_new_tokens = p.max_new_tokens();
  r.sampling.temperature = p.has_temperature() ? p.temperature() : 1.0f;
  r.sampling.top_p = p.has_top_p() ? p.top_p() : 1.0f;
  r.sampling.top_k = p.top_k();
  r.sampling.seed = p.has_seed() ? p.seed() : std::random_device{}();
  for (uint32_t id : p.stop_token_ids()) r.stop_token_ids.push_back(static_cast<int32_t>(id));
  r.ignore_eos = p.ignore_eos();
  // The sampling features; unset optionals are their "off" values. An id above INT32_MAX
  // turns negative here, which ValidateRequest refuses as outside the vocabulary, and
  // counts are capped at INT32_MAX, which it refuses as too large: nothing is clamped
  // into range.
  r.sampling.min_p = p.has_min_p() ? p.min_p() : 0.f;
  r.sampling.repetition_penalty = p.has_repetition_penalty() ? p.repetition_penalty() : 1.f;
  r.sampling.frequency_penalty = p.frequency_penalty();
  r.sampling.presence_penalty = p.presence_penalty();
  for (const auto& [id, bias] : p.logit_bias()) {
    r.sampling.logit_bias.push_back({static_cast<int32_t>(id), bias});
  }
  // Map order is unspecified; sorted, the request is the same whatever the wire order.
  std::sort(r.sampling.logit_bias.begin(), r.sampling.logit_bias.end());
  r.min_new_tokens = p.min_new_tokens();
  r.logprobs = p.logprobs();
  r.top_logprobs = static_cast<int32_t>(std::min<uint32_t>(p.top_logprobs(), INT32_MAX));
  for (uint32_t id : p.logprob_token_ids()) r.logprob_token_ids.push_back(static_cast<int32_t>(id));
  r.prompt_logprobs_start =
      p.has_prompt_logprobs_start() ? static_cast<int64_t>(p.prompt_logprobs_start()) : -1;
  // 0 (unset) is one sample; above kMaxSamples ValidateRequest refuses, naming n.
  r.n = p.n() == 0 ? 1 : static_cast<int32_t>(std::min<uint32_t>(p.n(), INT32_MAX));
  return r;
}

void ToProto(const TokenLogprobs& in, v1::TokenLogprobs* out) {
  out->set_logprob(in.logprob);
  for (const auto& [id, logprob] : in.top) {
    v1::TopLogprob* top = out->add_top_logprobs();
    top->set_token_id(static_cast<uint32_t>(id));
    top->set_logprob(logprob);
  }
  out->mutable_token_ids_logprobs()->Add(in.named.begin(), in.named.end());
}

// Each scored position carries its prompt token (TokenLogprobs::token).
void ToProto(const PromptLogprobs& in, v1::PromptLogprobs* out) {
  out->set_first_position(static_cast<uint32_t>(in.first_position));
  for (const TokenLogprobs& position : in.positions) {
    out->add_token_ids(static_cast<uint32_t>(position.token));
    ToProto(position, out->add_positions());
  }
  ToProto(in.next, out->mutable_next());
}

void FillStepCounters(const AttentionCounters& c, v1::StepCounters* out) {
  out->set_steps_total(c.steps);
  out->set_empty_steps_total(c.empty_steps);
  out->set_tokens_total(c.tokens);
  out->set_next_step(c.next_step);
}

v1::FinishReason ToProto(FinishReason reason) {
  switch (reason) {
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

AttentionWorkerService::AttentionWorkerService(int dp_rank, const ModelConfig& config,
                                               Scheduler* scheduler, KvCache* kv)
    : dp_rank_(dp_rank), config_(config), scheduler_(scheduler), kv_(kv) {}

namespace {

// Longest a waiting handler or stream writer sleeps without a wake-up.
constexpr absl::Duration kWakeInterval = absl::Milliseconds(50);

// One sample's tokens on their way from the step thread to the gRPC handler thread
// (guarded by its StreamState's mu).
struct SampleStream {
  std::deque<int32_t> tokens;
  // With the request's logprobs: one per token in `tokens` (on_logprobs comes just before
  // its on_token), so they leave in the same chunk.
  std::deque<TokenLogprobs> logprobs;
  // The handler is woken once this many tokens wait (the stream interval; 1 for the
  // first token), so tokens held back for a chunk cost no wake-up each.
  size_t wake_at = 1;
  bool done = false;
  absl::Status status;
  FinishReason reason = FinishReason::kLength;
  int32_t last_token = -1;  // the sample's latest token (its stop token, at the end)
  // Handler side: tokens sent so far (the next chunk's index).
  uint32_t index = 0;

  // Whether the handler has something to send: a chunk of the interval, or what is left
  // at the sample's end.
  bool Ready() const { return tokens.size() >= wake_at || (done && !tokens.empty()); }
};

// A request's output (SamplingParams.n samples) from the step thread to the gRPC handler.
struct StreamState {
  explicit StreamState(int32_t n) : samples(static_cast<size_t>(std::max(n, 1))) {}

  absl::Mutex mu;
  absl::CondVar cv;
  // Sample i's stream; samples 1.. get theirs when the prompt's prefill ends (started).
  std::vector<SampleStream> samples ABSL_GUARDED_BY(mu);
  bool started ABSL_GUARDED_BY(mu) = false;  // sample_sink was called
  // The prompt's scores until sample 0's first chunk (or the end) takes them.
  std::optional<PromptLogprobs> prompt_logprobs ABSL_GUARDED_BY(mu);
  // The first error any sample ended with.
  absl::Status status ABSL_GUARDED_BY(mu);
  bool wrote_first_logits ABSL_GUARDED_BY(mu) = false;

  // Every sample ended: sample 0, and the others if the prefill ended (a request stopped
  // before it never starts them).
  bool Done() const ABSL_SHARED_LOCKS_REQUIRED(mu) {
    if (!samples[0].done) return false;
    if (!started) return true;
    for (const SampleStream& s : samples) {
      if (!s.done) return false;
    }
    return true;
  }
};

// The sink that feeds `state`'s sample `sample`. Sample 0's also writes the first token's
// logits to `logits_path` (when set) and holds the prompt's scores.
TokenSink StreamSink(const std::shared_ptr<StreamState>& state, int32_t sample,
                     const std::string& logits_path, int64_t vocab) {
  TokenSink sink;
  const size_t i = static_cast<size_t>(sample);
  sink.on_token = [state, i, logits_path, vocab](int32_t token, const float* logits) {
    absl::MutexLock lock(&state->mu);
    if (!logits_path.empty() && !state->wrote_first_logits) {
      std::ofstream(logits_path, std::ios::binary)
          .write(reinterpret_cast<const char*>(logits), vocab * sizeof(float));
      state->wrote_first_logits = true;
    }
    SampleStream& s = state->samples[i];
    s.tokens.push_back(token);
    s.last_token = token;
    if (s.tokens.size() >= s.wake_at) state->cv.Signal();
  };
  sink.on_logprobs = [state, i](const TokenLogprobs& logprobs) {
    absl::MutexLock lock(&state->mu);
    state->samples[i].logprobs.push_back(logprobs);
  };
  sink.on_done = [state, i](const absl::Status& status, FinishReason reason) {
    absl::MutexLock lock(&state->mu);
    SampleStream& s = state->samples[i];
    s.done = true;
    s.status = status;
    s.reason = reason;
    if (!status.ok() && state->status.ok()) state->status = status;
    state->cv.Signal();
  };
  if (sample != 0) return sink;
  // Held for the first token's chunk, which on_token signals (or on_done, with none).
  sink.on_prompt_logprobs = [state](const PromptLogprobs& logprobs) {
    absl::MutexLock lock(&state->mu);
    state->prompt_logprobs = logprobs;
  };
  sink.sample_sink = [state, vocab](int32_t s) {
    {
      absl::MutexLock lock(&state->mu);
      state->started = true;
    }
    return StreamSink(state, s, /*logits_path=*/"", vocab);
  };
  return sink;
}

// The EOS or stop id that ended a sample (its last token), for matched_stop_token_id.
std::optional<uint32_t> MatchedStop(FinishReason reason, int32_t last_token) {
  if ((reason == FinishReason::kEos || reason == FinishReason::kStopToken) && last_token >= 0) {
    return static_cast<uint32_t>(last_token);
  }
  return std::nullopt;
}

// How sample `index` ended, for GenerateComplete.samples (with n > 1).
void AddSampleComplete(uint32_t index, FinishReason reason, uint32_t completion_tokens,
                       int32_t last_token, v1::GenerateComplete* out) {
  v1::SampleComplete* c = out->add_samples();
  c->set_sample_index(index);
  c->set_finish_reason(ToProto(reason));
  c->set_completion_tokens(completion_tokens);
  if (auto stop = MatchedStop(reason, last_token)) c->set_matched_stop_token_id(*stop);
}

}  // namespace

absl::StatusOr<uint64_t> AttentionWorkerService::Start(const v1::GenerateRequest& req,
                                                       TokenSink sink) {
  if (req.request_id().empty()) {
    return absl::InvalidArgumentError("request_id: must not be empty");
  }
  if (req.has_data_parallel_rank() && static_cast<int>(req.data_parallel_rank()) != dp_rank_) {
    return absl::InvalidArgumentError(absl::StrCat("data_parallel_rank: ", req.data_parallel_rank(),
                                                   " is not this rank (", dp_rank_, ")"));
  }
  AttentionStepLoop* loop = step_loop_.load();
  if (!ready_ || loop == nullptr) {
    return absl::UnavailableError(
        "the cluster is incomplete: waiting for every attention and expert rank");
  }
  absl::StatusOr<GenerationRequest> request = FromProto(req);
  if (!request.ok()) return request.status();
  uint64_t id;
  {
    absl::MutexLock lock(&mu_);
    if (ids_.count(req.request_id())) {
      return absl::AlreadyExistsError(
          absl::StrCat("request_id: '", req.request_id(), "' is already in flight"));
    }
    id = next_id_++;
    ids_[req.request_id()] = id;
  }
  if (absl::Status s = scheduler_->Add(id, std::move(*request), std::move(sink)); !s.ok()) {
    Forget(req.request_id());
    return s;
  }
  loop->Wake();
  return id;
}

void AttentionWorkerService::Forget(const std::string& request_id) {
  absl::MutexLock lock(&mu_);
  ids_.erase(request_id);
}

grpc::Status AttentionWorkerService::Generate(grpc::ServerContext* ctx,
                                              const v1::GenerateRequest* req,
                                              grpc::ServerWriter<v1::GenerateResponse>* writer) {
  const int32_t num_samples =
      static_cast<int32_t>(std::clamp<uint32_t>(req->sampling_params().n(), 1, kMaxSamples));
  auto state = std::make_shared<StreamState>(num_samples);
  std::string logits_path;
  if (!first_logits_dir_.empty()) {
    logits_path = first_logits_dir_ + "/" + req->request_id() + ".f32";
  }
  TokenSink sink = StreamSink(state, 0, logits_path, config_.vocab_size);
  const uint32_t prompt_tokens = static_cast<uint32_t>(req->prompt_token_ids_size());
  absl::StatusOr<uint64_t> started = Start(*req, std::move(sink));
  if (!started.ok()) return ToGrpcStatus(started.status());
  const uint64_t id = *started;
  AttentionStepLoop* loop = step_loop_.load();
  auto forget = [&] { Forget(req->request_id()); };
  bool aborted_by_client = false, abort_sent = false;
  absl::Status status;
  // What the handler sends of one sample: its tokens taken in one go.
  struct Taken {
    uint32_t sample = 0;
    uint32_t index = 0;
    std::deque<int32_t> tokens;
    std::deque<TokenLogprobs> logprobs;
    std::optional<PromptLogprobs> prompt_logprobs;
  };
  std::vector<Taken> taken;
  while (true) {
    taken.clear();
    bool done;
    {
      absl::MutexLock lock(&state->mu);
      const absl::Time deadline = absl::Now() + kWakeInterval;
      auto any_ready = [&]() ABSL_SHARED_LOCKS_REQUIRED(state->mu) {
        for (const SampleStream& s : state->samples) {
          if (s.Ready()) return true;
        }
        return false;
      };
      while (!state->Done() && !any_ready()) {
        if (state->cv.WaitWithDeadline(&state->mu, deadline)) break;  // timed out
      }
      done = state->Done();
      // Chunks of the stream interval; whatever is left goes out with the end.
      for (size_t i = 0; i < state->samples.size(); ++i) {
        SampleStream& s = state->samples[i];
        const bool with_prompt = i == 0 && state->prompt_logprobs.has_value();
        if (!(done || s.Ready()) || (s.tokens.empty() && !with_prompt)) continue;
        Taken& t = taken.emplace_back();
        t.sample = static_cast<uint32_t>(i);
        t.index = s.index;
        t.tokens.swap(s.tokens);
        t.logprobs.swap(s.logprobs);
        if (i == 0) t.prompt_logprobs.swap(state->prompt_logprobs);
        s.index += static_cast<uint32_t>(t.tokens.size());
        if (!t.tokens.empty()) s.wake_at = static_cast<size_t>(stream_interval_);
      }
      if (done) status = state->status;
    }
    // The protos are built here, off the step thread.
    for (const Taken& t : taken) {
      if (aborted_by_client) break;
      v1::GenerateResponse resp;
      resp.set_request_id(req->request_id());
      v1::TokenChunk* chunk = resp.mutable_chunk();
      chunk->set_index(t.index);
      for (int32_t token : t.tokens) chunk->add_token_ids(static_cast<uint32_t>(token));
      for (const TokenLogprobs& lp : t.logprobs) ToProto(lp, chunk->add_logprobs());
      if (t.prompt_logprobs) ToProto(*t.prompt_logprobs, chunk->mutable_prompt_logprobs());
      chunk->set_sample_index(t.sample);
      if (!writer->Write(resp)) aborted_by_client = true;
    }
    if (done) break;
    if (!abort_sent && (aborted_by_client || ctx->IsCancelled())) {
      aborted_by_client = true;
      abort_sent = true;
      scheduler_->Abort(id);  // every sample's on_done follows at the next step boundary
      loop->Wake();
    }
  }
  forget();
  if (ctx->IsCancelled()) {
    const bool deadline_passed = ctx->deadline() < std::chrono::system_clock::now();
    return deadline_passed ? grpc::Status(grpc::StatusCode::DEADLINE_EXCEEDED,
                                          "deadline passed; the request was stopped")
                           : grpc::Status::CANCELLED;
  }
  if (!status.ok()) return ToGrpcStatus(status);
  v1::GenerateResponse final_msg;
  final_msg.set_request_id(req->request_id());
  v1::GenerateComplete* c = final_msg.mutable_complete();
  {
    // Done: the step thread touches the state no more.
    absl::MutexLock lock(&state->mu);
    const SampleStream& first = state->samples[0];
    c->set_finish_reason(ToProto(first.reason));
    c->set_prompt_tokens(prompt_tokens);
    c->set_completion_tokens(first.index);
    if (auto stop = MatchedStop(first.reason, first.last_token))
      c->set_matched_stop_token_id(*stop);
    c->set_data_parallel_rank(static_cast<uint32_t>(dp_rank_));
    for (size_t i = 1; i < state->samples.size(); ++i) {
      const SampleStream& s = state->samples[i];
      // Samples never started (stopped before the prefill ended) end as sample 0 did.
      AddSampleComplete(static_cast<uint32_t>(i), state->started ? s.reason : first.reason, s.index,
                        s.last_token, c);
    }
  }
  // With the status: one write less per request.
  writer->WriteLast(final_msg, grpc::WriteOptions());
  return grpc::Status::OK;
}

absl::Status AttentionWorkerService::AbortById(const std::string& request_id) {
  if (request_id.empty()) return absl::InvalidArgumentError("request_id: must not be empty");
  uint64_t id;
  {
    absl::MutexLock lock(&mu_);
    auto it = ids_.find(request_id);
    if (it == ids_.end()) {
      return absl::NotFoundError(
          absl::StrCat("request_id: '", request_id, "' is not in flight on this rank"));
    }
    id = it->second;
  }
  scheduler_->Abort(id);
  if (AttentionStepLoop* loop = step_loop_.load()) loop->Wake();
  return absl::OkStatus();
}

grpc::Status AttentionWorkerService::Abort(grpc::ServerContext*, const v1::AbortRequest* req,
                                           v1::AbortResponse*) {
  return ToGrpcStatus(AbortById(req->request_id()));
}

// One Serve stream's events on their way out. Sinks (step thread) and the reader thread
// append; the writer thread sends.
struct AttentionWorkerService::ServeOutbox {
  absl::Mutex mu;
  absl::CondVar cv;
  v1::ServeEvents pending ABSL_GUARDED_BY(mu);
  bool flush ABSL_GUARDED_BY(mu) = false;          // send what is pending now
  bool closed ABSL_GUARDED_BY(mu) = false;         // the stream ended; the writer stops
  bool broken ABSL_GUARDED_BY(mu) = false;         // a write failed; events are dropped
  std::set<uint64_t> running ABSL_GUARDED_BY(mu);  // scheduler ids started here, not done

  // Appends `event`; with `now`, wakes the writer at once instead of at the step's end.
  void Push(v1::ServeEvent event, bool now) ABSL_LOCKS_EXCLUDED(mu) {
    absl::MutexLock lock(&mu);
    if (broken) return;
    *pending.add_events() = std::move(event);
    if (now) {
      flush = true;
      cv.Signal();
    }
  }
};

namespace {

// One sample's output state in a Serve request; touched by the step thread only (its
// sinks).
struct ServeSampleState {
  std::vector<uint32_t> held;  // tokens not sent yet (waiting for a chunk of the interval)
  // With the request's logprobs: one per held token (on_logprobs comes just before its
  // on_token), sent in the same chunk.
  std::vector<TokenLogprobs> held_logprobs;
  uint32_t index = 0;  // tokens sent so far
  size_t send_at = 1;  // held tokens that make a chunk (1 for the first token)
  bool done = false;   // its on_done ran
  FinishReason reason = FinishReason::kLength;
  int32_t last_token = -1;  // its latest token (its stop token, at the end)
};

// One Serve request's output state (SamplingParams.n samples); touched by the step thread
// only (its sinks).
struct ServeRequestState {
  explicit ServeRequestState(int32_t n) : samples(static_cast<size_t>(std::max(n, 1))) {}

  std::vector<ServeSampleState> samples;
  bool started = false;  // sample_sink was called: the prompt's prefill ended
  // The prompt's scores until sample 0's first chunk (or the end) takes them.
  std::optional<PromptLogprobs> prompt_logprobs;
  absl::Status status;  // the first error any sample ended with
  bool wrote_first_logits = false;
  bool done = false;  // guarded by the outbox's mu: every sample ended

  // Every sample ended: sample 0, and the others if the prefill ended (a request stopped
  // before it never starts them).
  bool AllDone() const {
    if (!samples[0].done) return false;
    if (!started) return true;
    for (const ServeSampleState& s : samples) {
      if (!s.done) return false;
    }
    return true;
  }
};

// Sample `sample`'s held tokens (and sample 0's held prompt scores) as one chunk.
v1::ServeEvent ChunkEvent(const std::string& request_id, ServeRequestState& state, size_t sample) {
  ServeSampleState& s = state.samples[sample];
  v1::ServeEvent e;
  e.set_request_id(request_id);
  v1::TokenChunk* chunk = e.mutable_chunk();
  chunk->set_index(s.index);
  chunk->set_sample_index(static_cast<uint32_t>(sample));
  chunk->mutable_token_ids()->Add(s.held.begin(), s.held.end());
  for (const TokenLogprobs& lp : s.held_logprobs) ToProto(lp, chunk->add_logprobs());
  if (sample == 0 && state.prompt_logprobs) {
    ToProto(*state.prompt_logprobs, chunk->mutable_prompt_logprobs());
    state.prompt_logprobs.reset();
  }
  s.index += static_cast<uint32_t>(s.held.size());
  s.held.clear();
  s.held_logprobs.clear();
  return e;
}

v1::ServeEvent ErrorEvent(const std::string& request_id, const absl::Status& status) {
  v1::ServeEvent e;
  e.set_request_id(request_id);
  e.mutable_error()->set_code(static_cast<int32_t>(status.code()));
  e.mutable_error()->set_message(std::string(status.message()));
  return e;
}

}  // namespace

absl::Status AttentionWorkerService::Submit(const v1::GenerateRequest& req,
                                            const std::shared_ptr<ServeOutbox>& outbox) {
  const int32_t num_samples =
      static_cast<int32_t>(std::clamp<uint32_t>(req.sampling_params().n(), 1, kMaxSamples));
  auto state = std::make_shared<ServeRequestState>(num_samples);
  auto scheduler_id = std::make_shared<uint64_t>(0);
  std::string logits_path;
  if (!first_logits_dir_.empty()) {
    logits_path = first_logits_dir_ + "/" + req.request_id() + ".f32";
  }
  const int64_t vocab = config_.vocab_size;
  const size_t interval = static_cast<size_t>(stream_interval_);
  const std::string request_id = req.request_id();
  const uint32_t prompt_tokens = static_cast<uint32_t>(req.prompt_token_ids_size());
  // The sink of sample `sample` (sample 0's is the request's).
  auto make_sink = [this, state, outbox, scheduler_id, logits_path, vocab, interval, request_id,
                    prompt_tokens](int32_t sample) {
    const size_t i = static_cast<size_t>(sample);
    TokenSink sink;
    sink.on_logprobs = [state, i](const TokenLogprobs& logprobs) {
      state->samples[i].held_logprobs.push_back(logprobs);
    };
    sink.on_token = [state, outbox, request_id, logits_path, vocab, interval, i](
                        int32_t token, const float* logits) {
      if (i == 0 && !logits_path.empty() && !state->wrote_first_logits) {
        std::ofstream(logits_path, std::ios::binary)
            .write(reinterpret_cast<const char*>(logits), vocab * sizeof(float));
        state->wrote_first_logits = true;
      }
      ServeSampleState& s = state->samples[i];
      s.held.push_back(static_cast<uint32_t>(token));
      s.last_token = token;
      if (s.held.size() >= s.send_at) {
        outbox->Push(ChunkEvent(request_id, *state, i), /*now=*/false);
        s.send_at = interval;
      }
    };
    sink.on_done = [this, state, outbox, request_id, prompt_tokens, scheduler_id, i](
                       const absl::Status& status, FinishReason reason) {
      ServeSampleState& s = state->samples[i];
      if (!s.held.empty() || (i == 0 && state->prompt_logprobs)) {
        outbox->Push(ChunkEvent(request_id, *state, i), false);
      }
      s.done = true;
      s.reason = reason;
      if (!status.ok() && state->status.ok()) state->status = status;
      if (!state->AllDone()) return;
      // Forgotten before the router can see the end, so it may reuse the id at once.
      Forget(request_id);
      if (state->status.ok()) {
        const ServeSampleState& first = state->samples[0];
        v1::ServeEvent e;
        e.set_request_id(request_id);
        v1::GenerateComplete* c = e.mutable_complete();
        c->set_finish_reason(ToProto(first.reason));
        c->set_prompt_tokens(prompt_tokens);
        c->set_completion_tokens(first.index);
        if (auto stop = MatchedStop(first.reason, first.last_token)) {
          c->set_matched_stop_token_id(*stop);
        }
        c->set_data_parallel_rank(static_cast<uint32_t>(dp_rank_));
        for (size_t k = 1; k < state->samples.size(); ++k) {
          const ServeSampleState& other = state->samples[k];
          // Samples never started (stopped before the prefill ended) end as sample 0 did.
          AddSampleComplete(static_cast<uint32_t>(k), state->started ? other.reason : first.reason,
                            other.index, other.last_token, c);
        }
        outbox->Push(std::move(e), false);
      } else {
        outbox->Push(ErrorEvent(request_id, state->status), false);
      }
      absl::MutexLock lock(&outbox->mu);
      state->done = true;
      outbox->running.erase(*scheduler_id);
    };
    return sink;
  };
  TokenSink sink = make_sink(0);
  // Held for the first token's chunk (or the end's, with none).
  sink.on_prompt_logprobs = [state](const PromptLogprobs& logprobs) {
    state->prompt_logprobs = logprobs;
  };
  sink.sample_sink = [state, make_sink](int32_t sample) {
    state->started = true;
    return make_sink(sample);
  };
  absl::StatusOr<uint64_t> started = Start(req, std::move(sink));
  if (!started.ok()) return started.status();
  // The step thread may have finished the request already (on_done marks it under the
  // same lock), so the id is recorded only if it is still running.
  absl::MutexLock lock(&outbox->mu);
  *scheduler_id = *started;
  if (!state->done) outbox->running.insert(*started);
  return absl::OkStatus();
}

grpc::Status AttentionWorkerService::Serve(
    grpc::ServerContext* ctx, grpc::ServerReaderWriter<v1::ServeEvents, v1::ServeRequest>* stream) {
  // The router waits for this answer before it sends requests on the stream.
  ctx->AddInitialMetadata(kServeAcceptedMetadataKey, "1");
  stream->SendInitialMetadata();
  auto outbox = std::make_shared<ServeOutbox>();
  {
    absl::MutexLock lock(&mu_);
    outboxes_.push_back(outbox);
  }
  std::thread writer([outbox, stream] {
    absl::MutexLock lock(&outbox->mu);
    while (true) {
      // The step's end wakes it; the timeout sends what arrived outside a step (a failure
      // at shutdown).
      const absl::Time deadline = absl::Now() + kWakeInterval;
      while (!outbox->flush && !outbox->closed) {
        if (outbox->cv.WaitWithDeadline(&outbox->mu, deadline)) break;  // timed out
      }
      const bool closing = outbox->closed;
      outbox->flush = false;
      if (outbox->pending.events_size() > 0) {
        v1::ServeEvents message;
        message.Swap(&outbox->pending);
        outbox->mu.Unlock();  // not held across the write
        const bool sent = stream->Write(message);
        outbox->mu.Lock();
        if (!sent) {
          outbox->broken = true;
          outbox->pending.Clear();
        }
      }
      if (closing) return;
    }
  });
  v1::ServeRequest request;
  while (stream->Read(&request)) {
    if (request.has_submit()) {
      if (absl::Status s = Submit(request.submit(), outbox); !s.ok()) {
        outbox->Push(ErrorEvent(request.submit().request_id(), s), /*now=*/true);
      }
    } else if (request.has_abort()) {
      (void)AbortById(request.abort().request_id());  // unknown: it ended already
    }
  }
  // The router went away: stop what it started here, which frees their KV.
  std::vector<uint64_t> running;
  {
    absl::MutexLock lock(&outbox->mu);
    running.assign(outbox->running.begin(), outbox->running.end());
  }
  for (uint64_t id : running) scheduler_->Abort(id);
  if (!running.empty()) {
    if (AttentionStepLoop* loop = step_loop_.load()) loop->Wake();
  }
  {
    absl::MutexLock lock(&outbox->mu);
    outbox->closed = true;
    outbox->cv.Signal();
  }
  writer.join();
  {
    absl::MutexLock lock(&mu_);
    outboxes_.erase(std::find(outboxes_.begin(), outboxes_.end(), outbox));
  }
  return grpc::Status::OK;
}

void AttentionWorkerService::FlushStreams() {
  absl::MutexLock lock(&mu_);
  for (const std::shared_ptr<ServeOutbox>& outbox : outboxes_) {
    absl::MutexLock outbox_lock(&outbox->mu);
    if (outbox->pending.events_size() == 0) continue;
    outbox->flush = true;
    outbox->cv.Signal();
  }
}

v1::RankLoad AttentionWorkerService::Load() {
  v1::RankLoad load;
  load.set_rank(static_cast<uint32_t>(dp_rank_));
  load.set_num_running_requests(static_cast<uint32_t>(scheduler_->num_running()));
  load.set_num_queued_requests(static_cast<uint32_t>(scheduler_->num_queued()));
  load.set_kv_cache_used_tokens(static_cast<uint64_t>(kv_->reserved_tokens()));
  load.set_kv_cache_total_tokens(static_cast<uint64_t>(kv_->capacity_tokens()));
  load.set_state(ready_ ? v1::WORKER_STATE_READY : v1::WORKER_STATE_JOINING);
  return load;
}

grpc::Status AttentionWorkerService::GetLoad(grpc::ServerContext*, const v1::GetLoadRequest*,
                                             v1::GetLoadResponse* resp) {
  *resp->mutable_load() = Load();
  return grpc::Status::OK;
}

grpc::Status AttentionWorkerService::Wake(grpc::ServerContext*, const v1::WakeRequest*,
                                          v1::WakeResponse* resp) {
  AttentionStepLoop* loop = step_loop_.load();
  if (!ready_ || loop == nullptr) {
    return ToGrpcStatus(absl::UnavailableError("not ready"));
  }
  loop->Wake();
  resp->set_next_step(loop->counters().next_step.load());
  return grpc::Status::OK;
}

}  // namespace dxs
