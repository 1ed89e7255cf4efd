// One token's router top-k softmax by one warp (the contract: topk_softmax.cuh), shared by
// TopKSoftmaxKernel and the decode router's fused kernel (route_decode.cu), so both give the
// same bits.
//
// Expert e lives in lane e % 32, slot e / 32, so loads are coalesced and every per-lane array
// is indexed by compile-time slot numbers only (it stays in registers). Selection ranks by
// logit, which orders experts exactly as their softmax probabilities do (exp is monotone)
// without depending on expf's rounding; NaN logits rank last. kSlots only bounds the experts
// (kSlots * 32): slots past num_experts are padding, so every kSlots gives the same result.
#pragma once

#include <cuda_runtime.h>

#include <climits>
#include <cstdint>

#include "kernels/cuda/topk_softmax.cuh"

namespace dxs::cuda {
namespace topk_warp {

constexpr int kWarpSize = 32;
constexpr unsigned kFullMask = 0xffffffffu;
constexpr int kNoExpert = INT_MAX;  // "nothing found yet" in an argmax

static_assert(kTopKSoftmaxMaxTopK <= kWarpSize, "lane k holds the k-th pick");
static_assert(kTopKSoftmaxMaxExperts <= kWarpSize * 32, "slot bits must fit in 32 bits");

// The ranking key: the logit, with NaN moved to the bottom so that the order is total and
// every lane of the warp agrees on the winner.
__device__ __forceinline__ float RankKey(float logit) { return isnan(logit) ? -INFINITY : logit; }

// True when (a_key, a_id) ranks before (b_key, b_id): larger key first, lower id on ties.
// kNoExpert ranks after everything.
__device__ __forceinline__ bool RanksBefore(float a_key, int a_id, float b_key, int b_id) {
  if (a_id == kNoExpert) return false;
  if (b_id == kNoExpert) return true;
  return a_key > b_key || (a_key == b_key && a_id < b_id);
}

// The key's bits in an unsigned order that matches the float order: larger keys give larger
// values. -0 and +0 give the same value (they tie in RanksBefore); keys are never NaN
// (RankKey), and -inf gives 0x007fffff, so 0 is below every key and means "no candidate".
__device__ __forceinline__ unsigned OrderedBits(float key) {
  unsigned u = __float_as_uint(key);
  if ((u << 1) == 0u) u = 0u;  // -0 as +0
  return (u & 0x80000000u) != 0u ? ~u : (u | 0x80000000u);
}

}  // namespace topk_warp

// The whole warp calls it (shuffles); logit(e) loads expert e's logit as float. Writes
// ids[0..top_k) and weights[0..top_k) (lane k the k-th pick). num_experts <= kSlots * 32,
// top_k <= min(num_experts, 32).
template <int kSlots, typename LoadLogitFn>
__device__ __forceinline__ void TopKSoftmaxWarp(LoadLogitFn logit_of, int num_experts, int top_k,
                                                bool normalize, int32_t* ids, float* weights) {
  using namespace topk_warp;
  const int lane = threadIdx.x % kWarpSize;
  float logit[kSlots];
  unsigned taken = 0;  // bit s: slot s is padding or already picked
  float row_max = -INFINITY;
#pragma unroll
  for (int s = 0; s < kSlots; ++s) {
    const int e = s * kWarpSize + lane;
    if (e < num_experts) {
      logit[s] = logit_of(e);
      row_max = fmaxf(row_max, logit[s]);
    } else {
      logit[s] = -INFINITY;
      taken |= 1u << s;
    }
  }
#pragma unroll
  for (int offset = kWarpSize / 2; offset > 0; offset /= 2) {
    row_max = fmaxf(row_max, __shfl_xor_sync(kFullMask, row_max, offset));
  }

  float prob[kSlots];
#pragma unroll
  for (int s = 0; s < kSlots; ++s) {
    prob[s] = (taken >> s & 1u) ? 0.f : expf(logit[s] - row_max);
  }
  // The denominator, added in expert order like the CPU reference (see the header); every
  // lane computes the same value. Padding adds exact zeros.
  float sum = 0.f;
#pragma unroll
  for (int s = 0; s < kSlots; ++s) {
    if (s * kWarpSize >= num_experts) break;  // uniform across the warp
    for (int src = 0; src < kWarpSize; ++src) sum += __shfl_sync(kFullMask, prob[s], src);
  }
#pragma unroll
  for (int s = 0; s < kSlots; ++s) prob[s] /= sum;

  // k rounds of warp argmax; lane k keeps the k-th pick. Each lane first takes its own best
  // free slot; the warp's winner is then the largest key (one redux.sync over OrderedBits)
  // and, among the lanes holding it, the lowest id (a second): RanksBefore's order in two
  // instructions instead of a 5-step shuffle tree of three values. Its probability comes from
  // the lane that holds it.
  int my_id = 0;
  float my_weight = 0.f;
  float picked_sum = 0.f;
  for (int k = 0; k < top_k; ++k) {
    float lane_key = -INFINITY;
    int lane_id = kNoExpert;
    float lane_prob = 0.f;
#pragma unroll
    for (int s = 0; s < kSlots; ++s) {
      const int e = s * kWarpSize + lane;
      const float key = RankKey(logit[s]);
      if (!(taken >> s & 1u) && RanksBefore(key, e, lane_key, lane_id)) {
        lane_key = key;
        lane_id = e;
        lane_prob = prob[s];
      }
    }
    const unsigned lane_bits = lane_id == kNoExpert ? 0u : OrderedBits(lane_key);
    const unsigned best_bits = __reduce_max_sync(kFullMask, lane_bits);
    // top_k <= num_experts, so some expert was still free and best_id is a real one.
    const int best_id = __reduce_min_sync(
        kFullMask, lane_id != kNoExpert && lane_bits == best_bits ? lane_id : kNoExpert);
    const float best_prob = __shfl_sync(kFullMask, lane_prob, best_id % kWarpSize);
    if (lane == best_id % kWarpSize) taken |= 1u << (best_id / kWarpSize);
    picked_sum += best_prob;
    if (lane == k) {
      my_id = best_id;
      my_weight = best_prob;
    }
  }
  if (lane < top_k) {
    ids[lane] = my_id;
    weights[lane] = normalize ? my_weight / picked_sum : my_weight;
  }
}

}  // namespace dxs::cuda
