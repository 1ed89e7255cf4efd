// The grouped GEMM, wide tiles without clusters, f32 C: this TU's one CUTLASS instantiation (the
// configurations are in grouped_gemm_sm90.cuh).
#include "kernels/cuda/grouped_gemm_sm90.cuh"

namespace dxs::cuda::grouped_gemm {

const Sm90Kernel kSm90Wide1F32Out = MakeSm90Kernel<ConfigSm90Wide1<float>>();

}  // namespace dxs::cuda::grouped_gemm
