// Checks a Frontend.GenerateRequest against the served model and the cluster shape before
// anything is admitted, so a bad request never reaches a worker or disturbs one in flight.
// Each refusal is INVALID_ARGUMENT whose message starts with the offending field's proto
// path ("prompt_token_ids[3]: ...", "sampling_params.top_p: ...").
#pragma once

#include <cstdint>

#include "absl/status/status.h"
#include "dxs/v1/frontend.pb.h"

namespace dxs {

// What a request is checked against.
struct GenerateLimits {
  // Valid token ids are 0 .. vocab_size - 1.
  int64_t vocab_size = 0;
  // Most tokens (prompt + completion) one request may hold: max_position_embeddings.
  int64_t max_context_length = 0;
  // Configured DP ranks; data_parallel_rank must be below this.
  int num_attention_ranks = 0;
  // Longest request_id accepted, in bytes. Ids are kept in memory and in logs.
  size_t max_request_id_bytes = 256;
  // Most top_logprobs and logprob_token_ids a request may ask for: the engine's
  // kMaxTopLogprobs (kernels/sampling.h) and kMaxLogprobTokenIds (model/scheduler.h),
  // repeated here because the router does not link the engine (a test holds them equal).
  int64_t max_top_logprobs = 20;
  int64_t max_logprob_token_ids = 128;
  // Most samples (SamplingParams.n) a request may ask for: the engine's kMaxSamples
  // (model/scheduler.h), repeated here for the same reason.
  int64_t max_samples = 64;
};

// OK, or INVALID_ARGUMENT naming the first bad field: request_id too long, empty prompt,
// a token id outside the vocabulary (prompt, stop_token_ids, logit_bias,
// logprob_token_ids), max_new_tokens < 0 or 0 without prompt_logprobs_start, prompt +
// max_new_tokens over the context length, temperature negative or not finite, top_p (when
// set) outside (0, 1], top_k < 0, min_p outside [0, 1], frequency or presence penalty
// outside [-2, 2], repetition_penalty not finite and > 0, a logit_bias value outside
// [-100, 100], min_new_tokens > max_new_tokens, too many top_logprobs or
// logprob_token_ids, prompt_logprobs_start not a prompt position, n above max_samples (0
// means 1), data_parallel_rank not a configured rank. NaN fails every float check.
// Nothing is clamped.
absl::Status ValidateGenerateRequest(const v1::GenerateRequest& request,
                                     const GenerateLimits& limits);

}  // namespace dxs
