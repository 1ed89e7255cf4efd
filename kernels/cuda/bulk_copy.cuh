// Copies from global into shared memory by the SM90 bulk-copy engine (cp.async.bulk: the
// TMA unit without a tensor map), completing on a shared-memory mbarrier. A thread issues a
// whole contiguous span with one instruction and no registers held for the bytes in flight,
// so a kernel that streams weights once can have all of a block's bytes requested at once,
// where register loads keep a few 16-byte chunks a lane in flight (and ptxas decides how
// many: gemv.cu's experts' GEMVs).
//
// Use, for one phase of one barrier a block:
//   thread 0: InitBarrier(&bar); then __syncthreads() before any thread waits on it;
//   thread 0: ExpectBytes(&bar, total) once, then Copy(...) spans adding up to `total`;
//   every thread that reads the copies: WaitBarrier(&bar, 0).
// ExpectBytes is the phase's one arrival, so a total of 0 (nothing to copy) completes it.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

namespace dxs::cuda::bulk_copy {

__device__ __forceinline__ uint32_t SharedAddress(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void InitBarrier(uint64_t* bar) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(SharedAddress(bar)) : "memory");
  // The initialisation visible to the bulk-copy engine (the async proxy) that completes it.
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
#endif
}

// The phase's arrival, expecting `bytes` to land before it completes.
__device__ __forceinline__ void ExpectBytes(uint64_t* bar, uint32_t bytes) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(SharedAddress(bar)),
               "r"(bytes)
               : "memory");
#endif
}

// `bytes` (a multiple of 16; both addresses 16-byte aligned) from src to dst, counted on bar.
__device__ __forceinline__ void Copy(void* dst, const void* src, uint32_t bytes, uint64_t* bar) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::
          "r"(SharedAddress(dst)),
      "l"(src), "r"(bytes), "r"(SharedAddress(bar))
      : "memory");
#endif
}

__device__ __forceinline__ void WaitBarrier(uint64_t* bar, uint32_t phase) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  uint32_t done = 0;
  while (done == 0) {
    asm volatile(
        "{\n"
        "  .reg .pred p;\n"
        "  mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
        "  selp.u32 %0, 1, 0, p;\n"
        "}\n"
        : "=r"(done)
        : "r"(SharedAddress(bar)), "r"(phase)
        : "memory");
  }
#endif
}

// Host side: lets `kernel` take `bytes` of dynamic shared memory (past 48 KB is an opt-in)
// and asks for an SM's most shared memory, for kernels whose blocks an SM are set by the
// shared memory their copies land in.
template <typename... Params>
cudaError_t AllowSharedBytes(void (*kernel)(Params...), size_t bytes) {
  if (cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout,
                                             cudaSharedmemCarveoutMaxShared);
      err != cudaSuccess) {
    return err;
  }
  if (bytes <= 48 * 1024) return cudaSuccess;
  return cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                              static_cast<int>(bytes));
}

}  // namespace dxs::cuda::bulk_copy
