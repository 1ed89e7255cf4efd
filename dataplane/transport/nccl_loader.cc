// The nccl row's Factory (transports.def): the nccl transport from its plugin,
// libdxs_nccl.so (nccl_plugin.cc), loaded with dlopen as the CUDA backend is, so that the
// services link neither the CUDA runtime nor NCCL and run where neither is installed.
#include "absl/status/status.h"
#include "common/plugin_loader.h"
#include "common/status_macros.h"
#include "common/tunables.h"
#include "dataplane/transport/nccl_transport.h"
#include "dataplane/transport/transport_factory.h"

namespace dxs {
namespace {

using MakeNcclTransportFn = NcclTransport* (*)(Transport* control, int device, absl::Status* error);

}  // namespace

absl::StatusOr<MadeTransport> NcclFactory(std::unique_ptr<Transport> control_transport,
                                          int cuda_device) {
  DXS_ASSIGN_OR_RETURN(
      void* fn, LoadPluginSymbol("libdxs_nccl.so", tunables::kNcclPlugin, "dxs_make_nccl_transport",
                                 "--transport nccl", "the nccl transport"));
  absl::Status error;
  // The plugin owns the control transport from here on, also when it fails.
  NcclTransport* nccl =
      reinterpret_cast<MakeNcclTransportFn>(fn)(control_transport.release(), cuda_device, &error);
  if (nccl == nullptr) return error;
  MadeTransport made;
  made.transport.reset(nccl);
  made.communicator = nccl;
  return made;
}

}  // namespace dxs
