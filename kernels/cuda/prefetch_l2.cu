// L2 prefetch of model weights (CudaBackend::PrefetchWeights): a decode step's layer reads its
// o-projection's weights right after attention, whose short kernels leave HBM mostly idle, so
// a branch of the recorded graph beside attention can bring those bytes into L2 first. Each
// thread issues one cp.async.bulk.prefetch.L2 of up to kChunk bytes: a few blocks cover a
// layer's projection, leaving the SMs to the step's own kernels.
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "kernels/cuda/elem_type.cuh"
#include "kernels/cuda/launch.cuh"
#include "kernels/cuda/ops.cuh"

namespace dxs::cuda {
namespace {

constexpr size_t kChunk = size_t{16} << 10;  // bytes a thread's bulk prefetch covers
constexpr int kThreads = 128;

// This thread's chunk of [p, p + bytes) (p 16-byte aligned) into L2: whole 16-byte steps of
// up to kChunk bytes from kChunk * the thread's index in the grid's x.
__device__ __forceinline__ void PrefetchChunk(const char* p, size_t bytes) {
  const size_t begin = (static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x) * kChunk;
  if (begin >= bytes) return;
  const size_t n = (bytes - begin < kChunk ? bytes - begin : kChunk) / 16 * 16;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  if (n > 0) {
    asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(p + begin),
                 "r"(static_cast<unsigned>(n))
                 : "memory");
  }
#endif
}

__global__ void __launch_bounds__(kThreads) PrefetchL2Kernel(const char* p, size_t bytes) {
  // pdl-early: the bytes are a model weight, which no kernel writes; the prefetches are
  // issued, not waited for, and the wait after them keeps the launch ordered behind its
  // predecessor on the prefetch stream (launch.cuh).
  PrefetchChunk(p, bytes);
  PdlWait();
}

}  // namespace

cudaError_t LaunchPrefetchL2(const void* p, size_t bytes, cudaStream_t stream) {
  if (bytes == 0) return cudaSuccess;
  if (p == nullptr || !Aligned16(p)) return cudaErrorInvalidValue;
  const size_t threads = (bytes + kChunk - 1) / kChunk;
  return LaunchKernel(PrefetchL2Kernel, static_cast<unsigned>((threads + kThreads - 1) / kThreads),
                      kThreads, 0, stream, static_cast<const char*>(p), bytes);
}

}  // namespace dxs::cuda
