// The gateway protocol (sglang.grpc.scheduler) in terms of dxs.v1: ToDxsGenerateRequest
// (every refusal names the protocol's field; every accepted field maps), ToSglangStatus
// (dxs.v1 field paths renamed, a real validation included), and SglangResponseTranslator
// (chunks, stream_interval, completes, n samples, logprobs, reasoning_tokens).
#include "router/frontend/sglang_translation.h"

#include <functional>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "google/protobuf/struct.pb.h"
#include "gtest/gtest.h"
#include "router/frontend/generate_validation.h"

namespace dxs {
namespace {

constexpr int64_t kContext = 64;

SglangModelFacts Facts() {
  SglangModelFacts facts;
  facts.max_context_length = kContext;
  return facts;
}

sglang::GenerateRequest Good() {
  sglang::GenerateRequest r;
  r.set_request_id("req-1");
  r.mutable_tokenized()->add_input_ids(5);
  r.mutable_tokenized()->add_input_ids(6);
  r.mutable_tokenized()->add_input_ids(7);
  r.mutable_sampling_params()->set_max_new_tokens(8);
  r.set_logprob_start_len(-1);  // what SMG sends
  return r;
}

bool StartsWith(absl::string_view message, absl::string_view prefix) {
  return message.substr(0, prefix.size()) == prefix;
}

void ExpectRefused(const std::function<void(sglang::GenerateRequest&)>& edit, absl::StatusCode code,
                   const std::string& field) {
  sglang::GenerateRequest r = Good();
  edit(r);
  absl::StatusOr<v1::GenerateRequest> out = ToDxsGenerateRequest(r, Facts());
  ASSERT_FALSE(out.ok()) << "accepted, expected a refusal naming " << field;
  EXPECT_EQ(out.status().code(), code) << out.status();
  EXPECT_TRUE(StartsWith(out.status().message(), field + ":") ||
              StartsWith(out.status().message(), field + "["))
      << "expected the message to start with " << field << ": " << out.status();
}

// ---- ToDxsGenerateRequest: refusals ----

TEST(ToDxsGenerateRequest, RefusesWhatDxsCannotHonourByName) {
  constexpr auto kInvalid = absl::StatusCode::kInvalidArgument;
  ExpectRefused([](auto& r) { r.mutable_mm_inputs()->add_image_urls("http://x/a.png"); }, kInvalid,
                "mm_inputs");
  // An empty but present mm_inputs is refused too (the field is a message: presence counts).
  ExpectRefused([](auto& r) { r.mutable_mm_inputs(); }, kInvalid, "mm_inputs");
  ExpectRefused([](auto& r) { r.add_input_embeds(0.5f); }, kInvalid, "input_embeds");
  ExpectRefused([](auto& r) { r.set_return_hidden_states(true); }, kInvalid,
                "return_hidden_states");
  ExpectRefused([](auto& r) { r.set_lora_id("adapter-1"); }, kInvalid, "lora_id");
  ExpectRefused([](auto& r) { r.set_custom_logit_processor("pickled"); }, kInvalid,
                "custom_logit_processor");
  ExpectRefused([](auto& r) { r.mutable_disaggregated_params()->set_bootstrap_host("10.0.0.1"); },
                kInvalid, "disaggregated_params");
  ExpectRefused([](auto& r) { r.mutable_disaggregated_params()->set_bootstrap_port(8998); },
                kInvalid, "disaggregated_params");
  ExpectRefused([](auto& r) { r.mutable_disaggregated_params()->set_bootstrap_room(3); }, kInvalid,
                "disaggregated_params");
}

TEST(ToDxsGenerateRequest, EmptyDisaggregatedParamsAreAccepted) {
  sglang::GenerateRequest r = Good();
  r.mutable_disaggregated_params();
  EXPECT_TRUE(ToDxsGenerateRequest(r, Facts()).ok());
}

TEST(ToDxsGenerateRequest, ConstraintsAreUnimplementedNamingTheField) {
  constexpr auto kUnimplemented = absl::StatusCode::kUnimplemented;
  ExpectRefused([](auto& r) { r.mutable_sampling_params()->set_regex("a+"); }, kUnimplemented,
                "sampling_params.regex");
  ExpectRefused([](auto& r) { r.mutable_sampling_params()->set_json_schema("{}"); }, kUnimplemented,
                "sampling_params.json_schema");
  ExpectRefused([](auto& r) { r.mutable_sampling_params()->set_ebnf_grammar("root ::= \"a\""); },
                kUnimplemented, "sampling_params.ebnf_grammar");
  ExpectRefused([](auto& r) { r.mutable_sampling_params()->set_structural_tag("{}"); },
                kUnimplemented, "sampling_params.structural_tag");
  // An empty constraint string still selects the constraint: refused, not ignored.
  ExpectRefused([](auto& r) { r.mutable_sampling_params()->set_regex(""); }, kUnimplemented,
                "sampling_params.regex");
}

TEST(ToDxsGenerateRequest, RefusesBadValuesNamingTheField) {
  constexpr auto kInvalid = absl::StatusCode::kInvalidArgument;
  ExpectRefused([](auto& r) { r.mutable_sampling_params()->add_stop("\n\n"); }, kInvalid,
                "sampling_params.stop");
  ExpectRefused([](auto& r) { r.mutable_sampling_params()->set_top_k(-2); }, kInvalid,
                "sampling_params.top_k");
  for (const std::string key : {"abc", "", "7x", "-1", " 7", "+7", "4294967296"}) {
    SCOPED_TRACE("logit_bias key \"" + key + "\"");
    ExpectRefused(
        [&key](auto& r) { (*r.mutable_sampling_params()->mutable_logit_bias())[key] = 1.0f; },
        kInvalid, "sampling_params.logit_bias");
  }
  ExpectRefused(
      [](auto& r) {
        (*r.mutable_sampling_params()->mutable_custom_params()->mutable_fields())["temperature"]
            .set_number_value(1.0);
      },
      kInvalid, "sampling_params.custom_params.temperature");
  for (const double seed : {1.5, -1.0, 1e300}) {
    SCOPED_TRACE(seed);
    ExpectRefused(
        [seed](auto& r) {
          (*r.mutable_sampling_params()->mutable_custom_params()->mutable_fields())["seed"]
              .set_number_value(seed);
        },
        kInvalid, "sampling_params.custom_params.seed");
  }
  ExpectRefused(
      [](auto& r) {
        (*r.mutable_sampling_params()->mutable_custom_params()->mutable_fields())["seed"]
            .set_string_value("42");
      },
      kInvalid, "sampling_params.custom_params.seed");
  ExpectRefused([](auto& r) { r.set_top_logprobs_num(3); }, kInvalid, "top_logprobs_num");
  ExpectRefused(
      [](auto& r) {
        r.set_return_logprob(true);
        r.set_top_logprobs_num(-1);
      },
      kInvalid, "top_logprobs_num");
  ExpectRefused([](auto& r) { r.set_logprob_start_len(-2); }, kInvalid, "logprob_start_len");
  ExpectRefused([](auto& r) { r.mutable_sampling_params()->set_stream_interval(-1); }, kInvalid,
                "sampling_params.stream_interval");
  ExpectRefused([](auto& r) { r.set_data_parallel_rank(-1); }, kInvalid, "data_parallel_rank");
  ExpectRefused([](auto& r) { r.mutable_sampling_params()->set_max_new_tokens(0x80000000u); },
                kInvalid, "sampling_params.max_new_tokens");
}

// ---- ToDxsGenerateRequest: accepted fields ----

TEST(ToDxsGenerateRequest, MapsEveryAcceptedField) {
  sglang::GenerateRequest r = Good();
  sglang::SamplingParams& in = *r.mutable_sampling_params();
  in.set_temperature(0.7f);
  in.set_top_p(0.9f);
  in.set_top_k(40);
  in.set_min_p(0.05f);
  in.set_frequency_penalty(0.5f);
  in.set_presence_penalty(-0.25f);
  in.set_repetition_penalty(1.1f);
  in.add_stop_token_ids(2);
  in.add_stop_token_ids(9);
  in.set_ignore_eos(true);
  in.set_min_new_tokens(3);
  in.set_n(4);
  in.set_stream_interval(2);
  (*in.mutable_logit_bias())["7"] = -5.5f;
  (*in.mutable_logit_bias())["0"] = 2.0f;
  (*in.mutable_custom_params()->mutable_fields())["seed"].set_number_value(42);
  // Informational and detokenizer options pass without effect.
  in.set_skip_special_tokens(true);
  in.set_no_stop_trim(true);
  r.set_log_metrics(true);
  r.mutable_tokenized()->set_original_text("hello");
  r.set_return_logprob(true);
  r.set_top_logprobs_num(5);
  r.add_token_ids_logprob(11);
  r.add_token_ids_logprob(12);
  r.set_logprob_start_len(1);
  r.set_data_parallel_rank(1);

  absl::StatusOr<v1::GenerateRequest> out = ToDxsGenerateRequest(r, Facts());
  ASSERT_TRUE(out.ok()) << out.status();
  EXPECT_EQ(out->request_id(), "req-1");
  EXPECT_EQ(std::vector<uint32_t>(out->prompt_token_ids().begin(), out->prompt_token_ids().end()),
            (std::vector<uint32_t>{5, 6, 7}));
  ASSERT_TRUE(out->has_data_parallel_rank());
  EXPECT_EQ(out->data_parallel_rank(), 1u);
  const v1::SamplingParams& p = out->sampling_params();
  EXPECT_EQ(p.max_new_tokens(), 8);
  ASSERT_TRUE(p.has_temperature());
  EXPECT_FLOAT_EQ(p.temperature(), 0.7f);
  ASSERT_TRUE(p.has_top_p());
  EXPECT_FLOAT_EQ(p.top_p(), 0.9f);
  EXPECT_EQ(p.top_k(), 40);
  ASSERT_TRUE(p.has_min_p());
  EXPECT_FLOAT_EQ(p.min_p(), 0.05f);
  EXPECT_FLOAT_EQ(p.frequency_penalty(), 0.5f);
  EXPECT_FLOAT_EQ(p.presence_penalty(), -0.25f);
  ASSERT_TRUE(p.has_repetition_penalty());
  EXPECT_FLOAT_EQ(p.repetition_penalty(), 1.1f);
  EXPECT_EQ(std::vector<uint32_t>(p.stop_token_ids().begin(), p.stop_token_ids().end()),
            (std::vector<uint32_t>{2, 9}));
  EXPECT_TRUE(p.ignore_eos());
  EXPECT_EQ(p.min_new_tokens(), 3u);
  EXPECT_EQ(p.n(), 4u);
  ASSERT_EQ(p.logit_bias_size(), 2);
  EXPECT_FLOAT_EQ(p.logit_bias().at(7), -5.5f);
  EXPECT_FLOAT_EQ(p.logit_bias().at(0), 2.0f);
  ASSERT_TRUE(p.has_seed());
  EXPECT_EQ(p.seed(), 42u);
  EXPECT_TRUE(p.logprobs());
  EXPECT_EQ(p.top_logprobs(), 5u);
  EXPECT_EQ(std::vector<uint32_t>(p.logprob_token_ids().begin(), p.logprob_token_ids().end()),
            (std::vector<uint32_t>{11, 12}));
  ASSERT_TRUE(p.has_prompt_logprobs_start());
  EXPECT_EQ(p.prompt_logprobs_start(), 1u);
}

TEST(ToDxsGenerateRequest, ProtoDefaultsMeanUnset) {
  sglang::GenerateRequest r = Good();
  sglang::SamplingParams& in = *r.mutable_sampling_params();
  in.set_top_k(-1);
  // top_p, min_p and repetition_penalty are 0: unset; temperature 0: greedy.
  absl::StatusOr<v1::GenerateRequest> out = ToDxsGenerateRequest(r, Facts());
  ASSERT_TRUE(out.ok()) << out.status();
  const v1::SamplingParams& p = out->sampling_params();
  EXPECT_TRUE(p.has_temperature());
  EXPECT_EQ(p.temperature(), 0.0f);
  EXPECT_FALSE(p.has_top_p());
  EXPECT_EQ(p.top_k(), 0);
  EXPECT_FALSE(p.has_min_p());
  EXPECT_FALSE(p.has_repetition_penalty());
  EXPECT_FALSE(p.has_seed());
  EXPECT_FALSE(p.logprobs());
  EXPECT_EQ(p.top_logprobs(), 0u);
  EXPECT_FALSE(p.has_prompt_logprobs_start());
  EXPECT_EQ(p.logprob_token_ids_size(), 0);
  EXPECT_EQ(p.n(), 0u);
  EXPECT_FALSE(out->has_data_parallel_rank());

  in.set_top_k(0);
  out = ToDxsGenerateRequest(r, Facts());
  ASSERT_TRUE(out.ok()) << out.status();
  EXPECT_EQ(out->sampling_params().top_k(), 0);
}

TEST(ToDxsGenerateRequest, LogprobOptions) {
  // token_ids_logprob without return_logprob: only the named ids' logprobs.
  sglang::GenerateRequest r = Good();
  r.add_token_ids_logprob(3);
  absl::StatusOr<v1::GenerateRequest> out = ToDxsGenerateRequest(r, Facts());
  ASSERT_TRUE(out.ok()) << out.status();
  EXPECT_FALSE(out->sampling_params().logprobs());
  EXPECT_EQ(out->sampling_params().logprob_token_ids_size(), 1);

  // return_logprob with logprob_start_len 0: the prompt is scored from position 0.
  r = Good();
  r.set_return_logprob(true);
  r.set_logprob_start_len(0);
  out = ToDxsGenerateRequest(r, Facts());
  ASSERT_TRUE(out.ok()) << out.status();
  EXPECT_TRUE(out->sampling_params().logprobs());
  EXPECT_EQ(out->sampling_params().top_logprobs(), 0u);
  ASSERT_TRUE(out->sampling_params().has_prompt_logprobs_start());
  EXPECT_EQ(out->sampling_params().prompt_logprobs_start(), 0u);

  // logprob_start_len -1: no prompt scores.
  r.set_logprob_start_len(-1);
  out = ToDxsGenerateRequest(r, Facts());
  ASSERT_TRUE(out.ok()) << out.status();
  EXPECT_FALSE(out->sampling_params().has_prompt_logprobs_start());
}

TEST(ToDxsGenerateRequest, UnsetMaxNewTokensIsTheRestOfTheContext) {
  sglang::GenerateRequest r = Good();
  r.mutable_sampling_params()->clear_max_new_tokens();
  absl::StatusOr<v1::GenerateRequest> out = ToDxsGenerateRequest(r, Facts());
  ASSERT_TRUE(out.ok()) << out.status();
  EXPECT_EQ(out->sampling_params().max_new_tokens(), kContext - 3);

  // Set explicitly to 0 is kept (a prompt-scoring request), not replaced by the default.
  r.mutable_sampling_params()->set_max_new_tokens(0);
  out = ToDxsGenerateRequest(r, Facts());
  ASSERT_TRUE(out.ok()) << out.status();
  EXPECT_EQ(out->sampling_params().max_new_tokens(), 0);
}

TEST(ToDxsGenerateRequest, APromptThatFillsTheContextLeavesNoRoom) {
  for (const int64_t length : {kContext, kContext + 1}) {
    sglang::GenerateRequest r = Good();
    r.mutable_sampling_params()->clear_max_new_tokens();
    r.mutable_tokenized()->clear_input_ids();
    for (int64_t i = 0; i < length; ++i) r.mutable_tokenized()->add_input_ids(1);
    absl::StatusOr<v1::GenerateRequest> out = ToDxsGenerateRequest(r, Facts());
    ASSERT_FALSE(out.ok());
    EXPECT_EQ(out.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_TRUE(StartsWith(out.status().message(), "tokenized.input_ids:")) << out.status();
  }
  // One token short of the context: one token of room.
  sglang::GenerateRequest r = Good();
  r.mutable_sampling_params()->clear_max_new_tokens();
  r.mutable_tokenized()->clear_input_ids();
  for (int64_t i = 0; i < kContext - 1; ++i) r.mutable_tokenized()->add_input_ids(1);
  absl::StatusOr<v1::GenerateRequest> out = ToDxsGenerateRequest(r, Facts());
  ASSERT_TRUE(out.ok()) << out.status();
  EXPECT_EQ(out->sampling_params().max_new_tokens(), 1);
}

// ---- ToSglangStatus ----

TEST(ToSglangStatus, RenamesDxsFieldPaths) {
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"prompt_token_ids[3]: token id 900 is not below vocab_size 100",
       "tokenized.input_ids[3]: token id 900 is not below vocab_size 100"},
      {"prompt_token_ids: must not be empty", "tokenized.input_ids: must not be empty"},
      {"sampling_params.top_logprobs: must be in [0, 20], got 50",
       "top_logprobs_num: must be in [0, 20], got 50"},
      {"sampling_params.logprobs: x", "return_logprob: x"},
      {"sampling_params.logprob_token_ids[0]: token id 1000",
       "token_ids_logprob[0]: token id 1000"},
      {"sampling_params.logprob_token_ids: at most 128", "token_ids_logprob: at most 128"},
      {"sampling_params.prompt_logprobs_start: must be a prompt position",
       "logprob_start_len: must be a prompt position"},
      {"sampling_params.seed: x", "sampling_params.custom_params.seed: x"},
  };
  for (const auto& [from, to] : cases) {
    const absl::Status s = ToSglangStatus(absl::InvalidArgumentError(from));
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_EQ(s.message(), to);
  }
}

TEST(ToSglangStatus, LeavesOtherStatusesAlone) {
  EXPECT_TRUE(ToSglangStatus(absl::OkStatus()).ok());
  // Other messages: the same field name in both protocols.
  for (const std::string message :
       {"sampling_params.top_p: must be in (0, 1], got 2", "sampling_params.n: too many",
        "sampling_params.max_new_tokens: prompt_token_ids (3) + 100 > 64",
        "request_id: 300 bytes"}) {
    const absl::Status s = ToSglangStatus(absl::InvalidArgumentError(message));
    EXPECT_EQ(s, absl::InvalidArgumentError(message));
  }
  // Other codes, even with a dxs field path.
  for (const absl::Status& s : {absl::UnavailableError("prompt_token_ids: rank 0 is down"),
                                absl::ResourceExhaustedError("sampling_params.top_logprobs: x"),
                                absl::AlreadyExistsError("request id req-1 is in flight"),
                                absl::UnimplementedError("sampling_params.logprobs: x")}) {
    EXPECT_EQ(ToSglangStatus(s), s);
  }
}

TEST(ToSglangStatus, NamesTheProtocolsFieldAfterARealValidation) {
  GenerateLimits limits;
  limits.vocab_size = 100;
  limits.max_context_length = kContext;
  limits.num_attention_ranks = 1;
  const auto validate = [&limits](const sglang::GenerateRequest& r) {
    absl::StatusOr<v1::GenerateRequest> out = ToDxsGenerateRequest(r, Facts());
    EXPECT_TRUE(out.ok()) << out.status();
    if (!out.ok()) return out.status();
    return ToSglangStatus(ValidateGenerateRequest(*out, limits));
  };

  sglang::GenerateRequest r = Good();
  EXPECT_TRUE(validate(r).ok()) << validate(r);

  r.set_return_logprob(true);
  r.set_top_logprobs_num(50);
  absl::Status s = validate(r);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(StartsWith(s.message(), "top_logprobs_num:")) << s;

  r = Good();
  r.mutable_tokenized()->set_input_ids(1, 100);  // outside the vocabulary
  s = validate(r);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(StartsWith(s.message(), "tokenized.input_ids[1]:")) << s;

  r = Good();
  r.set_return_logprob(true);
  r.set_logprob_start_len(3);  // the prompt has 3 tokens: positions 0..2
  s = validate(r);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(StartsWith(s.message(), "logprob_start_len:")) << s;

  r = Good();
  r.add_token_ids_logprob(4);
  r.add_token_ids_logprob(100);
  s = validate(r);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(StartsWith(s.message(), "token_ids_logprob[1]:")) << s;

  r = Good();
  r.mutable_sampling_params()->set_top_p(2.0f);
  s = validate(r);
  EXPECT_TRUE(StartsWith(s.message(), "sampling_params.top_p:")) << s;
}

// ---- SglangResponseTranslator ----

struct Sent {
  sglang::GenerateResponse message;
  bool last;
};

class Capture {
 public:
  SglangResponseTranslator::Sink Sink() {
    return [this](const sglang::GenerateResponse& m, bool last) {
      sent.push_back({m, last});
      return accept;
    };
  }
  std::vector<Sent> sent;
  bool accept = true;
};

v1::GenerateResponse Chunk(std::vector<uint32_t> ids, uint32_t sample_index = 0,
                           uint32_t index = 0) {
  v1::GenerateResponse m;
  m.set_request_id("req-1");
  v1::TokenChunk& c = *m.mutable_chunk();
  c.mutable_token_ids()->Assign(ids.begin(), ids.end());
  c.set_sample_index(sample_index);
  c.set_index(index);
  return m;
}

// A chunk with logprobs: token i's logprob is -(id / 10); its top list is {id: lp, id+1: lp-1};
// with `named`, the named ids' logprobs are -(id + k).
v1::GenerateResponse ChunkWithLogprobs(std::vector<uint32_t> ids, size_t named = 0,
                                       uint32_t sample_index = 0) {
  v1::GenerateResponse m = Chunk(ids, sample_index);
  for (const uint32_t id : ids) {
    v1::TokenLogprobs& lp = *m.mutable_chunk()->add_logprobs();
    lp.set_logprob(-static_cast<float>(id) / 10);
    v1::TopLogprob& a = *lp.add_top_logprobs();
    a.set_token_id(id);
    a.set_logprob(-static_cast<float>(id) / 10);
    v1::TopLogprob& b = *lp.add_top_logprobs();
    b.set_token_id(id + 1);
    b.set_logprob(-static_cast<float>(id) / 10 - 1);
    for (size_t k = 0; k < named; ++k) lp.add_token_ids_logprobs(-static_cast<float>(id + k));
  }
  return m;
}

v1::GenerateResponse Complete(v1::FinishReason reason, uint32_t completion_tokens,
                              std::optional<uint32_t> matched = std::nullopt) {
  v1::GenerateResponse m;
  m.set_request_id("req-1");
  v1::GenerateComplete& c = *m.mutable_complete();
  c.set_finish_reason(reason);
  c.set_prompt_tokens(3);
  c.set_completion_tokens(completion_tokens);
  if (matched) c.set_matched_stop_token_id(*matched);
  return m;
}

std::vector<uint32_t> Ids(const google::protobuf::RepeatedField<uint32_t>& ids) {
  return {ids.begin(), ids.end()};
}
std::vector<float> Floats(const google::protobuf::RepeatedField<float>& values) {
  return {values.begin(), values.end()};
}

sglang::GenerateRequest Streaming() {
  sglang::GenerateRequest r = Good();
  r.set_stream(true);
  return r;
}

TEST(SglangResponseTranslator, StreamsIncrementalChunksThenOneComplete) {
  sglang::GenerateRequest r = Streaming();
  r.set_return_logprob(true);
  r.set_top_logprobs_num(2);
  r.add_token_ids_logprob(50);
  r.add_token_ids_logprob(60);
  Capture capture;
  SglangResponseTranslator t(r, 1, Facts(), capture.Sink());

  v1::GenerateResponse m = ChunkWithLogprobs({10}, 2);
  ASSERT_TRUE(t.Write(m));
  m = ChunkWithLogprobs({11, 12}, 2);
  ASSERT_TRUE(t.Write(m));
  m = ChunkWithLogprobs({13}, 2);
  ASSERT_TRUE(t.Write(m));
  m = Complete(v1::FINISH_REASON_STOP_EOS, 4, 13);
  t.WriteLast(m);

  ASSERT_EQ(capture.sent.size(), 4u);
  const std::vector<std::vector<uint32_t>> expected_ids = {{10}, {11, 12}, {13}};
  uint32_t total = 0;
  for (size_t i = 0; i < 3; ++i) {
    SCOPED_TRACE(i);
    const Sent& s = capture.sent[i];
    EXPECT_FALSE(s.last);
    EXPECT_EQ(s.message.request_id(), "req-1");
    ASSERT_TRUE(s.message.has_chunk());
    const sglang::GenerateStreamChunk& c = s.message.chunk();
    EXPECT_EQ(Ids(c.token_ids()), expected_ids[i]);
    total += static_cast<uint32_t>(expected_ids[i].size());
    EXPECT_EQ(c.prompt_tokens(), 3u);
    EXPECT_EQ(c.completion_tokens(), total);
    EXPECT_EQ(c.index(), 0u);
    EXPECT_FALSE(c.has_input_logprobs());
    // Logprobs of this chunk's tokens only.
    const sglang::OutputLogProbs& lp = c.output_logprobs();
    ASSERT_EQ(lp.token_logprobs_size(), static_cast<int>(expected_ids[i].size()));
    EXPECT_EQ(Ids(lp.token_ids()), expected_ids[i]);
    ASSERT_EQ(lp.top_logprobs_size(), lp.token_logprobs_size());
    ASSERT_EQ(lp.token_ids_logprobs_size(), lp.token_logprobs_size());
    for (size_t k = 0; k < expected_ids[i].size(); ++k) {
      const uint32_t id = expected_ids[i][k];
      EXPECT_FLOAT_EQ(lp.token_logprobs(static_cast<int>(k)), -static_cast<float>(id) / 10);
      const sglang::TopLogProbs& top = lp.top_logprobs(static_cast<int>(k));
      EXPECT_EQ(Ids(top.token_ids()), (std::vector<uint32_t>{id, id + 1}));
      ASSERT_EQ(top.values_size(), 2);
      EXPECT_FLOAT_EQ(top.values(0), -static_cast<float>(id) / 10);
      EXPECT_FLOAT_EQ(top.values(1), -static_cast<float>(id) / 10 - 1);
      const sglang::TopLogProbs& named = lp.token_ids_logprobs(static_cast<int>(k));
      EXPECT_EQ(Ids(named.token_ids()), (std::vector<uint32_t>{50, 60}));
      EXPECT_EQ(Floats(named.values()),
                (std::vector<float>{-static_cast<float>(id), -static_cast<float>(id + 1)}));
    }
  }
  const Sent& last = capture.sent[3];
  EXPECT_TRUE(last.last);
  ASSERT_TRUE(last.message.has_complete());
  const sglang::GenerateComplete& c = last.message.complete();
  EXPECT_EQ(Ids(c.output_ids()), (std::vector<uint32_t>{10, 11, 12, 13}));
  EXPECT_EQ(c.finish_reason(), "stop");
  ASSERT_EQ(c.matched_stop_case(), sglang::GenerateComplete::kMatchedTokenId);
  EXPECT_EQ(c.matched_token_id(), 13u);
  EXPECT_EQ(c.prompt_tokens(), 3u);
  EXPECT_EQ(c.completion_tokens(), 4u);
  EXPECT_EQ(c.index(), 0u);
  // Cumulative logprobs in the complete.
  EXPECT_EQ(Ids(c.output_logprobs().token_ids()), (std::vector<uint32_t>{10, 11, 12, 13}));
  EXPECT_EQ(Floats(c.output_logprobs().token_logprobs()),
            (std::vector<float>{-1.0f, -1.1f, -1.2f, -1.3f}));
  EXPECT_EQ(c.output_logprobs().top_logprobs_size(), 4);
  EXPECT_EQ(c.output_logprobs().token_ids_logprobs_size(), 4);
}

TEST(SglangResponseTranslator, WithoutLogprobsChunksCarryNone) {
  Capture capture;
  SglangResponseTranslator t(Streaming(), 1, Facts(), capture.Sink());
  v1::GenerateResponse m = Chunk({10, 11});
  ASSERT_TRUE(t.Write(m));
  m = Complete(v1::FINISH_REASON_LENGTH, 2);
  t.WriteLast(m);
  ASSERT_EQ(capture.sent.size(), 2u);
  EXPECT_FALSE(capture.sent[0].message.chunk().has_output_logprobs());
  EXPECT_FALSE(capture.sent[1].message.complete().has_output_logprobs());
  EXPECT_FALSE(capture.sent[1].message.complete().has_input_logprobs());
}

TEST(SglangResponseTranslator, MapsFinishReasons) {
  struct Case {
    v1::FinishReason reason;
    std::optional<uint32_t> matched;
    std::string expected;
  };
  for (const Case& c : std::vector<Case>{{v1::FINISH_REASON_STOP_EOS, 2, "stop"},
                                         {v1::FINISH_REASON_STOP_TOKEN, 9, "stop"},
                                         {v1::FINISH_REASON_LENGTH, std::nullopt, "length"},
                                         {v1::FINISH_REASON_CONTEXT_LENGTH, std::nullopt, "length"},
                                         {v1::FINISH_REASON_ABORTED, std::nullopt, "abort"}}) {
    SCOPED_TRACE(v1::FinishReason_Name(c.reason));
    for (const bool stream : {true, false}) {
      sglang::GenerateRequest r = Good();
      r.set_stream(stream);
      Capture capture;
      SglangResponseTranslator t(r, 1, Facts(), capture.Sink());
      v1::GenerateResponse m = Chunk({1, 2});
      ASSERT_TRUE(t.Write(m));
      m = Complete(c.reason, 2, c.matched);
      t.WriteLast(m);
      ASSERT_FALSE(capture.sent.empty());
      const sglang::GenerateComplete& done = capture.sent.back().message.complete();
      EXPECT_EQ(done.finish_reason(), c.expected);
      if (c.matched) {
        ASSERT_EQ(done.matched_stop_case(), sglang::GenerateComplete::kMatchedTokenId);
        EXPECT_EQ(done.matched_token_id(), *c.matched);
      } else {
        EXPECT_EQ(done.matched_stop_case(), sglang::GenerateComplete::MATCHED_STOP_NOT_SET);
      }
    }
  }
}

TEST(SglangResponseTranslator, StreamIntervalGroupsTokens) {
  sglang::GenerateRequest r = Streaming();
  r.mutable_sampling_params()->set_stream_interval(3);
  r.set_return_logprob(true);
  Capture capture;
  SglangResponseTranslator t(r, 1, Facts(), capture.Sink());
  for (uint32_t id = 20; id < 28; ++id) {
    v1::GenerateResponse m = ChunkWithLogprobs({id});
    ASSERT_TRUE(t.Write(m));
  }
  v1::GenerateResponse m = Complete(v1::FINISH_REASON_LENGTH, 8);
  t.WriteLast(m);

  // The first token at once; then 3 at a time; the last 1 before the complete.
  const std::vector<std::vector<uint32_t>> expected = {{20}, {21, 22, 23}, {24, 25, 26}, {27}};
  ASSERT_EQ(capture.sent.size(), expected.size() + 1);
  uint32_t total = 0;
  for (size_t i = 0; i < expected.size(); ++i) {
    SCOPED_TRACE(i);
    const sglang::GenerateStreamChunk& c = capture.sent[i].message.chunk();
    EXPECT_FALSE(capture.sent[i].last);
    EXPECT_EQ(Ids(c.token_ids()), expected[i]);
    total += static_cast<uint32_t>(expected[i].size());
    EXPECT_EQ(c.completion_tokens(), total);
    // Each token's logprob exactly once, with its chunk.
    EXPECT_EQ(Ids(c.output_logprobs().token_ids()), expected[i]);
    EXPECT_EQ(c.output_logprobs().token_logprobs_size(), static_cast<int>(expected[i].size()));
    EXPECT_EQ(c.output_logprobs().top_logprobs_size(), static_cast<int>(expected[i].size()));
  }
  const Sent& last = capture.sent.back();
  EXPECT_TRUE(last.last);
  EXPECT_EQ(Ids(last.message.complete().output_ids()),
            (std::vector<uint32_t>{20, 21, 22, 23, 24, 25, 26, 27}));
  EXPECT_EQ(last.message.complete().output_logprobs().token_logprobs_size(), 8);
}

TEST(SglangResponseTranslator, StreamIntervalCountsTokensNotChunks) {
  sglang::GenerateRequest r = Streaming();
  r.mutable_sampling_params()->set_stream_interval(3);
  Capture capture;
  SglangResponseTranslator t(r, 1, Facts(), capture.Sink());
  for (const std::vector<uint32_t>& ids :
       std::vector<std::vector<uint32_t>>{{1, 2}, {3, 4}, {5}, {6, 7, 8, 9}}) {
    v1::GenerateResponse m = Chunk(ids);
    ASSERT_TRUE(t.Write(m));
  }
  // {1,2} at once; {3,4} waits; {3,4,5} goes; {6,7,8,9} is 4 >= 3 and goes.
  ASSERT_EQ(capture.sent.size(), 3u);
  EXPECT_EQ(Ids(capture.sent[0].message.chunk().token_ids()), (std::vector<uint32_t>{1, 2}));
  EXPECT_EQ(Ids(capture.sent[1].message.chunk().token_ids()), (std::vector<uint32_t>{3, 4, 5}));
  EXPECT_EQ(Ids(capture.sent[2].message.chunk().token_ids()), (std::vector<uint32_t>{6, 7, 8, 9}));
  v1::GenerateResponse m = Complete(v1::FINISH_REASON_LENGTH, 9);
  t.WriteLast(m);
  // Nothing pending: only the complete.
  ASSERT_EQ(capture.sent.size(), 4u);
  EXPECT_TRUE(capture.sent[3].message.has_complete());
}

TEST(SglangResponseTranslator, NotStreamingSendsOnlyCompletes) {
  sglang::GenerateRequest r = Good();
  r.set_return_logprob(true);
  Capture capture;
  SglangResponseTranslator t(r, 1, Facts(), capture.Sink());
  v1::GenerateResponse m = ChunkWithLogprobs({10});
  ASSERT_TRUE(t.Write(m));
  m = ChunkWithLogprobs({11, 12});
  ASSERT_TRUE(t.Write(m));
  EXPECT_TRUE(capture.sent.empty());
  m = Complete(v1::FINISH_REASON_LENGTH, 3);
  t.WriteLast(m);
  ASSERT_EQ(capture.sent.size(), 1u);
  EXPECT_TRUE(capture.sent[0].last);
  const sglang::GenerateComplete& c = capture.sent[0].message.complete();
  EXPECT_EQ(Ids(c.output_ids()), (std::vector<uint32_t>{10, 11, 12}));
  EXPECT_EQ(c.finish_reason(), "length");
  EXPECT_EQ(c.completion_tokens(), 3u);
  EXPECT_EQ(Ids(c.output_logprobs().token_ids()), (std::vector<uint32_t>{10, 11, 12}));
  EXPECT_EQ(c.output_logprobs().token_logprobs_size(), 3);
}

TEST(SglangResponseTranslator, NSamplesCompleteInIndexOrder) {
  for (const bool stream : {true, false}) {
    SCOPED_TRACE(stream ? "streaming" : "not streaming");
    sglang::GenerateRequest r = Good();
    r.set_stream(stream);
    r.mutable_sampling_params()->set_n(3);
    Capture capture;
    SglangResponseTranslator t(r, 3, Facts(), capture.Sink());
    for (v1::GenerateResponse m :
         {Chunk({30}, 2), Chunk({10}, 0), Chunk({20}, 1), Chunk({21, 22}, 1), Chunk({11}, 0),
          Chunk({31}, 2), Chunk({32}, 2)}) {
      ASSERT_TRUE(t.Write(m));
    }
    v1::GenerateResponse done = Complete(v1::FINISH_REASON_STOP_EOS, 2, 11);
    v1::SampleComplete* s2 = done.mutable_complete()->add_samples();
    s2->set_sample_index(2);
    s2->set_finish_reason(v1::FINISH_REASON_LENGTH);
    s2->set_completion_tokens(3);
    v1::SampleComplete* s1 = done.mutable_complete()->add_samples();
    s1->set_sample_index(1);
    s1->set_finish_reason(v1::FINISH_REASON_STOP_TOKEN);
    s1->set_completion_tokens(3);
    s1->set_matched_stop_token_id(22);
    v1::SampleComplete* s0 = done.mutable_complete()->add_samples();
    s0->set_sample_index(0);
    s0->set_finish_reason(v1::FINISH_REASON_STOP_EOS);
    s0->set_completion_tokens(2);
    s0->set_matched_stop_token_id(11);
    t.WriteLast(done);

    std::vector<const Sent*> chunks;
    std::vector<const Sent*> completes;
    for (const Sent& s : capture.sent) {
      (s.message.has_complete() ? completes : chunks).push_back(&s);
    }
    if (stream) {
      // Each chunk goes out under its own sample's index with that sample's count.
      ASSERT_EQ(chunks.size(), 7u);
      EXPECT_EQ(chunks[0]->message.chunk().index(), 2u);
      EXPECT_EQ(Ids(chunks[0]->message.chunk().token_ids()), (std::vector<uint32_t>{30}));
      EXPECT_EQ(chunks[3]->message.chunk().index(), 1u);
      EXPECT_EQ(Ids(chunks[3]->message.chunk().token_ids()), (std::vector<uint32_t>{21, 22}));
      EXPECT_EQ(chunks[3]->message.chunk().completion_tokens(), 3u);
      EXPECT_EQ(chunks[6]->message.chunk().index(), 2u);
      EXPECT_EQ(chunks[6]->message.chunk().completion_tokens(), 3u);
      for (const Sent* c : chunks) EXPECT_FALSE(c->last);
    } else {
      EXPECT_TRUE(chunks.empty());
    }
    ASSERT_EQ(completes.size(), 3u);
    const std::vector<std::vector<uint32_t>> ids = {{10, 11}, {20, 21, 22}, {30, 31, 32}};
    const std::vector<std::string> reasons = {"stop", "stop", "length"};
    const std::vector<std::optional<uint32_t>> matched = {11, 22, std::nullopt};
    for (size_t i = 0; i < 3; ++i) {
      SCOPED_TRACE(i);
      const sglang::GenerateComplete& c = completes[i]->message.complete();
      EXPECT_EQ(c.index(), i);
      EXPECT_EQ(Ids(c.output_ids()), ids[i]);
      EXPECT_EQ(c.finish_reason(), reasons[i]);
      EXPECT_EQ(c.completion_tokens(), ids[i].size());
      EXPECT_EQ(c.prompt_tokens(), 3u);
      if (matched[i]) {
        ASSERT_EQ(c.matched_stop_case(), sglang::GenerateComplete::kMatchedTokenId);
        EXPECT_EQ(c.matched_token_id(), *matched[i]);
      } else {
        EXPECT_EQ(c.matched_stop_case(), sglang::GenerateComplete::MATCHED_STOP_NOT_SET);
      }
      EXPECT_EQ(completes[i]->last, i == 2);
    }
    // The completes come after every chunk.
    EXPECT_EQ(capture.sent.back().message.complete().index(), 2u);
  }
}

TEST(SglangResponseTranslator, AnEmptyFirstChunkProducesNothing) {
  for (const bool stream : {true, false}) {
    sglang::GenerateRequest r = Good();
    r.set_stream(stream);
    r.set_request_id("");
    Capture capture;
    SglangResponseTranslator t(r, 1, Facts(), capture.Sink());
    v1::GenerateResponse m = Chunk({});
    m.set_request_id("r-1-abc");  // assigned by the router
    EXPECT_TRUE(t.Write(m));
    EXPECT_TRUE(capture.sent.empty());
    // A message that is neither chunk nor complete is ignored too.
    v1::GenerateResponse nothing;
    EXPECT_TRUE(t.Write(nothing));
    EXPECT_TRUE(capture.sent.empty());
    m = Chunk({4});
    ASSERT_TRUE(t.Write(m));
    EXPECT_EQ(capture.sent.size(), stream ? 1u : 0u);
  }
}

// The prompt's scores: dxs scores from position 1 (nothing precedes position 0); the
// protocol lists every position from logprob_start_len, position 0 without a value, with
// one token id per entry.
v1::GenerateResponse ChunkWithPromptLogprobs(std::vector<uint32_t> ids, uint32_t first_position,
                                             std::vector<uint32_t> prompt_ids) {
  v1::GenerateResponse m = ChunkWithLogprobs(ids);
  v1::PromptLogprobs& p = *m.mutable_chunk()->mutable_prompt_logprobs();
  p.set_first_position(first_position);
  for (uint32_t i = first_position; i < prompt_ids.size(); ++i) {
    p.add_token_ids(prompt_ids[i]);
    v1::TokenLogprobs& lp = *p.add_positions();
    lp.set_logprob(-static_cast<float>(i));
    v1::TopLogprob& top = *lp.add_top_logprobs();
    top.set_token_id(prompt_ids[i]);
    top.set_logprob(-static_cast<float>(i));
  }
  return m;
}

TEST(SglangResponseTranslator, PromptLogprobsFromPositionZero) {
  for (const bool stream : {true, false}) {
    SCOPED_TRACE(stream ? "streaming" : "not streaming");
    sglang::GenerateRequest r = Good();  // prompt 5, 6, 7
    r.set_stream(stream);
    r.set_return_logprob(true);
    r.set_top_logprobs_num(1);
    r.set_logprob_start_len(0);
    r.mutable_sampling_params()->set_n(2);
    Capture capture;
    SglangResponseTranslator t(r, 2, Facts(), capture.Sink());
    v1::GenerateResponse m = ChunkWithPromptLogprobs({10}, 1, {5, 6, 7});
    ASSERT_TRUE(t.Write(m));
    m = ChunkWithLogprobs({20}, 0, 1);
    ASSERT_TRUE(t.Write(m));
    m = ChunkWithLogprobs({11});
    ASSERT_TRUE(t.Write(m));
    m = Complete(v1::FINISH_REASON_LENGTH, 2);
    t.WriteLast(m);

    const auto check = [](const sglang::InputLogProbs& in) {
      ASSERT_EQ(in.token_logprobs_size(), 3);
      EXPECT_FALSE(in.token_logprobs(0).has_value());
      ASSERT_TRUE(in.token_logprobs(1).has_value());
      EXPECT_FLOAT_EQ(in.token_logprobs(1).value(), -1.0f);
      ASSERT_TRUE(in.token_logprobs(2).has_value());
      EXPECT_FLOAT_EQ(in.token_logprobs(2).value(), -2.0f);
      // One id per entry, the unscored first token included.
      EXPECT_EQ(Ids(in.token_ids()), (std::vector<uint32_t>{5, 6, 7}));
      ASSERT_EQ(in.top_logprobs_size(), 3);
      EXPECT_EQ(in.top_logprobs(0).values_size(), 0);
      EXPECT_EQ(Ids(in.top_logprobs(1).token_ids()), (std::vector<uint32_t>{6}));
      EXPECT_EQ(Ids(in.top_logprobs(2).token_ids()), (std::vector<uint32_t>{7}));
    };
    int chunks_with_input = 0;
    int completes = 0;
    for (size_t i = 0; i < capture.sent.size(); ++i) {
      const sglang::GenerateResponse& s = capture.sent[i].message;
      if (s.has_chunk()) {
        if (s.chunk().has_input_logprobs()) {
          ++chunks_with_input;
          EXPECT_EQ(i, 0u) << "only the first chunk carries the prompt's scores";
          check(s.chunk().input_logprobs());
        }
      } else {
        ++completes;
        ASSERT_TRUE(s.complete().has_input_logprobs());
        check(s.complete().input_logprobs());
      }
    }
    EXPECT_EQ(chunks_with_input, stream ? 1 : 0);
    EXPECT_EQ(completes, 2);
  }
}

TEST(SglangResponseTranslator, PromptLogprobsFromALaterPosition) {
  // logprob_start_len 1 and 2: dxs scores from there; every entry has a value and its id.
  for (const uint32_t start : {1u, 2u}) {
    SCOPED_TRACE(start);
    sglang::GenerateRequest r = Streaming();  // prompt 5, 6, 7
    r.set_return_logprob(true);
    r.set_logprob_start_len(static_cast<int32_t>(start));
    Capture capture;
    SglangResponseTranslator t(r, 1, Facts(), capture.Sink());
    v1::GenerateResponse m = ChunkWithPromptLogprobs({10}, start, {5, 6, 7});
    ASSERT_TRUE(t.Write(m));
    m = Complete(v1::FINISH_REASON_LENGTH, 1);
    t.WriteLast(m);
    ASSERT_EQ(capture.sent.size(), 2u);
    for (const sglang::InputLogProbs* in : {&capture.sent[0].message.chunk().input_logprobs(),
                                            &capture.sent[1].message.complete().input_logprobs()}) {
      const std::vector<uint32_t> expected_ids =
          start == 1 ? std::vector<uint32_t>{6, 7} : std::vector<uint32_t>{7};
      EXPECT_EQ(Ids(in->token_ids()), expected_ids);
      ASSERT_EQ(in->token_logprobs_size(), static_cast<int>(expected_ids.size()));
      EXPECT_EQ(in->top_logprobs_size(), in->token_logprobs_size());
      for (int k = 0; k < in->token_logprobs_size(); ++k) {
        ASSERT_TRUE(in->token_logprobs(k).has_value());
        EXPECT_FLOAT_EQ(in->token_logprobs(k).value(), -static_cast<float>(start + k));
      }
    }
  }
}

TEST(SglangResponseTranslator, PromptLogprobsOfAOneTokenPrompt) {
  // Nothing to score: one entry without a value, for the one token.
  sglang::GenerateRequest r = Streaming();
  r.mutable_tokenized()->clear_input_ids();
  r.mutable_tokenized()->add_input_ids(42);
  r.set_return_logprob(true);
  r.set_logprob_start_len(0);
  Capture capture;
  SglangResponseTranslator t(r, 1, Facts(), capture.Sink());
  v1::GenerateResponse m = ChunkWithPromptLogprobs({10}, 1, {42});
  ASSERT_TRUE(t.Write(m));
  ASSERT_EQ(capture.sent.size(), 1u);
  const sglang::InputLogProbs& in = capture.sent[0].message.chunk().input_logprobs();
  ASSERT_EQ(in.token_logprobs_size(), 1);
  EXPECT_FALSE(in.token_logprobs(0).has_value());
  EXPECT_EQ(Ids(in.token_ids()), (std::vector<uint32_t>{42}));
}

TEST(SglangResponseTranslator, PromptOnlyScoringSendsTheScoresBeforeTheComplete) {
  // max_new_tokens 0: a chunk without tokens carries the prompt's scores.
  sglang::GenerateRequest r = Streaming();
  r.mutable_sampling_params()->set_max_new_tokens(0);
  r.set_return_logprob(true);
  r.set_logprob_start_len(0);
  Capture capture;
  SglangResponseTranslator t(r, 1, Facts(), capture.Sink());
  v1::GenerateResponse m = ChunkWithPromptLogprobs({}, 1, {5, 6, 7});
  ASSERT_TRUE(t.Write(m));
  m = Complete(v1::FINISH_REASON_LENGTH, 0);
  t.WriteLast(m);
  ASSERT_EQ(capture.sent.size(), 2u);
  ASSERT_TRUE(capture.sent[0].message.has_chunk());
  EXPECT_EQ(capture.sent[0].message.chunk().token_ids_size(), 0);
  EXPECT_EQ(capture.sent[0].message.chunk().input_logprobs().token_logprobs_size(), 3);
  const sglang::GenerateComplete& c = capture.sent[1].message.complete();
  EXPECT_EQ(c.output_ids_size(), 0);
  EXPECT_EQ(c.completion_tokens(), 0u);
  EXPECT_EQ(c.input_logprobs().token_logprobs_size(), 3);
}

SglangModelFacts ThinkFacts() {
  SglangModelFacts facts = Facts();
  facts.think_start_token_id = 90;
  facts.think_end_token_id = 91;
  return facts;
}

uint32_t ReasoningTokensOf(sglang::GenerateRequest r, const SglangModelFacts& facts,
                           std::vector<uint32_t> output, bool finish = true) {
  r.set_stream(true);
  Capture capture;
  SglangResponseTranslator t(r, 1, facts, capture.Sink());
  v1::GenerateResponse m = Chunk(output);
  EXPECT_TRUE(t.Write(m));
  if (!finish) {
    EXPECT_EQ(capture.sent.size(), 1u);
    return capture.sent.empty() ? 0 : capture.sent[0].message.chunk().reasoning_tokens();
  }
  m = Complete(v1::FINISH_REASON_LENGTH, static_cast<uint32_t>(output.size()));
  t.WriteLast(m);
  EXPECT_EQ(capture.sent.size(), 2u);
  if (capture.sent.size() != 2u) return 0;
  // The chunk saw the same tokens as the complete.
  EXPECT_EQ(capture.sent[0].message.chunk().reasoning_tokens(),
            capture.sent[1].message.complete().reasoning_tokens());
  return capture.sent[1].message.complete().reasoning_tokens();
}

TEST(SglangResponseTranslator, CountsReasoningTokens) {
  sglang::GenerateRequest r = Good();
  r.set_require_reasoning(true);
  // Thinks, ends thinking, answers: <think> a b </think> counted.
  EXPECT_EQ(ReasoningTokensOf(r, ThinkFacts(), {90, 1, 2, 91, 3}), 4u);
  // No <think>: nothing.
  EXPECT_EQ(ReasoningTokensOf(r, ThinkFacts(), {1, 2, 91, 3}), 0u);
  EXPECT_EQ(ReasoningTokensOf(r, ThinkFacts(), {1, 2, 3}), 0u);
  // Still thinking: all of it.
  EXPECT_EQ(ReasoningTokensOf(r, ThinkFacts(), {90, 1, 2}, /*finish=*/false), 3u);

  // The prompt opened thinking (its last token is <think>): tokens up to </think>.
  sglang::GenerateRequest opened = r;
  opened.mutable_tokenized()->add_input_ids(90);
  EXPECT_EQ(ReasoningTokensOf(opened, ThinkFacts(), {1, 2, 3}), 3u);
  EXPECT_EQ(ReasoningTokensOf(opened, ThinkFacts(), {1, 91, 3}), 2u);

  // Not asked for, or a model without think ids: 0.
  sglang::GenerateRequest not_asked = Good();
  EXPECT_EQ(ReasoningTokensOf(not_asked, ThinkFacts(), {90, 1, 91, 3}), 0u);
  EXPECT_EQ(ReasoningTokensOf(r, Facts(), {90, 1, 91, 3}), 0u);
}

TEST(SglangResponseTranslator, ACallerThatWentAwayStopsTheStream) {
  Capture capture;
  SglangResponseTranslator t(Streaming(), 1, Facts(), capture.Sink());
  v1::GenerateResponse m = Chunk({1});
  ASSERT_TRUE(t.Write(m));
  capture.accept = false;
  m = Chunk({2});
  EXPECT_FALSE(t.Write(m));
  // Once gone, nothing more is sent.
  const size_t sent = capture.sent.size();
  m = Chunk({3});
  EXPECT_FALSE(t.Write(m));
  m = Complete(v1::FINISH_REASON_LENGTH, 3);
  EXPECT_FALSE(t.Write(m));
  EXPECT_EQ(capture.sent.size(), sent);
}

TEST(SglangResponseTranslator, ACallerGoneAtTheCompleteMakesWriteFalse) {
  Capture capture;
  capture.accept = false;
  SglangResponseTranslator t(Good(), 2, Facts(), capture.Sink());  // not streaming, n = 2
  v1::GenerateResponse m = Chunk({1});
  ASSERT_TRUE(t.Write(m));
  m = Complete(v1::FINISH_REASON_LENGTH, 1);
  EXPECT_FALSE(t.Write(m));
  // The first complete failed: the second is not attempted.
  EXPECT_EQ(capture.sent.size(), 1u);
}

}  // namespace
}  // namespace dxs
