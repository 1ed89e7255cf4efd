// AttentionWorkerService: dxs.v1.AttentionWorker over a Scheduler and its step loop.
//
// Generate streams each token as the step thread produces it (one TokenChunk per step),
// then a GenerateComplete. With a stream interval N > 1 (SGLang's and vLLM's
// --stream-interval), the first token still goes out at once and later ones in chunks of
// N: fewer messages through the worker, the router and the client, for throughput under
// load at the cost of smoothness. A token's log-probabilities, when the request asks for
// them, travel in its chunk; the prompt's scores in the first token's chunk (or, for a
// request that only scores its prompt, in a chunk of their own). A cancelled call or a
// passed deadline aborts the request, which frees its KV at the next step boundary. Errors
// become gRPC statuses only here.
//
// Serve multiplexes many requests over one bidi stream (the router keeps one per rank):
// the handler thread reads submits and aborts; token sinks (step thread) append events to
// the stream's outbox, and FlushStreams, run at the end of each step, wakes the stream's
// writer thread, which sends everything pending as one ServeEvents message. So a step
// costs one message and one thread wake-up per stream, however many requests it served.
// When the stream ends, every request still running from it is aborted.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "attention_service/attention_step_loop.h"
#include "common/model_config.h"
#include "dxs/v1/attention_worker.grpc.pb.h"
#include "model/kv_cache.h"
#include "model/scheduler.h"

namespace dxs {

class AttentionWorkerService final : public v1::AttentionWorker::Service {
 public:
  AttentionWorkerService(int dp_rank, const ModelConfig& config, Scheduler* scheduler, KvCache* kv);

  // Set once the step loop exists; until then and while `ready` is false, Generate is
  // UNAVAILABLE.
  void set_step_loop(AttentionStepLoop* loop) { step_loop_ = loop; }
  AttentionStepLoop* step_loop() const { return step_loop_.load(); }
  void set_ready(bool ready) { ready_ = ready; }
  bool ready() const { return ready_; }
  // Debugging aid (dxs-attention --dump-first-logits DIR): writes each request's logits at
  // its first generated position to DIR/<request_id>.f32 (raw little-endian float32), so
  // tests and operators can compare a cluster with the single-process engine.
  void set_first_logits_dir(std::string dir) { first_logits_dir_ = std::move(dir); }
  // Tokens per streamed chunk after the first (>= 1; 1, the default, streams every token).
  // Set before serving.
  void set_stream_interval(int n) { stream_interval_ = n < 1 ? 1 : n; }

  grpc::Status Generate(grpc::ServerContext* ctx, const v1::GenerateRequest* req,
                        grpc::ServerWriter<v1::GenerateResponse>* writer) override;
  grpc::Status Serve(grpc::ServerContext* ctx,
                     grpc::ServerReaderWriter<v1::ServeEvents, v1::ServeRequest>* stream) override;
  grpc::Status Abort(grpc::ServerContext* ctx, const v1::AbortRequest* req,
                     v1::AbortResponse* resp) override;
  grpc::Status GetLoad(grpc::ServerContext* ctx, const v1::GetLoadRequest* req,
                       v1::GetLoadResponse* resp) override;
  grpc::Status Wake(grpc::ServerContext* ctx, const v1::WakeRequest* req,
                    v1::WakeResponse* resp) override;

  v1::RankLoad Load();
  // Sends what the step produced on every Serve stream (one message each). Called by the
  // step thread at the end of each step (AttentionStepLoop::set_on_step_end).
  void FlushStreams() ABSL_LOCKS_EXCLUDED(mu_);

 private:
  struct ServeOutbox;
  // Checks and queues a request (the checks Generate and Serve share): INVALID_ARGUMENT,
  // UNAVAILABLE (not ready), ALREADY_EXISTS (id in flight), and the scheduler's errors.
  // On success the id stays in ids_ until the caller's forget (Generate) or the sink's
  // on_done (Serve) removes it. Returns the scheduler id.
  absl::StatusOr<uint64_t> Start(const v1::GenerateRequest& req, TokenSink sink)
      ABSL_LOCKS_EXCLUDED(mu_);
  // Serve: a submit from `outbox`'s stream.
  absl::Status Submit(const v1::GenerateRequest& req, const std::shared_ptr<ServeOutbox>& outbox)
      ABSL_LOCKS_EXCLUDED(mu_);
  // Aborts `request_id`; NOT_FOUND if not in flight.
  absl::Status AbortById(const std::string& request_id) ABSL_LOCKS_EXCLUDED(mu_);
  void Forget(const std::string& request_id) ABSL_LOCKS_EXCLUDED(mu_);

  int dp_rank_;
  ModelConfig config_;
  Scheduler* scheduler_;
  KvCache* kv_;
  std::string first_logits_dir_;
  int stream_interval_ = 1;
  std::atomic<AttentionStepLoop*> step_loop_{nullptr};
  std::atomic<bool> ready_{false};
  // Taken before a ServeOutbox's mu (FlushStreams), never after.
  absl::Mutex mu_;
  std::map<std::string, uint64_t> ids_ ABSL_GUARDED_BY(mu_);  // request id -> scheduler id
  uint64_t next_id_ ABSL_GUARDED_BY(mu_) = 1;
  std::vector<std::shared_ptr<ServeOutbox>> outboxes_ ABSL_GUARDED_BY(mu_);  // open Serve streams
};

// The counters a DP rank reports in heartbeats.
void FillStepCounters(const AttentionCounters& c, v1::StepCounters* out);

// Proto request -> engine request (defaults for unset fields). INVALID_ARGUMENT on bad
// values that the proto types allow but the engine would misread.
absl::StatusOr<GenerationRequest> FromProto(const v1::GenerateRequest& req);
v1::FinishReason ToProto(FinishReason reason);
// Engine log-probabilities -> their TokenChunk form.
void ToProto(const TokenLogprobs& in, v1::TokenLogprobs* out);
void ToProto(const PromptLogprobs& in, v1::PromptLogprobs* out);

}  // namespace dxs
