#include "model/engine.h"

#include <algorithm>
#include <numeric>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "model/weights.h"

namespace dxs {

const char* FinishReasonName(FinishReason r) {
  switch (r) {
    case FinishReason::kLength:
      return "length";
    case FinishReason::kEos:
      return "eos";
    case FinishReason::kStopToken:
      return "stop_token";
  }
  return "unknown";
}

absl::StatusOr<std::unique_ptr<LocalEngine>> LocalEngine::Load(const std::string& model_dir,
                                                               const EngineOptions& options) {
  std::unique_ptr<LocalEngine> e(new LocalEngine());
  e->options_ = options;
  DXS_ASSIGN_OR_RETURN(e->config_, LoadModelConfig(model_dir));
  DXS_ASSIGN_OR_RETURN(std::unique_ptr<Checkpoint> ckpt, Checkpoint::Open(model_dir));
  e->backend_ = MakeCpuBackend();
  DXS_ASSIGN_OR_RETURN(AttentionWeights aw,
                       LoadAttentionWeights(*ckpt, e->config_, e->backend_.get()));
  std::vector<int> all_experts(e->config_.num_experts);
  std::iota(all_experts.begin(), all_experts.end(), 0);
  DXS_ASSIGN_OR_RETURN(ExpertWeightMap ew,
                       LoadExpertWeights(*ckpt, e->config_, all_experts, e->backend_.get()));
  e->experts_ = std::make_unique<ExpertShard>(e->config_, std::move(ew), e->backend_.get());
  e->moe_ = std::make_unique<LocalMoeExecutor>(e->experts_.get());
  e->model_ = std::make_unique<Qwen3MoeModel>(e->config_, std::move(aw), e->backend_.get(),
                                              e->moe_.get());
  e->kv_ = std::make_unique<KvCache>(e->config_, e->backend_.get(), options.kv_capacity_tokens);
  return e;
}

absl::Status LocalEngine::ValidateRequest(const GenerationRequest& r) const {
  if (r.prompt.empty()) return absl::InvalidArgumentError("prompt: must not be empty");
  for (int32_t id : r.prompt) {
    if (id < 0 || id >= config_.vocab_size) {
      return absl::InvalidArgumentError(absl::StrCat(
          "prompt: token id ", id, " is outside the vocabulary [0, ", config_.vocab_size, ")"));
    }
  }
  if (r.max_new_tokens <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("max_new_tokens: must be positive, got ", r.max_new_tokens));
  }
  const int64_t total = static_cast<int64_t>(r.prompt.size()) + r.max_new_tokens;
  if (total > config_.max_position_embeddings) {
    return absl::InvalidArgumentError(absl::StrCat(
        "max_new_tokens: prompt (", r.prompt.size(), ") + max_new_tokens (", r.max_new_tokens,
        ") exceeds the context length ", config_.max_position_embeddings));
  }
  return ValidateSamplingParams(r.sampling);
}

absl::StatusOr<std::vector<GenerationResult>> LocalEngine::GenerateBatch(
    const std::vector<GenerationRequest>& requests) {
  for (const GenerationRequest& r : requests) DXS_RETURN_IF_ERROR(ValidateRequest(r));
  struct Live {
    int slot = -1;
    int64_t prefilled = 0;  // prompt tokens already in the KV cache
    bool done = false;
    Sampler sampler;
  };
  std::vector<Live> live;
  std::vector<GenerationResult> results(requests.size());
  auto release = [&]() {
    for (Live& l : live) {
      if (l.slot >= 0) kv_->Free(l.slot);
    }
  };
  for (const GenerationRequest& r : requests) {
    absl::StatusOr<int> slot =
        kv_->Allocate(static_cast<int64_t>(r.prompt.size()) + r.max_new_tokens);
    if (!slot.ok()) {
      release();
      return slot.status();
    }
    live.push_back(Live{*slot, 0, false, Sampler(r.sampling)});
  }
  const int64_t chunk_limit = options_.prefill_chunk_tokens;
  while (true) {
    std::vector<SequenceChunk> chunks;
    std::vector<size_t> owners;
    for (size_t i = 0; i < requests.size(); ++i) {
      Live& l = live[i];
      if (l.done) continue;
      const GenerationRequest& r = requests[i];
      SequenceChunk c;
      c.kv_slot = l.slot;
      const int64_t prompt_len = static_cast<int64_t>(r.prompt.size());
      if (l.prefilled < prompt_len) {
        int64_t n = prompt_len - l.prefilled;
        if (chunk_limit > 0) n = std::min(n, chunk_limit);
        c.start_position = l.prefilled;
        c.tokens.assign(r.prompt.begin() + l.prefilled, r.prompt.begin() + l.prefilled + n);
        l.prefilled += n;
      } else {
        c.start_position = prompt_len + static_cast<int64_t>(results[i].tokens.size()) - 1;
        c.tokens = {results[i].tokens.back()};
      }
      chunks.push_back(std::move(c));
      owners.push_back(i);
    }
    if (chunks.empty()) break;
    absl::StatusOr<Tensor> logits = model_->Forward(chunks, kv_.get());
    if (!logits.ok()) {
      release();
      return logits.status();
    }
    const int64_t vocab = config_.vocab_size;
    for (size_t j = 0; j < owners.size(); ++j) {
      const size_t i = owners[j];
      const GenerationRequest& r = requests[i];
      Live& l = live[i];
      if (l.prefilled < static_cast<int64_t>(r.prompt.size())) continue;  // mid-prefill
      const float* row = logits->f32() + static_cast<int64_t>(j) * vocab;
      GenerationResult& out = results[i];
      if (out.tokens.empty()) out.first_logits.assign(row, row + vocab);
      const int32_t token = l.sampler.Sample(row, vocab);
      out.tokens.push_back(token);
      const auto& eos = config_.eos_token_ids;
      if (!r.ignore_eos && std::find(eos.begin(), eos.end(), token) != eos.end()) {
        out.finish_reason = FinishReason::kEos;
        l.done = true;
      } else if (std::find(r.stop_token_ids.begin(), r.stop_token_ids.end(), token) !=
                 r.stop_token_ids.end()) {
        out.finish_reason = FinishReason::kStopToken;
        l.done = true;
      } else if (static_cast<int64_t>(out.tokens.size()) >= r.max_new_tokens) {
        out.finish_reason = FinishReason::kLength;
        l.done = true;
      }
      if (l.done) {
        kv_->Free(l.slot);
        l.slot = -1;
      }
    }
  }
  return results;
}

}  // namespace dxs
