// FlashInfer's SM90 batch prefill kernel (flashinfer/attention/hopper/prefill_sm90.cuh: the
// FlashAttention-3 design, TMA for Q, wgmma, a producer warpgroup and two consumer
// warpgroups) over our paged cache, in its own translation unit (flashinfer_prefill_sm90.cu):
// it needs sm_90a, FlashInfer's CUTLASS, and its hopper parameter structs share names with
// the FA2 kernel's. flashinfer_attention.cu routes prefill-heavy eager steps here and owns
// the rest (the lengths' checks, the page-list compaction, the routing); this header is the
// seam between the two files, not an interface for other callers.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <string>

#include "kernels/cuda/ops.cuh"

namespace dxs::cuda {

// The kernel's query tile for head_dim 128 (its CTA_Q, and the planner's cta_tile_q): every
// sequence's queries are cut into tiles of this many rows, one (tile, query head) a unit of
// work. It does not pack a GQA group's heads into a tile as the FA2 kernel does, so a decode
// row costs a whole tile per head.
constexpr int64_t kSm90QueryTile = 128;
// FlashInfer's planner switches to another scheduler (one schedule for every head, a grid of
// SMs x heads) above this many tiles a head; only the per-work scheduler is built here.
constexpr int64_t kSm90MaxTilesPerHead = 4096;

// The plan: FlashInfer's SM90 work list (per SM, a list of (query tile, head, sequence)),
// then our page indptr, in a pinned buffer copied to a device buffer on the stream. One
// plan is made per set of lengths and reused by every layer of the step.
struct FlashInferSm90Plan;
FlashInferSm90Plan* CreateFlashInferSm90Plan();
// Waits for the plan's last copy; the caller has made sure no kernel still reads it.
void DestroyFlashInferSm90Plan(FlashInferSm90Plan* plan);

// Makes the plan for these sequences: query starts [num_seqs + 1] and context lengths
// [num_seqs] on the host (checked by the caller: every context at least its queries), and
// page_indptr [num_seqs + 1], the CSR offsets of each sequence's pages in the compacted page
// list. Waits for the previous plan's host-to-device copy (never for kernels), and for the
// stream when the buffers must grow. cudaErrorNotSupported when the step has more tiles a
// head than kSm90MaxTilesPerHead.
cudaError_t MakeFlashInferSm90Plan(FlashInferSm90Plan* plan, const PagedAttentionArgs& args,
                                   const int32_t* host_query_start,
                                   const int32_t* host_context_lens, const int32_t* page_indptr,
                                   cudaStream_t stream, std::string* error);
// The current plan's page indptr on the device (for the compaction kernel).
const int32_t* FlashInferSm90PageIndptr(const FlashInferSm90Plan* plan);

// The kernel on the current plan (made for these args' lengths): causal attention of
// q[num_tokens, num_heads, 128] over the bf16 caches [blocks, block_size, kv_heads, 128]
// through the compacted page list `page_indices` (device) into out[num_tokens, num_heads *
// 128], query i of a sequence with q_len queries and context L at position L - q_len + i.
cudaError_t RunFlashInferSm90(const FlashInferSm90Plan* plan, const void* q, const void* k_cache,
                              const void* v_cache, const PagedAttentionArgs& args,
                              const int32_t* page_indices, float scale, void* out,
                              cudaStream_t stream, std::string* error);

}  // namespace dxs::cuda
