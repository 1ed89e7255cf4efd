// Rebalancer: EPLB live rebalancing. One rebalance:
//   1. Measure: each expert rank's tokens per expert (ExpertWorker.GetStatus, summed over
//      MoE layers), the growth since the previous rebalance summed over replicas.
//   2. Place: BalancedPlacement(load, N, R, current version + 1). Without any measured
//      token, or when it equals the current map, nothing changes (the version stays).
//   3. Load: every expert rank gets the placement (ExpertWorker.LoadPlacement) and loads
//      the experts it newly holds, keeping the old ones; all of them answer before step 4.
//   4. Publish: the registry's ClusterView carries the new placement; each attention rank
//      switches at its next step boundary.
//   5. Free: once every attention rank reports (Heartbeat.placement_version) that it
//      dispatches with the new version, the expert ranks get the placement again with
//      release_unused and free what they no longer hold.
// Attention ranks need not switch at the same step: each DP rank's tokens are dispatched
// and combined by that rank alone, so a step in which some ranks use the old placement and
// some the new one sends every pair to a rank that holds its expert (the union of both
// placements is resident from step 3 to step 5), and each pair is still computed by
// exactly one replica. Outputs do not depend on the version (a pair's result is the same
// on any replica), so the switch is invisible to requests.
//
// With interval_steps > 0 a thread rebalances each time the attention ranks' step counter
// (the largest steps_total reported) has advanced that many steps since the last one.
//
// Elastic EP (options.elastic_ep, dxs-router --elastic-ep): the thread also recovers. When
// some expert has no live replica (its ranks died) or is held by a DRAINING expert rank
// (dxs drain), it is reassigned (every other replica kept): each such expert to the live,
// non-draining rank holding the fewest experts; the ranks load the placement (from the
// checkpoint), it is published, and the drained rank's copies are freed as in step 5
// (after which the drained worker deregisters and exits). EPLB rebalances spread over the
// live, non-draining ranks only. A recovery is counted from the moment the registry lost
// an expert rank holding experts to the first view in which every expert has a live
// replica again (dxs_eplb_recoveries_total, dxs_eplb_recovery_duration_seconds); with full
// replica cover that is the same view, so the duration is ~0. It also takes ranks in: once
// the cluster is complete and nothing waits to be freed, a READY expert rank that holds no
// expert (one that joined with the next rank number, or came back empty after a restart)
// is rebalanced onto, once per incarnation: a rebalance as above over every live,
// non-draining rank, by the measured load, or evenly when no token was measured.
//
// Thread safety: Rebalance may be called from any thread; one runs at a time (a call while
// one runs gets ABORTED).
#pragma once

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "dxs/v1/control_plane.pb.h"
#include "dxs/v1/expert_worker.grpc.pb.h"
#include "grpcpp/security/credentials.h"
#include "prometheus/counter.h"
#include "prometheus/histogram.h"
#include "prometheus/registry.h"
#include "router/control_plane/cluster_registry.h"

namespace dxs {

struct RebalancerOptions {
  // Rebalance every this many steps; 0: only on request (Rebalance, `dxs rebalance`).
  int64_t interval_steps = 0;
  // R of BalancedPlacement: the router's --num-redundant-experts.
  int num_redundant_experts = 0;
  std::shared_ptr<grpc::ChannelCredentials> credentials;
  // How long an expert rank may take to load its new experts.
  absl::Duration load_timeout = absl::Seconds(120);
  // Recover lost and drained experts (see above); the router's --elastic-ep.
  bool elastic_ep = false;
};

class Rebalancer {
 public:
  // `registry` is not owned and must outlive this. Counters go to `metrics` (null: none):
  // dxs_eplb_rebalances_total, dxs_eplb_experts_moved_total.
  static absl::StatusOr<std::unique_ptr<Rebalancer>> Create(ClusterRegistry* registry,
                                                            RebalancerOptions options,
                                                            prometheus::Registry* metrics);
  ~Rebalancer();

  // The background thread (interval rebalances and freeing old experts).
  void Start();
  void Stop();

  // One rebalance now: FAILED_PRECONDITION (cluster incomplete), ABORTED (one is running),
  // UNAVAILABLE (an expert rank failed; the published placement is unchanged).
  absl::StatusOr<v1::RebalanceResponse> Rebalance();

 private:
  Rebalancer(ClusterRegistry* registry, RebalancerOptions options);
  // `even_when_unmeasured`: with no token measured, balance an even load (every expert
  // alike) instead of leaving the placement as it is.
  absl::StatusOr<v1::RebalanceResponse> RebalanceLocked(bool even_when_unmeasured = false)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Step 5 for the pending placement, when every attention rank runs it.
  void MaybeRelease() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Elastic EP: reassigns experts without a live replica or on draining ranks; times
  // recoveries.
  void MaybeRecover() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Elastic EP: rebalances onto READY expert ranks holding no expert (see above).
  void MaybeTakeIn() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // ExpertWorker.LoadPlacement of `placement` on every live expert rank.
  absl::Status LoadEverywhere(const v1::ClusterView& view, const v1::ExpertPlacement& placement)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  v1::ExpertWorker::Stub* Stub(const std::string& address) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void Loop();

  ClusterRegistry* const registry_;
  const RebalancerOptions options_;
  prometheus::Counter* rebalances_ = nullptr;
  prometheus::Counter* experts_moved_ = nullptr;
  prometheus::Counter* recoveries_ = nullptr;
  prometheus::Histogram* recovery_seconds_ = nullptr;
  uint64_t losses_seen_ ABSL_GUARDED_BY(mu_) = 0;
  std::optional<absl::Time> recovering_since_ ABSL_GUARDED_BY(mu_);

  absl::Mutex mu_;
  // Per (expert rank, incarnation), per expert: tokens counted at the last rebalance.
  std::map<std::pair<int, uint64_t>, std::vector<uint64_t>> last_tokens_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, std::unique_ptr<v1::ExpertWorker::Stub>> stubs_ ABSL_GUARDED_BY(mu_);
  std::optional<v1::ExpertPlacement> to_release_ ABSL_GUARDED_BY(mu_);
  int64_t last_step_ ABSL_GUARDED_BY(mu_) = 0;
  // (expert rank, incarnation) already taken in by MaybeTakeIn.
  std::set<std::pair<int, uint64_t>> taken_in_ ABSL_GUARDED_BY(mu_);

  std::atomic<bool> rebalancing_{false};  // RebalanceLocked is running
  absl::Notification stop_;
  std::thread thread_;
};

}  // namespace dxs
