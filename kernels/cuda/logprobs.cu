// Backend::LogprobRows on the GPU: log-probabilities of raw logits rows, so that only the
// few numbers a request asked for come back (kernels/sampling.h's RowLogprobs is the
// reference). Two kernels, so that a batch of rows spreads over every SM and each element is
// read from memory once:
// 1. LogprobSliceKernel: one warp per slice of 512 consecutive ids of a row, its values held
//    in registers (16 a lane, loaded at once): the slice's max, its sum of exp(l - max)
//    (exp in float, as the host's, summed in double), and its k first candidates in
//    (larger logit, lower id) order, by k warp-wide argmax passes over the registers.
// 2. LogprobMergeKernel: one block per row: lse = M + log(sum_s sum_s * exp(max_s - M))
//    over the slices, the sampled and named ids' l - lse, and the row's k first candidates
//    from the slices' (each warp merges a share of them, one warp the warps' picks).
// The k first of a row are among the union of its slices' k first, in the same total order,
// so the ids equal one pass over the whole row's.
// (One block per row making k passes over the whole row kept a few loads in flight per
// warp: measured on the H200, it was most of the cost of top-20 log-probabilities at batch
// 128, where the rows do not fit in L2.)
// Nothing synchronises with the host, and the work depends only on the shapes: it can be
// recorded in a CUDA graph.
#include <cuda_runtime.h>

#include <climits>
#include <cstddef>
#include <cstdint>

#include "kernels/cuda/launch.cuh"
#include "kernels/cuda/ops.cuh"

namespace dxs::cuda {
namespace {

constexpr int64_t kMaxK = 20;
constexpr int kPerLane = 16;
constexpr int64_t kSlice = 32 * kPerLane;  // ids per slice (one warp)
constexpr int kSliceWarps = 8;             // slices per block of the slice kernel
constexpr int kMergeWarps = 8;
constexpr int64_t kMaxGridY = 65535;
constexpr unsigned kFullMask = 0xffffffffu;

// A candidate in (larger logit, lower id) order; id -1 is "none", after every real one.
struct Candidate {
  float logit;
  int32_t id;
};

__device__ __forceinline__ bool Before(const Candidate& a, const Candidate& b) {
  if (a.id < 0) return false;
  if (b.id < 0) return true;
  return a.logit > b.logit || (a.logit == b.logit && a.id < b.id);
}

// The first of the warp's candidates, on every lane (the order is total over real
// candidates, so the butterfly agrees everywhere).
__device__ __forceinline__ Candidate WarpFirst(Candidate c) {
  for (int offset = 16; offset > 0; offset >>= 1) {
    const Candidate o{__shfl_xor_sync(kFullMask, c.logit, offset),
                      __shfl_xor_sync(kFullMask, c.id, offset)};
    if (Before(o, c)) c = o;
  }
  return c;
}

__device__ __forceinline__ float WarpMax(float v) {
  for (int offset = 16; offset > 0; offset >>= 1) {
    v = fmaxf(v, __shfl_xor_sync(kFullMask, v, offset));
  }
  return v;
}

__device__ __forceinline__ double WarpSum(double v) {
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(kFullMask, v, offset);
  return v;
}

// The warp's k first candidates, out[0..k) (none: id -1), written by lane 0.
// visit(f) calls f(candidate) for each of this lane's candidates; NaN logits and ids < 0
// are skipped. Each pass takes the first candidate after the previous pick, so no set of
// picks is kept.
template <typename Visit>
__device__ __forceinline__ void WarpFirstK(int64_t k, Visit visit, Candidate* out) {
  const int lane = threadIdx.x % 32;
  Candidate last{INFINITY, -1};  // none picked yet: every candidate comes after it
  for (int64_t t = 0; t < k; ++t) {
    Candidate best{-INFINITY, -1};
    visit([&](const Candidate& c) {
      if (c.id >= 0 && !isnan(c.logit) && (last.id < 0 || Before(last, c)) && Before(c, best)) {
        best = c;
      }
    });
    const Candidate pick = WarpFirst(best);
    if (pick.id < 0) {  // fewer candidates than k: the rest stay "none"
      for (int64_t u = t + lane; u < k; u += 32) out[u] = Candidate{-INFINITY, -1};
      return;
    }
    if (lane == 0) out[t] = pick;
    last = pick;
  }
}

// Grid (ceil(slices / kSliceWarps), rows); slice_* are [rows, slices], candidates [rows,
// slices, k].
__global__ void __launch_bounds__(kSliceWarps * 32)
    LogprobSliceKernel(const float* __restrict__ logits, int64_t vocab, int64_t slices, int64_t k,
                       float* __restrict__ slice_max, double* __restrict__ slice_sum,
                       Candidate* __restrict__ candidates) {
  PdlWait();
  const int lane = threadIdx.x % 32;
  const int64_t slice = int64_t{blockIdx.x} * kSliceWarps + threadIdx.x / 32;
  if (slice >= slices) return;
  const int64_t r = blockIdx.y;
  const int64_t base = slice * kSlice;
  const float* row = logits + r * vocab;
  float v[kPerLane];
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) {
    const int64_t j = base + lane + 32 * i;
    v[i] = j < vocab ? row[j] : -INFINITY;  // past the row: contributes nothing
  }
  float local_max = -INFINITY;
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) local_max = fmaxf(local_max, v[i]);
  const float max = WarpMax(local_max);
  // As the host: exp(l - max) in float, summed in double. A -inf logit adds 0 even when the
  // slice's max is -inf (the host's max is the row's, finite unless the whole row is not).
  double local_sum = 0;
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) {
    if (v[i] != -INFINITY) local_sum += static_cast<double>(expf(v[i] - max));
  }
  const double sum = WarpSum(local_sum);
  const int64_t at = r * slices + slice;
  if (lane == 0) {
    slice_max[at] = max;
    slice_sum[at] = sum;
  }
  if (k == 0) return;
  WarpFirstK(
      k,
      [&](auto&& f) {
#pragma unroll
        for (int i = 0; i < kPerLane; ++i) {
          const int64_t j = base + lane + 32 * i;
          f(Candidate{v[i], j < vocab ? static_cast<int32_t>(j) : -1});
        }
      },
      candidates + at * k);
}

// One block of kMergeWarps warps per row.
__global__ void __launch_bounds__(kMergeWarps * 32)
    LogprobMergeKernel(const float* __restrict__ logits, int64_t vocab, int64_t slices, int64_t k,
                       const float* __restrict__ slice_max, const double* __restrict__ slice_sum,
                       const Candidate* __restrict__ candidates,
                       const int32_t* __restrict__ sampled, const int32_t* __restrict__ named,
                       int64_t m, float* __restrict__ sampled_logprobs,
                       float* __restrict__ named_logprobs, int32_t* __restrict__ top_ids,
                       float* __restrict__ top_logprobs) {
  PdlWait();
  __shared__ float warp_max[kMergeWarps];
  __shared__ double warp_sum[kMergeWarps];
  __shared__ Candidate warp_picks[kMergeWarps * kMaxK];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int64_t r = blockIdx.x;
  const float* maxes = slice_max + r * slices;
  const double* sums = slice_sum + r * slices;
  float local_max = -INFINITY;
  for (int64_t s = threadIdx.x; s < slices; s += blockDim.x) local_max = fmaxf(local_max, maxes[s]);
  local_max = WarpMax(local_max);
  if (lane == 0) warp_max[warp] = local_max;
  __syncthreads();
  float max = -INFINITY;
  for (int w = 0; w < kMergeWarps; ++w) max = fmaxf(max, warp_max[w]);
  const double row_max = max;
  // A slice whose max is -inf adds its sum (0, or NaN for a NaN it held) times 0.
  double local_sum = 0;
  for (int64_t s = threadIdx.x; s < slices; s += blockDim.x) {
    const double scale = maxes[s] == -INFINITY && max != -INFINITY
                             ? 0.0
                             : exp(static_cast<double>(maxes[s]) - row_max);
    local_sum += sums[s] * scale;
  }
  local_sum = WarpSum(local_sum);
  if (lane == 0) warp_sum[warp] = local_sum;
  __syncthreads();
  double sum = 0;
  for (int w = 0; w < kMergeWarps; ++w) sum += warp_sum[w];
  const double lse = row_max + log(sum);
  const float* row = logits + r * vocab;
  auto logprob = [&](int64_t id) {
    return id >= 0 && id < vocab ? static_cast<float>(row[id] - lse) : 0.f;
  };
  if (threadIdx.x == 0) sampled_logprobs[r] = logprob(sampled[r]);
  for (int64_t j = threadIdx.x; j < m; j += blockDim.x) {
    named_logprobs[r * m + j] = logprob(named[r * m + j]);
  }
  if (k == 0) return;
  // Each warp: the k first of its share of the row's slices' candidates.
  const Candidate* row_candidates = candidates + r * slices * k;
  const int64_t total = slices * k;
  const int64_t share = (total + kMergeWarps - 1) / kMergeWarps;
  const int64_t begin = warp * share, end = begin + share < total ? begin + share : total;
  WarpFirstK(
      k,
      [&](auto&& f) {
        for (int64_t i = begin + lane; i < end; i += 32) f(row_candidates[i]);
      },
      warp_picks + warp * k);
  __syncthreads();
  if (warp != 0) return;
  __shared__ Candidate picks[kMaxK];
  WarpFirstK(
      k,
      [&](auto&& f) {
        for (int64_t i = lane; i < kMergeWarps * k; i += 32) f(warp_picks[i]);
      },
      picks);
  __syncwarp();
  for (int64_t t = lane; t < k; t += 32) {
    const Candidate pick = picks[t];
    top_ids[r * k + t] = pick.id;
    top_logprobs[r * k + t] = pick.id >= 0 ? static_cast<float>(pick.logit - lse) : -INFINITY;
  }
}

struct WorkspaceLayout {
  size_t max_offset, sum_offset, candidates_offset, bytes;
};

size_t AlignUp(size_t v, size_t a) { return (v + a - 1) / a * a; }

WorkspaceLayout Layout(int64_t n, int64_t slices, int64_t k) {
  WorkspaceLayout l;
  const size_t entries = static_cast<size_t>(n) * static_cast<size_t>(slices);
  l.max_offset = 0;
  l.sum_offset = AlignUp(entries * sizeof(float), 256);
  l.candidates_offset = AlignUp(l.sum_offset + entries * sizeof(double), 256);
  l.bytes = l.candidates_offset + entries * static_cast<size_t>(k) * sizeof(Candidate);
  return l;
}

bool ValidShape(int64_t n, int64_t vocab, int64_t k) {
  return n >= 0 && vocab > 0 && vocab <= INT32_MAX && n <= INT32_MAX && k >= 0 && k <= kMaxK;
}

}  // namespace

cudaError_t LogprobRowsWorkspaceBytes(int64_t n, int64_t vocab, int64_t k, size_t* bytes) {
  if (!ValidShape(n, vocab, k) || bytes == nullptr) return cudaErrorInvalidValue;
  *bytes = Layout(n, (vocab + kSlice - 1) / kSlice, k).bytes;
  return cudaSuccess;
}

cudaError_t LaunchLogprobRows(const float* logits, int64_t n, int64_t vocab, const int32_t* sampled,
                              const int32_t* named, int64_t m, int64_t k, float* sampled_logprobs,
                              float* named_logprobs, int32_t* top_ids, float* top_logprobs,
                              void* workspace, size_t workspace_bytes, cudaStream_t stream) {
  if (!ValidShape(n, vocab, k) || m < 0) return cudaErrorInvalidValue;
  if (n == 0) return cudaSuccess;
  const int64_t slices = (vocab + kSlice - 1) / kSlice;
  const WorkspaceLayout layout = Layout(n, slices, k);
  if (logits == nullptr || sampled == nullptr || sampled_logprobs == nullptr ||
      (m > 0 && (named == nullptr || named_logprobs == nullptr)) ||
      (k > 0 && (top_ids == nullptr || top_logprobs == nullptr)) || workspace == nullptr ||
      workspace_bytes < layout.bytes) {
    return cudaErrorInvalidValue;
  }
  auto* base = static_cast<char*>(workspace);
  auto* slice_max = reinterpret_cast<float*>(base + layout.max_offset);
  auto* slice_sum = reinterpret_cast<double*>(base + layout.sum_offset);
  auto* candidates = reinterpret_cast<Candidate*>(base + layout.candidates_offset);
  for (int64_t first = 0; first < n; first += kMaxGridY) {
    const int64_t rows = n - first < kMaxGridY ? n - first : kMaxGridY;
    const dim3 grid(static_cast<unsigned>((slices + kSliceWarps - 1) / kSliceWarps),
                    static_cast<unsigned>(rows));
    LaunchKernel(LogprobSliceKernel, grid, kSliceWarps * 32, 0, stream, logits + first * vocab,
                 vocab, slices, k, slice_max + first * slices, slice_sum + first * slices,
                 candidates + first * slices * k);
  }
  LaunchKernel(LogprobMergeKernel, static_cast<unsigned>(n), kMergeWarps * 32, 0, stream, logits,
               vocab, slices, k, slice_max, slice_sum, candidates, sampled, named, m,
               sampled_logprobs, named_logprobs, top_ids, top_logprobs);
  return cudaGetLastError();
}

}  // namespace dxs::cuda
