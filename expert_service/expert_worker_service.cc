#include "expert_service/expert_worker_service.h"

#include <algorithm>

#include "absl/strings/str_cat.h"

namespace dxs {

void ExpertWorkerService::set_shard(ExpertShard* shard, std::vector<int> experts,
                                    uint64_t placement_version, Loader loader) {
  {
    absl::MutexLock lock(&mu_);
    std::sort(experts.begin(), experts.end());
    experts_ = std::move(experts);
    placement_version_ = placement_version;
    loader_ = std::move(loader);
  }
  shard_ = shard;
}

void ExpertWorkerService::Stop() {
  absl::MutexLock lock(&mu_);
  stopped_ = true;
}

uint64_t ExpertWorkerService::placement_version() const {
  absl::MutexLock lock(&mu_);
  return placement_version_;
}

void ExpertWorkerService::InstallPending() {
  absl::MutexLock lock(&mu_);
  if (pending_ == nullptr || pending_->installed) return;
  ExpertShard* shard = shard_.load();
  if (!pending_->add.empty()) shard->AddExperts(std::move(pending_->add));
  if (pending_->keep_only) shard->KeepOnly(*pending_->keep_only);
  experts_ = pending_->experts;
  placement_version_ = std::max(placement_version_, pending_->version);
  pending_->installed = true;
}

grpc::Status ExpertWorkerService::GetStatus(grpc::ServerContext*, const v1::GetExpertStatusRequest*,
                                            v1::GetExpertStatusResponse* resp) {
  resp->set_rank(static_cast<uint32_t>(rank_));
  ExpertShard* shard = shard_.load();
  resp->set_state(shard ? v1::WORKER_STATE_READY : v1::WORKER_STATE_JOINING);
  if (shard == nullptr) return grpc::Status::OK;
  std::vector<int> experts;
  {
    absl::MutexLock lock(&mu_);
    experts = experts_;
    resp->set_placement_version(placement_version_);
  }
  for (int e : experts) resp->add_loaded_experts(static_cast<uint32_t>(e));
  if (ExpertStepServer* s = step_server_.load()) {
    FillStepCounters(s->counters(), resp->mutable_counters());
  }
  const std::vector<int64_t> per_expert = shard->tokens_per_expert_snapshot();
  for (int e : experts) {
    v1::ExpertTokenCount* t = resp->add_expert_tokens();
    t->set_expert(static_cast<uint32_t>(e));
    t->set_tokens_total(static_cast<uint64_t>(per_expert[e]));
  }
  return grpc::Status::OK;
}

grpc::Status ExpertWorkerService::LoadPlacement(grpc::ServerContext*,
                                                const v1::LoadPlacementRequest* request,
                                                v1::LoadPlacementResponse* response) {
  absl::MutexLock serial(&load_mu_);
  ExpertShard* shard = shard_.load();
  if (shard == nullptr) {
    return grpc::Status(grpc::StatusCode::UNAVAILABLE, "this expert rank is still starting");
  }
  const v1::ExpertPlacement& p = request->placement();
  const int num_experts = static_cast<int>(p.num_experts());
  if (p.expert_to_rank_size() != num_experts || num_experts <= 0) {
    return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                        absl::StrCat("placement has ", p.expert_to_rank_size(), " entries for ",
                                     num_experts, " experts"));
  }
  std::vector<int> assigned;
  for (int e = 0; e < num_experts; ++e) {
    if (p.expert_to_rank(e).ep_ranks().empty()) {
      return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                          absl::StrCat("expert ", e, " has no replica"));
    }
    for (uint32_t r : p.expert_to_rank(e).ep_ranks()) {
      if (r >= p.num_expert_ranks()) {
        return grpc::Status(
            grpc::StatusCode::INVALID_ARGUMENT,
            absl::StrCat("expert ", e, " on rank ", r, " of ", p.num_expert_ranks()));
      }
      if (static_cast<int>(r) == rank_) assigned.push_back(e);
    }
  }
  std::vector<int> resident;
  Loader loader;
  {
    absl::MutexLock lock(&mu_);
    if (stopped_) return grpc::Status(grpc::StatusCode::UNAVAILABLE, "shutting down");
    if (p.version() < placement_version_) {
      return grpc::Status(grpc::StatusCode::FAILED_PRECONDITION,
                          absl::StrCat("placement v", p.version(), " is older than the loaded v",
                                       placement_version_));
    }
    resident = experts_;
    loader = loader_;
  }
  std::vector<int> missing;
  for (int e : assigned) {
    if (!std::binary_search(resident.begin(), resident.end(), e)) missing.push_back(e);
  }
  Pending pending;
  pending.version = p.version();
  if (!missing.empty()) {
    absl::StatusOr<ExpertWeightMap> loaded = loader(missing);
    if (!loaded.ok()) {
      return grpc::Status(loaded.status().code() == absl::StatusCode::kInvalidArgument
                              ? grpc::StatusCode::INVALID_ARGUMENT
                              : grpc::StatusCode::UNAVAILABLE,
                          std::string(loaded.status().message()));
    }
    pending.add = std::move(*loaded);
  }
  if (request->release_unused()) {
    pending.keep_only = assigned;
    pending.experts = assigned;
  } else {
    pending.experts = resident;
    pending.experts.insert(pending.experts.end(), missing.begin(), missing.end());
    std::sort(pending.experts.begin(), pending.experts.end());
  }
  {
    absl::MutexLock lock(&mu_);
    pending_ = &pending;
    auto done = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return pending.installed || stopped_; };
    mu_.Await(absl::Condition(&done));
    pending_ = nullptr;
    if (!pending.installed) return grpc::Status(grpc::StatusCode::UNAVAILABLE, "shutting down");
    response->set_placement_version(placement_version_);
    for (int e : experts_) response->add_loaded_experts(static_cast<uint32_t>(e));
  }
  return grpc::Status::OK;
}

std::vector<int> ExpertWorkerService::resident_experts() const {
  absl::MutexLock lock(&mu_);
  return experts_;
}

}  // namespace dxs
