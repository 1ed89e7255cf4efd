#include "router/control_plane/rebalancer.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <string>

#include "absl/strings/str_cat.h"
#include "common/grpc/cluster_channel.h"
#include "common/metrics/families.h"
#include "grpcpp/client_context.h"
#include "grpcpp/create_channel.h"
#include "router/control_plane/eplb.h"

namespace dxs {
namespace {

constexpr absl::Duration kPollInterval = absl::Milliseconds(100);
constexpr absl::Duration kStatusTimeout = absl::Seconds(5);

bool IsLiveState(v1::WorkerState s) {
  return s == v1::WORKER_STATE_JOINING || s == v1::WORKER_STATE_READY ||
         s == v1::WORKER_STATE_DRAINING;
}

v1::ExpertPlacement ToProto(const Placement& p, const v1::ExpertPlacement& shape) {
  v1::ExpertPlacement out;
  out.set_version(p.version());
  out.set_num_layers(shape.num_layers());
  out.set_num_experts(static_cast<uint32_t>(p.num_experts()));
  out.set_num_expert_ranks(static_cast<uint32_t>(p.num_ranks()));
  for (int e = 0; e < p.num_experts(); ++e) {
    v1::ExpertReplicas* r = out.add_expert_to_rank();
    for (int rank : p.replicas(e)) r->add_ep_ranks(static_cast<uint32_t>(rank));
  }
  return out;
}

absl::StatusOr<Placement> FromProto(const v1::ExpertPlacement& p) {
  std::vector<std::vector<int>> ranks(p.expert_to_rank_size());
  for (int e = 0; e < p.expert_to_rank_size(); ++e) {
    for (uint32_t r : p.expert_to_rank(e).ep_ranks()) ranks[e].push_back(static_cast<int>(r));
  }
  return Placement::FromExpertRanks(static_cast<int>(p.num_expert_ranks()), ranks, p.version());
}

void SetDeadline(grpc::ClientContext* context, absl::Duration timeout) {
  context->set_deadline(std::chrono::system_clock::now() +
                        std::chrono::milliseconds(absl::ToInt64Milliseconds(timeout)));
}

}  // namespace

absl::StatusOr<std::unique_ptr<Rebalancer>> Rebalancer::Create(ClusterRegistry* registry,
                                                               RebalancerOptions options,
                                                               prometheus::Registry* metrics) {
  if (options.interval_steps < 0) {
    return absl::InvalidArgumentError("the EPLB interval must be at least 0 steps");
  }
  if (options.credentials == nullptr) options.credentials = grpc::InsecureChannelCredentials();
  std::unique_ptr<Rebalancer> r(new Rebalancer(registry, std::move(options)));
  if (metrics != nullptr) {
    absl::StatusOr<metrics::CounterFamily*> rebalances = metrics::AddCounter(
        metrics, "dxs_eplb_rebalances_total",
        "EPLB rebalances that published a new expert placement (periodic and by hand).");
    if (!rebalances.ok()) return rebalances.status();
    r->rebalances_ = &(*rebalances)->Add({});
    absl::StatusOr<metrics::CounterFamily*> moved = metrics::AddCounter(
        metrics, "dxs_eplb_experts_moved_total",
        "Expert copies (expert, EP rank) that EPLB rebalances made an EP rank load.");
    if (!moved.ok()) return moved.status();
    r->experts_moved_ = &(*moved)->Add({});
    absl::StatusOr<metrics::CounterFamily*> recoveries = metrics::AddCounter(
        metrics, "dxs_eplb_recoveries_total",
        "Losses of an expert rank holding experts after which every expert had a live "
        "replica again (elastic EP).");
    if (!recoveries.ok()) return recoveries.status();
    r->recoveries_ = &(*recoveries)->Add({});
    absl::StatusOr<metrics::HistogramFamily*> seconds = metrics::AddHistogram(
        metrics, "dxs_eplb_recovery_duration_seconds",
        "From the loss of an expert rank holding experts to a placement with a live replica "
        "of every expert (elastic EP).");
    if (!seconds.ok()) return seconds.status();
    r->recovery_seconds_ = &(*seconds)->Add({}, metrics::ExponentialBuckets(0.01, 2, 12));
  }
  return r;
}

Rebalancer::Rebalancer(ClusterRegistry* registry, RebalancerOptions options)
    : registry_(registry), options_(std::move(options)) {}

Rebalancer::~Rebalancer() { Stop(); }

void Rebalancer::Start() {
  if (!thread_.joinable()) thread_ = std::thread([this] { Loop(); });
}

void Rebalancer::Stop() {
  if (!stop_.HasBeenNotified()) stop_.Notify();
  if (thread_.joinable()) thread_.join();
}

void Rebalancer::Loop() {
  uint64_t known_version = 0;
  while (!stop_.HasBeenNotified()) {
    // Woken by every new view (a lost or drained rank is acted on at once), else polled.
    if (std::optional<v1::ClusterView> v =
            registry_->WaitForVersion(known_version, kPollInterval)) {
      known_version = v->version();
    }
    if (stop_.HasBeenNotified()) break;
    absl::MutexLock lock(&mu_);
    if (options_.elastic_ep) MaybeRecover();
    MaybeRelease();
    if (options_.elastic_ep && !to_release_) MaybeTakeIn();
    if (options_.interval_steps <= 0 || to_release_) continue;
    int64_t step = 0;
    for (const WorkerStatus& w : registry_->WorkerStatuses()) {
      if (w.info.role() == v1::ROLE_ATTENTION) {
        step = std::max(step, static_cast<int64_t>(w.counters.steps_total()));
      }
    }
    if (step < last_step_) last_step_ = step;  // the attention ranks restarted
    if (step - last_step_ < options_.interval_steps || !registry_->IsComplete()) continue;
    last_step_ = step;
    absl::StatusOr<v1::RebalanceResponse> done = RebalanceLocked();
    if (!done.ok()) {
      std::fprintf(stderr, "dxs-router: EPLB rebalance at step %lld: %s\n",
                   static_cast<long long>(step), done.status().ToString().c_str());
    }
  }
}

v1::ExpertWorker::Stub* Rebalancer::Stub(const std::string& address) {
  std::unique_ptr<v1::ExpertWorker::Stub>& stub = stubs_[address];
  if (stub == nullptr) {
    stub = v1::ExpertWorker::NewStub(MakeClusterChannel(address, options_.credentials));
  }
  return stub.get();
}

absl::StatusOr<v1::RebalanceResponse> Rebalancer::Rebalance() {
  if (rebalancing_) return absl::AbortedError("another rebalance is running; retry");
  absl::MutexLock lock(&mu_);  // waits out a poll of the background thread
  return RebalanceLocked();
}

absl::StatusOr<v1::RebalanceResponse> Rebalancer::RebalanceLocked(bool even_when_unmeasured) {
  rebalancing_ = true;
  struct Done {
    std::atomic<bool>* flag;
    ~Done() { *flag = false; }
  } done{&rebalancing_};
  if (!registry_->IsComplete()) {
    return absl::FailedPreconditionError("the cluster is incomplete: some rank is not live");
  }
  const v1::ClusterView view = registry_->View();
  const v1::ExpertPlacement& current_proto = view.placement();
  absl::StatusOr<Placement> current = FromProto(current_proto);
  if (!current.ok()) return current.status();
  const int num_experts = current->num_experts();
  const int num_ranks = current->num_ranks();

  // 1. Measure.
  std::vector<const v1::WorkerInfo*> experts;
  for (const v1::WorkerInfo& w : view.workers()) {
    if (w.role() == v1::ROLE_EXPERT && IsLiveState(w.state())) experts.push_back(&w);
  }
  std::vector<double> load(static_cast<size_t>(num_experts), 0.0);
  std::map<std::pair<int, uint64_t>, std::vector<uint64_t>> now_tokens;
  for (const v1::WorkerInfo* w : experts) {
    grpc::ClientContext context;
    SetDeadline(&context, kStatusTimeout);
    v1::GetExpertStatusResponse status;
    if (grpc::Status s = Stub(w->grpc_address())->GetStatus(&context, {}, &status); !s.ok()) {
      return absl::UnavailableError(absl::StrCat("expert rank ", w->rank(), " at ",
                                                 w->grpc_address(), ": ", s.error_message()));
    }
    const std::pair<int, uint64_t> key{static_cast<int>(w->rank()), w->incarnation()};
    std::vector<uint64_t> tokens =
        last_tokens_.count(key) ? last_tokens_[key] : std::vector<uint64_t>(num_experts, 0);
    const std::vector<uint64_t> before = tokens;
    for (const v1::ExpertTokenCount& t : status.expert_tokens()) {
      if (t.expert() >= static_cast<uint32_t>(num_experts)) continue;
      tokens[t.expert()] = t.tokens_total();
      if (t.tokens_total() >= before[t.expert()]) {
        load[t.expert()] += static_cast<double>(t.tokens_total() - before[t.expert()]);
      }
    }
    now_tokens[key] = std::move(tokens);
  }

  // Nothing measured (no token since the last rebalance): nothing to balance by.
  double total = 0;
  for (double l : load) total += l;
  if (total <= 0 && even_when_unmeasured) {
    std::fill(load.begin(), load.end(), 1.0);
    total = num_experts;
  }
  if (total <= 0) {
    last_tokens_ = std::move(now_tokens);
    v1::RebalanceResponse unchanged;
    unchanged.set_placement_version(current_proto.version());
    unchanged.set_cluster_view_version(view.version());
    unchanged.set_balance_ratio_before(1);
    unchanged.set_balance_ratio_after(1);
    return unchanged;
  }

  // 2. Place, over the live ranks that are not draining (all of them without elastic EP).
  std::vector<int> targets;
  for (const v1::WorkerInfo* w : experts) {
    if (w->state() != v1::WORKER_STATE_DRAINING) targets.push_back(static_cast<int>(w->rank()));
  }
  std::sort(targets.begin(), targets.end());
  if (targets.empty()) return absl::FailedPreconditionError("no expert rank to place experts on");
  const int num_targets = static_cast<int>(targets.size());
  const int num_redundant =
      std::min<int64_t>(options_.num_redundant_experts, int64_t{num_experts} * (num_targets - 1));
  absl::StatusOr<Placement> dense =
      BalancedPlacement(load, num_targets, num_redundant, current_proto.version() + 1);
  if (!dense.ok()) return dense.status();
  std::vector<std::vector<int>> spread(num_experts);
  for (int e = 0; e < num_experts; ++e) {
    for (int i : dense->replicas(e)) spread[e].push_back(targets[i]);
  }
  absl::StatusOr<Placement> next =
      Placement::FromExpertRanks(num_ranks, spread, current_proto.version() + 1);
  if (!next.ok()) return next.status();
  last_tokens_ = std::move(now_tokens);
  v1::RebalanceResponse response;
  response.set_balance_ratio_before(BalanceRatio(RankLoads(*current, load)));
  response.set_balance_ratio_after(BalanceRatio(RankLoads(*next, load)));
  uint32_t moved = 0;
  for (int r = 0; r < num_ranks; ++r) {
    const std::vector<int>& held = current->experts_of(r);
    for (int e : next->experts_of(r)) {
      if (!std::binary_search(held.begin(), held.end(), e)) ++moved;
    }
  }
  response.set_experts_moved(moved);
  bool same = true;
  for (int r = 0; r < num_ranks && same; ++r) same = current->experts_of(r) == next->experts_of(r);
  if (same) {
    response.set_placement_version(current_proto.version());
    response.set_cluster_view_version(view.version());
    return response;
  }

  // 3. Load (every rank, before anything dispatches with it).
  const v1::ExpertPlacement next_proto = ToProto(*next, current_proto);
  if (absl::Status s = LoadEverywhere(view, next_proto); !s.ok()) return s;

  // 4. Publish.
  absl::StatusOr<v1::ClusterView> published = registry_->SetPlacement(*next);
  if (!published.ok()) return published.status();
  response.set_placement_version(published->placement().version());
  response.set_cluster_view_version(published->version());
  to_release_ = published->placement();
  if (rebalances_ != nullptr) rebalances_->Increment();
  if (experts_moved_ != nullptr) experts_moved_->Increment(moved);
  std::fprintf(stderr,
               "dxs-router: EPLB placement v%llu published (view v%llu): %u expert copies "
               "moved, balance ratio %.3f -> %.3f\n",
               static_cast<unsigned long long>(response.placement_version()),
               static_cast<unsigned long long>(response.cluster_view_version()), moved,
               response.balance_ratio_before(), response.balance_ratio_after());
  return response;
}

absl::Status Rebalancer::LoadEverywhere(const v1::ClusterView& view,
                                        const v1::ExpertPlacement& placement) {
  v1::LoadPlacementRequest request;
  *request.mutable_placement() = placement;
  for (const v1::WorkerInfo& w : view.workers()) {
    if (w.role() != v1::ROLE_EXPERT || !IsLiveState(w.state())) continue;
    grpc::ClientContext context;
    SetDeadline(&context, options_.load_timeout);
    v1::LoadPlacementResponse loaded;
    if (grpc::Status s = Stub(w.grpc_address())->LoadPlacement(&context, request, &loaded);
        !s.ok()) {
      return absl::UnavailableError(absl::StrCat("expert rank ", w.rank(),
                                                 " could not load placement v", placement.version(),
                                                 ": ", s.error_message()));
    }
  }
  return absl::OkStatus();
}

void Rebalancer::MaybeRecover() {
  if (!registry_->started()) return;  // still starting: experts wait for their ranks
  const RegistryCounters counters = registry_->counters();
  if (counters.expert_losses_total > losses_seen_) {
    losses_seen_ = counters.expert_losses_total;
    if (!recovering_since_) recovering_since_ = counters.last_expert_loss;
  }
  const v1::ClusterView view = registry_->View();
  const v1::ExpertPlacement& current = view.placement();
  const int num_experts = current.expert_to_rank_size();
  const int num_ranks = static_cast<int>(current.num_expert_ranks());
  std::vector<bool> draining(num_ranks, false), target(num_ranks, false);
  for (const v1::WorkerInfo& w : view.workers()) {
    if (w.role() != v1::ROLE_EXPERT || w.rank() >= static_cast<uint32_t>(num_ranks)) continue;
    draining[w.rank()] = w.state() == v1::WORKER_STATE_DRAINING;
    target[w.rank()] = w.state() == v1::WORKER_STATE_JOINING || w.state() == v1::WORKER_STATE_READY;
  }
  std::vector<std::vector<int>> ranks(num_experts);
  std::vector<int> slots(num_ranks, 0);
  bool covered = num_experts > 0, moves = false;
  for (int e = 0; e < num_experts; ++e) {
    const auto& held = current.expert_to_rank(e).ep_ranks();
    if (held.empty()) covered = false;
    for (uint32_t r : held) {
      if (draining[r]) {
        moves = true;
      } else {
        ranks[e].push_back(static_cast<int>(r));
        ++slots[r];
      }
    }
  }
  if (covered && recovering_since_) {
    const double seconds = absl::ToDoubleSeconds(absl::Now() - *recovering_since_);
    if (recoveries_ != nullptr) recoveries_->Increment();
    if (recovery_seconds_ != nullptr) recovery_seconds_->Observe(seconds);
    std::fprintf(stderr,
                 "dxs-router: elastic EP: every expert has a live replica again, %.3f s after "
                 "the loss (placement v%llu)\n",
                 seconds, static_cast<unsigned long long>(current.version()));
    recovering_since_.reset();
  }
  if (covered && !moves) return;
  // Each expert left without a rank goes to the live, non-draining rank with the fewest.
  for (int e = 0; e < num_experts; ++e) {
    if (!ranks[e].empty()) continue;
    int best = -1;
    for (int r = 0; r < num_ranks; ++r) {
      if (target[r] && (best < 0 || slots[r] < slots[best])) best = r;
    }
    if (best < 0) return;  // no live expert rank: wait for one
    ranks[e].push_back(best);
    ++slots[best];
  }
  absl::StatusOr<Placement> next =
      Placement::FromExpertRanks(num_ranks, ranks, current.version() + 1);
  if (!next.ok()) {
    std::fprintf(stderr, "dxs-router: elastic EP: %s\n", next.status().ToString().c_str());
    return;
  }
  const v1::ExpertPlacement next_proto = ToProto(*next, current);
  if (absl::Status s = LoadEverywhere(view, next_proto); !s.ok()) {
    std::fprintf(stderr, "dxs-router: elastic EP: %s; retrying\n", s.ToString().c_str());
    return;
  }
  absl::StatusOr<v1::ClusterView> published = registry_->SetPlacement(*next);
  if (!published.ok()) {
    std::fprintf(stderr, "dxs-router: elastic EP: publishing placement v%llu: %s\n",
                 static_cast<unsigned long long>(next->version()),
                 published.status().ToString().c_str());
    return;
  }
  to_release_ = published->placement();
  std::fprintf(stderr, "dxs-router: elastic EP: placement v%llu published (view v%llu): %s\n",
               static_cast<unsigned long long>(published->placement().version()),
               static_cast<unsigned long long>(published->version()),
               moves ? "experts moved off draining ranks" : "lost experts reassigned");
  // The next pass (woken by this view) times the recovery.
}

void Rebalancer::MaybeTakeIn() {
  if (!registry_->started() || !registry_->IsComplete()) return;
  const v1::ClusterView view = registry_->View();
  const v1::ExpertPlacement& placement = view.placement();
  std::vector<bool> holds(placement.num_expert_ranks(), false);
  for (const v1::ExpertReplicas& replicas : placement.expert_to_rank()) {
    for (uint32_t r : replicas.ep_ranks()) {
      if (r < holds.size()) holds[r] = true;
    }
  }
  std::vector<std::pair<int, uint64_t>> empty;
  for (const v1::WorkerInfo& w : view.workers()) {
    if (w.role() != v1::ROLE_EXPERT || w.state() != v1::WORKER_STATE_READY) continue;
    const std::pair<int, uint64_t> key{static_cast<int>(w.rank()), w.incarnation()};
    if (w.rank() < holds.size() && holds[w.rank()]) continue;
    if (!taken_in_.count(key)) empty.push_back(key);
  }
  if (empty.empty()) return;
  absl::StatusOr<v1::RebalanceResponse> done = RebalanceLocked(/*even_when_unmeasured=*/true);
  std::string ranks;
  for (const auto& [rank, incarnation] : empty)
    absl::StrAppend(&ranks, ranks.empty() ? "" : ",", rank);
  if (!done.ok()) {
    std::fprintf(stderr, "dxs-router: elastic EP: taking in expert rank %s: %s; retrying\n",
                 ranks.c_str(), done.status().ToString().c_str());
    return;
  }
  taken_in_.insert(empty.begin(), empty.end());
  std::fprintf(stderr,
               "dxs-router: elastic EP: expert rank %s taken in: placement v%llu, %u expert "
               "copies moved\n",
               ranks.c_str(), static_cast<unsigned long long>(done->placement_version()),
               done->experts_moved());
}

void Rebalancer::MaybeRelease() {
  if (!to_release_) return;
  const v1::ClusterView view = registry_->View();
  if (view.placement().version() != to_release_->version()) {
    to_release_.reset();  // superseded (a later rebalance or a membership change)
    return;
  }
  std::vector<const WorkerStatus*> experts;
  const std::vector<WorkerStatus> statuses = registry_->WorkerStatuses();
  for (const WorkerStatus& w : statuses) {
    if (!IsLiveState(w.info.state())) continue;
    if (w.info.role() == v1::ROLE_ATTENTION &&
        w.reported_placement_version < to_release_->version()) {
      return;  // some attention rank may still dispatch with the old placement
    }
    if (w.info.role() == v1::ROLE_EXPERT) experts.push_back(&w);
  }
  v1::LoadPlacementRequest request;
  *request.mutable_placement() = *to_release_;
  request.set_release_unused(true);
  for (const WorkerStatus* w : experts) {
    grpc::ClientContext context;
    SetDeadline(&context, kStatusTimeout);
    v1::LoadPlacementResponse response;
    if (grpc::Status s = Stub(w->info.grpc_address())->LoadPlacement(&context, request, &response);
        !s.ok()) {
      std::fprintf(stderr, "dxs-router: expert rank %u: freeing experts of placement v%llu: %s\n",
                   w->info.rank(), static_cast<unsigned long long>(to_release_->version()),
                   s.error_message().c_str());
      return;  // retried on the next poll
    }
  }
  to_release_.reset();
}

}  // namespace dxs
