// Scheduler: continuous batching over a Qwen3MoeModel and its KV cache.
//
// Requests join (Add) and leave (finish, Abort) between steps. Each step, every live
// request contributes one chunk: the next piece of its prompt (all of it, or
// prefill_chunk_tokens at a time, so a long prompt doesn't stall running decodes), or its
// last sampled token. After the forward pass, FinishStep samples each request whose
// prompt is done, streams the token to its sink, and retires finished requests.
//
// Thread safety: Add and Abort may be called from any thread. BuildStep, FinishStep and
// FailAll are called by the one step thread, which alone touches the KV cache; so KV
// slots are allocated and freed there, never under a running forward pass.
#pragma once

#include <atomic>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <optional>
#include <set>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "common/model_config.h"
#include "kernels/backend.h"
#include "kernels/tensor.h"
#include "model/kv_cache.h"
#include "model/qwen3_moe.h"
#include "model/sampler.h"
#include "model/step_sampling.h"

namespace dxs {

struct GenerationRequest {
  std::vector<int32_t> prompt;
  // 0 only with prompt_logprobs_start >= 0: the request scores its prompt and generates
  // nothing.
  int64_t max_new_tokens = 16;
  SamplingParams sampling;
  std::vector<int32_t> stop_token_ids;
  bool ignore_eos = false;
  // EOS and stop ids are masked until this many tokens were generated (<= max_new_tokens).
  int64_t min_new_tokens = 0;
  // Log-probabilities (kernels/sampling.h, TokenLogprobs) of every output token.
  bool logprobs = false;
  // With each, the top_logprobs most likely alternatives (0..kMaxTopLogprobs).
  int32_t top_logprobs = 0;
  // With each, the log-probabilities of these ids (in the vocabulary).
  std::vector<int32_t> logprob_token_ids;
  // >= 0: score the prompt from this position (< prompt length): TokenSink::on_prompt_logprobs.
  int64_t prompt_logprobs_start = -1;
  // Samples of this prompt (1..kMaxSamples): the prompt is prefilled once and its KV shared
  // (KvCache::Fork); sample i draws from the stream SampleSeed(sampling.seed, i) and reports
  // to TokenSink::sample_sink(i) (sample 0 to the request's own sink).
  int32_t n = 1;

  // Whether each output token comes with a TokenLogprobs.
  bool WantsLogprobs() const { return logprobs || top_logprobs > 0 || !logprob_token_ids.empty(); }
};

// The most samples one request may ask for (GenerationRequest::n).
inline constexpr int32_t kMaxSamples = 64;

// The most ids GenerationRequest::logprob_token_ids may name.
inline constexpr int64_t kMaxLogprobTokenIds = 128;

// A prompt's scores (GenerationRequest::prompt_logprobs_start).
struct PromptLogprobs {
  // The prompt position of positions[0]: max(start, 1), as position 0 has nothing before it.
  int64_t first_position = 0;
  // positions[i]: the prompt token at first_position + i (its `token`) given the tokens
  // before it, with the request's top_logprobs alternatives and logprob_token_ids.
  std::vector<TokenLogprobs> positions;
  // The distribution after the whole prompt (token -1: top_logprobs and the named ids).
  TokenLogprobs next;
};

enum class FinishReason { kLength, kEos, kStopToken, kAborted };
const char* FinishReasonName(FinishReason r);

// Where a request's output goes. Called on the step thread; must not block for long.
struct TokenSink {
  // One generated token; `logits` is its row (vocab floats), valid only during the call.
  // Null for tokens after the first when the step was sampled on the backend
  // (Scheduler::FinishStepWithTokens); the first token always comes with its row.
  std::function<void(int32_t token, const float* logits)> on_token;
  // With GenerationRequest::WantsLogprobs: the token's log-probabilities, just before its
  // on_token. Optional.
  std::function<void(const TokenLogprobs& logprobs)> on_logprobs;
  // With prompt_logprobs_start >= 0: once, when the prompt's prefill ends (before the first
  // token). Optional.
  std::function<void(const PromptLogprobs& logprobs)> on_prompt_logprobs;
  // With n > 1: the sink of sample i (1..n-1), asked for once when the prompt's prefill
  // ends; each sample's sink then gets its own tokens and its own on_done. Prompt scores go
  // to sample 0's (the request's) sink only.
  std::function<TokenSink(int32_t sample)> sample_sink;
  // Exactly once: OK with a finish reason, or the error that ended the request.
  std::function<void(const absl::Status& status, FinishReason reason)> on_done;
};

// Checks a request against the model: INVALID_ARGUMENT naming the field.
absl::Status ValidateRequest(const ModelConfig& config, const GenerationRequest& r);

struct SchedulerOptions {
  int64_t prefill_chunk_tokens = 0;  // 0: whole prompt in one step
};

class Scheduler {
 public:
  Scheduler(const ModelConfig& config, KvCache* kv, SchedulerOptions options);

  // Validates and queues. INVALID_ARGUMENT for a bad request, ALREADY_EXISTS for a
  // duplicate id, RESOURCE_EXHAUSTED if it could never fit in the KV cache.
  absl::Status Add(uint64_t id, GenerationRequest request, TokenSink sink) ABSL_LOCKS_EXCLUDED(mu_);
  // Stops a request at the next step boundary (its sink gets kAborted). False if unknown.
  bool Abort(uint64_t id) ABSL_LOCKS_EXCLUDED(mu_);

  // Step thread.
  bool HasWork() ABSL_LOCKS_EXCLUDED(mu_);
  // The step as the backend sampled it (SampleStepOnBackend, or inside a decode graph):
  // tokens[j] is row j's token (every chunk's, sampled or not) and logprobs[j] its
  // log-probabilities where some request of the step asked (model/step_sampling.h).
  using StepTokens = dxs::StepTokens;
  std::vector<SequenceChunk> BuildStep() ABSL_LOCKS_EXCLUDED(mu_);
  // logits: the step's [StepLogitRows(chunks), vocab] on the host. With `sampled` (the
  // backend's tokens of a step where !StepSamplesOnHost()), each row takes its token from
  // there instead of sampling on the host; the rows still go to the sinks and the
  // log-probabilities are computed from them.
  void FinishStep(const std::vector<float>& logits, const StepTokens* sampled = nullptr)
      ABSL_LOCKS_EXCLUDED(mu_);
  // Whether FinishStep needs the step's logits on the host: a request gets its first token
  // (whose row its sink receives) or scores its prompt. Otherwise the backend samples every
  // row (Backend::SampleRows with PlanStepSampling's rows, LogprobRows where asked) and
  // FinishStepWithTokens takes its ids: only the ids and the asked-for log-probabilities
  // cross to the host.
  bool StepNeedsHostLogits() const;
  // Whether the step's tokens must be drawn on the host, not only its rows seen there: a
  // chunk scores prompt positions (several logits rows). Otherwise the backend samples even
  // the first tokens, those of forked samples included (SampleStepOnBackend), and
  // FinishStep takes them with the downloaded rows: the host's sort of a whole vocabulary
  // per new request (PrepareCandidates) is the device's.
  bool StepSamplesOnHost() const;
  // The step's sampling on the backend: one SamplingRow per row of the step (the request's
  // parameters and its draw number, the tokens it has sampled so far; greedy for rows still
  // in prefill, whose token is unused) with the rows' LogitAdjustments; then, for each chunk
  // whose request forks its samples at this step (StepTokens), n - 1 rows with the samples'
  // derived seeds; what the rows ask of LogprobRows (the widest shape) and their named ids
  // (a forked sample's rows take their chunk's).
  StepSamplingPlan PlanStepSampling() const;
  void FinishStepWithTokens(const StepTokens& step) ABSL_LOCKS_EXCLUDED(mu_);

  // Overlap scheduling (SGLang's overlap scheduler, vLLM's async scheduling): while the step
  // BuildStep built runs on the device, its sequences' next decode step is built and queued
  // behind it, its input tokens taken on the device from the first step's samples (the
  // engine's: LocalEngine); the first step's tokens come to the host after that and go to
  // FinishStepWithTokens, which then streams them while the second runs.
  //
  // CanStepAhead: the current step is one whose successor can be built before its tokens
  // are known: a decode step whose every sequence goes on after it (none reaches
  // max_new_tokens with it), whose sampling does not depend on that token (no penalties; the
  // min_new_tokens mask does not lift with it), and nothing is queued or aborted (an arrival
  // or an abort waits one step, for a step built the usual way).
  bool CanStepAhead() ABSL_LOCKS_EXCLUDED(mu_);
  // The next decode step of the current step's sequences, in the same order: the chunks
  // hold a placeholder token (input ids come from the device) at the next position.
  // PlanStepSampling then plans this step. The next FinishStepWithTokens takes the tokens
  // of the step before it, and a sequence that finished with them (EOS, a stop id) is
  // reported done at once: its token of this step is discarded, never streamed, and its KV
  // is freed when this step's tokens come (FinishStepWithTokens again).
  std::vector<SequenceChunk> BuildStepAhead();
  // Forgets the step BuildStep built (its forward pass failed and will be run again): the
  // prompt chunks it took count as not prefilled; the KV it wrote is overwritten by the
  // retry with the same values. The next BuildStep builds the step anew (aborts and
  // arrivals included).
  void UndoStep() ABSL_LOCKS_EXCLUDED(mu_);
  // Ends every request with `status` (a failed step) and frees their KV.
  void FailAll(const absl::Status& status) ABSL_LOCKS_EXCLUDED(mu_);

  // Prompt tokens prefilled so far, over every request (one with n samples counts its
  // prompt once).
  int64_t prefill_tokens() const { return prefill_tokens_.load(); }

  size_t num_running() ABSL_LOCKS_EXCLUDED(mu_);
  size_t num_queued() ABSL_LOCKS_EXCLUDED(mu_);

 private:
  struct Live {
    Live(uint64_t id_in, GenerationRequest r, TokenSink s, const ModelConfig& config);
    uint64_t id;
    GenerationRequest request;
    TokenSink sink;
    Sampler sampler;
    int slot = -1;  // set on admission
    int64_t prefilled = 0;
    std::vector<int32_t> generated;
    bool aborted = false;
    // The tokens whose logits sampling changes (penalties, logit_bias, the min_new_tokens
    // mask), kept up to date as tokens are generated; adjust_at: token -> index.
    std::vector<LogitAdjustment> adjust;
    std::map<int32_t, size_t> adjust_at;
    std::vector<int32_t> banned;  // EOS and stop ids while fewer than min_new_tokens
    PromptLogprobs prompt_logprobs;
    // KV the request's other samples will fork (KvNeed beyond its own slot); 0 once forked.
    int64_t fork_reserve = 0;
    // Which of its request's samples ForkSamples is drawing the first token of (1..n-1);
    // 0 otherwise (sample 0, and every later step).
    int32_t forking_sample = 0;
    // Finished (its sink told) while a step built ahead still computes its next token; the
    // entry goes, and its KV is freed, when that step's tokens come.
    bool done = false;

    bool NeedsAdjustedRow() const { return !adjust.empty() || request.sampling.min_p != 0.f; }
    LogitAdjustment& Adjustment(int32_t token);
    void Generated(int32_t token);  // updates the adjustments for one more output token
    // The first prompt position whose logits row scores the next token (-1: no scoring).
    int64_t FirstScoredRow() const;
  };
  // KV tokens a request needs with all its samples.
  int64_t KvNeed(const GenerationRequest& r) const;
  // Samples 1..n-1 of l, whose prompt just finished (step row `j`): each forks l's KV and
  // samples its first token from the same row. Returns them with their finish reasons (for
  // those that finished at once).
  std::vector<std::pair<Live, std::optional<FinishReason>>> ForkSamples(
      size_t j, Live& l,
      const std::function<int32_t(size_t j, Live& l, const float** row)>& sample);
  // After `token` was sampled for l: records it, streams it, and says whether l finished.
  std::optional<FinishReason> Emit(Live& l, int32_t token, const float* row);
  // Both take mu_ themselves, and call sinks (Retire: unless the request is done already).
  void Retire(size_t index, const absl::Status& status, FinishReason reason)
      ABSL_LOCKS_EXCLUDED(mu_);
  // Tells l's sink it ended and forgets its id (unless another sample of it runs).
  void EndRequest(Live& l, const absl::Status& status, FinishReason reason)
      ABSL_LOCKS_EXCLUDED(mu_);
  void AdmitQueued() ABSL_LOCKS_EXCLUDED(mu_);
  // StepNeedsHostLogits (to_sample false) and StepSamplesOnHost (true).
  bool StepNeedsHost(bool to_sample) const;
  // FinishStep's body: `sample(j, l, &row)` is chunk j's token (row: its logits, or null).
  // `score(j, l)` runs first for every chunk of the step (prompt scoring); may be null.
  void FinishStepWith(const std::function<void(size_t j, Live& l)>& score,
                      const std::function<int32_t(size_t j, Live& l, const float** row)>& sample)
      ABSL_LOCKS_EXCLUDED(mu_);

  ModelConfig config_;
  KvCache* kv_;
  SchedulerOptions options_;
  absl::Mutex mu_;
  std::deque<Live> queued_ ABSL_GUARDED_BY(mu_);
  std::vector<uint64_t> aborts_ ABSL_GUARDED_BY(mu_);
  std::set<uint64_t> known_ids_ ABSL_GUARDED_BY(mu_);  // queued or running
  int64_t queued_tokens_ ABSL_GUARDED_BY(mu_) = 0;     // KV the queue will need
  std::vector<Live> running_;  // step thread only (size mirrored for num_running)
  size_t num_running_ ABSL_GUARDED_BY(mu_) = 0;
  std::vector<size_t> step_owners_;
  std::vector<int64_t> step_prefill_;     // per step chunk: prompt tokens BuildStep took
  std::vector<int64_t> step_logit_rows_;  // per step chunk: its logits rows
  // The current step was built by BuildStepAhead and the step before it (the same owners)
  // has not had its tokens yet.
  bool ahead_ = false;
  std::vector<float> adjusted_row_;  // scratch: a row with its request's adjustments
  // While a request's samples take their first tokens from one row (FinishStepWith):
  // share_row_, and whether row_scratch_ holds that row's candidates yet.
  bool share_row_ = false;
  bool row_prepared_ = false;
  SamplingScratch row_scratch_;
  std::atomic<int64_t> prefill_tokens_{0};
  int64_t fork_reserve_ = 0;  // KV held for forks not made yet (step thread)
};

// The step's tokens sampled on `backend` from its logits [rows, vocab] (for a step where
// !scheduler.StepSamplesOnHost()), for FinishStep or FinishStepWithTokens: the plan
// (PlanStepSampling) uploaded, forked samples' rows gathered, then EnqueueStepSampling
// (ArgmaxRows when every row is greedy without adjustments, else SampleRows; LogprobRows
// where a request asked). Only the ids and the asked-for log-probabilities cross to the
// host. The single-process engine and the attention worker's step loop finish their
// steps with it where the sampling is not in a decode graph (Qwen3MoeModel::ForwardDecode).
// step_ids: the step's input ids on the backend (i32 [chunks]), which a step built ahead
// needs (StepSamplingPlan::pending_tokens: FAILED_PRECONDITION without them).
absl::StatusOr<Scheduler::StepTokens> SampleStepOnBackend(Backend* backend, const Tensor& logits,
                                                          const Scheduler& scheduler,
                                                          const Tensor* step_ids = nullptr);
// Its device half: the plan's sampling of `logits` enqueued, its outputs (one row per plan
// row) left on the backend.
absl::StatusOr<StepSamplingOutputs> EnqueueStepSamplingOnBackend(Backend* backend,
                                                                 const Tensor& logits,
                                                                 const StepSamplingPlan& plan,
                                                                 const Tensor* step_ids = nullptr);

}  // namespace dxs
