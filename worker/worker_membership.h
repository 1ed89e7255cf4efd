// WorkerMembership: the worker side of the control plane.
//
// Registers with the router (retrying while it is unreachable), then keeps a WatchCluster
// stream open and heartbeats on the interval the router asked for. Every new ClusterView
// is handed to `on_view`. If the router forgets the worker (lease expired, router
// restarted), the worker registers again with the same request.
//
// Thread safety: callbacks run on the membership's own threads; `counters` is called from
// the heartbeat thread and must be thread-safe.
#pragma once

#include <atomic>
#include <functional>
#include <memory>
#include <string>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "dxs/v1/control_plane.grpc.pb.h"
#include "grpcpp/security/credentials.h"

namespace dxs {

class WorkerMembership {
 public:
  using ViewCallback = std::function<void(const v1::ClusterView&)>;
  using CountersCallback = std::function<void(v1::HeartbeatRequest*)>;

  // Registers; fails if the router refuses (the refusal's status is returned as is) or
  // stays unreachable past `register_timeout`.
  // `before_reregister` (optional) runs on the membership thread before the worker registers
  // again after the router forgot it, and `after_reregister` once that registration is
  // done (successful or not): WorkerRuntime fences the data path in between.
  static absl::StatusOr<std::unique_ptr<WorkerMembership>> Start(
      const std::string& router_address, v1::RegisterRequest request, ViewCallback on_view,
      CountersCallback fill_heartbeat, absl::Duration register_timeout = absl::Seconds(30),
      std::shared_ptr<grpc::ChannelCredentials> credentials = nullptr,
      std::function<void()> before_reregister = nullptr,
      std::function<void()> after_reregister = nullptr);
  ~WorkerMembership();  // deregisters and stops the threads

  v1::RegisterResponse registration() const;

  // Sends the next heartbeat now (within 50 ms) instead of after the interval, for news the
  // router's view, which `dxs status` and the router's health read, should not get a
  // heartbeat interval late (WorkerRuntime::HeartbeatNow).
  void HeartbeatSoon() { heartbeat_soon_ = true; }

  // ControlPlane.ReportUnreachable: tells the router `peer`'s connection failed (it probes
  // the peer and marks it dead if it does not answer). Blocks up to `timeout`.
  absl::Status ReportUnreachable(const v1::WorkerId& peer, const std::string& reason,
                                 absl::Duration timeout);

 private:
  WorkerMembership() = default;
  absl::Status RegisterOnce();
  void ReRegisterIfCurrent(uint64_t incarnation);
  void WatchLoop();
  void HeartbeatLoop();

  std::unique_ptr<v1::ControlPlane::Stub> stub_;
  v1::RegisterRequest request_;
  ViewCallback on_view_;
  CountersCallback fill_heartbeat_;
  std::function<void()> before_reregister_, after_reregister_;
  mutable absl::Mutex mu_;
  v1::RegisterResponse registration_ ABSL_GUARDED_BY(mu_);
  bool registered_ ABSL_GUARDED_BY(mu_) = false;  // a refused worker never is
  std::atomic<bool> stopping_{false};
  std::atomic<bool> heartbeat_soon_{false};
  absl::Mutex reregister_mu_;  // one re-registration at a time
  absl::Mutex watch_mu_;
  grpc::ClientContext* watch_context_ ABSL_GUARDED_BY(watch_mu_) = nullptr;
  std::thread watch_thread_, heartbeat_thread_;
};

}  // namespace dxs
