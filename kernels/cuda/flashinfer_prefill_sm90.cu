// FlashInfer's SM90 batch prefill kernel over our paged cache (flashinfer_prefill_sm90.cuh
// says why it is a file of its own). Every template instantiation of the hopper kernel is
// here: bf16 q, cache and output, head_dim 128, causal, no sliding window, the per-work
// (persistent) tile scheduler.
//
// FlashInfer's SM90 planner (PrefillSM90Plan) cuts each sequence's queries into 128-row
// tiles and deals the (tile, query head) works to the SMs longest first, balancing an
// estimated cost per SM; the kernel runs one CTA per SM over its list. Unlike the FA2 path
// there is no split-KV and so no partial-merge workspace: the plan is the only buffer. The
// mask is FlashInfer's causal one for queries at the end of their context (query i of q_len
// over a context L sees keys [0, L - q_len + i]), as in the FA2 kernel and our own.
#include <cuda_bf16.h>

#include <algorithm>
#include <cstring>
#include <exception>
#include <string>
#include <vector>

#include "flashinfer/attention/hopper/default_params.cuh"
#include "flashinfer/attention/hopper/prefill_sm90.cuh"
#include "flashinfer/attention/hopper/variants.cuh"
#include "flashinfer/attention/scheduler.cuh"
#include "kernels/cuda/flashinfer_prefill_sm90.cuh"
#include "kernels/cuda/launch.cuh"

namespace dxs::cuda {
namespace {

constexpr int kHeadDim = 128;
// The planner's arrays (7 per work, one per SM) are a few MB at most for the steps routed
// here (e.g. 32 heads x 4096 tiles: 3.7 MB); the buffers start here and grow on demand.
constexpr size_t kMinPlanBytes = size_t{1} << 20;

using DType = cutlass::bfloat16_t;  // FlashInfer's cutlass_dtype_t<__nv_bfloat16>
using Params = flashinfer::BatchPrefillPagedParams<DType, DType, DType, int32_t>;
using Variant = flashinfer::StandardAttention;  // DefaultAttention</*use_logits_soft_cap=*/false>

cudaError_t Fail(std::string* error, const std::string& what, cudaError_t code) {
  *error = what;
  return code;
}

size_t Align(size_t bytes, size_t to) { return (bytes + to - 1) / to * to; }

}  // namespace

struct FlashInferSm90Plan {
  void* pinned = nullptr;
  void* device = nullptr;
  size_t bytes = 0;
  flashinfer::PrefillPlanSM90Info info;
  size_t tail_offset = 0;        // our page indptr, in both buffers
  cudaEvent_t copied = nullptr;  // the last plan's copies out of `pinned` ran
  int num_sms = 0;               // the planner's CTAs (one per SM)
  bool valid = false;            // a plan was made and not spoiled by a failed one
};

FlashInferSm90Plan* CreateFlashInferSm90Plan() { return new FlashInferSm90Plan(); }

void DestroyFlashInferSm90Plan(FlashInferSm90Plan* p) {
  if (p == nullptr) return;
  if (p->copied != nullptr) {
    cudaEventSynchronize(p->copied);
    cudaEventDestroy(p->copied);
  }
  cudaFree(p->device);
  cudaFreeHost(p->pinned);
  delete p;
}

cudaError_t MakeFlashInferSm90Plan(FlashInferSm90Plan* p, const PagedAttentionArgs& args,
                                   const int32_t* host_query_start,
                                   const int32_t* host_context_lens, const int32_t* page_indptr,
                                   cudaStream_t stream, std::string* error) {
  const int64_t n = args.num_seqs;
  // The planner's own bound on the tiles a head; above it, it picks the scheduler not built.
  const int64_t tiles_bound = (args.num_tokens + kSm90QueryTile - 1) / kSm90QueryTile + n - 1;
  if (tiles_bound > kSm90MaxTilesPerHead) {
    return Fail(error, "flashinfer sm90 prefill: more than 4096 query tiles a head",
                cudaErrorNotSupported);
  }
  cudaError_t e = cudaSuccess;
  if (p->copied == nullptr) {
    int device = 0;
    e = cudaGetDevice(&device);
    if (e == cudaSuccess) {
      e = cudaDeviceGetAttribute(&p->num_sms, cudaDevAttrMultiProcessorCount, device);
    }
    if (e == cudaSuccess) e = cudaEventCreateWithFlags(&p->copied, cudaEventDisableTiming);
    if (e != cudaSuccess) return Fail(error, "flashinfer sm90 prefill: plan setup", e);
  }
  // An upper bound of what the planner allocates (7 arrays over the works, aligned to 16
  // bytes, and one over the SMs), then our indptr at the end of the buffer.
  const size_t works = static_cast<size_t>(tiles_bound) * static_cast<size_t>(args.num_heads);
  const size_t tail_bytes = (n + 1) * sizeof(int32_t);
  const size_t needed = 7 * Align(works * sizeof(int32_t) + 16, 16) +
                        Align((p->num_sms + 1) * sizeof(int32_t) + 16, 16) + tail_bytes + 1024;
  p->valid = false;  // from here a failure leaves the buffers half rewritten
  if (needed > p->bytes) {
    // Kernels in flight may still read the old device plan, a copy the pinned one.
    e = cudaStreamSynchronize(stream);
    if (e != cudaSuccess) return Fail(error, "flashinfer sm90 prefill: plan buffers", e);
    const size_t bytes = std::max({needed, 2 * p->bytes, kMinPlanBytes});
    cudaFree(p->device);
    cudaFreeHost(p->pinned);
    p->device = p->pinned = nullptr;
    p->bytes = 0;
    e = cudaMalloc(&p->device, bytes);
    if (e == cudaSuccess) e = cudaMallocHost(&p->pinned, bytes);
    if (e != cudaSuccess) return Fail(error, "flashinfer sm90 prefill: plan buffers", e);
    p->bytes = bytes;
  } else {
    // The previous plan's copy must have left the pinned buffer before it is rewritten.
    e = cudaEventSynchronize(p->copied);
    if (e != cudaSuccess) return Fail(error, "flashinfer sm90 prefill: plan event", e);
  }
  const size_t tail_offset = (p->bytes - tail_bytes - 256) / 256 * 256;
  // The planner takes mutable host arrays (it reads them only).
  std::vector<int32_t> qo_indptr(host_query_start, host_query_start + n + 1);
  std::vector<int32_t> kv_indptr(page_indptr, page_indptr + n + 1);
  std::vector<int32_t> kv_lens(host_context_lens, host_context_lens + n);
  try {
    // kv_indptr indexes the page list (the kernel reads kv_indices + kv_indptr[s]), kv_lens
    // are in tokens. No float workspace: the SM90 path never splits the KV.
    e = flashinfer::PrefillSM90Plan<int32_t>(
        /*float_buffer=*/nullptr, /*float_workspace_size_in_bytes=*/0, p->device, p->pinned,
        tail_offset, p->info, qo_indptr.data(), kv_indptr.data(), kv_lens.data(),
        static_cast<uint32_t>(args.num_tokens), static_cast<uint32_t>(n),
        static_cast<uint32_t>(args.num_heads), static_cast<uint32_t>(args.num_kv_heads), kHeadDim,
        kHeadDim, static_cast<uint32_t>(args.block_size), /*causal=*/true,
        /*enable_cuda_graph=*/false, /*sizeof_dtype_o=*/2, stream);
  } catch (const std::exception& ex) {
    return Fail(error, std::string("flashinfer sm90 prefill: plan: ") + ex.what(),
                cudaErrorInvalidValue);
  }
  if (e != cudaSuccess) return Fail(error, "flashinfer sm90 prefill: plan", e);
  if (p->info.same_schedule_for_all_heads) {
    return Fail(error, "flashinfer sm90 prefill: the planner chose the all-heads schedule",
                cudaErrorNotSupported);
  }
  char* host_tail = static_cast<char*>(p->pinned) + tail_offset;
  std::memcpy(host_tail, page_indptr, tail_bytes);
  e = cudaMemcpyAsync(static_cast<char*>(p->device) + tail_offset, host_tail, tail_bytes,
                      cudaMemcpyHostToDevice, stream);
  if (e == cudaSuccess) e = cudaEventRecord(p->copied, stream);
  if (e != cudaSuccess) return Fail(error, "flashinfer sm90 prefill: plan copy", e);
  p->tail_offset = tail_offset;
  p->valid = true;
  return cudaSuccess;
}

const int32_t* FlashInferSm90PageIndptr(const FlashInferSm90Plan* p) {
  return reinterpret_cast<const int32_t*>(static_cast<const char*>(p->device) + p->tail_offset);
}

cudaError_t RunFlashInferSm90(const FlashInferSm90Plan* p, const void* q, const void* k_cache,
                              const void* v_cache, const PagedAttentionArgs& args,
                              const int32_t* page_indices, float scale, void* out,
                              cudaStream_t stream, std::string* error) {
  if (p == nullptr || !p->valid || args.head_dim != kHeadDim) {
    return Fail(error, "flashinfer sm90 prefill: no plan for this call", cudaErrorInvalidValue);
  }
  using flashinfer::GetPtrFromBaseOffset;
  void* ib = p->device;
  const flashinfer::PrefillPlanSM90Info& info = p->info;
  const int64_t q_row = args.num_heads * kHeadDim, kv_row = args.num_kv_heads * kHeadDim;
  Params params = {};
  params.q_ptr = static_cast<DType*>(const_cast<void*>(q));
  params.k_ptr = static_cast<DType*>(const_cast<void*>(k_cache));
  params.v_ptr = static_cast<DType*>(const_cast<void*>(v_cache));
  params.o_ptr = static_cast<DType*>(out);
  params.lse_ptr = nullptr;
  params.qo_tile_indices = GetPtrFromBaseOffset<int32_t>(ib, info.qo_tile_indices_offset);
  params.qo_indptr = GetPtrFromBaseOffset<int32_t>(ib, info.qo_indptr_offset);
  params.kv_indptr = GetPtrFromBaseOffset<int32_t>(ib, info.kv_indptr_offset);
  params.kv_indices = const_cast<int32_t*>(page_indices);
  params.qo_lens = GetPtrFromBaseOffset<int32_t>(ib, info.qo_len_offset);
  params.kv_lens = GetPtrFromBaseOffset<int32_t>(ib, info.kv_len_offset);
  params.head_indices = GetPtrFromBaseOffset<int32_t>(ib, info.head_indices_offset);
  params.work_indptr = GetPtrFromBaseOffset<int32_t>(ib, info.work_indptr_offset);
  params.batch_indices = GetPtrFromBaseOffset<int32_t>(ib, info.batch_indices_offset);
  params.additional_params.logits_soft_cap = 0.f;
  params.additional_params.sm_scale = scale;
  // q and out: [tokens, heads, 128]; the caches [pages, block_size, kv_heads, 128] (NHD).
  // The kernel gathers K/V rows with 16-byte cp.async at page * page_stride + slot *
  // stride_n + head * stride_h, so any block size works.
  params.q_stride_n = q_row;
  params.q_stride_h = kHeadDim;
  params.o_stride_n = q_row;
  params.o_stride_h = kHeadDim;
  params.k_stride_n = params.v_stride_n = kv_row;
  params.k_stride_h = params.v_stride_h = kHeadDim;
  params.k_page_stride = params.v_page_stride = args.block_size * kv_row;
  params.nnz_qo = args.num_tokens;
  params.num_qo_heads = static_cast<int>(args.num_heads);
  params.num_kv_heads = static_cast<int>(args.num_kv_heads);
  params.group_size = static_cast<int>(args.num_heads / args.num_kv_heads);
  params.page_size = static_cast<int>(args.block_size);
  params.window_left = -1;
  params.causal = true;
  cudaError_t e;
  try {
    // enable_pdl as the FA2 path passes it. FlashInfer 0.7.4's SM90 dispatcher launches with
    // plain cudaLaunchKernel whatever it says, so this kernel keeps full stream order (the
    // compaction before it has completed when it starts, and the next kernel's PdlWait()
    // covers it): launch.cuh's contract for other libraries' kernels.
    e = flashinfer::BatchPrefillWithPagedKVCacheDispatched<
        kHeadDim, kHeadDim, flashinfer::MaskMode::kCausal, /*LEFT_SLIDING_WINDOW=*/false,
        /*SAME_SCHEDULE_FOR_ALL_HEADS=*/false, Variant, Params>(params, PdlEnabled(), stream);
  } catch (const std::exception& ex) {
    return Fail(error, std::string("flashinfer sm90 prefill: ") + ex.what(), cudaErrorInvalidValue);
  }
  return e == cudaSuccess ? e : Fail(error, "flashinfer sm90 prefill: launch", e);
}

}  // namespace dxs::cuda
