#include "worker/worker_transport.h"

#include "common/status_macros.h"
#include "dataplane/transport/transport_factory.h"
#include "dataplane/transport/transport_table.h"
#include "kernels/make_backend.h"

namespace dxs {

absl::StatusOr<WorkerTransport> MakeWorkerTransport(const std::string& transport,
                                                    const std::string& device) {
  DXS_RETURN_IF_ERROR(ValidateWorkerTransport(transport, device));
  WorkerTransport made;
  DXS_ASSIGN_OR_RETURN(made.cuda_device, DeviceOrdinal(device));
  DXS_ASSIGN_OR_RETURN(MadeTransport t, MakeTransport(*FindTransport(transport), made.cuda_device));
  made.transport = std::move(t.transport);
  made.nccl = t.communicator;
  return made;
}

}  // namespace dxs
