// ControlPlaneService: dxs.v1.ControlPlane over a ClusterRegistry (synchronous gRPC API).
// Register, Heartbeat, Drain and Deregister are one registry call each, converted to
// grpc::Status by ToGrpcStatus. WatchCluster streams ClusterViews: the current one at once
// when the caller's known_version is behind, then every newer one (versions only increase;
// a slow reader may skip some). A timer thread expires leases every 200 ms.
//
// Every accepted or refused registration, every expiry and every deregistration is logged
// as one line on the log stream (stderr by default), with the reason.
//
// Shutdown: Shutdown() refuses new mutations with UNAVAILABLE, ends every WatchCluster
// stream with UNAVAILABLE within 200 ms and stops the timer; call it before
// grpc::Server::Shutdown so that server shutdown does not wait on open streams. A stream
// also ends within 200 ms of its client cancelling.
//
// Thread safety: the handlers run on gRPC's threads concurrently; Shutdown may be called
// from any thread, more than once. The registry must outlive the service.
#pragma once

#include <cstdio>
#include <functional>
#include <thread>

#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
#include "common/grpc/tls.h"
#include "dxs/v1/control_plane.grpc.pb.h"
#include "router/control_plane/cluster_registry.h"

namespace dxs {

class ControlPlaneService final : public v1::ControlPlane::Service {
 public:
  // How often the timer calls ExpireLeases, and the longest a stream waits before checking
  // for cancellation.
  static constexpr absl::Duration kPollInterval = absl::Milliseconds(200);

  // `registry` is not owned. `log` receives one line per membership event; nullptr: none.
  explicit ControlPlaneService(ClusterRegistry* registry, std::FILE* log = stderr);
  ~ControlPlaneService() override;

  ControlPlaneService(const ControlPlaneService&) = delete;
  ControlPlaneService& operator=(const ControlPlaneService&) = delete;

  void Shutdown();
  // With mutual TLS every control-plane RPC requires a cluster certificate (set before
  // the server starts).
  void set_tls(TlsConfig tls) { tls_ = std::move(tls); }
  // What Rebalance runs (the router's Rebalancer); unset: UNIMPLEMENTED. Set before the
  // server starts.
  using RebalanceFn = std::function<absl::StatusOr<v1::RebalanceResponse>()>;
  void set_rebalance(RebalanceFn rebalance) { rebalance_ = std::move(rebalance); }

  grpc::Status Register(grpc::ServerContext* context, const v1::RegisterRequest* request,
                        v1::RegisterResponse* response) override;
  grpc::Status WatchCluster(grpc::ServerContext* context, const v1::WatchClusterRequest* request,
                            grpc::ServerWriter<v1::ClusterView>* writer) override;
  grpc::Status Heartbeat(grpc::ServerContext* context, const v1::HeartbeatRequest* request,
                         v1::HeartbeatResponse* response) override;
  grpc::Status Drain(grpc::ServerContext* context, const v1::DrainRequest* request,
                     v1::DrainResponse* response) override;
  grpc::Status Deregister(grpc::ServerContext* context, const v1::DeregisterRequest* request,
                          v1::DeregisterResponse* response) override;
  grpc::Status Rebalance(grpc::ServerContext* context, const v1::RebalanceRequest* request,
                         v1::RebalanceResponse* response) override;
  // Probes the peer's gRPC server (kProbeTimeout); marks it dead if it does not answer.
  grpc::Status ReportUnreachable(grpc::ServerContext* context,
                                 const v1::ReportUnreachableRequest* request,
                                 v1::ReportUnreachableResponse* response) override;
  static constexpr absl::Duration kProbeTimeout = absl::Milliseconds(500);

 private:
  void ExpireLoop();
  void Log(const std::string& line);

  ClusterRegistry* const registry_;
  TlsConfig tls_;
  RebalanceFn rebalance_;
  std::FILE* const log_;
  absl::Notification stop_;
  std::thread expire_thread_;
};

}  // namespace dxs
