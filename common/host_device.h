// DXS_HOST_DEVICE: a function both host code and CUDA kernels call (__host__ __device__
// under nvcc, nothing elsewhere). Free of other headers so that .cu files can include it.
#pragma once

#if defined(__CUDACC__)
#define DXS_HOST_DEVICE __host__ __device__
#else
#define DXS_HOST_DEVICE
#endif
