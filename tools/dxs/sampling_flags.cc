#include "tools/dxs/sampling_flags.h"

#include <set>
#include <utility>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"

namespace dxs::cli {
namespace {

// A flag's value as a count or position: an integer >= 0 and <= INT32_MAX.
absl::StatusOr<int64_t> NonNegative(const Args& args, const std::string& name, int64_t fallback) {
  absl::StatusOr<int64_t> v = args.GetInt(name, fallback);
  if (!v.ok()) return v.status();
  if (*v < 0 || *v > INT32_MAX) {
    return absl::InvalidArgumentError(absl::StrCat("--", name, " must be >= 0, got ", *v));
  }
  return v;
}

// "ID:BIAS,...": ids >= 0, each once; the bias any number (its range is the engine's).
absl::StatusOr<std::vector<std::pair<int32_t, float>>> ParseLogitBias(const std::string& text) {
  std::vector<std::pair<int32_t, float>> out;
  std::set<int32_t> seen;
  for (absl::string_view entry : absl::StrSplit(text, ',')) {
    std::vector<absl::string_view> parts = absl::StrSplit(entry, ':');
    int32_t id = -1;
    double bias = 0;
    if (parts.size() != 2 || !absl::SimpleAtoi(parts[0], &id) || id < 0 ||
        !absl::SimpleAtod(parts[1], &bias)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--logit-bias: '", entry, "' is not ID:BIAS (a token id >= 0 and a number)"));
    }
    if (!seen.insert(id).second) {
      return absl::InvalidArgumentError(
          absl::StrCat("--logit-bias: token id ", id, " is given more than once"));
    }
    out.push_back({id, static_cast<float>(bias)});
  }
  return out;
}

nlohmann::json TopJson(const TokenLogprobs& lp) {
  nlohmann::json top = nlohmann::json::array();
  for (const auto& [id, logprob] : lp.top) top.push_back({id, logprob});
  return top;
}

// The lists AddLogprobsJson writes for output tokens and for prompt positions alike.
void AddLists(const GenerationRequest& req, const std::vector<TokenLogprobs>& positions,
              nlohmann::json* out) {
  nlohmann::json logprobs = nlohmann::json::array(), top = nlohmann::json::array(),
                 named = nlohmann::json::array();
  for (const TokenLogprobs& lp : positions) {
    logprobs.push_back(lp.logprob);
    top.push_back(TopJson(lp));
    named.push_back(lp.named);
  }
  (*out)["logprobs"] = logprobs;
  if (req.top_logprobs > 0) (*out)["top_logprobs"] = top;
  if (!req.logprob_token_ids.empty()) (*out)["token_ids_logprobs"] = named;
}

}  // namespace

std::set<std::string> SamplingValueFlags(std::set<std::string> others) {
  others.insert({"min-p", "frequency-penalty", "presence-penalty", "repetition-penalty",
                 "logit-bias", "min-new-tokens", "top-logprobs", "logprob-token-ids",
                 "prompt-logprobs", "n"});
  return others;
}

std::set<std::string> SamplingBoolFlags(std::set<std::string> others) {
  others.insert("logprobs");
  return others;
}

const char kSamplingUsage[] =
    "  [--min-p P] [--frequency-penalty F] [--presence-penalty F] [--repetition-penalty R]\n"
    "  [--logit-bias ID:BIAS,... (BIAS in [-100, 100])] [--min-new-tokens N (no EOS or\n"
    "  stop id before N tokens)]\n"
    "  Log-probabilities (of the raw logits; with --format json): [--logprobs]\n"
    "  [--top-logprobs N (0..20 alternatives per token)] [--logprob-token-ids ID,...]\n"
    "  [--prompt-logprobs START (score the prompt from position START; with\n"
    "  --max-new-tokens 0, only that)]\n"
    "  [--n N (1..64 samples of the prompt, prefilled once; sample i draws from a seed made\n"
    "  from --seed and i, sample 0 from --seed itself; JSON: a \"samples\" list)]\n";

absl::Status ReadSamplingFlags(const Args& args, const std::string& format,
                               GenerationRequest* req) {
  SamplingParams& s = req->sampling;
  for (auto [flag, field] : {std::pair<const char*, float*>{"min-p", &s.min_p},
                             {"frequency-penalty", &s.frequency_penalty},
                             {"presence-penalty", &s.presence_penalty},
                             {"repetition-penalty", &s.repetition_penalty}}) {
    absl::StatusOr<double> v = args.GetDouble(flag, *field);
    if (!v.ok()) return v.status();
    *field = static_cast<float>(*v);
  }
  if (args.Has("logit-bias")) {
    auto bias = ParseLogitBias(args.GetString("logit-bias"));
    if (!bias.ok()) return bias.status();
    s.logit_bias = std::move(*bias);
  }
  auto min_new = NonNegative(args, "min-new-tokens", 0);
  auto top = NonNegative(args, "top-logprobs", 0);
  auto start = NonNegative(args, "prompt-logprobs", 0);
  auto ids = args.GetIntList("logprob-token-ids");
  auto n = args.GetInt("n", 1);
  for (const absl::Status& st :
       {min_new.status(), top.status(), start.status(), ids.status(), n.status()}) {
    if (!st.ok()) return st;
  }
  // The upper bound (kMaxSamples) is the engine's or the router's to check.
  if (*n < 1) return absl::InvalidArgumentError(absl::StrCat("--n must be >= 1, got ", *n));
  if (*n > INT32_MAX) {
    return absl::InvalidArgumentError(
        absl::StrCat("--n: ", *n, " samples is too many (at most ", kMaxSamples, ")"));
  }
  req->n = static_cast<int32_t>(*n);
  for (int32_t id : *ids) {
    if (id < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("--logprob-token-ids: token ids are >= 0, got ", id));
    }
  }
  req->min_new_tokens = *min_new;
  req->logprobs = args.Has("logprobs");
  req->top_logprobs = static_cast<int32_t>(*top);
  req->logprob_token_ids = *ids;
  if (args.Has("prompt-logprobs")) req->prompt_logprobs_start = *start;
  if ((req->WantsLogprobs() || req->prompt_logprobs_start >= 0) && format != "json") {
    return absl::InvalidArgumentError(
        "--logprobs, --top-logprobs, --logprob-token-ids and --prompt-logprobs print with "
        "--format json");
  }
  return absl::OkStatus();
}

void AddLogprobsJson(const GenerationRequest& req, const std::vector<TokenLogprobs>& logprobs,
                     const std::optional<PromptLogprobs>& prompt_logprobs, nlohmann::json* out) {
  if (req.WantsLogprobs()) AddLists(req, logprobs, out);
  if (!prompt_logprobs.has_value()) return;
  const PromptLogprobs& p = *prompt_logprobs;
  nlohmann::json prompt;
  prompt["first_position"] = p.first_position;
  std::vector<int32_t> ids;
  for (const TokenLogprobs& position : p.positions) ids.push_back(position.token);
  prompt["token_ids"] = ids;
  AddLists(req, p.positions, &prompt);
  nlohmann::json next = nlohmann::json::object();
  if (req.top_logprobs > 0) next["top_logprobs"] = TopJson(p.next);
  if (!req.logprob_token_ids.empty()) next["token_ids_logprobs"] = p.next.named;
  prompt["next"] = next;
  (*out)["prompt_logprobs"] = prompt;
}

nlohmann::json SampleJson(const GenerationRequest& req, const std::vector<int32_t>& tokens,
                          const std::string& finish_reason,
                          const std::vector<TokenLogprobs>& logprobs) {
  nlohmann::json out;
  out["tokens"] = tokens;
  out["finish_reason"] = finish_reason;
  AddLogprobsJson(req, logprobs, std::nullopt, &out);
  return out;
}

}  // namespace dxs::cli
