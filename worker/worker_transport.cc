#include "worker/worker_transport.h"

#include "common/plugin_loader.h"
#include "common/status_macros.h"
#include "kernels/make_backend.h"

namespace dxs {
namespace {

using MakeNcclTransportFn = NcclTransport* (*)(Transport* control, int device, absl::Status* error);

}  // namespace

absl::StatusOr<WorkerTransport> MakeWorkerTransport(const std::string& transport,
                                                    const std::string& device) {
  DXS_RETURN_IF_ERROR(ValidateWorkerTransport(transport, device));
  WorkerTransport made;
  DXS_ASSIGN_OR_RETURN(made.cuda_device, DeviceOrdinal(device));
  DXS_ASSIGN_OR_RETURN(made.transport, MakeUcxTransport());
  if (transport == "ucx") return made;
  DXS_ASSIGN_OR_RETURN(
      void* fn, LoadPluginSymbol("libdxs_nccl.so", tunables::kNcclPlugin, "dxs_make_nccl_transport",
                                 "--transport nccl", "the nccl transport"));
  absl::Status error;
  // The plugin owns the control transport from here on, also when it fails.
  NcclTransport* nccl =
      reinterpret_cast<MakeNcclTransportFn>(fn)(made.transport.release(), made.cuda_device, &error);
  if (nccl == nullptr) return error;
  made.nccl = nccl;
  made.transport.reset(nccl);
  return made;
}

}  // namespace dxs
