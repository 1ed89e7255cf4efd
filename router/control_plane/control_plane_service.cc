#include "router/control_plane/control_plane_service.h"

#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/grpc/status_conversion.h"
#include "grpcpp/create_channel.h"

namespace dxs {
namespace {

std::string Describe(const v1::WorkerId& id) {
  return absl::StrCat(RoleName(id.role()), " rank ", id.rank(), " (incarnation ", id.incarnation(),
                      ")");
}

std::string ExpertsOf(const v1::ExpertPlacement& placement, uint32_t rank) {
  std::vector<int> experts;
  for (int e = 0; e < placement.expert_to_rank_size(); ++e) {
    for (uint32_t r : placement.expert_to_rank(e).ep_ranks()) {
      if (r == rank) experts.push_back(e);
    }
  }
  return absl::StrJoin(experts, ",");
}

// The worker named by a WatchCluster request is in `view` with that incarnation and alive.
bool StillRegistered(const v1::ClusterView& view, const v1::WorkerId& id) {
  for (const v1::WorkerInfo& w : view.workers()) {
    if (w.role() == id.role() && w.rank() == id.rank()) {
      return (id.incarnation() == 0 || id.incarnation() == w.incarnation()) &&
             w.state() != v1::WORKER_STATE_DEAD;
    }
  }
  return false;
}

}  // namespace

ControlPlaneService::ControlPlaneService(ClusterRegistry* registry, std::FILE* log)
    : registry_(registry), log_(log), expire_thread_([this] { ExpireLoop(); }) {}

ControlPlaneService::~ControlPlaneService() { Shutdown(); }

void ControlPlaneService::Shutdown() {
  registry_->Shutdown();
  if (!stop_.HasBeenNotified()) stop_.Notify();
  if (expire_thread_.joinable() && expire_thread_.get_id() != std::this_thread::get_id()) {
    expire_thread_.join();
  }
}

void ControlPlaneService::Log(const std::string& line) {
  if (log_ == nullptr) return;
  std::fprintf(log_, "dxs-router: %s\n", line.c_str());
  std::fflush(log_);
}

void ControlPlaneService::ExpireLoop() {
  while (!stop_.WaitForNotificationWithTimeout(kPollInterval)) {
    for (const v1::WorkerInfo& w : registry_->ExpireLeases(absl::Now())) {
      Log(absl::StrCat("expired ", RoleName(w.role()), " rank ", w.rank(), " at ", w.grpc_address(),
                       " (incarnation ", w.incarnation(), "): no heartbeat for more than ",
                       absl::FormatDuration(registry_->options().lease_timeout),
                       "; marked DEAD, rank and experts released; view v", registry_->version()));
    }
  }
}

grpc::Status ControlPlaneService::Register(grpc::ServerContext* context,
                                           const v1::RegisterRequest* request,
                                           v1::RegisterResponse* response) {
  if (absl::Status s = RequireClusterPeer(*context, tls_); !s.ok()) return ToGrpcStatus(s);
  absl::StatusOr<v1::RegisterResponse> result = registry_->Register(*request);
  const std::string who =
      absl::StrCat(RoleName(request->role()), " worker at ", request->grpc_address(),
                   request->has_rank() ? absl::StrCat(" asking for rank ", request->rank()) : "");
  if (!result.ok()) {
    Log(absl::StrCat("refused ", who, ": ", absl::StatusCodeToString(result.status().code()), ": ",
                     result.status().message()));
    return ToGrpcStatus(result.status());
  }
  std::string experts;
  if (request->role() == v1::ROLE_EXPERT) {
    experts = absl::StrCat(" experts [", ExpertsOf(result->placement(), result->rank()), "]");
  }
  Log(absl::StrCat("registered ", RoleName(request->role()), " rank ", result->rank(), " at ",
                   request->grpc_address(), " (incarnation ", result->incarnation(), ")", experts,
                   "; view v", result->cluster_view_version(),
                   registry_->IsComplete() ? ", cluster complete" : ""));
  *response = *std::move(result);
  return grpc::Status::OK;
}

grpc::Status ControlPlaneService::WatchCluster(grpc::ServerContext* context,
                                               const v1::WatchClusterRequest* request,
                                               grpc::ServerWriter<v1::ClusterView>* writer) {
  if (absl::Status s = RequireClusterPeer(*context, tls_); !s.ok()) return ToGrpcStatus(s);
  const bool named = request->worker().role() != v1::ROLE_UNSPECIFIED;
  if (named && !StillRegistered(registry_->View(), request->worker())) {
    return ToGrpcStatus(absl::NotFoundError(absl::StrCat(
        Describe(request->worker()), " is not registered (or its lease expired); Register again")));
  }
  uint64_t known_version = request->known_version();
  while (true) {
    if (context->IsCancelled()) {
      return ToGrpcStatus(absl::CancelledError("the client cancelled the watch"));
    }
    std::optional<v1::ClusterView> view = registry_->WaitForVersion(known_version, kPollInterval);
    if (registry_->IsShutDown()) {
      return ToGrpcStatus(absl::UnavailableError("the router is shutting down; reconnect"));
    }
    if (!view.has_value()) continue;
    if (!writer->Write(*view)) {
      return ToGrpcStatus(absl::CancelledError("the watch stream is closed"));
    }
    known_version = view->version();
    if (named && !StillRegistered(*view, request->worker())) {
      return ToGrpcStatus(absl::NotFoundError(absl::StrCat(
          Describe(request->worker()),
          " is no longer registered (lease expired or deregistered); Register again")));
    }
  }
}

grpc::Status ControlPlaneService::Heartbeat(grpc::ServerContext* context,
                                            const v1::HeartbeatRequest* request,
                                            v1::HeartbeatResponse* response) {
  if (absl::Status s = RequireClusterPeer(*context, tls_); !s.ok()) return ToGrpcStatus(s);
  absl::StatusOr<v1::HeartbeatResponse> result = registry_->Heartbeat(*request);
  if (!result.ok()) return ToGrpcStatus(result.status());
  *response = *std::move(result);
  return grpc::Status::OK;
}

grpc::Status ControlPlaneService::Drain(grpc::ServerContext* context,
                                        const v1::DrainRequest* request,
                                        v1::DrainResponse* response) {
  if (absl::Status s = RequireClusterPeer(*context, tls_); !s.ok()) return ToGrpcStatus(s);
  absl::StatusOr<v1::DrainResponse> result = registry_->Drain(*request);
  if (!result.ok()) {
    Log(absl::StrCat("refused drain of ", Describe(request->worker()), ": ",
                     result.status().message()));
    return ToGrpcStatus(result.status());
  }
  Log(absl::StrCat("draining ", Describe(request->worker()), "; view v",
                   result->cluster_view_version()));
  *response = *std::move(result);
  return grpc::Status::OK;
}

grpc::Status ControlPlaneService::Deregister(grpc::ServerContext* context,
                                             const v1::DeregisterRequest* request,
                                             v1::DeregisterResponse* response) {
  if (absl::Status s = RequireClusterPeer(*context, tls_); !s.ok()) return ToGrpcStatus(s);
  absl::StatusOr<v1::DeregisterResponse> result = registry_->Deregister(*request);
  if (!result.ok()) return ToGrpcStatus(result.status());
  Log(absl::StrCat("deregistered ", Describe(request->worker()), ": ",
                   request->reason().empty() ? "no reason given" : request->reason(), "; view v",
                   result->cluster_view_version()));
  *response = *std::move(result);
  return grpc::Status::OK;
}

grpc::Status ControlPlaneService::Rebalance(grpc::ServerContext* context,
                                            const v1::RebalanceRequest*,
                                            v1::RebalanceResponse* response) {
  if (absl::Status s = RequireClusterPeer(*context, tls_); !s.ok()) return ToGrpcStatus(s);
  if (!rebalance_) {
    return ToGrpcStatus(absl::UnimplementedError("this router does not rebalance experts"));
  }
  absl::StatusOr<v1::RebalanceResponse> result = rebalance_();
  if (!result.ok()) {
    Log(absl::StrCat("rebalance refused: ", absl::StatusCodeToString(result.status().code()), ": ",
                     result.status().message()));
    return ToGrpcStatus(result.status());
  }
  Log(absl::StrCat("rebalanced by request: placement v", result->placement_version(), ", ",
                   result->experts_moved(), " expert copies moved; view v",
                   result->cluster_view_version()));
  *response = *std::move(result);
  return grpc::Status::OK;
}

namespace {

// Whether a gRPC server answers at `address` within `timeout`: a connection is made, or
// the channel fails (connection refused: the process is gone) or the time runs out.
bool Answers(const std::string& address, const std::shared_ptr<grpc::ChannelCredentials>& creds,
             absl::Duration timeout) {
  std::shared_ptr<grpc::Channel> channel = grpc::CreateChannel(address, creds);
  const auto deadline = std::chrono::system_clock::now() +
                        std::chrono::milliseconds(absl::ToInt64Milliseconds(timeout));
  grpc_connectivity_state state = channel->GetState(/*try_to_connect=*/true);
  while (state != GRPC_CHANNEL_READY) {
    if (state == GRPC_CHANNEL_TRANSIENT_FAILURE || state == GRPC_CHANNEL_SHUTDOWN) return false;
    if (!channel->WaitForStateChange(state, deadline)) return false;
    state = channel->GetState(/*try_to_connect=*/true);
  }
  return true;
}

}  // namespace

grpc::Status ControlPlaneService::ReportUnreachable(grpc::ServerContext* context,
                                                    const v1::ReportUnreachableRequest* request,
                                                    v1::ReportUnreachableResponse* response) {
  if (absl::Status s = RequireClusterPeer(*context, tls_); !s.ok()) return ToGrpcStatus(s);
  const v1::WorkerId& peer = request->peer();
  if (peer.role() != v1::ROLE_ATTENTION && peer.role() != v1::ROLE_EXPERT) {
    return ToGrpcStatus(
        absl::InvalidArgumentError("peer.role is required: ROLE_ATTENTION or ROLE_EXPERT"));
  }
  std::string address;
  for (const v1::WorkerInfo& w : registry_->Workers()) {
    if (w.role() == peer.role() && w.rank() == peer.rank() && w.state() != v1::WORKER_STATE_DEAD &&
        (peer.incarnation() == 0 || peer.incarnation() == w.incarnation())) {
      address = w.grpc_address();
    }
  }
  if (address.empty()) {
    return ToGrpcStatus(absl::NotFoundError(
        absl::StrCat(Describe(peer), " is not a live worker (already dead or gone)")));
  }
  absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> creds = MakeChannelCredentials(tls_);
  if (!creds.ok()) return ToGrpcStatus(creds.status());
  if (Answers(address, *creds, kProbeTimeout)) {
    return ToGrpcStatus(absl::FailedPreconditionError(
        absl::StrCat(Describe(peer), " at ", address, " answers; not marked dead")));
  }
  absl::StatusOr<v1::ClusterView> view = registry_->MarkDead(peer);
  if (!view.ok()) return ToGrpcStatus(view.status());
  Log(absl::StrCat("marked ", Describe(peer), " dead: reported unreachable by ",
                   Describe(request->reporter()), " (", request->reason(),
                   ") and its gRPC server does not answer; view v", view->version()));
  response->set_cluster_view_version(view->version());
  return grpc::Status::OK;
}

}  // namespace dxs
