// ClusterMetrics: the router's cluster-wide series (docs/metrics.md, "Router"), gathered
// from what workers report in heartbeats, so that one scrape of the router shows the
// whole cluster, and in particular which ranks sat empty:
//
//   dxs_cluster_steps_total{role, rank}              mirrored from each worker's counters
//   dxs_cluster_empty_batch_steps_total{role, rank}  (StepCounters in its last heartbeat)
//   dxs_cluster_tokens_total{role, rank}
//   dxs_cluster_empty_ranks{role}    ranks whose empty-step count grew within the window
//   dxs_ep_token_imbalance           max / mean of EP ranks' tokens within the window
//   dxs_workers{role, state}         workers in the view by state
//   dxs_cluster_view_version         the ClusterView version
//
// Mirroring: a worker's counters restart at zero with each incarnation; the mirrored
// counter adds what each report grew by (and, after a restart, the new incarnation's
// whole count), so it never decreases and keeps counting across restarts. Steps a worker
// ran after its last heartbeat before dying are lost.
//
// Sample reads the registry once and updates everything; a background thread calls it
// every `interval` (Start/Stop), or tests call it with their own clock.
//
// Thread safety: every method may be called from any thread. The metrics registry and the
// cluster registry must outlive this object.
#pragma once

#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <thread>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/metrics/registry.h"
#include "router/control_plane/cluster_registry.h"

namespace dxs {

struct ClusterMetricsOptions {
  // The span of dxs_cluster_empty_ranks and dxs_ep_token_imbalance. Greater than zero.
  absl::Duration window = absl::Seconds(5);
  // How often the background thread samples (heartbeats arrive every heartbeat_interval;
  // sampling faster gains nothing). Greater than zero.
  absl::Duration interval = absl::Milliseconds(500);
};

class ClusterMetrics {
 public:
  static absl::StatusOr<std::unique_ptr<ClusterMetrics>> Create(metrics::Registry* registry,
                                                                const ClusterRegistry* cluster,
                                                                ClusterMetricsOptions options);
  ~ClusterMetrics() { Stop(); }
  ClusterMetrics(const ClusterMetrics&) = delete;
  ClusterMetrics& operator=(const ClusterMetrics&) = delete;

  // Starts the sampling thread (once); Stop joins it. Stop is idempotent.
  void Start();
  void Stop();

  // One pass over the registry as of `now`.
  void Sample(absl::Time now);

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
    metrics::Counter* steps = nullptr;
    metrics::Counter* empty_steps = nullptr;
    metrics::Counter* tokens = nullptr;
  };

  Track& TrackOf(v1::Role role, uint32_t rank) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const ClusterRegistry* const cluster_;
  const ClusterMetricsOptions options_;

  metrics::CounterFamily* steps_family_ = nullptr;
  metrics::CounterFamily* empty_family_ = nullptr;
  metrics::CounterFamily* tokens_family_ = nullptr;
  // [role: attention, expert][state: joining, ready, draining, dead]
  metrics::Gauge* workers_[2][4] = {};
  metrics::Gauge* empty_ranks_attention_ = nullptr;
  metrics::Gauge* empty_ranks_expert_ = nullptr;
  metrics::Gauge* imbalance_ = nullptr;
  metrics::Gauge* view_version_ = nullptr;

  absl::Mutex mu_;
  std::map<std::pair<int, uint32_t>, Track> tracks_ ABSL_GUARDED_BY(mu_);
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_;
};

}  // namespace dxs
