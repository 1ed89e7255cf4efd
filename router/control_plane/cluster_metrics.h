// ClusterMetrics: the router's cluster-wide series (docs/metrics.md, "Router"), gathered
// from what workers report in heartbeats, so that one scrape of the router shows the
// whole cluster, and in particular which ranks sat empty:
//
//   dxs_cluster_steps_total{role, rank}              mirrored from each worker's counters
//   dxs_cluster_empty_batch_steps_total{role, rank}  (StepCounters in its last heartbeat)
//   dxs_cluster_tokens_total{role, rank}
//   dxs_cluster_empty_ranks{role}    ranks whose empty-step count grew within the window
//   dxs_ep_token_imbalance           max / mean of EP ranks' tokens within the window
//   dxs_cluster_ep_balance_ratio     mean / max of the same (its inverse; 1 is even)
//   dxs_placement_version            the published ExpertPlacement version
//   dxs_placement_experts{rank}      expert copies each EP rank holds (primaries + replicas)
//   dxs_placement_replicas{rank}     of them, copies that are not the expert's primary
//   dxs_workers{role, state}         workers in the view by state
//   dxs_cluster_view_version         the ClusterView version
//
// Mirroring: a worker's counters restart at zero with each incarnation; the mirrored
// counter adds what each report grew by (and, after a restart, the new incarnation's
// whole count), so it never decreases and keeps counting across restarts. Steps a worker
// ran after its last heartbeat before dying are lost.
//
// This is a prometheus::Collectable (MetricsServer::Expose): every scrape samples the
// cluster registry as of that moment and reports the result, so the view a scrape shows is
// never older than the scrape. Sample reads the registry once and updates the mirrored
// counters and the window; a background thread also calls it every `interval`
// (Start/Stop), so that the window's history has points between scrapes however rarely
// Prometheus scrapes. Tests call Sample with their own clock (ClusterMetricsOptions::now).
//
// Thread safety: every method may be called from any thread. The cluster registry must
// outlive this object.
#pragma once

#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <thread>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "prometheus/collectable.h"
#include "prometheus/metric_family.h"
#include "router/control_plane/cluster_registry.h"

namespace dxs {

struct ClusterMetricsOptions {
  // The span of dxs_cluster_empty_ranks and dxs_ep_token_imbalance. Greater than zero.
  absl::Duration window = absl::Seconds(5);
  // How often the background thread samples (heartbeats arrive every heartbeat_interval;
  // sampling faster gains nothing). Greater than zero.
  absl::Duration interval = absl::Milliseconds(500);
  // The clock of a scrape's sample.
  std::function<absl::Time()> now = [] { return absl::Now(); };
};

class ClusterMetrics final : public prometheus::Collectable {
 public:
  // Shared: the metrics server keeps a weak pointer to it.
  static absl::StatusOr<std::shared_ptr<ClusterMetrics>> Create(const ClusterRegistry* cluster,
                                                                ClusterMetricsOptions options);
  ~ClusterMetrics() override { Stop(); }
  ClusterMetrics(const ClusterMetrics&) = delete;
  ClusterMetrics& operator=(const ClusterMetrics&) = delete;

  // Starts the sampling thread (once); Stop joins it. Stop is idempotent.
  void Start();
  void Stop();

  // One pass over the registry as of `now`.
  void Sample(absl::Time now) { SampleAt(now); }

  // Samples as of options.now(), then reports every series above.
  std::vector<prometheus::MetricFamily> Collect() const override;

 private:
  ClusterMetrics(const ClusterRegistry* cluster, ClusterMetricsOptions options)
      : cluster_(cluster), options_(options) {}

  // One (role, rank)'s reports, for mirroring and the window.
  struct Track {
    uint64_t incarnation = 0;
    v1::StepCounters last;  // as of the last sample, this incarnation
    struct Point {
      absl::Time time;
      uint64_t empty_steps;
      uint64_t tokens;
    };
    // Samples of this incarnation; the first is the newest one at or before the window's
    // start (the baseline), or the oldest.
    std::deque<Point> history;
    // The mirrored counters: never decrease, keep counting across incarnations.
    uint64_t steps_total = 0;
    uint64_t empty_steps_total = 0;
    uint64_t tokens_total = 0;
  };
  // What the last sample found, for Collect.
  struct View {
    uint64_t version = 0;
    int workers[2][4] = {};  // [role: attention, expert][state: joining, ready, draining, dead]
    int empty_ranks[2] = {};
    double imbalance = 1;
    uint64_t placement_version = 0;
    std::vector<int> placement_experts;   // per EP rank (num_expert_ranks entries)
    std::vector<int> placement_replicas;  // per EP rank
  };

  // Sample, callable from Collect.
  void SampleAt(absl::Time now) const;

  const ClusterRegistry* const cluster_;
  const ClusterMetricsOptions options_;

  // Sample is logically const for Collect: it only folds the registry's state into the
  // mirrored counters and the window.
  mutable absl::Mutex mu_;
  mutable std::map<std::pair<int, uint32_t>, Track> tracks_ ABSL_GUARDED_BY(mu_);
  mutable View view_ ABSL_GUARDED_BY(mu_);
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_;
};

}  // namespace dxs
