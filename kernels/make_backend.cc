#include "kernels/make_backend.h"

#include <string>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "common/plugin_loader.h"
#include "common/status_macros.h"

namespace dxs {
namespace {

#if DXS_HAVE_CUDA_BACKEND
using MakeCudaBackendFn = Backend* (*)(int device_ordinal, absl::Status* error);

// libdxs_cuda.so (kernels/cuda/cuda_plugin.cc): $DXS_CUDA_PLUGIN, else beside the
// executable. Loaded once and never unloaded (its code runs every tensor's release).
absl::StatusOr<MakeCudaBackendFn> LoadCudaPlugin() {
  DXS_ASSIGN_OR_RETURN(
      void* fn, LoadPluginSymbol("libdxs_cuda.so", tunables::kCudaPlugin, "dxs_make_cuda_backend",
                                 "--device cuda", "the CUDA backend"));
  return reinterpret_cast<MakeCudaBackendFn>(fn);
}
#endif

}  // namespace

bool BuiltWithCuda() { return DXS_HAVE_CUDA_BACKEND != 0; }

absl::StatusOr<int> DeviceOrdinal(absl::string_view device) {
  if (device == "cpu") return -1;
  if (device == "cuda") return 0;
  int ordinal = 0;
  if (absl::StartsWith(device, "cuda:") && absl::SimpleAtoi(device.substr(5), &ordinal) &&
      ordinal >= 0) {
    return ordinal;
  }
  return absl::InvalidArgumentError(
      absl::StrCat("--device ", device, ": expected cpu, cuda or cuda:N"));
}

absl::Status ValidateDeviceName(absl::string_view device) { return DeviceOrdinal(device).status(); }

absl::StatusOr<std::unique_ptr<Backend>> MakeBackend(absl::string_view device) {
  DXS_ASSIGN_OR_RETURN(const int ordinal, DeviceOrdinal(device));
  if (ordinal < 0) return MakeCpuBackend();
#if DXS_HAVE_CUDA_BACKEND
  DXS_ASSIGN_OR_RETURN(MakeCudaBackendFn make, LoadCudaPlugin());
  absl::Status error;
  Backend* backend = make(ordinal, &error);
  if (backend == nullptr) return error;
  return std::unique_ptr<Backend>(backend);
#else
  return absl::FailedPreconditionError(
      absl::StrCat("--device ", device,
                   ": this build of dxs has no CUDA backend (configure with the CUDA "
                   "toolkit present and DXS_WITH_CUDA=ON)"));
#endif
}

}  // namespace dxs
