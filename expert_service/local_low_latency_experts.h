// LocalLowLatencyExperts: expert ranks inside this process that answer one attention rank
// over the low-latency exchange (dataplane/low_latency/low_latency_exchange.h), each rank a backend
// of its own (its own stream) and the experts split across them (expert e on rank e % ranks). Each
// rank has a thread that runs a step (every MoE layer's round) after step, as an expert
// worker's loop would: one launch of the step's CUDA graph (recorded when the rank was
// attached, before any round ran; where the backend has graphs) and one status read. The ranks
// start each step together. It is the exchange's whole path on one GPU, for tests and benchmarks
// (the single-process engine with moe_factory calling AttachAttention); the services run one rank a
// process.
//
// Every rank and the attention side share one CUDA context here, and a wait spins until
// another rank's kernels run. So nothing may wait for the GPU to go idle while a step is
// under way: set CUDA_MODULE_LOADING=EAGER before the runtime starts (a kernel's first,
// lazy load can wait so), and run a step of each shape once before Start, so that no device
// or pinned memory is freed in a step (cudaFree and cudaFreeHost wait so; cudaMalloc and
// cudaHostAlloc do not: bench/gpu_host_call_probe.cu; gpu_bench --low-latency does this).
// Graphs are recorded and uploaded before they first run (Backend::CaptureGraph). And no
// rank may copy to pageable host memory between its steps: such a copy waits while another
// thread's pageable copy waits in its stream (the driver stages them one at a time), and the
// attention side copies each step's logits so, behind the step's waits for the expert ranks;
// their status reads are kernels into mapped memory (LowLatencyExchange::CheckStatus).
// Otherwise a step stalls until the waits time out. Between processes (the services) none of this
// applies: a process's calls wait only for its own work, and its peers' kernels answer.
#pragma once

#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/model_config.h"
#include "dataplane/low_latency/low_latency_exchange.h"
#include "dataplane/low_latency/low_latency_moe_executor.h"
#include "expert_service/low_latency_expert_rounds.h"
#include "kernels/backend.h"
#include "kernels/moe_executor.h"
#include "model/expert_shard.h"
#include "model/weights.h"

namespace dxs {

class LocalLowLatencyExperts {
 public:
  // `ranks` expert ranks of the experts in `weights`, each on a backend from make_backend;
  // `shape`'s capacity, timeout and ranks (one attention rank) as given, its model sizes
  // from `config`.
  static absl::StatusOr<std::unique_ptr<LocalLowLatencyExperts>> Make(
      const ModelConfig& config, const WeightSource& weights, int ranks, int capacity,
      const std::function<absl::StatusOr<std::unique_ptr<Backend>>()>& make_backend,
      int64_t timeout_ns = 5'000'000'000);
  ~LocalLowLatencyExperts();

  // The attention rank's MoE on `backend` (EngineOptions::moe_factory's signature); once.
  // Connects the exchange and warms the expert ranks up.
  absl::StatusOr<std::unique_ptr<MoeExecutor>> AttachAttention(const ModelConfig& config,
                                                               Backend* backend);
  // Starts the ranks' threads, which answer the attention rank's steps (a wait gives up
  // after the timeout: start them just before the steps). Once.
  void Start();
  // Ends the threads: the attention side must have finished its steps (their combines are
  // done). A step the ranks had begun past them gets empty rounds. The experts' status.
  absl::Status Stop();
  // Steps the expert ranks have answered.
  int64_t steps() const;
  // A stalled step as it stood while stalled (steps take milliseconds): the first time a
  // rank's step had not ended a second after its launch began, each rank's host phase and
  // every exchange's Progress (the rounds each side sent, received and has seen arrive),
  // read then. "no step stalled" otherwise. For a failed run's message.
  std::string StallReport() const;
  LowLatencyMoeExecutor* executor() const { return executor_; }

 private:
  struct Rank {
    std::unique_ptr<Backend> backend;
    std::unique_ptr<ExpertShard> shard;
    std::unique_ptr<LowLatencyExchange> exchange;
    std::unique_ptr<LowLatencyExpertRounds> rounds;
  };
  LocalLowLatencyExperts() = default;
  // Where a rank's thread is, for StallReport.
  enum class Phase { kIdle, kLaunching, kWaiting, kBarrier };
  struct HostPhase {
    Phase phase = Phase::kIdle;
    int64_t step = 0;
    absl::Time since;
  };
  void Loop(Rank* rank);
  void SetPhase(int rank, Phase phase, int64_t step);
  // The watcher's thread: every 100 ms, looks for a stalled step until Stop.
  void Watch();
  std::string Snapshot(const std::vector<HostPhase>& phases, absl::Time now) const;
  absl::Status EmptyStep();

  ModelConfig config_;
  LowLatencyShape shape_;
  std::vector<Rank> ranks_;
  std::unique_ptr<LowLatencyExchange> attention_;
  LowLatencyMoeExecutor* executor_ = nullptr;
  Backend* attention_backend_ = nullptr;
  std::vector<std::thread> threads_;
  mutable absl::Mutex mu_;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  // The step barrier: ranks that finished the current step, and the steps decided so far
  // (each decision says whether the next one runs, for every rank at once).
  int arrived_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t steps_ ABSL_GUARDED_BY(mu_) = 0;
  bool go_ ABSL_GUARDED_BY(mu_) = true;
  int exited_ ABSL_GUARDED_BY(mu_) = 0;
  absl::Status status_ ABSL_GUARDED_BY(mu_);
  std::thread watcher_;
  mutable absl::Mutex phase_mu_;
  std::vector<HostPhase> phases_ ABSL_GUARDED_BY(phase_mu_);
  bool watch_stop_ ABSL_GUARDED_BY(phase_mu_) = false;
  std::string stall_report_ ABSL_GUARDED_BY(phase_mu_);
};

}  // namespace dxs
