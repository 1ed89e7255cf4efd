// LocalEngine: the single-process Qwen3-MoE engine (all experts local) and its
// generation loop. It is the correctness reference the disaggregated cluster is held to,
// the runner behind `dxs run`, and what the benchmarks time.
//
// GenerateBatch runs requests together through the same Scheduler the attention worker
// uses: prompts are prefilled (optionally in chunks of prefill_chunk_tokens), then every
// live sequence decodes one token per step until it hits EOS, a stop id or max_new_tokens.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "common/model_config.h"
#include "common/safetensors.h"
#include "kernels/backend.h"
#include "model/expert_shard.h"
#include "model/kv_cache.h"
#include "model/local_moe_executor.h"
#include "model/qwen3_moe.h"
#include "model/random_checkpoint.h"
#include "model/sampler.h"
#include "model/scheduler.h"

namespace dxs {

struct GenerationResult {
  std::vector<int32_t> tokens;
  std::vector<float> first_logits;  // logits of the first generated position
  FinishReason finish_reason = FinishReason::kLength;
  // One per token, when the request asked (GenerationRequest::WantsLogprobs).
  std::vector<TokenLogprobs> logprobs;
  // When the request scored its prompt (prompt_logprobs_start >= 0).
  std::optional<PromptLogprobs> prompt_logprobs;
  // With n > 1: samples 1..n-1 (this result is sample 0).
  std::vector<GenerationResult> samples;
};

struct EngineOptions {
  int64_t kv_capacity_tokens = 1 << 20;
  int64_t prefill_chunk_tokens = 0;  // 0: whole prompt in one step
  // Where to compute (kernels/make_backend.h): cpu, cuda or cuda:N.
  std::string device = "cpu";
  // Decode steps through recorded graphs where the backend has them (CUDA graphs, per batch
  // bucket: Qwen3MoeModel::ForwardDecode); false runs every step eagerly (vLLM's
  // --enforce-eager).
  bool graphs = true;
  // Overlap scheduling (Scheduler::CanStepAhead; SGLang's overlap scheduler, vLLM's async
  // scheduling): a decode step is queued on the device behind the one running, its input
  // tokens taken there from that step's samples, and the host streams the running step's
  // tokens, checks its stops and builds the next while the device computes. The same tokens
  // as without; a sequence that stops has one more token computed and discarded. false: every
  // step waits for its tokens before the next is built (the A/B baseline).
  bool overlap_schedule = true;
  // The compute backend, overriding `device` (tests: the opaque backend).
  std::function<std::unique_ptr<Backend>()> backend_factory;
  // The model's MoE, overriding the local experts: then no expert is loaded here and
  // experts() must not be called (tests: remote experts over the low-latency exchange).
  std::function<absl::StatusOr<std::unique_ptr<MoeExecutor>>(const ModelConfig&, Backend*)>
      moe_factory;
};

class LocalEngine {
 public:
  static absl::StatusOr<std::unique_ptr<LocalEngine>> Load(const std::string& model_dir,
                                                           const EngineOptions& options = {});
  // A random preset (model/random_checkpoint.h) made in place on the backend: the same
  // weights as Load on the checkpoint WriteRandomCheckpoint writes, without the disk.
  static absl::StatusOr<std::unique_ptr<LocalEngine>> LoadRandom(const CheckpointPreset& preset,
                                                                 const EngineOptions& options = {});
  // `config`'s model from any weight source (benchmarks: weights made for a measurement).
  static absl::StatusOr<std::unique_ptr<LocalEngine>> LoadWeights(
      const ModelConfig& config, const WeightSource& weights, const EngineOptions& options = {});

  const ModelConfig& config() const { return config_; }
  Qwen3MoeModel& model() { return *model_; }
  // Every expert, and its per-expert token counts (all layers); not with a moe_factory.
  ExpertShard& experts() { return *experts_; }
  Backend* backend() { return backend_.get(); }

  absl::StatusOr<std::vector<GenerationResult>> GenerateBatch(
      const std::vector<GenerationRequest>& requests);
  // Prompt tokens prefilled by GenerateBatch so far (a request with n samples counts once).
  int64_t prefill_tokens() const { return prefill_tokens_; }

  // One step of `scheduler`'s batch (a scheduler over this engine's KV cache): builds it,
  // runs the forward pass, samples, and hands each sequence its token. A failed step fails
  // every live request of `scheduler` and returns why. With overlap_schedule, a decode step
  // may return queued on the device: the next call queues the one after it (built ahead)
  // and then hands out its tokens; the scheduler has work (HasWork) until they are out.
  absl::Status RunStep(Scheduler& scheduler);
  // Waits for the step RunStep left queued (if any) and forgets it, its tokens unread: for
  // a scheduler that is going away (LocalServer's end) before it had them.
  void DropInFlightStep();
  // Decode steps queued behind another (overlap_schedule), since the engine was made.
  int64_t overlapped_steps() const { return overlapped_steps_; }

 private:
  friend class LocalServer;
  LocalEngine() = default;
  static absl::StatusOr<std::unique_ptr<LocalEngine>> Create(const ModelConfig& config,
                                                             const WeightSource& weights,
                                                             const EngineOptions& options);
  // Forward pass and device sampling of `chunks`, its tokens' copy to the host queued:
  // in_flight_. input_ids: the chunks' tokens on the device (a step built ahead).
  absl::Status LaunchStep(Scheduler& scheduler, const std::vector<SequenceChunk>& chunks,
                          bool graphed, const Tensor* input_ids);
  // RunStep with a step in flight: queues the step after it when it can be built ahead,
  // then hands out the in-flight step's tokens.
  absl::Status FinishInFlightStep(Scheduler& scheduler);

  EngineOptions options_;
  ModelConfig config_;
  std::unique_ptr<Backend> backend_;
  std::unique_ptr<ExpertShard> experts_;
  std::unique_ptr<MoeExecutor> moe_;
  std::unique_ptr<Qwen3MoeModel> model_;
  std::unique_ptr<KvCache> kv_;
  int64_t prefill_tokens_ = 0;
  // A step queued on the device whose tokens the host has not taken (overlap_schedule), and
  // the scheduler it is a step of.
  std::optional<StepTokenDownloads::Step> in_flight_;
  Scheduler* in_flight_scheduler_ = nullptr;
  std::optional<StepTokenDownloads> downloads_;  // made with the backend
  int64_t overlapped_steps_ = 0;
};

}  // namespace dxs
