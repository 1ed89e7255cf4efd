// AttentionStepLoop: one DP rank's step loop, in lockstep with the other DP ranks.
//
// A step starts with a tiny exchange among all DP ranks (one kStep message each way per
// pair, carrying the sender's token count). A rank with work sends its step message at
// once; an idle rank sends one only when a peer's arrives, so an idle cluster is quiet:
// every rank sleeps in Transport::WaitForActivity and wakes within a millisecond of new
// work (Wake() from the request thread, or a peer's step message). Once the exchange is
// done, every rank runs the forward pass, with zero tokens if it has none, so every MoE
// layer's dispatch/combine sees every DP rank; empty steps are counted.
//
// Two-batch overlap: when the MoE executor overlaps (remote experts) and the cluster has
// at least `overlap_min_tokens` tokens in a step, every rank splits its step into two
// micro-batches (Qwen3MoeModel::Forward), so its attention for one runs while the experts
// compute the other. Each rank's setting travels in its step message and the strictest
// one applies, so all ranks always split the same way.
//
// Placement versions: each rank's step message carries the newest expert placement it
// has; the step dispatches with the oldest of those (every rank keeps a few), so all DP
// ranks of a step send to the same EP ranks, and an EP rank that joins or leaves the
// placement hears from every DP rank of the step or from none.
//
// Retries (elastic EP, set_retry_window): a step that fails with UNAVAILABLE (an EP rank
// died) is not failed to its requests: the scheduler forgets it (Scheduler::UndoStep; the
// attention ranks still hold every input) and it is built and run again, under a new step
// number, once a placement without the dead rank arrives (on_step_failed reports the
// failed EP ranks to the router). Requests wait meanwhile, up to their own deadline (an
// abort is taken at the next attempt); after `window` of failing steps they fail as
// before.
//
// Overlap scheduling (set_overlap_schedule, on by default; LocalEngine's, SGLang's overlap
// scheduler, vLLM's async scheduling): a decode step whose tokens are sampled on the device
// is left queued when its successor can be built before its tokens are known
// (Scheduler::CanStepAhead). The next RunOnce builds that step (BuildStepAhead), takes part
// in its step exchange and runs it with its input tokens taken on the device from the step
// before's samples, and only then reads the step before's tokens, streams them and checks
// their stops, while the device (and the expert ranks) work on the new step. A sequence that
// stopped has one more token computed and discarded. A step of this rank built ahead is an
// ordinary step to the other DP ranks and the expert ranks: the step exchange carries its
// token count as before.
//
// Low-latency decode (set_low_latency): each rank's step message also says whether its
// step fits the low-latency exchange and which generation of it the rank wants; a step in
// which every rank's fits runs over it (LowLatencyDecode), one CUDA graph replay a
// step, with no host synchronisation between layers, and the step's sampling in the same
// graph where it is on the device alone.
//
// Thread safety: RunOnce is called by the step thread only; Wake and counters from any.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <optional>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "attention_service/attention_metrics.h"
#include "attention_service/low_latency_decode.h"
#include "dataplane/dispatch/dispatch_combine.h"
#include "dataplane/transport/transport.h"
#include "model/kv_cache.h"
#include "model/qwen3_moe.h"
#include "model/scheduler.h"
#include "model/step_sampling.h"

namespace dxs {

struct AttentionCounters {
  std::atomic<int64_t> steps{0};
  std::atomic<int64_t> empty_steps{0};      // steps in which this rank had no tokens
  std::atomic<int64_t> all_empty_steps{0};  // steps in which no DP rank had tokens
  std::atomic<int64_t> failed_steps{0};
  std::atomic<int64_t> retried_steps{0};      // failed steps run again rather than failed
  std::atomic<int64_t> overlapped_steps{0};   // steps split into two micro-batches
  std::atomic<int64_t> piecewise_steps{0};    // decode steps run in graph segments
  std::atomic<int64_t> low_latency_steps{0};  // steps over the low-latency exchange
  std::atomic<int64_t> steps_ahead{0};        // steps built ahead of the step before's tokens
  std::atomic<int64_t> tokens{0};
  std::atomic<uint64_t> next_step{0};
};

class AttentionStepLoop {
 public:
  // `dp_peers[r]` is DP rank r's transport peer id; dp_peers[dp_rank] is this rank.
  AttentionStepLoop(int dp_rank, std::vector<int> dp_peers, Transport* transport,
                    Qwen3MoeModel* model, RemoteMoeExecutor* moe, Scheduler* scheduler, KvCache* kv,
                    absl::Duration timeout);

  // Runs one step if this rank has work, a peer started a step, or a wake is pending;
  // otherwise sleeps up to `idle_wait` and returns false.
  absl::StatusOr<bool> RunOnce(absl::Duration idle_wait);
  // Makes the next RunOnce start a step (the cluster-wide wake; an empty one if no rank
  // has work). Thread-safe.
  void Wake();
  const AttentionCounters& counters() const { return counters_; }
  // Smallest cluster-wide token count of a step that is split into two micro-batches; 0
  // turns two-batch overlap off (on every rank: the strictest setting wins). Set before
  // the first RunOnce.
  void set_overlap_min_tokens(int64_t n) { overlap_min_tokens_ = n; }
  static constexpr int64_t kDefaultOverlapMinTokens = 16;
  // Decode steps of one micro-batch (below the two-batch-overlap threshold) through
  // Qwen3MoeModel::ForwardDecodePiecewise: kGraphs replays the work between exchanges as
  // recorded graphs (on a backend that has them); kEager runs the same padded segments
  // without (the reference, and what tests run on the CPU); kOff (the default) runs the
  // plain forward pass. Set before the first RunOnce.
  enum class PiecewiseDecode { kOff, kEager, kGraphs };
  void set_piecewise_decode(PiecewiseDecode mode) { piecewise_ = mode; }
  // Decode steps over the low-latency exchange where every DP rank's fits; not owned, null
  // (the default) for none. The model must run its MoE through ll->moe(). Set before the
  // first RunOnce.
  void set_low_latency(LowLatencyDecode* ll) { ll_ = ll; }
  // Overlap scheduling (see above); false: every step's tokens are read before the next
  // step is built (the A/B baseline). Set before the first RunOnce.
  void set_overlap_schedule(bool on) { overlap_schedule_ = on; }
  // Waits for the step left queued (if any) and forgets it, its tokens unread: before the
  // scheduler's requests are ended from outside the loop (Scheduler::FailAll). Step thread.
  void DropInFlightStep();
  ~AttentionStepLoop() { DropInFlightStep(); }

  // Where each step is reported for Prometheus; not owned, null (the default) for none.
  // Set before the first RunOnce.
  void set_metrics(AttentionMetrics* metrics) { metrics_ = metrics; }
  // Runs on the step thread at the end of every step that ran, after the step's token
  // sinks (so a server can send all of a step's tokens in one message). Set before the
  // first RunOnce.
  void set_on_step_end(std::function<void()> on_step_end) { on_step_end_ = std::move(on_step_end); }
  // Elastic EP: steps failing with UNAVAILABLE are run again for up to `window` (zero, the
  // default: failed at once, their requests with UNAVAILABLE). Step thread.
  void set_retry_window(absl::Duration window) { retry_window_ = window; }
  // Runs on the step thread after a step failed and will be retried.
  void set_on_step_failed(std::function<void()> f) { on_step_failed_ = std::move(f); }
  // The DP ranks the router's view (version `view`) has live, one entry per DP rank; this
  // rank's steps go with those alone (a frozen or partitioned DP rank is left out, and put
  // back once it is live again). Empty (the default): every DP rank. Step thread, between
  // steps.
  void set_dp_ranks(std::vector<bool> live, uint64_t view) {
    const absl::Time now = absl::Now();
    if (dp_back_at_.size() < live.size()) dp_back_at_.resize(live.size(), absl::InfinitePast());
    for (size_t r = 0; r < live.size(); ++r) {
      if (live[r] && !live_dp_.empty() && (r >= live_dp_.size() || !live_dp_[r])) {
        dp_back_at_[r] = now;
      }
    }
    live_dp_ = std::move(live);
    dp_view_ = view;
  }
  // How long a step whose step exchange failed with UNAVAILABLE (a DP peer the router has
  // DEAD, or its connection failed), UNAVAILABLE or DEADLINE_EXCEEDED on a DP peer back in the
  // view within this window, or ABORTED (the DP ranks' views of who is live differ) is run
  // again before its requests fail: nothing of it was computed, and the next view takes the
  // dead rank out (its lease, 3 s by default), the returning rank's step thread catches up,
  // or the views come together.
  static constexpr absl::Duration kStepExchangeRetryWindow = absl::Seconds(10);

 private:
  // What the DP ranks agree on in the step exchange.
  struct StepPlan {
    int64_t total_tokens = 0;  // over all DP ranks
    int num_micro_batches = 1;
    uint64_t placement_version = 0;  // the oldest newest-version over the DP ranks
    bool low_latency = false;        // every DP rank's step fits the low-latency exchange
    uint32_t ll_generation = 0;      // the newest generation any DP rank wants
    uint64_t dp_mask = 0;            // the step's DP ranks (WireHeader::dp_mask)
    uint64_t dp_view = 0;            // the newest view version among them
  };
  // Whether DP rank r takes part in this rank's steps (set_dp_ranks).
  bool DpLive(int r) const {
    return r == dp_rank_ || live_dp_.empty() ||
           (r < static_cast<int>(live_dp_.size()) && live_dp_[r]);
  }
  absl::StatusOr<StepPlan> ExchangeStep(int64_t my_tokens, bool my_step_fits);
  // The step's forward pass over the low-latency exchange; nullopt: an expert rank has
  // none, the step goes by the host-driven exchange. input_ids as Qwen3MoeModel::Forward's;
  // with `sampling` the step's sampling runs inside its graph into *sampled
  // (Qwen3MoeModel::ForwardDecode).
  std::optional<absl::StatusOr<Tensor>> ForwardLowLatency(const StepPlan& plan,
                                                          const std::vector<SequenceChunk>& chunks,
                                                          const Tensor* input_ids,
                                                          const StepSamplingPlan* sampling,
                                                          StepSamplingOutputs* sampled);
  // This rank's overlap threshold as sent in step messages (off: the largest value).
  int32_t OverlapThresholdOnWire() const;
  // Tells every expert rank that this rank failed step_ (in the step exchange or after it)
  // and dispatches nothing more of it (WireHeader kStepAbandoned), so the step's other DP
  // ranks finish it.
  void AbandonStep();
  // A step queued on the device whose tokens the host has not read (overlap scheduling).
  using InFlightStep = StepTokenDownloads::Step;
  // Enqueues the device sampling of the step's logits (Scheduler::PlanStepSampling) and
  // the copy of its tokens to the host; nothing waits. input_ids: the step's, on the device
  // (a step built ahead: its penalties count them).
  absl::StatusOr<InFlightStep> LaunchTokens(const Tensor& logits, const Tensor* input_ids);
  // Reads `step`'s tokens and hands them to the scheduler (FinishStepWithTokens), then
  // on_step_end. A failed read fails every request of the scheduler and returns why.
  absl::Status FinishTokens(InFlightStep step);

  int dp_rank_;
  std::vector<int> dp_peers_;
  Transport* transport_;
  Qwen3MoeModel* model_;
  RemoteMoeExecutor* moe_;
  Scheduler* scheduler_;
  KvCache* kv_;
  absl::Duration timeout_;
  int64_t overlap_min_tokens_ = kDefaultOverlapMinTokens;
  PiecewiseDecode piecewise_ = PiecewiseDecode::kOff;
  LowLatencyDecode* ll_ = nullptr;
  uint64_t step_ = 0;
  std::vector<bool> live_dp_;
  // When each DP rank last came back into the view (set_dp_ranks): a rank that registers
  // again (thawed, partitioned and healed) may still be finishing the step it was stuck in,
  // its step thread waiting out that step's deadline, when this rank's view has it live.
  std::vector<absl::Time> dp_back_at_;
  uint64_t dp_view_ = 0;
  std::optional<absl::Time> exchange_failing_since_;
  std::atomic<bool> wake_pending_{false};
  AttentionCounters counters_;
  AttentionMetrics* metrics_ = nullptr;
  std::function<void()> on_step_end_;
  std::function<void()> on_step_failed_;
  absl::Duration retry_window_ = absl::ZeroDuration();
  std::optional<absl::Time> failing_since_;  // first failure of the current retries
  bool overlap_schedule_ = true;
  std::optional<InFlightStep> in_flight_;
  StepTokenDownloads downloads_;
};

}  // namespace dxs
