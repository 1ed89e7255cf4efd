// ExpertWorkerService: dxs.v1.ExpertWorker — status of this EP rank (experts held, step
// counters including empty-batch steps, tokens per expert). LoadPlacement (live
// rebalancing) is declared by the contract and not implemented yet: UNIMPLEMENTED.
#pragma once

#include <atomic>
#include <vector>

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
  explicit ExpertWorkerService(int rank) : rank_(rank) {}
  void set_shard(ExpertShard* shard, std::vector<int> experts) {
    experts_ = std::move(experts);
    shard_ = shard;
  }
  void set_step_server(ExpertStepServer* s) { step_server_ = s; }
  ExpertStepServer* step_server() const { return step_server_.load(); }
  // Serving rounds: the cluster is complete and this rank's data path is up.
  void set_serving(bool serving) { serving_ = serving; }
  bool serving() const { return serving_; }

  grpc::Status GetStatus(grpc::ServerContext*, const v1::GetExpertStatusRequest*,
                         v1::GetExpertStatusResponse* resp) override {
    resp->set_rank(static_cast<uint32_t>(rank_));
    ExpertShard* shard = shard_.load();
    resp->set_state(shard ? v1::WORKER_STATE_READY : v1::WORKER_STATE_JOINING);
    if (shard == nullptr) return grpc::Status::OK;
    for (int e : experts_) resp->add_loaded_experts(static_cast<uint32_t>(e));
    if (ExpertStepServer* s = step_server_.load()) {
      FillStepCounters(s->counters(), resp->mutable_counters());
    }
    const std::vector<int64_t> per_expert = shard->tokens_per_expert_snapshot();
    for (int e : experts_) {
      v1::ExpertTokenCount* t = resp->add_expert_tokens();
      t->set_expert(static_cast<uint32_t>(e));
      t->set_tokens_total(static_cast<uint64_t>(per_expert[e]));
    }
    return grpc::Status::OK;
  }

  grpc::Status LoadPlacement(grpc::ServerContext*, const v1::LoadPlacementRequest*,
                             v1::LoadPlacementResponse*) override {
    return grpc::Status(grpc::StatusCode::UNIMPLEMENTED,
                        "live placement changes are not supported yet; restart the worker");
  }

 private:
  int rank_;
  std::vector<int> experts_;  // written before shard_ is published
  std::atomic<ExpertShard*> shard_{nullptr};
  std::atomic<ExpertStepServer*> step_server_{nullptr};
  std::atomic<bool> serving_{false};
};

}  // namespace dxs
