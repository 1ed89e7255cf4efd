// The FP8 grouped GEMM with block scales in 1x2 clusters, bf16 C: this TU's one CUTLASS
// instantiation (the configurations are in grouped_gemm_fp8_sm90.cuh).
#include "kernels/cuda/grouped_gemm_fp8_sm90.cuh"

namespace dxs::cuda::grouped_gemm {

const Sm90Fp8Kernel kSm90Fp8PairNBf16Out =
    MakeSm90Fp8Kernel<Sm90Fp8GroupedGemm<cutlass::bfloat16_t, Fp8CoopPairN>>();

}  // namespace dxs::cuda::grouped_gemm
