#include "model/engine.h"

#include <algorithm>
#include <numeric>
#include <optional>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "kernels/make_backend.h"
#include "model/weights.h"

namespace dxs {

absl::StatusOr<std::unique_ptr<LocalEngine>> LocalEngine::Load(const std::string& model_dir,
                                                               const EngineOptions& options) {
  DXS_ASSIGN_OR_RETURN(const ModelConfig config, LoadModelConfig(model_dir));
  // Safetensors, or an in-place recipe (model/random_checkpoint.h) made on the backend.
  DXS_ASSIGN_OR_RETURN(std::unique_ptr<WeightSource> weights, OpenWeightSource(model_dir));
  return Create(config, *weights, options);
}

absl::StatusOr<std::unique_ptr<LocalEngine>> LocalEngine::LoadRandom(const CheckpointPreset& preset,
                                                                     const EngineOptions& options) {
  DXS_RETURN_IF_ERROR(preset.config.Validate());
  return Create(preset.config, RandomWeightSource(preset), options);
}

absl::StatusOr<std::unique_ptr<LocalEngine>> LocalEngine::LoadWeights(
    const ModelConfig& config, const WeightSource& weights, const EngineOptions& options) {
  DXS_RETURN_IF_ERROR(config.Validate());
  return Create(config, weights, options);
}

absl::StatusOr<std::unique_ptr<LocalEngine>> LocalEngine::Create(const ModelConfig& config,
                                                                 const WeightSource& weights,
                                                                 const EngineOptions& options) {
  std::unique_ptr<LocalEngine> e(new LocalEngine());
  e->options_ = options;
  e->config_ = config;
  if (options.backend_factory) {
    e->backend_ = options.backend_factory();
  } else {
    DXS_ASSIGN_OR_RETURN(e->backend_, MakeBackend(options.device));
  }
  DXS_ASSIGN_OR_RETURN(AttentionWeights aw,
                       LoadAttentionWeights(weights, e->config_, e->backend_.get()));
  if (options.moe_factory) {
    DXS_ASSIGN_OR_RETURN(e->moe_, options.moe_factory(e->config_, e->backend_.get()));
  } else {
    std::vector<int> all_experts(e->config_.num_experts);
    std::iota(all_experts.begin(), all_experts.end(), 0);
    DXS_ASSIGN_OR_RETURN(ExpertWeightMap ew,
                         LoadExpertWeights(weights, e->config_, all_experts, e->backend_.get()));
    e->experts_ = std::make_unique<ExpertShard>(e->config_, std::move(ew), e->backend_.get());
    e->moe_ = std::make_unique<LocalMoeExecutor>(e->experts_.get());
  }
  e->model_ =
      std::make_unique<Qwen3MoeModel>(e->config_, std::move(aw), e->backend_.get(), e->moe_.get());
  e->kv_ = std::make_unique<KvCache>(e->config_, e->backend_.get(), options.kv_capacity_tokens);
  e->downloads_.emplace(e->backend_.get());
  return e;
}

absl::StatusOr<std::vector<GenerationResult>> LocalEngine::GenerateBatch(
    const std::vector<GenerationRequest>& requests) {
  // All-or-nothing: a bad request fails the batch before any work.
  for (const GenerationRequest& r : requests) DXS_RETURN_IF_ERROR(ValidateRequest(config_, r));
  Scheduler scheduler(config_, kv_.get(), {options_.prefill_chunk_tokens});
  std::vector<GenerationResult> results(requests.size());
  absl::Status first_error;
  const int64_t vocab = config_.vocab_size;
  // A sink writing into `out`.
  auto sink_into = [vocab, &first_error](GenerationResult* out) {
    TokenSink sink;
    sink.on_token = [out, vocab](int32_t token, const float* logits) {
      if (out->tokens.empty()) out->first_logits.assign(logits, logits + vocab);
      out->tokens.push_back(token);
    };
    sink.on_logprobs = [out](const TokenLogprobs& lp) { out->logprobs.push_back(lp); };
    sink.on_prompt_logprobs = [out](const PromptLogprobs& lp) { out->prompt_logprobs = lp; };
    sink.on_done = [out, &first_error](const absl::Status& s, FinishReason reason) {
      out->finish_reason = reason;
      if (!s.ok() && first_error.ok()) first_error = s;
    };
    return sink;
  };
  for (size_t i = 0; i < requests.size(); ++i) {
    GenerationResult* out = &results[i];
    out->samples.resize(requests[i].n - 1);  // before any sink holds a pointer into it
    TokenSink sink = sink_into(out);
    sink.sample_sink = [out, sink_into](int32_t sample) {
      return sink_into(&out->samples[sample - 1]);
    };
    DXS_RETURN_IF_ERROR(scheduler.Add(i, requests[i], std::move(sink)));
  }
  while (scheduler.HasWork()) DXS_RETURN_IF_ERROR(RunStep(scheduler));
  prefill_tokens_ += scheduler.prefill_tokens();
  DXS_RETURN_IF_ERROR(first_error);
  return results;
}

absl::Status LocalEngine::LaunchStep(Scheduler& scheduler, const std::vector<SequenceChunk>& chunks,
                                     bool graphed, const Tensor* input_ids) {
  const StepSamplingPlan plan = scheduler.PlanStepSampling();
  StepSamplingOutputs outputs;
  if (graphed) {
    DXS_RETURN_IF_ERROR(
        model_->ForwardDecode(chunks, kv_.get(), true, &plan, &outputs, input_ids).status());
  } else {
    DXS_ASSIGN_OR_RETURN(Tensor logits, model_->Forward(chunks, kv_.get(), 1, input_ids));
    DXS_ASSIGN_OR_RETURN(outputs,
                         EnqueueStepSamplingOnBackend(backend_.get(), logits, plan, input_ids));
  }
  DXS_ASSIGN_OR_RETURN(in_flight_, downloads_->Launch(std::move(outputs), plan.logprobs));
  in_flight_scheduler_ = &scheduler;
  return absl::OkStatus();
}

void LocalEngine::DropInFlightStep() { downloads_->Drop(&in_flight_); }

absl::Status LocalEngine::FinishInFlightStep(Scheduler& scheduler) {
  if (in_flight_scheduler_ != &scheduler) {
    return absl::FailedPreconditionError(
        "a step of another scheduler is in flight (LocalEngine::DropInFlightStep first)");
  }
  std::optional<StepTokenDownloads::Step> step = std::move(in_flight_);
  in_flight_.reset();
  if (options_.overlap_schedule && scheduler.CanStepAhead()) {
    // The next step goes in behind it, before the host looks at its tokens.
    const std::vector<SequenceChunk> chunks = scheduler.BuildStepAhead();
    const bool graphed = options_.graphs && backend_->SupportsGraphs();
    if (absl::Status s = LaunchStep(scheduler, chunks, graphed, &step->outputs.ids); !s.ok()) {
      downloads_->Drop(&step);
      scheduler.FailAll(s);
      return s;
    }
    ++overlapped_steps_;
  }
  absl::StatusOr<StepTokens> tokens = downloads_->Read(*step);
  if (!tokens.ok()) {
    DropInFlightStep();
    scheduler.FailAll(tokens.status());
    return tokens.status();
  }
  scheduler.FinishStepWithTokens(*tokens);
  return absl::OkStatus();
}

absl::Status LocalEngine::RunStep(Scheduler& scheduler) {
  if (in_flight_) return FinishInFlightStep(scheduler);
  std::vector<SequenceChunk> chunks = scheduler.BuildStep();
  const bool decode = Qwen3MoeModel::IsDecodeStep(chunks);
  const bool graphed = options_.graphs && backend_->SupportsGraphs() && decode;
  if (decode && !scheduler.StepNeedsHostLogits() && !scheduler.StepSamplesOnHost()) {
    // A decode step past every request's first token: sampled on the device (inside the
    // step's graph where there is one); only the ids and asked-for log-probabilities come
    // back. With overlap scheduling it stays queued when the next step can go in behind
    // it (the next call does that, then takes these tokens); otherwise they are taken now.
    if (absl::Status s = LaunchStep(scheduler, chunks, graphed, nullptr); !s.ok()) {
      scheduler.FailAll(s);
      return s;
    }
    if (options_.overlap_schedule && scheduler.CanStepAhead()) return absl::OkStatus();
    return FinishInFlightStep(scheduler);
  }
  absl::StatusOr<Tensor> logits =
      graphed ? model_->ForwardDecode(chunks, kv_.get(), true) : model_->Forward(chunks, kv_.get());
  if (!logits.ok()) {
    scheduler.FailAll(logits.status());
    return logits.status();
  }
  // Steps past every request's first token sample on the backend, greedy or not: a few
  // ids come back instead of [rows, vocab] floats (39 MB a step at batch 64 on Qwen3's
  // vocab). The CPU takes the same path, so its tests cover it.
  // A request's first token is sampled there too (unless its samples fork, or the step
  // scores prompt positions), and the step's rows come to the host besides (its sink
  // receives the first token's row).
  std::optional<Scheduler::StepTokens> tokens;
  if (!scheduler.StepSamplesOnHost()) {
    absl::StatusOr<Scheduler::StepTokens> t =
        SampleStepOnBackend(backend_.get(), *logits, scheduler);
    if (!t.ok()) {
      scheduler.FailAll(t.status());
      return t.status();
    }
    tokens = *std::move(t);
  }
  if (tokens && !scheduler.StepNeedsHostLogits()) {
    scheduler.FinishStepWithTokens(*tokens);
    return absl::OkStatus();
  }
  absl::StatusOr<std::vector<float>> host = backend_->Download(*logits);
  if (!host.ok()) {
    scheduler.FailAll(host.status());
    return host.status();
  }
  scheduler.FinishStep(*host, tokens ? &*tokens : nullptr);
  return absl::OkStatus();
}

}  // namespace dxs
