#include "common/plugin_loader.h"

#include <dlfcn.h>

#include <filesystem>
#include <map>
#include <mutex>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"

namespace dxs {

std::string ExecutableDir() {
  std::error_code ec;
  const std::filesystem::path self = std::filesystem::read_symlink("/proc/self/exe", ec);
  return ec ? "." : self.parent_path().string();
}

absl::StatusOr<void*> LoadPluginSymbol(const std::string& file_name,
                                       const tunables::Tunable& path_override, const char* symbol,
                                       const std::string& flag, const std::string& what) {
  DXS_ASSIGN_OR_RETURN(std::string path, tunables::Read(path_override));
  if (path.empty()) {
    const std::string dir = ExecutableDir();
    path = absl::StrCat(dir, dir.back() == '/' ? "" : "/", file_name);
  }
  // dlopen's own count would do, but a failed open is remembered too: its reason stays.
  static std::mutex mu;
  static auto* opened = new std::map<std::string, absl::StatusOr<void*>>();
  std::lock_guard<std::mutex> lock(mu);
  auto it = opened->find(path);
  if (it == opened->end()) {
    void* lib = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
    const char* why = lib == nullptr ? dlerror() : nullptr;
    it = opened
             ->emplace(path, lib != nullptr ? absl::StatusOr<void*>(lib)
                                            : absl::FailedPreconditionError(absl::StrCat(
                                                  flag, ": cannot load ", what, " ", path, ": ",
                                                  why != nullptr ? why : "unknown error")))
             .first;
  }
  if (!it->second.ok()) return it->second.status();
  void* fn = dlsym(*it->second, symbol);
  if (fn == nullptr) {
    return absl::FailedPreconditionError(absl::StrCat(flag, ": ", path, " has no ", symbol));
  }
  return fn;
}

}  // namespace dxs
