// The parts of worker_transport.h that make nothing (the flag's check, the members of a
// view's communicator), in a library of their own: `dxs up` checks its --transport with
// them and links no transport.
#include <algorithm>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "dataplane/transport/transport_table.h"
#include "kernels/make_backend.h"
#include "worker/worker_transport.h"  // IWYU pragma: associated

namespace dxs {

absl::Status ValidateWorkerTransport(const std::string& transport, const std::string& device) {
  const TransportSpec* spec = FindTransport(transport);
  if (spec == nullptr || !spec->Has(kWorkers)) {
    return absl::InvalidArgumentError(
        absl::StrCat("--transport must be ", TransportNames(kWorkers), ", got '", transport, "'"));
  }
  DXS_ASSIGN_OR_RETURN(const int ordinal, DeviceOrdinal(device));
  if (spec->Has(kGpuMemoryOnly) && ordinal < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("--transport ", spec->name,
                     " moves GPU memory: it needs --device cuda or cuda:N, not --device ", device));
  }
  return absl::OkStatus();
}

std::vector<int> NcclMembers(const v1::ClusterView& view) {
  std::vector<int> members;
  for (const v1::WorkerInfo& w : view.workers()) {
    if (w.state() != v1::WORKER_STATE_DEAD) members.push_back(static_cast<int>(w.transport_rank()));
  }
  std::sort(members.begin(), members.end());
  members.erase(std::unique(members.begin(), members.end()), members.end());
  return members;
}

}  // namespace dxs
