// Internal to the grouped GEMM: what grouped_gemm.cc (host checks and dispatch, no CUTLASS)
// hands to the CUTLASS instantiations, one per grouped_gemm_sm90_*.cu (see
// grouped_gemm_sm90.cuh). Arguments arrive checked; sizes fit int32.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

namespace dxs::cuda::grouped_gemm {

struct Problem {
  const __nv_bfloat16* a = nullptr;
  const int32_t* expert_offsets = nullptr;
  const __nv_bfloat16* const* b_ptrs = nullptr;
  int32_t num_experts = 0;
  int32_t total_rows = 0;
  int32_t n = 0;
  int32_t k = 0;
  void* c = nullptr;
  int device = 0;
  int sm_count = 0;  // persistent CTAs: one per SM
  void* workspace = nullptr;
  size_t workspace_bytes = 0;
  cudaStream_t stream = nullptr;
};

// Workspace alignment the instantiations rely on (TMA descriptors need 64 bytes).
inline constexpr size_t kWorkspaceAlignment = 128;

// One CUTLASS instantiation: grouped_gemm_sm90_<tiles>_<C dtype>.cu defines one of these.
struct Sm90Kernel {
  size_t (*workspace_bytes)(int32_t num_experts, int sm_count);
  cudaError_t (*run)(const Problem& p);
};

// 128x128x64 tiles, cooperative: for batches averaging more than 64 rows an expert.
extern const Sm90Kernel kSm90LargeBf16Out;
extern const Sm90Kernel kSm90LargeF32Out;
// 128x256x64 tiles, cooperative: for batches averaging more than 128 rows an expert.
extern const Sm90Kernel kSm90Wide1Bf16Out;
extern const Sm90Kernel kSm90Wide1F32Out;
// The same in 2x1 clusters (DXS_GROUPED_GEMM_TILES=wide only; measured slower).
extern const Sm90Kernel kSm90WideBf16Out;
extern const Sm90Kernel kSm90WideF32Out;
// 64x128x64 tiles, ping-pong: for decode-sized batches (see grouped_gemm_sm90.cuh).
extern const Sm90Kernel kSm90SmallBf16Out;
extern const Sm90Kernel kSm90SmallF32Out;

}  // namespace dxs::cuda::grouped_gemm
