#include "router/frontend/generate_validation.h"

#include <cmath>

#include "absl/strings/str_cat.h"

namespace dxs {

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
  if (params.max_new_tokens() <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("sampling_params.max_new_tokens: must be > 0, got ", params.max_new_tokens()));
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
  if (request.has_data_parallel_rank() &&
      static_cast<int64_t>(request.data_parallel_rank()) >= limits.num_attention_ranks) {
    return absl::InvalidArgumentError(absl::StrCat(
        "data_parallel_rank: ", request.data_parallel_rank(),
        " is not in the cluster (attention ranks 0..", limits.num_attention_ranks - 1, ")"));
  }
  return absl::OkStatus();
}

}  // namespace dxs
