#include "kernels/cuda/cublas_loader.h"

#include <dlfcn.h>

#include <string>

#include "absl/strings/str_cat.h"

namespace dxs {
namespace {

// Resolves symbols of one library, remembering the first that is missing.
struct Resolver {
  void* lib = nullptr;
  std::string missing;
  template <typename Fn>
  void operator()(Fn* slot, const char* symbol) {
    *slot = reinterpret_cast<Fn>(dlsym(lib, symbol));
    if (*slot == nullptr && missing.empty()) missing = symbol;
  }
};

absl::StatusOr<void*> Open(const std::string& name, const char* what) {
  void* lib = dlopen(name.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (lib == nullptr) {
    return absl::FailedPreconditionError(
        absl::StrCat("cannot load ", what, " (", name, "): ", dlerror()));
  }
  return lib;
}

absl::StatusOr<CublasApi> Load() {
  const std::string name = absl::StrCat("libcublas.so.", CUBLAS_VER_MAJOR);
  absl::StatusOr<void*> lib = Open(name, "cuBLAS");
  if (!lib.ok()) return lib.status();
  CublasApi api;
  Resolver resolve{*lib, {}};
  resolve(&api.create, "cublasCreate_v2");
  resolve(&api.destroy, "cublasDestroy_v2");
  resolve(&api.set_stream, "cublasSetStream_v2");
  resolve(&api.set_workspace, "cublasSetWorkspace_v2");
  resolve(&api.set_math_mode, "cublasSetMathMode");
  resolve(&api.gemm_ex, "cublasGemmEx");
  resolve(&api.status_name, "cublasGetStatusName");
  resolve(&api.status_string, "cublasGetStatusString");
  if (!resolve.missing.empty()) {
    return absl::FailedPreconditionError(absl::StrCat(name, " has no ", resolve.missing));
  }
  // Optional (cuBLAS 12.5 and later): left null where absent; its users check.
  api.gemm_grouped_batched_ex = reinterpret_cast<decltype(api.gemm_grouped_batched_ex)>(
      dlsym(*lib, "cublasGemmGroupedBatchedEx"));
  return api;  // the library stays loaded for the life of the process
}

absl::StatusOr<CublasLtApi> LoadLt() {
  const std::string name = absl::StrCat("libcublasLt.so.", CUBLAS_VER_MAJOR);
  absl::StatusOr<void*> lib = Open(name, "cuBLASLt");
  if (!lib.ok()) return lib.status();
  CublasLtApi api;
  Resolver resolve{*lib, {}};
  resolve(&api.create, "cublasLtCreate");
  resolve(&api.destroy, "cublasLtDestroy");
  resolve(&api.desc_create, "cublasLtMatmulDescCreate");
  resolve(&api.desc_destroy, "cublasLtMatmulDescDestroy");
  resolve(&api.desc_set, "cublasLtMatmulDescSetAttribute");
  resolve(&api.layout_create, "cublasLtMatrixLayoutCreate");
  resolve(&api.layout_destroy, "cublasLtMatrixLayoutDestroy");
  resolve(&api.layout_set, "cublasLtMatrixLayoutSetAttribute");
  resolve(&api.pref_create, "cublasLtMatmulPreferenceCreate");
  resolve(&api.pref_destroy, "cublasLtMatmulPreferenceDestroy");
  resolve(&api.pref_set, "cublasLtMatmulPreferenceSetAttribute");
  resolve(&api.heuristic, "cublasLtMatmulAlgoGetHeuristic");
  resolve(&api.matmul, "cublasLtMatmul");
  resolve(&api.version, "cublasLtGetVersion");
  if (!resolve.missing.empty()) {
    return absl::FailedPreconditionError(absl::StrCat(name, " has no ", resolve.missing));
  }
  return api;
}

}  // namespace

absl::StatusOr<const CublasApi*> LoadCublas() {
  static const absl::StatusOr<CublasApi>* api = new absl::StatusOr<CublasApi>(Load());
  if (!api->ok()) return api->status();
  return &**api;
}

absl::StatusOr<const CublasLtApi*> LoadCublasLt() {
  static const absl::StatusOr<CublasLtApi>* api = new absl::StatusOr<CublasLtApi>(LoadLt());
  if (!api->ok()) return api->status();
  return &**api;
}

}  // namespace dxs
