// DecodeSamplingEqualsSamplingAfterTheStep: a decode step's sampling inside
// Qwen3MoeModel::ForwardDecode (recorded in its graph with `use_graph` on a backend that has
// graphs) equals the same sampling run afterwards on the logits the step returned: the
// same ids and log-probabilities, bit for bit. Steps of 3 sequences (padded to 4) with
// greedy rows with every adjustment, seeded rows with min_p and penalties, plain rows; with
// and without log-probabilities; the adjustment lists grow step by step past the graphs'
// capacities (1024, 2048, ...), so new graphs are recorded mid-run. Shared by decode_sampling_test
// (CPU, eager) and cuda_engine_test (CUDA, graphs).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/sampling.h"
#include "model/engine.h"
#include "model/step_sampling.h"

namespace dxs::testing {

inline void DecodeSamplingEqualsSamplingAfterTheStep(LocalEngine* engine, bool use_graph) {
  Backend* b = engine->backend();
  Qwen3MoeModel& model = engine->model();
  const int64_t vocab = engine->config().vocab_size;
  KvCache kv(engine->config(), b, 4096);
  const int batch = 3;
  std::vector<SequenceChunk> chunks(batch);
  for (int s = 0; s < batch; ++s) {
    chunks[s].kv_slot = *kv.Allocate(200);
    for (int i = 0; i < 9 + 4 * s; ++i) chunks[s].tokens.push_back(3 + (s * 31 + i * 17) % 400);
  }
  ASSERT_TRUE(model.Forward(chunks, &kv).ok());
  for (int step = 0; step < 8; ++step) {
    SCOPED_TRACE(::testing::Message() << "step " << step);
    for (int s = 0; s < batch; ++s) {
      chunks[s].start_position += static_cast<int64_t>(chunks[s].tokens.size());
      chunks[s].tokens = {static_cast<int32_t>(7 + (step * 13 + s) % 300)};
    }
    StepSamplingPlan plan;
    const bool logprobs = step % 2 == 1;
    plan.logprobs = {logprobs, logprobs ? 5 : 0, logprobs ? 2 : 0};
    // Row 0 greedy with penalties, a bias and a banned id; row 1 seeded with min_p and
    // penalties; row 2 plain sampling. Rows 0 and 1's lists grow 300 entries a step.
    for (int s = 0; s < batch; ++s) {
      SamplingParams p;
      if (s == 0) {
        p.repetition_penalty = 1.3f;
        p.frequency_penalty = 0.5f;
      } else {
        p.temperature = 0.8f;
        p.top_p = 0.95f;
        p.seed = 77 + s;
        if (s == 1) {
          p.min_p = 0.05f;
          p.presence_penalty = 0.25f;
        }
      }
      const int32_t begin = static_cast<int32_t>(plan.adjustments.size());
      if (s < 2) {
        for (int i = 0; i < 300 * (step + 1) && i < vocab; ++i) {
          LogitAdjustment a{};
          a.token = static_cast<int32_t>((i * 7 + s) % vocab);
          a.output_count = i % 3;
          a.bias = i % 5 == 0 ? 1.5f : 0.f;
          a.flags = kAdjustSeen | (i == 1 ? kAdjustBanned : 0u);
          bool dup = false;  // a row's adjustments name distinct tokens
          for (int32_t k = begin; k < static_cast<int32_t>(plan.adjustments.size()); ++k) {
            dup = dup || plan.adjustments[k].token == a.token;
          }
          if (!dup) plan.adjustments.push_back(a);
        }
      }
      plan.rows.push_back(ToSamplingRow(p, static_cast<uint64_t>(step), begin,
                                        static_cast<int32_t>(plan.adjustments.size()) - begin));
      for (int64_t k = 0; k < plan.logprobs.named; ++k) {
        plan.named_ids.push_back(static_cast<int32_t>((s * 5 + k * 11) % vocab));
      }
    }
    StepSamplingOutputs in_step;
    absl::StatusOr<Tensor> logits = model.ForwardDecode(chunks, &kv, use_graph, &plan, &in_step);
    ASSERT_TRUE(logits.ok()) << logits.status();
    absl::StatusOr<StepTokens> got = DownloadStepTokens(b, in_step, plan.logprobs);
    ASSERT_TRUE(got.ok()) << got.status();
    // The same plan sampled after the step, from the logits it returned.
    Tensor params = *b->Allocate({batch, kSamplingRowWords}, DType::kI64);
    ASSERT_TRUE(b->CopyFromHost(plan.rows.data(), DType::kI64, &params).ok());
    Tensor adjust = *b->Allocate(
        {static_cast<int64_t>(plan.adjustments.size()), kLogitAdjustmentWords}, DType::kI32);
    ASSERT_TRUE(b->CopyFromHost(plan.adjustments.data(), DType::kI32, &adjust).ok());
    Tensor named = *b->Allocate({batch, plan.logprobs.named}, DType::kI32);
    if (plan.logprobs.named > 0) {
      ASSERT_TRUE(b->CopyFromHost(plan.named_ids.data(), DType::kI32, &named).ok());
    }
    absl::StatusOr<StepSamplingOutputs> after =
        AllocateStepSamplingOutputs(b, batch, plan.logprobs);
    ASSERT_TRUE(after.ok());
    ASSERT_TRUE(
        EnqueueStepSampling(b, *logits, false, &params, &adjust, &named, plan.logprobs, &*after)
            .ok());
    absl::StatusOr<StepTokens> want = DownloadStepTokens(b, *after, plan.logprobs);
    ASSERT_TRUE(want.ok()) << want.status();
    EXPECT_EQ(got->tokens, want->tokens);
    ASSERT_EQ(got->logprobs.size(), want->logprobs.size());
    for (size_t r = 0; r < want->logprobs.size(); ++r) {
      EXPECT_EQ(got->logprobs[r].logprob, want->logprobs[r].logprob) << r;
      EXPECT_EQ(got->logprobs[r].top, want->logprobs[r].top) << r;
      EXPECT_EQ(got->logprobs[r].named, want->logprobs[r].named) << r;
    }
    for (int s = 0; s < batch; ++s) chunks[s].tokens = {got->tokens[s]};
  }
}

}  // namespace dxs::testing
