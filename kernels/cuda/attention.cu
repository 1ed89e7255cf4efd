// Attention CUDA kernels of kernels/cuda/ops.cuh: the KV cache write and paged attention.
// The CPU backend (kernels/cpu_attention.cc) is the reference.
//
// PagedAttention has two kernels:
// - PagedAttentionMmaKernel (below; its own comment): 16-bit q and cache of one type and
//   head_dim 64 or 128, on tensor cores, a warp per (sequence, kv head, 16 rows, split of
//   the positions) fed through a cp.async ring in shared memory (shared by four warps in
//   prefill), with split-KV partials merged by MergeSplitsKernel for decode. Every
//   production shape takes it.
// - PagedAttentionKernel, the general one (any floating types, any head_dim up to 256):
//
// PagedAttentionKernel: one block per (sequence, query row, kv head). The block serves the GQA
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
// max and one sum over all positions) by rounding only. Table entries outside
// [0, num_blocks) read as zero rows in both kernels.
//
// Grid: x walks a sequence's query rows (a grid-stride loop, so a wrong max_query_len hint
// costs time, never rows), y is the kv head, z the sequence; blocks past a sequence's
// query_len exit at once.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "kernels/cuda/elem_type.cuh"
#include "kernels/cuda/launch.cuh"
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
  PdlWait();
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
  PdlWait();
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
  int64_t num_blocks;
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
  PdlWait();
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
            block < 0 || block >= shape.num_blocks
                ? -1
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

// ---- PagedAttention on tensor cores (16-bit q and cache, head_dim 64 or 128) ----
//
// Work is cut into tiles of 16 "rows": a row is a (query row, head of the GQA group) pair,
// row r of a sequence is query r / group, head r % group, so a tile serves whole groups and
// consecutive queries. A warp owns a tile and walks its positions (or its split of them) in
// steps of 16 through mma.sync m16n8k16 with f32 accumulators:
//   S[16 rows][16 positions] = q . k        (q fragments stay in registers)
//   O[16 rows][head_dim]    += P . V       (P split into a 16-bit high and low part, two
//                                           MMAs, so P carries ~16 bits, not 8)
// A team of kTeam warps (one for decode, four for prefill, where the warps hold consecutive
// tiles of one sequence and kv head and so see the same positions) shares a ring of
// kStages step buffers in shared memory: each step's K and V rows (16 positions) are copied
// in with cp.async two steps ahead of the one being computed, so each warp keeps ~16 KiB of
// loads in flight. The 16 rows of a step are looked up in the block table once per step (a
// lane per row, passed on with shuffles), a step ahead of their copy.
// Fragments are read from the ring with 16-byte loads: the head_dim axis is permuted (the
// same permutation for q and K leaves q . k unchanged; for V and O it is undone when O is
// stored), so that each lane's K, q and V elements are contiguous; the 16-byte units of
// each row are XOR-swizzled so that those loads are free of bank conflicts.
// The softmax is online, in base 2 (scores pre-multiplied by scale * log2(e)), per row, with
// a fixed reduction order, so results are the same from run to run.
//
// Split-KV: with few work items (decode), each row's positions are cut into num_splits
// ranges of split_len (the last one runs to the end, whatever max_context_len said); each
// warp writes an unnormalised f32 partial (max, sum, acc[head_dim]) to the workspace and
// MergeSplitsKernel combines them in split order. With one split the warp writes out.

constexpr int kMmaWarps = 4;
constexpr int kMmaThreads = kMmaWarps * kWarpSize;
constexpr int kTileRows = 16;
constexpr int kStep = 16;             // positions per step
constexpr int kStages = 3;            // ring buffers: two steps in flight, one computed
constexpr int kPrefillTeam = 4;       // warps that share a ring when tiles share positions
constexpr int64_t kMinSplitLen = 64;  // positions; shorter splits cost more to merge
constexpr int kMaxSplits = 256;
// Warps of work per SM that splitting aims at, never more: one wave at the kernel's
// occupancy (two blocks of four warps, held back by the ring's shared memory).
constexpr int kWarpsPerSmTarget = 8;

struct MmaShape {
  int64_t num_tokens;
  int64_t num_heads;
  int64_t num_kv_heads;
  int64_t group;
  uint32_t block_size;  // clamped to 2^31 - 1: positions (below 2^31) divide the same
  int64_t max_blocks_per_seq;
  int64_t num_blocks;
  int64_t team_slots;  // teams per (sequence, kv head, split), walking the tile groups
  int64_t num_teams;   // num_seqs * num_kv_heads * num_splits * team_slots
  int64_t split_len;   // a multiple of kStep
  int num_splits;
  float scale_log2;  // scale * log2(e)
  ElemType out_type;
};

template <typename T>
struct Mma16;

template <>
struct Mma16<__nv_bfloat16> {
  static __device__ __forceinline__ void Run(float c[4], const uint32_t a[4], uint32_t b0,
                                             uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
  // x = hi + lo, each a pair of bf16 (x0 in the low half).
  static __device__ __forceinline__ void Split(float x0, float x1, uint32_t* hi, uint32_t* lo) {
    const __nv_bfloat162 h = __floats2bfloat162_rn(x0, x1);
    const __nv_bfloat162 l = __floats2bfloat162_rn(x0 - __low2float(h), x1 - __high2float(h));
    memcpy(hi, &h, 4);
    memcpy(lo, &l, 4);
  }
};

template <>
struct Mma16<__half> {
  static __device__ __forceinline__ void Run(float c[4], const uint32_t a[4], uint32_t b0,
                                             uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
  static __device__ __forceinline__ void Split(float x0, float x1, uint32_t* hi, uint32_t* lo) {
    const __half2 h = __floats2half2_rn(x0, x1);
    const __half2 l = __floats2half2_rn(x0 - __low2float(h), x1 - __high2float(h));
    memcpy(hi, &h, 4);
    memcpy(lo, &l, 4);
  }
};

__device__ __forceinline__ uint32_t Word(const uint4& u, int i) {
  return i == 0 ? u.x : i == 1 ? u.y : i == 2 ? u.z : u.w;
}

// 16 bytes from global to shared memory, bypassing L1; zeros when !valid (nothing read).
__device__ __forceinline__ void CopyAsync16(uint4* dst, const void* src, bool valid) {
  const unsigned dst_addr = static_cast<unsigned>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst_addr), "l"(src),
               "r"(valid ? 16 : 0)
               : "memory");
}
__device__ __forceinline__ void CopyAsyncCommit() {
  asm volatile("cp.async.commit_group;\n" ::: "memory");
}
template <int kPending>
__device__ __forceinline__ void CopyAsyncWait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending) : "memory");
}

// The warps of a team agree that the ring's copies are visible and its readers done.
template <int kTeam>
__device__ __forceinline__ void TeamSync() {
  static_assert(kTeam == 1 || kTeam == kMmaWarps, "a warp or the whole block");
  if constexpr (kTeam == 1) {
    __syncwarp();
  } else {
    __syncthreads();
  }
}

// Swizzles of a step buffer's 16-byte units (row = position in the step, unit within the
// row), chosen for the fragment reads below: each quarter-warp's 8 units fall in 8
// different 4-bank groups.
//   K: a quarter-warp reads rows g, g + 1 (g even), units 4j + t (t = 0..3).
//   V: a quarter-warp reads rows 2t + c (t = 0..3), units D / 64 * g + u for two g.
__device__ __forceinline__ int KSwizzle(int row) { return (row & 1) << 2; }
template <int D>
__device__ __forceinline__ int VSwizzle(int row) {
  const int t = (row >> 1) & 3;
  return D == 128 ? (t & 1) | ((t & 2) << 1) : t << 1;
}

template <int D, int kTeam>
constexpr size_t MmaSharedBytes() {
  return static_cast<size_t>(kMmaWarps / kTeam) * kStages * 2 * kStep * D * 2;
}

// Lane (g, t) = (lane / 4, lane % 4) of the m16n8k16 fragments:
//   A (q, P): rows g and g + 8;  B (K, V): column g;  C (S, O): rows g, g + 8, columns 2t, 2t+1.
// Physical head_dim index of the logical fragment slots:
//   q . k: lane t's 16-byte unit j holds d = 32j + 8t .. +8: k-step 2j takes words 0, 1 and
//          k-step 2j + 1 words 2, 3 (as both the A and the B operand);
//   P . V: n-tile n, column c is d = c * (D / 8) + n, so lane g's V elements are the
//          contiguous D / 8 at g * (D / 8).
template <typename T, int D, int kTeam>
__global__ void __launch_bounds__(kMmaThreads)
    PagedAttentionMmaKernel(const T* __restrict__ q, const T* __restrict__ k_cache,
                            const T* __restrict__ v_cache, const int32_t* __restrict__ query_start,
                            const int32_t* __restrict__ context_lens,
                            const int32_t* __restrict__ block_tables, MmaShape shape,
                            void* __restrict__ out, float* __restrict__ partial_acc,
                            float* __restrict__ partial_ml) {
  PdlWait();
  constexpr int kQUnits = D / 32;  // 16-byte units of q / K per lane and row
  constexpr int kKSteps = D / 16;
  constexpr int kNTiles = D / 8;  // of O
  constexpr int kVElems = D / 8;  // V elements per lane and row
  constexpr int kVUnits = kVElems / 8;
  constexpr int kRowUnits = D / 8;               // 16-byte units of a K or V row
  constexpr int kStepUnits = kStep * kRowUnits;  // of the K (or V) rows of a step
  constexpr int kTeamThreads = kTeam * kWarpSize;
  constexpr int kCopies = kStepUnits / kTeamThreads;  // K (and V) units per thread and step
  constexpr int kTeamsPerBlock = kMmaWarps / kTeam;
  static_assert(D % 64 == 0, "two V units or one per lane");
  static_assert(kStepUnits % kTeamThreads == 0, "whole copies per thread");
  extern __shared__ __align__(16) uint4 ring_smem[];  // [team][stage][K, V][kStepUnits]
  const int lane = threadIdx.x % kWarpSize, warp = threadIdx.x / kWarpSize;
  const int g = lane >> 2, t = lane & 3;
  const int team = warp / kTeam, warp_in_team = warp % kTeam;
  const int team_tid = warp_in_team * kWarpSize + lane;
  uint4* const ring = ring_smem + team * (kStages * 2 * kStepUnits);
  const int64_t kv_stride = shape.num_kv_heads * D;
  const int64_t max_positions = shape.max_blocks_per_seq * shape.block_size;

  // Teams of the grid walk the (sequence, kv head, split, tile group) items; uniform
  // across a team, so its barriers are reached by all of its warps.
  for (int64_t id = static_cast<int64_t>(blockIdx.x) * kTeamsPerBlock + team; id < shape.num_teams;
       id += static_cast<int64_t>(gridDim.x) * kTeamsPerBlock) {
    int64_t rest = id;
    // Later tile groups see more positions (causal): they go first, so the tail is short.
    const int64_t team_slot = shape.team_slots - 1 - rest % shape.team_slots;
    rest /= shape.team_slots;
    const int split = static_cast<int>(rest % shape.num_splits);
    rest /= shape.num_splits;
    const int64_t kv_head = rest % shape.num_kv_heads;
    const int64_t seq = rest / shape.num_kv_heads;
    const int64_t q_begin = query_start[seq];
    const int64_t q_len = query_start[seq + 1] - q_begin;
    const int64_t past = static_cast<int64_t>(context_lens[seq]) - q_len;
    const int32_t* table = block_tables + seq * shape.max_blocks_per_seq;
    const int64_t num_rows = q_len * shape.group;
    const int64_t split_begin = split * shape.split_len;
    const int64_t split_end = split == shape.num_splits - 1
                                  ? max_positions
                                  : min(split_begin + shape.split_len, max_positions);

    for (int64_t group_tile = team_slot; group_tile * kTeam * kTileRows < num_rows;
         group_tile += shape.team_slots) {
      const int64_t tile = group_tile * kTeam + warp_in_team;
      int64_t token[2], head[2], limit[2];
      uint4 qu[2][kQUnits];
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int64_t r = tile * kTileRows + g + 8 * half;
        const int64_t i = r / shape.group;
        token[half] = q_begin + i;
        head[half] = kv_head * shape.group + r % shape.group;
        const bool valid = r < num_rows && token[half] >= 0 && token[half] < shape.num_tokens;
        if (!valid) token[half] = -1;
        // Row r sees [0, past + i]; this warp its part in [split_begin, split_end).
        limit[half] = valid ? min(min(past + i + 1, max_positions), split_end) : 0;
        const int64_t q_offset = valid ? (token[half] * shape.num_heads + head[half]) * D : -1;
#pragma unroll
        for (int j = 0; j < kQUnits; ++j) {
          qu[half][j] = q_offset < 0
                            ? make_uint4(0, 0, 0, 0)
                            : __ldg(reinterpret_cast<const uint4*>(q + q_offset + 32 * j + 8 * t));
        }
      }
      uint32_t qf[kKSteps][4];
#pragma unroll
      for (int j = 0; j < kQUnits; ++j) {
        qf[2 * j][0] = qu[0][j].x;
        qf[2 * j][1] = qu[1][j].x;
        qf[2 * j][2] = qu[0][j].y;
        qf[2 * j][3] = qu[1][j].y;
        qf[2 * j + 1][0] = qu[0][j].z;
        qf[2 * j + 1][1] = qu[1][j].z;
        qf[2 * j + 1][2] = qu[0][j].w;
        qf[2 * j + 1][3] = qu[1][j].w;
      }
      // The team walks to the limit of its last row (the furthest; rows of tiles past
      // num_rows see nothing), which never exceeds the context (below 2^31).
      const int64_t last_row = min((group_tile + 1) * kTeam * kTileRows, num_rows) - 1;
      const int64_t end = min(min(past + last_row / shape.group + 1, max_positions), split_end);
      const int64_t num_steps = end > split_begin ? (end - split_begin + kStep - 1) / kStep : 0;

      // The element offset of row lane % 16 of step s's K/V rows, or -1 for none (past
      // `end`, or no block).
      auto row_offset = [&](int64_t s) -> int64_t {
        const int64_t pos = split_begin + s * kStep + (lane & (kStep - 1));
        if (pos >= end) return -1;
        const uint32_t p = static_cast<uint32_t>(pos);
        const int64_t block = table[p / shape.block_size];
        if (block < 0 || block >= shape.num_blocks) return -1;
        return (block * shape.block_size + p % shape.block_size) * kv_stride + kv_head * D;
      };
      // Step s's K and V rows into its ring buffer (offsets from row_offset(s)).
      auto copy_step = [&](int64_t s, int64_t offset) {
        uint4* buf = ring + static_cast<int>(s % kStages) * (2 * kStepUnits);
#pragma unroll
        for (int c = 0; c < kCopies; ++c) {
          const int u = team_tid + c * kTeamThreads;
          const int row = u / kRowUnits, col = u % kRowUnits;
          const int64_t src = __shfl_sync(kFullMask, static_cast<long long>(offset), row);
          const bool valid = src >= 0;
          const int64_t at = valid ? src + col * 8 : 0;
          CopyAsync16(buf + row * kRowUnits + (col ^ KSwizzle(row)), k_cache + at, valid);
          CopyAsync16(buf + kStepUnits + row * kRowUnits + (col ^ VSwizzle<D>(row)), v_cache + at,
                      valid);
        }
      };

      TeamSync<kTeam>();  // the ring's readers of the previous tile are done
      int64_t offset = row_offset(0);
#pragma unroll
      for (int s = 0; s < kStages - 1; ++s) {
        if (s < num_steps) {
          copy_step(s, offset);
          offset = row_offset(s + 1);
        }
        CopyAsyncCommit();  // one group per step, empty or not: the waits count groups
      }

      float o[kNTiles][4];
#pragma unroll
      for (int n = 0; n < kNTiles; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.f;
      float run_max[2] = {-INFINITY, -INFINITY}, run_sum[2] = {0.f, 0.f};

      int stage = 0;
      for (int64_t step = 0; step < num_steps; ++step) {
        CopyAsyncWait<kStages - 2>();  // this step's group has landed (this thread's part)
        TeamSync<kTeam>();             // everyone's part, and the buffer refilled below is read out
        if (step + kStages - 1 < num_steps) {
          copy_step(step + kStages - 1, offset);
          offset = row_offset(step + kStages);
        }
        CopyAsyncCommit();
        const uint4* ks = ring + stage * (2 * kStepUnits);
        const uint4* vs = ks + kStepUnits;
        stage = stage == kStages - 1 ? 0 : stage + 1;
        const int64_t base = split_begin + step * kStep;

        float s[2][4];
#pragma unroll
        for (int nt = 0; nt < 2; ++nt) {
          s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.f;
          const int row = nt * 8 + g;
#pragma unroll
          for (int j = 0; j < kQUnits; ++j) {
            const uint4 kr = ks[row * kRowUnits + ((4 * j + t) ^ KSwizzle(row))];
            Mma16<T>::Run(s[nt], qf[2 * j], kr.x, kr.y);
            Mma16<T>::Run(s[nt], qf[2 * j + 1], kr.z, kr.w);
          }
        }
        uint4 vr[4][kVUnits];  // positions base + 2t, 2t + 1, 2t + 8, 2t + 9
#pragma unroll
        for (int rr = 0; rr < 4; ++rr) {
          const int row = (rr >> 1) * 8 + 2 * t + (rr & 1);
#pragma unroll
          for (int u = 0; u < kVUnits; ++u) {
            vr[rr][u] = vs[row * kRowUnits + ((g * kVUnits + u) ^ VSwizzle<D>(row))];
          }
        }
#pragma unroll
        for (int nt = 0; nt < 2; ++nt) {
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const int64_t pos = base + nt * 8 + 2 * t + e;
            s[nt][e] = pos < limit[0] ? s[nt][e] * shape.scale_log2 : -INFINITY;
            s[nt][2 + e] = pos < limit[1] ? s[nt][2 + e] * shape.scale_log2 : -INFINITY;
          }
        }
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          float mx = fmaxf(fmaxf(s[0][2 * half], s[0][2 * half + 1]),
                           fmaxf(s[1][2 * half], s[1][2 * half + 1]));
          mx = fmaxf(mx, __shfl_xor_sync(kFullMask, mx, 1));
          mx = fmaxf(mx, __shfl_xor_sync(kFullMask, mx, 2));
          const float new_max = fmaxf(run_max[half], mx);
          // Nothing visible yet: keep everything at zero (and avoid inf - inf).
          const float ref = new_max == -INFINITY ? 0.f : new_max;
          const float rescale = exp2f(run_max[half] - ref);  // 0 while run_max is -inf
          float sum = 0.f;
#pragma unroll
          for (int nt = 0; nt < 2; ++nt) {
#pragma unroll
            for (int e = 0; e < 2; ++e) {
              const float p = exp2f(s[nt][2 * half + e] - ref);
              s[nt][2 * half + e] = p;
              sum += p;
            }
          }
          run_sum[half] = run_sum[half] * rescale + sum;
          run_max[half] = new_max;
#pragma unroll
          for (int n = 0; n < kNTiles; ++n) {
            o[n][2 * half] *= rescale;
            o[n][2 * half + 1] *= rescale;
          }
        }
        uint32_t p_hi[4], p_lo[4];
        Mma16<T>::Split(s[0][0], s[0][1], &p_hi[0], &p_lo[0]);
        Mma16<T>::Split(s[0][2], s[0][3], &p_hi[1], &p_lo[1]);
        Mma16<T>::Split(s[1][0], s[1][1], &p_hi[2], &p_lo[2]);
        Mma16<T>::Split(s[1][2], s[1][3], &p_hi[3], &p_lo[3]);
#pragma unroll
        for (int n = 0; n < kNTiles; ++n) {
          const int w = n / 2;  // the word of each V row holding element n
          const uint32_t sel = (n & 1) ? 0x7632u : 0x5410u;
          const uint32_t b0 =
              __byte_perm(Word(vr[0][w / 4], w % 4), Word(vr[1][w / 4], w % 4), sel);
          const uint32_t b1 =
              __byte_perm(Word(vr[2][w / 4], w % 4), Word(vr[3][w / 4], w % 4), sel);
          Mma16<T>::Run(o[n], p_hi, b0, b1);
          Mma16<T>::Run(o[n], p_lo, b0, b1);
        }
      }

#pragma unroll
      for (int half = 0; half < 2; ++half) {
        float sum = run_sum[half];
        sum += __shfl_xor_sync(kFullMask, sum, 1);
        sum += __shfl_xor_sync(kFullMask, sum, 2);
        if (token[half] < 0) continue;
        const int64_t out_row = (token[half] * shape.num_heads + head[half]) * D;
        if (shape.num_splits == 1) {
          // A row that sees no position (inconsistent metadata) gets zeros.
          const float inv = sum > 0.f ? 1.f / sum : 0.f;
#pragma unroll
          for (int n = 0; n < kNTiles; ++n) {
#pragma unroll
            for (int e = 0; e < 2; ++e) {
              StoreFromFloat(out, shape.out_type, out_row + (2 * t + e) * kVElems + n,
                             o[n][2 * half + e] * inv);
            }
          }
        } else {
          const int64_t index =
              (token[half] * shape.num_heads + head[half]) * shape.num_splits + split;
          float* acc = partial_acc + index * D;
#pragma unroll
          for (int n = 0; n < kNTiles; ++n) {
#pragma unroll
            for (int e = 0; e < 2; ++e) acc[(2 * t + e) * kVElems + n] = o[n][2 * half + e];
          }
          if (t == 0) {
            partial_ml[2 * index] = run_max[half];
            partial_ml[2 * index + 1] = sum;
          }
        }
      }
    }
  }
}

constexpr int kMergeThreads = 256;
constexpr int kMergeWarps = kMergeThreads / kWarpSize;
constexpr int kMaxMergeDim = 128;  // the tensor-core path's widest head
constexpr int kMergeElems = kMaxMergeDim / kWarpSize;

struct MergeShape {
  int64_t num_tokens;
  int64_t num_heads;
  int head_dim;
  int num_splits;
  ElemType out_type;
};

// out[row, head] = sum_s acc_s * 2^(m_s - M) / sum_s l_s * 2^(m_s - M). A block per (row,
// head) of sequence blockIdx.y; warp w takes splits w, w + kMergeWarps, ... (ascending) and
// the warps' sums are added in warp order: a fixed order.
__global__ void __launch_bounds__(kMergeThreads)
    MergeSplitsKernel(const float* __restrict__ partial_acc, const float* __restrict__ partial_ml,
                      const int32_t* __restrict__ query_start, MergeShape shape,
                      void* __restrict__ out) {
  PdlWait();
  __shared__ float warp_max[kMergeWarps], warp_sum[kMergeWarps];
  __shared__ float warp_acc[kMergeWarps][kMaxMergeDim];
  const int lane = threadIdx.x % kWarpSize, warp = threadIdx.x / kWarpSize;
  const int64_t seq = blockIdx.y;
  const int64_t q_begin = query_start[seq];
  const int64_t q_len = query_start[seq + 1] - q_begin;
  const int64_t items = q_len * shape.num_heads;
  const int S = shape.num_splits, D = shape.head_dim;
  for (int64_t f = blockIdx.x; f < items; f += gridDim.x) {  // uniform across the block
    const int64_t token = q_begin + f / shape.num_heads;
    if (token < 0 || token >= shape.num_tokens) continue;
    const int64_t item = token * shape.num_heads + f % shape.num_heads;
    const float* ml = partial_ml + 2 * item * S;
    const float* pa = partial_acc + item * S * D;
    float m = -INFINITY;
    for (int s = warp; s < S; s += kMergeWarps) {
      if (ml[2 * s + 1] > 0.f) m = fmaxf(m, ml[2 * s]);
    }
    if (lane == 0) warp_max[warp] = m;
    __syncthreads();
#pragma unroll
    for (int w = 0; w < kMergeWarps; ++w) m = fmaxf(m, warp_max[w]);
    float acc[kMergeElems], total = 0.f;
#pragma unroll
    for (int k = 0; k < kMergeElems; ++k) acc[k] = 0.f;
#pragma unroll 4
    for (int s = warp; s < S; s += kMergeWarps) {
      const float l = ml[2 * s + 1];
      if (!(l > 0.f)) continue;  // an empty split: nothing to add
      const float w = exp2f(ml[2 * s] - m);
      total += l * w;
#pragma unroll
      for (int k = 0; k < kMergeElems; ++k) {
        const int d = lane + k * kWarpSize;
        if (d < D) acc[k] += pa[static_cast<int64_t>(s) * D + d] * w;
      }
    }
#pragma unroll
    for (int k = 0; k < kMergeElems; ++k) {
      const int d = lane + k * kWarpSize;
      if (d < D) warp_acc[warp][d] = acc[k];
    }
    if (lane == 0) warp_sum[warp] = total;
    __syncthreads();
    for (int d = threadIdx.x; d < D; d += kMergeThreads) {
      float sum = 0.f, value = 0.f;
#pragma unroll
      for (int w = 0; w < kMergeWarps; ++w) {
        sum += warp_sum[w];
        value += warp_acc[w][d];
      }
      // A row that sees no position (inconsistent metadata) gets zeros.
      StoreFromFloat(out, shape.out_type, item * D + d, sum > 0.f ? value / sum : 0.f);
    }
    __syncthreads();  // before the next item overwrites the warp arrays
  }
}

// How decode work is spread: splits of the positions when (sequence, kv head, row tile)
// items alone would leave SMs idle. A function of the arguments and the device only.
struct SplitPlan {
  int num_splits = 1;
  int64_t split_len = 0;
  int64_t row_slots = 1;   // 16-row tiles per (sequence, kv head) the launch provides for
  int team = 1;            // warps sharing a ring: kPrefillTeam when tiles share positions
  int64_t team_slots = 1;  // teams per (sequence, kv head, split)
};

// The current device's SM count, asked once per device (the plan runs on every launch).
int DeviceSmCount() {
  constexpr int kMaxDevices = 64;
  static std::atomic<int> cached[kMaxDevices] = {};
  int device = 0, sms = 0;
  if (cudaGetDevice(&device) != cudaSuccess) {
    cudaGetLastError();  // clear: no device is not this call's error
    return 132;          // an H200's
  }
  if (device >= 0 && device < kMaxDevices) {
    sms = cached[device].load(std::memory_order_relaxed);
    if (sms > 0) return sms;
  }
  if (cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess ||
      sms <= 0) {
    cudaGetLastError();
    return 132;
  }
  if (device >= 0 && device < kMaxDevices) cached[device].store(sms, std::memory_order_relaxed);
  return sms;
}

bool MmaHeadDim(int64_t head_dim) { return head_dim == 64 || head_dim == 128; }

SplitPlan PlanSplits(const PagedAttentionArgs& args) {
  SplitPlan plan;
  const int64_t group = args.num_heads / args.num_kv_heads;
  const int64_t rows = std::max<int64_t>(1, std::min(args.max_query_len, args.num_tokens));
  plan.row_slots = std::max<int64_t>(1, (rows * group + kTileRows - 1) / kTileRows);
  const int64_t max_positions = args.max_blocks_per_seq * args.block_size;
  const int64_t context = std::max<int64_t>(1, std::min(args.max_context_len, max_positions));
  plan.split_len = (context + kStep - 1) / kStep * kStep;
  if (!MmaHeadDim(args.head_dim)) return plan;
  plan.team_slots = plan.row_slots;
  if (plan.row_slots >= kPrefillTeam) {  // query chunks: a team's tiles share K/V steps
    plan.team = kPrefillTeam;
    plan.team_slots = (plan.row_slots + kPrefillTeam - 1) / kPrefillTeam;
  }
  const int64_t items = args.num_seqs * args.num_kv_heads * plan.team_slots * plan.team;
  const int64_t target = static_cast<int64_t>(DeviceSmCount()) * kWarpsPerSmTarget;
  int64_t splits = std::max<int64_t>(1, target / items);
  splits = std::min<int64_t>({splits, (context + kMinSplitLen - 1) / kMinSplitLen, kMaxSplits});
  if (splits <= 1) return plan;
  const int64_t len = ((context + splits - 1) / splits + kStep - 1) / kStep * kStep;
  plan.split_len = len;
  plan.num_splits = static_cast<int>((context + len - 1) / len);
  return plan;
}

size_t PartialBytes(const PagedAttentionArgs& args, const SplitPlan& plan) {
  if (plan.num_splits <= 1) return 0;
  return static_cast<size_t>(args.num_tokens) * args.num_heads * plan.num_splits *
         (args.head_dim + 2) * sizeof(float);
}

// Kernels whose ring exceeds the default 48 KiB of dynamic shared memory opt in, once per
// device (the launch path runs on every layer).
template <typename Kernel>
cudaError_t AllowSharedBytes(Kernel* kernel, size_t bytes, std::atomic<uint64_t>* allowed) {
  if (bytes <= 48 * 1024) return cudaSuccess;
  int device = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err != cudaSuccess) return err;
  const uint64_t bit = device < 64 ? uint64_t{1} << device : 0;
  if (bit != 0 && (allowed->load(std::memory_order_relaxed) & bit)) return cudaSuccess;
  err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                             static_cast<int>(bytes));
  if (err == cudaSuccess && bit != 0) allowed->fetch_or(bit, std::memory_order_relaxed);
  return err;
}

template <typename T, int D, int kTeam>
cudaError_t LaunchMmaKernel(const void* q, const void* k_cache, const void* v_cache,
                            const PagedAttentionArgs& args, const MmaShape& shape, unsigned blocks,
                            void* out, float* partial_acc, float* partial_ml, cudaStream_t stream) {
  static std::atomic<uint64_t> allowed{0};
  constexpr size_t kSmem = MmaSharedBytes<D, kTeam>();
  auto* kernel = PagedAttentionMmaKernel<T, D, kTeam>;
  const cudaError_t err = AllowSharedBytes(kernel, kSmem, &allowed);
  if (err != cudaSuccess) return err;
  LaunchKernel(kernel, blocks, kMmaThreads, kSmem, stream, static_cast<const T*>(q),
               static_cast<const T*>(k_cache), static_cast<const T*>(v_cache), args.query_start,
               args.context_lens, args.block_tables, shape, out, partial_acc, partial_ml);
  return cudaGetLastError();
}

template <typename T>
cudaError_t LaunchMma(const void* q, const void* k_cache, const void* v_cache,
                      const PagedAttentionArgs& args, const MmaShape& shape, int team,
                      unsigned blocks, void* out, float* partial_acc, float* partial_ml,
                      cudaStream_t stream) {
  auto launch = [&](auto d, auto team_c) {
    return LaunchMmaKernel<T, decltype(d)::value, decltype(team_c)::value>(
        q, k_cache, v_cache, args, shape, blocks, out, partial_acc, partial_ml, stream);
  };
  using Team1 = std::integral_constant<int, 1>;
  using TeamN = std::integral_constant<int, kPrefillTeam>;
  if (args.head_dim == 64) {
    using D = std::integral_constant<int, 64>;
    return team == 1 ? launch(D{}, Team1{}) : launch(D{}, TeamN{});
  }
  using D = std::integral_constant<int, 128>;
  return team == 1 ? launch(D{}, Team1{}) : launch(D{}, TeamN{});
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
    LaunchKernel(WriteKvCacheVecKernel, blocks, kKvThreads, 0, stream, static_cast<const uint4*>(k),
                 static_cast<const uint4*>(v), slot_mapping, tokens,
                 static_cast<int64_t>(row_bytes / 16), static_cast<uint4*>(k_cache),
                 static_cast<uint4*>(v_cache));
    return cudaGetLastError();
  }
  return DispatchFloat(kv_type, [&](auto st) {
    return DispatchFloat(cache_type, [&](auto dt) {
      using Src = typename decltype(st)::type;
      using Dst = typename decltype(dt)::type;
      LaunchKernel(WriteKvCacheKernel<Src, Dst>, blocks, kKvThreads, 0, stream,
                   static_cast<const Src*>(k), static_cast<const Src*>(v), slot_mapping, tokens,
                   row_elems, static_cast<Dst*>(k_cache), static_cast<Dst*>(v_cache));
      return cudaGetLastError();
    });
  });
}

size_t PagedAttentionWorkspaceBytes(const PagedAttentionArgs& args) {
  if (args.num_tokens <= 0 || args.num_seqs <= 0 || args.num_heads <= 0 || args.num_kv_heads <= 0 ||
      args.num_heads % args.num_kv_heads != 0 || args.block_size <= 0 ||
      args.max_blocks_per_seq < 0) {
    return 0;
  }
  return PartialBytes(args, PlanSplits(args));
}

cudaError_t LaunchPagedAttention(const void* q, ElemType q_type, const void* k_cache,
                                 const void* v_cache, ElemType cache_type,
                                 const PagedAttentionArgs& args, float scale, void* out,
                                 ElemType out_type, void* workspace, size_t workspace_bytes,
                                 cudaStream_t stream) {
  if (!IsFloating(q_type) || !IsFloating(cache_type) || !IsFloating(out_type) ||
      args.num_seqs < 0 || args.num_seqs > kMaxGridZ || args.num_tokens < 0 ||
      args.num_heads <= 0 || args.num_kv_heads <= 0 || args.num_kv_heads > kMaxGridZ ||
      args.num_heads % args.num_kv_heads != 0 || args.head_dim <= 0 ||
      args.head_dim > kMaxHeadDim || args.block_size <= 0 || args.max_blocks_per_seq < 0 ||
      args.num_blocks < 0) {
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
  const SplitPlan plan = PlanSplits(args);
  const size_t partial_bytes = PartialBytes(args, plan);
  if (partial_bytes > 0 && (workspace == nullptr || workspace_bytes < partial_bytes)) {
    return cudaErrorInvalidValue;
  }

  // Query rows per sequence: max_query_len is a hint, never more than the rows there are.
  const int64_t rows = std::max<int64_t>(1, std::min(args.max_query_len, args.num_tokens));
  const bool mma =
      q_type == cache_type && (cache_type == ElemType::kBF16 || cache_type == ElemType::kF16) &&
      MmaHeadDim(args.head_dim) && Aligned16(q) && Aligned16(k_cache) && Aligned16(v_cache);
  if (mma) {
    MmaShape shape;
    shape.num_tokens = args.num_tokens;
    shape.num_heads = args.num_heads;
    shape.num_kv_heads = args.num_kv_heads;
    shape.group = group;
    shape.block_size = static_cast<uint32_t>(std::min<int64_t>(args.block_size, INT32_MAX));
    shape.max_blocks_per_seq = args.max_blocks_per_seq;
    shape.num_blocks = args.num_blocks;
    shape.team_slots = plan.team_slots;
    shape.num_teams = args.num_seqs * args.num_kv_heads * plan.num_splits * plan.team_slots;
    shape.split_len = plan.split_len;
    shape.num_splits = plan.num_splits;
    shape.scale_log2 = scale * 1.4426950408889634f;
    shape.out_type = out_type;
    float* partial_acc = static_cast<float*>(workspace);
    float* partial_ml = plan.num_splits > 1 ? partial_acc + args.num_tokens * args.num_heads *
                                                                plan.num_splits * args.head_dim
                                            : nullptr;
    const unsigned blocks = GridBlocks(shape.num_teams, kMmaWarps / plan.team);
    const cudaError_t launched =
        cache_type == ElemType::kBF16
            ? LaunchMma<__nv_bfloat16>(q, k_cache, v_cache, args, shape, plan.team, blocks, out,
                                       partial_acc, partial_ml, stream)
            : LaunchMma<__half>(q, k_cache, v_cache, args, shape, plan.team, blocks, out,
                                partial_acc, partial_ml, stream);
    if (launched != cudaSuccess || plan.num_splits == 1) return launched;
    MergeShape merge;
    merge.num_tokens = args.num_tokens;
    merge.num_heads = args.num_heads;
    merge.head_dim = static_cast<int>(args.head_dim);
    merge.num_splits = plan.num_splits;
    merge.out_type = out_type;
    const dim3 merge_grid(GridBlocks(rows * args.num_heads, 1),
                          static_cast<unsigned>(args.num_seqs));
    LaunchKernel(MergeSplitsKernel, merge_grid, kMergeThreads, 0, stream, partial_acc, partial_ml,
                 args.query_start, merge, out);
    return cudaGetLastError();
  }

  AttentionShape shape;
  shape.num_tokens = args.num_tokens;
  shape.num_heads = args.num_heads;
  shape.num_kv_heads = args.num_kv_heads;
  shape.group = static_cast<int>(group);
  shape.head_dim = static_cast<int>(args.head_dim);
  shape.block_size = args.block_size;
  shape.max_blocks_per_seq = args.max_blocks_per_seq;
  shape.num_blocks = args.num_blocks;
  shape.chunk = ChunkFor(args.head_dim);
  shape.scale = scale;
  shape.q_type = q_type;
  shape.out_type = out_type;
  shape.vector_loads = (args.head_dim * static_cast<int64_t>(ElemSize(cache_type))) % 16 == 0 &&
                       Aligned16(k_cache) && Aligned16(v_cache);
  const size_t smem = AttentionSharedBytes(shape.group, shape.head_dim, shape.chunk);
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
    LaunchKernel(PagedAttentionKernel<T>, grid, kAttnThreads, smem, stream, q,
                 static_cast<const T*>(k_cache), static_cast<const T*>(v_cache), args.query_start,
                 args.context_lens, args.block_tables, shape, out);
    return cudaGetLastError();
  });
}

}  // namespace dxs::cuda
