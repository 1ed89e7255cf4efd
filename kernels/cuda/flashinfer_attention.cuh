// Paged attention through FlashInfer's batch prefill kernel (flashinfer_attention.cu): an
// alternative to attention.cu's kernel for bf16 with head_dim 128, used where it measures
// faster (docs/gpu.md); on sm_90, prefill-heavy eager steps take FlashInfer's SM90
// (FlashAttention-3 style) kernel instead (flashinfer_prefill_sm90.cu; FlashInferKernel
// below). Absl-free like ops.cuh. It plans on the host from the lengths, so it needs them
// on the host; in a CUDA graph the plan is remade before each replay from the staged
// lengths (below).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "kernels/cuda/ops.cuh"

namespace dxs::cuda {

// Workspaces (128 MB for split-KV partials, the plan's buffers) and the current plans. One
// per stream; not thread-safe. Reads DXS_CUDA_PREFILL_SM90 (below) when created.
struct FlashInferAttention;
FlashInferAttention* CreateFlashInferAttention();
void DestroyFlashInferAttention(FlashInferAttention* fi);
// What the last failed call said (empty when none failed).
const char* FlashInferAttentionError(const FlashInferAttention* fi);

// Whether this build of FlashInfer's kernel takes these types and sizes.
bool FlashInferAttentionSupports(ElemType q_type, ElemType cache_type, ElemType out_type,
                                 int64_t num_heads, int64_t num_kv_heads, int64_t head_dim);

// Which of FlashInfer's kernels an eager call runs.
enum class FlashInferKernel {
  // The SM90 kernel for a prefill-heavy step where it runs (below), else FA2.
  kAuto,
  // The FA2-style batch prefill kernel (flashinfer/attention/prefill.cuh): every step.
  kFa2,
  // The SM90 kernel (FlashAttention-3 style, flashinfer/attention/hopper/prefill_sm90.cuh,
  // built for sm_90a): cudaErrorNotSupported where it does not run (another GPU, a build
  // without it, a graph being captured, a step beyond its planner's 4096 tiles a head).
  kSm90,
};

// Whether the SM90 kernel runs here: this build has it and the current device is sm_90.
bool FlashInferSm90Available();

// The kernel the last successful call of fi ran (kAuto before any).
FlashInferKernel FlashInferLastKernel(const FlashInferAttention* fi);

// LaunchPagedAttention's contract (ops.cuh), with the sequences' query starts
// [num_seqs + 1] and context lengths [num_seqs] also on the host: every sequence has a
// context of at least its queries. The plan is made again only when those change. It may
// wait for the previous plan's host-to-device copy (never for kernels). With graph_plan,
// the plan is FlashInfer's CUDA-graph plan (below) made eagerly: a padded decode step run
// without a graph then sums in the very order its recorded replays do.
//
// kAuto runs the SM90 kernel when all of these hold (flashinfer_attention.cu says why):
// DXS_CUDA_PREFILL_SM90 is not "off" (read when fi was created: "auto", the default, or
// "off"; anything else fails every call), FlashInferSm90Available(), no graph_plan, the
// stream is not capturing a graph, and the step is prefill-heavy: its longest query is at
// least 128 rows (one SM90 query tile), its 128-row tiles times the query heads fill the
// SMs, at least 3/4 of the tiles' causal work is real rows (decode rows and ragged tails
// padded to 128 rows waste the rest), and the planner stays within 4096 tiles a head.
// Both kernels round P to bf16 before P.V; they sum in different orders.
cudaError_t LaunchFlashInferAttention(FlashInferAttention* fi, const void* q, const void* k_cache,
                                      const void* v_cache, const PagedAttentionArgs& args,
                                      const int32_t* host_query_start,
                                      const int32_t* host_context_lens, float scale, void* out,
                                      cudaStream_t stream, bool graph_plan = false,
                                      FlashInferKernel kernel = FlashInferKernel::kAuto);

// ---- In CUDA graphs ----
// A plan recorded into a graph: FlashInfer's CUDA-graph plan (a launch shape fixed by the
// sizes, the work list in a buffer the graph copies from pinned memory at each replay).
struct FlashInferGraphPlan;
// While a graph records: the first call of a recording makes *plan (null before) from the
// host lengths, which must be staged memory holding each replay's values; later calls of
// the same recording with the same pointers reuse it. The graph then holds the plan's copy,
// the page-list compaction (once) and the kernels.
cudaError_t RecordFlashInferAttention(FlashInferAttention* fi, FlashInferGraphPlan** plan,
                                      const void* q, const void* k_cache, const void* v_cache,
                                      const PagedAttentionArgs& args,
                                      const int32_t* host_query_start,
                                      const int32_t* host_context_lens, float scale, void* out,
                                      cudaStream_t stream);
// Before each replay: remakes the plan from the staged lengths when they changed, after
// waiting for `last_replay_done` (the previous replay copied the pinned plan). An error if
// the new lengths need another launch shape than the recorded one.
cudaError_t RefreshFlashInferGraphPlan(FlashInferGraphPlan* plan, cudaEvent_t last_replay_done,
                                       cudaStream_t stream);
void DestroyFlashInferGraphPlan(FlashInferGraphPlan* plan);
const char* FlashInferGraphPlanError(const FlashInferGraphPlan* plan);

}  // namespace dxs::cuda
