// dxs_build_info: the usual Prometheus "info" gauge, always 1, whose labels say what is
// running, so dashboards can join on it and alerts can spot mixed versions:
//
//   dxs_build_info{version="0.1.0",git_commit="d865c07ab12f",role="router"} 1
//
// version is the CMake project version; git_commit the commit at configure time (or
// -DDXS_GIT_COMMIT=...), "unknown" when the build had neither.
#pragma once

#include <string_view>

#include "absl/status/status.h"
#include "prometheus/registry.h"

namespace dxs::metrics {

// Registers dxs_build_info{version, git_commit, role} and sets it to 1. Safe to call more
// than once (for the same or another role).
absl::Status RegisterBuildInfo(prometheus::Registry* registry, std::string_view role);

std::string_view BuildVersion();
std::string_view BuildGitCommit();

}  // namespace dxs::metrics
