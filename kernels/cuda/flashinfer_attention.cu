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
//
// On sm_90, prefill-heavy eager steps take FlashInfer's SM90 kernel instead
// (flashinfer_prefill_sm90.cu: FlashAttention-3's TMA/wgmma design, its own planner). The
// routing, the lengths' checks and the page-list compaction stay here; see PrefillHeavy.
#include <cuda_bf16.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <string>
#include <vector>

#include "common/tunables.h"
#include "flashinfer/attention/default_prefill_params.cuh"
#include "flashinfer/attention/prefill.cuh"
#include "flashinfer/attention/scheduler.cuh"
#include "flashinfer/attention/variants.cuh"
#include "kernels/cuda/flashinfer_attention.cuh"
#include "kernels/cuda/flashinfer_prefill_sm90.cuh"
#include "kernels/cuda/launch.cuh"

// Whether flashinfer_prefill_sm90.cu is built in (kernels/cuda/CMakeLists.txt).
#ifndef DXS_HAVE_FLASHINFER_SM90
#define DXS_HAVE_FLASHINFER_SM90 0
#endif

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

// What a plan was made for: the lengths, and the sizes that shape it.
struct PlanKey {
  std::vector<int32_t> qs, lens;
  int64_t heads = 0, kv_heads = 0, block_size = 0, max_blocks = 0;

  bool Matches(const PagedAttentionArgs& args, const int32_t* host_qs,
               const int32_t* host_lens) const {
    const size_t n = static_cast<size_t>(args.num_seqs);
    return qs.size() == n + 1 && heads == args.num_heads && kv_heads == args.num_kv_heads &&
           block_size == args.block_size && max_blocks == args.max_blocks_per_seq &&
           std::equal(qs.begin(), qs.end(), host_qs) &&
           std::equal(lens.begin(), lens.end(), host_lens);
  }
  void Set(const PagedAttentionArgs& args, const int32_t* host_qs, const int32_t* host_lens) {
    qs.assign(host_qs, host_qs + args.num_seqs + 1);
    lens.assign(host_lens, host_lens + args.num_seqs);
    heads = args.num_heads;
    kv_heads = args.num_kv_heads;
    block_size = args.block_size;
    max_blocks = args.max_blocks_per_seq;
  }
};

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
  PlanKey key;  // what it was made for
};

struct FlashInferAttention {
  void* float_workspace = nullptr;  // split-KV partials, shared by every plan
  PlanState eager;                  // the eager calls' plan
  PlanState eager_graph;            // theirs with graph_plan: a graph's launch shape
  int32_t* indices = nullptr;       // the eager calls' compacted page list (both kernels)
  int64_t indices_capacity = 0;
  cudaEvent_t plan_copied = nullptr;  // the eager plan's copy out of its pinned buffer ran
  // The SM90 kernel: DXS_CUDA_PREFILL_SM90 as read at creation, whether it runs on this
  // device (-1: not asked yet) and the device's SMs, its plan and what that was made for.
  bool sm90_off = false;
  std::string switch_error;  // an unknown DXS_CUDA_PREFILL_SM90, reported by every call
  int sm90_runs = -1;
  int num_sms = 0;
  FlashInferSm90Plan* sm90 = nullptr;
  PlanKey sm90_key;
  int64_t sm90_total_pages = 0;
  FlashInferKernel last_kernel = FlashInferKernel::kAuto;
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

// The CSR page lists of the sequences' pages (indptr [num_seqs + 1] into the compacted list,
// the last page's filled slots), after checking the lengths.
cudaError_t BuildPageLists(const PagedAttentionArgs& args, const int32_t* host_query_start,
                           const int32_t* host_context_lens, std::vector<int32_t>* page_indptr,
                           std::vector<int32_t>* last_page_len, std::string* error) {
  const int64_t n = args.num_seqs, bs = args.block_size;
  page_indptr->assign(n + 1, 0);
  last_page_len->assign(n, 0);
  for (int64_t s = 0; s < n; ++s) {
    const int32_t len = host_context_lens[s];
    const int32_t q_len = host_query_start[s + 1] - host_query_start[s];
    const int32_t pages = static_cast<int32_t>((len + bs - 1) / bs);
    if (len <= 0 || pages > args.max_blocks_per_seq || q_len < 0 || q_len > len) {
      return Fail(error,
                  "flashinfer attention: a sequence without context, with more queries than "
                  "context or more pages than its table",
                  cudaErrorInvalidValue);
    }
    (*page_indptr)[s + 1] = (*page_indptr)[s] + pages;
    (*last_page_len)[s] = len - (pages - 1) * static_cast<int32_t>(bs);
  }
  return cudaSuccess;
}

// Makes p's plan for these lengths in its pinned buffer and enqueues the copies to its
// device buffer (the caller makes sure no earlier copy still reads the pinned buffer).
cudaError_t MakePlan(PlanState* p, void* float_workspace, const PagedAttentionArgs& args,
                     const int32_t* host_query_start, const int32_t* host_context_lens,
                     cudaStream_t stream, std::string* error) {
  const int64_t n = args.num_seqs, bs = args.block_size;
  std::vector<int32_t> qo_indptr(host_query_start, host_query_start + n + 1);
  std::vector<int32_t> page_indptr, last_page_len;
  cudaError_t e = BuildPageLists(args, host_query_start, host_context_lens, &page_indptr,
                                 &last_page_len, error);
  if (e != cudaSuccess) return e;
  bool uniform = true;
  for (int64_t s = 0; s < n; ++s) {
    uniform = uniform && qo_indptr[s + 1] - qo_indptr[s] == qo_indptr[1] - qo_indptr[0];
  }
  // indptr | last_page_len go after FlashInfer's arrays, at the end of the buffers.
  const size_t tail_bytes = (2 * n + 1) * sizeof(int32_t);
  const size_t tail_offset = (p->bytes - tail_bytes - 256) / 256 * 256;
  // A graph's plan keeps one launch shape for every replay: uniform query lengths (decode)
  // tell FlashInfer so, and it sizes the grid for the worst case.
  const int64_t uniform_q_len = p->for_graph && uniform ? qo_indptr[1] - qo_indptr[0] : 0;
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
  p->key.Set(args, host_query_start, host_context_lens);
  return cudaSuccess;
}

// indices := the padded block table compacted by `indptr` (device).
cudaError_t CompactPages(const PagedAttentionArgs& args, const int32_t* indptr, int32_t* indices,
                         cudaStream_t stream, std::string* error) {
  const dim3 grid(static_cast<unsigned>((args.max_blocks_per_seq + 255) / 256),
                  static_cast<unsigned>(args.num_seqs));
  LaunchKernel(CompactBlockTableKernel, grid, 256, 0, stream, args.block_tables,
               args.max_blocks_per_seq, indptr, args.num_seqs, indices);
  const cudaError_t e = cudaGetLastError();
  return e == cudaSuccess ? e : Fail(error, "flashinfer attention: compact block table", e);
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
    const cudaError_t e = CompactPages(args, indptr, indices, stream, error);
    if (e != cudaSuccess) return e;
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

// The compacted page list holds at least total_pages entries.
cudaError_t EnsureIndices(FlashInferAttention* fi, int64_t total_pages, cudaStream_t stream) {
  if (total_pages <= fi->indices_capacity) return cudaSuccess;
  // Earlier kernels may still read the old list: the list grows rarely, so wait.
  cudaStreamSynchronize(stream);
  cudaFree(fi->indices);
  fi->indices = nullptr;
  fi->indices_capacity = 0;
  const int64_t capacity = std::max<int64_t>(total_pages * 2, 1024);
  const cudaError_t e = cudaMalloc(&fi->indices, capacity * sizeof(int32_t));
  if (e != cudaSuccess) return Fail(&fi->last_error, "flashinfer attention: page list", e);
  fi->indices_capacity = capacity;
  return cudaSuccess;
}

// ---- The SM90 kernel for prefill-heavy eager steps ----
//
// FlashInfer's SM90 kernel is FlashAttention-3's design (TMA loads of Q, wgmma, a producer
// warpgroup feeding two consumer warpgroups, softmax overlapped with the next tile's GEMM)
// with a gathering cp.async producer for paged K/V. On long causal prompts it should be the
// faster kernel: the FA2 one reaches 258 TFLOP/s on a 4096-token prompt (docs/gpu.md), about
// a third of the H200's dense bf16 rate, where the FA3 paper reports 60-70% of it for causal
// head_dim 128 (on contiguous K/V; this one gathers pages, so expect less: gpu_bench's
// "FA3 (sm90)" column measures it). But it works in 128-row query tiles per query head, with
// no GQA packing and no split-KV, so it loses where those matter; kAuto takes it only for
// steps that are prefill-heavy:
// - the longest query has at least kSm90MinQueryRows = 128 rows, one full query tile: below,
//   every tile is partly empty, and a short chunk is a few microseconds on either kernel
//   (the FA2 one splitting the KV of few rows over a long prefix across the SMs);
// - its tiles times the query heads fill the SMs (one wave), as it cannot split the KV to
//   make more work: a 128-row chunk over a 16k prefix with 32 heads would be 32 CTAs on
//   132 SMs;
// - at least 3/4 of its tiles' causal work (rows x keys up to each tile's last row) is real
//   rows. A decode row or a ragged tail costs it a whole 128-row tile per head where the FA2
//   kernel packs the GQA group's rows, so a mixed step with many decode rows over long
//   contexts is cheaper on FA2. If the SM90 kernel is s times faster per real row, it wins
//   down to 1/s real; 3/4 keeps a margin for s as low as 1.33 and for the estimate (the
//   kernel's 96-key tiles, the planner's balance). A choice to revisit with mixed steps
//   measured on the H200;
// - FlashInfer's planner stays on the per-work scheduler (at most 4096 tiles a head), the one
//   instantiated.
// Graph plans (decode) and calls while a graph records stay on FA2: the SM90 plan is eager.
constexpr int64_t kSm90MinQueryRows = 128;

// Whether the step's lengths make it prefill-heavy (above) on a GPU of num_sms SMs.
bool PrefillHeavy(const PagedAttentionArgs& args, const int32_t* host_query_start,
                  const int32_t* host_context_lens, int num_sms) {
  const int64_t n = args.num_seqs, tile = kSm90QueryTile;
  int64_t max_q = 0;
  for (int64_t s = 0; s < n; ++s) {
    max_q = std::max<int64_t>(max_q, host_query_start[s + 1] - host_query_start[s]);
  }
  if (max_q < kSm90MinQueryRows) return false;
  if ((args.num_tokens + tile - 1) / tile + n - 1 > kSm90MaxTilesPerHead) return false;
  int64_t tiles = 0;
  double real = 0, padded = 0;
  for (int64_t s = 0; s < n; ++s) {
    const int64_t q = host_query_start[s + 1] - host_query_start[s], len = host_context_lens[s];
    for (int64_t first = 0; first < q; first += tile) {
      const int64_t rows = std::min(tile, q - first);
      // The keys up to the tile's last row (queries are the context's last q positions).
      const double keys = static_cast<double>(std::max<int64_t>(len - q + first + rows, 0));
      real += rows * keys;
      padded += tile * keys;
      ++tiles;
    }
  }
  return tiles * args.num_heads >= num_sms && 4 * real >= 3 * padded;
}

// Whether the SM90 kernel runs on this device (built, sm_90), and its SMs: asked once.
cudaError_t InitSm90(FlashInferAttention* fi) {
  if (fi->sm90_runs >= 0) return cudaSuccess;
  if (!FlashInferSm90Available()) {
    fi->sm90_runs = 0;
    return cudaSuccess;
  }
  int device = 0;
  cudaError_t e = cudaGetDevice(&device);
  if (e == cudaSuccess) {
    e = cudaDeviceGetAttribute(&fi->num_sms, cudaDevAttrMultiProcessorCount, device);
  }
  if (e != cudaSuccess) return Fail(&fi->last_error, "flashinfer attention: device attributes", e);
  fi->sm90_runs = 1;
  return cudaSuccess;
}

// Whether a graph is being captured on the stream: the SM90 kernel's plan is copied from
// pinned memory when it is made, eagerly only.
cudaError_t Capturing(FlashInferAttention* fi, cudaStream_t stream, bool* capturing) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  const cudaError_t e = cudaStreamIsCapturing(stream, &status);
  if (e != cudaSuccess) return Fail(&fi->last_error, "flashinfer attention: capture status", e);
  *capturing = status != cudaStreamCaptureStatusNone;
  return cudaSuccess;
}

// The step on the SM90 kernel: its plan (made again only when the lengths change), the
// page list compacted by the plan's indptr, the kernel.
cudaError_t LaunchSm90(FlashInferAttention* fi, const void* q, const void* k_cache,
                       const void* v_cache, const PagedAttentionArgs& args,
                       const int32_t* host_query_start, const int32_t* host_context_lens,
                       float scale, void* out, cudaStream_t stream) {
#if DXS_HAVE_FLASHINFER_SM90
  if (fi->sm90 == nullptr) fi->sm90 = CreateFlashInferSm90Plan();
  cudaError_t e;
  if (!fi->sm90_key.Matches(args, host_query_start, host_context_lens)) {
    fi->sm90_key = PlanKey();  // a failed plan is made again by the next call
    std::vector<int32_t> page_indptr, last_page_len;
    e = BuildPageLists(args, host_query_start, host_context_lens, &page_indptr, &last_page_len,
                       &fi->last_error);
    if (e != cudaSuccess) return e;
    e = MakeFlashInferSm90Plan(fi->sm90, args, host_query_start, host_context_lens,
                               page_indptr.data(), stream, &fi->last_error);
    if (e != cudaSuccess) return e;
    fi->sm90_key.Set(args, host_query_start, host_context_lens);
    fi->sm90_total_pages = page_indptr[args.num_seqs];
  }
  e = EnsureIndices(fi, fi->sm90_total_pages, stream);
  if (e != cudaSuccess) return e;
  // The table is compacted on every call: the same lengths may come with another table.
  e = CompactPages(args, FlashInferSm90PageIndptr(fi->sm90), fi->indices, stream, &fi->last_error);
  if (e != cudaSuccess) return e;
  return RunFlashInferSm90(fi->sm90, q, k_cache, v_cache, args, fi->indices, scale, out, stream,
                           &fi->last_error);
#else
  (void)q, (void)k_cache, (void)v_cache, (void)args, (void)host_query_start;
  (void)host_context_lens, (void)scale, (void)out, (void)stream;
  return Fail(&fi->last_error, "flashinfer attention: built without the SM90 kernel",
              cudaErrorNotSupported);
#endif
}

}  // namespace

FlashInferAttention* CreateFlashInferAttention() {
  FlashInferAttention* fi = new FlashInferAttention();
  // Read once per instance (the backend makes one), like the backend's other switches.
  const absl::StatusOr<std::string> choice = tunables::Read(tunables::kCudaPrefillSm90);
  if (!choice.ok()) {
    fi->switch_error = std::string(choice.status().message());
  } else {
    fi->sm90_off = *choice == "off";
  }
  return fi;
}

void DestroyFlashInferAttention(FlashInferAttention* fi) {
  if (fi == nullptr) return;
  if (fi->plan_copied != nullptr) cudaEventSynchronize(fi->plan_copied);
  cudaFree(fi->float_workspace);
  FreePlanBuffers(&fi->eager);
  FreePlanBuffers(&fi->eager_graph);
#if DXS_HAVE_FLASHINFER_SM90
  DestroyFlashInferSm90Plan(fi->sm90);
#endif
  cudaFree(fi->indices);
  if (fi->plan_copied != nullptr) cudaEventDestroy(fi->plan_copied);
  delete fi;
}

bool FlashInferSm90Available() {
#if DXS_HAVE_FLASHINFER_SM90
  // Built for sm_90a only, which runs on compute capability 9.0 exactly.
  int device = 0, major = 0, minor = 0;
  return cudaGetDevice(&device) == cudaSuccess &&
         cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) == cudaSuccess &&
         cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device) == cudaSuccess &&
         major == 9 && minor == 0;
#else
  return false;
#endif
}

FlashInferKernel FlashInferLastKernel(const FlashInferAttention* fi) {
  return fi == nullptr ? FlashInferKernel::kAuto : fi->last_kernel;
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
                                      cudaStream_t stream, bool graph_plan,
                                      FlashInferKernel kernel) {
  if (fi == nullptr || !ArgsOk(args, host_query_start, host_context_lens)) {
    return cudaErrorInvalidValue;
  }
  if (!fi->switch_error.empty()) {
    return Fail(&fi->last_error, fi->switch_error, cudaErrorInvalidValue);
  }
  if (graph_plan && kernel == FlashInferKernel::kSm90) {
    return Fail(&fi->last_error, "flashinfer attention: the SM90 kernel has no graph plan",
                cudaErrorInvalidValue);
  }
  if (args.num_tokens == 0 || args.num_seqs == 0) return cudaSuccess;
  cudaError_t e;
  const bool forced = kernel == FlashInferKernel::kSm90;
  if (forced || (kernel == FlashInferKernel::kAuto && !graph_plan && !fi->sm90_off)) {
    e = InitSm90(fi);
    if (e != cudaSuccess) return e;
    bool capturing = false;
    const bool wanted =
        fi->sm90_runs == 1 &&
        (forced || PrefillHeavy(args, host_query_start, host_context_lens, fi->num_sms));
    if (wanted) {
      e = Capturing(fi, stream, &capturing);
      if (e != cudaSuccess) return e;
    }
    if (forced && (fi->sm90_runs != 1 || capturing)) {
      return Fail(&fi->last_error,
                  "flashinfer attention: the SM90 kernel does not run here (not an sm_90 GPU, "
                  "not built, or a graph is being captured)",
                  cudaErrorNotSupported);
    }
    if (wanted && !capturing) {
      e = LaunchSm90(fi, q, k_cache, v_cache, args, host_query_start, host_context_lens, scale, out,
                     stream);
      if (e == cudaSuccess) fi->last_kernel = FlashInferKernel::kSm90;
      return e;
    }
  }
  e = EnsureBuffers(fi);
  if (e != cudaSuccess) return e;
  PlanState& plan = graph_plan ? fi->eager_graph : fi->eager;
  if (!plan.key.Matches(args, host_query_start, host_context_lens)) {
    // The previous plan's copy must have left the pinned buffer before it is rewritten.
    e = cudaEventSynchronize(fi->plan_copied);
    if (e != cudaSuccess) return Fail(&fi->last_error, "flashinfer attention: plan event", e);
    e = MakePlan(&plan, fi->float_workspace, args, host_query_start, host_context_lens, stream,
                 &fi->last_error);
    if (e == cudaSuccess) e = cudaEventRecord(fi->plan_copied, stream);
    if (e != cudaSuccess) return e;
  }
  e = EnsureIndices(fi, plan.total_pages, stream);
  if (e != cudaSuccess) return e;
  // The table is compacted on every call: the same lengths may come with another table.
  e = RunPlanned(plan, fi->float_workspace, fi->indices, q, k_cache, v_cache, args, scale, out,
                 /*compact=*/true, stream, &fi->last_error);
  if (e == cudaSuccess) fi->last_kernel = FlashInferKernel::kFa2;
  return e;
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
  if (!fi->switch_error.empty()) {
    return Fail(&fi->last_error, fi->switch_error, cudaErrorInvalidValue);
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
                     gp->plan.key.Matches(args, host_query_start, host_context_lens);
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
  e = RunPlanned(gp->plan, fi->float_workspace, gp->indices, q, k_cache, v_cache, args, scale, out,
                 /*compact=*/!reuse, stream, &fi->last_error);
  if (e == cudaSuccess) fi->last_kernel = FlashInferKernel::kFa2;
  return e;
}

cudaError_t RefreshFlashInferGraphPlan(FlashInferGraphPlan* gp, cudaEvent_t last_replay_done,
                                       cudaStream_t stream) {
  if (gp == nullptr) return cudaErrorInvalidValue;
  if (gp->plan.key.Matches(gp->args, gp->host_query_start, gp->host_context_lens)) {
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
