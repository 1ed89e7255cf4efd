// Paged attention through FlashInfer's header-only batch prefill kernel (the FA2-style
// tensor-core kernel, flashinfer/attention/prefill.cuh), for the shapes it is built for:
// bf16 q, cache and output, head_dim 128. It serves prefill chunks and decode rows in one
// call (SGLang and vLLM call this kernel for decode too when the GQA group is >= 4).
//
// FlashInfer plans on the host: from the per-sequence query and context lengths it picks
// the query tile, whether to split the KV and where each CTA works, and copies the plan to
// the device. So this path needs the lengths on the host (PagedAttentionMeta's host copy).
// The plan depends on the lengths only, so one plan serves every layer of a step: it is
// made again only when the lengths change. In a CUDA graph (decode steps), FlashInfer's
// graph plan keeps one launch shape for every replay; the graph records the copy of the
// plan from pinned memory, and before each replay the plan is remade there from the
// lengths ForwardDecode staged (as SGLang calls plan() before replaying). FlashInfer's paged
// cache is CSR (an indptr over a flat list of page ids), ours a padded table per sequence,
// so a small kernel compacts the table.
#include <cuda_bf16.h>

#include <algorithm>
#include <cstring>
#include <exception>
#include <string>
#include <vector>

#include "flashinfer/attention/default_prefill_params.cuh"
#include "flashinfer/attention/prefill.cuh"
#include "flashinfer/attention/scheduler.cuh"
#include "flashinfer/attention/variants.cuh"
#include "kernels/cuda/flashinfer_attention.cuh"
#include "kernels/cuda/launch.cuh"

namespace dxs::cuda {
namespace {

constexpr int kHeadDim = 128;
// FlashInfer's own default workspaces (the Python wrappers' 128 MB float, 8 MB int).
constexpr size_t kFloatWorkspaceBytes = size_t{128} << 20;
constexpr size_t kIntWorkspaceBytes = size_t{8} << 20;
// A graph plan (a decode step's, up to 256 sequences) is a few KB.
constexpr size_t kGraphPlanBytes = size_t{1} << 20;

using Params =
    flashinfer::BatchPrefillPagedParams<__nv_bfloat16, __nv_bfloat16, __nv_bfloat16, int32_t>;
using Variant = flashinfer::DefaultAttention</*use_custom_mask=*/false,
                                             /*use_sliding_window=*/false,
                                             /*use_logits_soft_cap=*/false, /*use_alibi=*/false>;

// indices[indptr[s] + j] = block_tables[s * width + j] for the pages of sequence s.
__global__ void CompactBlockTableKernel(const int32_t* __restrict__ block_tables, int64_t width,
                                        const int32_t* __restrict__ indptr, int64_t num_seqs,
                                        int32_t* __restrict__ indices) {
  PdlWait();
  const int64_t s = blockIdx.y;
  if (s >= num_seqs) return;
  const int32_t begin = indptr[s], pages = indptr[s + 1] - begin;
  for (int64_t j = blockIdx.x * blockDim.x + threadIdx.x; j < pages; j += gridDim.x * blockDim.x) {
    indices[begin + j] = block_tables[s * width + j];
  }
}

}  // namespace

// One plan: FlashInfer's arrays for the kernel (request and tile indices, output offsets,
// the KV chunk size, merge offsets), then our page indptr | last_page_len, made on the host
// into `pinned` and copied to `device` on the stream.
struct PlanState {
  void* pinned = nullptr;
  void* device = nullptr;
  size_t bytes = 0;
  bool for_graph = false;  // FlashInfer's CUDA-graph plan: a launch shape fixed by the sizes
  flashinfer::PrefillPlanInfo info;
  size_t tail_offset = 0;  // where indptr | last_page_len start in both buffers
  int64_t total_pages = 0;
  // What it was made for.
  std::vector<int32_t> qs, lens;
  int64_t heads = 0, kv_heads = 0, block_size = 0, max_blocks = 0;
};

struct FlashInferAttention {
  void* float_workspace = nullptr;  // split-KV partials, shared by every plan
  PlanState eager;                  // the eager calls' plan
  PlanState eager_graph;            // theirs with graph_plan: a graph's launch shape
  int32_t* indices = nullptr;       // the eager calls' compacted page list
  int64_t indices_capacity = 0;
  cudaEvent_t plan_copied = nullptr;  // the eager plan's copy out of its pinned buffer ran
  std::string last_error;
};

// A plan recorded into a CUDA graph, with its own buffers and page list; made again on the
// host from the staged lengths before each replay whose lengths changed.
struct FlashInferGraphPlan {
  PlanState plan;
  const int32_t* host_query_start = nullptr;
  const int32_t* host_context_lens = nullptr;
  PagedAttentionArgs args;  // the recorded sizes
  int32_t* indices = nullptr;
  void* float_workspace = nullptr;  // the owner's
  std::string last_error;
};

namespace {

cudaError_t Fail(std::string* error, const std::string& what, cudaError_t code) {
  *error = what;
  return code;
}

cudaError_t AllocatePlanBuffers(PlanState* p, size_t bytes, std::string* error) {
  p->bytes = bytes;
  cudaError_t e = cudaMalloc(&p->device, bytes);
  if (e == cudaSuccess) e = cudaMallocHost(&p->pinned, bytes);
  return e == cudaSuccess ? e : Fail(error, "flashinfer attention: plan buffers", e);
}

void FreePlanBuffers(PlanState* p) {
  cudaFree(p->device);
  cudaFreeHost(p->pinned);
  p->device = p->pinned = nullptr;
}

cudaError_t EnsureBuffers(FlashInferAttention* fi) {
  if (fi->float_workspace != nullptr) return cudaSuccess;
  cudaError_t e = cudaMalloc(&fi->float_workspace, kFloatWorkspaceBytes);
  if (e != cudaSuccess) return Fail(&fi->last_error, "flashinfer attention: workspace", e);
  e = AllocatePlanBuffers(&fi->eager, kIntWorkspaceBytes, &fi->last_error);
  fi->eager_graph.for_graph = true;
  if (e == cudaSuccess) e = AllocatePlanBuffers(&fi->eager_graph, kGraphPlanBytes, &fi->last_error);
  if (e == cudaSuccess) e = cudaEventCreateWithFlags(&fi->plan_copied, cudaEventDisableTiming);
  return e == cudaSuccess ? e : Fail(&fi->last_error, "flashinfer attention: buffers", e);
}

bool SameLengths(const PlanState& p, const PagedAttentionArgs& args, const int32_t* qs,
                 const int32_t* lens) {
  const size_t n = static_cast<size_t>(args.num_seqs);
  return p.qs.size() == n + 1 && p.heads == args.num_heads && p.kv_heads == args.num_kv_heads &&
         p.block_size == args.block_size && p.max_blocks == args.max_blocks_per_seq &&
         std::equal(p.qs.begin(), p.qs.end(), qs) && std::equal(p.lens.begin(), p.lens.end(), lens);
}

// Makes p's plan for these lengths in its pinned buffer and enqueues the copies to its
// device buffer (the caller makes sure no earlier copy still reads the pinned buffer).
cudaError_t MakePlan(PlanState* p, void* float_workspace, const PagedAttentionArgs& args,
                     const int32_t* host_query_start, const int32_t* host_context_lens,
                     cudaStream_t stream, std::string* error) {
  const int64_t n = args.num_seqs, bs = args.block_size;
  std::vector<int32_t> qo_indptr(host_query_start, host_query_start + n + 1);
  std::vector<int32_t> page_indptr(n + 1, 0), last_page_len(n);
  bool uniform = true;
  for (int64_t s = 0; s < n; ++s) {
    const int32_t len = host_context_lens[s], q_len = qo_indptr[s + 1] - qo_indptr[s];
    const int32_t pages = static_cast<int32_t>((len + bs - 1) / bs);
    if (len <= 0 || pages > args.max_blocks_per_seq || q_len < 0 || q_len > len) {
      return Fail(error,
                  "flashinfer attention: a sequence without context, with more queries than "
                  "context or more pages than its table",
                  cudaErrorInvalidValue);
    }
    uniform = uniform && q_len == qo_indptr[1] - qo_indptr[0];
    page_indptr[s + 1] = page_indptr[s] + pages;
    last_page_len[s] = len - (pages - 1) * static_cast<int32_t>(bs);
  }
  // indptr | last_page_len go after FlashInfer's arrays, at the end of the buffers.
  const size_t tail_bytes = (2 * n + 1) * sizeof(int32_t);
  const size_t tail_offset = (p->bytes - tail_bytes - 256) / 256 * 256;
  // A graph's plan keeps one launch shape for every replay: uniform query lengths (decode)
  // tell FlashInfer so, and it sizes the grid for the worst case.
  const int64_t uniform_q_len = p->for_graph && uniform ? qo_indptr[1] - qo_indptr[0] : 0;
  cudaError_t e;
  try {
    e = flashinfer::PrefillPlan<int32_t>(
        float_workspace, kFloatWorkspaceBytes, p->device, p->pinned, tail_offset, p->info,
        qo_indptr.data(), page_indptr.data(), static_cast<uint32_t>(args.num_tokens),
        static_cast<uint32_t>(n), static_cast<uint32_t>(args.num_heads),
        static_cast<uint32_t>(args.num_kv_heads), kHeadDim, kHeadDim, static_cast<uint32_t>(bs),
        /*enable_cuda_graph=*/p->for_graph, /*sizeof_dtype_o=*/2, /*window_left=*/-1,
        /*fixed_split_size=*/-1, /*disable_split_kv=*/false, /*num_colocated_ctas=*/0,
        uniform_q_len, /*fixed_uniform_q_len=*/uniform_q_len > 0, stream);
  } catch (const std::exception& ex) {
    return Fail(error, std::string("flashinfer attention: plan: ") + ex.what(),
                cudaErrorInvalidValue);
  }
  if (e != cudaSuccess) return Fail(error, "flashinfer attention: plan", e);
  char* host_tail = static_cast<char*>(p->pinned) + tail_offset;
  std::memcpy(host_tail, page_indptr.data(), (n + 1) * sizeof(int32_t));
  std::memcpy(host_tail + (n + 1) * sizeof(int32_t), last_page_len.data(), n * sizeof(int32_t));
  e = cudaMemcpyAsync(static_cast<char*>(p->device) + tail_offset, host_tail, tail_bytes,
                      cudaMemcpyHostToDevice, stream);
  if (e != cudaSuccess) return Fail(error, "flashinfer attention: plan copy", e);
  p->tail_offset = tail_offset;
  p->total_pages = page_indptr[n];
  p->qs = std::move(qo_indptr);
  p->lens.assign(host_context_lens, host_context_lens + n);
  p->heads = args.num_heads;
  p->kv_heads = args.num_kv_heads;
  p->block_size = bs;
  p->max_blocks = args.max_blocks_per_seq;
  return cudaSuccess;
}

// The page list from the padded block table, then the kernel (and its split merge), on the
// plan in p's device buffer.
cudaError_t RunPlanned(const PlanState& p, void* float_workspace, int32_t* indices, const void* q,
                       const void* k_cache, const void* v_cache, const PagedAttentionArgs& args,
                       float scale, void* out, bool compact, cudaStream_t stream,
                       std::string* error) {
  const int64_t n = args.num_seqs;
  int32_t* dev_tail = reinterpret_cast<int32_t*>(static_cast<char*>(p.device) + p.tail_offset);
  int32_t* indptr = dev_tail;
  int32_t* last_page_len = dev_tail + n + 1;
  if (compact) {
    const dim3 grid(static_cast<unsigned>((args.max_blocks_per_seq + 255) / 256),
                    static_cast<unsigned>(n));
    LaunchKernel(CompactBlockTableKernel, grid, 256, 0, stream, args.block_tables,
                 args.max_blocks_per_seq, indptr, n, indices);
    const cudaError_t e = cudaGetLastError();
    if (e != cudaSuccess) return Fail(error, "flashinfer attention: compact block table", e);
  }
  using flashinfer::GetPtrFromBaseOffset;
  Params params;
  params.q = static_cast<__nv_bfloat16*>(const_cast<void*>(q));
  params.paged_kv = flashinfer::paged_kv_t<__nv_bfloat16, int32_t>(
      static_cast<uint32_t>(args.num_kv_heads), static_cast<uint32_t>(args.block_size), kHeadDim,
      static_cast<uint32_t>(n), flashinfer::QKVLayout::kNHD,
      static_cast<__nv_bfloat16*>(const_cast<void*>(k_cache)),
      static_cast<__nv_bfloat16*>(const_cast<void*>(v_cache)), indices, indptr, last_page_len);
  params.q_indptr = const_cast<int32_t*>(args.query_start);
  params.o = static_cast<__nv_bfloat16*>(out);
  params.lse = nullptr;
  params.num_qo_heads = static_cast<uint32_t>(args.num_heads);
  params.group_size =
      flashinfer::uint_fastdiv(static_cast<uint32_t>(args.num_heads / args.num_kv_heads));
  params.q_stride_n = static_cast<int32_t>(args.num_heads * kHeadDim);
  params.q_stride_h = kHeadDim;
  params.window_left = -1;
  params.logits_soft_cap = 0.f;
  params.sm_scale = scale;
  params.rope_rcp_scale = 1.f;
  params.rope_rcp_theta = 1.f / 1e4f;
  void* ib = p.device;
  const flashinfer::PrefillPlanInfo& info = p.info;
  params.request_indices = GetPtrFromBaseOffset<int32_t>(ib, info.request_indices_offset);
  params.qo_tile_indices = GetPtrFromBaseOffset<int32_t>(ib, info.qo_tile_indices_offset);
  params.kv_tile_indices = GetPtrFromBaseOffset<int32_t>(ib, info.kv_tile_indices_offset);
  params.o_indptr = GetPtrFromBaseOffset<int32_t>(ib, info.o_indptr_offset);
  params.kv_chunk_size_ptr = GetPtrFromBaseOffset<int32_t>(ib, info.kv_chunk_size_ptr_offset);
  __nv_bfloat16* tmp_v = nullptr;
  float* tmp_s = nullptr;
  if (info.split_kv) {
    params.merge_indptr = GetPtrFromBaseOffset<int32_t>(ib, info.merge_indptr_offset);
    tmp_v = GetPtrFromBaseOffset<__nv_bfloat16>(float_workspace, info.v_offset);
    tmp_s = GetPtrFromBaseOffset<float>(float_workspace, info.s_offset);
  }
  params.padded_batch_size = static_cast<uint32_t>(info.padded_batch_size);
  params.max_total_num_rows = static_cast<uint32_t>(info.total_num_rows);
  if (info.enable_cuda_graph) {
    params.block_valid_mask = GetPtrFromBaseOffset<bool>(ib, info.block_valid_mask_offset);
    params.total_num_rows = GetPtrFromBaseOffset<uint32_t>(ib, info.total_num_rows_offset);
  }
  cudaError_t e = cudaSuccess;
  try {
    switch (info.cta_tile_q) {
#define DXS_FI_TILE(TILE)                                                                          \
  case TILE:                                                                                       \
    e = flashinfer::BatchPrefillWithPagedKVCacheDispatched<                                        \
        /*SAME_KV_STRIDES=*/true, TILE, kHeadDim, kHeadDim, flashinfer::PosEncodingMode::kNone,    \
        /*USE_FP16_QK_REDUCTION=*/false, flashinfer::MaskMode::kCausal,                            \
        /*USE_TOKEN_HEAD_SF=*/false, Variant, Params>(params, tmp_v, tmp_s, PdlEnabled(), stream); \
    break;
      DXS_FI_TILE(16)
      DXS_FI_TILE(64)
      DXS_FI_TILE(128)
#undef DXS_FI_TILE
      default:
        return Fail(
            error, "flashinfer attention: unexpected query tile " + std::to_string(info.cta_tile_q),
            cudaErrorInvalidValue);
    }
  } catch (const std::exception& ex) {
    return Fail(error, std::string("flashinfer attention: ") + ex.what(), cudaErrorInvalidValue);
  }
  return e == cudaSuccess ? e : Fail(error, "flashinfer attention: launch", e);
}

bool ArgsOk(const PagedAttentionArgs& args, const int32_t* host_query_start,
            const int32_t* host_context_lens) {
  return host_query_start != nullptr && host_context_lens != nullptr && args.head_dim == kHeadDim &&
         args.num_seqs >= 0 && args.num_kv_heads > 0 && args.num_heads % args.num_kv_heads == 0;
}

}  // namespace

FlashInferAttention* CreateFlashInferAttention() { return new FlashInferAttention(); }

void DestroyFlashInferAttention(FlashInferAttention* fi) {
  if (fi == nullptr) return;
  if (fi->plan_copied != nullptr) cudaEventSynchronize(fi->plan_copied);
  cudaFree(fi->float_workspace);
  FreePlanBuffers(&fi->eager);
  FreePlanBuffers(&fi->eager_graph);
  cudaFree(fi->indices);
  if (fi->plan_copied != nullptr) cudaEventDestroy(fi->plan_copied);
  delete fi;
}

const char* FlashInferAttentionError(const FlashInferAttention* fi) {
  return fi == nullptr ? "" : fi->last_error.c_str();
}

bool FlashInferAttentionSupports(ElemType q_type, ElemType cache_type, ElemType out_type,
                                 int64_t num_heads, int64_t num_kv_heads, int64_t head_dim) {
  return q_type == ElemType::kBF16 && cache_type == ElemType::kBF16 &&
         out_type == ElemType::kBF16 && head_dim == kHeadDim && num_kv_heads > 0 &&
         num_heads % num_kv_heads == 0;
}

cudaError_t LaunchFlashInferAttention(FlashInferAttention* fi, const void* q, const void* k_cache,
                                      const void* v_cache, const PagedAttentionArgs& args,
                                      const int32_t* host_query_start,
                                      const int32_t* host_context_lens, float scale, void* out,
                                      cudaStream_t stream, bool graph_plan) {
  if (fi == nullptr || !ArgsOk(args, host_query_start, host_context_lens)) {
    return cudaErrorInvalidValue;
  }
  if (args.num_tokens == 0 || args.num_seqs == 0) return cudaSuccess;
  cudaError_t e = EnsureBuffers(fi);
  if (e != cudaSuccess) return e;
  PlanState& plan = graph_plan ? fi->eager_graph : fi->eager;
  if (!SameLengths(plan, args, host_query_start, host_context_lens)) {
    // The previous plan's copy must have left the pinned buffer before it is rewritten.
    e = cudaEventSynchronize(fi->plan_copied);
    if (e != cudaSuccess) return Fail(&fi->last_error, "flashinfer attention: plan event", e);
    e = MakePlan(&plan, fi->float_workspace, args, host_query_start, host_context_lens, stream,
                 &fi->last_error);
    if (e == cudaSuccess) e = cudaEventRecord(fi->plan_copied, stream);
    if (e != cudaSuccess) return e;
  }
  if (plan.total_pages > fi->indices_capacity) {
    // Earlier kernels may still read the old list: the list grows rarely, so wait.
    cudaStreamSynchronize(stream);
    cudaFree(fi->indices);
    fi->indices = nullptr;
    const int64_t capacity = std::max<int64_t>(plan.total_pages * 2, 1024);
    e = cudaMalloc(&fi->indices, capacity * sizeof(int32_t));
    if (e != cudaSuccess) return Fail(&fi->last_error, "flashinfer attention: page list", e);
    fi->indices_capacity = capacity;
  }
  // The table is compacted on every call: the same lengths may come with another table.
  return RunPlanned(plan, fi->float_workspace, fi->indices, q, k_cache, v_cache, args, scale, out,
                    /*compact=*/true, stream, &fi->last_error);
}

cudaError_t RecordFlashInferAttention(FlashInferAttention* fi, FlashInferGraphPlan** plan,
                                      const void* q, const void* k_cache, const void* v_cache,
                                      const PagedAttentionArgs& args,
                                      const int32_t* host_query_start,
                                      const int32_t* host_context_lens, float scale, void* out,
                                      cudaStream_t stream) {
  if (fi == nullptr || plan == nullptr || !ArgsOk(args, host_query_start, host_context_lens)) {
    return cudaErrorInvalidValue;
  }
  if (args.num_tokens == 0 || args.num_seqs == 0) return cudaSuccess;
  cudaError_t e = EnsureBuffers(fi);
  if (e != cudaSuccess) return e;
  FlashInferGraphPlan* gp = *plan;
  const bool reuse = gp != nullptr && gp->host_query_start == host_query_start &&
                     gp->host_context_lens == host_context_lens &&
                     gp->args.num_seqs == args.num_seqs &&
                     gp->args.max_blocks_per_seq == args.max_blocks_per_seq &&
                     gp->args.block_tables == args.block_tables &&
                     SameLengths(gp->plan, args, host_query_start, host_context_lens);
  if (!reuse) {
    if (gp != nullptr)
      return Fail(&fi->last_error, "flashinfer attention: one graph plan per recording",
                  cudaErrorInvalidValue);
    gp = new FlashInferGraphPlan();
    *plan = gp;
    gp->host_query_start = host_query_start;
    gp->host_context_lens = host_context_lens;
    gp->args = args;
    gp->float_workspace = fi->float_workspace;
    gp->plan.for_graph = true;
    e = AllocatePlanBuffers(&gp->plan, kGraphPlanBytes, &fi->last_error);
    if (e == cudaSuccess) {
      e = cudaMalloc(&gp->indices, std::max<int64_t>(args.num_seqs * args.max_blocks_per_seq, 1) *
                                       sizeof(int32_t));
    }
    if (e != cudaSuccess) return Fail(&fi->last_error, "flashinfer attention: graph plan", e);
    // Made now on the host, and its copies recorded: each replay copies the pinned plan
    // that RefreshFlashInferGraphPlan rewrote.
    e = MakePlan(&gp->plan, fi->float_workspace, args, host_query_start, host_context_lens, stream,
                 &fi->last_error);
    if (e != cudaSuccess) return e;
  }
  // The page list once per recording (every layer reads the same table).
  return RunPlanned(gp->plan, fi->float_workspace, gp->indices, q, k_cache, v_cache, args, scale,
                    out, /*compact=*/!reuse, stream, &fi->last_error);
}

cudaError_t RefreshFlashInferGraphPlan(FlashInferGraphPlan* gp, cudaEvent_t last_replay_done,
                                       cudaStream_t stream) {
  if (gp == nullptr) return cudaErrorInvalidValue;
  if (SameLengths(gp->plan, gp->args, gp->host_query_start, gp->host_context_lens)) {
    return cudaSuccess;
  }
  // The last replay's recorded copy read the pinned plan: wait for it before rewriting.
  if (last_replay_done != nullptr) {
    const cudaError_t e = cudaEventSynchronize(last_replay_done);
    if (e != cudaSuccess) return Fail(&gp->last_error, "flashinfer attention: replay event", e);
  }
  const flashinfer::PrefillPlanInfo recorded = gp->plan.info;
  const size_t recorded_tail = gp->plan.tail_offset;
  // MakePlan also enqueues the copy itself; the graph copies again: harmless, and the
  // replay reads what both wrote.
  cudaError_t e = MakePlan(&gp->plan, gp->float_workspace, gp->args, gp->host_query_start,
                           gp->host_context_lens, stream, &gp->last_error);
  if (e != cudaSuccess) return e;
  if (gp->plan.info.ToVector() != recorded.ToVector() || gp->plan.tail_offset != recorded_tail) {
    return Fail(&gp->last_error,
                "flashinfer attention: the replay's plan has another launch shape than the "
                "recorded one",
                cudaErrorInvalidValue);
  }
  return cudaSuccess;
}

void DestroyFlashInferGraphPlan(FlashInferGraphPlan* gp) {
  if (gp == nullptr) return;
  FreePlanBuffers(&gp->plan);
  cudaFree(gp->indices);
  delete gp;
}

const char* FlashInferGraphPlanError(const FlashInferGraphPlan* gp) {
  return gp == nullptr ? "" : gp->last_error.c_str();
}

}  // namespace dxs::cuda
