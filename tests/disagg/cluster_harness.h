// An in-process disaggregated cluster for tests: M attention ranks and N expert ranks,
// each on its own thread with its own weights and backend, talking through a Transport
// group (inproc, or UCX endpoints connected to each other in this process; the
// multi-process tests use UCX between processes). Mirrors what dxs-attention and
// dxs-expert run, minus gRPC and the router.
#pragma once

#include <atomic>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "absl/synchronization/notification.h"
#include "attention_service/attention_step_loop.h"
#include "dataplane/dispatch/dispatch_combine.h"
#include "dataplane/dispatch/placement.h"
#include "expert_service/expert_step_server.h"
#include "model/weights.h"

namespace dxs::testing {

struct ResultSink {
  std::mutex mu;
  std::vector<int32_t> tokens;
  std::vector<float> first_logits;
  std::vector<TokenLogprobs> logprobs;  // one per token, where the request asked
  bool done = false;
  absl::Status status;
  FinishReason reason = FinishReason::kLength;
};

struct ClusterOptions {
  DType wire_dtype = DType::kF32;  // kF8E4M3: FP8 dispatch rows, bf16 answers
  // Set on every DP rank's executor (called from their step threads at once); not owned.
  DispatchObserver* dispatch_observer = nullptr;
  std::string transport = "inproc";  // or "ucx"
  // Each rank's backend; null: the CPU backend.
  std::function<std::unique_ptr<Backend>()> backend_factory;
  // How the DP ranks run one-micro-batch decode steps (AttentionStepLoop).
  AttentionStepLoop::PiecewiseDecode piecewise = AttentionStepLoop::PiecewiseDecode::kOff;
  // Overlap scheduling on the DP ranks (AttentionStepLoop::set_overlap_schedule).
  bool overlap_schedule = true;
  // The one-copy exchange where the ranks can map each other (DispatchOptions); false:
  // every row through the transport.
  bool mapped_regions = true;
  // The DP ranks start stepping only at Release(): requests submitted before it are all in
  // their rank's first step, so the steps' batches do not depend on the threads' timing
  // (tests that compare runs bit for bit).
  bool held = false;
  // Runs on each DP rank's step thread before its first step (after Release), with the rank
  // and its loop: for what only the step thread may call (AttentionStepLoop::set_dp_ranks).
  // It may block, holding that rank's steps back; it must return before the cluster goes.
  std::function<void(int rank, AttentionStepLoop* loop)> on_step_thread_start;
  // The same for each EP rank's serving thread, before its first round
  // (ExpertStepServer::set_dp_view).
  std::function<void(int rank, ExpertStepServer* server)> on_serve_thread_start;
};

class InprocCluster {
 public:
  InprocCluster(const std::string& model_dir, int num_attention, const Placement& placement,
                DType wire_dtype = DType::kF32);
  InprocCluster(const std::string& model_dir, int num_attention, const Placement& placement,
                const ClusterOptions& options);
  ~InprocCluster();

  // Submits to DP rank `rank`; the sink is filled as tokens arrive.
  absl::Status Submit(int rank, uint64_t id, const GenerationRequest& r,
                      std::shared_ptr<ResultSink> sink);
  // Aborts request `id` on DP rank `rank` (Scheduler::Abort); false if unknown there.
  bool Abort(int rank, uint64_t id);
  // Starts one cluster step with no new work (all ranks empty unless busy).
  void WakeAll();
  // Lets DP ranks of a cluster made `held` start stepping.
  void Release();
  // Waits until every sink is done and the cluster has settled: each DP rank has since
  // found no step to run (its counters final) and each EP rank has counted as many steps as
  // the DP ranks, which all agree. False if that does not happen within `timeout`.
  bool WaitAllDone(const std::vector<std::shared_ptr<ResultSink>>& sinks, absl::Duration timeout);
  // Waits until every sink is done, nothing more (a rank that ran steps again counts more
  // steps than the others, so the cluster never settles in WaitAllDone's sense). False if
  // that does not happen by `deadline`.
  static bool WaitSinksDone(const std::vector<std::shared_ptr<ResultSink>>& sinks,
                            absl::Time deadline);

  const AttentionCounters& attention_counters(int r) const { return dp_[r]->loop->counters(); }
  const ExpertCounters& expert_counters(int r) const { return ep_[r]->server->counters(); }
  const DispatchCounters& dispatch_counters(int r) const { return dp_[r]->moe->counters(); }
  // (token, expert) pairs EP rank r's experts computed, all layers.
  int64_t expert_pairs(int r) const {
    int64_t n = 0;
    for (int64_t c : ep_[r]->shard->tokens_per_expert_snapshot()) n += c;
    return n;
  }
  int num_attention() const { return static_cast<int>(dp_.size()); }
  // Peer `peer`'s transport (DP ranks first, then EP ranks): to break and mend links.
  Transport* transport(int peer) const { return transports_[peer].get(); }

 private:
  struct DpRank {
    std::unique_ptr<Backend> backend;
    std::unique_ptr<KvCache> kv;
    std::unique_ptr<Scheduler> scheduler;
    std::unique_ptr<RemoteMoeExecutor> moe;
    std::unique_ptr<Qwen3MoeModel> model;
    std::unique_ptr<AttentionStepLoop> loop;
    std::atomic<int64_t> idle_polls{0};  // RunOnce calls that found no step to run
    std::thread thread;
  };
  struct EpRank {
    std::unique_ptr<Backend> backend;
    std::unique_ptr<ExpertShard> shard;
    std::unique_ptr<ShardCompute> compute;
    std::unique_ptr<ExpertStepServer> server;
    std::thread thread;
  };
  std::vector<std::unique_ptr<Transport>> transports_;
  std::vector<std::unique_ptr<DpRank>> dp_;
  std::vector<std::unique_ptr<EpRank>> ep_;
  std::atomic<bool> stop_{false};
  absl::Notification released_;  // notified at once unless the cluster is made held
};

}  // namespace dxs::testing
