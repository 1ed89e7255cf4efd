#include "router/frontend/sglang_translation.h"

#include <algorithm>
#include <array>
#include <charconv>
#include <cmath>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"

namespace dxs {
namespace {

absl::Status Refused(const std::string& field, const std::string& why) {
  return absl::InvalidArgumentError(absl::StrCat(field, ": ", why));
}

// The field paths of dxs.v1 that the protocol spells differently, longest first so that a
// prefix does not shadow a longer name.
constexpr std::array<std::pair<const char*, const char*>, 6> kFieldNames = {{
    {"sampling_params.prompt_logprobs_start", "logprob_start_len"},
    {"sampling_params.logprob_token_ids", "token_ids_logprob"},
    {"sampling_params.top_logprobs", "top_logprobs_num"},
    {"sampling_params.logprobs", "return_logprob"},
    {"sampling_params.seed", "sampling_params.custom_params.seed"},
    {"prompt_token_ids", "tokenized.input_ids"},
}};

const char* FinishReasonString(v1::FinishReason reason) {
  switch (reason) {
    case v1::FINISH_REASON_STOP_EOS:
    case v1::FINISH_REASON_STOP_TOKEN:
      return "stop";
    case v1::FINISH_REASON_LENGTH:
    case v1::FINISH_REASON_CONTEXT_LENGTH:
      return "length";
    case v1::FINISH_REASON_ABORTED:
      return "abort";
    default:
      return "abort";
  }
}

void AppendLogprobs(const sglang::OutputLogProbs& from, sglang::OutputLogProbs& to) {
  to.mutable_token_logprobs()->MergeFrom(from.token_logprobs());
  to.mutable_token_ids()->MergeFrom(from.token_ids());
  to.mutable_top_logprobs()->MergeFrom(from.top_logprobs());
  to.mutable_token_ids_logprobs()->MergeFrom(from.token_ids_logprobs());
}

sglang::TopLogProbs TopOf(const v1::TokenLogprobs& position) {
  sglang::TopLogProbs top;
  for (const v1::TopLogprob& t : position.top_logprobs()) {
    top.add_values(t.logprob());
    top.add_token_ids(t.token_id());
  }
  return top;
}

}  // namespace

absl::StatusOr<v1::GenerateRequest> ToDxsGenerateRequest(const sglang::GenerateRequest& request,
                                                         const SglangModelFacts& model) {
  // What dxs cannot honour, refused by name.
  if (request.has_mm_inputs()) {
    return Refused("mm_inputs", "multimodal inputs are not supported: dxs serves text models");
  }
  if (request.input_embeds_size() > 0) {
    return Refused("input_embeds", "input embeddings are not supported: send token ids");
  }
  if (request.return_hidden_states()) {
    return Refused("return_hidden_states", "hidden states are not returned by dxs");
  }
  if (!request.lora_id().empty()) {
    return Refused("lora_id", "LoRA adapters are not supported");
  }
  if (!request.custom_logit_processor().empty()) {
    return Refused("custom_logit_processor", "custom logit processors are not supported");
  }
  if (request.has_disaggregated_params()) {
    const sglang::DisaggregatedParams& d = request.disaggregated_params();
    if (!d.bootstrap_host().empty() || d.bootstrap_port() != 0 || d.bootstrap_room() != 0) {
      return Refused("disaggregated_params",
                     "prefill/decode disaggregation bootstrap is not supported: a dxs cluster "
                     "prefills and decodes each request itself");
    }
  }
  const sglang::SamplingParams& in = request.sampling_params();
  switch (in.constraint_case()) {
    case sglang::SamplingParams::kRegex:
      return absl::UnimplementedError(
          "sampling_params.regex: constrained generation is not "
          "supported");
    case sglang::SamplingParams::kJsonSchema:
      return absl::UnimplementedError(
          "sampling_params.json_schema: constrained generation is "
          "not supported");
    case sglang::SamplingParams::kEbnfGrammar:
      return absl::UnimplementedError(
          "sampling_params.ebnf_grammar: constrained generation is "
          "not supported");
    case sglang::SamplingParams::kStructuralTag:
      return absl::UnimplementedError(
          "sampling_params.structural_tag: constrained generation "
          "is not supported");
    case sglang::SamplingParams::CONSTRAINT_NOT_SET:
      break;
  }
  if (in.stop_size() > 0) {
    return Refused("sampling_params.stop",
                   "stop strings are matched in text by the gateway (SMG sends single-token "
                   "stops as stop_token_ids and matches the others itself); dxs takes "
                   "stop_token_ids");
  }

  v1::GenerateRequest out;
  out.set_request_id(request.request_id());
  if (request.has_tokenized()) {
    out.mutable_prompt_token_ids()->Assign(request.tokenized().input_ids().begin(),
                                           request.tokenized().input_ids().end());
  }
  if (request.has_data_parallel_rank()) {
    if (request.data_parallel_rank() < 0) {
      return Refused("data_parallel_rank",
                     absl::StrCat("must be >= 0, got ", request.data_parallel_rank()));
    }
    out.set_data_parallel_rank(static_cast<uint32_t>(request.data_parallel_rank()));
  }

  v1::SamplingParams& p = *out.mutable_sampling_params();
  if (in.has_max_new_tokens()) {
    if (in.max_new_tokens() > static_cast<uint32_t>(INT32_MAX)) {
      return Refused("sampling_params.max_new_tokens",
                     absl::StrCat(in.max_new_tokens(), " is beyond the context length ",
                                  model.max_context_length));
    }
    p.set_max_new_tokens(static_cast<int32_t>(in.max_new_tokens()));
  } else {
    // vLLM's default for an unset max_tokens: whatever the context has room for.
    const int64_t room = model.max_context_length - out.prompt_token_ids_size();
    if (room <= 0 && out.prompt_token_ids_size() > 0) {
      return Refused(
          "tokenized.input_ids",
          absl::StrCat("the prompt of ", out.prompt_token_ids_size(),
                       " tokens leaves no room in the context length ", model.max_context_length));
    }
    p.set_max_new_tokens(static_cast<int32_t>(std::max<int64_t>(room, 1)));
  }
  p.set_temperature(in.temperature());
  if (in.top_p() != 0) p.set_top_p(in.top_p());
  if (in.top_k() < -1) {
    return Refused("sampling_params.top_k",
                   absl::StrCat("must be -1 (no cut) or >= 0, got ", in.top_k()));
  }
  p.set_top_k(std::max(in.top_k(), 0));
  if (in.min_p() != 0) p.set_min_p(in.min_p());
  p.set_frequency_penalty(in.frequency_penalty());
  p.set_presence_penalty(in.presence_penalty());
  if (in.repetition_penalty() != 0) p.set_repetition_penalty(in.repetition_penalty());
  p.mutable_stop_token_ids()->Assign(in.stop_token_ids().begin(), in.stop_token_ids().end());
  p.set_ignore_eos(in.ignore_eos());
  p.set_min_new_tokens(in.min_new_tokens());
  p.set_n(in.n());
  if (in.has_stream_interval() && in.stream_interval() < 0) {
    return Refused("sampling_params.stream_interval",
                   absl::StrCat("must be >= 0, got ", in.stream_interval()));
  }
  for (const auto& [key, bias] : in.logit_bias()) {
    uint32_t id = 0;
    const char* end = key.data() + key.size();
    auto [ptr, ec] = std::from_chars(key.data(), end, id);
    if (key.empty() || ec != std::errc() || ptr != end) {
      return Refused(absl::StrCat("sampling_params.logit_bias[\"", key, "\"]"),
                     "the key must be a token id in decimal");
    }
    (*p.mutable_logit_bias())[id] = bias;
  }
  if (in.has_custom_params()) {
    for (const auto& [key, value] : in.custom_params().fields()) {
      if (key != "seed") {
        return Refused(absl::StrCat("sampling_params.custom_params.", key),
                       "not supported (the only custom parameter is seed)");
      }
      const double seed = value.number_value();
      if (value.kind_case() != google::protobuf::Value::kNumberValue || !std::isfinite(seed) ||
          seed < 0 || seed != std::floor(seed) || seed > 9007199254740992.0) {
        return Refused("sampling_params.custom_params.seed", "must be a whole number in [0, 2^53]");
      }
      p.set_seed(static_cast<uint64_t>(seed));
    }
  }

  if (request.top_logprobs_num() < 0) {
    return Refused("top_logprobs_num",
                   absl::StrCat("must be >= 0, got ", request.top_logprobs_num()));
  }
  if (request.logprob_start_len() < -1) {
    return Refused("logprob_start_len", absl::StrCat("must be -1 (none) or a prompt position, "
                                                     "got ",
                                                     request.logprob_start_len()));
  }
  if (request.return_logprob()) {
    p.set_logprobs(true);
    p.set_top_logprobs(static_cast<uint32_t>(request.top_logprobs_num()));
    if (request.logprob_start_len() >= 0) {
      p.set_prompt_logprobs_start(static_cast<uint32_t>(request.logprob_start_len()));
    }
  } else if (request.top_logprobs_num() > 0) {
    return Refused("top_logprobs_num", "needs return_logprob");
  }
  p.mutable_logprob_token_ids()->Assign(request.token_ids_logprob().begin(),
                                        request.token_ids_logprob().end());
  return out;
}

absl::Status ToSglangStatus(const absl::Status& status) {
  if (status.code() != absl::StatusCode::kInvalidArgument) return status;
  for (const auto& [dxs_name, sglang_name] : kFieldNames) {
    if (absl::StartsWith(status.message(), dxs_name)) {
      return absl::InvalidArgumentError(
          absl::StrCat(sglang_name, status.message().substr(std::string_view(dxs_name).size())));
    }
  }
  return status;
}

SglangResponseTranslator::SglangResponseTranslator(const sglang::GenerateRequest& request,
                                                   int num_samples, const SglangModelFacts& model,
                                                   Sink sink)
    : request_id_(request.request_id()),
      stream_(request.stream()),
      stream_interval_(request.sampling_params().has_stream_interval()
                           ? std::max(request.sampling_params().stream_interval(), 0)
                           : 0),
      return_logprob_(request.return_logprob()),
      logprob_token_ids_(request.token_ids_logprob().begin(), request.token_ids_logprob().end()),
      prompt_tokens_(static_cast<uint32_t>(request.tokenized().input_ids_size())),
      count_reasoning_(request.require_reasoning() && model.think_end_token_id.has_value()),
      prompt_opens_thinking_(
          model.think_start_token_id.has_value() && request.tokenized().input_ids_size() > 0 &&
          *request.tokenized().input_ids().rbegin() == *model.think_start_token_id),
      unscored_prompt_token_(request.logprob_start_len() == 0 &&
                                     request.tokenized().input_ids_size() > 0
                                 ? std::optional<uint32_t>(request.tokenized().input_ids(0))
                                 : std::nullopt),
      model_(model),
      sink_(std::move(sink)),
      samples_(static_cast<size_t>(std::max(num_samples, 1))) {}

sglang::OutputLogProbs SglangResponseTranslator::ChunkLogprobs(const v1::TokenChunk& chunk) const {
  sglang::OutputLogProbs to;
  for (int i = 0; i < chunk.logprobs_size(); ++i) {
    const v1::TokenLogprobs& position = chunk.logprobs(i);
    if (return_logprob_) {
      to.add_token_logprobs(position.logprob());
      to.add_token_ids(i < chunk.token_ids_size() ? chunk.token_ids(i) : 0);
      *to.add_top_logprobs() = TopOf(position);
    }
    if (!logprob_token_ids_.empty()) {
      sglang::TopLogProbs* named = to.add_token_ids_logprobs();
      for (size_t k = 0; k < logprob_token_ids_.size(); ++k) {
        named->add_token_ids(logprob_token_ids_[k]);
        named->add_values(static_cast<int>(k) < position.token_ids_logprobs_size()
                              ? position.token_ids_logprobs(static_cast<int>(k))
                              : 0.0f);
      }
    }
  }
  return to;
}

uint32_t SglangResponseTranslator::ReasoningTokens(const Sample& sample) const {
  if (!count_reasoning_ || sample.output_ids.empty()) return 0;
  const bool thinks =
      prompt_opens_thinking_ ||
      (model_.think_start_token_id && sample.output_ids[0] == *model_.think_start_token_id);
  if (!thinks) return 0;
  const auto end =
      std::find(sample.output_ids.begin(), sample.output_ids.end(), *model_.think_end_token_id);
  // Still thinking: everything so far is reasoning.
  if (end == sample.output_ids.end()) return static_cast<uint32_t>(sample.output_ids.size());
  return static_cast<uint32_t>(end - sample.output_ids.begin() + 1);
}

bool SglangResponseTranslator::Flush(uint32_t index, Sample& sample) {
  if (sample.pending_ids.empty() && !(input_logprobs_ && !input_logprobs_sent_)) return true;
  sglang::GenerateResponse message;
  message.set_request_id(request_id_);
  sglang::GenerateStreamChunk* chunk = message.mutable_chunk();
  chunk->mutable_token_ids()->Assign(sample.pending_ids.begin(), sample.pending_ids.end());
  chunk->set_prompt_tokens(prompt_tokens_);
  chunk->set_completion_tokens(static_cast<uint32_t>(sample.output_ids.size()));
  chunk->set_reasoning_tokens(ReasoningTokens(sample));
  chunk->set_index(index);
  if (sample.pending_logprobs.ByteSizeLong() > 0) {
    *chunk->mutable_output_logprobs() = std::move(sample.pending_logprobs);
  }
  if (input_logprobs_ && !input_logprobs_sent_) {
    *chunk->mutable_input_logprobs() = *input_logprobs_;
    input_logprobs_sent_ = true;
  }
  sample.pending_ids.clear();
  sample.pending_logprobs.Clear();
  sample.sent_any = true;
  if (!sink_(message, /*last=*/false)) caller_gone_ = true;
  return !caller_gone_;
}

bool SglangResponseTranslator::Write(v1::GenerateResponse& message) {
  if (caller_gone_) return false;
  if (message.has_complete()) {
    WriteLast(message);
    return !caller_gone_;
  }
  if (!message.has_chunk()) return true;
  const v1::TokenChunk& chunk = message.chunk();
  if (chunk.has_prompt_logprobs() && !input_logprobs_) {
    // The protocol scores prompt tokens from logprob_start_len, one token id per entry; the
    // first token (which nothing precedes) with no value. dxs scores from position 1.
    const v1::PromptLogprobs& prompt = chunk.prompt_logprobs();
    sglang::InputLogProbs input;
    if (unscored_prompt_token_) {
      input.add_token_logprobs();  // no value
      input.add_top_logprobs();
      input.add_token_ids(*unscored_prompt_token_);
    }
    for (int i = 0; i < prompt.positions_size(); ++i) {
      input.add_token_logprobs()->set_value(prompt.positions(i).logprob());
      *input.add_top_logprobs() = TopOf(prompt.positions(i));
    }
    input.mutable_token_ids()->Add(prompt.token_ids().begin(), prompt.token_ids().end());
    input_logprobs_ = std::move(input);
    // The distribution after the prompt (prompt.next) is the first output position's,
    // which the first token's own logprobs carry.
  }
  const uint32_t index = chunk.sample_index();
  if (index >= samples_.size()) return true;
  Sample& sample = samples_[index];
  sample.output_ids.insert(sample.output_ids.end(), chunk.token_ids().begin(),
                           chunk.token_ids().end());
  const sglang::OutputLogProbs fresh = ChunkLogprobs(chunk);
  AppendLogprobs(fresh, sample.logprobs);
  if (!stream_) return true;
  AppendLogprobs(fresh, sample.pending_logprobs);
  sample.pending_ids.insert(sample.pending_ids.end(), chunk.token_ids().begin(),
                            chunk.token_ids().end());
  // The first tokens go out at once (time to first token); then stream_interval at a time.
  const bool due = !sample.sent_any || stream_interval_ <= 1 ||
                   static_cast<int>(sample.pending_ids.size()) >= stream_interval_;
  if (due) return Flush(index, sample);
  return true;
}

void SglangResponseTranslator::WriteLast(v1::GenerateResponse& message) {
  if (!message.has_complete()) {
    Write(message);
    return;
  }
  const v1::GenerateComplete& done = message.complete();
  // One complete per sample, in index order: sample 0's numbers are the message's own.
  struct Ending {
    v1::FinishReason reason;
    std::optional<uint32_t> matched;
  };
  std::vector<Ending> endings(samples_.size(), Ending{v1::FINISH_REASON_ABORTED, std::nullopt});
  endings[0] = {done.finish_reason(), done.has_matched_stop_token_id()
                                          ? std::optional<uint32_t>(done.matched_stop_token_id())
                                          : std::nullopt};
  for (const v1::SampleComplete& s : done.samples()) {
    if (s.sample_index() >= endings.size()) continue;
    endings[s.sample_index()] = {s.finish_reason(),
                                 s.has_matched_stop_token_id()
                                     ? std::optional<uint32_t>(s.matched_stop_token_id())
                                     : std::nullopt};
  }
  for (size_t i = 0; i < samples_.size(); ++i) {
    Sample& sample = samples_[i];
    if (stream_ && !Flush(static_cast<uint32_t>(i), sample)) return;
    sglang::GenerateResponse out;
    out.set_request_id(request_id_);
    sglang::GenerateComplete* complete = out.mutable_complete();
    complete->mutable_output_ids()->Assign(sample.output_ids.begin(), sample.output_ids.end());
    complete->set_finish_reason(FinishReasonString(endings[i].reason));
    complete->set_prompt_tokens(done.prompt_tokens() > 0 ? done.prompt_tokens() : prompt_tokens_);
    complete->set_completion_tokens(static_cast<uint32_t>(sample.output_ids.size()));
    complete->set_reasoning_tokens(ReasoningTokens(sample));
    if (endings[i].matched) complete->set_matched_token_id(*endings[i].matched);
    if (sample.logprobs.ByteSizeLong() > 0) *complete->mutable_output_logprobs() = sample.logprobs;
    if (input_logprobs_) *complete->mutable_input_logprobs() = *input_logprobs_;
    complete->set_index(static_cast<uint32_t>(i));
    if (!sink_(out, /*last=*/i + 1 == samples_.size())) {
      caller_gone_ = true;
      return;
    }
  }
}

}  // namespace dxs
