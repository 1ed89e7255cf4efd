// ClusterRegistry: the router's membership table. Workers register (role, rank, addresses,
// expert claim), the registry validates the cluster and keeps a versioned ClusterView
// (workers ordered by (role, rank), expert placement, transport config) that the control
// plane service streams to every worker. Pure logic: no gRPC server, no threads of its own;
// the service drives lease expiry by calling ExpireLeases from a timer.
//
// Rules (each refusal names the problem; see control_plane.proto for the codes):
//  - One model: a registration must present the cluster's ModelFingerprint. If the options
//    leave it empty, the first accepted registration pins it for the registry's lifetime.
//  - Ranks: attention 0..M-1, expert 0..N-1. A live rank is held until it deregisters or
//    its lease expires; only a registration from the same grpc_address (the same worker
//    restarted on the same port) may take it over, as a new incarnation. An unset rank
//    gets the rank this address held before, else the lowest rank without a live worker.
//  - Joining (elastic EP only, once started()): an expert registration with rank N, the
//    current number of expert ranks, grows the cluster to N+1 expert ranks (an unset rank
//    does the same when every rank is live). It claims nothing unless it names experts;
//    the Rebalancer gives it some. A rank above N is refused with FAILED_PRECONDITION (ranks
//    join one at a time, in order), as is rank N before the cluster has started; without
//    elastic EP it is INVALID_ARGUMENT, out of range. Expert ranks never shrink: a joined
//    rank that deregisters leaves its number free for the next registration.
//  - One grpc_address per live worker.
//  - Placement: an expert rank's claim is RegisterRequest.loaded_experts, or, when empty,
//    the contiguous block [r*E/N, (r+1)*E/N) plus, with num_redundant_experts R > 0, the
//    replicas Placement::WithRedundantExperts places on rank r. Without redundant experts
//    live claims never overlap; with them, overlapping claims are replicas. The
//    registration that would make all N expert ranks live must leave no expert unclaimed.
//    The published ExpertPlacement lists, per expert, the live ranks that claimed it: the
//    primary first (the rank of the expert's contiguous block when it holds it), then
//    ascending (empty ep_ranks while unclaimed); its version increases whenever that map
//    changes. The dispatch engine's replica choice does not depend on this order.
//  - Lease: a worker silent (no Heartbeat) for longer than lease_timeout is marked
//    WORKER_STATE_DEAD. It stays in the view so peers see the rank is down, but it holds
//    nothing: its rank and its experts are free for the next registration, from any
//    address. A Heartbeat from it gets NOT_FOUND; it must Register again (recovery).
//  - transport_rank: attention rank r -> r, expert rank r -> M + r.
//
// Invariants: ClusterView.version starts at 1 (the empty cluster) and increases by one on
// every accepted change of anything in the view; incarnations increase across the whole
// registry and are never reused.
//
// Thread safety: every method may be called from any thread. WaitForVersion blocks without
// holding the lock; Shutdown wakes all waiters and makes later mutations fail with
// UNAVAILABLE.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "dataplane/dispatch/placement.h"
#include "dataplane/transport/transport_table.h"
#include "dxs/v1/control_plane.pb.h"

namespace dxs {

struct ClusterRegistryOptions {
  // M: configured attention (DP) ranks. At least 1.
  int num_attention_ranks = 1;
  // N: configured expert (EP) ranks, the cluster's size at start. At least 1. With elastic
  // EP more may join (ClusterRegistry::num_expert_ranks).
  int num_expert_ranks = 1;
  // E: routed experts per MoE layer. At least 1.
  int num_experts = 1;
  // R: expert slots beyond one per expert (vLLM's --num-redundant-experts), 0..E*(N-1).
  // An expert rank registering without a claim gets its block of
  // Placement::WithRedundantExperts(E, N, R): its contiguous block plus the replicas that
  // rule puts on it. 0: no replicas, the placement as before.
  int num_redundant_experts = 0;
  // Decoder layers, copied into ExpertPlacement.num_layers. Informational.
  int num_layers = 0;
  // The model the cluster serves. Both fields empty: pinned by the first registration.
  v1::ModelFingerprint fingerprint;
  // Transport backend: a row of the transport table (dataplane/transport/transports.def:
  // "ucx", "nccl" or "inproc"). Every worker must register the row's address field
  // (transport.ucx_worker_address for ucx, transport.nccl for nccl; none for inproc).
  std::string transport_backend = "ucx";
  // Makes the communicator ids of a backend with kCommunicatorPerView (nccl;
  // ClusterView.transport.nccl_unique_id): a new one for every new set of live workers, so
  // that a communicator is made again when a rank joins, dies, leaves or registers anew.
  // Required for such a backend (the router passes NewNcclUniqueId,
  // router/control_plane/nccl_unique_id.h); unused otherwise.
  std::function<absl::StatusOr<std::string>()> nccl_unique_id;
  // Element type of dispatch/combine payloads.
  v1::DType wire_dtype = v1::DTYPE_FLOAT32;
  absl::Duration heartbeat_interval = absl::Milliseconds(500);
  // Heartbeat silence after which a worker is DEAD. Greater than heartbeat_interval.
  absl::Duration lease_timeout = absl::Seconds(3);
  // Elastic EP (dxs-router --elastic-ep; ClusterView.elastic_ep): once every rank has been
  // live, the cluster stays complete while every attention rank is live and every expert
  // has a live replica; an expert rank holding experts may drain (the Rebalancer moves
  // them off) and SetPlacement accepts a placement that leaves dead ranks empty.
  bool elastic_ep = false;
  // The first view version, incarnation and placement version (each then counts up from
  // it). The router starts them at the wall clock's microseconds (dxs-router), so those of
  // a restarted router exceed its predecessor's: a worker's incarnation from the old router
  // never names a registration made with the new one (a stale process could otherwise
  // heartbeat, or deregister, in its place), and workers order the new views and
  // placements after the old ones. Tests keep 1.
  uint64_t first_version = 1;
  // Clock for registration and heartbeat times; tests substitute a fake one.
  std::function<absl::Time()> now = [] { return absl::Now(); };

  // INVALID_ARGUMENT naming the first bad field.
  absl::Status Validate() const;
};

// What the router knows about one worker beyond its WorkerInfo; for metrics and GetLoads.
struct WorkerStatus {
  v1::WorkerInfo info;
  // Expert ranks: the experts it claimed (sorted). Empty for attention ranks and once DEAD.
  std::vector<int> experts;
  // Registration or last accepted Heartbeat.
  absl::Time last_heartbeat;
  // Last reported by Heartbeat (zero until the first one); restart with each incarnation.
  v1::StepCounters counters;
  // When this incarnation registered, and its counters then (RegisterRequest.counters).
  absl::Time registered;
  v1::StepCounters registered_counters;
  v1::RankLoad load;
  uint64_t reported_view_version = 0;
  uint64_t reported_placement_version = 0;
  // From RegisterRequest.
  std::string software_version;
  v1::ModelInfo model_info;
};

// Registry-wide event counts since construction, for metrics.
struct RegistryCounters {
  uint64_t registrations_total = 0;
  uint64_t refusals_total = 0;
  uint64_t expirations_total = 0;
  uint64_t deregistrations_total = 0;
  // Expert ranks lost (lease expired or MarkDead) while holding experts, and when the last
  // one was.
  uint64_t expert_losses_total = 0;
  absl::Time last_expert_loss = absl::InfinitePast();
};

class ClusterRegistry {
 public:
  // Options must be valid (check with Validate first); an invalid set aborts.
  explicit ClusterRegistry(ClusterRegistryOptions options);

  ClusterRegistry(const ClusterRegistry&) = delete;
  ClusterRegistry& operator=(const ClusterRegistry&) = delete;

  // Admits a worker, or refuses it with INVALID_ARGUMENT, FAILED_PRECONDITION,
  // ALREADY_EXISTS, RESOURCE_EXHAUSTED or (after Shutdown) UNAVAILABLE.
  absl::StatusOr<v1::RegisterResponse> Register(const v1::RegisterRequest& request);

  // Renews the lease and records state, counters and load. NOT_FOUND for an unknown, DEAD
  // or stale (incarnation differs) worker; INVALID_ARGUMENT for an unset role or
  // incarnation, or a reported state other than JOINING, READY or DRAINING. Returns the
  // current view version.
  absl::StatusOr<v1::HeartbeatResponse> Heartbeat(const v1::HeartbeatRequest& request);

  // Marks a worker DRAINING (idempotent). NOT_FOUND as for Heartbeat (incarnation 0
  // matches any); FAILED_PRECONDITION for an expert rank holding experts, which have no
  // other replica yet.
  absl::StatusOr<v1::DrainResponse> Drain(const v1::DrainRequest& request);

  // Removes a worker (live or DEAD) from the view. NOT_FOUND for unknown or stale.
  absl::StatusOr<v1::DeregisterResponse> Deregister(const v1::DeregisterRequest& request);

  // Publishes `placement` (EPLB live rebalancing): every live expert rank's claim becomes what
  // the placement assigns it, and the view (with a placement version one above the
  // current, when the map changed) is returned. The caller has made every expert rank load
  // it first. From then on an expert rank registering without a claim (a restarted worker)
  // claims its experts of this placement instead of the default block. FAILED_PRECONDITION
  // while an expert rank is not live; INVALID_ARGUMENT for a
  // placement of another shape (with elastic EP one over fewer ranks is accepted: it was
  // computed before a rank joined, which it leaves empty); UNAVAILABLE after Shutdown.
  absl::StatusOr<v1::ClusterView> SetPlacement(const Placement& placement);

  // Marks the live worker `id` DEAD now (a peer reported it unreachable and it did not
  // answer), releasing its rank and experts as lease expiry does. NOT_FOUND as for
  // Heartbeat (incarnation 0 matches any).
  absl::StatusOr<v1::ClusterView> MarkDead(const v1::WorkerId& id);

  // Marks DEAD every live worker whose last heartbeat is older than the lease timeout at
  // `now`, releasing its rank and experts. Returns those workers as they are now (DEAD).
  std::vector<v1::WorkerInfo> ExpireLeases(absl::Time now);

  // Wakes every WaitForVersion and refuses later mutations with UNAVAILABLE. Idempotent.
  void Shutdown();
  bool IsShutDown() const;

  // The current view (a copy).
  v1::ClusterView View() const;
  uint64_t version() const;
  // Blocks until the view version exceeds `known_version` and returns that view, or
  // returns nullopt after `timeout` or once shut down.
  std::optional<v1::ClusterView> WaitForVersion(uint64_t known_version, absl::Duration timeout);

  // True when all M attention and N expert ranks have a live (JOINING, READY or DRAINING)
  // worker and the placement gives every expert an owner. With elastic EP, once that has
  // been true: every attention rank is live and every expert has a live replica.
  bool IsComplete() const;
  // Every rank has been live at once (IsComplete was true without elastic relaxation).
  bool started() const;

  // All workers in the view, ordered by (role, rank), DEAD ones included.
  std::vector<v1::WorkerInfo> Workers() const;
  // The same, with counters and load.
  std::vector<WorkerStatus> WorkerStatuses() const;
  RegistryCounters counters() const;
  // Expert ranks in the cluster: options().num_expert_ranks plus those that joined.
  int num_expert_ranks() const;

  const ClusterRegistryOptions& options() const { return options_; }

 private:
  // A rank's entry: empty (never registered or deregistered), live, or DEAD.
  using Slot = WorkerStatus;

  std::vector<std::optional<Slot>>& SlotsOf(v1::Role role) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The slot named by `id` if registered (any state) with a matching incarnation (0 matches
  // any), else NOT_FOUND saying why.
  absl::StatusOr<Slot*> FindLocked(const v1::WorkerId& id, bool allow_dead)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::StatusOr<v1::RegisterResponse> RegisterLocked(const v1::RegisterRequest& request)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Rebuilds view_ from the slots with version + 1; bumps the placement version when the
  // expert map changed. Wakes waiters.
  void PublishLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  v1::ExpertPlacement BuildPlacementLocked() const ABSL_SHARED_LOCKS_REQUIRED(mu_);

  bool IsCompleteLocked() const ABSL_SHARED_LOCKS_REQUIRED(mu_);
  // Marks a live slot DEAD (expiry or MarkDead) without publishing.
  void KillLocked(WorkerStatus* slot) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const ClusterRegistryOptions options_;
  const TransportSpec* const transport_;  // options_.transport_backend's row
  // The live workers (role, rank, incarnation) the current nccl_unique_id was made for.
  std::string nccl_members_ ABSL_GUARDED_BY(mu_);
  // Placement::WithRedundantExperts(E, N, R): the default claims.
  const Placement default_placement_;
  // The last placement SetPlacement published: the default claims from then on.
  std::optional<Placement> eplb_placement_ ABSL_GUARDED_BY(mu_);

  mutable absl::Mutex mu_;
  bool shut_down_ ABSL_GUARDED_BY(mu_) = false;
  // Every rank has been live at once (the cluster has served); elastic EP relaxes
  // completeness from then on.
  bool started_ ABSL_GUARDED_BY(mu_) = false;
  v1::ModelFingerprint fingerprint_ ABSL_GUARDED_BY(mu_);
  std::vector<std::optional<Slot>> attention_ ABSL_GUARDED_BY(mu_);
  std::vector<std::optional<Slot>> expert_ ABSL_GUARDED_BY(mu_);
  uint64_t next_incarnation_ ABSL_GUARDED_BY(mu_) = 1;
  v1::ClusterView view_ ABSL_GUARDED_BY(mu_);
  RegistryCounters counters_ ABSL_GUARDED_BY(mu_);
};

// Names a role in messages: "attention" or "expert".
const char* RoleName(v1::Role role);

}  // namespace dxs
