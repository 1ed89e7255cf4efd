// ll_exchange_cuda_test's stand-in experts (ll_exchange_test_experts.cu says what they
// compute; the test repeats it on the host).
#pragma once

#include <cuda_runtime_api.h>

#include "dataplane/low_latency/cuda/ll_exchange.cuh"

namespace dxs::testing {

// y: bf16 [d.num_sources * d.capacity, d.hidden]; the region's rows are bf16.
cudaError_t LaunchStandInExperts(const void* dispatch_region, const cuda::LlRegionLayout& d,
                                 void* y, cudaStream_t stream);

}  // namespace dxs::testing
