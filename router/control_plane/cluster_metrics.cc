#include "router/control_plane/cluster_metrics.h"

#include <algorithm>
#include <string>
#include <vector>

namespace dxs {

namespace {

constexpr const char* kRoleNames[2] = {"attention", "expert"};
constexpr const char* kStateNames[4] = {"joining", "ready", "draining", "dead"};

// Index into View::workers' state dimension; -1 for an unset state.
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

prometheus::MetricFamily Family(const char* name, const char* help, prometheus::MetricType type) {
  prometheus::MetricFamily family;
  family.name = name;
  family.help = help;
  family.type = type;
  return family;
}

// One sample; labels in the order given (role before rank, as everywhere in dxs).
void AddSample(prometheus::MetricFamily* family,
               std::vector<prometheus::ClientMetric::Label> labels, double value) {
  prometheus::ClientMetric metric;
  metric.label = std::move(labels);
  if (family->type == prometheus::MetricType::Counter) {
    metric.counter.value = value;
  } else {
    metric.gauge.value = value;
  }
  family->metric.push_back(std::move(metric));
}

}  // namespace

absl::StatusOr<std::shared_ptr<ClusterMetrics>> ClusterMetrics::Create(
    const ClusterRegistry* cluster, ClusterMetricsOptions options) {
  if (options.window <= absl::ZeroDuration() || options.interval <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError("cluster metrics: window and interval must be positive");
  }
  if (!options.now) return absl::InvalidArgumentError("cluster metrics: no clock");
  return std::shared_ptr<ClusterMetrics>(new ClusterMetrics(cluster, std::move(options)));
}

void ClusterMetrics::Start() {
  if (thread_.joinable()) return;
  thread_ = std::thread([this] {
    while (true) {
      SampleAt(options_.now());
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

void ClusterMetrics::SampleAt(absl::Time now) const {
  // The registry is read under mu_ too: a scrape and the sampling thread may sample at the
  // same time, and the later reading must be the one that stays in view_.
  absl::MutexLock lock(&mu_);
  const std::vector<WorkerStatus> statuses = cluster_->WorkerStatuses();
  View view;
  const v1::ClusterView cluster_view = cluster_->View();
  view.version = cluster_view.version();
  const v1::ExpertPlacement& placement = cluster_view.placement();
  view.placement_version = placement.version();
  // Expert ranks that joined (elastic EP) are in the view's count, not the options'.
  const size_t num_expert_ranks =
      std::max<size_t>(cluster_view.num_expert_ranks(), cluster_->options().num_expert_ranks);
  view.placement_experts.assign(num_expert_ranks, 0);
  view.placement_replicas.assign(num_expert_ranks, 0);
  for (const v1::ExpertReplicas& replicas : placement.expert_to_rank()) {
    for (int i = 0; i < replicas.ep_ranks_size(); ++i) {
      const uint32_t r = replicas.ep_ranks(i);
      if (r >= view.placement_experts.size()) continue;
      ++view.placement_experts[r];
      if (i > 0) ++view.placement_replicas[r];
    }
  }
  std::vector<uint64_t> ep_window_tokens;
  for (const WorkerStatus& s : statuses) {
    const v1::Role role = s.info.role();
    if (role != v1::ROLE_ATTENTION && role != v1::ROLE_EXPERT) continue;
    const int role_index = role == v1::ROLE_ATTENTION ? 0 : 1;
    const int state = StateIndex(s.info.state());
    if (state >= 0) ++view.workers[role_index][state];

    Track& t = tracks_[{static_cast<int>(role), s.info.rank()}];
    if (t.incarnation != s.info.incarnation()) {
      // A new incarnation: its counters go on from what it registered with (0 for a new
      // process), which is also the window's first point, at its registration: steps it
      // took before the first sample here still count in the window.
      t.incarnation = s.info.incarnation();
      t.last = s.registered_counters;
      t.history.clear();
      t.history.push_back({s.registered, t.last.empty_steps_total(), t.last.tokens_total()});
    }
    const v1::StepCounters& c = s.counters;
    auto mirror = [](uint64_t* total, uint64_t now_value, uint64_t* last_value) {
      if (now_value > *last_value) *total += now_value - *last_value;
      *last_value = std::max(now_value, *last_value);
    };
    uint64_t last_steps = t.last.steps_total(), last_empty = t.last.empty_steps_total(),
             last_tokens = t.last.tokens_total();
    mirror(&t.steps_total, c.steps_total(), &last_steps);
    mirror(&t.empty_steps_total, c.empty_steps_total(), &last_empty);
    mirror(&t.tokens_total, c.tokens_total(), &last_tokens);
    t.last.set_steps_total(last_steps);
    t.last.set_empty_steps_total(last_empty);
    t.last.set_tokens_total(last_tokens);

    t.history.push_back({now, last_empty, last_tokens});
    const absl::Time window_start = now - options_.window;
    while (t.history.size() >= 2 && t.history[1].time <= window_start) t.history.pop_front();
    const Track::Point& base = t.history.front();
    if (last_empty > base.empty_steps) ++view.empty_ranks[role_index];
    // The balance is over the EP ranks that take part in steps: live and holding experts.
    // A dead rank, or a live one holding none (joined or restarted and not yet rebalanced
    // onto, or drained), receives nothing by design and would read as imbalance.
    if (role == v1::ROLE_EXPERT && s.info.state() != v1::WORKER_STATE_DEAD && !s.experts.empty()) {
      ep_window_tokens.push_back(last_tokens - base.tokens);
    }
  }
  uint64_t sum = 0, max = 0;
  for (uint64_t tokens : ep_window_tokens) {
    sum += tokens;
    max = std::max(max, tokens);
  }
  view.imbalance = sum == 0
                       ? 1.0
                       : static_cast<double>(max) * static_cast<double>(ep_window_tokens.size()) /
                             static_cast<double>(sum);
  view_ = view;
}

std::vector<prometheus::MetricFamily> ClusterMetrics::Collect() const {
  SampleAt(options_.now());
  using prometheus::MetricType;
  prometheus::MetricFamily steps =
      Family("dxs_cluster_steps_total",
             "Steps each worker took part in, as reported in its heartbeats.", MetricType::Counter);
  prometheus::MetricFamily empty =
      Family("dxs_cluster_empty_batch_steps_total",
             "Empty-batch steps of each worker, as reported in its heartbeats "
             "(its dxs_empty_batch_steps_total, seen from the router).",
             MetricType::Counter);
  prometheus::MetricFamily tokens =
      Family("dxs_cluster_tokens_total",
             "Tokens each worker handled, as reported in its heartbeats "
             "(attention: tokens in its batches; expert: token rows received, "
             "summed over MoE layers).",
             MetricType::Counter);
  prometheus::MetricFamily empty_ranks =
      Family("dxs_cluster_empty_ranks",
             "Ranks whose empty-batch step count grew within the router's window "
             "(default the last 5 s).",
             MetricType::Gauge);
  prometheus::MetricFamily imbalance =
      Family("dxs_ep_token_imbalance",
             "Max over mean of the token rows each live EP rank received within "
             "the router's window; 1 is balanced, and also reported with no "
             "traffic.",
             MetricType::Gauge);
  prometheus::MetricFamily balance =
      Family("dxs_cluster_ep_balance_ratio",
             "Mean over max of the token rows each live EP rank received within "
             "the router's window (the inverse of dxs_ep_token_imbalance); 1 is "
             "balanced, and also reported with no traffic.",
             MetricType::Gauge);
  prometheus::MetricFamily placement_version =
      Family("dxs_placement_version",
             "Version of the published expert placement; 0 until every expert is "
             "placed the first time, then it grows on every change of the map.",
             MetricType::Gauge);
  prometheus::MetricFamily placement_experts =
      Family("dxs_placement_experts",
             "Expert copies each EP rank holds in the published placement "
             "(primaries and replicas; the same for every MoE layer).",
             MetricType::Gauge);
  prometheus::MetricFamily placement_replicas =
      Family("dxs_placement_replicas",
             "Expert copies on each EP rank that are redundant replicas (not the "
             "expert's primary, its first rank in the placement).",
             MetricType::Gauge);
  prometheus::MetricFamily workers =
      Family("dxs_workers", "Workers in the cluster view, by role and state.", MetricType::Gauge);
  prometheus::MetricFamily version =
      Family("dxs_cluster_view_version",
             "Version of the cluster view (membership and placement); it grows "
             "on every change.",
             MetricType::Gauge);

  absl::MutexLock lock(&mu_);
  for (const auto& [key, t] : tracks_) {
    const std::vector<prometheus::ClientMetric::Label> labels = {
        {"role", kRoleNames[key.first == v1::ROLE_ATTENTION ? 0 : 1]},
        {"rank", std::to_string(key.second)}};
    AddSample(&steps, labels, static_cast<double>(t.steps_total));
    AddSample(&empty, labels, static_cast<double>(t.empty_steps_total));
    AddSample(&tokens, labels, static_cast<double>(t.tokens_total));
  }
  for (int role = 0; role < 2; ++role) {
    AddSample(&empty_ranks, {{"role", kRoleNames[role]}}, view_.empty_ranks[role]);
    for (int state = 0; state < 4; ++state) {
      AddSample(&workers, {{"role", kRoleNames[role]}, {"state", kStateNames[state]}},
                view_.workers[role][state]);
    }
  }
  AddSample(&imbalance, {}, view_.imbalance);
  AddSample(&balance, {}, view_.imbalance > 0 ? 1.0 / view_.imbalance : 1.0);
  AddSample(&placement_version, {}, static_cast<double>(view_.placement_version));
  for (size_t r = 0; r < view_.placement_experts.size(); ++r) {
    AddSample(&placement_experts, {{"rank", std::to_string(r)}}, view_.placement_experts[r]);
    AddSample(&placement_replicas, {{"rank", std::to_string(r)}}, view_.placement_replicas[r]);
  }
  AddSample(&version, {}, static_cast<double>(view_.version));

  std::vector<prometheus::MetricFamily> out;
  // A counter family without samples is left out, as the registry does.
  for (prometheus::MetricFamily* f : {&steps, &empty, &tokens}) {
    if (!f->metric.empty()) out.push_back(std::move(*f));
  }
  for (prometheus::MetricFamily* f :
       {&empty_ranks, &imbalance, &balance, &placement_version, &placement_experts,
        &placement_replicas, &workers, &version}) {
    out.push_back(std::move(*f));
  }
  return out;
}

}  // namespace dxs
