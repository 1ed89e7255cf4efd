#include "kernels/make_backend.h"

#include <string>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "common/status_macros.h"

#if DXS_HAVE_CUDA_BACKEND
#include "kernels/cuda/cuda_backend.h"
#endif

namespace dxs {
namespace {

// The GPU ordinal of "cuda" / "cuda:N", or -1 for "cpu".
absl::StatusOr<int> ParseDevice(absl::string_view device) {
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

}  // namespace

bool BuiltWithCuda() { return DXS_HAVE_CUDA_BACKEND != 0; }

absl::Status ValidateDeviceName(absl::string_view device) { return ParseDevice(device).status(); }

absl::StatusOr<std::unique_ptr<Backend>> MakeBackend(absl::string_view device) {
  DXS_ASSIGN_OR_RETURN(const int ordinal, ParseDevice(device));
  if (ordinal < 0) return MakeCpuBackend();
#if DXS_HAVE_CUDA_BACKEND
  return MakeCudaBackend(ordinal);
#else
  return absl::FailedPreconditionError(
      absl::StrCat("--device ", device,
                   ": this build of dxs has no CUDA backend (configure with the CUDA "
                   "toolkit present and DXS_WITH_CUDA=ON)"));
#endif
}

}  // namespace dxs
