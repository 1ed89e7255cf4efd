// ValidateGenerateRequest: every bad field is INVALID_ARGUMENT with a message that starts
// with the field's proto path; good requests (edge values included) pass.
#include "router/frontend/generate_validation.h"

#include <cmath>
#include <functional>
#include <limits>
#include <string>

#include "gtest/gtest.h"

namespace dxs {
namespace {

GenerateLimits Limits() {
  GenerateLimits limits;
  limits.vocab_size = 100;
  limits.max_context_length = 32;
  limits.num_attention_ranks = 2;
  return limits;
}

v1::GenerateRequest Good() {
  v1::GenerateRequest r;
  r.add_prompt_token_ids(0);
  r.add_prompt_token_ids(99);
  r.mutable_sampling_params()->set_max_new_tokens(30);  // 2 + 30 = 32, exactly the context
  return r;
}

void ExpectRefused(const std::function<void(v1::GenerateRequest&)>& edit,
                   const std::string& field_prefix) {
  v1::GenerateRequest r = Good();
  edit(r);
  absl::Status s = ValidateGenerateRequest(r, Limits());
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_EQ(s.message().rfind(field_prefix, 0), 0u) << s;
}

TEST(GenerateValidation, AcceptsGoodRequests) {
  EXPECT_TRUE(ValidateGenerateRequest(Good(), Limits()).ok());
  v1::GenerateRequest r = Good();
  r.mutable_sampling_params()->set_temperature(0.f);
  r.mutable_sampling_params()->set_top_p(1.f);
  r.mutable_sampling_params()->set_top_k(0);
  r.set_data_parallel_rank(1);
  EXPECT_TRUE(ValidateGenerateRequest(r, Limits()).ok());
}

// Every new sampling field at the edges of its domain.
TEST(GenerateValidation, AcceptsSamplingFeaturesAtTheirEdges) {
  for (float low : {0.f, -2.f}) {
    v1::GenerateRequest r = Good();
    v1::SamplingParams* p = r.mutable_sampling_params();
    p->set_min_p(low == 0.f ? 0.f : 1.f);
    p->set_frequency_penalty(low);
    p->set_presence_penalty(-low);
    p->set_repetition_penalty(low == 0.f ? 1e-3f : 1e3f);
    (*p->mutable_logit_bias())[0] = -100.f;
    (*p->mutable_logit_bias())[99] = 100.f;
    p->set_min_new_tokens(30);  // = max_new_tokens
    p->set_logprobs(true);
    p->set_top_logprobs(20);
    for (uint32_t id = 0; id < 128; ++id) p->add_logprob_token_ids(id % 100);
    p->add_stop_token_ids(99);
    p->set_prompt_logprobs_start(low == 0.f ? 0 : 1);  // the prompt has 2 tokens
    absl::Status s = ValidateGenerateRequest(r, Limits());
    EXPECT_TRUE(s.ok()) << s;
  }
  // n: 0 (unset) means 1; 1 and 64 are the edges.
  for (uint32_t n : {0u, 1u, 2u, 64u}) {
    v1::GenerateRequest r = Good();
    r.mutable_sampling_params()->set_n(n);
    r.mutable_sampling_params()->set_temperature(0.9f);
    r.mutable_sampling_params()->set_seed(7);
    EXPECT_TRUE(ValidateGenerateRequest(r, Limits()).ok()) << "n " << n;
  }
  // Prompt scoring alone: no tokens to generate.
  v1::GenerateRequest r = Good();
  r.mutable_sampling_params()->set_max_new_tokens(0);
  r.mutable_sampling_params()->set_prompt_logprobs_start(1);
  EXPECT_TRUE(ValidateGenerateRequest(r, Limits()).ok());
}

TEST(GenerateValidation, RefusesEachBadField) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const float inf = std::numeric_limits<float>::infinity();
  ExpectRefused([](auto& r) { r.clear_prompt_token_ids(); }, "prompt_token_ids:");
  ExpectRefused([](auto& r) { r.set_prompt_token_ids(1, 100); }, "prompt_token_ids[1]:");
  ExpectRefused([](auto& r) { r.set_prompt_token_ids(0, 0xffffffffu); }, "prompt_token_ids[0]:");
  ExpectRefused([](auto& r) { r.mutable_sampling_params()->set_max_new_tokens(0); },
                "sampling_params.max_new_tokens:");
  ExpectRefused([](auto& r) { r.mutable_sampling_params()->set_max_new_tokens(-3); },
                "sampling_params.max_new_tokens:");
  ExpectRefused([](auto& r) { r.clear_sampling_params(); }, "sampling_params.max_new_tokens:");
  ExpectRefused([](auto& r) { r.mutable_sampling_params()->set_max_new_tokens(31); },
                "sampling_params.max_new_tokens:");
  for (float t : {-0.5f, nan, inf, -inf}) {
    ExpectRefused([t](auto& r) { r.mutable_sampling_params()->set_temperature(t); },
                  "sampling_params.temperature:");
  }
  for (float p : {0.f, -0.1f, 1.01f, nan, inf}) {
    ExpectRefused([p](auto& r) { r.mutable_sampling_params()->set_top_p(p); },
                  "sampling_params.top_p:");
  }
  ExpectRefused([](auto& r) { r.mutable_sampling_params()->set_top_k(-1); },
                "sampling_params.top_k:");
  // The sampling features: every bad value is named, never clamped.
  for (float m : {-0.1f, 1.01f, nan, inf}) {
    ExpectRefused([m](auto& r) { r.mutable_sampling_params()->set_min_p(m); },
                  "sampling_params.min_p:");
  }
  for (float f : {-2.01f, 2.01f, nan, inf, -inf}) {
    ExpectRefused([f](auto& r) { r.mutable_sampling_params()->set_frequency_penalty(f); },
                  "sampling_params.frequency_penalty:");
    ExpectRefused([f](auto& r) { r.mutable_sampling_params()->set_presence_penalty(f); },
                  "sampling_params.presence_penalty:");
  }
  for (float rp : {0.f, -1.f, nan, inf}) {
    ExpectRefused([rp](auto& r) { r.mutable_sampling_params()->set_repetition_penalty(rp); },
                  "sampling_params.repetition_penalty:");
  }
  ExpectRefused([](auto& r) { (*r.mutable_sampling_params()->mutable_logit_bias())[100] = 1.f; },
                "sampling_params.logit_bias[100]:");
  for (float b : {-100.5f, 100.5f, nan, inf}) {
    ExpectRefused([b](auto& r) { (*r.mutable_sampling_params()->mutable_logit_bias())[7] = b; },
                  "sampling_params.logit_bias[7]:");
  }
  ExpectRefused([](auto& r) { r.mutable_sampling_params()->set_min_new_tokens(31); },
                "sampling_params.min_new_tokens:");
  ExpectRefused([](auto& r) { r.mutable_sampling_params()->set_top_logprobs(21); },
                "sampling_params.top_logprobs:");
  ExpectRefused(
      [](auto& r) {
        for (int i = 0; i < 129; ++i) r.mutable_sampling_params()->add_logprob_token_ids(1);
      },
      "sampling_params.logprob_token_ids:");
  ExpectRefused(
      [](auto& r) {
        r.mutable_sampling_params()->add_logprob_token_ids(3);
        r.mutable_sampling_params()->add_logprob_token_ids(100);
      },
      "sampling_params.logprob_token_ids[1]:");
  ExpectRefused([](auto& r) { r.mutable_sampling_params()->set_prompt_logprobs_start(2); },
                "sampling_params.prompt_logprobs_start:");
  ExpectRefused([](auto& r) { r.mutable_sampling_params()->add_stop_token_ids(100); },
                "sampling_params.stop_token_ids[0]:");
  ExpectRefused(
      [](auto& r) {
        r.mutable_sampling_params()->set_max_new_tokens(0);
        r.mutable_sampling_params()->set_min_new_tokens(1);
        r.mutable_sampling_params()->set_prompt_logprobs_start(0);
      },
      "sampling_params.min_new_tokens:");
  for (uint32_t n : {65u, 1000u, 0xffffffffu}) {
    ExpectRefused([n](auto& r) { r.mutable_sampling_params()->set_n(n); }, "sampling_params.n:");
  }
  ExpectRefused([](auto& r) { r.set_data_parallel_rank(2); }, "data_parallel_rank:");
  ExpectRefused([](auto& r) { r.set_request_id(std::string(257, 'x')); }, "request_id:");
}

TEST(GenerateValidation, ContextMessageGivesTheNumbers) {
  v1::GenerateRequest r = Good();
  r.mutable_sampling_params()->set_max_new_tokens(40);
  absl::Status s = ValidateGenerateRequest(r, Limits());
  EXPECT_NE(s.message().find("(2)"), std::string::npos) << s;
  EXPECT_NE(s.message().find("(40)"), std::string::npos) << s;
  EXPECT_NE(s.message().find("context length 32"), std::string::npos) << s;
}

// The context bound is per sample: each of n samples is its own sequence after the shared
// prompt, so n does not multiply it.
TEST(GenerateValidation, ContextLengthIsPerSample) {
  v1::GenerateRequest r = Good();  // 2 + 30 = 32, exactly the context
  r.mutable_sampling_params()->set_n(64);
  EXPECT_TRUE(ValidateGenerateRequest(r, Limits()).ok());
  r.mutable_sampling_params()->set_n(65);
  absl::Status s = ValidateGenerateRequest(r, Limits());
  EXPECT_NE(s.message().find("[1, 64]"), std::string::npos) << s;
  EXPECT_NE(s.message().find("got 65"), std::string::npos) << s;
}

}  // namespace
}  // namespace dxs
