// Paged attention for decode steps of few sequences (ops.cuh, LaunchDecodeAttention): one
// kernel, where attention.cu's path is its kernel plus a split-merge kernel.
//
// Where it runs (CudaBackend::UseDecodeAttention): by default the eager decode steps of at
// most 32 (sequence, kv head) pairs over at most 2048 positions that FlashInfer does not
// take (eager and not a padded step: e.g. the attention service's step loop with
// --piecewise_graphs=false, which is bound by the host's launches): there it
// replaces attention.cu's kernel and split merge (H200, batch 1 x 1k: 8.6 against 13.8 us
// in a graph, 15.8 against 19.7 us an eager call). Inside ForwardDecode's CUDA graphs it
// measured at parity with FlashInfer's kernel and merge in the whole step
// (DXS_CUDA_DECODE_ATTENTION=on: 312.3 against 314.2 tok/s at batch 1), which stay there.
// Its dot products run on CUDA cores (tensor cores would need attention.cu's fragment
// layouts), so from 4k positions attention.cu's kernel is faster.
//
// Layout:
// - The grid is (splits, kv heads, sequences); a block of kWarps warps serves one split of
//   one (sequence, kv head) for the whole GQA group. The split count depends only on the
//   number of sequences and kv heads (DecodeAttentionSplits), never on lengths, so a CUDA
//   graph's launch shape fits every replay and eager runs give the replay's bits; each
//   block finds its positions from the context length on the device.
// - A warp scores kPos positions at a time (kPos * padded group = 64 scores): its lanes
//   each hold head_dim / 32 columns of q (every head of the group, in registers) and of the
//   kPos K rows, read straight from the cache (one coalesced 128/256-byte load per row and
//   warp), and the 64 partial dot products are summed across the lanes by a reduce-scatter
//   (62 shuffles; each lane ends with 2 scores). The online softmax (base 2) runs on those
//   two scores per lane, a head's max and sum over its lanes by a fixed butterfly; the
//   probabilities go through shared memory to every lane for P.V over its columns.
// - The block's warps merge in shared memory, in warp order; the block writes its f32 partial
//   (max, sum, acc) to the workspace, and the last block of a (query row, kv head) to arrive
//   (a counter per row and kv head, reset by that block) merges the splits in split order and
//   writes the row. Summation orders depend on the sizes only: the same call gives the same
//   bits.
// - The context lengths and the block table come from the host before the step's first
//   kernel, so they are read before PdlWait() (launch.cuh: memory written two or more
//   kernels back); q and the cache (the KV write just before) after it.
// Table entries outside [0, num_blocks) read as zero rows, as in attention.cu.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "kernels/cuda/elem_type.cuh"
#include "kernels/cuda/launch.cuh"
#include "kernels/cuda/ops.cuh"

namespace dxs::cuda {
namespace {

constexpr int kWarps = 8;
constexpr int kThreads = kWarps * 32;
constexpr unsigned kFull = 0xffffffffu;
constexpr int kScores = 64;         // scores a warp forms at once: kPos positions x GP heads
constexpr int kMaxSplits = 16;      // blocks per (sequence, kv head)
constexpr int kMaxGroupDim = 1024;  // group * head_dim: the block's merge buffer
constexpr int64_t kMaxGrid = 65535;

struct DecodeShape {
  int64_t num_tokens;
  int64_t num_heads;
  int64_t num_kv_heads;
  int group;
  int64_t block_size;
  int64_t max_blocks_per_seq;
  int64_t num_blocks;
  int num_splits;
  float scale_log2;
};

// E consecutive 16-bit elements as one load.
template <int E>
struct Pack;
template <>
struct Pack<2> {
  using type = uint32_t;
};
template <>
struct Pack<4> {
  using type = uint2;
};

template <typename T>
__device__ __forceinline__ float2 Widen2(uint32_t bits) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    __nv_bfloat162 h;
    __builtin_memcpy(&h, &bits, sizeof(h));
    return __bfloat1622float2(h);
  } else {
    __half2 h;
    __builtin_memcpy(&h, &bits, sizeof(h));
    return __half22float2(h);
  }
}

template <typename T, int E>
__device__ __forceinline__ void Widen(typename Pack<E>::type p, float (&f)[E]) {
  if constexpr (E == 2) {
    const float2 a = Widen2<T>(p);
    f[0] = a.x, f[1] = a.y;
  } else {
    const float2 a = Widen2<T>(p.x), b = Widen2<T>(p.y);
    f[0] = a.x, f[1] = a.y, f[2] = b.x, f[3] = b.y;
  }
}

template <int E>
__device__ __forceinline__ typename Pack<E>::type Zero() {
  if constexpr (E == 2) {
    return 0u;
  } else {
    return make_uint2(0u, 0u);
  }
}

// A query that sees `visible` positions (clamped to [0, max_positions]): split `split` of
// `splits` takes an equal share of them, in whole groups of `pos` positions.
__device__ __forceinline__ void SplitRange(int64_t visible, int64_t max_positions, int splits,
                                           int split, int pos, int64_t* begin, int64_t* end) {
  visible = visible < 0 ? 0 : visible < max_positions ? visible : max_positions;
  const int64_t share = ((visible + splits - 1) / splits + pos - 1) / pos * pos;
  *begin = split * share;
  *end = *begin + share < visible ? *begin + share : visible;
}

// Lanes [0, pos) look up the cache row of position first + lane (its element offset): -1
// past `end` (and on the other lanes), -2 for a table entry outside the cache (a zero row).
__device__ __forceinline__ int64_t CacheRow(const int32_t* table, const DecodeShape& shape,
                                            int64_t row_stride, int64_t first, int64_t end,
                                            int lane, int pos) {
  const int64_t at = first + lane;
  if (lane >= pos || at >= end) return -1;
  const int64_t block = table[at / shape.block_size];
  return block >= 0 && block < shape.num_blocks
             ? (block * shape.block_size + at % shape.block_size) * row_stride
             : -2;
}

// One step of a warp's reduce-scatter of v[0, kN): lanes with bit kOffset set keep (and
// sum with their partner's) the upper half, moved down to v[0, kN / 2); the others the lower.
template <int kN, int kOffset>
__device__ __forceinline__ void ReduceScatterStep(float (&v)[kScores], int lane) {
  constexpr int kHalf = kN / 2;
  const uint32_t upper = (lane & kOffset) != 0 ? 0xffffffffu : 0u;
#pragma unroll
  for (int j = 0; j < kHalf; ++j) {
    // Selected as bits: a select of two array elements would become a load at a computed
    // index, and v would live in local memory.
    const uint32_t lo = __float_as_uint(v[j]), hi = __float_as_uint(v[j + kHalf]);
    const float send = __uint_as_float((lo & upper) | (hi & ~upper));
    const float keep = __uint_as_float((hi & upper) | (lo & ~upper));
    v[j] = keep + __shfl_xor_sync(kFull, send, kOffset);
  }
}

// Asks L2 for the 128-byte lines of `bytes` bytes from p (a hint: no fault, no ordering).
__device__ __forceinline__ void PrefetchRowL2(const void* p, int bytes) {
  const char* c = static_cast<const char*>(p);
  for (int b = 0; b < bytes; b += 128) asm volatile("prefetch.global.L2 [%0];" ::"l"(c + b));
}

// T: q and cache type; O: out; E: columns a lane holds (head_dim / 32); GP: the group padded
// to 4, 8 or 16 heads (heads past the group have q = 0 and are never written).
template <typename T, typename O, int E, int GP>
__global__ void __launch_bounds__(kThreads)
    DecodeAttentionKernel(const T* __restrict__ q, const T* __restrict__ k_cache,
                          const T* __restrict__ v_cache, const int32_t* __restrict__ query_start,
                          const int32_t* __restrict__ context_lens,
                          const int32_t* __restrict__ block_tables, DecodeShape shape,
                          float* __restrict__ partial_acc, float* __restrict__ partial_ml,
                          int32_t* __restrict__ counters, O* __restrict__ out) {
  using P = typename Pack<E>::type;
  constexpr int D = 32 * E;
  constexpr int kPos = kScores / GP;  // positions a warp scores at once
  static_assert(kScores / 32 == 2, "each lane owns two scores after the reduce-scatter");
  constexpr int kLanesPerHead = kPos / 2;
  __shared__ float s_scores[kWarps][kScores];  // a group's probabilities, head-major
  __shared__ float s_rescale[kWarps][GP];
  __shared__ float s_max[kWarps][GP], s_sum[kWarps][GP];
  __shared__ __align__(16) float s_acc[kWarps][kMaxGroupDim];
  __shared__ float s_weight[kMaxSplits][GP];
  __shared__ float2 s_ml[kMaxSplits * GP];
  __shared__ bool s_last;

  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  // After the reduce-scatter lane l holds scores 2l and 2l + 1 (head-major, kPos a head).
  const int own_head = 2 * lane / kPos, own_pos = 2 * lane % kPos;
  const int G = shape.group;
  const int S = shape.num_splits;
  const int64_t seq = blockIdx.z, kv_head = blockIdx.y;
  const int split = blockIdx.x;
  const int64_t max_positions = shape.max_blocks_per_seq * shape.block_size;
  const int64_t row_stride = shape.num_kv_heads * D;  // elements per cache position
  // pdl-early: the query rows, context length and block table are the host's, copied in before
  // the step's first kernel (launch.cuh: safe before the wait); nothing a kernel writes. So
  // the first position group's cache rows are looked up while the KV write still runs.
  const int64_t q_begin = query_start[seq];
  const int64_t q_len = query_start[seq + 1] - q_begin;
  const int64_t context = context_lens[seq];
  const int32_t* table = block_tables + seq * shape.max_blocks_per_seq;
  // Then every cache row of query 0's share is prefetched into L2 (lane p of a warp its
  // group's position p, K and V): the loads after the wait, one round trip a group, hit L2
  // instead of HBM. The rows of earlier steps are written two or more kernels back; the new
  // rows the KV write is storing now are prefetched too, which is only a hint (L2 is where
  // every SM's stores and loads meet, so the loads after the wait read the stored rows).
  int64_t first_rows = -1;  // query 0's first group
  if (q_len > 0) {
    int64_t begin, end;
    SplitRange(context - q_len + 1, max_positions, S, split, kPos, &begin, &end);
    first_rows = CacheRow(table, shape, row_stride, begin + warp * kPos, end, lane, kPos);
    for (int64_t first = begin + warp * kPos; first < end; first += kWarps * kPos) {
      const int64_t r = first == begin + warp * kPos
                            ? first_rows
                            : CacheRow(table, shape, row_stride, first, end, lane, kPos);
      if (r >= 0) {
        PrefetchRowL2(k_cache + r + kv_head * D, D * sizeof(T));
        PrefetchRowL2(v_cache + r + kv_head * D, D * sizeof(T));
      }
    }
  }
  PdlWait();

  for (int64_t i = 0; i < q_len; ++i) {  // uniform across the grid for this sequence
    const int64_t row = q_begin + i;
    if (row < 0 || row >= shape.num_tokens) continue;  // bad metadata: skipped
    int64_t begin, end;
    SplitRange(context - q_len + i + 1, max_positions, S, split, kPos, &begin, &end);

    float qf[GP][E], acc[GP][E];
    float head_max = -INFINITY, head_sum = 0.f;  // of head own_head, over this warp's positions
    const T* q_row = q + (row * shape.num_heads + kv_head * G) * D + lane * E;
#pragma unroll
    for (int g = 0; g < GP; ++g) {
      const P bits = g < G ? *reinterpret_cast<const P*>(q_row + g * D) : Zero<E>();
      Widen<T, E>(bits, qf[g]);
#pragma unroll
      for (int e = 0; e < E; ++e) {
        qf[g][e] *= shape.scale_log2;
        acc[g][e] = 0.f;
      }
    }

    for (int64_t first = begin + warp * kPos; first < end; first += kWarps * kPos) {
      const int64_t my_row = i == 0 && first == begin + warp * kPos
                                 ? first_rows
                                 : CacheRow(table, shape, row_stride, first, end, lane, kPos);
      P kb[kPos], vb[kPos];
#pragma unroll
      for (int p = 0; p < kPos; ++p) {
        const int64_t r = __shfl_sync(kFull, my_row, p);
        const int64_t at = r + kv_head * D + lane * E;
        kb[p] = r >= 0 ? __ldcs(reinterpret_cast<const P*>(k_cache + at)) : Zero<E>();
        vb[p] = r >= 0 ? __ldcs(reinterpret_cast<const P*>(v_cache + at)) : Zero<E>();
      }
      // Partial dot products, head-major: v[g * kPos + p].
      float v[kScores];
#pragma unroll
      for (int p = 0; p < kPos; ++p) {
        float kf[E];
        Widen<T, E>(kb[p], kf);
#pragma unroll
        for (int g = 0; g < GP; ++g) {
          float s = 0.f;
#pragma unroll
          for (int e = 0; e < E; ++e) s = fmaf(qf[g][e], kf[e], s);
          v[g * kPos + p] = s;
        }
      }
      // Reduce-scatter over the lanes: afterwards lane l holds the sums of scores 2l and
      // 2l + 1 in v[0] and v[1].
      ReduceScatterStep<kScores, 16>(v, lane);
      ReduceScatterStep<kScores / 2, 8>(v, lane);
      ReduceScatterStep<kScores / 4, 4>(v, lane);
      ReduceScatterStep<kScores / 8, 2>(v, lane);
      ReduceScatterStep<kScores / 16, 1>(v, lane);
      // The online softmax, each lane for its two scores (head own_head, positions own_pos
      // and own_pos + 1), the max and sum over the lanes of a head by a fixed butterfly (the
      // same bits on each of them); then the probabilities and each head's rescale go
      // through shared memory to every lane for P.V over its columns.
      const int64_t valid = end - first;  // positions of this group inside the split
      const float s0 = own_pos < valid ? v[0] : -INFINITY;
      const float s1 = own_pos + 1 < valid ? v[1] : -INFINITY;
      float group_max = fmaxf(s0, s1);
#pragma unroll
      for (int o = 1; o < kLanesPerHead; o *= 2) {
        group_max = fmaxf(group_max, __shfl_xor_sync(kFull, group_max, o));
      }
      const float new_max = fmaxf(head_max, group_max);  // finite: position first is valid
      const float rescale = head_max == -INFINITY ? 0.f : exp2f(head_max - new_max);
      const float e0 = own_pos < valid ? exp2f(s0 - new_max) : 0.f;
      const float e1 = own_pos + 1 < valid ? exp2f(s1 - new_max) : 0.f;
      float sum = e0 + e1;
#pragma unroll
      for (int o = 1; o < kLanesPerHead; o *= 2) sum += __shfl_xor_sync(kFull, sum, o);
      head_max = new_max;
      head_sum = fmaf(head_sum, rescale, sum);
      s_scores[warp][2 * lane] = e0;
      s_scores[warp][2 * lane + 1] = e1;
      if (own_pos == 0) s_rescale[warp][own_head] = rescale;
      __syncwarp();
      float vf[kPos][E];
#pragma unroll
      for (int p = 0; p < kPos; ++p) Widen<T, E>(vb[p], vf[p]);
#pragma unroll
      for (int g = 0; g < GP; ++g) {
        const float r = s_rescale[warp][g];
#pragma unroll
        for (int e = 0; e < E; ++e) acc[g][e] *= r;
#pragma unroll
        for (int p = 0; p < kPos; ++p) {
          const float prob = s_scores[warp][g * kPos + p];
#pragma unroll
          for (int e = 0; e < E; ++e) acc[g][e] = fmaf(prob, vf[p][e], acc[g][e]);
        }
      }
      __syncwarp();  // before the next group rewrites s_scores and s_rescale
    }

    // The block's warps, merged in warp order into the split's partial.
#pragma unroll
    for (int g = 0; g < GP; ++g) {
      if (g < G) {
#pragma unroll
        for (int e = 0; e < E; ++e) s_acc[warp][g * D + lane * E + e] = acc[g][e];
      }
    }
    if (own_pos == 0) s_max[warp][own_head] = head_max, s_sum[warp][own_head] = head_sum;
    __syncthreads();
    const int64_t pair = row * shape.num_kv_heads + kv_head;
    const int64_t part = pair * S + split;
    const int units = G * D / 4;  // float4 units of the group's output
    for (int u = threadIdx.x; u < units; u += kThreads) {
      const int g = u * 4 / D;
      float m = -INFINITY;
      for (int w = 0; w < kWarps; ++w) m = fmaxf(m, s_max[w][g]);
      float4 a = make_float4(0.f, 0.f, 0.f, 0.f);
      float l = 0.f;
      for (int w = 0; w < kWarps; ++w) {
        const float f = s_max[w][g] == -INFINITY ? 0.f : exp2f(s_max[w][g] - m);
        const float4 x = reinterpret_cast<const float4*>(s_acc[w])[u];
        a.x = fmaf(f, x.x, a.x), a.y = fmaf(f, x.y, a.y), a.z = fmaf(f, x.z, a.z),
        a.w = fmaf(f, x.w, a.w);
        l = fmaf(f, s_sum[w][g], l);
      }
      reinterpret_cast<float4*>(partial_acc + part * G * D)[u] = a;
      if (u * 4 % D == 0) {
        partial_ml[(part * G + g) * 2] = m;
        partial_ml[(part * G + g) * 2 + 1] = l;
      }
    }
    __threadfence();  // the partial, visible to whichever block merges
    __syncthreads();
    if (threadIdx.x == 0) s_last = atomicAdd(&counters[pair], 1) == S - 1;
    __syncthreads();
    if (s_last) {
      __threadfence();
      // Every split's (max, sum) per head at once, then each split's weight per head:
      // exp2(max_s - max) / the sum over splits of the same.
      const float2* ml = reinterpret_cast<const float2*>(partial_ml) + pair * S * G;
      for (int t = threadIdx.x; t < S * G; t += kThreads) s_ml[t] = __ldcg(ml + t);
      __syncthreads();
      for (int g = threadIdx.x; g < G; g += kThreads) {
        float m = -INFINITY;
        for (int s = 0; s < S; ++s) m = fmaxf(m, s_ml[s * G + g].x);
        float l = 0.f;
        for (int s = 0; s < S; ++s) {
          const float ms = s_ml[s * G + g].x;
          const float f = ms == -INFINITY ? 0.f : exp2f(ms - m);
          s_weight[s][g] = f;
          l = fmaf(f, s_ml[s * G + g].y, l);
        }
        const float inv = l > 0.f ? 1.f / l : 0.f;  // no position at all: a zero row
        for (int s = 0; s < S; ++s) s_weight[s][g] *= inv;
      }
      __syncthreads();
      O* out_row = out + (row * shape.num_heads + kv_head * G) * D;
      for (int u = threadIdx.x; u < units; u += kThreads) {
        const int g = u * 4 / D;
        // The splits in batches whose loads are all in flight at once, summed in split order.
        const float4* part_acc = reinterpret_cast<const float4*>(partial_acc + pair * S * G * D);
        constexpr int kBatch = 16;
        float4 a = make_float4(0.f, 0.f, 0.f, 0.f);
        for (int s0 = 0; s0 < S; s0 += kBatch) {
          float4 x[kBatch];
#pragma unroll
          for (int j = 0; j < kBatch; ++j) {
            if (s0 + j < S) x[j] = __ldcg(part_acc + (s0 + j) * (G * D / 4) + u);
          }
#pragma unroll
          for (int j = 0; j < kBatch; ++j) {
            if (s0 + j < S) {
              const float f = s_weight[s0 + j][g];
              a.x = fmaf(f, x[j].x, a.x), a.y = fmaf(f, x[j].y, a.y), a.z = fmaf(f, x[j].z, a.z),
              a.w = fmaf(f, x[j].w, a.w);
            }
          }
        }
        out_row[u * 4] = FromFloat<O>(a.x);
        out_row[u * 4 + 1] = FromFloat<O>(a.y);
        out_row[u * 4 + 2] = FromFloat<O>(a.z);
        out_row[u * 4 + 3] = FromFloat<O>(a.w);
      }
      if (threadIdx.x == 0) counters[pair] = 0;  // ready for the next call
    }
    __syncthreads();  // before the next query row reuses the shared buffers
  }
}

bool Aligned(const void* p, size_t bytes) { return reinterpret_cast<uintptr_t>(p) % bytes == 0; }

int PaddedGroup(int64_t group) { return group <= 4 ? 4 : group <= 8 ? 8 : 16; }

template <typename T, typename O, int E, int GP>
cudaError_t LaunchKernelFor(dim3 grid, cudaStream_t stream, const void* q, const void* k,
                            const void* v, const PagedAttentionArgs& args, const DecodeShape& shape,
                            float* partial_acc, float* partial_ml, int32_t* counters, void* out) {
  auto* kernel = DecodeAttentionKernel<T, O, E, GP>;
  LaunchKernel(kernel, grid, kThreads, 0, stream, static_cast<const T*>(q),
               static_cast<const T*>(k), static_cast<const T*>(v), args.query_start,
               args.context_lens, args.block_tables, shape, partial_acc, partial_ml, counters,
               static_cast<O*>(out));
  return cudaGetLastError();
}

template <typename T, typename O, int E>
cudaError_t LaunchFor(int gp, dim3 grid, cudaStream_t stream, const void* q, const void* k,
                      const void* v, const PagedAttentionArgs& args, const DecodeShape& shape,
                      float* partial_acc, float* partial_ml, int32_t* counters, void* out) {
  if (gp == 4) {
    return LaunchKernelFor<T, O, E, 4>(grid, stream, q, k, v, args, shape, partial_acc, partial_ml,
                                       counters, out);
  }
  if constexpr (E * 32 * 16 <= kMaxGroupDim) {
    if (gp == 16) {
      return LaunchKernelFor<T, O, E, 16>(grid, stream, q, k, v, args, shape, partial_acc,
                                          partial_ml, counters, out);
    }
  }
  return LaunchKernelFor<T, O, E, 8>(grid, stream, q, k, v, args, shape, partial_acc, partial_ml,
                                     counters, out);
}

template <typename T>
cudaError_t LaunchTyped(ElemType out_type, int gp, dim3 grid, cudaStream_t stream, const void* q,
                        const void* k, const void* v, const PagedAttentionArgs& args,
                        const DecodeShape& shape, float* partial_acc, float* partial_ml,
                        int32_t* counters, void* out) {
  const bool f32 = out_type == ElemType::kF32;
  if (args.head_dim == 64) {
    return f32 ? LaunchFor<T, float, 2>(gp, grid, stream, q, k, v, args, shape, partial_acc,
                                        partial_ml, counters, out)
               : LaunchFor<T, T, 2>(gp, grid, stream, q, k, v, args, shape, partial_acc, partial_ml,
                                    counters, out);
  }
  return f32 ? LaunchFor<T, float, 4>(gp, grid, stream, q, k, v, args, shape, partial_acc,
                                      partial_ml, counters, out)
             : LaunchFor<T, T, 4>(gp, grid, stream, q, k, v, args, shape, partial_acc, partial_ml,
                                  counters, out);
}

size_t PartialAccBytes(const PagedAttentionArgs& args, int splits) {
  return static_cast<size_t>(args.num_tokens) * args.num_heads * splits * args.head_dim *
         sizeof(float);
}

}  // namespace

bool DecodeAttentionSupports(ElemType q_type, ElemType cache_type, ElemType out_type,
                             int64_t num_heads, int64_t num_kv_heads, int64_t head_dim) {
  if (num_kv_heads <= 0 || num_heads <= 0 || num_heads % num_kv_heads != 0) return false;
  const int64_t group = num_heads / num_kv_heads;
  return q_type == cache_type && (q_type == ElemType::kBF16 || q_type == ElemType::kF16) &&
         (out_type == q_type || out_type == ElemType::kF32) &&
         (head_dim == 64 || head_dim == 128) && group <= 16 && group * head_dim <= kMaxGroupDim;
}

int DecodeAttentionSplits(int64_t num_seqs, int64_t num_kv_heads, int num_sms) {
  const int64_t pairs = std::max<int64_t>(1, num_seqs * num_kv_heads);
  return static_cast<int>(std::clamp<int64_t>(num_sms / pairs, 1, kMaxSplits));
}

size_t DecodeAttentionWorkspaceBytes(const PagedAttentionArgs& args, int splits) {
  if (args.num_tokens <= 0 || args.num_heads <= 0 || args.head_dim <= 0 || splits <= 0) return 0;
  // acc [rows, kv heads, splits, group, head_dim], then (max, sum) [rows, kv heads, splits, group].
  return PartialAccBytes(args, splits) +
         static_cast<size_t>(args.num_tokens) * args.num_heads * splits * 2 * sizeof(float);
}

cudaError_t LaunchDecodeAttention(const void* q, ElemType q_type, const void* k_cache,
                                  const void* v_cache, ElemType cache_type,
                                  const PagedAttentionArgs& args, float scale, void* out,
                                  ElemType out_type, int splits, void* workspace,
                                  size_t workspace_bytes, int32_t* counters, cudaStream_t stream) {
  if (args.num_seqs < 0 || args.num_seqs > kMaxGrid || args.num_tokens < 0 ||
      args.num_kv_heads <= 0 || args.num_kv_heads > kMaxGrid || args.block_size <= 0 ||
      args.max_blocks_per_seq < 0 || args.num_blocks < 0 || splits < 1 || splits > kMaxSplits ||
      !DecodeAttentionSupports(q_type, cache_type, out_type, args.num_heads, args.num_kv_heads,
                               args.head_dim)) {
    return cudaErrorInvalidValue;
  }
  if (args.num_tokens == 0 || args.num_seqs == 0) return cudaSuccess;
  if (q == nullptr || k_cache == nullptr || v_cache == nullptr || out == nullptr ||
      args.query_start == nullptr || args.context_lens == nullptr || counters == nullptr ||
      (args.block_tables == nullptr && args.max_blocks_per_seq > 0) || workspace == nullptr ||
      workspace_bytes < DecodeAttentionWorkspaceBytes(args, splits)) {
    return cudaErrorInvalidValue;
  }
  // Whole per-lane loads of q and the cache rows, float4 stores of the partials.
  const size_t lane_bytes = args.head_dim / 32 * 2;
  if (!Aligned(q, lane_bytes) || !Aligned(k_cache, lane_bytes) || !Aligned(v_cache, lane_bytes) ||
      !Aligned(workspace, 16) || !Aligned(out, ElemSize(out_type))) {
    return cudaErrorInvalidValue;
  }
  DecodeShape shape;
  shape.num_tokens = args.num_tokens;
  shape.num_heads = args.num_heads;
  shape.num_kv_heads = args.num_kv_heads;
  shape.group = static_cast<int>(args.num_heads / args.num_kv_heads);
  shape.block_size = args.block_size;
  shape.max_blocks_per_seq = args.max_blocks_per_seq;
  shape.num_blocks = args.num_blocks;
  shape.num_splits = splits;
  shape.scale_log2 = scale * 1.4426950408889634f;
  float* partial_acc = static_cast<float*>(workspace);
  float* partial_ml =
      reinterpret_cast<float*>(static_cast<char*>(workspace) + PartialAccBytes(args, splits));
  const dim3 grid(static_cast<unsigned>(splits), static_cast<unsigned>(args.num_kv_heads),
                  static_cast<unsigned>(args.num_seqs));
  const int gp = PaddedGroup(shape.group);
  return q_type == ElemType::kBF16
             ? LaunchTyped<__nv_bfloat16>(out_type, gp, grid, stream, q, k_cache, v_cache, args,
                                          shape, partial_acc, partial_ml, counters, out)
             : LaunchTyped<__half>(out_type, gp, grid, stream, q, k_cache, v_cache, args, shape,
                                   partial_acc, partial_ml, counters, out);
}

}  // namespace dxs::cuda
