#include "router/control_plane/cluster_registry.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace dxs {
namespace {

bool IsValidRole(v1::Role role) { return role == v1::ROLE_ATTENTION || role == v1::ROLE_EXPERT; }

bool IsLive(const std::optional<WorkerStatus>& slot) {
  return slot.has_value() && slot->info.state() != v1::WORKER_STATE_DEAD;
}

// The default claims: the contiguous blocks plus the redundant experts' replicas. Options
// must be valid.
Placement DefaultPlacement(const ClusterRegistryOptions& o) {
  absl::StatusOr<Placement> p = Placement::WithRedundantExperts(
      o.num_experts, o.num_expert_ranks, std::max(o.num_redundant_experts, 0));
  return p.ok() ? *std::move(p) : Placement::Contiguous(o.num_experts, o.num_expert_ranks);
}

// Sorted ids as ranges: "0-3,5,7-8"; "none" when empty.
std::string FormatExperts(const std::vector<int>& sorted) {
  if (sorted.empty()) return "none";
  std::vector<std::string> parts;
  for (size_t i = 0; i < sorted.size();) {
    size_t j = i;
    while (j + 1 < sorted.size() && sorted[j + 1] == sorted[j] + 1) ++j;
    parts.push_back(j == i ? absl::StrCat(sorted[i]) : absl::StrCat(sorted[i], "-", sorted[j]));
    i = j + 1;
  }
  return absl::StrJoin(parts, ",");
}

std::string FormatFingerprint(const v1::ModelFingerprint& fp) {
  auto or_none = [](const std::string& s) { return s.empty() ? std::string("(none)") : s; };
  return absl::StrCat("checkpoint ", or_none(fp.checkpoint_fingerprint()), " config ",
                      or_none(fp.config_fingerprint()));
}

bool SameFingerprint(const v1::ModelFingerprint& a, const v1::ModelFingerprint& b) {
  return a.checkpoint_fingerprint() == b.checkpoint_fingerprint() &&
         a.config_fingerprint() == b.config_fingerprint();
}

bool SameExpertMap(const v1::ExpertPlacement& a, const v1::ExpertPlacement& b) {
  if (a.expert_to_rank_size() != b.expert_to_rank_size()) return false;
  for (int e = 0; e < a.expert_to_rank_size(); ++e) {
    const auto& ra = a.expert_to_rank(e).ep_ranks();
    const auto& rb = b.expert_to_rank(e).ep_ranks();
    if (!std::equal(ra.begin(), ra.end(), rb.begin(), rb.end())) return false;
  }
  return true;
}

}  // namespace

const char* RoleName(v1::Role role) {
  switch (role) {
    case v1::ROLE_ATTENTION:
      return "attention";
    case v1::ROLE_EXPERT:
      return "expert";
    default:
      return "unspecified-role";
  }
}

absl::Status ClusterRegistryOptions::Validate() const {
  if (num_attention_ranks < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("num_attention_ranks must be >= 1, got ", num_attention_ranks));
  }
  if (num_expert_ranks < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("num_expert_ranks must be >= 1, got ", num_expert_ranks));
  }
  if (num_experts < 1) {
    return absl::InvalidArgumentError(absl::StrCat("num_experts must be >= 1, got ", num_experts));
  }
  const int64_t most_redundant = int64_t{num_experts} * (num_expert_ranks - 1);
  if (num_redundant_experts < 0 || num_redundant_experts > most_redundant) {
    return absl::InvalidArgumentError(absl::StrCat(
        "num_redundant_experts must be in 0..", most_redundant, " (", num_experts, " experts on ",
        num_expert_ranks, " EP ranks; at most every rank holds every expert), got ",
        num_redundant_experts));
  }
  if (num_layers < 0) {
    return absl::InvalidArgumentError(absl::StrCat("num_layers must be >= 0, got ", num_layers));
  }
  const TransportSpec* transport = FindTransport(transport_backend);
  if (transport == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat("transport backend must be ", TransportNames(),
                                                   ", got '", transport_backend, "'"));
  }
  if (transport->Has(kCommunicatorPerView) && !nccl_unique_id) {
    return absl::InvalidArgumentError(
        absl::StrCat("the ", transport->name, " transport backend needs an nccl_unique_id source"));
  }
  if (wire_dtype != v1::DTYPE_FLOAT32 && wire_dtype != v1::DTYPE_BFLOAT16 &&
      wire_dtype != v1::DTYPE_FLOAT16 && wire_dtype != v1::DTYPE_FLOAT8_E4M3) {
    return absl::InvalidArgumentError(
        "wire dtype must be float32, bfloat16, float16 or float8_e4m3");
  }
  if (heartbeat_interval <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError("heartbeat interval must be positive");
  }
  if (lease_timeout <= heartbeat_interval) {
    return absl::InvalidArgumentError(absl::StrCat(
        "lease timeout (", absl::FormatDuration(lease_timeout),
        ") must exceed the heartbeat interval (", absl::FormatDuration(heartbeat_interval), ")"));
  }
  if (!now) return absl::InvalidArgumentError("clock (now) must be set");
  return absl::OkStatus();
}

ClusterRegistry::ClusterRegistry(ClusterRegistryOptions options)
    : options_(std::move(options)),
      transport_(FindTransport(options_.transport_backend)),
      default_placement_(DefaultPlacement(options_)) {
  if (absl::Status s = options_.Validate(); !s.ok()) {
    std::fprintf(stderr, "ClusterRegistry: invalid options: %s\n", s.ToString().c_str());
    std::abort();
  }
  absl::MutexLock lock(&mu_);
  fingerprint_ = options_.fingerprint;
  attention_.resize(options_.num_attention_ranks);
  expert_.resize(options_.num_expert_ranks);
  next_incarnation_ = std::max<uint64_t>(options_.first_version, 1);
  view_.set_version(next_incarnation_ - 1);
  *view_.mutable_placement() = BuildPlacementLocked();  // version 0: nothing placed yet
  PublishLocked();  // view version first_version (1 by default): the empty cluster
}

std::vector<std::optional<WorkerStatus>>& ClusterRegistry::SlotsOf(v1::Role role) {
  return role == v1::ROLE_ATTENTION ? attention_ : expert_;
}

absl::StatusOr<v1::RegisterResponse> ClusterRegistry::Register(const v1::RegisterRequest& request) {
  absl::MutexLock lock(&mu_);
  absl::StatusOr<v1::RegisterResponse> response = RegisterLocked(request);
  if (response.ok()) {
    ++counters_.registrations_total;
  } else {
    ++counters_.refusals_total;
  }
  return response;
}

absl::StatusOr<v1::RegisterResponse> ClusterRegistry::RegisterLocked(
    const v1::RegisterRequest& request) {
  if (shut_down_) return absl::UnavailableError("the router is shutting down");

  // Checks that need no cluster state.
  const v1::Role role = request.role();
  if (!IsValidRole(role)) {
    return absl::InvalidArgumentError("role is required: ROLE_ATTENTION or ROLE_EXPERT");
  }
  const char* role_name = RoleName(role);
  if (request.grpc_address().empty()) {
    return absl::InvalidArgumentError(
        "grpc_address is required: host:port of the worker's gRPC server");
  }
  const int num_ranks =
      role == v1::ROLE_ATTENTION ? options_.num_attention_ranks : static_cast<int>(expert_.size());
  // Elastic EP: once the cluster has started, a new expert rank may join with the next
  // rank number (num_ranks); the cluster then has one expert rank more.
  const bool may_join = role == v1::ROLE_EXPERT && options_.elastic_ep;
  bool joins = false;
  if (request.has_rank() && request.rank() >= static_cast<uint32_t>(num_ranks)) {
    if (!may_join) {
      return absl::InvalidArgumentError(absl::StrCat(
          role_name, " rank ", request.rank(), " is out of range: the cluster has ", num_ranks, " ",
          role_name, " ranks (0..", num_ranks - 1, ")",
          role == v1::ROLE_EXPERT ? "; new expert ranks join only with dxs-router --elastic-ep"
                                  : ""));
    }
    if (request.rank() > static_cast<uint32_t>(num_ranks)) {
      return absl::FailedPreconditionError(
          absl::StrCat("expert rank ", request.rank(), " cannot join: the cluster has ", num_ranks,
                       " expert ranks (0..", num_ranks - 1, "), so the next one to join is rank ",
                       num_ranks, "; ranks join one at a time, in order"));
    }
    if (!started_) {
      return absl::FailedPreconditionError(
          absl::StrCat("expert rank ", request.rank(), " cannot join yet: expert ranks 0..",
                       num_ranks - 1, " and every attention rank must all have been live first"));
    }
    joins = true;
  }
  if (!HasRegisteredAddress(*transport_, request.transport())) {
    return absl::InvalidArgumentError(
        absl::StrCat("transport.", transport_->address_field,
                     " is required: the cluster's transport backend is ", transport_->name));
  }
  if (role == v1::ROLE_ATTENTION && request.loaded_experts_size() > 0) {
    return absl::InvalidArgumentError(
        "loaded_experts is for expert ranks; an attention worker must leave it empty");
  }
  std::vector<int> claim;
  for (uint32_t e : request.loaded_experts()) {
    if (e >= static_cast<uint32_t>(options_.num_experts)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "loaded_experts: expert ", e, " is outside [0, ", options_.num_experts, ")"));
    }
    claim.push_back(static_cast<int>(e));
  }
  std::sort(claim.begin(), claim.end());
  if (auto dup = std::adjacent_find(claim.begin(), claim.end()); dup != claim.end()) {
    return absl::InvalidArgumentError(
        absl::StrCat("loaded_experts: expert ", *dup, " is listed twice"));
  }

  // One model.
  const bool pinned =
      !fingerprint_.checkpoint_fingerprint().empty() || !fingerprint_.config_fingerprint().empty();
  if (pinned && !SameFingerprint(request.fingerprint(), fingerprint_)) {
    return absl::FailedPreconditionError(
        absl::StrCat("different checkpoint: worker has ", FormatFingerprint(request.fingerprint()),
                     ", cluster has ", FormatFingerprint(fingerprint_)));
  }

  // The rank.
  std::vector<std::optional<WorkerStatus>>& slots = SlotsOf(role);
  int rank = -1;
  if (request.has_rank()) {
    rank = static_cast<int>(request.rank());
    const std::optional<WorkerStatus> empty;
    const std::optional<WorkerStatus>& holder = joins ? empty : slots[rank];
    if (IsLive(holder) && holder->info.grpc_address() != request.grpc_address()) {
      return absl::AlreadyExistsError(
          absl::StrCat(role_name, " rank ", rank, " is held by a live worker at ",
                       holder->info.grpc_address(), " (incarnation ", holder->info.incarnation(),
                       "); only a worker at that address may replace it before its lease ends"));
    }
  } else {
    for (int r = 0; r < num_ranks && rank < 0; ++r) {
      if (slots[r].has_value() && slots[r]->info.grpc_address() == request.grpc_address()) {
        rank = r;  // the same worker again: give it back its rank
      }
    }
    for (int r = 0; r < num_ranks && rank < 0; ++r) {
      if (!IsLive(slots[r])) rank = r;
    }
    if (rank < 0 && may_join && started_) {
      rank = num_ranks;  // elastic EP: the next rank number joins
      joins = true;
    }
    if (rank < 0) {
      return absl::ResourceExhaustedError(absl::StrCat("no free ", role_name, " rank: all ",
                                                       num_ranks, " are held by live workers"));
    }
  }

  // One live worker per address.
  for (v1::Role other_role : {v1::ROLE_ATTENTION, v1::ROLE_EXPERT}) {
    const std::vector<std::optional<WorkerStatus>>& other = SlotsOf(other_role);
    for (size_t r = 0; r < other.size(); ++r) {
      if (other_role == role && static_cast<int>(r) == rank) continue;
      if (IsLive(other[r]) && other[r]->info.grpc_address() == request.grpc_address()) {
        return absl::AlreadyExistsError(absl::StrCat("grpc_address ", request.grpc_address(),
                                                     " is already registered by live ",
                                                     RoleName(other_role), " rank ", r));
      }
    }
  }

  // The expert claim against the other live expert ranks.
  if (role == v1::ROLE_EXPERT) {
    if (claim.empty()) {
      const Placement& defaults = eplb_placement_ ? *eplb_placement_ : default_placement_;
      if (rank < defaults.num_ranks()) claim = defaults.experts_of(rank);
      // Elastic EP: experts that moved to live ranks while this one was away stay there; a
      // restarted rank comes back empty and is rebalanced onto.
      if (options_.elastic_ep && started_) claim.clear();
    }
    // With redundant experts an overlap is a replica; without, a conflict.
    const bool replicas = options_.num_redundant_experts > 0;
    std::vector<int> owner(options_.num_experts, -1);
    int num_live_expert_ranks = 1;  // this one
    for (int q = 0; q < static_cast<int>(expert_.size()); ++q) {
      if (q == rank || !IsLive(expert_[q])) continue;
      ++num_live_expert_ranks;
      for (int e : expert_[q]->experts) owner[e] = q;
    }
    std::vector<std::string> overlaps;
    for (int e : claim) {
      if (owner[e] >= 0 && !replicas) {
        overlaps.push_back(absl::StrCat("expert ", e, " already held by EP rank ", owner[e]));
      }
    }
    if (!overlaps.empty()) {
      constexpr size_t kMaxListed = 8;
      const size_t num_overlaps = overlaps.size();
      if (num_overlaps > kMaxListed) overlaps.resize(kMaxListed);
      return absl::FailedPreconditionError(absl::StrCat(
          "experts overlapping: ", absl::StrJoin(overlaps, "; "),
          num_overlaps > kMaxListed ? absl::StrCat("; ... (", num_overlaps, " in all)") : "",
          " (EP rank ", rank, " claims ", FormatExperts(claim), ")"));
    }
    if (num_live_expert_ranks == num_ranks && !(options_.elastic_ep && started_)) {
      for (int e : claim) owner[e] = rank;
      std::vector<int> missing;
      for (int e = 0; e < options_.num_experts; ++e) {
        if (owner[e] < 0) missing.push_back(e);
      }
      if (!missing.empty()) {
        return absl::FailedPreconditionError(absl::StrCat(
            "experts missing: ", FormatExperts(missing), " claimed by no EP rank; EP rank ", rank,
            " (claiming ", FormatExperts(claim), ") is the last of ", num_ranks,
            " and the placement must cover experts 0-", options_.num_experts - 1));
      }
    }
  }

  // Accepted.
  if (!pinned) fingerprint_ = request.fingerprint();
  WorkerStatus slot;
  v1::WorkerInfo& info = slot.info;
  info.set_role(role);
  info.set_rank(static_cast<uint32_t>(rank));
  info.set_incarnation(next_incarnation_++);
  info.set_state(v1::WORKER_STATE_JOINING);
  info.set_grpc_address(request.grpc_address());
  info.set_metrics_address(request.metrics_address());
  *info.mutable_transport() = request.transport();
  info.set_transport_rank(role == v1::ROLE_ATTENTION
                              ? static_cast<uint32_t>(rank)
                              : static_cast<uint32_t>(options_.num_attention_ranks + rank));
  *info.mutable_capacity() = request.capacity();
  slot.experts = std::move(claim);
  slot.last_heartbeat = options_.now();
  slot.registered = slot.last_heartbeat;
  slot.registered_counters = request.counters();
  slot.software_version = request.software_version();
  slot.model_info = request.model_info();
  const uint64_t incarnation = info.incarnation();
  if (joins) {
    slots.resize(rank + 1);
    std::fprintf(stderr, "dxs-router: expert rank %d joins: the cluster has %d expert ranks\n",
                 rank, rank + 1);
  }
  slots[rank] = std::move(slot);
  PublishLocked();

  v1::RegisterResponse response;
  response.set_cluster_view_version(view_.version());
  response.set_rank(static_cast<uint32_t>(rank));
  response.set_incarnation(incarnation);
  *response.mutable_placement() = view_.placement();
  *response.mutable_transport() = view_.transport();
  response.set_heartbeat_interval_ms(
      static_cast<uint32_t>(absl::ToInt64Milliseconds(options_.heartbeat_interval)));
  response.set_lease_timeout_ms(
      static_cast<uint32_t>(absl::ToInt64Milliseconds(options_.lease_timeout)));
  return response;
}

absl::StatusOr<WorkerStatus*> ClusterRegistry::FindLocked(const v1::WorkerId& id, bool allow_dead) {
  if (!IsValidRole(id.role())) {
    return absl::InvalidArgumentError("worker.role is required: ROLE_ATTENTION or ROLE_EXPERT");
  }
  const char* role_name = RoleName(id.role());
  std::vector<std::optional<WorkerStatus>>& slots = SlotsOf(id.role());
  if (id.rank() >= slots.size() || !slots[id.rank()].has_value()) {
    return absl::NotFoundError(
        absl::StrCat(role_name, " rank ", id.rank(), " is not registered; Register again"));
  }
  WorkerStatus& slot = *slots[id.rank()];
  if (id.incarnation() != 0 && id.incarnation() != slot.info.incarnation()) {
    return absl::NotFoundError(absl::StrCat(role_name, " rank ", id.rank(), ": incarnation ",
                                            id.incarnation(), " is stale (current ",
                                            slot.info.incarnation(), "); Register again"));
  }
  if (!allow_dead && slot.info.state() == v1::WORKER_STATE_DEAD) {
    return absl::NotFoundError(
        absl::StrCat(role_name, " rank ", id.rank(), ": lease expired (no heartbeat for more than ",
                     absl::FormatDuration(options_.lease_timeout), "); Register again"));
  }
  return &slot;
}

absl::StatusOr<v1::HeartbeatResponse> ClusterRegistry::Heartbeat(
    const v1::HeartbeatRequest& request) {
  absl::MutexLock lock(&mu_);
  if (shut_down_) return absl::UnavailableError("the router is shutting down");
  if (IsValidRole(request.worker().role()) && request.worker().incarnation() == 0) {
    return absl::InvalidArgumentError(
        "worker.incarnation is required: the value from RegisterResponse");
  }
  absl::StatusOr<WorkerStatus*> found = FindLocked(request.worker(), /*allow_dead=*/false);
  if (!found.ok()) return found.status();
  WorkerStatus& slot = **found;

  v1::WorkerState state = slot.info.state();
  switch (request.state()) {
    case v1::WORKER_STATE_UNSPECIFIED:
      break;
    case v1::WORKER_STATE_JOINING:
    case v1::WORKER_STATE_READY:
      // A drain is the router's decision; the worker's own report does not undo it.
      if (state != v1::WORKER_STATE_DRAINING) state = request.state();
      break;
    case v1::WORKER_STATE_DRAINING:
      state = v1::WORKER_STATE_DRAINING;
      break;
    default:
      return absl::InvalidArgumentError(
          "state must be WORKER_STATE_JOINING, WORKER_STATE_READY or WORKER_STATE_DRAINING");
  }
  slot.last_heartbeat = options_.now();
  slot.counters = request.counters();
  slot.load = request.load();
  slot.reported_view_version = request.cluster_view_version();
  slot.reported_placement_version = request.placement_version();
  if (state != slot.info.state()) {
    slot.info.set_state(state);
    PublishLocked();
  }
  v1::HeartbeatResponse response;
  response.set_cluster_view_version(view_.version());
  return response;
}

absl::StatusOr<v1::DrainResponse> ClusterRegistry::Drain(const v1::DrainRequest& request) {
  absl::MutexLock lock(&mu_);
  if (shut_down_) return absl::UnavailableError("the router is shutting down");
  absl::StatusOr<WorkerStatus*> found = FindLocked(request.worker(), /*allow_dead=*/false);
  if (!found.ok()) return found.status();
  WorkerStatus& slot = **found;
  if (slot.info.role() == v1::ROLE_EXPERT && !slot.experts.empty() && options_.elastic_ep) {
    int others = 0;
    for (size_t r = 0; r < expert_.size(); ++r) {
      if (r != slot.info.rank() && IsLive(expert_[r]) &&
          expert_[r]->info.state() != v1::WORKER_STATE_DRAINING) {
        ++others;
      }
    }
    if (others == 0) {
      return absl::FailedPreconditionError(
          absl::StrCat("expert rank ", slot.info.rank(),
                       " is the last expert rank not draining; its experts have nowhere to go"));
    }
  } else if (slot.info.role() == v1::ROLE_EXPERT && !slot.experts.empty()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "expert rank ", slot.info.rank(), " holds experts ", FormatExperts(slot.experts),
        ", which have no other replica; deregister it instead"));
  }
  if (slot.info.state() != v1::WORKER_STATE_DRAINING) {
    slot.info.set_state(v1::WORKER_STATE_DRAINING);
    PublishLocked();
  }
  v1::DrainResponse response;
  response.set_cluster_view_version(view_.version());
  response.set_num_inflight_requests(slot.load.num_running_requests() +
                                     slot.load.num_queued_requests());
  return response;
}

absl::StatusOr<v1::DeregisterResponse> ClusterRegistry::Deregister(
    const v1::DeregisterRequest& request) {
  absl::MutexLock lock(&mu_);
  if (shut_down_) return absl::UnavailableError("the router is shutting down");
  absl::StatusOr<WorkerStatus*> found = FindLocked(request.worker(), /*allow_dead=*/true);
  if (!found.ok()) return found.status();
  SlotsOf(request.worker().role())[request.worker().rank()].reset();
  ++counters_.deregistrations_total;
  PublishLocked();
  v1::DeregisterResponse response;
  response.set_cluster_view_version(view_.version());
  return response;
}

std::vector<v1::WorkerInfo> ClusterRegistry::ExpireLeases(absl::Time now) {
  absl::MutexLock lock(&mu_);
  std::vector<v1::WorkerInfo> expired;
  if (shut_down_) return expired;
  for (auto* slots : {&attention_, &expert_}) {
    for (std::optional<WorkerStatus>& slot : *slots) {
      if (!IsLive(slot) || now - slot->last_heartbeat <= options_.lease_timeout) continue;
      KillLocked(&*slot);
      expired.push_back(slot->info);
    }
  }
  if (!expired.empty()) {
    counters_.expirations_total += expired.size();
    PublishLocked();
  }
  return expired;
}

void ClusterRegistry::KillLocked(WorkerStatus* slot) {
  if (slot->info.role() == v1::ROLE_EXPERT && !slot->experts.empty()) {
    ++counters_.expert_losses_total;
    counters_.last_expert_loss = options_.now();
  }
  slot->info.set_state(v1::WORKER_STATE_DEAD);
  slot->experts.clear();
}

absl::StatusOr<v1::ClusterView> ClusterRegistry::MarkDead(const v1::WorkerId& id) {
  absl::MutexLock lock(&mu_);
  if (shut_down_) return absl::UnavailableError("the router is shutting down");
  absl::StatusOr<WorkerStatus*> found = FindLocked(id, /*allow_dead=*/false);
  if (!found.ok()) return found.status();
  KillLocked(*found);
  ++counters_.expirations_total;
  PublishLocked();
  return view_;
}

absl::StatusOr<v1::ClusterView> ClusterRegistry::SetPlacement(const Placement& placement) {
  absl::MutexLock lock(&mu_);
  if (shut_down_) return absl::UnavailableError("the router is shutting down");
  const int num_ranks = static_cast<int>(expert_.size());
  // Elastic EP: a placement computed before a rank joined leaves the new rank empty.
  const bool fewer_ranks = options_.elastic_ep && placement.num_ranks() < num_ranks;
  if (placement.num_experts() != options_.num_experts ||
      (placement.num_ranks() != num_ranks && !fewer_ranks)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "placement of ", placement.num_experts(), " experts over ", placement.num_ranks(),
        " ranks; the cluster has ", options_.num_experts, " over ", num_ranks));
  }
  auto experts_of = [&placement](int r) {
    return r < placement.num_ranks() ? placement.experts_of(r) : std::vector<int>();
  };
  for (int r = 0; r < num_ranks; ++r) {
    // Elastic EP: a rank that is not live may be left out (given no experts).
    const bool may_skip = options_.elastic_ep && experts_of(r).empty();
    if (!IsLive(expert_[r]) && !may_skip) {
      return absl::FailedPreconditionError(absl::StrCat("expert rank ", r, " is not live"));
    }
  }
  for (int r = 0; r < num_ranks; ++r) {
    if (IsLive(expert_[r])) expert_[r]->experts = experts_of(r);
  }
  eplb_placement_ = placement;
  PublishLocked();
  return view_;
}

void ClusterRegistry::Shutdown() {
  absl::MutexLock lock(&mu_);
  shut_down_ = true;  // WaitForVersion's condition reads it; the unlock wakes waiters
}

bool ClusterRegistry::IsShutDown() const {
  absl::MutexLock lock(&mu_);
  return shut_down_;
}

v1::ExpertPlacement ClusterRegistry::BuildPlacementLocked() const {
  v1::ExpertPlacement placement;
  placement.set_version(view_.placement().version());
  placement.set_num_layers(static_cast<uint32_t>(options_.num_layers));
  placement.set_num_experts(static_cast<uint32_t>(options_.num_experts));
  placement.set_num_expert_ranks(static_cast<uint32_t>(expert_.size()));
  for (int e = 0; e < options_.num_experts; ++e) placement.add_expert_to_rank();
  for (size_t r = 0; r < expert_.size(); ++r) {
    if (!IsLive(expert_[r])) continue;
    for (int e : expert_[r]->experts) {
      placement.mutable_expert_to_rank(e)->add_ep_ranks(static_cast<uint32_t>(r));
    }
  }
  // The primary first: the rank whose contiguous block holds the expert, if it holds it
  // (one rank per expert without replicas: nothing moves).
  for (int e = 0; e < options_.num_experts; ++e) {
    auto* ranks = placement.mutable_expert_to_rank(e)->mutable_ep_ranks();
    const uint32_t home = static_cast<uint32_t>(default_placement_.owner(e));
    auto it = std::find(ranks->begin(), ranks->end(), home);
    if (it != ranks->end()) std::rotate(ranks->begin(), it, it + 1);
  }
  return placement;
}

void ClusterRegistry::PublishLocked() {
  v1::ClusterView view;
  view.set_version(view_.version() + 1);
  for (const auto* slots : {&attention_, &expert_}) {
    for (const std::optional<WorkerStatus>& slot : *slots) {
      if (slot.has_value()) *view.add_workers() = slot->info;
    }
  }
  v1::ExpertPlacement placement = BuildPlacementLocked();
  if (!SameExpertMap(placement, view_.placement())) {
    placement.set_version(
        std::max<uint64_t>(view_.placement().version() + 1, options_.first_version));
  }
  *view.mutable_placement() = std::move(placement);
  view.mutable_transport()->set_backend(options_.transport_backend);
  view.mutable_transport()->set_wire_dtype(options_.wire_dtype);
  if (transport_->Has(kCommunicatorPerView)) {
    // One communicator per set of live workers: the same id while the set stands, a new
    // one when a rank joins, dies, leaves or comes back as a new incarnation.
    std::string members;
    for (const v1::WorkerInfo& w : view.workers()) {
      if (w.state() == v1::WORKER_STATE_DEAD) continue;
      absl::StrAppend(&members, static_cast<int>(w.role()), ":", w.rank(), ":", w.incarnation(),
                      ";");
    }
    if (members.empty()) {
      nccl_members_.clear();
    } else if (members == nccl_members_ && !view_.transport().nccl_unique_id().empty()) {
      view.mutable_transport()->set_nccl_unique_id(view_.transport().nccl_unique_id());
    } else {
      absl::StatusOr<std::string> id = options_.nccl_unique_id();
      if (id.ok()) {
        view.mutable_transport()->set_nccl_unique_id(*std::move(id));
        nccl_members_ = std::move(members);
      } else {
        // Workers see no id and cannot make the communicator; the next change tries again.
        std::fprintf(stderr, "cluster view %llu: no NCCL unique id: %s\n",
                     static_cast<unsigned long long>(view.version()),
                     id.status().ToString().c_str());
        nccl_members_.clear();
      }
    }
  }
  view.set_num_attention_ranks(static_cast<uint32_t>(options_.num_attention_ranks));
  view.set_num_expert_ranks(static_cast<uint32_t>(expert_.size()));
  *view.mutable_fingerprint() = fingerprint_;
  view.set_elastic_ep(options_.elastic_ep);
  view_ = std::move(view);
  if (!started_ && IsCompleteLocked()) started_ = true;
}

v1::ClusterView ClusterRegistry::View() const {
  absl::MutexLock lock(&mu_);
  return view_;
}

uint64_t ClusterRegistry::version() const {
  absl::MutexLock lock(&mu_);
  return view_.version();
}

std::optional<v1::ClusterView> ClusterRegistry::WaitForVersion(uint64_t known_version,
                                                               absl::Duration timeout) {
  absl::MutexLock lock(&mu_);
  auto newer_or_shut_down = [this, known_version]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return shut_down_ || view_.version() > known_version;
  };
  mu_.AwaitWithTimeout(absl::Condition(&newer_or_shut_down), timeout);
  if (shut_down_ || view_.version() <= known_version) return std::nullopt;
  return view_;
}

bool ClusterRegistry::started() const {
  absl::MutexLock lock(&mu_);
  return started_;
}

bool ClusterRegistry::IsComplete() const {
  absl::MutexLock lock(&mu_);
  return IsCompleteLocked();
}

bool ClusterRegistry::IsCompleteLocked() const {
  const bool elastic = options_.elastic_ep && started_;
  // Once started, the cluster serves on the live DP ranks while at least one is: a DP
  // rank's requests are its own (the frontend routes around a dead one, and the others
  // step without it: worker_runtime.h).
  int live_attention = 0;
  for (const std::optional<WorkerStatus>& slot : attention_) {
    if (IsLive(slot)) {
      ++live_attention;
    } else if (!started_) {
      return false;
    }
  }
  if (live_attention == 0) return false;
  for (const std::optional<WorkerStatus>& slot : expert_) {
    if (!IsLive(slot) && !elastic) return false;
  }
  for (const v1::ExpertReplicas& replicas : view_.placement().expert_to_rank()) {
    if (replicas.ep_ranks().empty()) return false;
  }
  return true;
}

std::vector<v1::WorkerInfo> ClusterRegistry::Workers() const {
  absl::MutexLock lock(&mu_);
  return {view_.workers().begin(), view_.workers().end()};
}

std::vector<WorkerStatus> ClusterRegistry::WorkerStatuses() const {
  absl::MutexLock lock(&mu_);
  std::vector<WorkerStatus> statuses;
  for (const auto* slots : {&attention_, &expert_}) {
    for (const std::optional<WorkerStatus>& slot : *slots) {
      if (slot.has_value()) statuses.push_back(*slot);
    }
  }
  return statuses;
}

int ClusterRegistry::num_expert_ranks() const {
  absl::MutexLock lock(&mu_);
  return static_cast<int>(expert_.size());
}

RegistryCounters ClusterRegistry::counters() const {
  absl::MutexLock lock(&mu_);
  return counters_;
}

}  // namespace dxs
