// Attention CUDA kernels of kernels/cuda/ops.cuh: the KV cache write and paged attention.
// The CPU backend (kernels/cpu_attention.cc) is the reference.
//
// PagedAttention: one block per (sequence, query row, kv head). The block serves the GQA
// group of query heads that share the kv head, so each K/V row is read from the cache once
// per query row and group rather than once per head. It walks the visible positions in
// chunks of kChunk:
//   1. each position's cache row is looked up in the block table (once per chunk);
//   2. the K rows of the chunk are staged in shared memory as f32 (coalesced, 16-byte loads
//      when the rows allow), padded by one float per row so that a warp reading one column
//      of 32 rows hits 32 banks;
//   3. one thread per (head, position) forms the score q . k * scale (j ascending);
//   4. one warp per head takes the chunk's max and exp-sum (a fixed butterfly) and updates
//      the running max and denominator of the online softmax, while the V rows replace the
//      K rows in shared memory;
//   5. one thread per (head, column) rescales its output accumulator and adds the chunk's
//      probability-weighted V column (positions ascending).
// The output is the accumulator over the denominator, rounded once. All sums have a fixed
// order, so results are the same from run to run; they differ from the CPU backend's (one
// max and one sum over all positions) by rounding only.
//
// Grid: x walks a sequence's query rows (a grid-stride loop, so a wrong max_query_len hint
// costs time, never rows), y is the kv head, z the sequence; blocks past a sequence's
// query_len exit at once.
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "kernels/cuda/elem_type.cuh"
#include "kernels/cuda/ops.cuh"

namespace dxs::cuda {
namespace {

constexpr int kWarpSize = 32;
constexpr unsigned kFullMask = 0xffffffffu;

// ---- WriteKvCache ----

constexpr int kKvThreads = 128;

// Equal types, rows of `units` 16-byte units: a block per token.
__global__ void __launch_bounds__(kKvThreads)
    WriteKvCacheVecKernel(const uint4* __restrict__ k, const uint4* __restrict__ v,
                          const int64_t* __restrict__ slot_mapping, int64_t tokens, int64_t units,
                          uint4* __restrict__ k_cache, uint4* __restrict__ v_cache) {
  for (int64_t t = blockIdx.x; t < tokens; t += gridDim.x) {
    const int64_t slot = slot_mapping[t];
    if (slot < 0) continue;  // a padding token: nothing to cache
    for (int64_t u = threadIdx.x; u < units; u += kKvThreads) {
      k_cache[slot * units + u] = k[t * units + u];
      v_cache[slot * units + u] = v[t * units + u];
    }
  }
}

template <typename Src, typename Dst>
__global__ void __launch_bounds__(kKvThreads)
    WriteKvCacheKernel(const Src* __restrict__ k, const Src* __restrict__ v,
                       const int64_t* __restrict__ slot_mapping, int64_t tokens, int64_t row_elems,
                       Dst* __restrict__ k_cache, Dst* __restrict__ v_cache) {
  for (int64_t t = blockIdx.x; t < tokens; t += gridDim.x) {
    const int64_t slot = slot_mapping[t];
    if (slot < 0) continue;
    for (int64_t j = threadIdx.x; j < row_elems; j += kKvThreads) {
      k_cache[slot * row_elems + j] = ConvertElem<Src, Dst>(k[t * row_elems + j]);
      v_cache[slot * row_elems + j] = ConvertElem<Src, Dst>(v[t * row_elems + j]);
    }
  }
}

// ---- PagedAttention ----

constexpr int kAttnThreads = 128;
constexpr int kAttnWarps = kAttnThreads / kWarpSize;
constexpr int64_t kMaxHeadDim = 256;
constexpr int64_t kMaxGridZ = 65535;  // gridDim.y and gridDim.z

// Positions per chunk: the f32 K/V tile is about 32 KiB for every head_dim. At least a warp,
// so that the lanes of a warp in step 3 share one head (q reads are broadcasts).
int ChunkFor(int64_t head_dim) { return head_dim <= 64 ? 128 : head_dim <= 128 ? 64 : 32; }

struct AttentionShape {
  int64_t num_tokens;
  int64_t num_heads;
  int64_t num_kv_heads;
  int group;  // query heads per kv head
  int head_dim;
  int64_t block_size;
  int64_t max_blocks_per_seq;
  int chunk;
  float scale;
  ElemType q_type;
  ElemType out_type;
  bool vector_loads;  // K/V rows are whole 16-byte units at 16-byte addresses
};

// The dynamic shared memory of one block, in the order the kernel lays it out.
size_t AttentionSharedBytes(int group, int head_dim, int chunk) {
  return sizeof(int64_t) * chunk +  // cache row of each chunk position
         sizeof(float) * (static_cast<size_t>(chunk) * (head_dim + 1) +  // K or V tile
                          2 * static_cast<size_t>(group) * head_dim +    // q, accumulator
                          static_cast<size_t>(group) * chunk +           // scores / probs
                          3 * static_cast<size_t>(group));               // max, sum, rescale
}

__device__ __forceinline__ float WarpSum(float v) {
#pragma unroll
  for (int offset = kWarpSize / 2; offset > 0; offset /= 2) {
    v += __shfl_xor_sync(kFullMask, v, offset);
  }
  return v;
}

__device__ __forceinline__ float WarpMax(float v) {
#pragma unroll
  for (int offset = kWarpSize / 2; offset > 0; offset /= 2) {
    v = fmaxf(v, __shfl_xor_sync(kFullMask, v, offset));
  }
  return v;
}

// Stages rows row_base[0..n) of `cache` (head_dim elements each; a negative base is a
// position without a block and stages zeros) into tile[n][head_dim + 1] as f32.
template <typename T>
__device__ void StageRows(const T* __restrict__ cache, const int64_t* row_base, int n, int head_dim,
                          bool vector_loads, float* tile) {
  const int stride = head_dim + 1;
  if (vector_loads) {
    constexpr int kVec = 16 / sizeof(T);
    const int units = head_dim / kVec;
    for (int u = threadIdx.x; u < n * units; u += kAttnThreads) {
      const int p = u / units, j = (u - p * units) * kVec;
      float* dst = tile + p * stride + j;
      const int64_t base = row_base[p];
      if (base < 0) {
#pragma unroll
        for (int e = 0; e < kVec; ++e) dst[e] = 0.f;
        continue;
      }
      const uint4 raw = __ldg(reinterpret_cast<const uint4*>(cache + base + j));
      T vals[kVec];
      memcpy(vals, &raw, sizeof(raw));
#pragma unroll
      for (int e = 0; e < kVec; ++e) dst[e] = ToFloat(vals[e]);
    }
  } else {
    for (int idx = threadIdx.x; idx < n * head_dim; idx += kAttnThreads) {
      const int p = idx / head_dim, j = idx - p * head_dim;
      const int64_t base = row_base[p];
      tile[p * stride + j] = base < 0 ? 0.f : ToFloat(cache[base + j]);
    }
  }
}

template <typename T>
__global__ void __launch_bounds__(kAttnThreads)
    PagedAttentionKernel(const void* __restrict__ q, const T* __restrict__ k_cache,
                         const T* __restrict__ v_cache, const int32_t* __restrict__ query_start,
                         const int32_t* __restrict__ context_lens,
                         const int32_t* __restrict__ block_tables, AttentionShape shape,
                         void* __restrict__ out) {
  const int G = shape.group, D = shape.head_dim, C = shape.chunk, stride = D + 1;
  extern __shared__ __align__(16) unsigned char smem_bytes[];
  int64_t* row_base = reinterpret_cast<int64_t*>(smem_bytes);  // [C]
  float* tile = reinterpret_cast<float*>(row_base + C);        // [C][D + 1]: K, then V
  float* q_s = tile + C * stride;                              // [G][D]
  float* acc = q_s + G * D;                                    // [G][D]
  float* prob = acc + G * D;                                   // [G][C]
  float* run_max = prob + G * C;                               // [G]
  float* run_sum = run_max + G;                                // [G]
  float* rescale = run_sum + G;                                // [G]

  const int tid = threadIdx.x, lane = tid % kWarpSize, warp = tid / kWarpSize;
  const int64_t seq = blockIdx.z, kv_head = blockIdx.y;
  const int64_t q_begin = query_start[seq];
  const int64_t q_len = query_start[seq + 1] - q_begin;
  const int64_t past = static_cast<int64_t>(context_lens[seq]) - q_len;
  const int32_t* table = block_tables + seq * shape.max_blocks_per_seq;
  const int64_t max_positions = shape.max_blocks_per_seq * shape.block_size;
  const int64_t first_head = kv_head * G;

  for (int64_t i = blockIdx.x; i < q_len; i += gridDim.x) {  // uniform across the block
    const int64_t row = q_begin + i;
    if (row < 0 || row >= shape.num_tokens) continue;  // bad metadata: skipped
    // Query i sits at position past + i and sees [0, past + i]; never past the block table.
    const int64_t visible = past + i + 1 < max_positions ? past + i + 1 : max_positions;
    const int64_t head_row = row * shape.num_heads + first_head;  // in units of D

    for (int e = tid; e < G * D; e += kAttnThreads) {
      q_s[e] = LoadAsFloat(q, shape.q_type, head_row * D + e);
      acc[e] = 0.f;
    }
    for (int h = tid; h < G; h += kAttnThreads) {
      run_max[h] = -INFINITY;
      run_sum[h] = 0.f;
    }
    __syncthreads();

    for (int64_t start = 0; start < visible; start += C) {
      const int n = static_cast<int>(visible - start < C ? visible - start : C);
      for (int p = tid; p < n; p += kAttnThreads) {
        const int64_t pos = start + p;
        const int64_t block = table[pos / shape.block_size];
        row_base[p] =
            block < 0 ? -1
                      : ((block * shape.block_size + pos % shape.block_size) * shape.num_kv_heads +
                         kv_head) *
                            D;
      }
      __syncthreads();
      StageRows(k_cache, row_base, n, D, shape.vector_loads, tile);
      __syncthreads();

      for (int e = tid; e < G * C; e += kAttnThreads) {
        const int h = e / C, p = e - h * C;
        if (p >= n) continue;
        const float* qh = q_s + h * D;
        const float* kp = tile + p * stride;
        float dot = 0.f;
        for (int j = 0; j < D; ++j) dot += qh[j] * kp[j];
        prob[e] = dot * shape.scale;
      }
      __syncthreads();

      // The online softmax, a warp per head; meanwhile V takes K's place in the tile.
      for (int h = warp; h < G; h += kAttnWarps) {
        float* ph = prob + h * C;
        const float old_max = run_max[h];
        float chunk_max = -INFINITY;
        for (int p = lane; p < n; p += kWarpSize) chunk_max = fmaxf(chunk_max, ph[p]);
        const float new_max = fmaxf(old_max, WarpMax(chunk_max));
        float chunk_sum = 0.f;
        for (int p = lane; p < n; p += kWarpSize) {
          const float e = expf(ph[p] - new_max);
          ph[p] = e;
          chunk_sum += e;
        }
        chunk_sum = WarpSum(chunk_sum);
        __syncwarp();  // every lane has read run_max[h] before lane 0 replaces it
        if (lane == 0) {
          const float r = expf(old_max - new_max);  // 0 on the first chunk (old_max = -inf)
          rescale[h] = r;
          run_sum[h] = run_sum[h] * r + chunk_sum;
          run_max[h] = new_max;
        }
      }
      StageRows(v_cache, row_base, n, D, shape.vector_loads, tile);
      __syncthreads();

      for (int e = tid; e < G * D; e += kAttnThreads) {
        const int h = e / D, j = e - h * D;
        const float* ph = prob + h * C;
        float sum = 0.f;
        for (int p = 0; p < n; ++p) sum += ph[p] * tile[p * stride + j];
        acc[e] = acc[e] * rescale[h] + sum;
      }
      __syncthreads();  // before the next chunk overwrites row_base, tile and prob
    }

    for (int e = tid; e < G * D; e += kAttnThreads) {
      const int h = e / D;
      // A query that sees no position (inconsistent metadata) gets a zero row.
      const float value = visible > 0 ? acc[e] / run_sum[h] : 0.f;
      StoreFromFloat(out, shape.out_type, head_row * D + e, value);
    }
    __syncthreads();  // before the next query row overwrites q_s and acc
  }
}

}  // namespace

cudaError_t LaunchWriteKvCache(const void* k, const void* v, ElemType kv_type,
                               const int64_t* slot_mapping, int64_t tokens, int64_t row_elems,
                               void* k_cache, void* v_cache, ElemType cache_type,
                               cudaStream_t stream) {
  if (!IsFloating(kv_type) || !IsFloating(cache_type) || tokens < 0 || row_elems < 0) {
    return cudaErrorInvalidValue;
  }
  if (tokens == 0 || row_elems == 0) return cudaSuccess;
  if (k == nullptr || v == nullptr || slot_mapping == nullptr || k_cache == nullptr ||
      v_cache == nullptr) {
    return cudaErrorInvalidValue;
  }
  const unsigned blocks = GridBlocks(tokens, 1);
  const size_t row_bytes = static_cast<size_t>(row_elems) * ElemSize(kv_type);
  if (kv_type == cache_type && row_bytes % 16 == 0 && Aligned16(k) && Aligned16(v) &&
      Aligned16(k_cache) && Aligned16(v_cache)) {
    WriteKvCacheVecKernel<<<blocks, kKvThreads, 0, stream>>>(
        static_cast<const uint4*>(k), static_cast<const uint4*>(v), slot_mapping, tokens,
        static_cast<int64_t>(row_bytes / 16), static_cast<uint4*>(k_cache),
        static_cast<uint4*>(v_cache));
    return cudaGetLastError();
  }
  return DispatchFloat(kv_type, [&](auto st) {
    return DispatchFloat(cache_type, [&](auto dt) {
      using Src = typename decltype(st)::type;
      using Dst = typename decltype(dt)::type;
      WriteKvCacheKernel<<<blocks, kKvThreads, 0, stream>>>(
          static_cast<const Src*>(k), static_cast<const Src*>(v), slot_mapping, tokens, row_elems,
          static_cast<Dst*>(k_cache), static_cast<Dst*>(v_cache));
      return cudaGetLastError();
    });
  });
}

cudaError_t LaunchPagedAttention(const void* q, ElemType q_type, const void* k_cache,
                                 const void* v_cache, ElemType cache_type,
                                 const PagedAttentionArgs& args, float scale, void* out,
                                 ElemType out_type, cudaStream_t stream) {
  if (!IsFloating(q_type) || !IsFloating(cache_type) || !IsFloating(out_type) ||
      args.num_seqs < 0 || args.num_seqs > kMaxGridZ || args.num_tokens < 0 ||
      args.num_heads <= 0 || args.num_kv_heads <= 0 || args.num_kv_heads > kMaxGridZ ||
      args.num_heads % args.num_kv_heads != 0 || args.head_dim <= 0 ||
      args.head_dim > kMaxHeadDim || args.block_size <= 0 || args.max_blocks_per_seq < 0) {
    return cudaErrorInvalidValue;
  }
  if (args.num_tokens == 0 || args.num_seqs == 0) return cudaSuccess;
  if (q == nullptr || k_cache == nullptr || v_cache == nullptr || out == nullptr ||
      args.query_start == nullptr || args.context_lens == nullptr ||
      (args.block_tables == nullptr && args.max_blocks_per_seq > 0)) {
    return cudaErrorInvalidValue;
  }
  const int64_t group = args.num_heads / args.num_kv_heads;
  if (group > kAttnThreads * 16) return cudaErrorInvalidValue;  // far beyond any model

  AttentionShape shape;
  shape.num_tokens = args.num_tokens;
  shape.num_heads = args.num_heads;
  shape.num_kv_heads = args.num_kv_heads;
  shape.group = static_cast<int>(group);
  shape.head_dim = static_cast<int>(args.head_dim);
  shape.block_size = args.block_size;
  shape.max_blocks_per_seq = args.max_blocks_per_seq;
  shape.chunk = ChunkFor(args.head_dim);
  shape.scale = scale;
  shape.q_type = q_type;
  shape.out_type = out_type;
  shape.vector_loads = (args.head_dim * static_cast<int64_t>(ElemSize(cache_type))) % 16 == 0 &&
                       Aligned16(k_cache) && Aligned16(v_cache);
  const size_t smem = AttentionSharedBytes(shape.group, shape.head_dim, shape.chunk);

  // Query rows per sequence: max_query_len is a hint, never more than the rows there are.
  const int64_t rows = std::max<int64_t>(1, std::min(args.max_query_len, args.num_tokens));
  const dim3 grid(GridBlocks(rows, 1), static_cast<unsigned>(args.num_kv_heads),
                  static_cast<unsigned>(args.num_seqs));
  return DispatchFloat(cache_type, [&](auto ct) {
    using T = typename decltype(ct)::type;
    if (smem > 48 * 1024) {  // beyond the default; the device's opt-in limit decides
      const cudaError_t err =
          cudaFuncSetAttribute(PagedAttentionKernel<T>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                               static_cast<int>(smem));
      if (err != cudaSuccess) return err;
    }
    PagedAttentionKernel<T><<<grid, kAttnThreads, smem, stream>>>(
        q, static_cast<const T*>(k_cache), static_cast<const T*>(v_cache), args.query_start,
        args.context_lens, args.block_tables, shape, out);
    return cudaGetLastError();
  });
}

}  // namespace dxs::cuda
