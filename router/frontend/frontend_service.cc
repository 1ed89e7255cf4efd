#include "router/frontend/frontend_service.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <memory>
#include <optional>
#include <utility>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/synchronization/blocking_counter.h"
#include "common/grpc/status_conversion.h"
#include "grpcpp/client_context.h"

namespace dxs {
namespace {

std::chrono::system_clock::time_point DeadlineAfter(absl::Duration d) {
  return std::chrono::system_clock::now() + std::chrono::microseconds(absl::ToInt64Microseconds(d));
}

bool IsLive(v1::WorkerState state) {
  return state == v1::WORKER_STATE_JOINING || state == v1::WORKER_STATE_READY ||
         state == v1::WORKER_STATE_DRAINING;
}

uint64_t SinceNs(absl::Time start, absl::Time end) {
  return static_cast<uint64_t>(absl::ToInt64Nanoseconds(end - start));
}

// "UNAVAILABLE: the cluster is incomplete: ..." listing what is missing.
std::string IncompleteMessage(const v1::ClusterView& view) {
  int attention = 0, expert = 0;
  for (const v1::WorkerInfo& w : view.workers()) {
    if (!IsLive(w.state())) continue;
    (w.role() == v1::ROLE_ATTENTION ? attention : expert) += 1;
  }
  return absl::StrCat("the cluster is incomplete: ", attention, " of ", view.num_attention_ranks(),
                      " attention and ", expert, " of ", view.num_expert_ranks(),
                      " expert ranks are live (or some experts have no rank); retry later");
}

}  // namespace

FrontendService::FrontendService(ClusterRegistry* registry, const ModelConfig& config,
                                 v1::ModelInfo model_info, FrontendOptions options)
    : registry_(registry),
      model_info_(std::move(model_info)),
      limits_{config.vocab_size, config.max_position_embeddings,
              registry->options().num_attention_ranks},
      options_(options),
      inflight_(registry->options().num_attention_ranks, options.max_inflight),
      stubs_(registry->options().num_attention_ranks, options.worker_credentials),
      streams_(registry->options().num_attention_ranks),
      random_(std::random_device{}()) {}

std::string FrontendService::NewRequestId() {
  uint32_t salt;
  {
    absl::MutexLock lock(&random_mu_);
    salt = static_cast<uint32_t>(random_());
  }
  return absl::StrFormat("r-%d-%08x", next_request_number_.fetch_add(1), salt);
}

std::vector<FrontendService::RankTarget> FrontendService::Targets(
    const v1::ClusterView& view) const {
  std::vector<RankTarget> targets(static_cast<size_t>(limits_.num_attention_ranks));
  for (RankTarget& t : targets) t.candidate.why_not = "not registered";
  for (const v1::WorkerInfo& w : view.workers()) {
    if (w.role() != v1::ROLE_ATTENTION || w.rank() >= targets.size()) continue;
    RankTarget& t = targets[w.rank()];
    t.address = w.grpc_address();
    if (IsLive(w.state())) t.candidate.incarnation = w.incarnation();
    // DRAINING ranks finish their requests but take no new ones.
    t.candidate.eligible =
        w.state() == v1::WORKER_STATE_JOINING || w.state() == v1::WORKER_STATE_READY;
    // Unpinned requests prefer READY ranks (RankCandidate::ready).
    t.candidate.ready = w.state() == v1::WORKER_STATE_READY;
    t.candidate.why_not = absl::StrCat("state ", v1::WorkerState_Name(w.state()));
  }
  return targets;
}

void FrontendService::OnClusterView(const v1::ClusterView& view) {
  std::vector<uint64_t> live(static_cast<size_t>(limits_.num_attention_ranks), 0);
  const std::vector<RankTarget> targets = Targets(view);
  for (size_t r = 0; r < targets.size(); ++r) live[r] = targets[r].candidate.incarnation;
  const int stopped = inflight_.StopLostRanks(live);
  streams_.CloseStale(live);
  if (stopped > 0) {
    std::fprintf(stderr,
                 "dxs-router: frontend: %d in-flight requests failed: their attention rank's "
                 "worker is gone (view %llu)\n",
                 stopped, static_cast<unsigned long long>(view.version()));
  }
}

void FrontendService::Shutdown() {
  shutting_down_ = true;
  inflight_.StopAll(StopReason::kShutdown);
  streams_.CloseAll();
}

// Forwards one request's messages to its caller, whichever way they come from the worker,
// and keeps its latency metrics and the tracker's token counts.
struct FrontendService::Relay {
  const std::string& id;
  const int rank;
  const absl::Time arrival;
  GenerateResponseWriter* const writer;
  FrontendMetrics* const metrics;
  InflightTracker* const inflight;
  // Tokens relayed per sample (SamplingParams.n; one entry with n = 1).
  std::vector<uint32_t> completion_tokens;
  bool got_complete = false;
  bool caller_gone = false;
  std::optional<absl::Time> first_token_at;
  absl::Time last_token_at;

  // Sends `message` on (the `complete` with the router's timings, as the last message).
  // False once the caller has gone away.
  bool Forward(v1::GenerateResponse& message) {
    int num_new_tokens = 0;
    if (message.has_chunk()) {
      num_new_tokens = message.chunk().token_ids_size();
    } else if (message.has_complete()) {
      got_complete = true;
      const absl::Time now = absl::Now();
      v1::GenerateTimings* timings = message.mutable_complete()->mutable_timings();
      if (first_token_at) timings->set_time_to_first_token_ns(SinceNs(arrival, *first_token_at));
      timings->set_e2e_latency_ns(SinceNs(arrival, now));
    }
    if (!caller_gone && message.has_complete()) {
      // The final message goes out with the status: one write less per request.
      writer->WriteLast(message);
    } else if (!caller_gone && !writer->Write(message)) {
      caller_gone = true;
    }
    if (num_new_tokens > 0) {
      const absl::Time now = absl::Now();
      if (metrics != nullptr) {
        if (!first_token_at) {
          metrics->ObserveTimeToFirstToken(absl::ToDoubleSeconds(now - arrival));
        } else {
          metrics->ObserveInterToken(absl::ToDoubleSeconds(now - last_token_at), num_new_tokens);
        }
      }
      last_token_at = now;
      if (!first_token_at) first_token_at = now;
      const uint32_t sample = message.chunk().sample_index();
      if (sample < completion_tokens.size()) {
        completion_tokens[sample] += static_cast<uint32_t>(num_new_tokens);
      }
      inflight->RecordTokens(id, num_new_tokens, now);
    }
    return !caller_gone;
  }

  // The caller cancelled or its deadline passed.
  absl::Status CallerStopped(grpc::ServerContext* context) const {
    if (context->deadline() < std::chrono::system_clock::now()) {
      return absl::DeadlineExceededError("deadline passed; the request was stopped");
    }
    return absl::CancelledError("the caller cancelled; the request was stopped");
  }

  // The end of a request that the router stopped (`reason`), when the worker did not
  // complete it: nullopt for kNone.
  std::optional<absl::Status> RouterStopped(StopReason reason, const v1::GenerateRequest& request,
                                            const std::string& address) {
    switch (reason) {
      case StopReason::kAbort: {
        // Aborted before the worker knew the request: end the stream as the worker would.
        v1::GenerateResponse last;
        last.set_request_id(id);
        v1::GenerateComplete* complete = last.mutable_complete();
        complete->set_finish_reason(v1::FINISH_REASON_ABORTED);
        complete->set_prompt_tokens(static_cast<uint32_t>(request.prompt_token_ids_size()));
        complete->set_completion_tokens(completion_tokens[0]);
        complete->set_data_parallel_rank(static_cast<uint32_t>(rank));
        for (size_t i = 1; i < completion_tokens.size(); ++i) {
          v1::SampleComplete* sample = complete->add_samples();
          sample->set_sample_index(static_cast<uint32_t>(i));
          sample->set_finish_reason(v1::FINISH_REASON_ABORTED);
          sample->set_completion_tokens(completion_tokens[i]);
        }
        if (first_token_at) {
          complete->mutable_timings()->set_time_to_first_token_ns(
              SinceNs(arrival, *first_token_at));
        }
        complete->mutable_timings()->set_e2e_latency_ns(SinceNs(arrival, absl::Now()));
        writer->WriteLast(last);
        return absl::OkStatus();
      }
      case StopReason::kRankLost:
        return absl::UnavailableError(
            absl::StrCat("attention rank ", rank, " (", address,
                         ") was lost mid-request: its worker died or was replaced; safe to retry"));
      case StopReason::kShutdown:
        return absl::UnavailableError("the router is shutting down");
      case StopReason::kNone:
        break;
    }
    return std::nullopt;
  }
};

namespace {

// dxs.v1's own caller: the messages go out as they are.
class ServerStreamWriter final : public GenerateResponseWriter {
 public:
  explicit ServerStreamWriter(grpc::ServerWriter<v1::GenerateResponse>* writer) : writer_(writer) {}
  bool Write(v1::GenerateResponse& message) override { return writer_->Write(message); }
  // The final message goes out with the status: one write less per request.
  void WriteLast(v1::GenerateResponse& message) override {
    writer_->WriteLast(message, grpc::WriteOptions());
  }

 private:
  grpc::ServerWriter<v1::GenerateResponse>* const writer_;
};

}  // namespace

grpc::Status FrontendService::Generate(grpc::ServerContext* context,
                                       const v1::GenerateRequest* request,
                                       grpc::ServerWriter<v1::GenerateResponse>* writer) {
  ServerStreamWriter stream(writer);
  return ToGrpcStatus(ServeGenerate(context, *request, stream));
}

absl::Status FrontendService::ServeGenerate(grpc::ServerContext* context,
                                            v1::GenerateRequest request,
                                            GenerateResponseWriter& writer) {
  const absl::Status status = GenerateImpl(context, std::move(request), writer);
  if (options_.metrics != nullptr) options_.metrics->OnRequestDone(status.code());
  return status;
}

absl::Status FrontendService::GenerateImpl(grpc::ServerContext* context,
                                           v1::GenerateRequest request,
                                           GenerateResponseWriter& writer) {
  const absl::Time arrival = absl::Now();
  if (shutting_down_) return absl::UnavailableError("the router is shutting down");
  if (absl::Status s = ValidateGenerateRequest(request, limits_); !s.ok()) return s;
  const v1::ClusterView view = registry_->View();
  if (!registry_->IsComplete()) return absl::UnavailableError(IncompleteMessage(view));

  const std::vector<RankTarget> targets = Targets(view);
  std::vector<RankCandidate> candidates;
  for (const RankTarget& t : targets) candidates.push_back(t.candidate);
  // What the request may come to owe: its prompt once (its samples share the prompt's KV)
  // and max_new_tokens per sample.
  const int64_t num_samples = std::max<int64_t>(request.sampling_params().n(), 1);
  const int64_t num_tokens = int64_t{request.prompt_token_ids_size()} +
                             num_samples * request.sampling_params().max_new_tokens();
  std::optional<int> pinned;
  if (request.has_data_parallel_rank()) pinned = static_cast<int>(request.data_parallel_rank());

  const bool assigned = request.request_id().empty();
  absl::StatusOr<int> admitted;
  if (assigned) {
    // A caller may have chosen an id of the same shape; draw again on a clash.
    do {
      request.set_request_id(NewRequestId());
      admitted = inflight_.Admit(request.request_id(), num_tokens, pinned, candidates);
    } while (absl::IsAlreadyExists(admitted.status()));
  } else {
    admitted = inflight_.Admit(request.request_id(), num_tokens, pinned, candidates);
  }
  if (!admitted.ok()) return admitted.status();
  const int rank = *admitted;
  const std::string& id = request.request_id();
  FrontendMetrics* const metrics = options_.metrics;
  if (metrics != nullptr) metrics->OnAdmitted();
  absl::Cleanup release = [&] {
    inflight_.Release(id);
    if (metrics != nullptr) metrics->OnReleased();
  };
  auto observe_duration = [&] {
    if (metrics == nullptr) return;
    metrics->ObserveRequestDuration(absl::ToDoubleSeconds(absl::Now() - arrival));
  };

  if (assigned) {
    v1::GenerateResponse first;
    first.set_request_id(id);
    first.mutable_chunk()->set_index(0);
    if (!writer.Write(first)) return absl::CancelledError("the caller went away");
  }

  const std::string& address = targets[rank].address;
  std::shared_ptr<v1::AttentionWorker::Stub> stub = stubs_.Get(rank, address);
  Relay relay{id,
              rank,
              arrival,
              &writer,
              metrics,
              &inflight_,
              std::vector<uint32_t>(static_cast<size_t>(num_samples), 0)};
  if (std::shared_ptr<AttentionStream> stream =
          streams_.Get(rank, address, targets[rank].candidate.incarnation, stub)) {
    const absl::Status status = RelayServe(context, request, address, *stream, relay);
    if (status.ok()) observe_duration();
    return status;
  }
  absl::Status status = RelayGenerate(context, request, address, *stub, relay);
  if (status.ok()) observe_duration();
  return status;
}

absl::Status FrontendService::RelayServe(grpc::ServerContext* context,
                                         const v1::GenerateRequest& request,
                                         const std::string& address, AttentionStream& stream,
                                         Relay& relay) {
  const std::string& id = relay.id;
  auto mailbox = std::make_shared<RequestMailbox>();
  inflight_.AttachUpstream(id, [mailbox] { mailbox->Stop(); });
  absl::Cleanup detach = [&] { inflight_.DetachUpstream(id); };
  stream.Submit(request, mailbox);
  absl::Cleanup forget = [&] { stream.Forget(id); };
  // IsCancelled() on the synchronous API plucks the call's completion queue, which polls
  // its file descriptors: asked after every token it was a fifth of the router's CPU time
  // at concurrency 64 (perf, serving_bench 2 2). It is asked once per kCancelPollInterval,
  // the bound on how long a caller's cancellation goes unnoticed; a failed
  // Write notices a caller that went away sooner.
  absl::Time next_cancel_check = absl::Now() + kCancelPollInterval;
  auto cancelled = [&] {
    const absl::Time now = absl::Now();
    if (now < next_cancel_check) return false;
    next_cancel_check = now + kCancelPollInterval;
    return context->IsCancelled();
  };
  while (true) {
    // Woken by the worker's events or the router's stop; the timeout is the next
    // cancellation check.
    RequestMailbox::News news = mailbox->Wait(next_cancel_check);
    for (v1::ServeEvent& event : news.events) {
      v1::GenerateResponse message;
      message.set_request_id(id);
      if (event.has_chunk()) {
        *message.mutable_chunk() = std::move(*event.mutable_chunk());
      } else if (event.has_complete()) {
        *message.mutable_complete() = std::move(*event.mutable_complete());
      } else if (event.has_error()) {
        // Never OK: an error event ends the request.
        const int code = event.error().code() == 0 ? static_cast<int>(absl::StatusCode::kUnknown)
                                                   : event.error().code();
        return absl::Status(static_cast<absl::StatusCode>(code),
                            absl::StrCat("attention rank ", relay.rank, " (", address,
                                         "): ", event.error().message()));
      } else {
        continue;
      }
      if (!relay.Forward(message)) break;
      if (relay.got_complete) return absl::OkStatus();
    }
    if (relay.caller_gone || cancelled()) {
      stream.Abort(id);
      return relay.CallerStopped(context);
    }
    if (news.stopped) {
      stream.Abort(id);
      if (std::optional<absl::Status> s =
              relay.RouterStopped(inflight_.stop_reason(id), request, address)) {
        return *s;
      }
      return absl::InternalError("stopped without a reason");  // not reached
    }
    if (news.stream_ended) {
      return absl::UnavailableError(absl::StrCat("attention rank ", relay.rank, " (", address,
                                                 ") was lost mid-request: its stream ended (",
                                                 news.stream_status.ToString(),
                                                 "); safe to retry"));
    }
  }
}

absl::Status FrontendService::RelayGenerate(grpc::ServerContext* context,
                                            const v1::GenerateRequest& request,
                                            const std::string& address,
                                            v1::AttentionWorker::Stub& stub, Relay& relay) {
  const std::string& id = relay.id;
  std::unique_ptr<grpc::ClientContext> upstream = grpc::ClientContext::FromServerContext(*context);
  inflight_.AttachUpstream(id, [c = upstream.get()] { c->TryCancel(); });
  absl::Cleanup detach = [&] { inflight_.DetachUpstream(id); };

  std::unique_ptr<grpc::ClientReader<v1::GenerateResponse>> reader =
      stub.Generate(upstream.get(), request);
  v1::GenerateResponse message;
  while (reader->Read(&message)) {
    if (!relay.Forward(message)) upstream->TryCancel();
  }
  const absl::Status upstream_status = FromGrpcStatus(reader->Finish());
  std::move(detach).Invoke();

  if (relay.caller_gone || context->IsCancelled()) return relay.CallerStopped(context);
  if (relay.got_complete) return absl::OkStatus();
  if (std::optional<absl::Status> s =
          relay.RouterStopped(inflight_.stop_reason(id), request, address)) {
    return *s;
  }
  const int rank = relay.rank;
  if (!upstream_status.ok()) {
    return absl::Status(upstream_status.code(), absl::StrCat("attention rank ", rank, " (", address,
                                                             "): ", upstream_status.message()));
  }
  return absl::InternalError(absl::StrCat("attention rank ", rank, " (", address,
                                          ") ended the stream without a final message"));
}

grpc::Status FrontendService::Abort(grpc::ServerContext*, const v1::AbortRequest* request,
                                    v1::AbortResponse*) {
  return ToGrpcStatus(AbortRequest(request->request_id()));
}

absl::Status FrontendService::AbortRequest(const std::string& request_id) {
  if (request_id.empty()) return absl::InvalidArgumentError("request_id: must not be empty");
  absl::StatusOr<int> rank = inflight_.RankOf(request_id);
  if (!rank.ok()) return rank.status();
  // On the rank's Serve stream, the abort follows the submit: the worker always knows it.
  if (streams_.Abort(*rank, request_id)) return absl::OkStatus();
  const std::vector<RankTarget> targets = Targets(registry_->View());
  const RankTarget& target = targets[*rank];
  grpc::Status forwarded(grpc::StatusCode::UNAVAILABLE, "no live worker");
  if (target.candidate.incarnation != 0) {
    grpc::ClientContext context;
    context.set_deadline(DeadlineAfter(options_.abort_timeout));
    v1::AbortRequest abort;
    abort.set_request_id(request_id);
    v1::AbortResponse response;
    forwarded = stubs_.Get(*rank, target.address)->Abort(&context, abort, &response);
  }
  if (forwarded.ok()) return absl::OkStatus();
  // The worker does not know the request yet (still on its way) or cannot be reached:
  // cancel the upstream call here; the stream ends with FINISH_REASON_ABORTED.
  if (!inflight_.Stop(request_id, StopReason::kAbort)) {
    return absl::NotFoundError(absl::StrCat("request_id: '", request_id, "' is not in flight"));
  }
  return absl::OkStatus();
}

absl::StatusOr<v1::ModelInfo> FrontendService::ServedModel() const {
  for (const v1::WorkerInfo& w : registry_->Workers()) {
    if (w.role() != v1::ROLE_ATTENTION || !IsLive(w.state())) continue;
    v1::ModelInfo info = model_info_;
    info.set_wire_dtype(registry_->View().transport().wire_dtype());
    return info;
  }
  return absl::UnavailableError(
      "no attention worker has registered yet, so the served model is not known");
}

bool FrontendService::Serving() const { return !shutting_down_ && registry_->IsComplete(); }

grpc::Status FrontendService::GetModelInfo(grpc::ServerContext*, const v1::GetModelInfoRequest*,
                                           v1::GetModelInfoResponse* response) {
  absl::StatusOr<v1::ModelInfo> model = ServedModel();
  if (!model.ok()) return ToGrpcStatus(model.status());
  *response->mutable_model_info() = *std::move(model);
  return grpc::Status::OK;
}

grpc::Status FrontendService::GetLoads(grpc::ServerContext*, const v1::GetLoadsRequest*,
                                       v1::GetLoadsResponse* response) {
  *response = Loads();
  return grpc::Status::OK;
}

v1::GetLoadsResponse FrontendService::Loads() {
  const v1::ClusterView view = registry_->View();
  const std::vector<WorkerStatus> statuses = registry_->WorkerStatuses();

  // One GetLoad per live attention rank, all at once.
  struct Probe {
    v1::WorkerInfo worker;
    std::optional<WorkerStatus> status;  // last heartbeat, if the registry still has it
    grpc::ClientContext context;
    v1::GetLoadResponse response;
    grpc::Status result;
    bool sent = false;
  };
  std::vector<std::unique_ptr<Probe>> probes;
  for (const v1::WorkerInfo& w : view.workers()) {
    if (w.role() != v1::ROLE_ATTENTION) continue;
    auto probe = std::make_unique<Probe>();
    probe->worker = w;
    for (const WorkerStatus& s : statuses) {
      if (s.info.role() == w.role() && s.info.rank() == w.rank()) probe->status = s;
    }
    probes.push_back(std::move(probe));
  }
  int num_live = 0;
  for (const auto& p : probes) num_live += IsLive(p->worker.state()) ? 1 : 0;
  absl::BlockingCounter pending(num_live);
  const v1::GetLoadRequest request;
  for (const auto& p : probes) {
    if (!IsLive(p->worker.state())) continue;
    p->sent = true;
    p->context.set_deadline(DeadlineAfter(options_.get_load_timeout));
    stubs_.Get(static_cast<int>(p->worker.rank()), p->worker.grpc_address())
        ->async()
        ->GetLoad(&p->context, &request, &p->response, [p = p.get(), &pending](grpc::Status s) {
          p->result = std::move(s);
          pending.DecrementCount();
        });
  }
  pending.Wait();

  const absl::Time now = absl::Now();
  const std::vector<RankTraffic> traffic = inflight_.Traffic(now);
  v1::GetLoadsResponse response;
  response.set_cluster_view_version(view.version());
  for (const auto& p : probes) {
    const uint32_t rank = p->worker.rank();
    v1::RankLoad load;
    if (p->sent && p->result.ok()) {
      load = p->response.load();
      if (load.sampled_at_unix_ns() == 0) load.set_sampled_at_unix_ns(absl::ToUnixNanos(now));
    } else if (p->status.has_value()) {
      // Unreachable just now, or DEAD: the last heartbeat's numbers, dated by it.
      load = p->status->load;
      load.set_sampled_at_unix_ns(absl::ToUnixNanos(p->status->last_heartbeat));
    }
    load.set_rank(rank);
    const v1::WorkerState state = p->worker.state();
    if (state == v1::WORKER_STATE_DEAD) {
      load.set_num_running_requests(0);
      load.set_num_queued_requests(0);
      load.set_kv_cache_used_tokens(0);
      load.set_tokens_per_second(0);
    }
    if (state == v1::WORKER_STATE_DEAD || state == v1::WORKER_STATE_DRAINING ||
        load.state() == v1::WORKER_STATE_UNSPECIFIED) {
      load.set_state(state);
    }
    if (rank < traffic.size()) {
      load.set_num_outstanding_tokens(static_cast<uint64_t>(traffic[rank].num_outstanding_tokens));
      if (load.tokens_per_second() == 0) {
        load.set_tokens_per_second(traffic[rank].tokens_per_second);
      }
    }
    *response.add_loads() = std::move(load);
  }
  return response;
}

}  // namespace dxs
