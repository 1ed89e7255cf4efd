// DXS_CUDA_RETURN_IF_ERROR(expr): returns expr's cudaError_t from the enclosing launcher
// unless it is cudaSuccess (the absl-free launchers' DXS_RETURN_IF_ERROR; moe_ops.cu,
// sampling.cu).
#pragma once

#include <cuda_runtime_api.h>

#define DXS_CUDA_RETURN_IF_ERROR(expr)                      \
  do {                                                      \
    const cudaError_t dxs_cuda_err_ = (expr);               \
    if (dxs_cuda_err_ != cudaSuccess) return dxs_cuda_err_; \
  } while (0)
