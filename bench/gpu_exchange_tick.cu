// The ping-pong baseline's kernel (bench/gpu_exchange_bench.cc): as small as a launch gets,
// with one store so that it is real work on the stream.
#include <cuda_runtime_api.h>

namespace dxs::bench {
namespace {

__global__ void TickKernel(unsigned int* counter) { *counter += 1; }

}  // namespace

cudaError_t LaunchTick(unsigned int* counter, cudaStream_t stream) {
  TickKernel<<<1, 1, 0, stream>>>(counter);
  return cudaGetLastError();
}

}  // namespace dxs::bench
