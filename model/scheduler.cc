#include "model/scheduler.h"

#include <algorithm>
#include <optional>

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
  const int64_t prompt_len = static_cast<int64_t>(r.prompt.size());
  if (r.prompt_logprobs_start < -1 || r.prompt_logprobs_start >= prompt_len) {
    return absl::InvalidArgumentError(
        absl::StrCat("prompt_logprobs_start: must be in [0, ", prompt_len,
                     ") (the prompt's positions), or unset; got ", r.prompt_logprobs_start));
  }
  if (r.max_new_tokens < 0 || (r.max_new_tokens == 0 && r.prompt_logprobs_start < 0)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "max_new_tokens: must be positive (0 only to score the prompt), got ", r.max_new_tokens));
  }
  if (r.min_new_tokens < 0 || r.min_new_tokens > r.max_new_tokens) {
    return absl::InvalidArgumentError(
        absl::StrCat("min_new_tokens: must be in [0, max_new_tokens (", r.max_new_tokens,
                     ")], got ", r.min_new_tokens));
  }
  if (r.n < 1 || r.n > kMaxSamples) {
    return absl::InvalidArgumentError(
        absl::StrCat("n: must be in [1, ", kMaxSamples, "], got ", r.n));
  }
  if (r.top_logprobs < 0 || r.top_logprobs > kMaxTopLogprobs) {
    return absl::InvalidArgumentError(
        absl::StrCat("top_logprobs: must be in [0, ", kMaxTopLogprobs, "], got ", r.top_logprobs));
  }
  if (static_cast<int64_t>(r.logprob_token_ids.size()) > kMaxLogprobTokenIds) {
    return absl::InvalidArgumentError(absl::StrCat("logprob_token_ids: at most ",
                                                   kMaxLogprobTokenIds, " ids, got ",
                                                   r.logprob_token_ids.size()));
  }
  for (int32_t id : r.logprob_token_ids) {
    if (id < 0 || id >= config.vocab_size) {
      return absl::InvalidArgumentError(absl::StrCat("logprob_token_ids: token id ", id,
                                                     " is outside the vocabulary [0, ",
                                                     config.vocab_size, ")"));
    }
  }
  for (int32_t id : r.stop_token_ids) {
    if (id < 0 || id >= config.vocab_size) {
      return absl::InvalidArgumentError(absl::StrCat("stop_token_ids: token id ", id,
                                                     " is outside the vocabulary [0, ",
                                                     config.vocab_size, ")"));
    }
  }
  const int64_t total = static_cast<int64_t>(r.prompt.size()) + r.max_new_tokens;
  if (total > config.max_position_embeddings) {
    return absl::InvalidArgumentError(absl::StrCat(
        "max_new_tokens: prompt (", r.prompt.size(), ") + max_new_tokens (", r.max_new_tokens,
        ") exceeds the context length ", config.max_position_embeddings));
  }
  DXS_RETURN_IF_ERROR(ValidateSamplingParams(r.sampling));
  return ValidateLogitBias(r.sampling, config.vocab_size);
}

Scheduler::Live::Live(uint64_t id_in, GenerationRequest r, TokenSink s, const ModelConfig& config)
    : id(id_in), request(std::move(r)), sink(std::move(s)), sampler(request.sampling) {
  const SamplingParams& p = request.sampling;
  prompt_logprobs.first_position = std::max<int64_t>(request.prompt_logprobs_start, 1);
  if (p.repetition_penalty != 1.f) {
    for (int32_t t : request.prompt) Adjustment(t).flags |= kAdjustSeen;
  }
  for (const auto& [t, bias] : p.logit_bias) Adjustment(t).bias = bias;
  if (request.min_new_tokens > 0) {
    if (!request.ignore_eos) {
      for (int64_t t : config.eos_token_ids) banned.push_back(static_cast<int32_t>(t));
    }
    banned.insert(banned.end(), request.stop_token_ids.begin(), request.stop_token_ids.end());
    for (int32_t t : banned) Adjustment(t).flags |= kAdjustBanned;
  }
}

LogitAdjustment& Scheduler::Live::Adjustment(int32_t token) {
  auto [it, added] = adjust_at.emplace(token, adjust.size());
  if (added) adjust.push_back(LogitAdjustment{token, 0, 0.f, 0});
  return adjust[it->second];
}

namespace {

// Whether a request's next logits depend on the tokens it generated (its penalties).
bool Penalised(const SamplingParams& p) {
  return p.repetition_penalty != 1.f || p.frequency_penalty != 0.f || p.presence_penalty != 0.f;
}

}  // namespace

void Scheduler::Live::Generated(int32_t token) {
  generated.push_back(token);
  if (Penalised(request.sampling)) {
    LogitAdjustment& a = Adjustment(token);
    ++a.output_count;
    a.flags |= kAdjustSeen;
  }
  if (static_cast<int64_t>(generated.size()) == request.min_new_tokens) {
    for (int32_t t : banned) adjust[adjust_at.at(t)].flags &= ~kAdjustBanned;
    banned.clear();
  }
}

int64_t Scheduler::Live::FirstScoredRow() const {
  if (request.prompt_logprobs_start < 0) return -1;
  return std::max<int64_t>(request.prompt_logprobs_start, 1) - 1;
}

Scheduler::Scheduler(const ModelConfig& config, KvCache* kv, SchedulerOptions options)
    : config_(config), kv_(kv), options_(options) {}

absl::Status Scheduler::Add(uint64_t id, GenerationRequest request, TokenSink sink) {
  if (absl::Status s = ValidateRequest(config_, request); !s.ok()) return s;
  if (request.n > 1 && !sink.sample_sink) {
    return absl::InvalidArgumentError("n: more than one sample needs TokenSink::sample_sink");
  }
  const int64_t need = KvNeed(request);
  if (need > kv_->capacity_tokens()) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "request needs ", need, " KV tokens; the cache holds ", kv_->capacity_tokens()));
  }
  absl::MutexLock lock(&mu_);
  if (!known_ids_.insert(id).second) {
    return absl::AlreadyExistsError(absl::StrCat("request id ", id, " is already in flight"));
  }
  queued_.emplace_back(id, std::move(request), std::move(sink), config_);
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

int64_t Scheduler::KvNeed(const GenerationRequest& r) const {
  // Each further sample: its own output, and the copy of the prompt's last partial block.
  return static_cast<int64_t>(r.prompt.size()) + r.max_new_tokens +
         (r.n - 1) * (r.max_new_tokens + kv_->block_size());
}

void Scheduler::Retire(size_t index, const absl::Status& status, FinishReason reason) {
  Live& l = running_[index];
  if (l.slot >= 0) kv_->Free(l.slot);
  fork_reserve_ -= l.fork_reserve;
  l.fork_reserve = 0;
  if (!l.done) EndRequest(l, status, reason);
  running_.erase(running_.begin() + static_cast<std::ptrdiff_t>(index));
}

void Scheduler::EndRequest(Live& l, const absl::Status& status, FinishReason reason) {
  l.done = true;
  l.sink.on_done(status, reason);
  // The id stays known while another sample of the request runs.
  const bool sibling_runs = std::any_of(running_.begin(), running_.end(), [&l](const Live& other) {
    return &other != &l && other.id == l.id && !other.done;
  });
  if (!sibling_runs) {
    absl::MutexLock lock(&mu_);
    known_ids_.erase(l.id);
  }
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
      const int64_t need = KvNeed(q.request);
      if (kv_->reserved_tokens() + fork_reserve_ + need > kv_->capacity_tokens() &&
          !running_.empty()) {
        break;
      }
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
    // Room for the other samples' forks, held until they fork (or the request ends first).
    l.fork_reserve = KvNeed(l.request) - static_cast<int64_t>(l.request.prompt.size()) -
                     l.request.max_new_tokens;
    fork_reserve_ += l.fork_reserve;
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
  // Requests that ended while a step built ahead ran: that step is done now.
  for (size_t i = running_.size(); i-- > 0;) {
    if (running_[i].done) Retire(i, absl::OkStatus(), FinishReason::kAborted);
  }
  ahead_ = false;
  AdmitQueued();
  std::vector<SequenceChunk> chunks;
  step_owners_.clear();
  step_prefill_.clear();
  step_logit_rows_.clear();
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
      // A scored prompt needs the rows of every position from FirstScoredRow.
      if (const int64_t scored = l.FirstScoredRow(); scored >= 0) {
        c.logit_rows = std::max<int64_t>(1, l.prefilled + n - std::max(l.prefilled, scored));
      }
      l.prefilled += n;
      prefill_tokens_ += n;
      step_prefill_.push_back(n);
    } else {
      c.start_position = prompt_len + static_cast<int64_t>(l.generated.size()) - 1;
      c.tokens = {l.generated.back()};
      step_prefill_.push_back(0);
    }
    step_logit_rows_.push_back(c.logit_rows);
    chunks.push_back(std::move(c));
    step_owners_.push_back(i);
  }
  return chunks;
}

bool Scheduler::CanStepAhead() {
  if (step_owners_.empty() || ahead_) return false;
  {
    absl::MutexLock lock(&mu_);
    if (!queued_.empty() || !aborts_.empty()) return false;
  }
  for (size_t j = 0; j < step_owners_.size(); ++j) {
    const Live& l = running_[step_owners_[j]];
    const GenerationRequest& r = l.request;
    const SamplingParams& p = r.sampling;
    const int64_t generated = static_cast<int64_t>(l.generated.size());
    // Penalties go ahead too: the token of the step in flight is counted on the device
    // (PlanStepSampling's kAdjustPending entry); a request naming every token but one leaves
    // no token free for that entry.
    if (l.done || step_prefill_[j] != 0 || step_logit_rows_[j] != 1 || l.generated.empty() ||
        generated + 1 >= r.max_new_tokens || generated + 1 == r.min_new_tokens ||
        (Penalised(p) && static_cast<int64_t>(l.adjust.size()) + 1 >= config_.vocab_size)) {
      return false;
    }
  }
  return true;
}

std::vector<SequenceChunk> Scheduler::BuildStepAhead() {
  ahead_ = true;
  std::vector<SequenceChunk> chunks;
  chunks.reserve(step_owners_.size());
  for (size_t j = 0; j < step_owners_.size(); ++j) {
    const Live& l = running_[step_owners_[j]];
    SequenceChunk& c = chunks.emplace_back();
    c.kv_slot = l.slot;
    // The position after the step before's input: that step's token goes here.
    c.start_position =
        static_cast<int64_t>(l.request.prompt.size()) + static_cast<int64_t>(l.generated.size());
    c.tokens = {0};
  }
  return chunks;
}

namespace {

// A row's log-probabilities from the backend, computed at the step's widest shape (most
// alternatives, most named ids): this request's share of them.
TokenLogprobs RequestShare(TokenLogprobs lp, const GenerationRequest& request) {
  lp.top.resize(std::min(lp.top.size(), static_cast<size_t>(request.top_logprobs)));
  lp.named.resize(request.logprob_token_ids.size());
  return lp;
}

}  // namespace

void Scheduler::FinishStep(const std::vector<float>& logits, const StepTokens* sampled) {
  const int64_t vocab = config_.vocab_size;
  // first_row[j]: chunk j's first logits row; its last is the one sampled.
  std::vector<int64_t> first_row(step_logit_rows_.size() + 1, 0);
  for (size_t j = 0; j < step_logit_rows_.size(); ++j) {
    first_row[j + 1] = first_row[j] + step_logit_rows_[j];
  }
  auto row_of = [&](int64_t r) { return logits.data() + r * vocab; };
  auto score = [&](size_t j, Live& l) {
    const int64_t scored = l.FirstScoredRow();
    if (scored < 0 || step_prefill_[j] == 0) return;
    const GenerationRequest& req = l.request;
    const int64_t prompt_len = static_cast<int64_t>(req.prompt.size());
    // The chunk's rows are positions [end - rows, end) of the prompt.
    const int64_t end = l.prefilled, rows = step_logit_rows_[j];
    for (int64_t q = std::max(end - rows, scored); q < end; ++q) {
      const float* row = row_of(first_row[j] + (q - (end - rows)));
      if (q + 1 < prompt_len) {
        TokenLogprobs& lp = l.prompt_logprobs.positions.emplace_back();
        RowLogprobs(row, vocab, req.prompt[q + 1], req.top_logprobs, req.logprob_token_ids, &lp);
      } else {
        RowLogprobs(row, vocab, -1, req.top_logprobs, req.logprob_token_ids,
                    &l.prompt_logprobs.next);
        if (l.sink.on_prompt_logprobs) l.sink.on_prompt_logprobs(l.prompt_logprobs);
        l.prompt_logprobs = {};
      }
    }
  };
  FinishStepWith(score, [&](size_t j, Live& l, const float** row) {
    const float* raw = row_of(first_row[j + 1] - 1);
    *row = raw;
    const float* sample_from = raw;
    if (sampled == nullptr && l.NeedsAdjustedRow()) {
      adjusted_row_.assign(raw, raw + vocab);
      ApplyLogitAdjustments(l.request.sampling, l.adjust.data(), l.adjust.size(),
                            adjusted_row_.data());
      sample_from = adjusted_row_.data();
    }
    int32_t token;
    if (sampled != nullptr) {
      // The backend's draw, from the same parameters.
      token = sampled->tokens.at(sampled->Row(j, l.forking_sample));
    } else if (share_row_ && l.request.sampling.temperature != 0.f) {
      // The samples of one request at its first token: one row, one set of parameters but
      // the seed, so the candidates are sorted once.
      if (!row_prepared_) {
        PrepareCandidates(sample_from, vocab, l.request.sampling, &row_scratch_);
        row_prepared_ = true;
      }
      token = DrawCandidate(row_scratch_, l.request.sampling, l.generated.size());
    } else {
      token = l.sampler.Sample(sample_from, vocab, l.generated.size());
    }
    if (l.request.WantsLogprobs() && l.sink.on_logprobs) {
      if (sampled != nullptr && !sampled->logprobs.empty()) {
        // The backend's (LogprobRows), as for every later token.
        l.sink.on_logprobs(
            RequestShare(sampled->logprobs.at(sampled->Row(j, l.forking_sample)), l.request));
      } else {
        TokenLogprobs lp;
        RowLogprobs(raw, vocab, token, l.request.top_logprobs, l.request.logprob_token_ids, &lp);
        l.sink.on_logprobs(lp);
      }
    }
    return token;
  });
}

bool Scheduler::StepNeedsHost(bool to_sample) const {
  for (size_t j = 0; j < step_owners_.size(); ++j) {
    const Live& l = running_[step_owners_[j]];
    // Scoring: a prefill chunk whose rows reach the scored positions (even one row).
    if (step_prefill_[j] > 0 && l.FirstScoredRow() >= 0 && l.prefilled > l.FirstScoredRow()) {
      return true;
    }
    if (l.prefilled < static_cast<int64_t>(l.request.prompt.size())) continue;  // mid-prefill
    // A first token: its row goes to the sink.
    if (l.generated.empty() && !to_sample) return true;
  }
  return false;
}

bool Scheduler::StepNeedsHostLogits() const { return StepNeedsHost(/*to_sample=*/false); }

bool Scheduler::StepSamplesOnHost() const { return StepNeedsHost(/*to_sample=*/true); }

StepSamplingPlan Scheduler::PlanStepSampling() const {
  StepSamplingPlan plan;
  std::vector<SamplingRow> forks;
  for (size_t j = 0; j < step_owners_.size(); ++j) {
    const Live& l = running_[step_owners_[j]];
    const GenerationRequest& r = l.request;
    if (r.WantsLogprobs()) {
      plan.logprobs.any = true;
      plan.logprobs.top = std::max<int64_t>(plan.logprobs.top, r.top_logprobs);
      plan.logprobs.named =
          std::max<int64_t>(plan.logprobs.named, static_cast<int64_t>(r.logprob_token_ids.size()));
    }
    if (l.prefilled < static_cast<int64_t>(r.prompt.size())) {
      plan.rows.push_back(ToSamplingRow(SamplingParams{}, 0));  // mid-prefill: greedy, unused
      continue;
    }
    // A step built ahead draws the token after the one the step before is drawing, whose
    // penalties are counted on the device: one more entry, pending.
    const bool pending = ahead_ && Penalised(r.sampling);
    const SamplingRow row =
        ToSamplingRow(r.sampling, l.generated.size() + (ahead_ ? 1 : 0),
                      static_cast<int32_t>(plan.adjustments.size()),
                      static_cast<int32_t>(l.adjust.size() + (pending ? 1 : 0)));
    plan.rows.push_back(row);
    plan.adjustments.insert(plan.adjustments.end(), l.adjust.begin(), l.adjust.end());
    if (pending) {
      // Its token: the lowest no entry names (entries name distinct tokens).
      int32_t free_token = 0;
      while (l.adjust_at.count(free_token) != 0) ++free_token;
      plan.adjustments.push_back(LogitAdjustment{free_token, 0, 0.f, kAdjustPending});
      plan.pending_tokens = true;
    }
    if (r.n > 1 && l.generated.empty()) {
      // The other samples' first tokens: the same row and adjustments (nothing generated
      // yet), draw 0 of the seed ForkSamples gives each.
      for (int32_t i = 1; i < r.n; ++i) {
        SamplingRow fork = row;
        fork.seed = SampleSeed(r.sampling.seed, i);
        forks.push_back(fork);
        plan.fork_rows.push_back(static_cast<int32_t>(j));
      }
    }
  }
  plan.rows.insert(plan.rows.end(), forks.begin(), forks.end());
  plan.argmax = std::all_of(plan.rows.begin(), plan.rows.end(), [](const SamplingRow& row) {
    return row.temperature == 0.f && row.adjust_count == 0;
  });
  const size_t chunks = step_owners_.size();
  const int64_t width = plan.logprobs.named;
  plan.named_ids.assign(plan.rows.size() * width, -1);
  for (size_t r = 0; r < plan.rows.size() && width > 0; ++r) {
    const size_t j = r < chunks ? r : static_cast<size_t>(plan.fork_rows[r - chunks]);
    const std::vector<int32_t>& named = running_[step_owners_[j]].request.logprob_token_ids;
    std::copy(named.begin(), named.end(), plan.named_ids.begin() + r * width);
  }
  return plan;
}

void Scheduler::FinishStepWithTokens(const StepTokens& step) {
  FinishStepWith(nullptr, [&](size_t j, Live& l, const float** row) {
    *row = nullptr;
    const size_t r = step.Row(j, l.forking_sample);
    if (l.request.WantsLogprobs() && l.sink.on_logprobs) {
      l.sink.on_logprobs(RequestShare(step.logprobs.at(r), l.request));
    }
    return step.tokens.at(r);
  });
}

std::optional<FinishReason> Scheduler::Emit(Live& l, int32_t token, const float* row) {
  l.Generated(token);
  l.sink.on_token(token, row);
  const auto& eos = config_.eos_token_ids;
  const auto& stop = l.request.stop_token_ids;
  if (!l.request.ignore_eos && std::find(eos.begin(), eos.end(), token) != eos.end()) {
    return FinishReason::kEos;
  }
  if (std::find(stop.begin(), stop.end(), token) != stop.end()) return FinishReason::kStopToken;
  if (static_cast<int64_t>(l.generated.size()) >= l.request.max_new_tokens) {
    return FinishReason::kLength;
  }
  return std::nullopt;
}

std::vector<std::pair<Scheduler::Live, std::optional<FinishReason>>> Scheduler::ForkSamples(
    size_t j, Live& l, const std::function<int32_t(size_t j, Live& l, const float** row)>& sample) {
  std::vector<std::pair<Live, std::optional<FinishReason>>> samples;
  const int64_t prompt_len = static_cast<int64_t>(l.request.prompt.size());
  fork_reserve_ -= l.fork_reserve;
  l.fork_reserve = 0;
  for (int32_t i = 1; i < l.request.n; ++i) {
    GenerationRequest r = l.request;
    r.n = 1;
    r.prompt_logprobs_start = -1;  // the prompt's scores went to sample 0
    r.sampling.seed = SampleSeed(l.request.sampling.seed, i);
    Live& child =
        samples.emplace_back(Live(l.id, std::move(r), l.sink.sample_sink(i), config_), std::nullopt)
            .first;
    child.prefilled = prompt_len;
    absl::StatusOr<int> slot = kv_->Fork(l.slot, prompt_len, prompt_len + l.request.max_new_tokens);
    if (!slot.ok()) {  // not expected: the admission held room for it
      child.sink.on_done(slot.status(), FinishReason::kAborted);
      samples.pop_back();
      continue;
    }
    child.slot = *slot;
    const float* row = nullptr;
    child.forking_sample = i;
    const int32_t token = sample(j, child, &row);
    child.forking_sample = 0;
    samples.back().second = Emit(child, token, row);
  }
  return samples;
}

void Scheduler::FinishStepWith(
    const std::function<void(size_t j, Live& l)>& score,
    const std::function<int32_t(size_t j, Live& l, const float** row)>& sample) {
  std::vector<std::pair<size_t, FinishReason>> finished;
  std::vector<Live> forked;  // other samples, running from the next step
  for (size_t j = 0; j < step_owners_.size(); ++j) {
    Live& l = running_[step_owners_[j]];
    if (l.done) {
      // It ended with the step before, which this one was built ahead of: this token is
      // discarded, and its KV goes now.
      finished.push_back({step_owners_[j], FinishReason::kAborted});
      continue;
    }
    if (score) score(j, l);
    if (l.prefilled < static_cast<int64_t>(l.request.prompt.size())) continue;  // mid-prefill
    if (l.request.max_new_tokens == 0) {  // scored its prompt, generates nothing
      finished.push_back({step_owners_[j], FinishReason::kLength});
      continue;
    }
    const bool fork = l.request.n > 1 && l.generated.empty();
    share_row_ = fork;
    row_prepared_ = false;
    if (fork) {
      for (auto& [child, end] : ForkSamples(j, l, sample)) {
        if (end) {
          kv_->Free(child.slot);
          child.sink.on_done(absl::OkStatus(), *end);
        } else {
          forked.push_back(std::move(child));
        }
      }
    }
    const float* row = nullptr;
    const int32_t token = sample(j, l, &row);
    share_row_ = false;
    if (std::optional<FinishReason> end = Emit(l, token, row)) {
      if (ahead_) {
        // The step built ahead computes its next token: it ends now, its KV with that step.
        EndRequest(l, absl::OkStatus(), *end);
      } else {
        finished.push_back({step_owners_[j], *end});
      }
    }
  }
  for (Live& child : forked) running_.push_back(std::move(child));
  // Retire from the back so earlier indices stay valid (none when a step was built ahead:
  // its owners are this step's).
  for (auto it = finished.rbegin(); it != finished.rend(); ++it) {
    Retire(it->first, absl::OkStatus(), it->second);
  }
  // The step built ahead, if any, is the current step now.
  if (!ahead_) step_owners_.clear();
  ahead_ = false;
  const size_t live = static_cast<size_t>(
      std::count_if(running_.begin(), running_.end(), [](const Live& l) { return !l.done; }));
  absl::MutexLock lock(&mu_);
  num_running_ = live;
}

void Scheduler::UndoStep() {
  ahead_ = false;
  for (size_t j = 0; j < step_owners_.size(); ++j) {
    Live& l = running_[step_owners_[j]];
    l.prefilled -= step_prefill_[j];
    // Scores of the undone chunk's positions (those after l.prefilled) come again with the
    // retry.
    std::vector<TokenLogprobs>& scored = l.prompt_logprobs.positions;
    const int64_t keep = std::max<int64_t>(0, l.prefilled - l.prompt_logprobs.first_position + 1);
    if (static_cast<int64_t>(scored.size()) > keep) scored.resize(keep);
  }
  step_owners_.clear();
  step_prefill_.clear();
  step_logit_rows_.clear();
}

void Scheduler::FailAll(const absl::Status& status) {
  ahead_ = false;
  while (!running_.empty()) Retire(running_.size() - 1, status, FinishReason::kAborted);
  step_owners_.clear();
  absl::MutexLock lock(&mu_);
  num_running_ = 0;
}

absl::StatusOr<StepSamplingOutputs> EnqueueStepSamplingOnBackend(Backend* backend,
                                                                 const Tensor& logits,
                                                                 const StepSamplingPlan& plan,
                                                                 const Tensor* step_ids) {
  if (plan.pending_tokens && (step_ids == nullptr || step_ids->num_elements() != logits.rows())) {
    return absl::FailedPreconditionError(
        "step sampling: a step built ahead needs its input ids on the backend (its penalties "
        "count the step before's tokens)");
  }
  const int64_t chunks = logits.rows();
  const int64_t n = static_cast<int64_t>(plan.rows.size());
  std::optional<Tensor> expanded;  // the chunks' rows, then each forked sample's chunk's
  if (!plan.fork_rows.empty()) {
    std::vector<int32_t> sources(n);
    for (int64_t r = 0; r < n; ++r) {
      sources[r] = r < chunks ? static_cast<int32_t>(r) : plan.fork_rows[r - chunks];
    }
    DXS_ASSIGN_OR_RETURN(Tensor index, backend->Allocate({n}, DType::kI32));
    DXS_RETURN_IF_ERROR(backend->CopyFromHost(sources.data(), DType::kI32, &index));
    DXS_ASSIGN_OR_RETURN(expanded, backend->Allocate({n, logits.row_size()}, DType::kF32));
    DXS_RETURN_IF_ERROR(backend->GatherRows(logits, index, &*expanded));
  }
  std::optional<Tensor> params, adjustments, named;
  if (!plan.argmax) {
    DXS_ASSIGN_OR_RETURN(params, backend->Allocate({n, kSamplingRowWords}, DType::kI64));
    DXS_RETURN_IF_ERROR(backend->CopyFromHost(plan.rows.data(), DType::kI64, &*params));
    if (!plan.adjustments.empty()) {
      const int64_t m = static_cast<int64_t>(plan.adjustments.size());
      DXS_ASSIGN_OR_RETURN(adjustments, backend->Allocate({m, kLogitAdjustmentWords}, DType::kI32));
      DXS_RETURN_IF_ERROR(
          backend->CopyFromHost(plan.adjustments.data(), DType::kI32, &*adjustments));
      if (plan.pending_tokens) {
        // Forked rows come only with a request's first token, never in a step built ahead.
        DXS_RETURN_IF_ERROR(backend->CountPendingTokens(*step_ids, *params, &*adjustments));
      }
    }
  }
  if (plan.logprobs.any) {
    DXS_ASSIGN_OR_RETURN(named, backend->Allocate({n, plan.logprobs.named}, DType::kI32));
    if (plan.logprobs.named > 0) {
      DXS_RETURN_IF_ERROR(backend->CopyFromHost(plan.named_ids.data(), DType::kI32, &*named));
    }
  }
  DXS_ASSIGN_OR_RETURN(StepSamplingOutputs out,
                       AllocateStepSamplingOutputs(backend, n, plan.logprobs));
  DXS_RETURN_IF_ERROR(EnqueueStepSampling(
      backend, expanded ? *expanded : logits, plan.argmax, params ? &*params : nullptr,
      adjustments ? &*adjustments : nullptr, named ? &*named : nullptr, plan.logprobs, &out));
  return out;
}

absl::StatusOr<Scheduler::StepTokens> SampleStepOnBackend(Backend* backend, const Tensor& logits,
                                                          const Scheduler& scheduler,
                                                          const Tensor* step_ids) {
  const StepSamplingPlan plan = scheduler.PlanStepSampling();
  const int64_t chunks = logits.rows();
  const int64_t n = static_cast<int64_t>(plan.rows.size());
  DXS_ASSIGN_OR_RETURN(StepSamplingOutputs out,
                       EnqueueStepSamplingOnBackend(backend, logits, plan, step_ids));
  DXS_ASSIGN_OR_RETURN(Scheduler::StepTokens step, DownloadStepTokens(backend, out, plan.logprobs));
  if (!plan.fork_rows.empty()) {
    step.fork_first.assign(chunks, -1);
    for (int64_t r = n - 1; r >= chunks; --r) step.fork_first[plan.fork_rows[r - chunks]] = r;
  }
  return step;
}

}  // namespace dxs
