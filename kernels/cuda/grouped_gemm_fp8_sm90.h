// Internal to the FP8 grouped GEMM: what grouped_gemm.cc hands to the CUTLASS instantiations
// grouped_gemm_fp8_sm90_*.cu (see grouped_gemm_fp8_sm90.cuh). Arguments arrive checked; sizes
// fit int32. Apart from grouped_gemm_sm90.h so that the bf16 instantiations do not rebuild.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "kernels/cuda/grouped_gemm_sm90.h"

namespace dxs::cuda::grouped_gemm {

// The FP8 grouped GEMM (grouped_gemm_fp8_sm90.cuh): A e4m3 rows with per-row, per-128-column
// scales (sfa: each expert's block M-major, from row begin * k / 128 on), B_e e4m3 weights
// with 128x128 block scales (sfb_ptrs[e]: [k / 128, n / 128], N-major).
struct Fp8Problem {
  const uint8_t* a = nullptr;
  const float* sfa = nullptr;
  const int32_t* expert_offsets = nullptr;
  const void* const* b_ptrs = nullptr;
  const float* const* sfb_ptrs = nullptr;
  int32_t num_experts = 0;
  int32_t total_rows = 0;
  int32_t n = 0;
  int32_t k = 0;
  void* c = nullptr;
  int device = 0;
  int sm_count = 0;
  void* workspace = nullptr;
  size_t workspace_bytes = 0;
  cudaStream_t stream = nullptr;
};

struct Sm90Fp8Kernel {
  size_t (*workspace_bytes)(int32_t num_experts, int sm_count);
  cudaError_t (*run)(const Fp8Problem& p);
};

// 128x128x128 tiles, cooperative, 1x1 clusters, FP8 blockwise scaling; bf16 or f32 C.
extern const Sm90Fp8Kernel kSm90Fp8Bf16Out;
extern const Sm90Fp8Kernel kSm90Fp8F32Out;
// Alternatives, bf16 C only (DXS_CUDA_FP8_GROUPED_TILES): the same tiles in 1x2 clusters, and
// 64x128x128 ping-pong tiles (grouped_gemm_fp8_sm90.cuh).
extern const Sm90Fp8Kernel kSm90Fp8PairNBf16Out;
extern const Sm90Fp8Kernel kSm90Fp8PingpongBf16Out;

}  // namespace dxs::cuda::grouped_gemm
