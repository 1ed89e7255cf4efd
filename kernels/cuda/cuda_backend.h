// CudaBackend: the Backend of kernels/backend.h on one NVIDIA GPU.
//
// Weights are kept in bf16 (f16 stays f16) and activations are bf16, with fp32
// accumulation in every kernel and GEMM; router logits, routing weights and the expert
// pre-sum are f32 where the model asks for it. Memory comes from a caching allocator over
// cudaMalloc, so the step loop allocates nothing from the driver once warm. The queue is
// one CUDA stream per backend; events are CUDA events. Dense GEMMs are cuBLAS (GemmEx,
// fp32 compute); the kernels are in kernels/cuda/*.cu behind kernels/cuda/ops.cuh.
//
// Errors: shapes and dtypes are checked on the host before anything is enqueued
// (INVALID_ARGUMENT, as the CPU backend gives); a launch error is INTERNAL with CUDA's
// name for it; an error during asynchronous work surfaces at the next synchronisation.
#pragma once

#include <cuda_runtime_api.h>

#include <memory>

#include "absl/status/statusor.h"
#include "kernels/backend.h"

namespace dxs {

// A backend on GPU `device_ordinal`. FAILED_PRECONDITION, with what was found, when there
// is no such GPU or the driver cannot be used; never a crash.
absl::StatusOr<std::unique_ptr<Backend>> MakeCudaBackend(int device_ordinal = 0);

// The number of GPUs the CUDA runtime sees (0 when there is no driver or no device).
int CudaDeviceCount();

// The stream (the work queue) of a backend made by MakeCudaBackend; null for any other
// backend. For benchmarks that time with CUDA events, and for interop.
cudaStream_t CudaStreamOf(Backend* backend);

// Blocks the backend's memory pool has taken from cudaMalloc so far (each a device
// synchronisation where the pool had none cached), or -1 for any other backend. For
// benchmarks that check a timed loop allocates nothing new.
int64_t CudaSystemAllocations(Backend* backend);

}  // namespace dxs
