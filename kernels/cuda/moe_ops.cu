// The MoE kernels of the CUDA backend (kernels/cuda/ops.cuh, section moe_ops.cu): the
// dispatch layout, the stable sort of pairs by expert, the combine and the scale-add.
//
// Every integer output is bit-identical to the CPU backend's (kernels/cpu_moe_ops.cc): the
// layout goes on the wire. Nothing here depends on scheduling: integer results come from
// prefix sums and per-tile ranks (integer atomics only count), and every floating sum is
// taken in the CPU's order by one thread per output element.
//
// Building blocks:
// - ExclusiveScan: a three-kernel prefix sum of i32 (tile sums, one block scanning them,
//   each tile rescanned with its offset). Its scratch is plain arithmetic on the length,
//   so the *WorkspaceBytes functions never touch CUDA (CUB's device-wide algorithms would
//   ask the device for their tuning).
// - SortByKey: a stable LSD radix sort of the indices [0, n) by keys[i] in [0, num_keys),
//   out-of-range keys treated as num_keys (so they sort last). Each pass of at most 8 bits
//   ranks every item within its tile of 256 (the count of equal digits before it, read from
//   shared memory), scans the per-(digit, tile) counts digit-major and scatters; then the
//   segment offsets [num_keys + 1] are read off the sorted keys. Small sorts (at most 4096
//   items and 4096 buckets: a decode step's pairs) take one block instead (SmallSortKernel,
//   a counting sort in shared memory), with the same result: one launch instead of six.
//
// Data-dependent bad input (ops.cuh): an expert id outside [0, num_experts), an owner
// outside [0, num_ranks), a row outside [0, dst_rows) or a token_rows entry outside
// [0, num_tokens) is skipped where the CPU backend would have failed. Skipped pairs are not
// counted; SortPairsByExpert lists them after expert_offsets[num_experts] in `order`.
//
// Empty work launches nothing, as ops.cuh says; so SortPairsByExpert with no pairs leaves
// expert_offsets unwritten (the caller zeroes them if it reads them). The dispatch layout
// alone still writes its (zero) counts. CombineRows takes null recv and token_rows when
// every rank's range is empty (only the device knows the ranges).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <climits>
#include <cstddef>
#include <cstdint>
#include <cub/block/block_reduce.cuh>
#include <cub/block/block_scan.cuh>

#include "kernels/cuda/carver.cuh"
#include "kernels/cuda/elem_type.cuh"
#include "kernels/cuda/launch.cuh"
#include "kernels/cuda/ops.cuh"
#include "kernels/cuda/return_if_error.cuh"
#include "kernels/replica_choice.h"

namespace dxs::cuda {
namespace {

constexpr int kThreads = 256;  // every kernel's block size
constexpr int kScanItems = 8;  // per thread in a scan tile
constexpr int64_t kScanTile = kThreads * kScanItems;
constexpr int kSortTile = kThreads;  // one item per thread
constexpr int kMaxDigitBits = 8;     // a sort pass has at most kThreads buckets
constexpr int kColsPerThread = 4;    // row kernels: a block covers 1024 columns of a row
constexpr int64_t kColsPerBlock = kThreads * kColsPerThread;
constexpr int64_t kMaxGridY = 65535;
constexpr int kWarpSize = 32;
constexpr unsigned kFullMask = 0xffffffffu;
constexpr int kSmallSortItems = 16;  // per thread: the small sort's items are in registers
constexpr int64_t kSmallSortMaxItems = kThreads * kSmallSortItems;  // 4096
constexpr int32_t kSmallSortMaxBuckets = 4096;  // num_keys + 1, in shared memory (16 KiB)

static_assert(1 << kMaxDigitBits <= kThreads, "a thread counts each bucket of its tile");

int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

// ---- Exclusive prefix sum of i32 ----

int64_t ScanPartials(int64_t n) { return CeilDiv(n, kScanTile); }

using BlockScanI32 = cub::BlockScan<int32_t, kThreads>;

__global__ void __launch_bounds__(kThreads)
    ScanTileSumsKernel(const int32_t* __restrict__ in, int64_t n, int32_t* __restrict__ sums) {
  PdlWait();
  using BlockReduceI32 = cub::BlockReduce<int32_t, kThreads>;
  __shared__ typename BlockReduceI32::TempStorage temp;
  const int64_t base = static_cast<int64_t>(blockIdx.x) * kScanTile;
  int32_t sum = 0;
#pragma unroll
  for (int j = 0; j < kScanItems; ++j) {
    const int64_t p = base + j * kThreads + threadIdx.x;
    if (p < n) sum += in[p];
  }
  sum = BlockReduceI32(temp).Sum(sum);
  if (threadIdx.x == 0) sums[blockIdx.x] = sum;
}

// One block: the tile sums become the tiles' exclusive offsets, in place.
__global__ void __launch_bounds__(kThreads)
    ScanTileOffsetsKernel(int32_t* __restrict__ sums, int64_t num_tiles) {
  PdlWait();
  __shared__ typename BlockScanI32::TempStorage temp;
  int32_t carry = 0;
  for (int64_t base = 0; base < num_tiles; base += kThreads) {
    const int64_t p = base + threadIdx.x;
    int32_t v = p < num_tiles ? sums[p] : 0;
    int32_t chunk_sum;
    BlockScanI32(temp).ExclusiveSum(v, v, chunk_sum);
    if (p < num_tiles) sums[p] = carry + v;
    carry += chunk_sum;
    __syncthreads();  // temp is reused by the next chunk
  }
}

__global__ void __launch_bounds__(kThreads)
    ScanTilesKernel(const int32_t* __restrict__ in, int64_t n,
                    const int32_t* __restrict__ tile_offsets, int32_t* __restrict__ out) {
  PdlWait();
  __shared__ typename BlockScanI32::TempStorage temp;
  // Blocked: thread x holds items [x * kScanItems, (x + 1) * kScanItems) of the tile.
  const int64_t base = static_cast<int64_t>(blockIdx.x) * kScanTile + threadIdx.x * kScanItems;
  int32_t items[kScanItems];
#pragma unroll
  for (int j = 0; j < kScanItems; ++j) items[j] = base + j < n ? in[base + j] : 0;
  BlockScanI32(temp).ExclusiveSum(items, items);
  const int32_t offset = tile_offsets[blockIdx.x];
#pragma unroll
  for (int j = 0; j < kScanItems; ++j) {
    if (base + j < n) out[base + j] = offset + items[j];
  }
}

// out[i] = in[0] + ... + in[i - 1] for n >= 1 values whose total fits i32. partials holds
// ScanPartials(n) values.
cudaError_t ExclusiveScan(const int32_t* in, int64_t n, int32_t* out, int32_t* partials,
                          cudaStream_t stream) {
  const int64_t tiles = ScanPartials(n);
  LaunchKernel(ScanTileSumsKernel, static_cast<unsigned>(tiles), kThreads, 0, stream, in, n,
               partials);
  DXS_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  LaunchKernel(ScanTileOffsetsKernel, 1, kThreads, 0, stream, partials, tiles);
  DXS_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  LaunchKernel(ScanTilesKernel, static_cast<unsigned>(tiles), kThreads, 0, stream, in, n, partials,
               out);
  return cudaGetLastError();
}

// ---- Stable sort of indices by key ----

// keys[v] in [0, num_keys), else num_keys: out-of-range keys form a last bucket.
__device__ __forceinline__ int32_t KeyOf(const int32_t* __restrict__ keys, int32_t num_keys,
                                         int32_t v) {
  const int32_t k = keys[v];
  return k >= 0 && k < num_keys ? k : num_keys;
}

struct SortShape {
  int64_t n = 0;
  int64_t num_keys = 0;
  int64_t tiles = 0;
  int passes = 0;
  int digit_bits = 0;
  int64_t cells = 0;  // (digit, tile) counts: (1 << digit_bits) * tiles
  bool valid = false;
};

SortShape MakeSortShape(int64_t n, int64_t num_keys) {
  SortShape s;
  s.n = n;
  s.num_keys = num_keys;
  if (n <= 0 || n > INT_MAX || num_keys <= 0 || num_keys >= INT_MAX) return s;
  int key_bits = 0;  // bits of the largest key, the num_keys bucket
  while ((int64_t{1} << key_bits) <= num_keys) ++key_bits;
  s.passes = static_cast<int>(CeilDiv(key_bits, kMaxDigitBits));
  s.digit_bits = static_cast<int>(CeilDiv(key_bits, s.passes));
  s.tiles = CeilDiv(n, kSortTile);
  s.cells = (int64_t{1} << s.digit_bits) * s.tiles;
  s.valid = s.cells <= INT_MAX;
  return s;
}

struct SortScratch {
  int32_t* rank_in_tile = nullptr;  // [n]
  int32_t* perm_tmp = nullptr;      // [n], with two passes or more
  int32_t* counts = nullptr;        // [cells], digit-major
  int32_t* starts = nullptr;        // [cells]
  int32_t* partials = nullptr;      // scan scratch
};

SortScratch CarveSort(Carver& c, const SortShape& s) {
  SortScratch w;
  w.rank_in_tile = c.Take<int32_t>(s.n);
  if (s.passes >= 2) w.perm_tmp = c.Take<int32_t>(s.n);
  w.counts = c.Take<int32_t>(s.cells);
  w.starts = c.Take<int32_t>(s.cells);
  w.partials = c.Take<int32_t>(ScanPartials(s.cells));
  return w;
}

// Item p of the pass is index v = perm_in[p] (p itself when perm_in is null); its digit is
// bits [shift, shift + digit_bits) of KeyOf(v).
__device__ __forceinline__ int32_t SortItem(const int32_t* __restrict__ perm_in, int32_t p) {
  return perm_in == nullptr ? p : perm_in[p];
}

__device__ __forceinline__ int32_t Digit(int32_t key, int shift, int32_t num_buckets) {
  return (key >> shift) & (num_buckets - 1);
}

// rank_in_tile[p] = items of p's tile before p with p's digit; counts[d * tiles + tile] =
// items of the tile with digit d.
__global__ void __launch_bounds__(kThreads)
    SortRankKernel(const int32_t* __restrict__ keys, int32_t num_keys,
                   const int32_t* __restrict__ perm_in, int32_t n, int shift, int32_t num_buckets,
                   int32_t* __restrict__ rank_in_tile, int32_t* __restrict__ counts) {
  PdlWait();
  __shared__ int32_t digits[kSortTile];
  const int32_t p =
      static_cast<int32_t>(blockIdx.x) * kSortTile + static_cast<int32_t>(threadIdx.x);
  int32_t digit = -1;  // padding past n matches no bucket
  if (p < n) digit = Digit(KeyOf(keys, num_keys, SortItem(perm_in, p)), shift, num_buckets);
  digits[threadIdx.x] = digit;
  __syncthreads();
  if (p < n) {
    int32_t rank = 0;
    for (int q = 0; q < static_cast<int>(threadIdx.x); ++q) rank += digits[q] == digit;
    rank_in_tile[p] = rank;
  }
  if (static_cast<int32_t>(threadIdx.x) < num_buckets) {
    int32_t count = 0;
    for (int q = 0; q < kSortTile; ++q) count += digits[q] == static_cast<int32_t>(threadIdx.x);
    counts[static_cast<int64_t>(threadIdx.x) * gridDim.x + blockIdx.x] = count;
  }
}

__global__ void __launch_bounds__(kThreads)
    SortScatterKernel(const int32_t* __restrict__ keys, int32_t num_keys,
                      const int32_t* __restrict__ perm_in, int32_t n, int shift,
                      int32_t num_buckets, const int32_t* __restrict__ rank_in_tile,
                      const int32_t* __restrict__ starts, int32_t* __restrict__ perm_out) {
  PdlWait();
  const int32_t p =
      static_cast<int32_t>(blockIdx.x) * kSortTile + static_cast<int32_t>(threadIdx.x);
  if (p >= n) return;
  const int32_t v = SortItem(perm_in, p);
  const int32_t digit = Digit(KeyOf(keys, num_keys, v), shift, num_buckets);
  perm_out[starts[static_cast<int64_t>(digit) * gridDim.x + blockIdx.x] + rank_in_tile[p]] = v;
}

// offsets[k] = the first position of `sorted` whose key is >= k, for k in [0, num_keys]:
// position p writes the keys in (key before p, key at p], position n standing for
// num_keys. Each offset is written exactly once.
__global__ void __launch_bounds__(kThreads)
    SegmentOffsetsKernel(const int32_t* __restrict__ keys, int32_t num_keys,
                         const int32_t* __restrict__ sorted, int32_t n,
                         int32_t* __restrict__ offsets) {
  PdlWait();
  const int64_t p = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (p > n) return;
  const int32_t before = p == 0 ? -1 : KeyOf(keys, num_keys, sorted[p - 1]);
  const int32_t at = p == n ? num_keys : KeyOf(keys, num_keys, sorted[p]);
  for (int32_t k = before + 1; k <= at; ++k) offsets[k] = static_cast<int32_t>(p);
}

// ---- The small sort: one block ----
//
// A stable counting sort with every bucket in shared memory, for n <= kSmallSortMaxItems
// items and num_keys + 1 <= kSmallSortMaxBuckets buckets (a decode step's few pairs): one
// launch instead of the radix chain's six. Thread x holds items c * kThreads + x (c <
// kSmallSortItems) in registers. Chunk c's items are ranked warp by warp in item order: a
// warp's lanes with equal keys find each other (__match_any_sync), take the bucket's running
// count plus their lanes before, and the lowest adds the group's size. The counts become
// the buckets' starts by one block scan, and each item lands at start + rank. The result is
// the radix chain's exactly (both are the stable order, out-of-range keys last).
__global__ void __launch_bounds__(kThreads)
    SmallSortKernel(const int32_t* __restrict__ keys, int32_t num_keys, int32_t n,
                    int32_t* __restrict__ sorted, int32_t* __restrict__ offsets,
                    SortPayloads payloads) {
  PdlWait();
  __shared__ int32_t bucket[kSmallSortMaxBuckets];  // running counts, then starts
  __shared__ typename BlockScanI32::TempStorage temp;
  const int32_t num_buckets = num_keys + 1;
  for (int32_t b = threadIdx.x; b < num_buckets; b += kThreads) bucket[b] = 0;
  __syncthreads();
  const int lane = threadIdx.x % kWarpSize, warp = threadIdx.x / kWarpSize;
  const unsigned lanes_before = (1u << lane) - 1u;
  const int32_t chunks = (n + kThreads - 1) / kThreads;
  int32_t key[kSmallSortItems], rank[kSmallSortItems];
#pragma unroll
  for (int c = 0; c < kSmallSortItems; ++c) {
    key[c] = -1;
    rank[c] = 0;
    if (c >= chunks) continue;  // uniform over the block
    const int32_t first = c * kThreads, i = first + static_cast<int32_t>(threadIdx.x);
    if (i < n) key[c] = KeyOf(keys, num_keys, i);
    const unsigned peers = __match_any_sync(kFullMask, key[c]);
    const int32_t before = __popc(peers & lanes_before);
    const int32_t warps = (min(n - first, kThreads) + kWarpSize - 1) / kWarpSize;
    for (int w = 0; w < warps; ++w) {
      if (warp == w && i < n) rank[c] = bucket[key[c]] + before;
      __syncwarp();  // every peer has read the count before the lowest one adds to it
      if (warp == w && i < n && before == 0) bucket[key[c]] += __popc(peers);
      __syncthreads();
    }
  }
  int32_t carry = 0;
  for (int32_t base = 0; base < num_buckets; base += kThreads) {
    const int32_t b = base + static_cast<int32_t>(threadIdx.x);
    int32_t v = b < num_buckets ? bucket[b] : 0;
    int32_t chunk_sum;
    BlockScanI32(temp).ExclusiveSum(v, v, chunk_sum);
    if (b < num_buckets) {
      bucket[b] = carry + v;
      offsets[b] = carry + v;
    }
    carry += chunk_sum;
    __syncthreads();  // temp is reused by the next chunk; the starts are read below
  }
#pragma unroll
  for (int c = 0; c < kSmallSortItems; ++c) {
    const int32_t i = c * kThreads + static_cast<int32_t>(threadIdx.x);
    if (c >= chunks || i >= n) continue;
    const int32_t at = bucket[key[c]] + rank[c];
    sorted[at] = i;
#pragma unroll
    for (int j = 0; j < kMaxSortPayloads; ++j) {
      if (j < payloads.count) payloads.out[j][at] = payloads.in[j][i];
    }
  }
}

// out[j][s] = in[j][sorted[s]]: the payloads after the radix chain.
__global__ void __launch_bounds__(kThreads)
    PermutePayloadsKernel(const int32_t* __restrict__ sorted, int32_t n, SortPayloads payloads) {
  PdlWait();
  const int32_t s = static_cast<int32_t>(blockIdx.x) * kThreads + static_cast<int32_t>(threadIdx.x);
  if (s >= n) return;
  const int32_t v = sorted[s];
#pragma unroll
  for (int j = 0; j < kMaxSortPayloads; ++j) {
    if (j < payloads.count) payloads.out[j][s] = payloads.in[j][v];
  }
}

bool UsesSmallSort(const SortShape& s) {
  return s.n <= kSmallSortMaxItems && s.num_keys + 1 <= kSmallSortMaxBuckets;
}

// sorted[n] = the indices [0, n) stably sorted by KeyOf; offsets[num_keys + 1] bound each
// key's run (out-of-range keys come after offsets[num_keys]); the payloads permuted alike.
cudaError_t SortByKey(const int32_t* keys, const SortShape& s, const SortScratch& w,
                      int32_t* sorted, int32_t* offsets, const SortPayloads& payloads,
                      cudaStream_t stream) {
  const int32_t n = static_cast<int32_t>(s.n), num_keys = static_cast<int32_t>(s.num_keys);
  if (UsesSmallSort(s)) {
    LaunchKernel(SmallSortKernel, 1, kThreads, 0, stream, keys, num_keys, n, sorted, offsets,
                 payloads);
    return cudaGetLastError();
  }
  const int32_t num_buckets = 1 << s.digit_bits;
  const unsigned tiles = static_cast<unsigned>(s.tiles);
  const int32_t* in = nullptr;
  for (int pass = 0; pass < s.passes; ++pass) {
    // Alternate between sorted and perm_tmp so that the last pass lands in sorted.
    int32_t* out = (s.passes - 1 - pass) % 2 == 0 ? sorted : w.perm_tmp;
    const int shift = pass * s.digit_bits;
    LaunchKernel(SortRankKernel, tiles, kThreads, 0, stream, keys, num_keys, in, n, shift,
                 num_buckets, w.rank_in_tile, w.counts);
    DXS_CUDA_RETURN_IF_ERROR(cudaGetLastError());
    DXS_CUDA_RETURN_IF_ERROR(ExclusiveScan(w.counts, s.cells, w.starts, w.partials, stream));
    LaunchKernel(SortScatterKernel, tiles, kThreads, 0, stream, keys, num_keys, in, n, shift,
                 num_buckets, w.rank_in_tile, w.starts, out);
    DXS_CUDA_RETURN_IF_ERROR(cudaGetLastError());
    in = out;
  }
  const unsigned blocks = static_cast<unsigned>(CeilDiv(s.n + 1, kThreads));
  LaunchKernel(SegmentOffsetsKernel, blocks, kThreads, 0, stream, keys, num_keys, sorted, n,
               offsets);
  DXS_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  if (payloads.count == 0) return cudaSuccess;
  LaunchKernel(PermutePayloadsKernel, static_cast<unsigned>(CeilDiv(s.n, kThreads)), kThreads, 0,
               stream, sorted, n, payloads);
  return cudaGetLastError();
}

// ---- Dispatch layout ----

// Cell (r, t) = r * num_tokens + t: token t's pairs on rank r. Rank-major, so one prefix sum
// over all cells gives tok_off[r] + (rank r's tokens before t), and likewise for pairs.
struct LayoutScratch {
  int32_t* token_flags = nullptr;   // [cells] 1 when t has a pair on r
  int32_t* pair_counts = nullptr;   // [cells] t's pairs on r
  int32_t* token_starts = nullptr;  // [cells] exclusive prefix sums of the above
  int32_t* pair_starts = nullptr;
  int32_t* partials = nullptr;  // scan scratch, shared by both scans
};

LayoutScratch CarveLayout(Carver& c, int64_t cells) {
  LayoutScratch w;
  w.token_flags = c.Take<int32_t>(cells);
  w.pair_counts = c.Take<int32_t>(cells);
  w.token_starts = c.Take<int32_t>(cells);
  w.pair_starts = c.Take<int32_t>(cells);
  w.partials = c.Take<int32_t>(ScanPartials(cells));
  return w;
}

// Where pairs go: owner[num_experts, width], each expert's replicas' ranks (primary
// first, then -1); width 1 is one owner per expert.
struct OwnerTable {
  const int32_t* __restrict__ ranks;
  int32_t width;
  int32_t num_experts;
  int32_t num_ranks;
  int32_t top_k;
};

// The rank of pair p (the replica choice of kernels/replica_choice.h for its token row
// p / top_k; its expert written to *expert), or -1 for an expert outside [0, num_experts)
// or a rank outside [0, num_ranks): the pair is skipped.
__device__ __forceinline__ int32_t PairRank(const int32_t* __restrict__ ids, const OwnerTable& o,
                                            int64_t p, int32_t* expert) {
  const int32_t e = ids[p];
  *expert = e;
  if (e < 0 || e >= o.num_experts) return -1;
  const int32_t r = o.width == 1 ? o.ranks[e]
                                 : ChooseReplicaRank(o.ranks + static_cast<int64_t>(e) * o.width,
                                                     o.width, p / o.top_k);
  return r >= 0 && r < o.num_ranks ? r : -1;
}

// Integer atomics: the counts do not depend on their order.
__global__ void __launch_bounds__(kThreads)
    CountExpertsKernel(const int32_t* __restrict__ ids, OwnerTable owner, int64_t num_pairs,
                       int32_t* __restrict__ num_tokens_per_expert) {
  PdlWait();
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kThreads;
  for (int64_t p = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; p < num_pairs;
       p += stride) {
    int32_t e;
    if (PairRank(ids, owner, p, &e) >= 0) {
      atomicAdd(num_tokens_per_expert + e, 1);
    }
  }
}

__global__ void __launch_bounds__(kThreads)
    LayoutCountKernel(const int32_t* __restrict__ ids, OwnerTable owner, int32_t num_tokens,
                      int32_t top_k, int32_t num_ranks, int32_t* __restrict__ token_flags,
                      int32_t* __restrict__ pair_counts) {
  PdlWait();
  const int64_t cell = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (cell >= static_cast<int64_t>(num_ranks) * num_tokens) return;
  const int32_t r = static_cast<int32_t>(cell / num_tokens);
  const int64_t t = cell % num_tokens;
  int32_t count = 0;
  for (int32_t k = 0; k < top_k; ++k) {
    int32_t e;
    count += PairRank(ids, owner, t * top_k + k, &e) == r;
  }
  token_flags[cell] = count > 0;
  pair_counts[cell] = count;
}

__global__ void __launch_bounds__(kThreads) LayoutFillKernel(
    const int32_t* __restrict__ ids, const float* __restrict__ weights, OwnerTable owner,
    int32_t num_tokens, int32_t top_k, int32_t num_ranks, const int32_t* __restrict__ token_flags,
    const int32_t* __restrict__ pair_counts, const int32_t* __restrict__ token_starts,
    const int32_t* __restrict__ pair_starts, int32_t* __restrict__ num_tokens_per_rank,
    int32_t* __restrict__ num_pairs_per_rank, int32_t* __restrict__ token_rows,
    int32_t* __restrict__ pairs) {
  PdlWait();
  const int64_t cell = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (cell >= static_cast<int64_t>(num_ranks) * num_tokens) return;
  const int32_t r = static_cast<int32_t>(cell / num_tokens);
  const int64_t t = cell % num_tokens;
  const int64_t first = static_cast<int64_t>(r) * num_tokens, last = first + num_tokens - 1;
  const int32_t token_offset = token_starts[first], pair_offset = pair_starts[first];
  const int32_t rank_pairs = pair_starts[last] + pair_counts[last] - pair_offset;
  if (t == 0) {
    num_tokens_per_rank[r] = token_starts[last] + token_flags[last] - token_offset;
    num_pairs_per_rank[r] = rank_pairs;
  }
  if (pair_counts[cell] == 0) return;
  token_rows[token_starts[cell]] = static_cast<int32_t>(t);
  const int32_t local_row = token_starts[cell] - token_offset;
  // Rank r's block: rows | experts | weights, rank_pairs each, in (token, k) order.
  int32_t* block = pairs + 3 * static_cast<int64_t>(pair_offset);
  int64_t j = pair_starts[cell] - pair_offset;
  for (int32_t k = 0; k < top_k; ++k) {
    const int64_t p = t * top_k + k;
    int32_t e;
    if (PairRank(ids, owner, p, &e) != r) continue;
    block[j] = local_row;
    block[static_cast<int64_t>(rank_pairs) + j] = e;
    block[2 * static_cast<int64_t>(rank_pairs) + j] = __float_as_int(weights[p]);
    ++j;
  }
}

// ---- Combine ----

// The row of [begin, end) of token_rows (ascending) holding token t, or -1.
__device__ __forceinline__ int64_t FindTokenRow(const int32_t* __restrict__ token_rows,
                                                int64_t begin, int64_t end, int32_t t) {
  if (begin < 0) return -1;
  int64_t lo = begin, hi = end;
  while (lo < hi) {  // lower bound
    const int64_t mid = lo + (hi - lo) / 2;
    if (token_rows[mid] < t) {
      lo = mid + 1;
    } else {
      hi = mid;
    }
  }
  return lo < end && token_rows[lo] == t ? lo : -1;
}

// Block (t, column chunk): the block's threads find token t's row in kThreads ranks at a
// time, then each thread adds its columns of those rows in rank order. The first row is
// taken as is (as the CPU copies it), so even the sign of a zero matches.
template <typename In, typename Out>
__global__ void __launch_bounds__(kThreads)
    CombineRowsKernel(const In* __restrict__ recv, const int32_t* __restrict__ token_rows,
                      const int64_t* __restrict__ rank_offsets, int64_t num_ranks, int64_t hidden,
                      Out* __restrict__ out) {
  PdlWait();
  __shared__ int64_t found[kThreads];
  const int32_t t = static_cast<int32_t>(blockIdx.x);
  const int64_t col0 = static_cast<int64_t>(blockIdx.y) * kColsPerBlock + threadIdx.x;
  float sum[kColsPerThread] = {};
  bool have = false;  // uniform over the block
  for (int64_t base = 0; base < num_ranks; base += kThreads) {
    const int64_t r = base + threadIdx.x;
    found[threadIdx.x] =
        r < num_ranks ? FindTokenRow(token_rows, rank_offsets[r], rank_offsets[r + 1], t) : -1;
    __syncthreads();
    const int chunk = static_cast<int>(num_ranks - base < kThreads ? num_ranks - base : kThreads);
    for (int q = 0; q < chunk; ++q) {
      const int64_t i = found[q];
      if (i < 0) continue;
      const In* row = recv + i * hidden;
#pragma unroll
      for (int c = 0; c < kColsPerThread; ++c) {
        const int64_t col = col0 + c * kThreads;
        if (col >= hidden) break;
        const float x = ToFloat(row[col]);
        sum[c] = have ? __fadd_rn(sum[c], x) : x;
      }
      have = true;
    }
    __syncthreads();  // found is rewritten by the next chunk
  }
  Out* dst = out + static_cast<int64_t>(t) * hidden;
#pragma unroll
  for (int c = 0; c < kColsPerThread; ++c) {
    const int64_t col = col0 + c * kThreads;
    if (col >= hidden) break;
    dst[col] = FromFloat<Out>(have ? sum[c] : 0.f);
  }
}

template <typename In, typename Out>
cudaError_t CombineAs(const void* recv, const int32_t* token_rows, const int64_t* rank_offsets,
                      int64_t num_ranks, int64_t num_tokens, int64_t hidden, void* out,
                      cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>(num_tokens),
                  static_cast<unsigned>(CeilDiv(hidden, kColsPerBlock)));
  LaunchKernel(CombineRowsKernel<In, Out>, grid, kThreads, 0, stream, static_cast<const In*>(recv),
               token_rows, rank_offsets, num_ranks, hidden, static_cast<Out*>(out));
  return cudaGetLastError();
}

// ---- Scale-add ----

struct ScaleAddScratch {
  SortScratch sort;
  int32_t* order = nullptr;    // [n] i by destination row, ascending i within one
  int32_t* offsets = nullptr;  // [dst_rows + 1]
};

ScaleAddScratch CarveScaleAdd(Carver& c, const SortShape& s) {
  ScaleAddScratch w;
  w.sort = CarveSort(c, s);
  w.order = c.Take<int32_t>(s.n);
  w.offsets = c.Take<int32_t>(s.num_keys + 1);
  return w;
}

// Block (d, column chunk): each thread walks destination row d's contributions in
// ascending i for its columns. Multiply and add are rounded separately, as on the CPU
// (no contraction into an FMA).
template <typename T>
__global__ void __launch_bounds__(kThreads)
    ScaleAddRowsKernel(const T* __restrict__ src, const float* __restrict__ scales,
                       const int32_t* __restrict__ order, const int32_t* __restrict__ offsets,
                       int64_t cols, float* __restrict__ dst) {
  PdlWait();
  const int64_t d = blockIdx.x;
  const int32_t begin = offsets[d], end = offsets[d + 1];
  if (begin == end) return;
  const int64_t col0 = static_cast<int64_t>(blockIdx.y) * kColsPerBlock + threadIdx.x;
  float* row = dst + d * cols;
  float sum[kColsPerThread];
#pragma unroll
  for (int c = 0; c < kColsPerThread; ++c) {
    const int64_t col = col0 + c * kThreads;
    sum[c] = col < cols ? row[col] : 0.f;
  }
  for (int32_t s = begin; s < end; ++s) {
    const int32_t i = order[s];
    const float w = scales[i];
    const T* x = src + static_cast<int64_t>(i) * cols;
#pragma unroll
    for (int c = 0; c < kColsPerThread; ++c) {
      const int64_t col = col0 + c * kThreads;
      if (col < cols) sum[c] = __fadd_rn(sum[c], __fmul_rn(w, ToFloat(x[col])));
    }
  }
#pragma unroll
  for (int c = 0; c < kColsPerThread; ++c) {
    const int64_t col = col0 + c * kThreads;
    if (col < cols) row[col] = sum[c];
  }
}

}  // namespace

// ---- Workspace sizes ----

size_t DispatchLayoutWorkspaceBytes(int64_t num_tokens, int64_t top_k, int64_t num_ranks) {
  if (num_tokens <= 0 || num_tokens > INT_MAX || top_k <= 0 || top_k > INT_MAX || num_ranks <= 0 ||
      num_ranks > INT_MAX || num_ranks * num_tokens > INT_MAX) {
    return 0;
  }
  Carver c(nullptr);
  CarveLayout(c, num_ranks * num_tokens);
  return c.used();
}

size_t SortPairsWorkspaceBytes(int64_t num_pairs, int64_t num_experts) {
  const SortShape s = MakeSortShape(num_pairs, num_experts);
  if (!s.valid) return 0;
  Carver c(nullptr);
  CarveSort(c, s);
  return c.used();
}

size_t ScaleAddRowsWorkspaceBytes(int64_t num_rows, int64_t dst_rows) {
  const SortShape s = MakeSortShape(num_rows, dst_rows);
  if (!s.valid) return 0;
  Carver c(nullptr);
  CarveScaleAdd(c, s);
  return c.used();
}

// ---- Launchers ----

cudaError_t LaunchDispatchLayout(const int32_t* ids, const float* weights, const int32_t* owner,
                                 int64_t owner_width, int64_t num_tokens, int64_t top_k,
                                 int64_t num_experts, int64_t num_ranks,
                                 int32_t* num_tokens_per_rank, int32_t* num_pairs_per_rank,
                                 int32_t* num_tokens_per_expert, int32_t* token_rows,
                                 int32_t* pairs, void* workspace, size_t workspace_bytes,
                                 cudaStream_t stream) {
  if (num_tokens < 0 || num_tokens > INT_MAX || top_k < 0 || top_k > INT_MAX || num_experts < 0 ||
      num_experts > INT_MAX || num_ranks <= 0 || num_ranks > INT_MAX || owner_width < 1 ||
      owner_width > INT_MAX || num_tokens * top_k > INT_MAX || num_ranks * num_tokens > INT_MAX) {
    return cudaErrorInvalidValue;
  }
  if (num_tokens_per_rank == nullptr || num_pairs_per_rank == nullptr ||
      (num_experts > 0 && num_tokens_per_expert == nullptr)) {
    return cudaErrorInvalidValue;
  }
  const int64_t num_pairs = num_tokens * top_k;
  if (num_pairs == 0) {
    // No pairs: every count is zero, and the caller reads the counts.
    const size_t rank_bytes = static_cast<size_t>(num_ranks) * sizeof(int32_t);
    DXS_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(num_tokens_per_rank, 0, rank_bytes, stream));
    DXS_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(num_pairs_per_rank, 0, rank_bytes, stream));
    if (num_experts > 0) {
      DXS_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(
          num_tokens_per_expert, 0, static_cast<size_t>(num_experts) * sizeof(int32_t), stream));
    }
    return cudaSuccess;
  }
  // With pairs there must be an expert to route to (the CPU backend fails otherwise).
  if (num_experts == 0 || ids == nullptr || weights == nullptr || owner == nullptr ||
      token_rows == nullptr || pairs == nullptr || workspace == nullptr ||
      workspace_bytes < DispatchLayoutWorkspaceBytes(num_tokens, top_k, num_ranks)) {
    return cudaErrorInvalidValue;
  }
  const int64_t cells = num_ranks * num_tokens;
  Carver carver(workspace);
  const LayoutScratch w = CarveLayout(carver, cells);
  const int32_t tokens = static_cast<int32_t>(num_tokens), k = static_cast<int32_t>(top_k);
  const int32_t experts = static_cast<int32_t>(num_experts),
                ranks = static_cast<int32_t>(num_ranks);
  const OwnerTable table{owner, static_cast<int32_t>(owner_width), experts, ranks, k};

  DXS_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(
      num_tokens_per_expert, 0, static_cast<size_t>(num_experts) * sizeof(int32_t), stream));
  const int64_t count_blocks = CeilDiv(num_pairs, kThreads);
  LaunchKernel(CountExpertsKernel, static_cast<unsigned>(count_blocks < 1024 ? count_blocks : 1024),
               kThreads, 0, stream, ids, table, num_pairs, num_tokens_per_expert);
  DXS_CUDA_RETURN_IF_ERROR(cudaGetLastError());

  const unsigned cell_blocks = static_cast<unsigned>(CeilDiv(cells, kThreads));
  LaunchKernel(LayoutCountKernel, cell_blocks, kThreads, 0, stream, ids, table, tokens, k, ranks,
               w.token_flags, w.pair_counts);
  DXS_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  DXS_CUDA_RETURN_IF_ERROR(ExclusiveScan(w.token_flags, cells, w.token_starts, w.partials, stream));
  DXS_CUDA_RETURN_IF_ERROR(ExclusiveScan(w.pair_counts, cells, w.pair_starts, w.partials, stream));
  LaunchKernel(LayoutFillKernel, cell_blocks, kThreads, 0, stream, ids, weights, table, tokens, k,
               ranks, w.token_flags, w.pair_counts, w.token_starts, w.pair_starts,
               num_tokens_per_rank, num_pairs_per_rank, token_rows, pairs);
  return cudaGetLastError();
}

cudaError_t LaunchSortPairsByExpert(const int32_t* experts, int64_t n, int64_t num_experts,
                                    int32_t* order, int32_t* expert_offsets, void* workspace,
                                    size_t workspace_bytes, cudaStream_t stream,
                                    const SortPayloads& payloads) {
  if (n < 0 || n > INT_MAX || num_experts <= 0 || num_experts >= INT_MAX || payloads.count < 0 ||
      payloads.count > kMaxSortPayloads) {
    return cudaErrorInvalidValue;
  }
  if (n == 0) return cudaSuccess;
  const SortShape s = MakeSortShape(n, num_experts);
  if (!s.valid || experts == nullptr || order == nullptr || expert_offsets == nullptr ||
      workspace == nullptr || workspace_bytes < SortPairsWorkspaceBytes(n, num_experts)) {
    return cudaErrorInvalidValue;
  }
  Carver carver(workspace);
  const SortScratch w = CarveSort(carver, s);
  // perm_tmp and `order` alternate between passes; the last one writes `order`.
  for (int j = 0; j < payloads.count; ++j) {
    if (payloads.in[j] == nullptr || payloads.out[j] == nullptr) return cudaErrorInvalidValue;
  }
  return SortByKey(experts, s, w, order, expert_offsets, payloads, stream);
}

cudaError_t LaunchCombineRows(const void* recv, ElemType recv_type, const int32_t* token_rows,
                              const int64_t* rank_offsets, int64_t num_ranks, int64_t num_tokens,
                              int64_t hidden, void* out, ElemType out_type, cudaStream_t stream) {
  if (!IsFloating(recv_type) || !IsFloating(out_type) || num_ranks < 0 || num_tokens < 0 ||
      num_tokens > INT_MAX || hidden < 0 || CeilDiv(hidden, kColsPerBlock) > kMaxGridY) {
    return cudaErrorInvalidValue;
  }
  if (num_tokens == 0 || hidden == 0) return cudaSuccess;
  // recv and token_rows may be null (empty) when every rank's range is: only the device
  // knows the ranges.
  if (out == nullptr || (num_ranks > 0 && rank_offsets == nullptr)) return cudaErrorInvalidValue;
  return DispatchFloat(recv_type, [&](auto in) {
    return DispatchFloat(out_type, [&](auto o) {
      return CombineAs<typename decltype(in)::type, typename decltype(o)::type>(
          recv, token_rows, rank_offsets, num_ranks, num_tokens, hidden, out, stream);
    });
  });
}

cudaError_t LaunchScaleAddRows(const void* src, ElemType src_type, const float* scales,
                               const int32_t* rows, int64_t n, int64_t cols, float* dst,
                               int64_t dst_rows, void* workspace, size_t workspace_bytes,
                               cudaStream_t stream) {
  if (n < 0 || n > INT_MAX || cols < 0 || dst_rows < 0 || dst_rows >= INT_MAX ||
      CeilDiv(cols, kColsPerBlock) > kMaxGridY ||
      (src_type != ElemType::kF32 && src_type != ElemType::kBF16)) {
    return cudaErrorInvalidValue;
  }
  if (n == 0 || cols == 0) return cudaSuccess;
  // Rows but no destination rows: every row is out of range (the CPU backend fails).
  const SortShape s = MakeSortShape(n, dst_rows);
  if (dst_rows == 0 || !s.valid || src == nullptr || scales == nullptr || rows == nullptr ||
      dst == nullptr || workspace == nullptr ||
      workspace_bytes < ScaleAddRowsWorkspaceBytes(n, dst_rows)) {
    return cudaErrorInvalidValue;
  }
  Carver carver(workspace);
  const ScaleAddScratch w = CarveScaleAdd(carver, s);
  DXS_CUDA_RETURN_IF_ERROR(SortByKey(rows, s, w.sort, w.order, w.offsets, {}, stream));
  const dim3 grid(static_cast<unsigned>(dst_rows),
                  static_cast<unsigned>(CeilDiv(cols, kColsPerBlock)));
  if (src_type == ElemType::kBF16) {
    LaunchKernel(ScaleAddRowsKernel<__nv_bfloat16>, grid, kThreads, 0, stream,
                 static_cast<const __nv_bfloat16*>(src), scales, w.order, w.offsets, cols, dst);
  } else {
    LaunchKernel(ScaleAddRowsKernel<float>, grid, kThreads, 0, stream,
                 static_cast<const float*>(src), scales, w.order, w.offsets, cols, dst);
  }
  return cudaGetLastError();
}

namespace {

// The segments as a kernel argument (2 KiB: within the 4 KiB every launch may pass).
struct UnpackSegments {
  int32_t v[4 * kMaxUnpackSegments];  // first_pair, num_pairs, row_offset, num_rows
  int n;
};

__global__ void UnpackInitKernel(int32_t* bad) {
  PdlWait();
  bad[0] = 0;
  bad[1] = INT_MAX;
}

// One thread per pair; its segment by a scan over the (few) segments.
__global__ void UnpackRoutedPairsKernel(const int32_t* __restrict__ blocks, UnpackSegments segs,
                                        const int32_t* __restrict__ held, int64_t num_experts,
                                        int64_t num_pairs, int32_t* __restrict__ rows,
                                        int32_t* __restrict__ experts, float* __restrict__ weights,
                                        int32_t* bad) {
  PdlWait();
  for (int64_t p = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; p < num_pairs;
       p += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    int s = 0;
    while (s + 1 < segs.n && p >= segs.v[4 * s] + segs.v[4 * s + 1]) ++s;
    const int64_t first = segs.v[4 * s], count = segs.v[4 * s + 1];
    const int64_t k = p - first;
    const int32_t* seg = blocks + 3 * first;
    const int32_t row = seg[k], expert = seg[count + k];
    const bool ok = row >= 0 && row < segs.v[4 * s + 3] && expert >= 0 && expert < num_experts &&
                    held[expert] != 0;
    // A bad pair becomes one that is safe to compute and adds nothing: the segment's first
    // row, the lowest held expert, weight 0.
    int32_t fallback = 0;
    if (!ok) {
      while (fallback + 1 < num_experts && held[fallback] == 0) ++fallback;
      atomicAdd(&bad[0], 1);
      atomicMin(&bad[1], static_cast<int32_t>(p));
    }
    rows[p] = (ok ? row : 0) + segs.v[4 * s + 2];
    experts[p] = ok ? expert : fallback;
    weights[p] = ok ? __int_as_float(seg[2 * count + k]) : 0.f;
  }
}

}  // namespace

cudaError_t LaunchUnpackRoutedPairs(const int32_t* blocks, const int32_t* segments,
                                    int num_segments, const int32_t* held, int64_t num_experts,
                                    int64_t num_pairs, int32_t* rows, int32_t* experts,
                                    float* weights, int32_t* bad, cudaStream_t stream) {
  if (num_segments < 1 || num_segments > kMaxUnpackSegments || num_pairs < 0 ||
      num_pairs > INT_MAX || num_experts < 0) {
    return cudaErrorInvalidValue;
  }
  if (num_pairs == 0) return cudaSuccess;
  UnpackSegments segs{};
  for (int i = 0; i < 4 * num_segments; ++i) segs.v[i] = segments[i];
  segs.n = num_segments;
  LaunchKernel(UnpackInitKernel, 1, 1, 0, stream, bad);
  DXS_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  const int64_t blocks_needed = (num_pairs + 255) / 256;
  LaunchKernel(UnpackRoutedPairsKernel,
               static_cast<unsigned>(blocks_needed < 1024 ? blocks_needed : 1024), 256, 0, stream,
               blocks, segs, held, num_experts, num_pairs, rows, experts, weights, bad);
  return cudaGetLastError();
}

}  // namespace dxs::cuda
