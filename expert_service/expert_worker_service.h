// ExpertWorkerService: dxs.v1.ExpertWorker — status of this EP rank (experts held, step
// counters including empty-batch steps, tokens per expert) and LoadPlacement, the expert
// side of EPLB live rebalancing.
//
// LoadPlacement loads the experts the placement newly assigns to this rank on the gRPC
// thread (the serving thread keeps serving rounds meanwhile), then hands them to the
// serving thread, which installs them between two rounds (InstallPending) and answers. The
// old experts stay resident beside the new ones: attention ranks switch versions at their
// own step boundaries, so until all of them have, a round may carry pairs of either
// version, and the union serves both. A LoadPlacement with release_unused (the router
// sends it once every attention rank runs the new version) frees the rest.
//
// Thread safety: GetStatus and LoadPlacement run on gRPC threads; InstallPending on the
// serving thread (the one that calls the shard's Forward methods). Loads are serialised.
#pragma once

#include <atomic>
#include <functional>
#include <optional>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "dxs/v1/expert_worker.grpc.pb.h"
#include "expert_service/expert_step_server.h"
#include "model/expert_shard.h"

namespace dxs {

// The counters an EP rank reports (GetStatus and heartbeats).
inline void FillStepCounters(const ExpertCounters& c, v1::StepCounters* out) {
  out->set_steps_total(c.steps);
  out->set_empty_steps_total(c.empty_steps);
  out->set_empty_layer_steps_total(c.empty_rounds);
  out->set_tokens_total(c.rows_received);
}

class ExpertWorkerService final : public v1::ExpertWorker::Service {
 public:
  // Loads the given experts' weights of every MoE layer (from the checkpoint).
  using Loader = std::function<absl::StatusOr<ExpertWeightMap>(const std::vector<int>&)>;

  explicit ExpertWorkerService(int rank) : rank_(rank) {}
  void set_shard(ExpertShard* shard, std::vector<int> experts, uint64_t placement_version,
                 Loader loader);
  void set_step_server(ExpertStepServer* s) { step_server_ = s; }
  ExpertStepServer* step_server() const { return step_server_.load(); }
  // Serving rounds: the cluster is complete and this rank's data path is up.
  void set_serving(bool serving) { serving_ = serving; }
  bool serving() const { return serving_; }
  // Shuts LoadPlacement down (UNAVAILABLE) and wakes a waiting one.
  void Stop();
  uint64_t placement_version() const;
  // Experts resident now, ascending.
  std::vector<int> resident_experts() const;

  // On the serving thread, between rounds: installs what a LoadPlacement prepared.
  void InstallPending();

  grpc::Status GetStatus(grpc::ServerContext*, const v1::GetExpertStatusRequest*,
                         v1::GetExpertStatusResponse* resp) override;
  grpc::Status LoadPlacement(grpc::ServerContext*, const v1::LoadPlacementRequest* request,
                             v1::LoadPlacementResponse* response) override;

 private:
  struct Pending {
    ExpertWeightMap add;
    std::optional<std::vector<int>> keep_only;  // release_unused
    std::vector<int> experts;                   // resident once installed
    uint64_t version = 0;
    bool installed = false;
  };

  int rank_;
  Loader loader_;
  std::atomic<ExpertShard*> shard_{nullptr};
  std::atomic<ExpertStepServer*> step_server_{nullptr};
  std::atomic<bool> serving_{false};
  absl::Mutex load_mu_;  // one LoadPlacement at a time
  mutable absl::Mutex mu_;
  std::vector<int> experts_ ABSL_GUARDED_BY(mu_);  // resident, ascending
  uint64_t placement_version_ ABSL_GUARDED_BY(mu_) = 0;
  Pending* pending_ ABSL_GUARDED_BY(mu_) = nullptr;
  bool stopped_ ABSL_GUARDED_BY(mu_) = false;
};

}  // namespace dxs
