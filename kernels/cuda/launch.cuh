// Kernel launches with programmatic dependent launch (PDL, sm_90): a kernel may be scheduled
// while the one before it in the stream still runs, and waits on the device for that one's
// completion and memory instead of on the launch path. A decode step is a chain of short
// dependent kernels (a layer at batch 1 is about 17 of them, most a few microseconds), so
// each boundary's launch and ramp otherwise sits between two kernels in the graph.
//
// The contract, for every kernel launched through LaunchKernel:
// - It calls PdlWait() before it reads or writes any memory that an earlier kernel of the
//   stream writes or reads (in practice: first thing; only immutable weights may be touched
//   before it), and before any return. A block that returned without waiting would let the
//   kernel complete before its predecessor, and the next kernel's wait would then not cover
//   the one before.
// - PdlWait() also lets the next kernel be scheduled (griddepcontrol.launch_dependents),
//   after the wait: so when a kernel starts, every kernel before its predecessor has
//   completed, and reads before PdlWait() of memory written two or more kernels back are
//   safe.
// Kernels of other libraries (cuBLAS, CUTLASS, CUB) and copies keep full stream order; a
// PDL kernel after one of them simply waits for it. tests/python/pdl_wait_check.py checks
// that every kernel passed to LaunchKernel calls PdlWait() first.
//
// DXS_CUDA_PDL=off launches without the attribute (plain stream order), for A/B runs.
#pragma once

#include <cuda_runtime.h>

#include <utility>

#include "common/tunables.h"

namespace dxs::cuda {

// Whether launches carry the PDL attribute: on unless DXS_CUDA_PDL=off (read once).
inline bool PdlEnabled() {
  static const bool enabled = tunables::On(tunables::kCudaPdl);
  return enabled;
}

// Wait for the previous kernel of the stream (and so, transitively, everything before it),
// then allow the next one to be scheduled. A no-op when the launch had no PDL attribute.
__device__ __forceinline__ void PdlWait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// Lets the next kernel of the stream be scheduled now, before this one waits. For a short
// kernel whose successor streams weights (a norm before a GEMV): the successor's pdl-early
// weight loads then overlap this kernel's wait for its own predecessor instead of starting
// after it. A kernel that calls it (before PdlWait, under a `// pdl-early:` comment) gives
// up the "two or more kernels back" guarantee for its successor, which may start while this
// kernel's predecessor still runs; that is safe because every kernel touches only immutable
// weights before its own PdlWait(). DXS_CUDA_NORM_EARLY_TRIGGER=on|off turns it on for
// ResidualNormKernel: off by default, 1.01x at batch 1 on an H200 with bf16 weights
// (docs/results/gpu-bench.md, 2026-12-02), not adopted.
__device__ __forceinline__ void PdlTrigger() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// Whether the residual norms call PdlTrigger() before waiting (read once).
inline bool NormEarlyTrigger() {
  static const bool on = tunables::Get(tunables::kCudaNormEarlyTrigger) == "on";
  return on;
}

// kernel<<<grid, block, smem, stream>>>(args...) with the PDL attribute (see above). Returns
// the launch's error, which cudaGetLastError() also reports.
template <typename... Params, typename... Args>
cudaError_t LaunchKernel(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem,
                         cudaStream_t stream, Args&&... args) {
  cudaLaunchAttribute attribute[1];
  attribute[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute[0].val.programmaticStreamSerializationAllowed = PdlEnabled() ? 1 : 0;
  cudaLaunchConfig_t config = {};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  config.attrs = attribute;
  config.numAttrs = 1;
  return cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...);
}

}  // namespace dxs::cuda
