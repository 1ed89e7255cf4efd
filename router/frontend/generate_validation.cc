#include "router/frontend/generate_validation.h"

#include <algorithm>
#include <cmath>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"

namespace dxs {
namespace {

// "<field>[<i>]: token id <id> is outside the vocabulary [0, vocab)".
absl::Status CheckTokenId(const char* field, int i, uint32_t id, int64_t vocab) {
  if (static_cast<int64_t>(id) < vocab) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(field, "[", i, "]: token id ", id,
                                                 " is outside the vocabulary [0, ", vocab, ")"));
}

// The logit adjustments: min_p, the penalties, logit_bias and min_new_tokens. The ranges
// are OpenAI's (penalties, biases) and vLLM's (min_p, repetition_penalty); a NaN fails
// each comparison, so each test is written to pass only inside the domain.
absl::Status ValidateAdjustments(const v1::SamplingParams& params, int64_t vocab) {
  if (params.has_min_p() && !(params.min_p() >= 0.f && params.min_p() <= 1.f)) {
    return absl::InvalidArgumentError(
        absl::StrCat("sampling_params.min_p: must be in [0, 1], got ", params.min_p()));
  }
  if (!(params.frequency_penalty() >= -2.f && params.frequency_penalty() <= 2.f)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "sampling_params.frequency_penalty: must be in [-2, 2], got ", params.frequency_penalty()));
  }
  if (!(params.presence_penalty() >= -2.f && params.presence_penalty() <= 2.f)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "sampling_params.presence_penalty: must be in [-2, 2], got ", params.presence_penalty()));
  }
  if (params.has_repetition_penalty() &&
      !(std::isfinite(params.repetition_penalty()) && params.repetition_penalty() > 0.f)) {
    return absl::InvalidArgumentError(
        absl::StrCat("sampling_params.repetition_penalty: must be a finite number > 0, got ",
                     params.repetition_penalty()));
  }
  // Map order is unspecified: the lowest bad id is named, so the message is stable.
  std::vector<std::pair<uint32_t, float>> bias(params.logit_bias().begin(),
                                               params.logit_bias().end());
  std::sort(bias.begin(), bias.end());
  for (const auto& [id, value] : bias) {
    if (static_cast<int64_t>(id) >= vocab) {
      return absl::InvalidArgumentError(
          absl::StrCat("sampling_params.logit_bias[", id, "]: token id ", id,
                       " is outside the vocabulary [0, ", vocab, ")"));
    }
    if (!(value >= -100.f && value <= 100.f)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "sampling_params.logit_bias[", id, "]: the bias must be in [-100, 100], got ", value));
    }
  }
  if (static_cast<int64_t>(params.min_new_tokens()) > params.max_new_tokens()) {
    return absl::InvalidArgumentError(
        absl::StrCat("sampling_params.min_new_tokens: ", params.min_new_tokens(),
                     " is more than max_new_tokens (", params.max_new_tokens(), ")"));
  }
  return absl::OkStatus();
}

// What the request asks to score: top_logprobs, logprob_token_ids, prompt_logprobs_start.
absl::Status ValidateLogprobs(const v1::SamplingParams& params, int num_prompt_tokens,
                              const GenerateLimits& limits) {
  if (static_cast<int64_t>(params.top_logprobs()) > limits.max_top_logprobs) {
    return absl::InvalidArgumentError(absl::StrCat("sampling_params.top_logprobs: must be in [0, ",
                                                   limits.max_top_logprobs, "], got ",
                                                   params.top_logprobs()));
  }
  if (params.logprob_token_ids_size() > limits.max_logprob_token_ids) {
    return absl::InvalidArgumentError(absl::StrCat("sampling_params.logprob_token_ids: at most ",
                                                   limits.max_logprob_token_ids, " ids, got ",
                                                   params.logprob_token_ids_size()));
  }
  for (int i = 0; i < params.logprob_token_ids_size(); ++i) {
    if (absl::Status s = CheckTokenId("sampling_params.logprob_token_ids", i,
                                      params.logprob_token_ids(i), limits.vocab_size);
        !s.ok()) {
      return s;
    }
  }
  if (params.has_prompt_logprobs_start() &&
      static_cast<int64_t>(params.prompt_logprobs_start()) >= num_prompt_tokens) {
    return absl::InvalidArgumentError(
        absl::StrCat("sampling_params.prompt_logprobs_start: must be a prompt position, in [0, ",
                     num_prompt_tokens, "), got ", params.prompt_logprobs_start()));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status ValidateGenerateRequest(const v1::GenerateRequest& request,
                                     const GenerateLimits& limits) {
  if (request.request_id().size() > limits.max_request_id_bytes) {
    return absl::InvalidArgumentError(absl::StrCat("request_id: ", request.request_id().size(),
                                                   " bytes; at most ", limits.max_request_id_bytes,
                                                   " allowed"));
  }
  const int num_prompt_tokens = request.prompt_token_ids_size();
  if (num_prompt_tokens == 0) {
    return absl::InvalidArgumentError("prompt_token_ids: must not be empty");
  }
  for (int i = 0; i < num_prompt_tokens; ++i) {
    const uint32_t id = request.prompt_token_ids(i);
    if (static_cast<int64_t>(id) >= limits.vocab_size) {
      return absl::InvalidArgumentError(absl::StrCat("prompt_token_ids[", i, "]: token id ", id,
                                                     " is outside the vocabulary [0, ",
                                                     limits.vocab_size, ")"));
    }
  }
  const v1::SamplingParams& params = request.sampling_params();
  if (params.max_new_tokens() < 0 ||
      (params.max_new_tokens() == 0 && !params.has_prompt_logprobs_start())) {
    return absl::InvalidArgumentError(absl::StrCat(
        "sampling_params.max_new_tokens: must be > 0 (0 only with prompt_logprobs_start, to "
        "score the prompt), got ",
        params.max_new_tokens()));
  }
  const int64_t total = int64_t{num_prompt_tokens} + params.max_new_tokens();
  if (total > limits.max_context_length) {
    return absl::InvalidArgumentError(
        absl::StrCat("sampling_params.max_new_tokens: prompt_token_ids (", num_prompt_tokens,
                     ") + max_new_tokens (", params.max_new_tokens(), ") = ", total,
                     " exceeds the context length ", limits.max_context_length));
  }
  if (params.has_temperature() &&
      !(std::isfinite(params.temperature()) && params.temperature() >= 0.f)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "sampling_params.temperature: must be a finite number >= 0, got ", params.temperature()));
  }
  if (params.has_top_p() && !(params.top_p() > 0.f && params.top_p() <= 1.f)) {
    return absl::InvalidArgumentError(
        absl::StrCat("sampling_params.top_p: must be in (0, 1], got ", params.top_p()));
  }
  if (params.top_k() < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("sampling_params.top_k: must be >= 0, got ", params.top_k()));
  }
  if (absl::Status s = ValidateAdjustments(params, limits.vocab_size); !s.ok()) return s;
  if (absl::Status s = ValidateLogprobs(params, num_prompt_tokens, limits); !s.ok()) return s;
  if (static_cast<int64_t>(params.n()) > limits.max_samples) {
    return absl::InvalidArgumentError(absl::StrCat("sampling_params.n: must be in [1, ",
                                                   limits.max_samples, "] (0 means 1), got ",
                                                   params.n()));
  }
  for (int i = 0; i < params.stop_token_ids_size(); ++i) {
    if (absl::Status s = CheckTokenId("sampling_params.stop_token_ids", i, params.stop_token_ids(i),
                                      limits.vocab_size);
        !s.ok()) {
      return s;
    }
  }
  if (request.has_data_parallel_rank() &&
      static_cast<int64_t>(request.data_parallel_rank()) >= limits.num_attention_ranks) {
    return absl::InvalidArgumentError(absl::StrCat(
        "data_parallel_rank: ", request.data_parallel_rank(),
        " is not in the cluster (attention ranks 0..", limits.num_attention_ranks - 1, ")"));
  }
  return absl::OkStatus();
}

}  // namespace dxs
