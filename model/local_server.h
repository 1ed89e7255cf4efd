// LocalServer: the single-process engine serving requests as they arrive (continuous
// batching), as the attention worker serves its DP rank's requests: Submit adds a request
// to the running batch from any thread, and a step thread runs the engine's steps while any
// request is live and sleeps until the next Submit otherwise. A request joins at the next
// step boundary, so its time to first token includes the step in flight when it came.
//
// `dxs bench --local MODEL --request-rate ...` drives it: the single-process side of the
// open-loop serving benchmark, beside the same workload against a cluster.
//
// Thread safety: Submit and Abort from any thread; the sinks are called on the step thread.
#pragma once

#include <atomic>
#include <cstdint>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "model/engine.h"
#include "model/scheduler.h"

namespace dxs {

class LocalServer {
 public:
  // `engine` is not owned and must outlive this; nothing else may run it meanwhile
  // (GenerateBatch), as both would use its KV cache.
  explicit LocalServer(LocalEngine* engine);
  // Requests still live end with CANCELLED; then the step thread is joined.
  ~LocalServer();
  LocalServer(const LocalServer&) = delete;
  LocalServer& operator=(const LocalServer&) = delete;

  // Queues `request` under `id` (unique among live requests); the scheduler's errors
  // otherwise (INVALID_ARGUMENT, ALREADY_EXISTS, RESOURCE_EXHAUSTED), with nothing queued.
  absl::Status Submit(uint64_t id, GenerationRequest request, TokenSink sink);
  // Ends request `id` at the next step boundary (its sink gets kAborted; a client that went
  // away). False if no such request is live.
  bool Abort(uint64_t id);

 private:
  void Loop();

  LocalEngine* const engine_;
  Scheduler scheduler_;
  std::atomic<bool> stopping_{false};
  absl::Mutex mu_;
  bool wake_ ABSL_GUARDED_BY(mu_) = false;  // a Submit since the step thread last looked
  std::thread thread_;
};

}  // namespace dxs
