#include "attention_service/attention_step_loop.h"

#include <algorithm>
#include <chrono>
#include <iostream>
#include <limits>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "common/step_trace.h"
#include "common/timeouts.h"
#include "dataplane/dispatch/wire.h"

namespace dxs {

AttentionStepLoop::AttentionStepLoop(int dp_rank, std::vector<int> dp_peers, Transport* transport,
                                     Qwen3MoeModel* model, RemoteMoeExecutor* moe,
                                     Scheduler* scheduler, KvCache* kv, absl::Duration timeout)
    : dp_rank_(dp_rank),
      dp_peers_(std::move(dp_peers)),
      transport_(transport),
      model_(model),
      moe_(moe),
      scheduler_(scheduler),
      kv_(kv),
      timeout_(timeout),
      downloads_(model->backend()) {}

void AttentionStepLoop::Wake() {
  wake_pending_ = true;
  transport_->Wake();
}

void AttentionStepLoop::AbandonStep() {
  // The expert ranks may be gathering a round of this step that waits for this rank's
  // header; the other DP ranks of the step wait on that round. A failed send (a dead expert
  // rank) needs nothing more: that rank's rounds fail anyway.
  WireHeader h;
  h.kind = MessageKind::kStepAbandoned;
  h.step = step_;
  const std::string encoded = h.Encode();
  for (int peer : moe_->ep_peers()) (void)transport_->Send(peer, encoded, nullptr, 0);
}

int32_t AttentionStepLoop::OverlapThresholdOnWire() const {
  if (overlap_min_tokens_ <= 0) return std::numeric_limits<int32_t>::max();
  return static_cast<int32_t>(
      std::min<int64_t>(overlap_min_tokens_, std::numeric_limits<int32_t>::max()));
}

absl::StatusOr<AttentionStepLoop::StepPlan> AttentionStepLoop::ExchangeStep(int64_t my_tokens,
                                                                            bool my_step_fits) {
  const int num_dp = static_cast<int>(dp_peers_.size());
  // The step's DP ranks: those this rank's view has live (itself always). A left-out rank
  // makes the step ineligible for the low-latency exchange, which is made for all of them.
  std::vector<int> members;
  uint64_t mask = 0;
  for (int r = 0; r < num_dp; ++r) {
    if (!DpLive(r)) continue;
    members.push_back(r);
    if (num_dp <= 64) mask |= uint64_t{1} << r;
  }
  const bool all_members = static_cast<int>(members.size()) == num_dp;
  // Step messages carry (token count, overlap threshold) in (aux, num_rows).
  int32_t threshold = OverlapThresholdOnWire();
  uint64_t version = moe_->newest_placement_version();
  bool all_fit = my_step_fits && all_members;
  uint32_t generation = ll_ != nullptr ? ll_->wanted_generation() : 0;
  uint64_t view = dp_view_;
  auto plan = [&](int64_t total) {
    StepPlan p;
    p.total_tokens = total;
    p.placement_version = version;
    p.low_latency = all_fit;
    p.ll_generation = generation;
    p.dp_mask = all_members ? 0 : mask;
    p.dp_view = view;
    const bool overlap = !all_fit && moe_->overlaps() &&
                         threshold != std::numeric_limits<int32_t>::max() && total >= threshold;
    p.num_micro_batches = overlap ? 2 : 1;
    return p;
  };
  if (members.size() == 1) return plan(my_tokens);
  const absl::Time deadline = absl::Now() + timeout_;
  // Peers' step messages, read first: a peer may be a step ahead if this rank missed the
  // end of a failed step (or was left out of the others' steps for a while); then this
  // rank joins the peer's step number. Every queued message is read and the newest kept:
  // a peer sends one per step it starts, so the older ones are steps it has given up on.
  // Joining one of those instead would leave this rank a step behind the peer for good,
  // each waiting out the step timeout in turn (a rank that spent a step timeout in a step
  // the peer had left finds two messages queued, and the peer already waiting in the
  // second).
  std::vector<WireHeader> theirs(num_dp);
  std::vector<bool> have(num_dp, false);
  for (int r : members) {
    if (r == dp_rank_) continue;
    while (transport_->HasMessage(dp_peers_[r])) {
      DXS_ASSIGN_OR_RETURN(TransportMessage m, transport_->Recv(dp_peers_[r], deadline));
      DXS_ASSIGN_OR_RETURN(theirs[r], WireHeader::Decode(m.header));
      have[r] = true;
    }
  }
  for (int r : members) {
    if (have[r] && theirs[r].step > step_) step_ = theirs[r].step;
  }
  WireHeader mine;
  mine.kind = MessageKind::kStep;
  mine.aux = my_tokens;
  mine.num_rows = threshold;
  mine.placement_version = version;
  if (all_fit) mine.flags = WireHeader::kLowLatencyFits;
  mine.ll_generation = generation;
  mine.dp_mask = all_members ? 0 : mask;
  mine.dp_view = dp_view_;
  auto send_mine = [&]() -> absl::Status {
    mine.step = step_;
    const std::string encoded = mine.Encode();
    for (int r : members) {
      if (r == dp_rank_) continue;
      DXS_RETURN_IF_ERROR(transport_->Send(dp_peers_[r], encoded, nullptr, 0));
    }
    return absl::OkStatus();
  };
  DXS_RETURN_IF_ERROR(send_mine());
  for (bool again = true; again;) {
    again = false;
    for (int r : members) {
      if (r == dp_rank_) continue;
      // Skip step messages of older steps (left over from a failed step).
      while (!have[r] || theirs[r].step < step_) {
        absl::StatusOr<TransportMessage> got = transport_->Recv(dp_peers_[r], deadline);
        if (!got.ok()) {
          return absl::Status(
              got.status().code(),
              absl::StrCat("step message of DP rank ", r, " for step ", step_,
                           have[r] ? absl::StrCat(" (its last: step ", theirs[r].step, ")") : "",
                           ": ", got.status().message()));
        }
        TransportMessage m = *std::move(got);
        DXS_ASSIGN_OR_RETURN(theirs[r], WireHeader::Decode(m.header));
        have[r] = true;
      }
      if (theirs[r].kind != MessageKind::kStep) {
        return absl::InternalError(absl::StrCat("DP rank ", r, " sent a message of kind ",
                                                static_cast<int>(theirs[r].kind),
                                                " where its step message was due"));
      }
      if (theirs[r].step > step_) {
        // A peer ahead (this rank was left out of its steps, or missed a failed step's
        // end): take its step number, tell every member, and gather again.
        step_ = theirs[r].step;
        DXS_RETURN_IF_ERROR(send_mine());
        again = true;
        break;
      }
    }
  }
  int64_t total = my_tokens;
  for (int r : members) {
    if (r == dp_rank_) continue;
    if (theirs[r].dp_mask != mine.dp_mask) {
      // Views differ on which DP ranks are live (one just learnt that a rank died or came
      // back): nothing is computed, and the step is run again once they agree.
      return absl::AbortedError(absl::StrCat("DP rank ", r, " steps with DP ranks 0x",
                                             absl::Hex(theirs[r].dp_mask), ", this rank with 0x",
                                             absl::Hex(mine.dp_mask),
                                             " (their views of the live DP ranks differ)"));
    }
    total += theirs[r].aux;
    threshold = std::max(threshold, theirs[r].num_rows);
    version = std::min(version, theirs[r].placement_version);
    all_fit = all_fit && (theirs[r].flags & WireHeader::kLowLatencyFits) != 0;
    generation = std::max(generation, theirs[r].ll_generation);
    view = std::max(view, theirs[r].dp_view);
  }
  return plan(total);
}

std::optional<absl::StatusOr<Tensor>> AttentionStepLoop::ForwardLowLatency(
    const StepPlan& plan, const std::vector<SequenceChunk>& chunks, const Tensor* input_ids,
    const StepSamplingPlan* sampling, StepSamplingOutputs* sampled) {
  bool made_new = false;
  absl::StatusOr<bool> began =
      ll_->BeginStep(step_, plan.ll_generation, moe_->placement(), moe_->ep_peers(), &made_new);
  if (!began.ok()) return began.status();
  if (!*began) {
    std::cerr << "attention rank " << dp_rank_
              << ": an expert rank has no low-latency exchange; decode steps go by the "
                 "host-driven exchange\n";
    return std::nullopt;
  }
  // The recorded decode graphs hold the old exchange's memory.
  if (made_new) model_->DropDecodeGraphs();
  if (chunks.empty()) {
    if (absl::Status s = ll_->EmptyStep(); !s.ok()) return s;
    return model_->backend()->Allocate({0, model_->config().vocab_size}, DType::kF32);
  }
  return model_->ForwardDecode(chunks, kv_, piecewise_ == PiecewiseDecode::kGraphs, sampling,
                               sampled, input_ids);
}

absl::StatusOr<AttentionStepLoop::InFlightStep> AttentionStepLoop::LaunchTokens(
    const Tensor& logits, const Tensor* input_ids) {
  const StepSamplingPlan plan = scheduler_->PlanStepSampling();
  DXS_ASSIGN_OR_RETURN(StepSamplingOutputs outputs,
                       EnqueueStepSamplingOnBackend(model_->backend(), logits, plan, input_ids));
  return downloads_.Launch(std::move(outputs), plan.logprobs);
}

absl::Status AttentionStepLoop::FinishTokens(InFlightStep step) {
  absl::StatusOr<StepTokens> tokens = downloads_.Read(step);
  if (!tokens.ok()) {
    const absl::Status failure = absl::UnavailableError(absl::StrCat(
        "DP rank ", dp_rank_, ": reading a step's tokens failed: ", tokens.status().message()));
    std::cerr << "attention rank " << dp_rank_ << ": " << failure << "\n";
    scheduler_->FailAll(failure);
    if (on_step_end_) on_step_end_();
    return failure;
  }
  scheduler_->FinishStepWithTokens(*tokens);
  if (on_step_end_) on_step_end_();
  return absl::OkStatus();
}

void AttentionStepLoop::DropInFlightStep() { downloads_.Drop(&in_flight_); }

absl::StatusOr<bool> AttentionStepLoop::RunOnce(absl::Duration idle_wait) {
  // A step left queued whose successor cannot be built ahead (an arrival, an abort, a
  // sequence at its last token...): its tokens now; the next RunOnce builds a step the
  // usual way.
  if (in_flight_ && !scheduler_->CanStepAhead()) {
    InFlightStep step = *std::move(in_flight_);
    in_flight_.reset();
    (void)FinishTokens(std::move(step));
    return true;
  }
  bool peer_started = false;
  for (int r = 0; r < static_cast<int>(dp_peers_.size()); ++r) {
    // A left-out rank's messages wait for it to be live again (they are older steps then).
    if (r != dp_rank_ && DpLive(r) && transport_->HasMessage(dp_peers_[r])) peer_started = true;
  }
  if (!scheduler_->HasWork() && !peer_started && !wake_pending_.exchange(false)) {
    DXS_RETURN_IF_ERROR(transport_->WaitForActivity(absl::Now() + idle_wait));
    return false;
  }
  wake_pending_ = false;  // this step is the one a pending wake asked for
  const auto step_start = std::chrono::steady_clock::now();
  // With a step in flight, this one is built ahead of its tokens (CanStepAhead held).
  std::optional<InFlightStep> before = std::move(in_flight_);
  in_flight_.reset();
  const bool ahead = before.has_value();
  const Tensor* input_ids = ahead ? &before->outputs.ids : nullptr;
  std::vector<SequenceChunk> chunks =
      before ? scheduler_->BuildStepAhead() : scheduler_->BuildStep();
  int64_t my_tokens = 0;
  for (const SequenceChunk& c : chunks) my_tokens += static_cast<int64_t>(c.tokens.size());
  const bool my_step_fits = ll_ != nullptr && ll_->Fits(Qwen3MoeModel::IsDecodeStep(chunks),
                                                        static_cast<int64_t>(chunks.size()));
  absl::StatusOr<StepPlan> plan = ExchangeStep(my_tokens, my_step_fits);
  // The step's outcome: logits on the host where a request gets its first token (its sink
  // receives the row), else only the tokens the backend sampled (SampleStepOnBackend).
  absl::Status outcome = absl::UnknownError("no forward pass");
  std::vector<float> host_logits;
  Scheduler::StepTokens sampled;
  // The step's tokens on their way to the host (overlap scheduling: a step sampled on the
  // device alone).
  std::optional<InFlightStep> launched;
  // First tokens are sampled on the backend too (unless samples fork or the step scores
  // prompt positions); their rows come to the host besides.
  const bool host_rows = scheduler_->StepNeedsHostLogits();
  const bool host_sampling = scheduler_->StepSamplesOnHost();
  bool piecewise_step = false, low_latency_step = false;
  // The traces' strings are built only when tracing is on (off: once a step, a static's load).
  if (StepTraceOn() && plan.ok()) {
    TraceStep("attention ", dp_rank_, ": step ", step_, " planned: ", my_tokens, " of ",
              plan->total_tokens, " tokens, DP ranks 0x", absl::Hex(plan->dp_mask),
              " (0: all) of view ", plan->dp_view, ", ", plan->num_micro_batches, " micro-batches",
              plan->low_latency ? ", low-latency" : "");
  } else if (StepTraceOn()) {
    TraceStep("attention ", dp_rank_, ": step ", step_, " not planned: ", plan.status().ToString());
  }
  if (plan.ok()) {
    moe_->set_step(step_);
    moe_->set_dp_ranks(plan->dp_mask, plan->dp_view);
    (void)moe_->UsePlacement(plan->placement_version);  // kept: else the current one
    std::optional<absl::StatusOr<Tensor>> ll_out;
    // A low-latency step sampled on the device alone samples inside its graph (the
    // penalties, filters and log-probabilities too), as the single-process engine's
    // decode steps do: only the ids and asked-for log-probabilities come back.
    std::optional<StepSamplingPlan> graph_sampling;
    StepSamplingOutputs graph_sampled;
    if (plan->low_latency && !host_sampling && !host_rows && !chunks.empty()) {
      graph_sampling = scheduler_->PlanStepSampling();
      if (!graph_sampling->fork_rows.empty()) graph_sampling.reset();
    }
    if (plan->low_latency) {
      ll_out = ForwardLowLatency(*plan, chunks, input_ids,
                                 graph_sampling ? &*graph_sampling : nullptr, &graph_sampled);
    }
    low_latency_step = ll_out.has_value();
    piecewise_step = !low_latency_step && piecewise_ != PiecewiseDecode::kOff &&
                     plan->num_micro_batches == 1 && Qwen3MoeModel::IsDecodeStep(chunks);
    absl::StatusOr<Tensor> out =
        low_latency_step ? *std::move(ll_out)
        : piecewise_step ? model_->ForwardDecodePiecewise(
                               chunks, kv_, piecewise_ == PiecewiseDecode::kGraphs, input_ids)
                         : model_->Forward(chunks, kv_, plan->num_micro_batches, input_ids);
    if (!out.ok()) {
      outcome = out.status();
    } else if (low_latency_step && graph_sampling) {
      // Sampled in the graph: the tokens' copy to the host is queued; they are read now or,
      // with overlap scheduling, after the next step is queued.
      absl::StatusOr<InFlightStep> l =
          downloads_.Launch(std::move(graph_sampled), graph_sampling->logprobs);
      outcome = l.status();
      if (l.ok()) launched = *std::move(l);
    } else if (overlap_schedule_ && !host_sampling && !host_rows && !chunks.empty()) {
      // Sampled on the device alone: the tokens are read later, after the next step is
      // queued where it can be built ahead of them.
      absl::StatusOr<InFlightStep> l = LaunchTokens(*out, input_ids);
      outcome = l.status();
      if (l.ok()) launched = *std::move(l);
    } else {
      outcome = absl::OkStatus();
      if (!host_sampling) {
        absl::StatusOr<Scheduler::StepTokens> t =
            SampleStepOnBackend(model_->backend(), *out, *scheduler_, input_ids);
        outcome = t.status();
        if (t.ok()) sampled = *std::move(t);
      }
      if (outcome.ok() && host_rows) {
        absl::StatusOr<std::vector<float>> h = model_->backend()->Download(*out);
        outcome = h.status();
        if (h.ok()) host_logits = *std::move(h);
      }
    }
    if (low_latency_step) {
      // The exchange's waits report here: a step whose peer stopped answering has
      // computed on rows that never came, so its tokens are not used.
      absl::Status ended = ll_->EndStep();
      if (outcome.ok()) outcome = ended;
      if (!outcome.ok()) ll_->Reset();
    }
  } else {
    outcome = plan.status();
  }
  if (!outcome.ok()) downloads_.Drop(&launched);
  // The step before's tokens, now that this step is queued behind it: streamed and their
  // stops checked while the device works on this one. Then this step is the scheduler's
  // current step, as if built the usual way (a failure below undoes or fails it as such).
  bool read_failed = false;
  if (before) read_failed = !FinishTokens(*std::move(before)).ok();
  if (StepTraceOn() && plan.ok()) {
    TraceStep("attention ", dp_rank_, ": step ", step_, " ended: ", outcome.ToString());
  }
  // A step not planned here may still have been planned by a DP peer that read this rank's
  // step message before this rank gave up on the peer's.
  if (!outcome.ok()) AbandonStep();
  ++step_;
  counters_.next_step = step_;
  ++counters_.steps;
  counters_.tokens += my_tokens;
  if (my_tokens == 0) ++counters_.empty_steps;
  if (plan.ok() && plan->total_tokens == 0) ++counters_.all_empty_steps;
  if (plan.ok() && plan->num_micro_batches > 1) ++counters_.overlapped_steps;
  if (piecewise_step) ++counters_.piecewise_steps;
  if (low_latency_step) ++counters_.low_latency_steps;
  if (ahead) ++counters_.steps_ahead;
  auto report = [&] {
    if (metrics_ == nullptr) return;
    metrics_->OnStep(
        my_tokens, !outcome.ok(), plan.ok() ? plan->num_micro_batches : 1, piecewise_step,
        low_latency_step, ahead,
        std::chrono::duration<double>(std::chrono::steady_clock::now() - step_start).count());
  };
  if (read_failed) {
    // Every request has failed with the step before (a device error); this step's tokens
    // are for none.
    downloads_.Drop(&launched);
    outcome = absl::UnavailableError("the tokens of the step before could not be read");
    ++counters_.failed_steps;
    report();
    return true;
  }
  // A DP rank of the step that the router now has DEAD: the expert ranks may have dropped a
  // round it was part of (its rows never came), so this rank's step failed through no
  // fault of its own.
  bool lost_dp_member = false;
  if (plan.ok() && !outcome.ok()) {
    for (int r = 0; r < static_cast<int>(dp_peers_.size()); ++r) {
      const bool member = plan->dp_mask == 0 || (r < 64 && ((plan->dp_mask >> r) & 1) != 0);
      if (r != dp_rank_ && member && transport_->PeerDeclaredDead(dp_peers_[r])) {
        lost_dp_member = true;
      }
    }
  }
  // A step exchange that failed on a DP peer the router has just declared dead, or on DP
  // ranks that disagree on who is live.
  bool exchange_lost_dp = !plan.ok() && absl::IsAborted(outcome);
  const absl::Time failed_at = absl::Now();
  // UNAVAILABLE: a link failed; DEADLINE_EXCEEDED: a peer's step message did not come.
  const bool exchange_unanswered =
      !plan.ok() && (absl::IsUnavailable(outcome) || absl::IsDeadlineExceeded(outcome));
  for (int r = 0; exchange_unanswered && r < static_cast<int>(dp_peers_.size()); ++r) {
    if (r == dp_rank_) continue;
    if (absl::IsUnavailable(outcome) && transport_->PeerDeclaredDead(dp_peers_[r])) {
      exchange_lost_dp = true;
    }
    // A peer back in the view within the window may be unreachable still, or its step thread
    // still waiting out the step it was stuck in, so its first step message is late.
    if (DpLive(r) && r < static_cast<int>(dp_back_at_.size()) &&
        failed_at - dp_back_at_[r] < kStepExchangeRetryWindow) {
      exchange_lost_dp = true;
    }
  }
  if (exchange_lost_dp || lost_dp_member) {
    // The step exchange failed on a DP peer (nothing was computed), or the step lost a DP
    // rank: run the step again (its requests keep their state, as for elastic EP's
    // retries) while the views catch up, for up to the window.
    const absl::Time now = absl::Now();
    if (!exchange_failing_since_) exchange_failing_since_ = now;
    if (now - *exchange_failing_since_ < kStepExchangeRetryWindow) {
      ++counters_.failed_steps;
      ++counters_.retried_steps;
      if (now == *exchange_failing_since_) {
        std::cerr << "attention rank " << dp_rank_ << ": step " << step_ - 1
                  << (lost_dp_member ? " lost a DP rank" : "'s step exchange failed")
                  << ", running it again: " << outcome << "\n";
      }
      scheduler_->UndoStep();
      report();
      (void)transport_->WaitForActivity(absl::Now() + kStepRetryPause);
      wake_pending_ = true;
      return true;
    }
  }
  if (plan.ok() && !lost_dp_member) exchange_failing_since_.reset();
  if (!outcome.ok() && retry_window_ > absl::ZeroDuration() && absl::IsUnavailable(outcome)) {
    const absl::Time now = absl::Now();
    if (!failing_since_) failing_since_ = now;
    if (now - *failing_since_ < retry_window_) {
      ++counters_.failed_steps;
      ++counters_.retried_steps;
      if (counters_.retried_steps == 1 || now == *failing_since_) {
        std::cerr << "attention rank " << dp_rank_ << ": step " << step_ - 1
                  << " failed, running it again until a placement without the failed EP rank "
                     "arrives: "
                  << outcome << "\n";
      }
      scheduler_->UndoStep();
      report();
      if (on_step_failed_) on_step_failed_();
      // Not at once: a new placement (or the peer) takes a moment; a new view wakes us.
      (void)transport_->WaitForActivity(absl::Now() + kStepRetryPause);
      wake_pending_ = true;  // the retry runs even if this rank has no request left
      return true;
    }
  }
  if (outcome.ok()) failing_since_.reset();
  if (!outcome.ok()) {
    failing_since_.reset();
    exchange_failing_since_.reset();
    ++counters_.failed_steps;
    // UNAVAILABLE to the requests (the cluster failed them, not their input), the step's own
    // code in the message: a peer's DEADLINE_EXCEEDED and a closed link read differently.
    const absl::Status failure = absl::UnavailableError(
        absl::StrCat("step ", step_ - 1, " failed on DP rank ", dp_rank_, ": ",
                     absl::StatusCodeToString(outcome.code()), ": ", outcome.message()));
    std::cerr << "attention rank " << dp_rank_ << ": " << failure << "\n";
    scheduler_->FailAll(failure);
    report();
    if (on_step_end_) on_step_end_();
    return true;
  }
  if (launched) {
    if (overlap_schedule_ && scheduler_->CanStepAhead()) {
      // Left queued: the next RunOnce queues the step after it, then reads its tokens.
      in_flight_ = std::move(launched);
      report();
      return true;
    }
    report();
    (void)FinishTokens(*std::move(launched));  // calls on_step_end
    return true;
  }
  if (host_sampling) {
    scheduler_->FinishStep(host_logits);
  } else if (host_rows) {
    scheduler_->FinishStep(host_logits, &sampled);
  } else {
    scheduler_->FinishStepWithTokens(sampled);
  }
  report();
  if (on_step_end_) on_step_end_();
  return true;
}

}  // namespace dxs
