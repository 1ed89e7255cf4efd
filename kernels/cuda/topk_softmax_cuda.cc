#include "kernels/cuda/topk_softmax_cuda.h"

#include "absl/strings/str_cat.h"
#include "kernels/cuda/topk_softmax.cuh"
#include "kernels/topk_softmax.h"

namespace dxs {
namespace {

absl::Status CheckKernelLimits(int64_t num_experts, int64_t top_k) {
  if (num_experts > kTopKSoftmaxMaxExperts) {
    return absl::InvalidArgumentError(absl::StrCat("top-k softmax (CUDA): num_experts ",
                                                   num_experts, " exceeds the kernel's limit of ",
                                                   kTopKSoftmaxMaxExperts));
  }
  if (top_k > kTopKSoftmaxMaxTopK) {
    return absl::InvalidArgumentError(absl::StrCat("top-k softmax (CUDA): top_k ", top_k,
                                                   " exceeds the kernel's limit of ",
                                                   kTopKSoftmaxMaxTopK));
  }
  return absl::OkStatus();
}

// Everything before the launch; OkStatus with *done set when there is nothing to launch.
absl::Status Prepare(const void* logits, int64_t num_tokens, int64_t num_experts, int64_t top_k,
                     const int32_t* ids, const float* weights, bool* done) {
  *done = true;
  if (absl::Status s = ValidateTopKArgs(num_tokens, num_experts, top_k); !s.ok()) return s;
  if (absl::Status s = CheckKernelLimits(num_experts, top_k); !s.ok()) return s;
  if (num_tokens == 0) return absl::OkStatus();  // empty batch: no CUDA call, no launch
  if (logits == nullptr || ids == nullptr || weights == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat("top-k softmax (CUDA): null device pointer with num_tokens ", num_tokens));
  }
  *done = false;
  return absl::OkStatus();
}

absl::Status FromLaunch(cudaError_t err) {
  if (err == cudaSuccess) return absl::OkStatus();
  return absl::InternalError(absl::StrCat("top-k softmax (CUDA): kernel launch failed: ",
                                          cudaGetErrorName(err), ": ", cudaGetErrorString(err)));
}

}  // namespace

absl::Status TopKSoftmaxCuda(const float* logits, int64_t num_tokens, int64_t num_experts,
                             int64_t top_k, bool normalize, int32_t* ids, float* weights,
                             cudaStream_t stream) {
  bool done = true;
  if (absl::Status s = Prepare(logits, num_tokens, num_experts, top_k, ids, weights, &done);
      !s.ok() || done) {
    return s;
  }
  return FromLaunch(
      LaunchTopKSoftmax(logits, num_tokens, num_experts, top_k, normalize, ids, weights, stream));
}

absl::Status TopKSoftmaxCudaBf16(const __nv_bfloat16* logits, int64_t num_tokens,
                                 int64_t num_experts, int64_t top_k, bool normalize, int32_t* ids,
                                 float* weights, cudaStream_t stream) {
  bool done = true;
  if (absl::Status s = Prepare(logits, num_tokens, num_experts, top_k, ids, weights, &done);
      !s.ok() || done) {
    return s;
  }
  return FromLaunch(LaunchTopKSoftmaxBf16(logits, num_tokens, num_experts, top_k, normalize, ids,
                                          weights, stream));
}

}  // namespace dxs
