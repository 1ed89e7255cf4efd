#include "kernels/cuda/cublas_loader.h"

#include <dlfcn.h>

#include <string>
#include <type_traits>

#include "absl/strings/str_cat.h"

namespace dxs {
namespace {

absl::StatusOr<CublasApi> Load() {
  const std::string name = absl::StrCat("libcublas.so.", CUBLAS_VER_MAJOR);
  void* lib = dlopen(name.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (lib == nullptr) {
    return absl::FailedPreconditionError(
        absl::StrCat("cannot load cuBLAS (", name, "): ", dlerror()));
  }
  CublasApi api;
  bool missing = false;
  std::string which;
  auto resolve = [&](auto* slot, const char* symbol) {
    *slot = reinterpret_cast<std::remove_pointer_t<decltype(slot)>>(dlsym(lib, symbol));
    if (*slot == nullptr) {
      missing = true;
      which = symbol;
    }
  };
  resolve(&api.create, "cublasCreate_v2");
  resolve(&api.destroy, "cublasDestroy_v2");
  resolve(&api.set_stream, "cublasSetStream_v2");
  resolve(&api.set_workspace, "cublasSetWorkspace_v2");
  resolve(&api.set_math_mode, "cublasSetMathMode");
  resolve(&api.gemm_ex, "cublasGemmEx");
  resolve(&api.status_name, "cublasGetStatusName");
  resolve(&api.status_string, "cublasGetStatusString");
  if (missing) {
    return absl::FailedPreconditionError(absl::StrCat(name, " has no ", which));
  }
  // Optional (cuBLAS 12.5 and later): left null where absent; its users check.
  api.gemm_grouped_batched_ex = reinterpret_cast<decltype(api.gemm_grouped_batched_ex)>(
      dlsym(lib, "cublasGemmGroupedBatchedEx"));
  return api;  // the library stays loaded for the life of the process
}

}  // namespace

absl::StatusOr<const CublasApi*> LoadCublas() {
  static const absl::StatusOr<CublasApi>* api = new absl::StatusOr<CublasApi>(Load());
  if (!api->ok()) return api->status();
  return &**api;
}

}  // namespace dxs
