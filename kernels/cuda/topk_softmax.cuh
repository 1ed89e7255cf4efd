// Router top-k softmax on the GPU: the raw launch API, free of absl so that any host C++
// (or CUDA) file can call it. Most callers want the absl::Status wrapper in
// kernels/cuda/topk_softmax_cuda.h, which checks arguments and collects launch errors.
//
// Contract (the same as TopKSoftmaxCpu in kernels/topk_softmax.h): for each token t, the
// softmax of logits[t, 0..num_experts) in fp32; the top_k largest probabilities in
// descending order (ties go to the lower expert id) into ids[t, 0..top_k) and
// weights[t, 0..top_k); with `normalize`, the picked weights are divided by their sum. The
// kernel ranks by logit: the same order, except where exp rounds distinct logits to one
// probability (both underflow to 0), where the larger logit goes first here. A row with a
// NaN or +inf logit has NaN weights and its experts ranked by logit, NaN last, on both sides.
// All pointers are device pointers, row-major, rows packed (stride num_experts / top_k).
//
// NOTES: one warp per token, each lane holding up to 16 logits in registers, hence the
// limits below (Qwen3-30B-A3B has 128 experts and top_k 8; Qwen3-235B-A22B the same).
// The softmax sum and the sum of the picked weights are added in expert order and in pick
// order respectively, exactly as the CPU reference does, so GPU and CPU results differ only
// by the last bits of expf and are the same from run to run.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstdint>

namespace dxs {

inline constexpr int64_t kTopKSoftmaxMaxExperts = 512;
inline constexpr int64_t kTopKSoftmaxMaxTopK = 32;

// Enqueues the kernel on `stream` and returns cudaGetLastError() after the launch; errors
// during execution surface at the next synchronisation, as with any kernel.
// Zero tokens returns cudaSuccess at once, without touching CUDA (null pointers are fine).
// Arguments outside the limits, or null pointers with tokens to route, return
// cudaErrorInvalidValue without launching.
cudaError_t LaunchTopKSoftmax(const float* logits, int64_t num_tokens, int64_t num_experts,
                              int64_t top_k, bool normalize, int32_t* ids, float* weights,
                              cudaStream_t stream);

// The same with bf16 logits, widened to fp32 on load (all math is fp32).
cudaError_t LaunchTopKSoftmaxBf16(const __nv_bfloat16* logits, int64_t num_tokens,
                                  int64_t num_experts, int64_t top_k, bool normalize, int32_t* ids,
                                  float* weights, cudaStream_t stream);

}  // namespace dxs
