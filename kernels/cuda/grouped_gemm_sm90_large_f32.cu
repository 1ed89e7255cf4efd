// The grouped GEMM, large tiles, f32 C: this TU's one CUTLASS instantiation (the
// configurations are in grouped_gemm_sm90.cuh).
#include "kernels/cuda/grouped_gemm_sm90.cuh"

namespace dxs::cuda::grouped_gemm {

const Sm90Kernel kSm90LargeF32Out = MakeSm90Kernel<ConfigSm90Large<float>>();

}  // namespace dxs::cuda::grouped_gemm
