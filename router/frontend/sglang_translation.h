// The gateway protocol (sglang.grpc.scheduler, as the SMG gateway speaks it) in terms of
// dxs.v1: a GenerateRequest becomes a dxs.v1 request that goes through the router's one
// request path (FrontendService::ServeGenerate: one validation, one relay), and the dxs.v1
// messages that come back become the protocol's chunks and completes.
//
// What the request may not carry, because dxs cannot honour it, is refused with
// INVALID_ARGUMENT naming the field (multimodal inputs, input_embeds, hidden states, LoRA,
// a custom logit processor, prefill/decode bootstrap fields, stop strings) or UNIMPLEMENTED
// (constrained generation: regex, json_schema, ebnf_grammar, structural_tag). Nothing is
// dropped silently.
//
// Field mapping and proto3 defaults (the protocol cannot tell an unset number from 0):
//   temperature            as is (0: greedy)
//   top_p                  0 = unset (1.0); SMG always sends it
//   top_k                  -1 or 0 = no cut; other negatives refused
//   repetition_penalty     0 = unset (1.0); SMG sends 1.0
//   max_new_tokens         unset: the rest of the context (context length - prompt length)
//   n                      0 = 1
//   stream_interval        unset or 0: each worker chunk as it comes; N: N tokens a chunk
//   stop                   refused: SMG matches stop strings in text itself and sends the
//                          single-token ones as stop_token_ids (docs/gateway.md)
//   logit_bias             map<string, float>: the key is a token id in decimal
//   custom_params          only {"seed": number}: the protocol has no seed field
//   return_logprob         the sampled tokens' logprobs; with top_logprobs_num, the top N
//   token_ids_logprob      the named ids' logprobs at every output position
//   logprob_start_len      -1: no prompt scores; >= 0 (with return_logprob): scores from it
//   skip_special_tokens, spaces_between_special_tokens, no_stop_trim: detokenizer options,
//                          which only matter where text is made: in the gateway
//   require_reasoning      reasoning_tokens counted (SglangModelFacts)
//   timestamp, log_metrics, original_text: informational
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "dxs/v1/frontend.pb.h"
#include "router/frontend/frontend_service.h"
#include "sglang_scheduler.pb.h"

namespace dxs {

namespace sglang = ::sglang::grpc::scheduler;

// What the translation needs to know of the served model.
struct SglangModelFacts {
  int64_t max_context_length = 0;
  // The ids of "<think>" and "</think>" in the model's tokenizer, if it has them: with
  // require_reasoning, an output that thinks (its prompt ends with <think>, or it starts
  // with it) counts its tokens up to and including </think> as reasoning_tokens.
  std::optional<uint32_t> think_start_token_id;
  std::optional<uint32_t> think_end_token_id;
};

// The dxs.v1 request, or the refusal naming the protocol's field.
absl::StatusOr<v1::GenerateRequest> ToDxsGenerateRequest(const sglang::GenerateRequest& request,
                                                         const SglangModelFacts& model);

// A status from the dxs.v1 path with its field named as the protocol names it
// ("prompt_token_ids" -> "tokenized.input_ids", "sampling_params.top_logprobs" ->
// "top_logprobs_num", ...). Other statuses are returned as they are.
absl::Status ToSglangStatus(const absl::Status& status);

// Turns one request's dxs.v1 messages into the protocol's. Streaming (request.stream):
// incremental chunks (token ids and logprobs; cumulative counts) as they come, grouped by
// stream_interval, then one GenerateComplete per sample index. Not streaming: one
// GenerateComplete per sample index with every output id and cumulative logprobs. Either
// way the completes come in sample index order once every sample has ended.
class SglangResponseTranslator final : public GenerateResponseWriter {
 public:
  // `sink` writes one protocol message; false once the caller has gone away.
  using Sink = std::function<bool(const sglang::GenerateResponse&, bool last)>;
  SglangResponseTranslator(const sglang::GenerateRequest& request, int num_samples,
                           const SglangModelFacts& model, Sink sink);

  bool Write(v1::GenerateResponse& message) override;
  void WriteLast(v1::GenerateResponse& message) override;

 private:
  struct Sample {
    std::vector<uint32_t> output_ids;
    sglang::OutputLogProbs logprobs;  // cumulative
    // Not yet sent (streaming with a stream interval).
    std::vector<uint32_t> pending_ids;
    sglang::OutputLogProbs pending_logprobs;
    bool sent_any = false;
  };

  bool Flush(uint32_t index, Sample& sample);
  // The chunk's logprobs in the protocol's shape.
  sglang::OutputLogProbs ChunkLogprobs(const v1::TokenChunk& chunk) const;
  uint32_t ReasoningTokens(const Sample& sample) const;

  const std::string request_id_;
  const bool stream_;
  const int stream_interval_;
  const bool return_logprob_;
  const std::vector<uint32_t> logprob_token_ids_;
  const uint32_t prompt_tokens_;
  // require_reasoning and the prompt ends with <think>.
  const bool count_reasoning_;
  const bool prompt_opens_thinking_;
  // With logprob_start_len 0: the prompt's first token, which the protocol lists (without a
  // value: nothing precedes it) ahead of the positions dxs scores (from 1).
  const std::optional<uint32_t> unscored_prompt_token_;
  const SglangModelFacts model_;
  const Sink sink_;
  std::vector<Sample> samples_;
  std::optional<sglang::InputLogProbs> input_logprobs_;
  bool input_logprobs_sent_ = false;
  bool caller_gone_ = false;
};

}  // namespace dxs
