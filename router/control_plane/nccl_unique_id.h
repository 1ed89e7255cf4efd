// The router's source of NCCL unique ids (ClusterView.transport.nccl_unique_id): NCCL's own
// ncclGetUniqueId, loaded at run time so that the router links no GPU library and runs
// where NCCL is absent unless asked for the nccl transport. ncclGetUniqueId needs no GPU:
// it opens the bootstrap root's socket in the calling process (the router, which outlives
// every communicator it names) and describes it in the id's 128 bytes.
#pragma once

#include <string>

#include "absl/status/statusor.h"

namespace dxs {

inline constexpr size_t kNcclUniqueIdBytes = 128;  // NCCL_UNIQUE_ID_BYTES

// A new id. NCCL comes from $DXS_NCCL_LIBRARY if set, else libnccl.so.2 on the loader's
// path, else the CUDA toolkit's (/usr/local/cuda/lib64). FAILED_PRECONDITION naming what
// could not be loaded; INTERNAL with NCCL's message if it fails.
absl::StatusOr<std::string> NewNcclUniqueId();

// Whether NewNcclUniqueId can load NCCL (the router checks at start, before any id).
absl::Status CheckNcclLoads();

}  // namespace dxs
