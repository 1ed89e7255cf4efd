// libdxs_cuda.so's one entry point (kernels/make_backend.cc loads it with dlopen). abseil
// is a shared library of the process, so a Status crosses the boundary as is.
#include <memory>

#include "absl/status/status.h"
#include "kernels/cuda/cuda_backend.h"

// The backend, or null with *error set.
extern "C" __attribute__((visibility("default"))) dxs::Backend* dxs_make_cuda_backend(
    int device_ordinal, absl::Status* error) {
  absl::StatusOr<std::unique_ptr<dxs::Backend>> backend = dxs::MakeCudaBackend(device_ordinal);
  if (!backend.ok()) {
    *error = backend.status();
    return nullptr;
  }
  return backend->release();
}
