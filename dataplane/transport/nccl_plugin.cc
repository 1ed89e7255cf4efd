// libdxs_nccl.so's one entry point: the nccl transport (nccl_transport.h) for workers
// started with --transport nccl, which load it with dlopen (worker/worker_transport.cc),
// as they load the CUDA backend, so that the services link neither the CUDA runtime nor
// NCCL and run where neither is installed. abseil is a shared library of the process, so
// a Status crosses the boundary as is.
#include <memory>

#include "absl/status/status.h"
#include "dataplane/transport/nccl_transport.h"

// The transport over `control` (owned from here on, also on failure) for GPU `device`, or
// null with *error set.
extern "C" __attribute__((visibility("default"))) dxs::NcclTransport* dxs_make_nccl_transport(
    dxs::Transport* control, int device, absl::Status* error) {
  dxs::NcclTransportOptions options;
  options.device = device;
  absl::StatusOr<std::unique_ptr<dxs::NcclTransport>> transport =
      dxs::MakeNcclTransport(std::unique_ptr<dxs::Transport>(control), options);
  if (!transport.ok()) {
    *error = transport.status();
    return nullptr;
  }
  return transport->release();
}
