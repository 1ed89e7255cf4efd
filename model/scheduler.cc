#include "model/scheduler.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"

namespace dxs {

const char* FinishReasonName(FinishReason r) {
  switch (r) {
    case FinishReason::kLength:
      return "length";
    case FinishReason::kEos:
      return "eos";
    case FinishReason::kStopToken:
      return "stop_token";
    case FinishReason::kAborted:
      return "aborted";
  }
  return "unknown";
}

absl::Status ValidateRequest(const ModelConfig& config, const GenerationRequest& r) {
  if (r.prompt.empty()) return absl::InvalidArgumentError("prompt: must not be empty");
  for (int32_t id : r.prompt) {
    if (id < 0 || id >= config.vocab_size) {
      return absl::InvalidArgumentError(absl::StrCat(
          "prompt: token id ", id, " is outside the vocabulary [0, ", config.vocab_size, ")"));
    }
  }
  if (r.max_new_tokens <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("max_new_tokens: must be positive, got ", r.max_new_tokens));
  }
  const int64_t total = static_cast<int64_t>(r.prompt.size()) + r.max_new_tokens;
  if (total > config.max_position_embeddings) {
    return absl::InvalidArgumentError(absl::StrCat(
        "max_new_tokens: prompt (", r.prompt.size(), ") + max_new_tokens (", r.max_new_tokens,
        ") exceeds the context length ", config.max_position_embeddings));
  }
  return ValidateSamplingParams(r.sampling);
}

Scheduler::Scheduler(const ModelConfig& config, KvCache* kv, SchedulerOptions options)
    : config_(config), kv_(kv), options_(options) {}

absl::Status Scheduler::Add(uint64_t id, GenerationRequest request, TokenSink sink) {
  if (absl::Status s = ValidateRequest(config_, request); !s.ok()) return s;
  const int64_t need = static_cast<int64_t>(request.prompt.size()) + request.max_new_tokens;
  if (need > kv_->capacity_tokens()) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "request needs ", need, " KV tokens; the cache holds ", kv_->capacity_tokens()));
  }
  absl::MutexLock lock(&mu_);
  if (!known_ids_.insert(id).second) {
    return absl::AlreadyExistsError(absl::StrCat("request id ", id, " is already in flight"));
  }
  queued_.emplace_back(id, std::move(request), std::move(sink));
  queued_tokens_ += need;
  return absl::OkStatus();
}

bool Scheduler::Abort(uint64_t id) {
  absl::MutexLock lock(&mu_);
  if (!known_ids_.count(id)) return false;
  aborts_.push_back(id);
  return true;
}

bool Scheduler::HasWork() {
  absl::MutexLock lock(&mu_);
  return !running_.empty() || !queued_.empty() || !aborts_.empty();
}

size_t Scheduler::num_running() {
  absl::MutexLock lock(&mu_);
  return num_running_;
}

size_t Scheduler::num_queued() {
  absl::MutexLock lock(&mu_);
  return queued_.size();
}

void Scheduler::Retire(size_t index, const absl::Status& status, FinishReason reason) {
  Live& l = running_[index];
  if (l.slot >= 0) kv_->Free(l.slot);
  l.sink.on_done(status, reason);
  {
    absl::MutexLock lock(&mu_);
    known_ids_.erase(l.id);
  }
  running_.erase(running_.begin() + static_cast<std::ptrdiff_t>(index));
}

void Scheduler::AdmitQueued() {
  std::vector<uint64_t> aborts;
  std::deque<Live> arrivals;
  {
    absl::MutexLock lock(&mu_);
    aborts.swap(aborts_);
    // Admit in arrival order while the KV cache has room.
    while (!queued_.empty()) {
      const Live& q = queued_.front();
      const int64_t need = static_cast<int64_t>(q.request.prompt.size()) + q.request.max_new_tokens;
      if (kv_->reserved_tokens() + need > kv_->capacity_tokens() && !running_.empty()) break;
      queued_tokens_ -= need;
      arrivals.push_back(std::move(queued_.front()));
      queued_.pop_front();
    }
    // Aborts of requests still queued.
    for (auto it = queued_.begin(); it != queued_.end();) {
      if (std::find(aborts.begin(), aborts.end(), it->id) != aborts.end()) {
        it->sink.on_done(absl::OkStatus(), FinishReason::kAborted);
        known_ids_.erase(it->id);
        it = queued_.erase(it);
      } else {
        ++it;
      }
    }
  }
  for (Live& l : arrivals) {
    absl::StatusOr<int> slot =
        kv_->Allocate(static_cast<int64_t>(l.request.prompt.size()) + l.request.max_new_tokens);
    running_.push_back(std::move(l));
    if (!slot.ok()) {
      Retire(running_.size() - 1, slot.status(), FinishReason::kAborted);
      continue;
    }
    running_.back().slot = *slot;
  }
  for (size_t i = running_.size(); i-- > 0;) {
    if (std::find(aborts.begin(), aborts.end(), running_[i].id) != aborts.end()) {
      Retire(i, absl::OkStatus(), FinishReason::kAborted);
    }
  }
  absl::MutexLock lock(&mu_);
  num_running_ = running_.size();
}

std::vector<SequenceChunk> Scheduler::BuildStep() {
  AdmitQueued();
  std::vector<SequenceChunk> chunks;
  step_owners_.clear();
  step_prefill_.clear();
  for (size_t i = 0; i < running_.size(); ++i) {
    Live& l = running_[i];
    SequenceChunk c;
    c.kv_slot = l.slot;
    const int64_t prompt_len = static_cast<int64_t>(l.request.prompt.size());
    if (l.prefilled < prompt_len) {
      int64_t n = prompt_len - l.prefilled;
      if (options_.prefill_chunk_tokens > 0) n = std::min(n, options_.prefill_chunk_tokens);
      c.start_position = l.prefilled;
      c.tokens.assign(l.request.prompt.begin() + l.prefilled,
                      l.request.prompt.begin() + l.prefilled + n);
      l.prefilled += n;
      step_prefill_.push_back(n);
    } else {
      c.start_position = prompt_len + static_cast<int64_t>(l.generated.size()) - 1;
      c.tokens = {l.generated.back()};
      step_prefill_.push_back(0);
    }
    chunks.push_back(std::move(c));
    step_owners_.push_back(i);
  }
  return chunks;
}

void Scheduler::FinishStep(const std::vector<float>& logits) {
  const int64_t vocab = config_.vocab_size;
  FinishStepWith([&](size_t j, Live& l, const float** row) {
    *row = logits.data() + static_cast<int64_t>(j) * vocab;
    return l.sampler.Sample(*row, vocab, l.generated.size());
  });
}

bool Scheduler::StepNeedsHostLogits() const {
  for (size_t owner : step_owners_) {
    const Live& l = running_[owner];
    if (l.prefilled < static_cast<int64_t>(l.request.prompt.size())) continue;  // mid-prefill
    if (l.generated.empty()) return true;
  }
  return false;
}

std::vector<SamplingRow> Scheduler::StepSamplingRows() const {
  std::vector<SamplingRow> rows;
  rows.reserve(step_owners_.size());
  for (size_t owner : step_owners_) {
    const Live& l = running_[owner];
    if (l.prefilled < static_cast<int64_t>(l.request.prompt.size())) {
      rows.push_back(ToSamplingRow(SamplingParams{}, 0));  // mid-prefill: greedy, unused
    } else {
      rows.push_back(ToSamplingRow(l.request.sampling, l.generated.size()));
    }
  }
  return rows;
}

void Scheduler::FinishStepWithTokens(const std::vector<int32_t>& tokens) {
  FinishStepWith([&](size_t j, Live&, const float** row) {
    *row = nullptr;
    return tokens[j];
  });
}

void Scheduler::FinishStepWith(
    const std::function<int32_t(size_t j, Live& l, const float** row)>& sample) {
  std::vector<std::pair<size_t, FinishReason>> finished;
  for (size_t j = 0; j < step_owners_.size(); ++j) {
    Live& l = running_[step_owners_[j]];
    if (l.prefilled < static_cast<int64_t>(l.request.prompt.size())) continue;  // mid-prefill
    const float* row = nullptr;
    const int32_t token = sample(j, l, &row);
    l.generated.push_back(token);
    l.sink.on_token(token, row);
    const auto& eos = config_.eos_token_ids;
    const auto& stop = l.request.stop_token_ids;
    if (!l.request.ignore_eos && std::find(eos.begin(), eos.end(), token) != eos.end()) {
      finished.push_back({step_owners_[j], FinishReason::kEos});
    } else if (std::find(stop.begin(), stop.end(), token) != stop.end()) {
      finished.push_back({step_owners_[j], FinishReason::kStopToken});
    } else if (static_cast<int64_t>(l.generated.size()) >= l.request.max_new_tokens) {
      finished.push_back({step_owners_[j], FinishReason::kLength});
    }
  }
  // Retire from the back so earlier indices stay valid.
  for (auto it = finished.rbegin(); it != finished.rend(); ++it) {
    Retire(it->first, absl::OkStatus(), it->second);
  }
  step_owners_.clear();
  absl::MutexLock lock(&mu_);
  num_running_ = running_.size();
}

void Scheduler::UndoStep() {
  for (size_t j = 0; j < step_owners_.size(); ++j)
    running_[step_owners_[j]].prefilled -= step_prefill_[j];
  step_owners_.clear();
  step_prefill_.clear();
}

void Scheduler::FailAll(const absl::Status& status) {
  while (!running_.empty()) Retire(running_.size() - 1, status, FinishReason::kAborted);
  step_owners_.clear();
  absl::MutexLock lock(&mu_);
  num_running_ = 0;
}

absl::StatusOr<std::vector<int32_t>> SampleStepOnBackend(Backend* backend, const Tensor& logits,
                                                         const Scheduler& scheduler) {
  const std::vector<SamplingRow> rows = scheduler.StepSamplingRows();
  const bool greedy = std::all_of(rows.begin(), rows.end(),
                                  [](const SamplingRow& r) { return r.temperature == 0.f; });
  DXS_ASSIGN_OR_RETURN(Tensor ids, backend->Allocate({logits.rows()}, DType::kI32));
  if (greedy) {
    DXS_RETURN_IF_ERROR(backend->ArgmaxRows(logits, &ids));
  } else {
    const int64_t n = static_cast<int64_t>(rows.size());
    DXS_ASSIGN_OR_RETURN(Tensor params, backend->Allocate({n, kSamplingRowWords}, DType::kI64));
    DXS_RETURN_IF_ERROR(backend->CopyFromHost(rows.data(), DType::kI64, &params));
    DXS_RETURN_IF_ERROR(backend->SampleRows(logits, params, &ids));
  }
  return backend->DownloadIndices(ids);
}

}  // namespace dxs
