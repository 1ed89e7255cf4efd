#include "worker/worker_runtime.h"

#include <unistd.h>

#include <csignal>
#include <iostream>
#include <map>
#include <set>
#include <string>

#include "absl/strings/str_cat.h"
#include "common/grpc/server.h"
#include "common/step_trace.h"
#include "router/control_plane/model_identity.h"

namespace dxs {
namespace {

std::atomic<bool> g_shutdown{false};

void OnSignal(int) { g_shutdown = true; }

std::string HostOf(const std::string& address) {
  const size_t colon = address.rfind(':');
  return colon == std::string::npos ? address : address.substr(0, colon);
}

}  // namespace

void InstallSignalHandlers() {
  std::signal(SIGINT, OnSignal);
  std::signal(SIGTERM, OnSignal);
}

bool ShutdownRequested() { return g_shutdown.load(); }

DType FromProtoDType(v1::DType d) {
  switch (d) {
    case v1::DTYPE_BFLOAT16:
      return DType::kBF16;
    case v1::DTYPE_FLOAT16:
      return DType::kF16;
    case v1::DTYPE_FLOAT8_E4M3:
      return DType::kF8E4M3;
    default:
      return DType::kF32;
  }
}

absl::Status WorkerRuntime::Start(const std::string& listen, grpc::Service* service,
                                  const std::string& transport, const std::string& device) {
  absl::StatusOr<WorkerTransport> made = MakeWorkerTransport(transport, device);
  if (!made.ok()) return made.status();
  transport_ = std::move(made->transport);
  transport_spec_ = FindTransport(transport);
  nccl_ = made->nccl;
  cuda_device_ = made->cuda_device;
  GrpcServerOptions options;
  options.address = listen;
  absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> credentials =
      MakeServerCredentials(tls_);
  if (!credentials.ok()) return credentials.status();
  options.credentials = *credentials;
  absl::StatusOr<GrpcServer> server = StartGrpcServer(options, {service});
  if (!server.ok()) return server.status();
  server_ = std::move(server->server);
  grpc_address_ = absl::StrCat(HostOf(listen), ":", server->port);
  return absl::OkStatus();
}

absl::Status WorkerRuntime::StartMetrics(
    const std::string& listen,
    const std::vector<std::shared_ptr<prometheus::Collectable>>& collectables) {
  metrics::MetricsServerOptions options;
  options.address = listen;
  absl::StatusOr<std::unique_ptr<metrics::MetricsServer>> server =
      metrics::MetricsServer::Start(options);
  if (!server.ok()) {
    return absl::Status(server.status().code(),
                        absl::StrCat("--metrics-listen: ", server.status().message()));
  }
  metrics_server_ = std::move(*server);
  for (const std::shared_ptr<prometheus::Collectable>& c : collectables) {
    metrics_server_->Expose(c);
  }
  metrics_address_ = absl::StrCat(HostOf(listen), ":", metrics_server_->port());
  return absl::OkStatus();
}

v1::RegisterRequest WorkerRuntime::BaseRegistration(v1::Role role,
                                                    const std::string& model_dir) const {
  v1::RegisterRequest req;
  req.set_role(role);
  req.set_rank(static_cast<uint32_t>(rank_));
  req.set_grpc_address(grpc_address_);
  req.set_metrics_address(metrics_address_);
  SetConnectAddress(*transport_spec_, transport_->LocalAddress(), req.mutable_transport());
  if (nccl_ != nullptr) {
    v1::NcclPeerInfo* nccl = req.mutable_transport()->mutable_nccl();
    char host[256] = {};
    if (gethostname(host, sizeof(host) - 1) == 0) nccl->set_hostname(host);
    nccl->set_cuda_device(cuda_device_);
    nccl->set_pci_bus_id(nccl_->DeviceBusId());
  }
  absl::StatusOr<v1::ModelFingerprint> fp = ComputeModelFingerprint(model_dir);
  if (fp.ok()) *req.mutable_fingerprint() = *fp;
  req.set_software_version("dxs " DXS_VERSION_STRING);
  return req;
}

absl::Status WorkerRuntime::Join(const std::string& router, v1::RegisterRequest request,
                                 WorkerMembership::CountersCallback fill_heartbeat) {
  absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> channel_credentials =
      MakeChannelCredentials(tls_);
  if (!channel_credentials.ok()) return channel_credentials.status();
  absl::StatusOr<std::unique_ptr<WorkerMembership>> m = WorkerMembership::Start(
      router, std::move(request),
      [this](const v1::ClusterView& view) {
        absl::MutexLock lock(&mu_);
        pending_ = view;
        last_view_ = view;
        if (transport_) {
          DeclareDeadPeers(view);
          transport_->Wake();
        }
      },
      std::move(fill_heartbeat), absl::Seconds(30), *channel_credentials, [this] { Fence(); },
      [this] { Unfence(); });
  if (!m.ok()) return m.status();
  membership_ = std::move(*m);
  return absl::OkStatus();
}

void WorkerRuntime::DeclareDeadPeers(const v1::ClusterView& view) {
  // Here, on the membership thread, not when the step thread applies the view between
  // steps: a step may be waiting on the dead peer (a partitioned host, a frozen process),
  // and this ends that wait now instead of at the step timeout.
  const v1::Role my_role = role_name_ == "attention" ? v1::ROLE_ATTENTION : v1::ROLE_EXPERT;
  std::map<int, std::string> dead;  // transport rank -> why; erased while a live entry has it
  std::set<int> live;
  for (const v1::WorkerInfo& w : view.workers()) {
    if (w.role() == my_role && static_cast<int>(w.rank()) == rank_) continue;
    const int peer = static_cast<int>(w.transport_rank());
    if (w.state() == v1::WORKER_STATE_DEAD) {
      dead[peer] = absl::StrCat("(", w.role() == v1::ROLE_ATTENTION ? "attention" : "expert",
                                " rank ", w.rank(), ", incarnation ", w.incarnation(),
                                ") is dead in the router's view v", view.version());
    } else {
      live.insert(peer);
    }
  }
  for (const auto& [peer, why] : dead) {
    if (!live.count(peer)) transport_->SetPeerDeclaredDead(peer, why);
  }
  if (fenced_) return;  // every peer stays declared dead until this worker registers again
  for (int peer : live) transport_->SetPeerDeclaredDead(peer, "");
}

void WorkerRuntime::Fence() {
  if (!transport_) return;
  TraceStep(role_name_, " ", rank_, ": fenced (the router forgot this worker)");
  {
    absl::MutexLock lock(&mu_);
    fenced_ = true;
    if (last_view_) {
      for (const v1::WorkerInfo& w : last_view_->workers()) {
        const v1::Role my_role = role_name_ == "attention" ? v1::ROLE_ATTENTION : v1::ROLE_EXPERT;
        if (w.role() == my_role && static_cast<int>(w.rank()) == rank_) continue;
        transport_->SetPeerDeclaredDead(
            static_cast<int>(w.transport_rank()),
            "(every peer): this worker lost its registration (the router had it DEAD); fenced "
            "until it registers again");
      }
    }
    transport_->Wake();
  }
  absl::MutexLock lock(&fence_mu_);
  const uint64_t epoch = ++fence_epoch_;
  auto acked = [this, epoch]()
                   ABSL_EXCLUSIVE_LOCKS_REQUIRED(fence_mu_) { return fence_acked_ >= epoch; };
  if (!fence_mu_.AwaitWithTimeout(absl::Condition(&acked), absl::Seconds(10))) {
    std::cerr << role_name_ << " " << rank_
              << ": the step thread did not come between steps within 10 s of losing the "
                 "registration; registering again anyway\n";
  }
}

void WorkerRuntime::Unfence() {
  TraceStep(role_name_, " ", rank_, ": registered again, unfenced");
  absl::MutexLock lock(&mu_);
  fenced_ = false;
  if (transport_ && last_view_) DeclareDeadPeers(*last_view_);
}

std::optional<ClusterShape> WorkerRuntime::ApplyPendingView() {
  {
    // Between steps: nothing of a fenced incarnation is in flight on this thread any more.
    absl::MutexLock lock(&fence_mu_);
    fence_acked_ = fence_epoch_;
  }
  std::optional<v1::ClusterView> view;
  {
    absl::MutexLock lock(&mu_);
    view.swap(pending_);
  }
  if (!view) return std::nullopt;
  if (StepTraceOn()) {
    std::string workers;
    for (const v1::WorkerInfo& w : view->workers()) {
      absl::StrAppend(&workers, " ", w.role() == v1::ROLE_ATTENTION ? "a" : "e", w.rank(), "@",
                      w.transport_rank(), w.state() == v1::WORKER_STATE_DEAD ? "(DEAD)" : "");
    }
    TraceStep(role_name_, " ", rank_, ": view ", view->version(), " applied:", workers);
  }
  const v1::Role my_role = role_name_ == "attention" ? v1::ROLE_ATTENTION : v1::ROLE_EXPERT;
  int attention = 0, expert = 0;
  ClusterShape shape;
  shape.live_attention.assign(view->num_attention_ranks(), false);
  shape.dead_attention.assign(view->num_attention_ranks(), false);
  shape.view_version = view->version();
  bool self_live = false;
  by_transport_rank_.clear();
  for (const v1::WorkerInfo& w : view->workers()) {
    const int peer = static_cast<int>(w.transport_rank());
    v1::WorkerId id;
    id.set_role(w.role());
    id.set_rank(w.rank());
    id.set_incarnation(w.incarnation());
    by_transport_rank_[peer] = id;
    if (w.role() == my_role && static_cast<int>(w.rank()) == rank_) {
      shape.self_state = w.state();
      if (self_peer_ < 0) {
        (void)transport_->SetSelf(peer);
        self_peer_ = peer;
      }
    } else {
      const std::string address = ConnectAddress(*transport_spec_, w.transport());
      auto it = connected_.find(peer);
      if (!address.empty() && (it == connected_.end() || it->second != address)) {
        if (absl::Status s = transport_->Connect(peer, address); !s.ok()) {
          std::cerr << role_name_ << " " << rank_ << ": connect to peer " << peer << ": " << s
                    << "\n";
        } else {
          connected_[peer] = address;
        }
      }
    }
    if (w.state() == v1::WORKER_STATE_DEAD) {
      if (w.role() == v1::ROLE_ATTENTION && w.rank() < shape.dead_attention.size()) {
        shape.dead_attention[w.rank()] = true;
      }
      continue;
    }
    if (w.role() == my_role && static_cast<int>(w.rank()) == rank_) self_live = true;
    if (w.role() == v1::ROLE_ATTENTION && w.rank() < shape.live_attention.size()) {
      shape.live_attention[w.rank()] = true;
    }
    (w.role() == v1::ROLE_ATTENTION ? attention : expert)++;
  }
  shape.elastic_ep = view->elastic_ep();
  elastic_ = shape.elastic_ep;
  shape.num_attention = static_cast<int>(view->num_attention_ranks());
  shape.num_expert = static_cast<int>(view->num_expert_ranks());
  shape.wire_dtype = FromProtoDType(view->transport().wire_dtype());
  const v1::ExpertPlacement& p = view->placement();
  // Every replica of every expert (ExpertReplicas.ep_ranks, the primary first): the
  // dispatch engine chooses among them (dataplane/dispatch/placement.h).
  std::vector<std::vector<int>> expert_ranks(p.expert_to_rank_size());
  bool placed =
      shape.num_expert > 0 && p.expert_to_rank_size() == static_cast<int>(p.num_experts());
  for (int e = 0; e < static_cast<int>(p.expert_to_rank_size()); ++e) {
    if (p.expert_to_rank(e).ep_ranks_size() == 0) placed = false;
    for (uint32_t r : p.expert_to_rank(e).ep_ranks())
      expert_ranks[e].push_back(static_cast<int>(r));
  }
  absl::StatusOr<Placement> placement =
      placed ? Placement::FromExpertRanks(shape.num_expert, expert_ranks, p.version())
             : absl::StatusOr<Placement>(absl::FailedPreconditionError("incomplete"));
  if (placement.ok()) shape.placement = *placement;
  // Once started, DP ranks may be missing: each DP rank's requests are its own, so the live
  // ones step without a dead one (every step names its DP ranks: WireHeader::dp_mask).
  const bool attention_ok =
      attention == shape.num_attention ||
      (started_ && attention > 0 && (my_role != v1::ROLE_ATTENTION || self_live));
  complete_ = placement.ok() && self_peer_ >= 0 && attention_ok && expert == shape.num_expert;
  if (elastic_ && (started_ || my_role == v1::ROLE_EXPERT)) {
    // Elastic EP: expert ranks may be missing while every expert has a live replica. An
    // expert rank exchanges with the attention ranks alone, so one that joins (or comes
    // back) while another expert rank is dead serves as soon as they are all live; the
    // attention ranks, which dispatch to every expert rank, still wait for the whole
    // cluster the first time.
    complete_ = placement.ok() && self_peer_ >= 0 && attention_ok;
  }
  if (nccl_ != nullptr && !ApplyNcclView(*view)) complete_ = false;
  if (complete_) started_ = true;
  return shape;
}

bool WorkerRuntime::ApplyNcclView(const v1::ClusterView& view) {
  if (view.transport().backend() != transport_spec_->name) {
    // Said once per backend the router names, not on every view (heartbeats bring many).
    if (mismatched_transport_ != view.transport().backend()) {
      mismatched_transport_ = view.transport().backend();
      std::cerr << role_name_ << " " << rank_ << ": started with --transport "
                << transport_spec_->name << ", but the router's transport is '"
                << mismatched_transport_ << "': this worker cannot serve\n";
    }
    return false;
  }
  mismatched_transport_.clear();
  const std::string& id = view.transport().nccl_unique_id();
  if (self_peer_ < 0 || id.empty()) return false;  // the router has no id for this set (yet)
  if (id != nccl_id_) {
    // A new set of live workers: a new communicator over them. Each id is tried once; a
    // failed Init waits for the next change of the set (the router's next id).
    nccl_id_ = id;
    const std::vector<int> members = NcclMembers(view);
    if (absl::Status s = nccl_->InitMembers(members, self_peer_, id); !s.ok()) {
      std::cerr << role_name_ << " " << rank_ << ": NCCL communicator of " << members.size()
                << " ranks: " << s << "\n";
    }
  }
  return nccl_->Healthy();
}

std::optional<v1::WorkerId> WorkerRuntime::WorkerAtTransportRank(int peer) const {
  auto it = by_transport_rank_.find(peer);
  if (it == by_transport_rank_.end()) return std::nullopt;
  return it->second;
}

void WorkerRuntime::Stop() {
  membership_.reset();
  if (server_) {
    server_->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(1));
    server_.reset();
  }
  if (metrics_server_) metrics_server_->Stop();
}

}  // namespace dxs
