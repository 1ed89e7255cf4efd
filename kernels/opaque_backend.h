// OpaqueBackend: a test backend whose "device" memory the host cannot read.
//
// It computes exactly as the CPU backend does (same ops, same float32 arithmetic), but
// every tensor it hands out points into a PROT_NONE mapping of a memfd. The backend's ops
// (and transports, through TransportAddress) reach the same pages through a second,
// read-write mapping of that memfd. Any host code outside the backend that dereferences a
// tensor's memory therefore crashes at once, so a test that runs a whole generation on
// this backend and gets the CPU backend's tokens proves that the model, the step loops,
// the dispatch/combine engine and the expert workers touch tensor data only through the
// backend, as a CUDA backend requires. Nothing here needs a GPU.
//
// Memory: one sparse arena (virtual; pages are committed as they are written) behind the
// usual caching allocator. Host tensors that did not come from this backend (a transport
// buffer, say) pass through the ops unchanged.
//
// Thread safety: as the CPU backend.
#pragma once

#include <memory>

#include "absl/status/statusor.h"
#include "kernels/backend.h"

namespace dxs {

// `arena_bytes` of address space for all of the backend's tensors (default 8 GiB).
absl::StatusOr<std::unique_ptr<Backend>> MakeOpaqueBackend(size_t arena_bytes = size_t{8} << 30);

}  // namespace dxs
