// Sampling on the GPU, so that only the chosen ids come back: greedy (argmax) per row, and
// Backend::SampleRows (temperature, top-k, top-p and a counter-based draw; the host's
// SampleToken in kernels/sampling.h is the reference).
//
// SampleRows, in chunks of rows whose candidates fit the workspace:
// 1. PrepareKernel: per sampled row, the key of candidate j is logits[j] / temperature
//    (float, rounded as the host divides), and ids[j] = j. A greedy row with adjustments is
//    sorted with temperature 1 and takes its first candidate; greedy rows without
//    adjustments and rows with bad parameters are sorted too (every row of the chunk is),
//    and their order is not read.
//    AdjustKernel then rewrites the keys of the row's LogitAdjustments (penalties, bias, the
//    min_new_tokens mask) from the raw logits, as the host's ApplyLogitAdjustments does; the
//    logits themselves are not changed (their log-probabilities are the raw ones).
// 2. One CUB radix sort of the whole chunk (SortKey: the row in the high 32 bits, the key's
//    bits turned so that ascending is descending in the low 32), which keeps every row's
//    candidates in the row's own span. It is stable, so equal keys keep ascending ids: the
//    host's order (larger key, then lower id). -0 and +0 compare equal, as on the host.
//    (A segmented sort has one thread block sort a whole row: measured on the H200 it took
//    most of a sampled decode step at batch 32; the one sort spreads over every SM.)
// 3. SampleKernel, one block per row: the weights exp(key - max) in double over the top_k
//    first candidates, their sum (block reduction), the top-p cut and the draw (block
//    scans over tiles, stopping at the first prefix that qualifies), then the min-p cut (a
//    binary search: the weights fall along the sorted candidates). Greedy rows without
//    adjustments take the argmax of the raw logits instead. The sums go in another order than the
//    host's, so a token differs from the CPU's only when a draw or a cut lands within rounding of a
//    cumulative-mass boundary.
// Nothing synchronises with the host, and the work depends only on the shapes: it can be
// recorded in a CUDA graph.
#include <cuda_runtime.h>

#include <climits>
#include <cstddef>
#include <cstdint>
#include <cub/block/block_reduce.cuh>
#include <cub/block/block_scan.cuh>
#include <cub/device/device_radix_sort.cuh>

#include "common/splitmix64.h"
#include "kernels/cuda/carver.cuh"
#include "kernels/cuda/launch.cuh"
#include "kernels/cuda/ops.cuh"
#include "kernels/cuda/return_if_error.cuh"

namespace dxs::cuda {
namespace {

constexpr int kThreads = 512;  // argmax and sampling blocks
constexpr int kItems = 8;      // per thread in a sampling scan tile
constexpr int64_t kTile = int64_t{kThreads} * kItems;
constexpr int kPrepareThreads = 256;
constexpr int kPrepareItems = 4;
constexpr int64_t kPrepareCols = int64_t{kPrepareThreads} * kPrepareItems;
// Candidates sorted at once: the workspace holds two 64-bit key and two id buffers of this
// many (96 MiB), so 256 rows of a 152k vocabulary go in a few chunks.
constexpr int64_t kMaxChunkItems = int64_t{1} << 22;
constexpr int64_t kMaxGridY = 65535;

int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Whether (v, i) beats (best, best_i): larger, or equal and earlier. NaN never beats and
// is never beaten here; the caller handles a NaN at index 0.
__device__ bool Better(float v, int64_t i, float best, int64_t best_i) {
  return v > best || (v == best && i < best_i);
}

// The host's Argmax of one row by a block of kThreads; the result is valid in thread 0.
__device__ int32_t BlockArgmax(const float* __restrict__ row, int64_t vocab) {
  // The host scan keeps index 0 when row[0] is NaN (nothing compares greater).
  if (isnan(row[0])) return 0;
  float best = -INFINITY;
  int64_t best_i = vocab;  // none yet
  for (int64_t j = threadIdx.x; j < vocab; j += blockDim.x) {
    const float v = row[j];
    if (!isnan(v) && (best_i == vocab || Better(v, j, best, best_i))) {
      best = v;
      best_i = j;
    }
  }
  // Warp then block reduction in a fixed shape: the result does not depend on timing.
  for (int offset = 16; offset > 0; offset >>= 1) {
    const float v = __shfl_down_sync(0xffffffffu, best, offset);
    const int64_t i = __shfl_down_sync(0xffffffffu, best_i, offset);
    if (i != vocab && (best_i == vocab || Better(v, i, best, best_i))) {
      best = v;
      best_i = i;
    }
  }
  __shared__ float warp_best[kThreads / 32];
  __shared__ int64_t warp_index[kThreads / 32];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  if (lane == 0) {
    warp_best[warp] = best;
    warp_index[warp] = best_i;
  }
  __syncthreads();
  int32_t result = 0;
  if (threadIdx.x == 0) {
    float b = warp_best[0];
    int64_t bi = warp_index[0];
    for (int w = 1; w < kThreads / 32; ++w) {
      if (warp_index[w] != vocab && (bi == vocab || Better(warp_best[w], warp_index[w], b, bi))) {
        b = warp_best[w];
        bi = warp_index[w];
      }
    }
    // A row of NaNs after a number at 0 keeps 0, as the host scan does.
    result = static_cast<int32_t>(bi == vocab ? 0 : bi);
  }
  return result;
}

__global__ void __launch_bounds__(kThreads)
    ArgmaxRowsKernel(const float* __restrict__ logits, int64_t vocab, int32_t* __restrict__ ids) {
  PdlWait();
  const int32_t best = BlockArgmax(logits + blockIdx.x * vocab, vocab);
  if (threadIdx.x == 0) ids[blockIdx.x] = best;
}

// ---- SampleRows ----

// The sort key of candidate key `f` in row `r` of the chunk: the row in the high 32 bits, so
// that one ascending radix sort of the chunk keeps each row's candidates in its own span, and
// in the low 32 bits the float's bits turned so that ascending is the descending float
// order, -0 taken as +0 (as CUB's own float sort does).
__device__ uint64_t SortKey(int64_t r, float f) {
  uint32_t b = __float_as_uint(f == 0.f ? 0.f : f);
  b = (b & 0x80000000u) ? ~b : (b | 0x80000000u);  // ascending unsigned = ascending float
  return (static_cast<uint64_t>(r) << 32) | static_cast<uint32_t>(~b);
}
// The float key back from a sort key.
__device__ float KeyOf(uint64_t key) {
  const uint32_t b = ~static_cast<uint32_t>(key);
  return __uint_as_float((b & 0x80000000u) ? (b & 0x7fffffffu) : ~b);
}

// ValidateSamplingParams (kernels/sampling.cc), on the device.
__device__ bool ValidRow(const SamplingRow& p, int64_t num_adjust) {
  return p.temperature >= 0.f && !isinf(p.temperature) && p.top_p > 0.f && p.top_p <= 1.f &&
         p.top_k >= 0 && p.min_p >= 0.f && p.min_p <= 1.f && p.repetition_penalty > 0.f &&
         !isinf(p.repetition_penalty) && p.frequency_penalty >= -2.f &&
         p.frequency_penalty <= 2.f && p.presence_penalty >= -2.f && p.presence_penalty <= 2.f &&
         p.adjust_begin >= 0 && p.adjust_count >= 0 &&
         int64_t{p.adjust_begin} + p.adjust_count <= num_adjust && p.reserved[0] == 0 &&
         p.reserved[1] == 0 && p.reserved[2] == 0;
}

// Whether the row's candidates are sorted: sampled with a temperature, or greedy over
// adjusted logits, from more than one.
__device__ bool SortsRow(const SamplingRow& p, int64_t vocab, int64_t num_adjust) {
  return ValidRow(p, num_adjust) && (p.temperature != 0.f || p.adjust_count > 0) && vocab > 1;
}

// The divisor of a sorted row's keys: a greedy row sorts its adjusted logits as they are.
__device__ float KeyDivisor(const SamplingRow& p) {
  return p.temperature != 0.f ? p.temperature : 1.f;
}

// grid (column blocks, rows of the chunk): the sort keys and ids of every row (a row that
// is not sorted gets keys of its row only, so that the sort keeps it in its span).
__global__ void __launch_bounds__(kPrepareThreads)
    PrepareKernel(const float* __restrict__ logits, const SamplingRow* __restrict__ params,
                  int64_t num_adjust, int64_t vocab, uint64_t* __restrict__ keys,
                  int32_t* __restrict__ ids) {
  PdlWait();
  const int64_t r = blockIdx.y;
  const SamplingRow p = params[r];
  const bool sorted = SortsRow(p, vocab, num_adjust);
  const float divisor = KeyDivisor(p);
  const float* row = logits + r * vocab;
  const int64_t col0 = static_cast<int64_t>(blockIdx.x) * kPrepareCols + threadIdx.x;
#pragma unroll
  for (int c = 0; c < kPrepareItems; ++c) {
    const int64_t j = col0 + c * kPrepareThreads;
    if (j < vocab) {
      keys[r * vocab + j] =
          sorted ? SortKey(r, __fdiv_rn(row[j], divisor)) : static_cast<uint64_t>(r) << 32;
      ids[r * vocab + j] = static_cast<int32_t>(j);
    }
  }
}

// One block per row of the chunk: the keys of the row's adjusted tokens, from the raw
// logits (the host's ApplyLogitAdjustments, each operation rounded as there).
__global__ void __launch_bounds__(kPrepareThreads)
    AdjustKernel(const float* __restrict__ logits, const SamplingRow* __restrict__ params,
                 const LogitAdjustment* __restrict__ adjustments, int64_t num_adjust, int64_t vocab,
                 uint64_t* __restrict__ keys) {
  PdlWait();
  const int64_t r = blockIdx.x;
  const SamplingRow p = params[r];
  if (!SortsRow(p, vocab, num_adjust)) return;
  const float divisor = KeyDivisor(p);
  for (int32_t i = threadIdx.x; i < p.adjust_count; i += blockDim.x) {
    const LogitAdjustment a = adjustments[p.adjust_begin + i];
    if (a.token < 0 || a.token >= vocab) continue;  // the host rejects it
    float l = logits[r * vocab + a.token];
    if (a.flags & kAdjustBanned) {
      l = -INFINITY;
    } else {
      l = __fadd_rn(l, a.bias);
      if ((a.flags & kAdjustSeen) && p.repetition_penalty != 1.f) {
        l = l > 0.f ? __fdiv_rn(l, p.repetition_penalty) : __fmul_rn(l, p.repetition_penalty);
      }
      l = __fsub_rn(l, __fmul_rn(p.frequency_penalty, static_cast<float>(a.output_count)));
      if (a.output_count > 0) l = __fsub_rn(l, p.presence_penalty);
    }
    keys[r * vocab + a.token] = SortKey(r, __fdiv_rn(l, divisor));
  }
}

// A candidate's weight, as the host computes it: the float difference, exp in double.
__device__ double Weight(float key, float max_key) {
  return exp(static_cast<double>(__fsub_rn(key, max_key)));
}

using BlockScanF64 = cub::BlockScan<double, kThreads>;
using BlockReduceF64 = cub::BlockReduce<double, kThreads>;
using BlockReduceI64 = cub::BlockReduce<int64_t, kThreads>;

struct MinOp {
  __device__ int64_t operator()(int64_t a, int64_t b) const { return a < b ? a : b; }
};

struct SampleShared {
  union {
    BlockScanF64::TempStorage scan;
    BlockReduceF64::TempStorage sum;
    BlockReduceI64::TempStorage min;
  } cub;
  double total;
  int64_t found;
  double found_prefix;
};

// The first candidate i < count whose inclusive prefix of weights w (in candidate order)
// satisfies `qualifies` (which must hold for every later prefix once it holds), and that
// prefix; {count, the sum of all} when none does. Block-uniform result.
struct Found {
  int64_t index;
  double prefix;
};

template <typename Qualifies>
__device__ Found FindFirstPrefix(const uint64_t* __restrict__ keys, float max_key, int64_t count,
                                 Qualifies qualifies, SampleShared& s) {
  double carry = 0;
  for (int64_t base = 0; base < count; base += kTile) {
    const int64_t first_item = base + static_cast<int64_t>(threadIdx.x) * kItems;
    double v[kItems];
#pragma unroll
    for (int j = 0; j < kItems; ++j) {
      const int64_t i = first_item + j;
      v[j] = i < count ? Weight(KeyOf(keys[i]), max_key) : 0.0;
    }
    double tile_sum;
    BlockScanF64(s.cub.scan).InclusiveSum(v, v, tile_sum);
    int64_t mine = INT64_MAX;
    int mine_j = 0;
#pragma unroll
    for (int j = 0; j < kItems; ++j) {
      const int64_t i = first_item + j;
      if (mine == INT64_MAX && i < count && qualifies(carry + v[j])) {
        mine = i;
        mine_j = j;
      }
    }
    __syncthreads();  // the scan's storage is reused by the reduction
    const int64_t first = BlockReduceI64(s.cub.min).Reduce(mine, MinOp());
    if (threadIdx.x == 0) s.found = first;
    __syncthreads();
    const int64_t found = s.found;
    if (found != INT64_MAX) {
      if (mine == found) {
        double prefix = 0;
#pragma unroll
        for (int j = 0; j < kItems; ++j) {
          if (j == mine_j) prefix = carry + v[j];
        }
        s.found_prefix = prefix;
      }
      __syncthreads();
      return {found, s.found_prefix};
    }
    carry += tile_sum;
  }
  return {count, carry};
}

// One block per row of the chunk; keys/ids are the chunk's sorted candidates.
__global__ void __launch_bounds__(kThreads)
    SampleKernel(const float* __restrict__ logits, const SamplingRow* __restrict__ params,
                 int64_t num_adjust, int64_t vocab, const uint64_t* __restrict__ sorted_keys,
                 const int32_t* __restrict__ sorted_ids, int32_t* __restrict__ out) {
  PdlWait();
  __shared__ SampleShared s;
  const int64_t r = blockIdx.x;
  const SamplingRow p = params[r];
  if (!ValidRow(p, num_adjust)) {
    if (threadIdx.x == 0) out[r] = -1;
    return;
  }
  if (!SortsRow(p, vocab, num_adjust)) {  // greedy without adjustments, or a single candidate
    const int32_t best = BlockArgmax(logits + r * vocab, vocab);
    if (threadIdx.x == 0) out[r] = best;
    return;
  }
  const uint64_t* keys = sorted_keys + r * vocab;
  const int32_t* ids = sorted_ids + r * vocab;
  if (p.temperature == 0.f) {  // greedy over adjusted logits: the stable sort's first
    if (threadIdx.x == 0) out[r] = ids[0];
    return;
  }
  const float max_key = KeyOf(keys[0]);
  const int64_t keep = p.top_k > 0 && p.top_k < vocab ? p.top_k : vocab;

  double local = 0;
  for (int64_t i = threadIdx.x; i < keep; i += kThreads) local += Weight(KeyOf(keys[i]), max_key);
  const double sum = BlockReduceF64(s.cub.sum).Sum(local);
  if (threadIdx.x == 0) s.total = sum;
  __syncthreads();
  const double total = s.total;

  // Top-p: the smallest prefix whose mass reaches top_p (at least one candidate).
  int64_t cut = keep;
  double kept = total;
  if (p.top_p < 1.f) {
    const double top_p = p.top_p;
    const Found f = FindFirstPrefix(
        keys, max_key, keep, [total, top_p](double prefix) { return prefix / total >= top_p; }, s);
    if (f.index < keep) {
      cut = f.index + 1;
      kept = f.prefix;
    }
  }
  // Min-p: the candidates whose weight (their probability over the first's) reaches min_p,
  // a prefix as the weights fall along the sorted keys; at least one.
  if (p.min_p > 0.f) {
    __syncthreads();  // every thread has read the top-p search's shared result
    if (threadIdx.x == 0) {
      const double min_p = p.min_p;
      int64_t lo = 1, hi = cut;  // the first index in [lo, hi) whose weight is below min_p
      while (lo < hi) {
        const int64_t mid = lo + (hi - lo) / 2;
        if (Weight(KeyOf(keys[mid]), max_key) >= min_p) {
          lo = mid + 1;
        } else {
          hi = mid;
        }
      }
      s.found = lo;
    }
    __syncthreads();
    const int64_t min_p_cut = s.found;
    __syncthreads();
    if (min_p_cut < cut) {
      cut = min_p_cut;
      double part = 0;
      for (int64_t i = threadIdx.x; i < cut; i += kThreads) {
        part += Weight(KeyOf(keys[i]), max_key);
      }
      __syncthreads();  // the reduction's storage was the search's
      const double sum_kept = BlockReduceF64(s.cub.sum).Sum(part);
      if (threadIdx.x == 0) s.total = sum_kept;
      __syncthreads();
      kept = s.total;
    }
  }
  // The draw: the first candidate whose cumulative weight exceeds u * kept.
  const double target = SplitMix64Unit(SplitMix64At(p.seed, p.draw)) * kept;
  const Found d = FindFirstPrefix(
      keys, max_key, cut, [target](double prefix) { return target < prefix; }, s);
  if (threadIdx.x == 0) out[r] = ids[d.index < cut ? d.index : cut - 1];
}

// The chunk's shape: rows of `vocab` candidates sorted at once.
int64_t ChunkRows(int64_t n, int64_t vocab) {
  int64_t rows = kMaxChunkItems / vocab;   // >= 1: vocab <= kMaxChunkItems
  if (rows > kMaxGridY) rows = kMaxGridY;  // PrepareKernel's grid.y
  return rows < n ? rows : n;
}

// The bits of the sort keys of `rows` rows: 32 for the key, and the row numbers 0..rows-1.
int SortKeyBits(int64_t rows) {
  int bits = 32;
  while ((int64_t{1} << (bits - 32)) < rows) ++bits;
  return bits;
}

// CUB's temporary storage for a sort of `rows` rows of `vocab`.
cudaError_t SortTempBytes(int64_t rows, int64_t vocab, size_t* bytes) {
  cub::DoubleBuffer<uint64_t> keys(nullptr, nullptr);
  cub::DoubleBuffer<int32_t> ids(nullptr, nullptr);
  *bytes = 0;
  return cub::DeviceRadixSort::SortPairs(nullptr, *bytes, keys, ids, static_cast<int>(rows * vocab),
                                         0, SortKeyBits(rows));
}

struct SampleScratch {
  uint64_t* keys[2];
  int32_t* ids[2];
  void* sort_temp;
  size_t sort_temp_bytes;
};

cudaError_t CarveSample(Carver& c, int64_t n, int64_t vocab, SampleScratch* s) {
  const int64_t chunk = ChunkRows(n, vocab);
  size_t full = 0, last = 0;
  DXS_CUDA_RETURN_IF_ERROR(SortTempBytes(chunk, vocab, &full));
  if (n % chunk != 0) DXS_CUDA_RETURN_IF_ERROR(SortTempBytes(n % chunk, vocab, &last));
  for (int b = 0; b < 2; ++b) s->keys[b] = c.Take<uint64_t>(chunk * vocab);
  for (int b = 0; b < 2; ++b) s->ids[b] = c.Take<int32_t>(chunk * vocab);
  s->sort_temp_bytes = full > last ? full : last;
  s->sort_temp = c.Take<char>(static_cast<int64_t>(s->sort_temp_bytes));
  return cudaSuccess;
}

bool SampleShapeOk(int64_t n, int64_t vocab) {
  return n >= 0 && vocab > 0 && vocab <= kMaxChunkItems && n <= INT_MAX;
}

// CountPendingToken (kernels/sampling.cc) for row blockIdx.x, one warp: the lanes look for
// the token among the row's other entries (distinct tokens: one lane at most finds it).
__global__ void CountPendingTokensKernel(const int32_t* tokens, const SamplingRow* rows,
                                         LogitAdjustment* adjustments, int64_t num_adjust) {
  PdlWait();
  const SamplingRow& row = rows[blockIdx.x];
  const int64_t begin = row.adjust_begin, count = row.adjust_count;
  if (count <= 0 || begin < 0 || begin + count > num_adjust) return;
  LogitAdjustment* a = adjustments + begin;
  if ((a[count - 1].flags & kAdjustPending) == 0) return;
  const int32_t token = tokens[blockIdx.x];
  int64_t at = -1;
  for (int64_t j = threadIdx.x; j < count - 1; j += 32) {
    if (a[j].token == token) at = j;
  }
  if (__ballot_sync(0xffffffffu, at >= 0) != 0) {
    if (at >= 0) {
      ++a[at].output_count;
      a[at].flags |= kAdjustSeen;
    }
  } else if (threadIdx.x == 0) {
    a[count - 1] = LogitAdjustment{token, 1, 0.f, kAdjustSeen};
  }
}

}  // namespace

cudaError_t LaunchArgmaxRows(const float* logits, int64_t n, int64_t vocab, int32_t* ids,
                             cudaStream_t stream) {
  if (n < 0 || vocab <= 0 || n > 2147483647 || vocab > 2147483647) return cudaErrorInvalidValue;
  if (n == 0) return cudaSuccess;
  if (logits == nullptr || ids == nullptr) return cudaErrorInvalidValue;
  LaunchKernel(ArgmaxRowsKernel, static_cast<unsigned>(n), kThreads, 0, stream, logits, vocab, ids);
  return cudaGetLastError();
}

cudaError_t LaunchCountPendingTokens(const int32_t* tokens, int64_t n, const SamplingRow* params,
                                     LogitAdjustment* adjustments, int64_t num_adjust,
                                     cudaStream_t stream) {
  if (n < 0 || n > 2147483647 || num_adjust < 0) return cudaErrorInvalidValue;
  if (n == 0 || num_adjust == 0) return cudaSuccess;
  if (tokens == nullptr || params == nullptr || adjustments == nullptr) {
    return cudaErrorInvalidValue;
  }
  LaunchKernel(CountPendingTokensKernel, static_cast<unsigned>(n), 32u, 0, stream, tokens, params,
               adjustments, num_adjust);
  return cudaGetLastError();
}

cudaError_t SampleRowsWorkspaceBytes(int64_t n, int64_t vocab, size_t* bytes) {
  *bytes = 0;
  if (!SampleShapeOk(n, vocab)) return cudaErrorInvalidValue;
  if (n == 0) return cudaSuccess;
  Carver c(nullptr);
  SampleScratch s;
  DXS_CUDA_RETURN_IF_ERROR(CarveSample(c, n, vocab, &s));
  *bytes = c.used();
  return cudaSuccess;
}

cudaError_t LaunchSampleRows(const float* logits, int64_t n, int64_t vocab,
                             const SamplingRow* params, const LogitAdjustment* adjustments,
                             int64_t num_adjust, int32_t* ids, void* workspace,
                             size_t workspace_bytes, cudaStream_t stream) {
  if (!SampleShapeOk(n, vocab) || num_adjust < 0 || (num_adjust > 0 && adjustments == nullptr)) {
    return cudaErrorInvalidValue;
  }
  if (n == 0) return cudaSuccess;
  size_t need = 0;
  DXS_CUDA_RETURN_IF_ERROR(SampleRowsWorkspaceBytes(n, vocab, &need));
  if (logits == nullptr || params == nullptr || ids == nullptr || workspace == nullptr ||
      workspace_bytes < need) {
    return cudaErrorInvalidValue;
  }
  Carver carver(workspace);
  SampleScratch s;
  DXS_CUDA_RETURN_IF_ERROR(CarveSample(carver, n, vocab, &s));
  const int64_t chunk = ChunkRows(n, vocab);
  for (int64_t row0 = 0; row0 < n; row0 += chunk) {
    const int64_t rows = n - row0 < chunk ? n - row0 : chunk;
    const float* chunk_logits = logits + row0 * vocab;
    const SamplingRow* chunk_params = params + row0;
    const dim3 grid(static_cast<unsigned>(CeilDiv(vocab, kPrepareCols)),
                    static_cast<unsigned>(rows));
    LaunchKernel(PrepareKernel, grid, kPrepareThreads, 0, stream, chunk_logits, chunk_params,
                 num_adjust, vocab, s.keys[0], s.ids[0]);
    DXS_CUDA_RETURN_IF_ERROR(cudaGetLastError());
    if (num_adjust > 0) {
      LaunchKernel(AdjustKernel, static_cast<unsigned>(rows), kPrepareThreads, 0, stream,
                   chunk_logits, chunk_params, adjustments, num_adjust, vocab, s.keys[0]);
      DXS_CUDA_RETURN_IF_ERROR(cudaGetLastError());
    }
    cub::DoubleBuffer<uint64_t> keys(s.keys[0], s.keys[1]);
    cub::DoubleBuffer<int32_t> cand(s.ids[0], s.ids[1]);
    size_t temp_bytes = s.sort_temp_bytes;
    DXS_CUDA_RETURN_IF_ERROR(cub::DeviceRadixSort::SortPairs(s.sort_temp, temp_bytes, keys, cand,
                                                             static_cast<int>(rows * vocab), 0,
                                                             SortKeyBits(rows), stream));
    LaunchKernel(SampleKernel, static_cast<unsigned>(rows), kThreads, 0, stream, chunk_logits,
                 chunk_params, num_adjust, vocab, keys.Current(), cand.Current(), ids + row0);
    DXS_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  }
  return cudaSuccess;
}

}  // namespace dxs::cuda
