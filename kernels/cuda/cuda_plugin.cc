// libdxs_cuda.so's one entry point (kernels/make_backend.cc loads it with dlopen).
#include <memory>
#include <string>

#include "kernels/cuda/cuda_backend.h"

// On success returns the backend and leaves *error alone; on failure returns null and sets
// *error to the status code and message ("<code>\t<message>").
extern "C" __attribute__((visibility("default"))) dxs::Backend* dxs_make_cuda_backend(
    int device_ordinal, std::string* error) {
  absl::StatusOr<std::unique_ptr<dxs::Backend>> backend = dxs::MakeCudaBackend(device_ordinal);
  if (!backend.ok()) {
    *error = std::to_string(static_cast<int>(backend.status().code())) + "\t" +
             std::string(backend.status().message());
    return nullptr;
  }
  return backend->release();
}
