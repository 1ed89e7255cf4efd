#include "model/step_sampling.h"

#include <algorithm>

#include "common/status_macros.h"

namespace dxs {

StepSamplingOutputs StepSamplingOutputs::Rows(int64_t n) const {
  StepSamplingOutputs o;
  o.ids = ids.Rows(0, n);
  if (sampled_logprobs.defined()) {
    o.sampled_logprobs = sampled_logprobs.Rows(0, n);
    o.named_logprobs = named_logprobs.Rows(0, n);
    o.top_ids = top_ids.Rows(0, n);
    o.top_logprobs = top_logprobs.Rows(0, n);
  }
  return o;
}

absl::StatusOr<StepSamplingOutputs> AllocateStepSamplingOutputs(Backend* backend, int64_t rows,
                                                                const StepLogprobShape& shape) {
  StepSamplingOutputs out;
  DXS_ASSIGN_OR_RETURN(out.ids, backend->Allocate({rows}, DType::kI32));
  if (!shape.any) return out;
  DXS_ASSIGN_OR_RETURN(out.sampled_logprobs, backend->Allocate({rows}, DType::kF32));
  DXS_ASSIGN_OR_RETURN(out.named_logprobs, backend->Allocate({rows, shape.named}, DType::kF32));
  DXS_ASSIGN_OR_RETURN(out.top_ids, backend->Allocate({rows, shape.top}, DType::kI32));
  DXS_ASSIGN_OR_RETURN(out.top_logprobs, backend->Allocate({rows, shape.top}, DType::kF32));
  return out;
}

absl::Status EnqueueStepSampling(Backend* backend, const Tensor& logits, bool argmax,
                                 const Tensor* params, const Tensor* adjustments,
                                 const Tensor* named, const StepLogprobShape& shape,
                                 StepSamplingOutputs* out) {
  if (argmax) {
    DXS_RETURN_IF_ERROR(backend->ArgmaxRows(logits, &out->ids));
  } else {
    if (params == nullptr) return absl::InvalidArgumentError("step sampling: no parameters");
    DXS_RETURN_IF_ERROR(backend->SampleRows(logits, *params, adjustments, &out->ids));
  }
  if (!shape.any) return absl::OkStatus();
  if (named == nullptr) return absl::InvalidArgumentError("step sampling: no named ids");
  return backend->LogprobRows(logits, out->ids, *named, &out->sampled_logprobs,
                              &out->named_logprobs, &out->top_ids, &out->top_logprobs);
}

namespace {

// StepTokens from the step's outputs as host arrays (ids [n]; with shape.any sampled [n],
// named [n, named], top ids and log-probabilities [n, top]).
StepTokens ParseStepTokens(int64_t n, const int32_t* ids, const float* sampled, const float* named,
                           const int32_t* top_ids, const float* top_lp,
                           const StepLogprobShape& shape) {
  StepTokens step;
  step.tokens.assign(ids, ids + n);
  if (!shape.any) return step;
  step.logprobs.resize(n);
  for (int64_t r = 0; r < n; ++r) {
    TokenLogprobs& lp = step.logprobs[r];
    lp.token = step.tokens[r];
    lp.logprob = sampled[r];
    for (int64_t t = 0; t < shape.top; ++t) {
      lp.top.push_back({top_ids[r * shape.top + t], top_lp[r * shape.top + t]});
    }
    lp.named.assign(named + r * shape.named, named + (r + 1) * shape.named);
  }
  return step;
}

}  // namespace

absl::StatusOr<StepTokens> DownloadStepTokens(Backend* backend, const StepSamplingOutputs& out,
                                              const StepLogprobShape& shape) {
  DXS_ASSIGN_OR_RETURN(std::vector<int32_t> ids, backend->DownloadIndices(out.ids));
  const int64_t n = static_cast<int64_t>(ids.size());
  if (!shape.any) return ParseStepTokens(n, ids.data(), nullptr, nullptr, nullptr, nullptr, shape);
  DXS_ASSIGN_OR_RETURN(std::vector<float> sampled, backend->Download(out.sampled_logprobs));
  std::vector<float> named, top_lp;
  std::vector<int32_t> top_ids;
  if (shape.named > 0) {
    DXS_ASSIGN_OR_RETURN(named, backend->Download(out.named_logprobs));
  }
  if (shape.top > 0) {
    DXS_ASSIGN_OR_RETURN(top_ids, backend->DownloadIndices(out.top_ids));
    DXS_ASSIGN_OR_RETURN(top_lp, backend->Download(out.top_logprobs));
  }
  return ParseStepTokens(n, ids.data(), sampled.data(), named.data(), top_ids.data(), top_lp.data(),
                         shape);
}

absl::Status EnqueueStepTokensDownload(Backend* backend, const StepSamplingOutputs& out,
                                       const StepLogprobShape& shape, PendingStepTokens* pending) {
  const int64_t n = out.ids.num_elements();
  // Every array is of 4-byte elements: ids, then sampled, named, top ids and top logprobs.
  const size_t words =
      static_cast<size_t>(n * (1 + (shape.any ? 1 + shape.named + 2 * shape.top : 0)));
  const size_t bytes = std::max<size_t>(words * 4, 64);
  if (pending->staging == nullptr || pending->staging->num_bytes() < bytes) {
    // Grown to twice the need, so that a batch growing a little records no new allocation.
    DXS_ASSIGN_OR_RETURN(pending->staging, backend->AllocateStaging(2 * bytes));
  }
  if (pending->copied == nullptr) {
    DXS_ASSIGN_OR_RETURN(pending->copied, backend->CreateEvent());
  }
  pending->rows = n;
  pending->shape = shape;
  size_t at = 0;
  const auto put = [&](const Tensor& t) -> absl::Status {
    DXS_RETURN_IF_ERROR(backend->CopyToStaging(t, *pending->staging, at));
    at += t.num_bytes();
    return absl::OkStatus();
  };
  DXS_RETURN_IF_ERROR(put(out.ids));
  if (shape.any) {
    DXS_RETURN_IF_ERROR(put(out.sampled_logprobs));
    DXS_RETURN_IF_ERROR(put(out.named_logprobs));
    DXS_RETURN_IF_ERROR(put(out.top_ids));
    DXS_RETURN_IF_ERROR(put(out.top_logprobs));
  }
  return backend->RecordEvent(pending->copied.get());
}

absl::StatusOr<StepTokens> ReadStepTokens(Backend* backend, PendingStepTokens* pending) {
  DXS_RETURN_IF_ERROR(backend->SynchronizeEvent(pending->copied.get()));
  const int64_t n = pending->rows;
  const StepLogprobShape& shape = pending->shape;
  const auto* base = static_cast<const uint8_t*>(pending->staging->data());
  const auto* ids = reinterpret_cast<const int32_t*>(base);
  const auto* sampled = reinterpret_cast<const float*>(ids + n);
  const auto* named = sampled + n;
  const auto* top_ids = reinterpret_cast<const int32_t*>(named + n * shape.named);
  const auto* top_lp = reinterpret_cast<const float*>(top_ids + n * shape.top);
  return ParseStepTokens(n, ids, sampled, named, top_ids, top_lp, shape);
}

absl::StatusOr<StepTokenDownloads::Step> StepTokenDownloads::Launch(StepSamplingOutputs outputs,
                                                                    const StepLogprobShape& shape) {
  Step step;
  step.outputs = std::move(outputs);
  step.tokens = &downloads_[next_];
  next_ ^= 1;
  DXS_RETURN_IF_ERROR(EnqueueStepTokensDownload(backend_, step.outputs, shape, step.tokens));
  return step;
}

absl::StatusOr<StepTokens> StepTokenDownloads::Read(const Step& step) {
  return ReadStepTokens(backend_, step.tokens);
}

void StepTokenDownloads::Drop(std::optional<Step>* step) {
  if (!step->has_value()) return;
  (void)ReadStepTokens(backend_, (*step)->tokens);  // its copies finish first
  step->reset();
}

}  // namespace dxs
