// The test's stand-in for an expert rank's experts over its LL dispatch region: slot (s, t)
// with t < counts[s] and a pair here gets y = sum over its pairs here, in k order, of
// fmaf(weight * (expert + 1) / 16, x, acc), rounded to bf16 once. Slots without a pair
// here are left alone (LaunchLlCombineSend does not send them).
#include <cuda_bf16.h>

#include "tests/dataplane/low_latency/ll_exchange_test_experts.h"

namespace dxs::testing {
namespace {

__global__ void StandInExpertsKernel(const char* region, cuda::LlRegionLayout d, __nv_bfloat16* y) {
  const int64_t slot = blockIdx.x;
  const int s = static_cast<int>(slot / d.capacity);
  const int64_t t = slot % d.capacity;
  if (t >= reinterpret_cast<const int32_t*>(region + d.counts)[s]) return;
  const cuda::LlPair* pairs =
      reinterpret_cast<const cuda::LlPair*>(region + d.meta) + slot * d.top_k;
  bool any = false;
  for (int k = 0; k < d.top_k; ++k) any |= pairs[k].expert >= 0;
  if (!any) return;
  const __nv_bfloat16* x =
      reinterpret_cast<const __nv_bfloat16*>(region + d.rows) + slot * d.hidden;
  for (int h = threadIdx.x; h < d.hidden; h += blockDim.x) {
    const float xv = __bfloat162float(x[h]);
    float acc = 0.f;
    for (int k = 0; k < d.top_k; ++k) {
      if (pairs[k].expert < 0) continue;
      const float coef = __fmul_rn(pairs[k].weight, static_cast<float>(pairs[k].expert + 1) / 16.f);
      acc = __fmaf_rn(coef, xv, acc);
    }
    y[slot * d.hidden + h] = __float2bfloat16_rn(acc);
  }
}

}  // namespace

cudaError_t LaunchStandInExperts(const void* dispatch_region, const cuda::LlRegionLayout& d,
                                 void* y, cudaStream_t stream) {
  StandInExpertsKernel<<<static_cast<int>(d.num_sources) * d.capacity, 128, 0, stream>>>(
      static_cast<const char*>(dispatch_region), d, static_cast<__nv_bfloat16*>(y));
  return cudaGetLastError();
}

}  // namespace dxs::testing
