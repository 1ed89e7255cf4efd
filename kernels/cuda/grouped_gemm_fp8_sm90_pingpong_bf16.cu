// The FP8 grouped GEMM with block scales in 64x128 ping-pong tiles, bf16 C: this TU's one
// CUTLASS instantiation (the configurations are in grouped_gemm_fp8_sm90.cuh).
#include "kernels/cuda/grouped_gemm_fp8_sm90.cuh"

namespace dxs::cuda::grouped_gemm {

const Sm90Fp8Kernel kSm90Fp8PingpongBf16Out =
    MakeSm90Fp8Kernel<Sm90Fp8GroupedGemm<cutlass::bfloat16_t, Fp8Pingpong>>();

}  // namespace dxs::cuda::grouped_gemm
