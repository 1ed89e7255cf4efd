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

}  // namespace
}  // namespace dxs
