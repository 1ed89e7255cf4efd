#include "router/control_plane/cluster_metrics.h"

#include <algorithm>
#include <string>
#include <vector>

#include "common/status_macros.h"

namespace dxs {

namespace m = metrics;

namespace {

constexpr const char* kStateNames[4] = {"joining", "ready", "draining", "dead"};

// Index into ClusterMetrics::workers_' state dimension; -1 for an unset state.
int StateIndex(v1::WorkerState state) {
  switch (state) {
    case v1::WORKER_STATE_JOINING:
      return 0;
    case v1::WORKER_STATE_READY:
      return 1;
    case v1::WORKER_STATE_DRAINING:
      return 2;
    case v1::WORKER_STATE_DEAD:
      return 3;
    default:
      return -1;
  }
}

}  // namespace

absl::StatusOr<std::unique_ptr<ClusterMetrics>> ClusterMetrics::Create(
    m::Registry* registry, const ClusterRegistry* cluster, ClusterMetricsOptions options) {
  if (options.window <= absl::ZeroDuration() || options.interval <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError("cluster metrics: window and interval must be positive");
  }
  std::unique_ptr<ClusterMetrics> cm(new ClusterMetrics(cluster, options));
  DXS_ASSIGN_OR_RETURN(
      cm->steps_family_,
      registry->AddCounter("dxs_cluster_steps_total",
                           "Steps each worker took part in, as reported in its heartbeats.",
                           {"role", "rank"}));
  DXS_ASSIGN_OR_RETURN(
      cm->empty_family_,
      registry->AddCounter("dxs_cluster_empty_batch_steps_total",
                           "Empty-batch steps of each worker, as reported in its heartbeats "
                           "(its dxs_empty_batch_steps_total, seen from the router).",
                           {"role", "rank"}));
  DXS_ASSIGN_OR_RETURN(
      cm->tokens_family_,
      registry->AddCounter("dxs_cluster_tokens_total",
                           "Tokens each worker handled, as reported in its heartbeats "
                           "(attention: tokens in its batches; expert: token rows received, "
                           "summed over MoE layers).",
                           {"role", "rank"}));
  DXS_ASSIGN_OR_RETURN(
      m::GaugeFamily * empty_ranks,
      registry->AddGauge("dxs_cluster_empty_ranks",
                         "Ranks whose empty-batch step count grew within the router's window "
                         "(default the last 5 s).",
                         {"role"}));
  cm->empty_ranks_attention_ = &empty_ranks->WithLabels({"attention"});
  cm->empty_ranks_expert_ = &empty_ranks->WithLabels({"expert"});
  DXS_ASSIGN_OR_RETURN(
      m::GaugeFamily * imbalance,
      registry->AddGauge("dxs_ep_token_imbalance",
                         "Max over mean of the token rows each live EP rank received within "
                         "the router's window; 1 is balanced, and also reported with no "
                         "traffic."));
  cm->imbalance_ = &imbalance->WithLabels({});
  cm->imbalance_->Set(1);
  DXS_ASSIGN_OR_RETURN(
      m::GaugeFamily * workers,
      registry->AddGauge("dxs_workers", "Workers in the cluster view, by role and state.",
                         {"role", "state"}));
  for (int role = 0; role < 2; ++role) {
    for (int state = 0; state < 4; ++state) {
      cm->workers_[role][state] =
          &workers->WithLabels({role == 0 ? "attention" : "expert", kStateNames[state]});
    }
  }
  DXS_ASSIGN_OR_RETURN(
      m::GaugeFamily * version,
      registry->AddGauge("dxs_cluster_view_version",
                         "Version of the cluster view (membership and placement); it grows "
                         "on every change."));
  cm->view_version_ = &version->WithLabels({});
  return cm;
}

void ClusterMetrics::Start() {
  if (thread_.joinable()) return;
  thread_ = std::thread([this] {
    while (true) {
      Sample(absl::Now());
      absl::MutexLock lock(&mu_);
      if (mu_.AwaitWithTimeout(absl::Condition(&stop_), options_.interval)) return;
    }
  });
}

void ClusterMetrics::Stop() {
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
  }
  if (thread_.joinable()) thread_.join();
}

ClusterMetrics::Track& ClusterMetrics::TrackOf(v1::Role role, uint32_t rank) {
  Track& t = tracks_[{static_cast<int>(role), rank}];
  if (t.steps == nullptr) {
    const std::vector<std::string> labels = {RoleName(role), std::to_string(rank)};
    t.steps = &steps_family_->WithLabels(labels);
    t.empty_steps = &empty_family_->WithLabels(labels);
    t.tokens = &tokens_family_->WithLabels(labels);
  }
  return t;
}

void ClusterMetrics::Sample(absl::Time now) {
  const std::vector<WorkerStatus> statuses = cluster_->WorkerStatuses();
  view_version_->Set(static_cast<double>(cluster_->version()));
  int workers[2][4] = {};
  int empty_ranks[2] = {};
  std::vector<uint64_t> ep_window_tokens;
  absl::MutexLock lock(&mu_);
  for (const WorkerStatus& s : statuses) {
    const v1::Role role = s.info.role();
    if (role != v1::ROLE_ATTENTION && role != v1::ROLE_EXPERT) continue;
    const int role_index = role == v1::ROLE_ATTENTION ? 0 : 1;
    const int state = StateIndex(s.info.state());
    if (state >= 0) ++workers[role_index][state];

    Track& t = TrackOf(role, s.info.rank());
    if (t.incarnation != s.info.incarnation()) {  // a new worker: its counters start at 0
      t.incarnation = s.info.incarnation();
      t.last = v1::StepCounters();
      t.history.clear();
    }
    const v1::StepCounters& c = s.counters;
    auto mirror = [](m::Counter* counter, uint64_t now_value, uint64_t* last_value) {
      if (now_value > *last_value) counter->Increment(now_value - *last_value);
      *last_value = std::max(now_value, *last_value);
    };
    uint64_t last_steps = t.last.steps_total(), last_empty = t.last.empty_steps_total(),
             last_tokens = t.last.tokens_total();
    mirror(t.steps, c.steps_total(), &last_steps);
    mirror(t.empty_steps, c.empty_steps_total(), &last_empty);
    mirror(t.tokens, c.tokens_total(), &last_tokens);
    t.last.set_steps_total(last_steps);
    t.last.set_empty_steps_total(last_empty);
    t.last.set_tokens_total(last_tokens);

    t.history.push_back({now, last_empty, last_tokens});
    const absl::Time window_start = now - options_.window;
    while (t.history.size() >= 2 && t.history[1].time <= window_start) t.history.pop_front();
    const Track::Point& base = t.history.front();
    if (last_empty > base.empty_steps) ++empty_ranks[role_index];
    if (role == v1::ROLE_EXPERT && s.info.state() != v1::WORKER_STATE_DEAD) {
      ep_window_tokens.push_back(last_tokens - base.tokens);
    }
  }
  for (int role = 0; role < 2; ++role) {
    for (int state = 0; state < 4; ++state) workers_[role][state]->Set(workers[role][state]);
  }
  empty_ranks_attention_->Set(empty_ranks[0]);
  empty_ranks_expert_->Set(empty_ranks[1]);
  uint64_t sum = 0, max = 0;
  for (uint64_t tokens : ep_window_tokens) {
    sum += tokens;
    max = std::max(max, tokens);
  }
  imbalance_->Set(sum == 0
                      ? 1.0
                      : static_cast<double>(max) * static_cast<double>(ep_window_tokens.size()) /
                            static_cast<double>(sum));
}

}  // namespace dxs
