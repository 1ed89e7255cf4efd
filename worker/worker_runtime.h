// WorkerRuntime: what attention and expert worker processes share around their data path:
// the UCX transport, the gRPC server (with health and reflection), joining the cluster
// through the router, and applying each new cluster view (connecting to peers whose
// transport address changed, rebuilding the placement).
//
// Thread safety: views arrive on the membership thread and are parked; the worker's main
// (step) thread applies them with ApplyPendingView between steps, so the transport is
// only touched by that thread.
#pragma once

#include <grpcpp/grpcpp.h>

#include <atomic>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "common/dtype.h"
#include "common/grpc/tls.h"
#include "common/metrics/metrics_server.h"
#include "dataplane/dispatch/placement.h"
#include "dataplane/transport/transport.h"
#include "dataplane/transport/transport_table.h"
#include "dxs/v1/control_plane.grpc.pb.h"
#include "prometheus/collectable.h"
#include "worker/worker_membership.h"
#include "worker/worker_transport.h"

namespace dxs {

// The cluster as the data path needs it.
struct ClusterShape {
  int num_attention = 0;
  int num_expert = 0;
  Placement placement;  // empty (0 ranks) until every expert is placed
  DType wire_dtype = DType::kF32;
  // ClusterView.elastic_ep.
  bool elastic_ep = false;
  // This worker's state in the view (DRAINING after dxs drain).
  v1::WorkerState self_state = v1::WORKER_STATE_UNSPECIFIED;
  // Per DP rank (num_attention of them): registered and not DEAD in the view. Once the
  // cluster has been complete, a DP rank the router has DEAD (a frozen, partitioned or
  // killed attention worker) is left out of the others' steps, which go on without it.
  std::vector<bool> live_attention;
  // Per DP rank: in the view as DEAD. A DP rank absent from the view is not dead: a router
  // that restarted lists each worker only once it registers again, while the DP ranks may
  // still run a step planned under the old router's view with that rank in it.
  std::vector<bool> dead_attention;
  // ClusterView.version of this view.
  uint64_t view_version = 0;
};

class WorkerRuntime {
 public:
  WorkerRuntime(std::string role_name, int rank) : role_name_(std::move(role_name)), rank_(rank) {}
  ~WorkerRuntime() { Stop(); }

  // TLS for the worker's gRPC server and its calls to the router; set before Start.
  void set_tls(TlsConfig tls) { tls_ = std::move(tls); }
  // Creates the transport (worker_transport.h: `transport` ucx or nccl, on `device`) and
  // starts the gRPC server on `listen` (port 0: any).
  absl::Status Start(const std::string& listen, grpc::Service* service,
                     const std::string& transport, const std::string& device);
  // Serves `collectables` as GET /metrics on `listen` (port 0: any). Call before
  // BaseRegistration, which then carries the bound address.
  absl::Status StartMetrics(
      const std::string& listen,
      const std::vector<std::shared_ptr<prometheus::Collectable>>& collectables);
  // A registration with rank, addresses (gRPC, transport, metrics) and the model identity
  // of `model_dir` filled in.
  v1::RegisterRequest BaseRegistration(v1::Role role, const std::string& model_dir) const;
  // Registers with the router and starts watching the cluster and heartbeating.
  absl::Status Join(const std::string& router, v1::RegisterRequest request,
                    WorkerMembership::CountersCallback fill_heartbeat);
  // Applies the newest parked view, if any: sets this worker's transport rank, connects
  // changed peers and, on nccl, makes the communicator of a new id over the view's live
  // workers (NcclMembers; this blocks until they have all joined, or the transport's
  // init timeout). Returns the shape when a view was applied.
  std::optional<ClusterShape> ApplyPendingView();
  // Every configured rank is registered and every expert placed (as of the applied view),
  // and on nccl the view's communicator is up.
  bool cluster_complete() const { return complete_; }
  // Steps may run: the cluster is complete, or, with elastic EP, it was once and every
  // expert still has a live replica, or some expert is being recovered (its steps fail and
  // are run again until a placement covers it). Once complete, DP ranks may be missing
  // (at least one live; an attention worker itself live): the others step without them.
  bool can_serve() const { return complete_ || (elastic_ && started_); }
  // ControlPlane.ReportUnreachable through the membership (no-op before Join).
  absl::Status ReportUnreachable(const v1::WorkerId& peer, const std::string& reason) {
    return membership_ ? membership_->ReportUnreachable(peer, reason, absl::Seconds(2))
                       : absl::OkStatus();
  }
  // The worker at transport rank `peer` in the last applied view, if any.
  std::optional<v1::WorkerId> WorkerAtTransportRank(int peer) const;

  Transport* transport() const { return transport_.get(); }
  const std::string& grpc_address() const { return grpc_address_; }
  // HOST:PORT of the metrics server, with the bound port; empty before StartMetrics.
  const std::string& metrics_address() const { return metrics_address_; }
  v1::RegisterResponse registration() const { return membership_->registration(); }
  // Heartbeats now rather than after the interval (no-op before Join). Workers call it when
  // their state changes (JOINING -> READY) and when they go idle after work, so that the
  // router's view (states, loads, the step counters behind dxs_cluster_*) is current at the
  // moments it is looked at, `dxs status` after a run for one; under steady load nothing
  // changes and heartbeats keep their interval.
  void HeartbeatNow() {
    if (membership_) membership_->HeartbeatSoon();
  }
  void Stop();

 private:
  // Tells the transport which peers the view has DEAD (and which are live again), so a
  // step waiting on a dead peer fails now rather than at the step timeout
  // (Transport::SetPeerDeclaredDead). On the membership thread.
  void DeclareDeadPeers(const v1::ClusterView& view) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Before this worker registers again (the router forgot it: its lease ran out while it
  // was frozen or cut off), on the membership thread: every peer is declared dead, so that
  // what the step thread still waits on for the old incarnation (a combine, a round) ends
  // at once, and this returns once the step thread has come between steps (up to 10 s).
  // Requests of the new incarnation then never meet a step of the old one. Unfence, after
  // the registration, lets the views declare the live peers live again.
  void Fence();
  void Unfence();

  std::string role_name_;
  TlsConfig tls_;
  int rank_;
  std::unique_ptr<Transport> transport_;
  const TransportSpec* transport_spec_ = nullptr;  // its row of the transport table
  NcclTransport* nccl_ = nullptr;                  // transport_ when it is nccl
  int cuda_device_ = -1;                           // the GPU ordinal of --device (-1: cpu)
  std::string nccl_id_;  // the unique id of the last communicator Init was tried for
  // The router transport named in the last view that was not nccl (said once).
  std::string mismatched_transport_;
  std::unique_ptr<grpc::Server> server_;
  std::string grpc_address_;
  std::unique_ptr<metrics::MetricsServer> metrics_server_;
  std::string metrics_address_;
  std::unique_ptr<WorkerMembership> membership_;
  absl::Mutex mu_;
  std::optional<v1::ClusterView> pending_ ABSL_GUARDED_BY(mu_);
  std::optional<v1::ClusterView> last_view_ ABSL_GUARDED_BY(mu_);
  bool fenced_ ABSL_GUARDED_BY(mu_) = false;
  absl::Mutex fence_mu_;
  uint64_t fence_epoch_ ABSL_GUARDED_BY(fence_mu_) = 0;  // Fence calls
  uint64_t fence_acked_ ABSL_GUARDED_BY(fence_mu_) = 0;  // as of the step thread's last turn
  std::map<int, std::string> connected_;                 // transport rank -> address connected to
  bool complete_ = false;
  bool started_ = false;  // complete_ has been true
  bool elastic_ = false;
  std::map<int, v1::WorkerId> by_transport_rank_;  // of the last applied view
  int self_peer_ = -1;  // this worker's transport rank, once a view has named it
  // Applies the view's NCCL communicator (nccl only); whether one is up for it.
  bool ApplyNcclView(const v1::ClusterView& view);
};

// SIGINT/SIGTERM set a flag that ShutdownRequested() reads; main loops poll it.
void InstallSignalHandlers();
bool ShutdownRequested();

DType FromProtoDType(v1::DType d);

}  // namespace dxs
