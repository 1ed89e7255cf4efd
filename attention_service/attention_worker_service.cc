#include "attention_service/attention_worker_service.h"

#include <condition_variable>
#include <deque>
#include <fstream>
#include <random>

#include "absl/strings/str_cat.h"
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
  return r;
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

// Tokens from the step thread to the gRPC handler thread.
struct StreamState {
  std::mutex mu;
  std::condition_variable cv;
  std::deque<int32_t> tokens;
  // The handler is woken once this many tokens wait (the stream interval; 1 for the
  // first token), so tokens held back for a chunk cost no wake-up each.
  size_t wake_at = 1;
  bool done = false;
  absl::Status status;
  FinishReason reason = FinishReason::kLength;
  bool wrote_first_logits = false;
};

}  // namespace

grpc::Status AttentionWorkerService::Generate(grpc::ServerContext* ctx,
                                              const v1::GenerateRequest* req,
                                              grpc::ServerWriter<v1::GenerateResponse>* writer) {
  if (req->request_id().empty()) {
    return ToGrpcStatus(absl::InvalidArgumentError("request_id: must not be empty"));
  }
  if (req->has_data_parallel_rank() && static_cast<int>(req->data_parallel_rank()) != dp_rank_) {
    return ToGrpcStatus(absl::InvalidArgumentError(absl::StrCat(
        "data_parallel_rank: ", req->data_parallel_rank(), " is not this rank (", dp_rank_, ")")));
  }
  AttentionStepLoop* loop = step_loop_.load();
  if (!ready_ || loop == nullptr) {
    return ToGrpcStatus(absl::UnavailableError(
        "the cluster is incomplete: waiting for every attention and expert rank"));
  }
  absl::StatusOr<GenerationRequest> request = FromProto(*req);
  if (!request.ok()) return ToGrpcStatus(request.status());
  uint64_t id;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (ids_.count(req->request_id())) {
      return ToGrpcStatus(absl::AlreadyExistsError(
          absl::StrCat("request_id: '", req->request_id(), "' is already in flight")));
    }
    id = next_id_++;
    ids_[req->request_id()] = id;
  }
  auto forget = [&] {
    std::lock_guard<std::mutex> lock(mu_);
    ids_.erase(req->request_id());
  };
  auto state = std::make_shared<StreamState>();
  TokenSink sink;
  std::string logits_path;
  if (!first_logits_dir_.empty()) {
    logits_path = first_logits_dir_ + "/" + req->request_id() + ".f32";
  }
  const int64_t vocab = config_.vocab_size;
  sink.on_token = [state, logits_path, vocab](int32_t token, const float* logits) {
    std::lock_guard<std::mutex> lock(state->mu);
    if (!logits_path.empty() && !state->wrote_first_logits) {
      std::ofstream(logits_path, std::ios::binary)
          .write(reinterpret_cast<const char*>(logits), vocab * sizeof(float));
      state->wrote_first_logits = true;
    }
    state->tokens.push_back(token);
    if (state->tokens.size() >= state->wake_at) state->cv.notify_one();
  };
  sink.on_done = [state](const absl::Status& s, FinishReason reason) {
    std::lock_guard<std::mutex> lock(state->mu);
    state->done = true;
    state->status = s;
    state->reason = reason;
    state->cv.notify_one();
  };
  const uint32_t prompt_tokens = static_cast<uint32_t>(request->prompt.size());
  if (absl::Status s = scheduler_->Add(id, std::move(*request), std::move(sink)); !s.ok()) {
    forget();
    return ToGrpcStatus(s);
  }
  loop->Wake();
  uint32_t index = 0;
  bool aborted_by_client = false, abort_sent = false;
  while (true) {
    std::deque<int32_t> tokens;
    bool done;
    {
      std::unique_lock<std::mutex> lock(state->mu);
      state->cv.wait_for(lock, std::chrono::milliseconds(50),
                         [&] { return state->done || state->tokens.size() >= state->wake_at; });
      done = state->done;
      // Chunks of the stream interval; whatever is left goes out with the end.
      if (done || state->tokens.size() >= state->wake_at) tokens.swap(state->tokens);
      if (!tokens.empty()) state->wake_at = static_cast<size_t>(stream_interval_);
    }
    if (!tokens.empty() && !aborted_by_client) {
      v1::GenerateResponse resp;
      resp.set_request_id(req->request_id());
      resp.mutable_chunk()->set_index(index);
      for (int32_t t : tokens) resp.mutable_chunk()->add_token_ids(static_cast<uint32_t>(t));
      index += static_cast<uint32_t>(tokens.size());
      if (!writer->Write(resp)) aborted_by_client = true;
    }
    if (done) break;
    if (!abort_sent && (aborted_by_client || ctx->IsCancelled())) {
      aborted_by_client = true;
      abort_sent = true;
      scheduler_->Abort(id);  // on_done follows at the next step boundary
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
  if (!state->status.ok()) return ToGrpcStatus(state->status);
  v1::GenerateResponse final_msg;
  final_msg.set_request_id(req->request_id());
  v1::GenerateComplete* c = final_msg.mutable_complete();
  c->set_finish_reason(ToProto(state->reason));
  c->set_prompt_tokens(prompt_tokens);
  c->set_completion_tokens(index);
  c->set_data_parallel_rank(static_cast<uint32_t>(dp_rank_));
  // With the status: one write less per request.
  writer->WriteLast(final_msg, grpc::WriteOptions());
  return grpc::Status::OK;
}

grpc::Status AttentionWorkerService::Abort(grpc::ServerContext*, const v1::AbortRequest* req,
                                           v1::AbortResponse*) {
  if (req->request_id().empty()) {
    return ToGrpcStatus(absl::InvalidArgumentError("request_id: must not be empty"));
  }
  uint64_t id;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = ids_.find(req->request_id());
    if (it == ids_.end()) {
      return ToGrpcStatus(absl::NotFoundError(
          absl::StrCat("request_id: '", req->request_id(), "' is not in flight on this rank")));
    }
    id = it->second;
  }
  scheduler_->Abort(id);
  if (AttentionStepLoop* loop = step_loop_.load()) loop->Wake();
  return grpc::Status::OK;
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
