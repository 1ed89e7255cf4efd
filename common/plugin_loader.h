// The shared libraries dxs loads at run time rather than links: the CUDA backend
// (libdxs_cuda.so, for --device cuda) and the nccl transport (libdxs_nccl.so, for
// --transport nccl). Both link the CUDA runtime statically, which the services must not
// (kernels/cuda/CMakeLists.txt says why), and machines without a GPU never load them.
#pragma once

#include <string>

#include "absl/status/statusor.h"
#include "common/tunables.h"

namespace dxs {

// The directory of the running executable (/proc/self/exe), or "." if it cannot be read:
// where the plugins and the service binaries sit beside `dxs`.
std::string ExecutableDir();

// `symbol` of the plugin `file_name`: the path that the tunable `path_override` holds if it
// is set (DXS_CUDA_PLUGIN, DXS_NCCL_PLUGIN), else `file_name` beside the running executable. Each
// path is opened once (RTLD_NOW | RTLD_LOCAL) and never closed: the plugin's code runs until the
// process ends. FAILED_PRECONDITION when the file does not load ("<flag>: cannot load <what>
// <path>: <the loader's reason>") or lacks the symbol ("<flag>: <path> has no <symbol>").
absl::StatusOr<void*> LoadPluginSymbol(const std::string& file_name,
                                       const tunables::Tunable& path_override, const char* symbol,
                                       const std::string& flag, const std::string& what);

}  // namespace dxs
