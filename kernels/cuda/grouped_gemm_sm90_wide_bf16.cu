// The grouped GEMM, wide tiles, bf16 C: this TU's one CUTLASS instantiation (the
// configurations are in grouped_gemm_sm90.cuh).
#include "kernels/cuda/grouped_gemm_sm90.cuh"

namespace dxs::cuda::grouped_gemm {

const Sm90Kernel kSm90WideBf16Out = MakeSm90Kernel<ConfigSm90Wide<cutlass::bfloat16_t>>();

}  // namespace dxs::cuda::grouped_gemm
