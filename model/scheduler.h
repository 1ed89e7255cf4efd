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

#include <cstdint>
#include <deque>
#include <functional>
#include <map>
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

namespace dxs {

struct GenerationRequest {
  std::vector<int32_t> prompt;
  int64_t max_new_tokens = 16;
  SamplingParams sampling;
  std::vector<int32_t> stop_token_ids;
  bool ignore_eos = false;
};

enum class FinishReason { kLength, kEos, kStopToken, kAborted };
const char* FinishReasonName(FinishReason r);

// Where a request's output goes. Called on the step thread; must not block for long.
struct TokenSink {
  // One generated token; `logits` is its row (vocab floats), valid only during the call.
  // Null for tokens after the first when the step was sampled on the backend
  // (Scheduler::FinishStepWithTokens); the first token always comes with its row.
  std::function<void(int32_t token, const float* logits)> on_token;
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
  std::vector<SequenceChunk> BuildStep() ABSL_LOCKS_EXCLUDED(mu_);
  // logits: the step's [num_chunks, vocab] on the host.
  void FinishStep(const std::vector<float>& logits) ABSL_LOCKS_EXCLUDED(mu_);
  // Whether FinishStep needs the step's logits on the host: a request gets its first token
  // (whose row its sink receives). Otherwise the backend samples every row
  // (Backend::SampleRows with StepSamplingRows) and FinishStepWithTokens takes its ids:
  // only the ids cross to the host.
  bool StepNeedsHostLogits() const;
  // One SamplingRow per row of the step: the request's parameters and its draw number (the
  // tokens it has sampled so far); greedy for rows still in prefill (their token is unused).
  std::vector<SamplingRow> StepSamplingRows() const;
  // tokens[j]: row j's token as the backend sampled it (every chunk's, sampled or not).
  void FinishStepWithTokens(const std::vector<int32_t>& tokens) ABSL_LOCKS_EXCLUDED(mu_);
  // Forgets the step BuildStep built (its forward pass failed and will be run again): the
  // prompt chunks it took count as not prefilled; the KV it wrote is overwritten by the
  // retry with the same values. The next BuildStep builds the step anew (aborts and
  // arrivals included).
  void UndoStep() ABSL_LOCKS_EXCLUDED(mu_);
  // Ends every request with `status` (a failed step) and frees their KV.
  void FailAll(const absl::Status& status) ABSL_LOCKS_EXCLUDED(mu_);

  size_t num_running() ABSL_LOCKS_EXCLUDED(mu_);
  size_t num_queued() ABSL_LOCKS_EXCLUDED(mu_);

 private:
  struct Live {
    Live(uint64_t id_in, GenerationRequest r, TokenSink s)
        : id(id_in), request(std::move(r)), sink(std::move(s)), sampler(request.sampling) {}
    uint64_t id;
    GenerationRequest request;
    TokenSink sink;
    Sampler sampler;
    int slot = -1;  // set on admission
    int64_t prefilled = 0;
    std::vector<int32_t> generated;
    bool aborted = false;
  };
  // Both take mu_ themselves, and call sinks.
  void Retire(size_t index, const absl::Status& status, FinishReason reason)
      ABSL_LOCKS_EXCLUDED(mu_);
  void AdmitQueued() ABSL_LOCKS_EXCLUDED(mu_);
  // FinishStep's body: `sample(j, &row)` is row j's token (row: its logits, or null).
  void FinishStepWith(const std::function<int32_t(size_t j, Live& l, const float** row)>& sample)
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
  std::vector<int64_t> step_prefill_;  // per step row: prompt tokens BuildStep took
};

// The step's tokens sampled on `backend` from its logits [rows, vocab] (for a step where
// !scheduler.StepNeedsHostLogits()), for FinishStepWithTokens: ArgmaxRows when every row is
// greedy (no parameters to upload), else SampleRows with StepSamplingRows. Only the ids
// cross to the host. The single-process engine and the attention worker's step loop both
// finish their steps with it.
absl::StatusOr<std::vector<int32_t>> SampleStepOnBackend(Backend* backend, const Tensor& logits,
                                                         const Scheduler& scheduler);

}  // namespace dxs
