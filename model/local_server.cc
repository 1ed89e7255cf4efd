#include "model/local_server.h"

#include <utility>

#include "common/status_macros.h"

namespace dxs {

LocalServer::LocalServer(LocalEngine* engine)
    : engine_(engine),
      scheduler_(engine->config_, engine->kv_.get(), {engine->options_.prefill_chunk_tokens}),
      thread_([this] { Loop(); }) {}

LocalServer::~LocalServer() {
  stopping_ = true;
  {
    absl::MutexLock lock(&mu_);
    wake_ = true;
  }
  thread_.join();
  scheduler_.FailAll(absl::CancelledError("the single-process server stopped"));
  engine_->DropInFlightStep();  // the scheduler it was for goes with this server
}

absl::Status LocalServer::Submit(uint64_t id, GenerationRequest request, TokenSink sink) {
  if (stopping_) return absl::CancelledError("the single-process server is stopping");
  DXS_RETURN_IF_ERROR(scheduler_.Add(id, std::move(request), std::move(sink)));
  absl::MutexLock lock(&mu_);
  wake_ = true;
  return absl::OkStatus();
}

bool LocalServer::Abort(uint64_t id) {
  if (!scheduler_.Abort(id)) return false;
  absl::MutexLock lock(&mu_);
  wake_ = true;
  return true;
}

void LocalServer::Loop() {
  while (!stopping_) {
    {
      // Added before woken (Submit), so a request that came while the last step ran is
      // seen by HasWork below or wakes this wait.
      absl::MutexLock lock(&mu_);
      mu_.Await(absl::Condition(&wake_));
      wake_ = false;
    }
    // A failed step has failed its requests (their sinks say why); the next ones go on.
    while (!stopping_ && scheduler_.HasWork()) (void)engine_->RunStep(scheduler_);
  }
}

}  // namespace dxs
