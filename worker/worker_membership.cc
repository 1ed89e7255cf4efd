#include "worker/worker_membership.h"

#include <grpcpp/grpcpp.h>

#include <iostream>

#include "common/grpc/cluster_channel.h"
#include "common/grpc/status_conversion.h"

namespace dxs {
namespace {

// Between registration attempts while the router does not answer yet (workers may start
// before it): a worker registers within 0.1 s of the router coming up.
constexpr absl::Duration kRegisterRetryInterval = absl::Milliseconds(100);
// One Register call: the router answers at once, so this only bounds a router that took the
// connection and hangs.
constexpr absl::Duration kRegisterRpcTimeout = absl::Seconds(5);
// The Deregister at shutdown: the router drops a silent worker at its lease anyway, so a
// process that is ending does not wait long for the answer.
constexpr absl::Duration kDeregisterRpcTimeout = absl::Seconds(1);
// Before watching again after the watch stream ended (the router went away or forgot this
// worker): a router that is down is not called in a tight loop.
constexpr absl::Duration kWatchRetryInterval = absl::Milliseconds(200);
// The heartbeat thread sleeps in slices this long, so that shutdown and HeartbeatNow are
// prompt; it is also the shortest heartbeat interval.
constexpr absl::Duration kHeartbeatSlice = absl::Milliseconds(50);
// One Heartbeat call: shorter than the router's default lease (3 s), so a call stuck on a
// dead connection gives way to the next heartbeat before the lease runs out.
constexpr absl::Duration kHeartbeatRpcTimeout = absl::Seconds(2);

}  // namespace

absl::StatusOr<std::unique_ptr<WorkerMembership>> WorkerMembership::Start(
    const std::string& router_address, v1::RegisterRequest request, ViewCallback on_view,
    CountersCallback fill_heartbeat, absl::Duration register_timeout,
    std::shared_ptr<grpc::ChannelCredentials> credentials, std::function<void()> before_reregister,
    std::function<void()> after_reregister) {
  std::unique_ptr<WorkerMembership> m(new WorkerMembership());
  m->stub_ = v1::ControlPlane::NewStub(MakeClusterChannel(
      router_address, credentials ? credentials : grpc::InsecureChannelCredentials()));
  m->request_ = std::move(request);
  m->on_view_ = std::move(on_view);
  m->fill_heartbeat_ = std::move(fill_heartbeat);
  m->before_reregister_ = std::move(before_reregister);
  m->after_reregister_ = std::move(after_reregister);
  const absl::Time deadline = absl::Now() + register_timeout;
  while (true) {
    absl::Status s = m->RegisterOnce();
    if (s.ok()) break;
    if (s.code() != absl::StatusCode::kUnavailable || absl::Now() > deadline) return s;
    absl::SleepFor(kRegisterRetryInterval);
  }
  m->watch_thread_ = std::thread([p = m.get()] { p->WatchLoop(); });
  m->heartbeat_thread_ = std::thread([p = m.get()] { p->HeartbeatLoop(); });
  return m;
}

WorkerMembership::~WorkerMembership() {
  stopping_ = true;
  {
    absl::MutexLock lock(&watch_mu_);
    if (watch_context_ != nullptr) watch_context_->TryCancel();
  }
  if (watch_thread_.joinable()) watch_thread_.join();
  if (heartbeat_thread_.joinable()) heartbeat_thread_.join();
  if (!registered_) return;  // refused: there is nothing to leave
  v1::DeregisterRequest req;
  {
    absl::MutexLock lock(&mu_);
    req.mutable_worker()->set_role(request_.role());
    req.mutable_worker()->set_rank(registration_.rank());
    req.mutable_worker()->set_incarnation(registration_.incarnation());
  }
  req.set_reason("shutdown");
  grpc::ClientContext ctx;
  ctx.set_deadline(absl::ToChronoTime(absl::Now() + kDeregisterRpcTimeout));
  v1::DeregisterResponse resp;
  (void)stub_->Deregister(&ctx, req, &resp);
}

v1::RegisterResponse WorkerMembership::registration() const {
  absl::MutexLock lock(&mu_);
  return registration_;
}

absl::Status WorkerMembership::RegisterOnce() {
  grpc::ClientContext ctx;
  ctx.set_deadline(absl::ToChronoTime(absl::Now() + kRegisterRpcTimeout));
  v1::RegisterResponse resp;
  grpc::Status s = stub_->Register(&ctx, request_, &resp);
  if (!s.ok()) return FromGrpcStatus(s);
  absl::MutexLock lock(&mu_);
  registration_ = resp;
  registered_ = true;
  // Keep the rank we were granted on re-registration.
  request_.set_rank(resp.rank());
  return absl::OkStatus();
}

void WorkerMembership::ReRegisterIfCurrent(uint64_t incarnation) {
  // Both the watch and the heartbeat notice a lost registration; only the first of them
  // (the one still holding the current incarnation) registers again.
  absl::MutexLock lock(&reregister_mu_);
  {
    absl::MutexLock l(&mu_);
    if (registration_.incarnation() != incarnation) return;
  }
  std::cerr << "membership: router forgot this worker; registering again\n";
  if (fill_heartbeat_) {  // the counters go on from their totals (RegisterRequest.counters)
    v1::HeartbeatRequest now;
    fill_heartbeat_(&now);
    absl::MutexLock l(&mu_);
    *request_.mutable_counters() = now.counters();
  }
  if (before_reregister_) before_reregister_();
  if (absl::Status r = RegisterOnce(); !r.ok()) {
    std::cerr << "membership: re-registration failed: " << r << "\n";
  }
  if (after_reregister_) after_reregister_();
}

void WorkerMembership::WatchLoop() {
  uint64_t known = 0;
  while (!stopping_) {
    grpc::ClientContext ctx;
    {
      absl::MutexLock lock(&watch_mu_);
      if (stopping_) break;
      watch_context_ = &ctx;
    }
    v1::WatchClusterRequest req;
    req.set_known_version(known);
    uint64_t watched_incarnation;
    {
      absl::MutexLock lock(&mu_);
      req.mutable_worker()->set_role(request_.role());
      req.mutable_worker()->set_rank(registration_.rank());
      req.mutable_worker()->set_incarnation(registration_.incarnation());
      watched_incarnation = registration_.incarnation();
    }
    auto reader = stub_->WatchCluster(&ctx, req);
    v1::ClusterView view;
    while (reader->Read(&view)) {
      known = view.version();
      on_view_(view);
    }
    grpc::Status s = reader->Finish();
    {
      absl::MutexLock lock(&watch_mu_);
      watch_context_ = nullptr;
    }
    if (stopping_) break;
    // The router went away or forgot this worker: it may be a new router whose versions
    // are unrelated to the last one's, so the next watch asks for its current view.
    known = 0;
    if (s.error_code() == grpc::StatusCode::NOT_FOUND) ReRegisterIfCurrent(watched_incarnation);
    absl::SleepFor(kWatchRetryInterval);
  }
}

void WorkerMembership::HeartbeatLoop() {
  const uint32_t slice_ms = static_cast<uint32_t>(absl::ToInt64Milliseconds(kHeartbeatSlice));
  while (!stopping_) {
    uint32_t interval_ms;
    v1::HeartbeatRequest req;
    {
      absl::MutexLock lock(&mu_);
      interval_ms = std::max<uint32_t>(registration_.heartbeat_interval_ms(), slice_ms);
      req.mutable_worker()->set_role(request_.role());
      req.mutable_worker()->set_rank(registration_.rank());
      req.mutable_worker()->set_incarnation(registration_.incarnation());
    }
    // Sleep in small slices so shutdown is prompt.
    for (uint32_t waited = 0; waited < interval_ms && !stopping_ && !heartbeat_soon_;
         waited += slice_ms) {
      absl::SleepFor(kHeartbeatSlice);
    }
    heartbeat_soon_ = false;
    if (stopping_) break;
    if (fill_heartbeat_) fill_heartbeat_(&req);
    grpc::ClientContext ctx;
    ctx.set_deadline(absl::ToChronoTime(absl::Now() + kHeartbeatRpcTimeout));
    v1::HeartbeatResponse resp;
    grpc::Status s = stub_->Heartbeat(&ctx, req, &resp);
    if (s.error_code() == grpc::StatusCode::NOT_FOUND) {
      ReRegisterIfCurrent(req.worker().incarnation());
    }
  }
}

absl::Status WorkerMembership::ReportUnreachable(const v1::WorkerId& peer,
                                                 const std::string& reason,
                                                 absl::Duration timeout) {
  v1::ReportUnreachableRequest req;
  {
    absl::MutexLock lock(&mu_);
    req.mutable_reporter()->set_role(request_.role());
    req.mutable_reporter()->set_rank(registration_.rank());
    req.mutable_reporter()->set_incarnation(registration_.incarnation());
  }
  *req.mutable_peer() = peer;
  req.set_reason(reason);
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() +
                   std::chrono::milliseconds(absl::ToInt64Milliseconds(timeout)));
  v1::ReportUnreachableResponse resp;
  grpc::Status s = stub_->ReportUnreachable(&ctx, req, &resp);
  if (!s.ok())
    return absl::Status(static_cast<absl::StatusCode>(s.error_code()), s.error_message());
  return absl::OkStatus();
}

}  // namespace dxs
