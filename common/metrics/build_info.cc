#include "common/metrics/build_info.h"

#include <string>

#include "common/metrics/families.h"

#ifndef DXS_VERSION_STRING
#define DXS_VERSION_STRING "unknown"
#endif
#ifndef DXS_GIT_COMMIT
#define DXS_GIT_COMMIT "unknown"
#endif

namespace dxs::metrics {

std::string_view BuildVersion() { return DXS_VERSION_STRING; }
std::string_view BuildGitCommit() { return DXS_GIT_COMMIT; }

absl::Status RegisterBuildInfo(prometheus::Registry* registry, std::string_view role) {
  absl::StatusOr<GaugeFamily*> family =
      AddGauge(registry, "dxs_build_info", "Build of this dxs process; the value is always 1.");
  if (!family.ok()) return family.status();
  (*family)
      ->Add({{"version", std::string(BuildVersion())},
             {"git_commit", std::string(BuildGitCommit())},
             {"role", std::string(role)}})
      .Set(1);
  return absl::OkStatus();
}

}  // namespace dxs::metrics
