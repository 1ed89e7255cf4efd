// Router top-k softmax on the GPU, behind absl::Status: the entry point for backends.
// The math and the limits are in kernels/cuda/topk_softmax.cuh.
//
// Order of checks, so that an empty batch costs nothing: arguments first (ValidateTopKArgs,
// then the kernel's limits), then zero tokens returns OK before any CUDA call and without a
// kernel launch (null pointers are fine then), then null pointers are rejected, then the
// launch. A launch error becomes InternalError carrying the CUDA error name and string.
// The kernel runs asynchronously on `stream`: errors during execution surface at the
// caller's next synchronisation.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstdint>

#include "absl/status/status.h"

namespace dxs {

absl::Status TopKSoftmaxCuda(const float* logits, int64_t num_tokens, int64_t num_experts,
                             int64_t top_k, bool normalize, int32_t* ids, float* weights,
                             cudaStream_t stream);

// bf16 logits, widened to fp32 on load. A separate name, not an overload, so that a call
// with a literal nullptr stays unambiguous.
absl::Status TopKSoftmaxCudaBf16(const __nv_bfloat16* logits, int64_t num_tokens,
                                 int64_t num_experts, int64_t top_k, bool normalize, int32_t* ids,
                                 float* weights, cudaStream_t stream);

}  // namespace dxs
