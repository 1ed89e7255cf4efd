// The transport a worker's data path runs on, chosen by --transport (the router's
// --transport must name the same) among the rows of the transport table with kWorkers
// (dataplane/transport/transports.def), and made by the row's factory:
// - ucx: UCP for the control channel and the data exchange (host memory, and GPU memory
//   through cuda_ipc where UCX's CUDA module loads);
// - nccl: the data exchange over one NCCL communicator of the cluster's live workers, its
//   control channel a ucx transport (dataplane/transport/nccl_transport.h). It needs
//   --device cuda[:N] (NCCL moves device memory) and the plugin libdxs_nccl.so beside the
//   binary ($DXS_NCCL_PLUGIN overrides), which links NCCL and the CUDA runtime so that
//   the services do not.
//
// With nccl, every cluster view names the communicator of its live workers
// (ClusterView.transport.nccl_unique_id, a new id whenever that set changes) and
// NcclMembers gives its members; WorkerRuntime::ApplyPendingView makes the communicator
// anew for each new id.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "dataplane/transport/nccl_transport.h"
#include "dataplane/transport/transport.h"
#include "dxs/v1/control_plane.pb.h"

namespace dxs {

// INVALID_ARGUMENT naming the flag for a transport that is no row with kWorkers (ucx or
// nccl), or one with kGpuMemoryOnly (nccl) with a device that is not a GPU. Touches no GPU.
absl::Status ValidateWorkerTransport(const std::string& transport, const std::string& device);

struct WorkerTransport {
  std::unique_ptr<Transport> transport;
  NcclTransport* nccl = nullptr;  // transport itself when it is nccl, else null
  int cuda_device = -1;           // the GPU ordinal of --device (-1: cpu)
};

// The transport of a validated (transport, device) pair. nccl: FAILED_PRECONDITION when
// the plugin does not load or there is no usable GPU.
absl::StatusOr<WorkerTransport> MakeWorkerTransport(const std::string& transport,
                                                    const std::string& device);

// The members of `view`'s NCCL communicator: the transport ranks of its workers that are
// not dead, ascending (the set the router made the view's id for).
std::vector<int> NcclMembers(const v1::ClusterView& view);

}  // namespace dxs
