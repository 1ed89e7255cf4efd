#include "router/control_plane/nccl_unique_id.h"

#include <dlfcn.h>

#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/mutex.h"
#include "common/tunables.h"

namespace dxs {
namespace {

struct NcclApi {
  int (*get_unique_id)(void* id) = nullptr;  // ncclResult_t ncclGetUniqueId(ncclUniqueId*)
  const char* (*error_string)(int result) = nullptr;
};

// Loaded once; the library stays loaded (its bootstrap threads live in it).
absl::StatusOr<NcclApi> LoadNccl() {
  static absl::Mutex mu(absl::kConstInit);
  static NcclApi* api = nullptr;
  absl::MutexLock lock(&mu);
  if (api != nullptr) return *api;
  std::vector<std::string> candidates;
  if (std::string path = tunables::Get(tunables::kNcclLibrary); !path.empty()) {
    candidates.push_back(std::move(path));
  } else {
    candidates = {"libnccl.so.2", "/usr/local/cuda/lib64/libnccl.so.2"};
  }
  std::vector<std::string> errors;
  for (const std::string& candidate : candidates) {
    void* handle = dlopen(candidate.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (handle == nullptr) {
      const char* why = dlerror();
      errors.push_back(why != nullptr ? why : candidate);
      continue;
    }
    NcclApi loaded;
    loaded.get_unique_id = reinterpret_cast<int (*)(void*)>(dlsym(handle, "ncclGetUniqueId"));
    loaded.error_string =
        reinterpret_cast<const char* (*)(int)>(dlsym(handle, "ncclGetErrorString"));
    if (loaded.get_unique_id == nullptr || loaded.error_string == nullptr) {
      errors.push_back(absl::StrCat(candidate, ": no ncclGetUniqueId"));
      dlclose(handle);
      continue;
    }
    api = new NcclApi(loaded);
    return *api;
  }
  return absl::FailedPreconditionError(
      absl::StrCat("the nccl transport needs NCCL in the router (set DXS_NCCL_LIBRARY): ",
                   absl::StrJoin(errors, "; ")));
}

}  // namespace

absl::Status CheckNcclLoads() { return LoadNccl().status(); }

absl::StatusOr<std::string> NewNcclUniqueId() {
  absl::StatusOr<NcclApi> api = LoadNccl();
  if (!api.ok()) return api.status();
  std::string id(kNcclUniqueIdBytes, '\0');
  if (const int result = api->get_unique_id(id.data()); result != 0) {
    return absl::InternalError(
        absl::StrCat("ncclGetUniqueId: ", api->error_string(result), " (", result, ")"));
  }
  return id;
}

}  // namespace dxs
