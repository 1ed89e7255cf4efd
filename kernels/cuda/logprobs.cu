// Backend::LogprobRows on the GPU: log-probabilities of raw logits rows, so that only the
// few numbers a request asked for come back (kernels/sampling.h's RowLogprobs is the
// reference). One block per row, in passes over the row (which stays in L2 between them):
// 1. the row's max, then the sum of exp(l - max) accumulated in double: lse = max + log(sum);
// 2. the sampled and named ids: l - lse;
// 3. the top k by k block-wide argmax passes, each over the candidates after the previous
//    pick in (larger logit, lower id) order, so no set of picks is kept. k <= 20 passes over
//    a row cost about what one sort of it would, and need no workspace.
// Nothing synchronises with the host, and the work depends only on the shapes: it can be
// recorded in a CUDA graph.
#include <cuda_runtime.h>

#include <climits>
#include <cstdint>
#include <cub/block/block_reduce.cuh>

#include "kernels/cuda/launch.cuh"
#include "kernels/cuda/ops.cuh"

namespace dxs::cuda {
namespace {

constexpr int kThreads = 512;
constexpr int64_t kMaxK = 20;

// A candidate in (larger logit, lower id) order; id -1 is "none", after every real one.
struct Candidate {
  float logit;
  int32_t id;
};

__device__ bool Before(const Candidate& a, const Candidate& b) {
  if (a.id < 0) return false;
  if (b.id < 0) return true;
  return a.logit > b.logit || (a.logit == b.logit && a.id < b.id);
}

struct FirstOp {
  __device__ Candidate operator()(const Candidate& a, const Candidate& b) const {
    return Before(b, a) ? b : a;
  }
};

struct MaxOp {
  __device__ float operator()(float a, float b) const { return a > b ? a : b; }
};

using BlockReduceF = cub::BlockReduce<float, kThreads>;
using BlockReduceD = cub::BlockReduce<double, kThreads>;
using BlockReduceC = cub::BlockReduce<Candidate, kThreads>;

struct Shared {
  union {
    BlockReduceF::TempStorage f;
    BlockReduceD::TempStorage d;
    BlockReduceC::TempStorage c;
  } cub;
  float max;
  double lse;
  Candidate pick;
};

__global__ void __launch_bounds__(kThreads)
    LogprobRowsKernel(const float* __restrict__ logits, int64_t vocab,
                      const int32_t* __restrict__ sampled, const int32_t* __restrict__ named,
                      int64_t m, int64_t k, float* __restrict__ sampled_logprobs,
                      float* __restrict__ named_logprobs, int32_t* __restrict__ top_ids,
                      float* __restrict__ top_logprobs) {
  PdlWait();
  __shared__ Shared s;
  const int64_t r = blockIdx.x;
  const float* row = logits + r * vocab;
  float local_max = -INFINITY;
  for (int64_t j = threadIdx.x; j < vocab; j += kThreads) local_max = fmaxf(local_max, row[j]);
  const float max = BlockReduceF(s.cub.f).Reduce(local_max, MaxOp());
  if (threadIdx.x == 0) s.max = max;
  __syncthreads();
  const double row_max = s.max;
  double local_sum = 0;
  for (int64_t j = threadIdx.x; j < vocab; j += kThreads) {
    local_sum += exp(static_cast<double>(row[j]) - row_max);
  }
  const double sum = BlockReduceD(s.cub.d).Sum(local_sum);
  if (threadIdx.x == 0) s.lse = row_max + log(sum);
  __syncthreads();
  const double lse = s.lse;
  auto logprob = [&](int64_t id) {
    return id >= 0 && id < vocab ? static_cast<float>(row[id] - lse) : 0.f;
  };
  if (threadIdx.x == 0) sampled_logprobs[r] = logprob(sampled[r]);
  for (int64_t j = threadIdx.x; j < m; j += kThreads) {
    named_logprobs[r * m + j] = logprob(named[r * m + j]);
  }
  Candidate last{INFINITY, -1};  // none picked yet: every candidate comes after it
  for (int64_t t = 0; t < k; ++t) {
    Candidate best{-INFINITY, -1};
    for (int64_t j = threadIdx.x; j < vocab; j += kThreads) {
      const Candidate c{row[j], static_cast<int32_t>(j)};
      const bool after_last = last.id < 0 || Before(last, c);
      if (after_last && !isnan(c.logit) && Before(c, best)) best = c;
    }
    __syncthreads();  // the reduction storage is reused
    const Candidate pick = BlockReduceC(s.cub.c).Reduce(best, FirstOp());
    if (threadIdx.x == 0) {
      s.pick = pick;
      top_ids[r * k + t] = pick.id;
      top_logprobs[r * k + t] = pick.id >= 0 ? static_cast<float>(pick.logit - lse) : -INFINITY;
    }
    __syncthreads();
    last = s.pick;
    if (last.id < 0) {  // fewer tokens than k: the rest stay "none"
      for (int64_t u = t + 1 + threadIdx.x; u < k; u += kThreads) {
        top_ids[r * k + u] = -1;
        top_logprobs[r * k + u] = -INFINITY;
      }
      break;
    }
  }
}

}  // namespace

cudaError_t LaunchLogprobRows(const float* logits, int64_t n, int64_t vocab, const int32_t* sampled,
                              const int32_t* named, int64_t m, int64_t k, float* sampled_logprobs,
                              float* named_logprobs, int32_t* top_ids, float* top_logprobs,
                              cudaStream_t stream) {
  if (n < 0 || vocab <= 0 || vocab > INT32_MAX || n > INT32_MAX || m < 0 || k < 0 || k > kMaxK) {
    return cudaErrorInvalidValue;
  }
  if (n == 0) return cudaSuccess;
  if (logits == nullptr || sampled == nullptr || sampled_logprobs == nullptr ||
      (m > 0 && (named == nullptr || named_logprobs == nullptr)) ||
      (k > 0 && (top_ids == nullptr || top_logprobs == nullptr))) {
    return cudaErrorInvalidValue;
  }
  LaunchKernel(LogprobRowsKernel, static_cast<unsigned>(n), kThreads, 0, stream, logits, vocab,
               sampled, named, m, k, sampled_logprobs, named_logprobs, top_ids, top_logprobs);
  return cudaGetLastError();
}

}  // namespace dxs::cuda
