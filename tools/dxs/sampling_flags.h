// The sampling-feature flags `dxs run` (the engine) and `dxs generate` (a router) share,
// and the JSON both print for log-probabilities, so the two give the same output for the
// same request.
#pragma once

#include <optional>
#include <set>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "model/scheduler.h"
#include "nlohmann/json.hpp"
#include "tools/dxs/cli_args.h"

namespace dxs::cli {

// Value flags: --min-p --frequency-penalty --presence-penalty --repetition-penalty
// --logit-bias ID:BIAS,... --min-new-tokens --top-logprobs --logprob-token-ids ID,...
// --prompt-logprobs START --n N. Bool flag: --logprobs.
std::set<std::string> SamplingValueFlags(std::set<std::string> others);
std::set<std::string> SamplingBoolFlags(std::set<std::string> others);

// The usage lines of those flags, for `dxs run` and `dxs generate`.
extern const char kSamplingUsage[];

// Reads the flags into `req` (the fields they name; the rest untouched). INVALID_ARGUMENT
// with the flag's name for a value that is not what the flag takes: not a number, a
// negative count or id, a malformed or repeated --logit-bias entry, or log-probabilities
// asked for without --format json (text output has no place for them), --n below 1.
// Ranges (min_p in [0, 1], n <= 64, ...) are the engine's or the router's to check, which
// name the field.
absl::Status ReadSamplingFlags(const Args& args, const std::string& format, GenerationRequest* req);

// Adds to `out` what `req` asked for: "logprobs" (one per output token), "top_logprobs"
// (per output token, a list of [id, logprob]), "token_ids_logprobs" (per output token, one
// per logprob_token_ids entry) and "prompt_logprobs" ({"first_position", "token_ids", and
// the same three lists for the scored prompt tokens, and "next": the distribution after
// the prompt}).
void AddLogprobsJson(const GenerationRequest& req, const std::vector<TokenLogprobs>& logprobs,
                     const std::optional<PromptLogprobs>& prompt_logprobs, nlohmann::json* out);

// One sample's entry of the "samples" list printed with --n > 1: "tokens", "finish_reason"
// and the per-token lists of AddLogprobsJson (the prompt's scores stay at the top level).
nlohmann::json SampleJson(const GenerationRequest& req, const std::vector<int32_t>& tokens,
                          const std::string& finish_reason,
                          const std::vector<TokenLogprobs>& logprobs);

}  // namespace dxs::cli
