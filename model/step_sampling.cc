#include "model/step_sampling.h"

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

absl::StatusOr<StepTokens> DownloadStepTokens(Backend* backend, const StepSamplingOutputs& out,
                                              const StepLogprobShape& shape) {
  StepTokens step;
  DXS_ASSIGN_OR_RETURN(step.tokens, backend->DownloadIndices(out.ids));
  if (!shape.any) return step;
  const int64_t n = static_cast<int64_t>(step.tokens.size());
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
  step.logprobs.resize(n);
  for (int64_t r = 0; r < n; ++r) {
    TokenLogprobs& lp = step.logprobs[r];
    lp.token = step.tokens[r];
    lp.logprob = sampled[r];
    for (int64_t t = 0; t < shape.top; ++t) {
      lp.top.push_back({top_ids[r * shape.top + t], top_lp[r * shape.top + t]});
    }
    lp.named.assign(named.begin() + r * shape.named, named.begin() + (r + 1) * shape.named);
  }
  return step;
}

}  // namespace dxs
