// The nccl transport: the DataExchange (data_exchange.h) over one NCCL communicator that
// spans the cluster's transport world (attention ranks, then expert ranks; one rank per
// GPU), for device memory; the message API (the control channel) is another Transport's
// (ucx), which this one wraps and forwards to.
//
// This is the high-throughput mode of the NCCL issue: the engine sends the counts on the
// control channel first, then both sides post their exact-size sends and receives as one
// group (ncclGroupStart, one ncclSend/ncclRecv per entry, zero counts included, since an
// unmatched zero-count send can hang the next matched pair; ncclGroupEnd), and an event
// recorded on the transport's stream after the group marks its completion.
//
// How it keeps the DataExchange contract, and where NCCL makes it narrower:
// - Communicators are non-blocking (ncclConfig_t.blocking = 0). Init, each group and each
//   wait poll ncclCommGetAsyncError against a deadline; nothing waits inside NCCL.
// - A watchdog per wait: at the deadline, or on an asynchronous NCCL error, the
//   communicator is aborted (ncclCommAbort) and every group in flight and every later one
//   fails (DEADLINE_EXCEEDED for the one that timed out, UNAVAILABLE for the rest) until
//   Init makes a new communicator: what the cluster does when a worker registers again.
//   A peer that dies therefore shows as the watchdog's deadline (the caller's: the engine
//   uses seconds), not as a hang.
// - Matching: NCCL matches a pair's sends and receives in posting order, with no tags. The
//   contract's per-tag order holds when both sides post their groups in the same order,
//   which the step engine does (one exchange per layer and direction, in layer order).
// - Sizes are not checked: NCCL has no way to notice a receive larger or smaller than the
//   matching send. The counts that size both sides come from the control channel, so
//   they agree by construction; a mismatch is undefined here, where ucx reports INTERNAL.
// - Only device memory: SupportsMemory(kHost) is false, and a host entry is refused with
//   UNIMPLEMENTED (the engine stages through device buffers, as it stages the other way
//   for ucx without CUDA).
//
// The unique id: every rank passes the same bytes to InitMembers. In a cluster the router
// makes them (router/control_plane/nccl_unique_id.h, NCCL's ncclGetUniqueId, which needs
// no GPU) and publishes them in ClusterView.transport.nccl_unique_id, a new id for every
// new set of live workers; each worker started with --transport nccl registers its
// NcclPeerInfo and makes the communicator over the view's live workers for each new id
// (worker/worker_transport.h, WorkerRuntime::ApplyPendingView). In the tests the caller
// carries an id from NcclUniqueId below.
//
// This library links the CUDA runtime and NCCL, so the services load it as a plugin,
// libdxs_nccl.so (nccl_plugin.cc), as kernels/make_backend.cc loads the CUDA backend, to
// keep CUDA's thread-local storage off civetweb's fixed worker stacks; tests link it.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "dataplane/transport/transport.h"

namespace dxs {

struct NcclTransportOptions {
  int device = 0;  // the GPU this rank drives
  // How long Init waits for every rank to join the communicator.
  absl::Duration init_timeout = absl::Seconds(30);
};

// A new unique id (NCCL_UNIQUE_ID_BYTES bytes) for rank 0 to hand to every rank.
// FAILED_PRECONDITION without a usable GPU or NCCL.
absl::StatusOr<std::string> NcclUniqueId();

class NcclTransport : public Transport {
 public:
  // (Re)makes the communicator over `members`, the transport ranks of the live workers in
  // ascending order (a dead rank leaves a gap: the communicator's ranks are dense, the
  // transport's are not), `self` among them, from the unique id every member got. A
  // transfer's peer is a transport rank; one outside `members` is INVALID_ARGUMENT.
  // Groups of an earlier communicator must have been waited for. INVALID_ARGUMENT for
  // members not ascending, `self` not among them or an id of the wrong size; UNAVAILABLE
  // if the members do not all join before the timeout (the attempt is aborted).
  virtual absl::Status InitMembers(const std::vector<int>& members, int self,
                                   const std::string& unique_id) = 0;
  // InitMembers over the transport ranks 0..world_size-1.
  absl::Status Init(int world_size, int rank, const std::string& unique_id) {
    std::vector<int> members(world_size > 0 ? static_cast<size_t>(world_size) : 0);
    for (int i = 0; i < world_size; ++i) members[static_cast<size_t>(i)] = i;
    return InitMembers(members, rank, unique_id);
  }
  // Whether a communicator is up (Init succeeded and nothing aborted it since).
  virtual bool Healthy() const = 0;
  // The PCI bus id of the GPU this rank drives ("0000:3b:00.0"), for the registration's
  // NcclPeerInfo; empty if CUDA does not say.
  virtual std::string DeviceBusId() const = 0;
};

// The nccl transport over `control` (the message API's transport). FAILED_PRECONDITION
// naming the reason when there is no usable GPU.
absl::StatusOr<std::unique_ptr<NcclTransport>> MakeNcclTransport(
    std::unique_ptr<Transport> control, const NcclTransportOptions& options);

}  // namespace dxs
