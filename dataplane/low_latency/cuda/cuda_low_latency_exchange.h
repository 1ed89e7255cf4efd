// The low-latency exchange on the CUDA backend (kernels/cuda/): the rounds of
// ll_exchange.cuh enqueued on a CudaBackend's stream. Built into libdxs_cuda.so beside the
// backend (its entry point dxs_make_cuda_low_latency_exchange, which
// MakeLowLatencyExchange looks up), and into the binaries that link the backend in.
#pragma once

#include <memory>

#include "absl/status/statusor.h"
#include "dataplane/low_latency/low_latency_exchange.h"
#include "kernels/backend.h"

namespace dxs {

// One rank's side on `backend`, which this copy of the CUDA backend's code made
// (FAILED_PRECONDITION otherwise); the shape's checks are INVALID_ARGUMENT.
absl::StatusOr<std::unique_ptr<LowLatencyExchange>> MakeCudaLowLatencyExchange(
    Backend* backend, const LowLatencyShape& shape, LowLatencySide side, int rank);

}  // namespace dxs
