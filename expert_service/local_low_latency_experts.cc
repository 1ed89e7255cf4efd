#include "expert_service/local_low_latency_experts.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "common/status_macros.h"

namespace dxs {

absl::StatusOr<std::unique_ptr<LocalLowLatencyExperts>> LocalLowLatencyExperts::Make(
    const ModelConfig& config, const WeightSource& weights, int ranks, int capacity,
    const std::function<absl::StatusOr<std::unique_ptr<Backend>>()>& make_backend,
    int64_t timeout_ns) {
  if (ranks < 1 || ranks > config.num_experts) {
    return absl::InvalidArgumentError(
        absl::StrCat(ranks, " expert ranks for ", config.num_experts, " experts"));
  }
  auto experts = std::unique_ptr<LocalLowLatencyExperts>(new LocalLowLatencyExperts());
  experts->config_ = config;
  LowLatencyShape& shape = experts->shape_;
  shape = LowLatencyShapeOf(config, /*attention_ranks=*/1, ranks, capacity);
  shape.timeout_ns = timeout_ns;
  experts->ranks_.resize(ranks);
  for (int r = 0; r < ranks; ++r) {
    Rank& rank = experts->ranks_[r];
    DXS_ASSIGN_OR_RETURN(rank.backend, make_backend());
    std::vector<int> held;
    for (int e = r; e < config.num_experts; e += ranks) held.push_back(e);
    DXS_ASSIGN_OR_RETURN(ExpertWeightMap map,
                         LoadExpertWeights(weights, config, held, rank.backend.get()));
    rank.shard = std::make_unique<ExpertShard>(config, std::move(map), rank.backend.get());
    DXS_ASSIGN_OR_RETURN(rank.exchange, MakeLowLatencyExchange(rank.backend.get(), shape,
                                                               LowLatencySide::kExpert, r));
  }
  return experts;
}

LocalLowLatencyExperts::~LocalLowLatencyExperts() {
  if (!threads_.empty()) (void)Stop();
}

absl::StatusOr<std::unique_ptr<MoeExecutor>> LocalLowLatencyExperts::AttachAttention(
    const ModelConfig& config, Backend* backend) {
  if (attention_ != nullptr) return absl::FailedPreconditionError("an attention rank is attached");
  DXS_ASSIGN_OR_RETURN(attention_,
                       MakeLowLatencyExchange(backend, shape_, LowLatencySide::kAttention, 0));
  std::vector<std::string> keys;
  for (Rank& rank : ranks_) keys.push_back(rank.exchange->region_key());
  DXS_RETURN_IF_ERROR(attention_->Connect(keys));
  for (Rank& rank : ranks_) {
    DXS_RETURN_IF_ERROR(rank.exchange->Connect({attention_->region_key()}));
    DXS_ASSIGN_OR_RETURN(
        rank.rounds, LowLatencyExpertRounds::Make(config, rank.shard.get(), rank.exchange.get()));
  }
  std::vector<int32_t> owner(config.num_experts);
  for (int e = 0; e < config.num_experts; ++e) owner[e] = e % static_cast<int>(ranks_.size());
  DXS_ASSIGN_OR_RETURN(Tensor owners, backend->Allocate({config.num_experts}, DType::kI32));
  DXS_RETURN_IF_ERROR(backend->CopyFromHost(owner.data(), DType::kI32, &owners));
  auto moe = std::make_unique<LowLatencyMoeExecutor>(attention_.get(), owners);
  executor_ = moe.get();
  attention_backend_ = backend;
  return std::unique_ptr<MoeExecutor>(std::move(moe));
}

void LocalLowLatencyExperts::Start() {
  if (!threads_.empty() || executor_ == nullptr) return;
  {
    absl::MutexLock lock(&phase_mu_);
    phases_.assign(ranks_.size(), HostPhase{Phase::kIdle, 0, absl::Now()});
    watch_stop_ = false;
  }
  for (Rank& rank : ranks_) threads_.emplace_back([this, &rank] { Loop(&rank); });
  watcher_ = std::thread([this] { Watch(); });
}

void LocalLowLatencyExperts::SetPhase(int rank, Phase phase, int64_t step) {
  absl::MutexLock lock(&phase_mu_);
  phases_[rank] = {phase, step, absl::Now()};
}

void LocalLowLatencyExperts::Loop(Rank* rank) {
  const int r = static_cast<int>(rank - ranks_.data());
  for (int64_t own_step = 0;; ++own_step) {
    SetPhase(r, Phase::kLaunching, own_step);
    absl::Status s = rank->rounds->Launch();
    SetPhase(r, Phase::kWaiting, own_step);
    if (s.ok()) s = rank->rounds->CheckStatus();
    SetPhase(r, Phase::kBarrier, own_step);
    absl::MutexLock lock(&mu_);
    if (!s.ok() && status_.ok()) status_ = s;
    // The barrier: the last rank to finish the step decides, for all, whether the next runs.
    const int64_t step = steps_;
    if (++arrived_ == static_cast<int>(ranks_.size())) {
      arrived_ = 0;
      go_ = !stop_ && status_.ok();
      ++steps_;
    } else {
      auto decided = [this, step]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return steps_ > step; };
      mu_.Await(absl::Condition(&decided));
    }
    if (!go_) break;
  }
  // A rank that failed left the others waiting in their waits; they time out and arrive.
  SetPhase(r, Phase::kIdle, -1);
  absl::MutexLock lock(&mu_);
  ++exited_;
}

void LocalLowLatencyExperts::Watch() {
  constexpr absl::Duration kStalled = absl::Seconds(1);
  // How often the watch looks at the phases: a tenth of kStalled, so a stall is reported
  // within 10% of its threshold.
  constexpr absl::Duration kLookInterval = absl::Milliseconds(100);
  while (true) {
    std::vector<HostPhase> phases;
    {
      absl::MutexLock lock(&phase_mu_);
      phase_mu_.AwaitWithTimeout(absl::Condition(&watch_stop_), kLookInterval);
      if (watch_stop_ || !stall_report_.empty()) return;
      phases = phases_;
    }
    const absl::Time now = absl::Now();
    bool stalled = false;
    for (const HostPhase& p : phases) {
      stalled |= p.phase != Phase::kIdle && p.phase != Phase::kBarrier && now - p.since > kStalled;
    }
    if (!stalled) continue;
    // Read outside the lock: the ranks' threads go on setting their phases.
    std::string report = Snapshot(phases, now);
    absl::MutexLock lock(&phase_mu_);
    stall_report_ = std::move(report);
    return;
  }
}

std::string LocalLowLatencyExperts::Snapshot(const std::vector<HostPhase>& phases,
                                             absl::Time now) const {
  auto progress = [](const LowLatencyExchange& exchange) {
    absl::StatusOr<LowLatencyProgress> p = exchange.Progress();
    return p.ok() ? p->ToString() : std::string(p.status().message());
  };
  static constexpr const char* kPhases[] = {"idle", "launching its step",
                                            "waiting for its step's work", "at the step barrier"};
  std::string out = "a step stalled:";
  for (size_t r = 0; r < ranks_.size(); ++r) {
    const HostPhase& p = phases[r];
    absl::StrAppend(&out, " expert rank ", r, ": step ", p.step, ", ",
                    kPhases[static_cast<int>(p.phase)], " for ",
                    absl::FormatDuration(now - p.since), ", ", progress(*ranks_[r].exchange), ";");
  }
  absl::StrAppend(&out, " attention rank: ", progress(*attention_));
  return out;
}

absl::Status LocalLowLatencyExperts::EmptyStep() {
  Backend* b = attention_backend_;
  DXS_ASSIGN_OR_RETURN(Tensor x, b->Allocate({0, shape_.hidden}, DType::kBF16));
  DXS_ASSIGN_OR_RETURN(Tensor ids, b->Allocate({0, shape_.top_k}, DType::kI32));
  DXS_ASSIGN_OR_RETURN(Tensor w, b->Allocate({0, shape_.top_k}, DType::kF32));
  DXS_ASSIGN_OR_RETURN(Tensor out, b->Allocate({0, shape_.hidden}, DType::kF32));
  for (int l = 0; l < config_.num_hidden_layers; ++l) {
    if (config_.IsMoeLayer(l)) DXS_RETURN_IF_ERROR(executor_->Run(l, x, ids, w, &out));
  }
  return absl::OkStatus();
}

absl::Status LocalLowLatencyExperts::Stop() {
  if (threads_.empty()) {
    absl::MutexLock lock(&mu_);
    return status_;
  }
  // Every round the attention side sent has been answered. The ranks are finishing that
  // step (host work only: they decide at once, and stop) or, all of them, wait in one more,
  // which gets empty rounds.
  bool exited = false;
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
    auto all_exited = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      return exited_ == static_cast<int>(ranks_.size());
    };
    exited = mu_.AwaitWithTimeout(absl::Condition(&all_exited), absl::Milliseconds(500));
  }
  absl::Status empty;
  if (!exited) empty = EmptyStep();
  for (std::thread& t : threads_) t.join();
  threads_.clear();
  {
    absl::MutexLock lock(&phase_mu_);
    watch_stop_ = true;
  }
  watcher_.join();
  absl::MutexLock lock(&mu_);
  return !status_.ok() ? status_ : empty;
}

std::string LocalLowLatencyExperts::StallReport() const {
  absl::MutexLock lock(&phase_mu_);
  return stall_report_.empty() ? "no step stalled" : stall_report_;
}

int64_t LocalLowLatencyExperts::steps() const {
  absl::MutexLock lock(&mu_);
  return steps_;
}

}  // namespace dxs
