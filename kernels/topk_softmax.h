// Router top-k softmax on the host, shared by the CPU backend and by tests that check the
// device kernels. See Backend::TopKSoftmax for the contract.
#pragma once

#include <cstdint>

#include "absl/status/status.h"

namespace dxs {

// Checks arguments the way every backend must: zero tokens is fine (and does nothing),
// non-positive expert count or top-k, or top-k above the expert count, is an error.
absl::Status ValidateTopKArgs(int64_t num_tokens, int64_t num_experts, int64_t top_k);

absl::Status TopKSoftmaxCpu(const float* logits, int64_t num_tokens, int64_t num_experts,
                            int64_t top_k, bool normalize, int32_t* ids, float* weights);

}  // namespace dxs
