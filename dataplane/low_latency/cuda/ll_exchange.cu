// The low-latency exchange's kernels (ll_exchange.cuh says what a round is). Launched
// plainly (no PDL attribute): each one is a full stream-order point, so the kernels around
// it need not know that another process writes into the regions.
#include <algorithm>
#include <cstring>
#include <string>

#include "dataplane/low_latency/cuda/ll_exchange.cuh"
#include "kernels/cuda/elem_type.cuh"

namespace dxs::cuda {
namespace {

constexpr int kThreads = 128;
constexpr size_t kAlign = 256;

size_t AlignUp(size_t v) { return (v + kAlign - 1) / kAlign * kAlign; }

cudaError_t Fail(std::string* error, const std::string& what) {
  if (error != nullptr) *error = "ll exchange: " + what;
  return cudaErrorInvalidValue;
}

__device__ __forceinline__ unsigned long long LoadAcquireSys(const unsigned long long* p) {
  unsigned long long v;
  asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ void StoreReleaseSys(unsigned long long* p, unsigned long long v) {
  asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

__device__ __forceinline__ unsigned long long GlobalTimerNs() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__device__ __forceinline__ int64_t TokenCount(const int32_t* device_count, int64_t bound) {
  if (device_count == nullptr) return bound;
  const int64_t n = *device_count;
  return n < 0 ? 0 : (n > bound ? bound : n);
}

// The ranks a token's pairs go to, as a bit set (ids outside [0, num_experts) go nowhere).
// Called by the whole first warp (top_k <= 32): one id and its owner a lane, then an OR.
__device__ __forceinline__ uint32_t RankMask(const int32_t* ids, int top_k, const int32_t* owner,
                                             int num_experts, int num_ranks) {
  const int lane = threadIdx.x & 31;
  uint32_t bit = 0;
  if (lane < top_k) {
    const int32_t e = ids[lane];
    if (e >= 0 && e < num_experts) {
      const int32_t r = owner[e];
      if (r >= 0 && r < num_ranks) bit = 1u << r;
    }
  }
  return __reduce_or_sync(0xffffffffu, bit);
}

__device__ __forceinline__ void CopyRow(void* dst, const void* src, int row_bytes) {
  const uint4* s = static_cast<const uint4*>(src);
  uint4* d = static_cast<uint4*>(dst);
  for (int i = threadIdx.x; i < row_bytes / 16; i += blockDim.x) d[i] = s[i];
}

// The send kernels' end: once every block has written, the last one publishes the round to
// each receiver (count, fence, flag) and counts it in sync->send_epoch.
template <typename Publish>
__device__ __forceinline__ void FinishSend(LlSync* sync, unsigned long long epoch,
                                           Publish&& publish) {
  // Each thread's own rows and meta, at system scope, before the block counts itself (the
  // writer fences, not only the thread that counts).
  __threadfence_system();
  __syncthreads();
  __shared__ bool last;
  if (threadIdx.x == 0) last = atomicAdd(&sync->blocks_done, 1u) == gridDim.x - 1;
  __syncthreads();
  if (!last) return;
  __threadfence_system();  // every block's writes (seen through the counter) before the flags
  publish();
  if (threadIdx.x == 0) {
    sync->blocks_done = 0;
    sync->send_epoch = epoch;
  }
}

__global__ void __launch_bounds__(kThreads) LlDispatchSendKernel(LlDispatchSendArgs a) {
  const unsigned long long epoch = a.sync->send_epoch + 1;
  const int64_t n = TokenCount(a.num_tokens_device, a.num_tokens);
  const LlRegionLayout& L = a.layout;
  __shared__ uint32_t mask_s;
  for (int64_t t = blockIdx.x; t < n; t += gridDim.x) {
    const int32_t* ids = a.topk_ids + t * L.top_k;
    if (threadIdx.x < 32) {  // RankMask takes the whole warp
      const uint32_t mask = RankMask(ids, L.top_k, a.expert_owner, a.num_experts, a.num_ranks);
      if (threadIdx.x == 0) mask_s = mask;
    }
    __syncthreads();
    const uint32_t mask = mask_s;
    const size_t slot = static_cast<size_t>(a.source) * L.capacity + t;
    const char* row = static_cast<const char*>(a.x) + t * L.row_bytes;
    for (int r = 0; r < a.num_ranks; ++r) {
      char* base = static_cast<char*>(a.regions[r]);
      // Every receiver gets the slot's meta (no pair there: all -1); only those with a pair
      // get the row.
      if (threadIdx.x < L.top_k) {
        const int32_t e = ids[threadIdx.x];
        const bool here = e >= 0 && e < a.num_experts && a.expert_owner[e] == r;
        reinterpret_cast<LlPair*>(base + L.meta)[slot * L.top_k + threadIdx.x] =
            LlPair{here ? e : -1, a.topk_weights[t * L.top_k + threadIdx.x]};
      }
      if (mask >> r & 1u) CopyRow(base + L.rows + slot * L.row_bytes, row, L.row_bytes);
    }
    __syncthreads();  // mask_s is rewritten by the next token
  }
  FinishSend(a.sync, epoch, [&] {
    for (int r = threadIdx.x; r < a.num_ranks; r += blockDim.x) {
      char* base = static_cast<char*>(a.regions[r]);
      reinterpret_cast<volatile int32_t*>(base + L.counts)[a.source] = static_cast<int32_t>(n);
      __threadfence_system();
      StoreReleaseSys(reinterpret_cast<unsigned long long*>(base + L.flags) + a.source, epoch);
    }
  });
}

__global__ void LlWaitKernel(const char* region, LlRegionLayout L, LlSync* sync,
                             unsigned long long timeout_ns) {
  const unsigned long long epoch = sync->recv_epoch + 1;
  __shared__ int failed;
  if (threadIdx.x == 0) failed = sync->error;
  __syncthreads();
  if (failed == 0) {
    const unsigned long long* flags = reinterpret_cast<const unsigned long long*>(region + L.flags);
    for (int s = threadIdx.x; s < L.num_sources; s += blockDim.x) {
      const unsigned long long start = GlobalTimerNs();
      unsigned long long arrived;
      while ((arrived = LoadAcquireSys(flags + s)) < epoch) {
        if (GlobalTimerNs() - start > timeout_ns) {
          if (atomicCAS(&sync->error, 0, 1) == 0) {
            sync->error_source = s;
            sync->error_round = epoch;
            sync->error_arrived = arrived;
          }
          break;
        }
        __nanosleep(100);
      }
    }
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
    sync->recv_epoch = epoch;
  }
}

__global__ void LlSnapshotKernel(const LlSync* sync, const char* region, LlRegionLayout L,
                                 int32_t* bad, bool reset_bad, LlSnapshot* out) {
  const unsigned long long* flags = reinterpret_cast<const unsigned long long*>(region + L.flags);
  for (int s = threadIdx.x; s < L.num_sources; s += blockDim.x) {
    out->arrived[s] = LoadAcquireSys(flags + s);
  }
  if (threadIdx.x == 0) {
    out->sync = *sync;
    out->bad = bad == nullptr ? 0 : reset_bad ? atomicExch(bad, 0) : *bad;
  }
  __threadfence_system();
}

__global__ void __launch_bounds__(kThreads) LlCombineSendKernel(LlCombineSendArgs a) {
  const unsigned long long epoch = a.sync->send_epoch + 1;
  const LlRegionLayout& D = a.dispatch;
  const LlRegionLayout& C = a.combine;
  const char* dispatch = static_cast<const char*>(a.dispatch_region);
  const int32_t* counts = reinterpret_cast<const int32_t*>(dispatch + D.counts);
  const LlPair* meta = reinterpret_cast<const LlPair*>(dispatch + D.meta);
  const int64_t slots = static_cast<int64_t>(D.num_sources) * D.capacity;
  for (int64_t i = blockIdx.x; i < slots; i += gridDim.x) {
    const int s = static_cast<int>(i / D.capacity);
    const int64_t t = i % D.capacity;
    if (t >= counts[s]) continue;  // uniform over the block, as below
    bool any = false;
    for (int k = 0; k < D.top_k; ++k) any |= meta[i * D.top_k + k].expert >= 0;
    if (!any) continue;
    char* base = static_cast<char*>(a.regions[s]);
    CopyRow(base + C.rows + (static_cast<size_t>(a.source) * C.capacity + t) * C.row_bytes,
            static_cast<const char*>(a.y) + i * C.row_bytes, C.row_bytes);
  }
  FinishSend(a.sync, epoch, [&] {
    for (int s = threadIdx.x; s < D.num_sources; s += blockDim.x) {
      char* base = static_cast<char*>(a.regions[s]);
      reinterpret_cast<volatile int32_t*>(base + C.counts)[a.source] = counts[s];
      __threadfence_system();
      StoreReleaseSys(reinterpret_cast<unsigned long long*>(base + C.flags) + a.source, epoch);
    }
  });
}

template <typename Row, typename Out>
__global__ void __launch_bounds__(kThreads) LlCombineReduceKernel(LlCombineReduceArgs a) {
  const int64_t n = TokenCount(a.num_tokens_device, a.num_tokens);
  const LlRegionLayout& L = a.layout;
  const Row* rows = reinterpret_cast<const Row*>(static_cast<const char*>(a.region) + L.rows);
  __shared__ uint32_t mask_s;
  for (int64_t t = blockIdx.x; t < n; t += gridDim.x) {
    if (threadIdx.x < 32) {
      const uint32_t mask =
          RankMask(a.topk_ids + t * a.top_k, a.top_k, a.expert_owner, a.num_experts, L.num_sources);
      if (threadIdx.x == 0) mask_s = mask;
    }
    __syncthreads();
    const uint32_t mask = mask_s;
    Out* out = static_cast<Out*>(a.out) + t * L.hidden;
    for (int h = threadIdx.x; h < L.hidden; h += blockDim.x) {
      float acc = 0.f;  // ranks in ascending order: one summation order
      for (int r = 0; r < L.num_sources; ++r) {
        if (mask >> r & 1u)
          acc += ToFloat(rows[(static_cast<size_t>(r) * L.capacity + t) * L.hidden + h]);
      }
      out[h] = FromFloat<Out>(acc);
    }
    __syncthreads();
  }
}

__global__ void __launch_bounds__(kThreads) LlRegionPairsKernel(LlRegionPairsArgs a) {
  const LlRegionLayout& L = a.layout;
  const char* region = static_cast<const char*>(a.region);
  const int32_t* counts = reinterpret_cast<const int32_t*>(region + L.counts);
  const LlPair* meta = reinterpret_cast<const LlPair*>(region + L.meta);
  const int64_t slots = static_cast<int64_t>(L.num_sources) * L.capacity;
  const int64_t total = slots * L.top_k;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t slot = i / L.top_k;
    const int s = static_cast<int>(slot / L.capacity);
    const int64_t t = slot % L.capacity;
    const LlPair pair = meta[i];
    bool valid = t < counts[s] && pair.expert >= 0 && pair.expert < a.num_experts;
    if (valid && a.held[pair.expert] == 0) {
      atomicAdd(a.bad, 1);
      valid = false;
    }
    a.rows[i] = valid ? static_cast<int32_t>(slot) : 0;
    a.experts[i] = valid ? pair.expert : a.num_experts;
    a.weights[i] = valid ? pair.weight : 0.f;
    a.out_rows[i] = static_cast<int32_t>(valid ? slot : slots);
  }
}

bool LayoutOk(const LlRegionLayout& L, std::string* error, const char* what) {
  if (L.bytes == 0 || L.num_sources < 1 || L.num_sources > kLlMaxRanks || L.capacity < 1 ||
      L.row_bytes <= 0 || L.row_bytes % 16 != 0) {
    Fail(error, std::string(what) + ": the region layout is empty or out of range");
    return false;
  }
  return true;
}

int Grid(int64_t work, int num_sms) {
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(work, 2 * std::max(num_sms, 1))));
}

}  // namespace

namespace {

LlRegionLayout MakeLayout(int num_sources, int capacity, int hidden, int top_k, size_t elem) {
  LlRegionLayout L;
  if (num_sources < 1 || num_sources > kLlMaxRanks || capacity < 1 || hidden < 1 || top_k < 0 ||
      top_k > kLlMaxTopK || elem == 0 || (hidden * elem) % 16 != 0) {
    return L;
  }
  L.num_sources = num_sources;
  L.capacity = capacity;
  L.hidden = hidden;
  L.top_k = top_k;
  L.row_bytes = static_cast<int32_t>(hidden * elem);
  const size_t slots = static_cast<size_t>(num_sources) * capacity;
  L.flags = 0;
  L.counts = AlignUp(num_sources * sizeof(unsigned long long));
  L.meta = L.counts + AlignUp(num_sources * sizeof(int32_t));
  L.rows = L.meta + AlignUp(slots * top_k * sizeof(LlPair));
  L.bytes = L.rows + AlignUp(slots * L.row_bytes);
  return L;
}

}  // namespace

LlRegionLayout MakeLlRegionLayout(int num_sources, int capacity, int hidden, int top_k,
                                  ElemType row_type) {
  return MakeLayout(num_sources, capacity, hidden, top_k,
                    IsFloating(row_type) ? ElemSize(row_type) : 0);
}

LlRegionLayout MakeLlRecordRegionLayout(int num_sources, int capacity, int record_bytes,
                                        int top_k) {
  return MakeLayout(num_sources, capacity, record_bytes, top_k, 1);
}

cudaError_t LaunchLlDispatchSend(const LlDispatchSendArgs& a, int num_sms, cudaStream_t stream,
                                 std::string* error) {
  const LlRegionLayout& L = a.layout;
  if (!LayoutOk(L, error, "dispatch send")) return cudaErrorInvalidValue;
  if (a.num_ranks < 1 || a.num_ranks > kLlMaxRanks) {
    return Fail(error, "dispatch send: num_ranks " + std::to_string(a.num_ranks) + " outside [1, " +
                           std::to_string(kLlMaxRanks) + "]");
  }
  if (a.source < 0 || a.source >= L.num_sources) {
    return Fail(error, "dispatch send: source " + std::to_string(a.source) +
                           " outside the region's " + std::to_string(L.num_sources) + " sources");
  }
  if (a.num_tokens < 0 || a.num_tokens > L.capacity) {
    return Fail(error, "dispatch send: " + std::to_string(a.num_tokens) +
                           " tokens, the capacity is " + std::to_string(L.capacity));
  }
  if (L.top_k < 1 || L.top_k > kThreads) {
    return Fail(error, "dispatch send: the region has no meta (top_k 0)");
  }
  const bool tokens = a.num_tokens > 0;
  if (a.regions == nullptr || a.sync == nullptr || a.expert_owner == nullptr || a.num_experts < 1 ||
      (tokens && (a.x == nullptr || a.topk_ids == nullptr || a.topk_weights == nullptr))) {
    return Fail(error, "dispatch send: a null pointer or no experts");
  }
  LlDispatchSendKernel<<<Grid(a.num_tokens, num_sms), kThreads, 0, stream>>>(a);
  return cudaGetLastError();
}

cudaError_t LaunchLlWait(const void* region, const LlRegionLayout& layout, LlSync* sync,
                         int64_t timeout_ns, cudaStream_t stream, std::string* error) {
  if (!LayoutOk(layout, error, "wait")) return cudaErrorInvalidValue;
  if (region == nullptr || sync == nullptr || timeout_ns <= 0) {
    return Fail(error, "wait: a null region or sync, or a timeout <= 0");
  }
  LlWaitKernel<<<1, kLlMaxRanks, 0, stream>>>(static_cast<const char*>(region), layout, sync,
                                              static_cast<unsigned long long>(timeout_ns));
  return cudaGetLastError();
}

cudaError_t LaunchLlCombineSend(const LlCombineSendArgs& a, int num_sms, cudaStream_t stream,
                                std::string* error) {
  const LlRegionLayout &D = a.dispatch, &C = a.combine;
  if (!LayoutOk(D, error, "combine send") || !LayoutOk(C, error, "combine send")) {
    return cudaErrorInvalidValue;
  }
  if (C.capacity != D.capacity || C.top_k != 0 || D.top_k < 1) {
    return Fail(error,
                "combine send: the combine region needs the dispatch's capacity and no meta");
  }
  if (a.source < 0 || a.source >= C.num_sources) {
    return Fail(error, "combine send: source " + std::to_string(a.source) +
                           " outside the region's " + std::to_string(C.num_sources) + " sources");
  }
  if (a.y == nullptr || a.dispatch_region == nullptr || a.regions == nullptr || a.sync == nullptr) {
    return Fail(error, "combine send: a null pointer");
  }
  LlCombineSendKernel<<<Grid(static_cast<int64_t>(D.num_sources) * D.capacity, num_sms), kThreads,
                        0, stream>>>(a);
  return cudaGetLastError();
}

cudaError_t LaunchLlCombineReduce(const LlCombineReduceArgs& a, int num_sms, cudaStream_t stream,
                                  std::string* error) {
  const LlRegionLayout& L = a.layout;
  if (!LayoutOk(L, error, "combine reduce")) return cudaErrorInvalidValue;
  if (a.num_tokens < 0 || a.num_tokens > L.capacity) {
    return Fail(error, "combine reduce: " + std::to_string(a.num_tokens) +
                           " tokens, the capacity is " + std::to_string(L.capacity));
  }
  if (static_cast<size_t>(L.hidden) * ElemSize(a.row_type) != static_cast<size_t>(L.row_bytes)) {
    return Fail(error, "combine reduce: the row type does not match the region's rows");
  }
  if (a.top_k < 1 || a.top_k > kLlMaxTopK || a.num_experts < 1 || a.expert_owner == nullptr ||
      a.region == nullptr || (a.num_tokens > 0 && (a.topk_ids == nullptr || a.out == nullptr))) {
    return Fail(error, "combine reduce: a null pointer, no experts or top_k out of range");
  }
  if (a.num_tokens == 0) return cudaSuccess;
  const int grid = Grid(a.num_tokens, num_sms);
  const cudaError_t e = DispatchFloat(a.row_type, [&](auto row) {
    return DispatchFloat(a.out_type, [&](auto out) {
      using R = typename decltype(row)::type;
      using O = typename decltype(out)::type;
      LlCombineReduceKernel<R, O><<<grid, kThreads, 0, stream>>>(a);
      return cudaGetLastError();
    });
  });
  if (e == cudaErrorInvalidValue)
    return Fail(error, "combine reduce: a non-floating row or out type");
  return e;
}

cudaError_t LaunchLlRegionPairs(const LlRegionPairsArgs& a, int num_sms, cudaStream_t stream,
                                std::string* error) {
  const LlRegionLayout& L = a.layout;
  if (!LayoutOk(L, error, "region pairs")) return cudaErrorInvalidValue;
  if (L.top_k < 1) return Fail(error, "region pairs: the region has no meta (top_k 0)");
  if (a.region == nullptr || a.held == nullptr || a.num_experts < 1 || a.rows == nullptr ||
      a.experts == nullptr || a.weights == nullptr || a.out_rows == nullptr || a.bad == nullptr) {
    return Fail(error, "region pairs: a null pointer or no experts");
  }
  const int64_t total = static_cast<int64_t>(L.num_sources) * L.capacity * L.top_k;
  LlRegionPairsKernel<<<Grid((total + kThreads - 1) / kThreads, num_sms), kThreads, 0, stream>>>(a);
  return cudaGetLastError();
}

cudaError_t LlReadSync(const LlSync* sync, LlSync* host) {
  return cudaMemcpy(host, sync, sizeof(*host), cudaMemcpyDeviceToHost);
}

cudaError_t LaunchLlSnapshot(const LlSync* sync, const void* region, const LlRegionLayout& layout,
                             int32_t* bad, bool reset_bad, LlSnapshot* mapped, cudaStream_t stream,
                             std::string* error) {
  if (!LayoutOk(layout, error, "snapshot")) return cudaErrorInvalidValue;
  if (sync == nullptr || region == nullptr || mapped == nullptr) {
    return Fail(error, "snapshot: a null sync, region or snapshot");
  }
  LlSnapshotKernel<<<1, kLlMaxRanks, 0, stream>>>(sync, static_cast<const char*>(region), layout,
                                                  bad, reset_bad, mapped);
  return cudaGetLastError();
}

static_assert(sizeof(cudaIpcMemHandle_t) == sizeof(LlRegionHandle), "IPC handle size");

cudaError_t LlExportRegion(void* base, LlRegionHandle* handle) {
  cudaIpcMemHandle_t h;
  const cudaError_t e = cudaIpcGetMemHandle(&h, base);
  if (e == cudaSuccess) std::memcpy(handle->bytes, &h, sizeof(h));
  return e;
}

cudaError_t LlOpenRegion(const LlRegionHandle& handle, void** base) {
  cudaIpcMemHandle_t h;
  std::memcpy(&h, handle.bytes, sizeof(h));
  return cudaIpcOpenMemHandle(base, h, cudaIpcMemLazyEnablePeerAccess);
}

cudaError_t LlCloseRegion(void* base) { return cudaIpcCloseMemHandle(base); }

}  // namespace dxs::cuda
