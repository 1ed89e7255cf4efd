// The FP8 grouped GEMM with block scales, bf16 C: this TU's one CUTLASS instantiation (the
// configuration is in grouped_gemm_fp8_sm90.cuh).
#include "kernels/cuda/grouped_gemm_fp8_sm90.cuh"

namespace dxs::cuda::grouped_gemm {

const Sm90Fp8Kernel kSm90Fp8Bf16Out = MakeSm90Fp8Kernel<Sm90Fp8GroupedGemm<cutlass::bfloat16_t>>();

}  // namespace dxs::cuda::grouped_gemm
