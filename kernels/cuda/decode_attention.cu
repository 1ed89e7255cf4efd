// Paged decode attention for small batches in one launch: a thread-block cluster per
// (sequence, kv head) splits the positions, and the split partials are merged through the
// cluster's distributed shared memory instead of a second kernel.
//
// Why: a decode step at batch 1 over 1k positions reads 2 MB of K/V a layer (0.5 us at the
// copy rate), but FlashInfer's split-KV path is three kernels there (page-list compaction,
// attention, merge) and measured 12 us a layer inside the 48-layer decode graph (gpu_bench,
// H200: the step without them was that much shorter). Here one kernel of kClusterMax CTAs a
// (sequence, kv head) does it: each CTA streams its slice of the positions with every load
// of a batch in flight at once, and the merge is a read of 16 CTAs' shared memory.
//
// Per CTA (8 warps), positions in batches of kBatch (8 a warp):
//   A. each warp loads its positions' K and V rows (a lane 4 elements: one 256-byte row a
//      warp load), forms the scores of all kMaxGroup heads of the kv head's GQA group
//      against q (in registers, pre-scaled by scale * log2 e), reduces them across the warp
//      by a transposing butterfly (9 shuffles for 8 heads) and stages V in shared memory;
//   B. warp g takes head g's batch max, updates its running max and denominator (online
//      softmax, exp2) and writes the weights P;
//   C. warp g's lanes rescale and add P.V for head g, 4 columns a lane.
// Then the CTAs' (max, denominator, accumulator) are merged in rank order by the cluster
// (each CTA a slice of the outputs) and rounded once into out. Every sum has a fixed order,
// so results are the same from run to run and in or out of a CUDA graph.
#include <cooperative_groups.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <atomic>
#include <climits>
#include <cmath>
#include <cstdint>
#include <type_traits>

#include "kernels/cuda/elem_type.cuh"
#include "kernels/cuda/launch.cuh"
#include "kernels/cuda/ops.cuh"

namespace dxs::cuda {
namespace {

namespace cg = cooperative_groups;

constexpr int kD = 128;         // head_dim
constexpr int kMaxGroup = 8;    // query heads a kv head (a warp each)
constexpr int kWarps = 8;       // a CTA
constexpr int kThreads = kWarps * 32;
constexpr int kPerWarp = 8;     // positions a warp loads at once
constexpr int kBatch = kWarps * kPerWarp;
static_assert(kBatch == 64, "phase B reads a batch as two positions a lane");
constexpr int kClusterMax = 16;  // CTAs a (sequence, kv head): non-portable, where allowed
constexpr int kClusterPortable = 8;

struct DecodeShape {
  int num_tokens;
  int num_heads;
  int num_kv_heads;
  int group;
  int block_size;
  int max_blocks_per_seq;
  int64_t num_blocks;
  float scale_log2;
};

__device__ __forceinline__ void Widen4(const uint2& raw, float out[4]) {
  const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&raw);
  const float2 a = __bfloat1622float2(h[0]), b = __bfloat1622float2(h[1]);
  out[0] = a.x, out[1] = a.y, out[2] = b.x, out[3] = b.y;
}
__device__ __forceinline__ void Widen4Half(const uint2& raw, float out[4]) {
  const __half2* h = reinterpret_cast<const __half2*>(&raw);
  const float2 a = __half22float2(h[0]), b = __half22float2(h[1]);
  out[0] = a.x, out[1] = a.y, out[2] = b.x, out[3] = b.y;
}
template <typename T>
__device__ __forceinline__ void Widen(const uint2& raw, float out[4]) {
  if constexpr (std::is_same_v<T, __half>) {
    Widen4Half(raw, out);
  } else {
    Widen4(raw, out);
  }
}

// Sums v[g] over the warp for the 8 heads g at once: after halving the set at each of the
// first three steps (offsets 16, 8, 4) a lane holds one head's partial, head
// (lane >> 2) & 7 with bits 4, 3, 2 read as 4, 2, 1; offsets 2 and 1 finish it.
__device__ __forceinline__ float TransposeSum8(const float v[kMaxGroup], int lane) {
  const bool b4 = lane & 16, b3 = lane & 8, b2 = lane & 4;
  float h4[4];
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const float mine = b4 ? v[j + 4] : v[j], theirs = b4 ? v[j] : v[j + 4];
    h4[j] = mine + __shfl_xor_sync(0xffffffffu, theirs, 16);
  }
  float h2[2];
#pragma unroll
  for (int j = 0; j < 2; ++j) {
    const float mine = b3 ? h4[j + 2] : h4[j], theirs = b3 ? h4[j] : h4[j + 2];
    h2[j] = mine + __shfl_xor_sync(0xffffffffu, theirs, 8);
  }
  float s = (b2 ? h2[1] : h2[0]) + __shfl_xor_sync(0xffffffffu, b2 ? h2[0] : h2[1], 4);
  s += __shfl_xor_sync(0xffffffffu, s, 2);
  s += __shfl_xor_sync(0xffffffffu, s, 1);
  return s;
}

template <typename T, typename TO>
__global__ void __launch_bounds__(kThreads)
    PagedDecodeClusterKernel(const T* __restrict__ q, const T* __restrict__ k_cache,
                             const T* __restrict__ v_cache, const int32_t* __restrict__ query_start,
                             const int32_t* __restrict__ context_lens,
                             const int32_t* __restrict__ block_tables, const DecodeShape shape,
                             TO* __restrict__ out) {
  PdlWait();
  cg::cluster_group cluster = cg::this_cluster();
  const int rank = static_cast<int>(cluster.block_rank());
  const int ranks = static_cast<int>(cluster.num_blocks());
  const int h = blockIdx.y, s = blockIdx.z;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  __shared__ float scores[kMaxGroup][kBatch];
  __shared__ float weights[kMaxGroup][kBatch];
  __shared__ uint2 v_rows[kBatch][32];  // a batch's V rows, as loaded
  __shared__ float rescale[kMaxGroup];
  __shared__ float cta_m[kMaxGroup], cta_l[kMaxGroup];
  __shared__ float cta_acc[kMaxGroup][kD];

  // One query row a sequence: anything else (a bad hint) computes nothing for the sequence
  // (the launcher only takes steps of one row a sequence).
  const int row = __ldg(query_start + s);
  const bool one_row = __ldg(query_start + s + 1) - row == 1 && row >= 0 && row < shape.num_tokens;
  const int len = one_row ? max(__ldg(context_lens + s), 0) : 0;
  float qv[kMaxGroup][4];
#pragma unroll
  for (int g = 0; g < kMaxGroup; ++g) {
    if (one_row && g < shape.group) {
      const T* qp = q + (static_cast<int64_t>(row) * shape.num_heads + h * shape.group + g) * kD +
                    4 * lane;
      Widen<T>(*reinterpret_cast<const uint2*>(qp), qv[g]);
#pragma unroll
      for (int e = 0; e < 4; ++e) qv[g][e] *= shape.scale_log2;
    } else {
#pragma unroll
      for (int e = 0; e < 4; ++e) qv[g][e] = 0.f;
    }
  }
  const int chunk = (len + ranks - 1) / ranks;
  const int begin = min(len, rank * chunk), end = min(len, begin + chunk);
  const int64_t row_stride = static_cast<int64_t>(shape.num_kv_heads) * kD;
  const int32_t* table = block_tables + static_cast<int64_t>(s) * shape.max_blocks_per_seq;
  // Warp g's running max and denominator of head g (the same in every lane), and lane's
  // 4 columns of head g's accumulator.
  float m = -INFINITY, l = 0.f, acc[4] = {0.f, 0.f, 0.f, 0.f};
  for (int base = begin; base < end; base += kBatch) {
    // A. Scores and V rows of this warp's positions, every load issued before any use.
    uint2 kr[kPerWarp], vr[kPerWarp];
#pragma unroll
    for (int i = 0; i < kPerWarp; ++i) {
      const int j = base + warp * kPerWarp + i;
      kr[i] = vr[i] = make_uint2(0u, 0u);
      if (j < end) {
        const int block = __ldg(table + j / shape.block_size);
        if (block >= 0 && block < shape.num_blocks) {  // else a zero row, as the other kernels
          const int64_t at = (static_cast<int64_t>(block) * shape.block_size + j % shape.block_size) *
                                 row_stride +
                             static_cast<int64_t>(h) * kD + 4 * lane;
          kr[i] = __ldg(reinterpret_cast<const uint2*>(k_cache + at));
          vr[i] = __ldg(reinterpret_cast<const uint2*>(v_cache + at));
        }
      }
    }
#pragma unroll
    for (int i = 0; i < kPerWarp; ++i) {
      const int slot = warp * kPerWarp + i;
      float kf[4], dot[kMaxGroup];
      Widen<T>(kr[i], kf);
#pragma unroll
      for (int g = 0; g < kMaxGroup; ++g) {
        dot[g] = qv[g][0] * kf[0];
#pragma unroll
        for (int e = 1; e < 4; ++e) dot[g] = fmaf(qv[g][e], kf[e], dot[g]);
      }
      const float score = TransposeSum8(dot, lane);
      if ((lane & 3) == 0) {
        const int g = (lane >> 2) & 7;
        scores[g][slot] = base + slot < end ? score : -INFINITY;
      }
      v_rows[slot][lane] = vr[i];  // zeros past the end: P is 0 there and 0 * 0 adds nothing
    }
    __syncthreads();
    // B. Head `warp`'s weights for the batch (online softmax in base 2).
    if (warp < shape.group) {
      const float s0 = scores[warp][lane], s1 = scores[warp][lane + 32];
      float batch_max = fmaxf(s0, s1);
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) {
        batch_max = fmaxf(batch_max, __shfl_xor_sync(0xffffffffu, batch_max, o));
      }
      const float m_new = fmaxf(m, batch_max);  // finite: the batch has a position
      const float p0 = exp2f(s0 - m_new), p1 = exp2f(s1 - m_new);
      weights[warp][lane] = p0;
      weights[warp][lane + 32] = p1;
      float sum = p0 + p1;
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
      const float r = exp2f(m - m_new);  // 0 on the first batch (m = -inf)
      l = l * r + sum;
      m = m_new;
      if (lane == 0) rescale[warp] = r;
    }
    __syncthreads();
    // C. Head `warp`'s accumulator, columns 4 * lane .. + 3, positions in order.
    if (warp < shape.group) {
      const float r = rescale[warp];
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[e] *= r;
#pragma unroll 8
      for (int slot = 0; slot < kBatch; ++slot) {
        float vf[4];
        Widen<T>(v_rows[slot][lane], vf);
        const float p = weights[warp][slot];
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[e] = fmaf(p, vf[e], acc[e]);
      }
    }
    __syncthreads();
  }
  if (warp < kMaxGroup) {
    if (lane == 0) cta_m[warp] = m, cta_l[warp] = l;
#pragma unroll
    for (int e = 0; e < 4; ++e) cta_acc[warp][4 * lane + e] = acc[e];
  }
  cluster.sync();
  // The merge: this CTA's slice of the group's outputs, over the ranks in order.
  const int per = kMaxGroup * kD / ranks;
  if (static_cast<int>(threadIdx.x) < per) {
    const int o = rank * per + static_cast<int>(threadIdx.x);
    const int g = o / kD, d = o % kD;
    if (one_row && g < shape.group) {
      float big = -INFINITY;
      for (int r = 0; r < ranks; ++r) big = fmaxf(big, *cluster.map_shared_rank(&cta_m[g], r));
      float den = 0.f, num = 0.f;
      if (big != -INFINITY) {
        for (int r = 0; r < ranks; ++r) {
          const float mr = *cluster.map_shared_rank(&cta_m[g], r);
          if (mr == -INFINITY) continue;  // a rank without positions
          const float w = exp2f(mr - big);
          den = fmaf(*cluster.map_shared_rank(&cta_l[g], r), w, den);
          num = fmaf(*cluster.map_shared_rank(&cta_acc[g][d], r), w, num);
        }
      }
      out[(static_cast<int64_t>(row) * shape.num_heads + h * shape.group + g) * kD + d] =
          FromFloat<TO>(den > 0.f ? num / den : 0.f);
    }
  }
  cluster.sync();  // the others read this CTA's shared memory until here
}

bool SwitchedOn() {
  static const bool on = !SwitchedOff("DXS_CUDA_DECODE_CLUSTER");
  return on;
}

// Whether the current device runs thread-block clusters (sm_90 and later).
bool ClustersRun() {
  int device = 0, major = 0;
  if (cudaGetDevice(&device) != cudaSuccess ||
      cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess) {
    cudaGetLastError();
    return false;
  }
  return major >= 9;
}

// The cluster size for this kernel: kClusterMax where the device schedules it, else the
// portable size. Decided once per kernel (a host query, so it may run during a capture).
template <typename T, typename TO>
int ClusterSize() {
  static std::atomic<int> chosen{0};
  int size = chosen.load(std::memory_order_relaxed);
  if (size != 0) return size;
  auto* kernel = PagedDecodeClusterKernel<T, TO>;
  size = kClusterPortable;
  if (cudaFuncSetAttribute(kernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1) ==
      cudaSuccess) {
    cudaLaunchConfig_t config = {};
    config.gridDim = dim3(kClusterMax, 1, 1);
    config.blockDim = dim3(kThreads, 1, 1);
    cudaLaunchAttribute attribute[1];
    attribute[0].id = cudaLaunchAttributeClusterDimension;
    attribute[0].val.clusterDim.x = kClusterMax;
    attribute[0].val.clusterDim.y = 1;
    attribute[0].val.clusterDim.z = 1;
    config.attrs = attribute;
    config.numAttrs = 1;
    int clusters = 0;
    if (cudaOccupancyMaxActiveClusters(&clusters, kernel, &config) == cudaSuccess &&
        clusters > 0) {
      size = kClusterMax;
    }
  }
  cudaGetLastError();
  chosen.store(size, std::memory_order_relaxed);
  return size;
}

}  // namespace

bool PagedDecodeClusterTakes(ElemType q_type, ElemType cache_type, ElemType out_type,
                             const PagedAttentionArgs& args) {
  static const bool clusters = ClustersRun();
  return SwitchedOn() && clusters && q_type == cache_type &&
         (cache_type == ElemType::kBF16 || cache_type == ElemType::kF16) && IsFloating(out_type) &&
         args.head_dim == kD && args.num_kv_heads > 0 && args.num_heads % args.num_kv_heads == 0 &&
         args.num_heads / args.num_kv_heads <= kMaxGroup && args.num_kv_heads <= 65535 &&
         args.num_seqs >= 1 && args.num_seqs <= kDecodeClusterMaxSeqs &&
         args.num_tokens == args.num_seqs && args.max_query_len <= 1 &&
         args.max_context_len <= kDecodeClusterMaxContext && args.block_size > 0 &&
         args.block_size <= INT32_MAX && args.max_blocks_per_seq >= 0 &&
         args.max_blocks_per_seq <= INT32_MAX;
}

cudaError_t LaunchPagedDecodeCluster(const void* q, ElemType q_type, const void* k_cache,
                                     const void* v_cache, ElemType cache_type,
                                     const PagedAttentionArgs& args, float scale, void* out,
                                     ElemType out_type, cudaStream_t stream) {
  if (!PagedDecodeClusterTakes(q_type, cache_type, out_type, args)) return cudaErrorNotSupported;
  if (q == nullptr || k_cache == nullptr || v_cache == nullptr || out == nullptr ||
      args.query_start == nullptr || args.context_lens == nullptr ||
      (args.block_tables == nullptr && args.max_blocks_per_seq > 0) ||
      reinterpret_cast<uintptr_t>(q) % 8 != 0 || reinterpret_cast<uintptr_t>(k_cache) % 8 != 0 ||
      reinterpret_cast<uintptr_t>(v_cache) % 8 != 0) {
    return cudaErrorInvalidValue;
  }
  DecodeShape shape;
  shape.num_tokens = static_cast<int>(args.num_tokens);
  shape.num_heads = static_cast<int>(args.num_heads);
  shape.num_kv_heads = static_cast<int>(args.num_kv_heads);
  shape.group = static_cast<int>(args.num_heads / args.num_kv_heads);
  shape.block_size = static_cast<int>(args.block_size);
  shape.max_blocks_per_seq = static_cast<int>(args.max_blocks_per_seq);
  shape.num_blocks = args.num_blocks;
  shape.scale_log2 = scale * 1.4426950408889634f;
  auto launch = [&](auto tt, auto ot) {
    using T = typename decltype(tt)::type;
    using TO = typename decltype(ot)::type;
    const int cluster = ClusterSize<T, TO>();
    const dim3 grid(static_cast<unsigned>(cluster), static_cast<unsigned>(args.num_kv_heads),
                    static_cast<unsigned>(args.num_seqs));
    LaunchClusterKernel(PagedDecodeClusterKernel<T, TO>, grid, kThreads, 0, cluster, stream,
                        static_cast<const T*>(q), static_cast<const T*>(k_cache),
                        static_cast<const T*>(v_cache), args.query_start, args.context_lens,
                        args.block_tables, shape, static_cast<TO*>(out));
    return cudaGetLastError();
  };
  auto by_out = [&](auto tt) {
    return DispatchFloat(out_type, [&](auto ot) { return launch(tt, ot); });
  };
  return cache_type == ElemType::kBF16 ? by_out(TypeTag<__nv_bfloat16>{})
                                       : by_out(TypeTag<__half>{});
}

}  // namespace dxs::cuda
