// The backend a `--device` flag names: "cpu", "cuda" (GPU 0) or "cuda:N".
//
// A build without the CUDA toolkit, or a machine without a usable GPU, gives
// FAILED_PRECONDITION saying which; an unknown name is INVALID_ARGUMENT. Never a crash.
#pragma once

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "kernels/backend.h"

namespace dxs {

// A device name the flag accepts, checked without touching any GPU: "cpu", "cuda", "cuda:N".
absl::Status ValidateDeviceName(absl::string_view device);
// The GPU ordinal a valid device name names: N for "cuda:N", 0 for "cuda", -1 for "cpu".
absl::StatusOr<int> DeviceOrdinal(absl::string_view device);
absl::StatusOr<std::unique_ptr<Backend>> MakeBackend(absl::string_view device);
// Whether this binary was built with the CUDA backend.
bool BuiltWithCuda();

}  // namespace dxs
