// DataExchange: the data part of a Transport. Pre-sized sends and receives on memory-typed
// buffers, posted as one group and completed together: the shape NCCL needs (ncclGroupStart,
// ncclSend/ncclRecv of known counts, ncclGroupEnd), which every backend implements. The
// message API of Transport (transport.h) stays the control channel: step headers and the
// counts that size these transfers travel there first.
//
// A backend is this op table (three calls and a query, like NCCL's ncclTransport struct of
// operations) on the Transport object that already holds its peers, connections and
// failure state; a new backend is one file. NCCL's would be: PostExchange = ncclGroupStart,
// one ncclSend/ncclRecv per entry (zero counts included), ncclGroupEnd, an event recorded
// on the stream; ExchangeDone = the event's query plus ncclCommGetAsyncError; WaitExchange
// = polling those until the deadline, then ncclCommAbort. (NCCL has no control channel:
// that Transport would forward the message API to a ucx one.)
//
// Matching: between two peers, the k-th send from A to B under `tag` matches the k-th
// receive on B from A under `tag`, counted over groups in posting order, whichever side
// posts first. Receives match exactly one source. Sizes must agree; a mismatch fails the
// receiving group with INTERNAL (the sending group may complete or fail too, per backend).
// Zero-byte entries are real transfers: each matches a zero-byte entry on the other side
// and completes like any other (NCCL needs both sides to post them).
//
// Groups: several may be in flight at once (different tags, or the same tag in posting
// order) and may be waited for in any order. No transfer of a group relies on the peer's
// receive being posted first: both sides may post all their sends before their receives,
// at any size (backends do not depend on buffering sends).
//
// Failure: a group fails as a whole. WaitExchange returns UNAVAILABLE naming the peer when
// a transfer's peer failed (fault detection is the Transport's: a disconnect at once, a
// dead process within a few seconds), DEADLINE_EXCEEDED at the deadline; the rest of the
// group is then cancelled and, once WaitExchange returned, no transfer of the group writes
// memory any more. Sends, which only read, may not be withdrawable (UCX cannot cancel a
// send the peer has not matched): their buffers may still be read until the peer fails, is
// disconnected or reconnected, or the transport is destroyed. After a failed group, the
// matching count with its peers under that tag is undefined: callers abandon the tag (the
// engine fails the step and resets the peers), as with ncclCommAbort.
//
// Completion is per group: a group is done when all its transfers are, and nothing reports
// one transfer alone. WaitExchange polls briefly, then sleeps until progress, a peer's
// failure or the deadline (no spinning); like Recv, Wake() does not cut it short.
//
// Thread safety: like the rest of Transport, one thread (the step thread) makes every call;
// each peer calls from its own thread, in any order relative to the others. Memory must
// stay valid, and receive buffers untouched, from PostExchange until WaitExchange returns.
//
// Mapped regions (DeepEP's registered buffers, on the host): MapRegion gives memory that a
// peer on the same host maps into its own address space (AttachPeerRegion, given the
// region's key out of band) and loads from and stores into directly: one copy through
// memory where a transfer makes two (into a shared-memory FIFO and out of it). The
// transport orders nothing there: writes into a peer's region are published by a message
// or transfer sent after them (x86 stores are seen in order, and the transport's channels
// are themselves shared memory), and the owner reads them only after receiving it.
// CanAttachPeerRegions(peer) says whether the peer's regions would map here; symmetric,
// so the owner asks it before handing a key out. A region stays mapped in the peers that
// attached it after UnmapRegion (their writes then land nowhere its owner reads) until
// they detach: on Connect or Disconnect of that peer, or when the transport goes.
//
// Memory types: kHost is any host pointer. kDevice is GPU memory, passed to the backend as
// such (UCX: UCS_MEMORY_TYPE_CUDA); a backend that cannot move it says so in
// SupportsMemory and refuses the group at PostExchange with UNIMPLEMENTED.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/time/time.h"

namespace dxs {

enum class MemoryType : uint8_t { kHost, kDevice };

// One entry of a group: send `bytes` from `data` to `peer`, or receive exactly `bytes` from
// `peer` into `data`. `data` may be null when `bytes` is 0.
// A region of this process's memory that peers map (MapRegion); `key` names it to them.
struct MappedRegion {
  void* data = nullptr;
  size_t bytes = 0;
  std::string key;
};

// A peer's region, mapped into this process (AttachPeerRegion).
struct PeerRegion {
  void* data = nullptr;
  size_t bytes = 0;
};

struct Transfer {
  enum class Kind : uint8_t { kSend, kRecv };
  Kind kind = Kind::kSend;
  int peer = -1;
  void* data = nullptr;
  size_t bytes = 0;
  MemoryType memory = MemoryType::kHost;
};

using ExchangeId = uint64_t;

// Tags are caller-chosen and below 2^kExchangeTagBits; backends use the bits above for the
// source rank (UCX) or keep them free.
inline constexpr int kExchangeTagBits = 48;
inline constexpr uint64_t kMaxExchangeTag = (uint64_t{1} << kExchangeTagBits) - 1;

// The DEADLINE_EXCEEDED every backend reports for a group still pending: which of its
// transfers were not done. `ops` are a backend's entries, each with `done` and `transfer`.
template <typename Ops>
absl::Status ExchangeDeadlineError(uint64_t tag, const Ops& ops, size_t num_pending) {
  std::string pending;
  for (const auto& op : ops) {
    if (op.done) continue;
    absl::StrAppend(&pending, pending.empty() ? "" : ", ",
                    op.transfer.kind == Transfer::Kind::kSend ? "send to " : "receive from ",
                    op.transfer.peer);
  }
  return absl::DeadlineExceededError(
      absl::StrCat("exchange tag ", tag, ": ", num_pending, " of ", ops.size(),
                   " transfers not done at the deadline (", pending, ")"));
}

class DataExchange {
 public:
  virtual ~DataExchange() = default;

  // Posts every transfer as one group and returns at once. Fails without posting anything
  // on bad arguments (INVALID_ARGUMENT: tag above kMaxExchangeTag, bad peer, null data
  // with bytes > 0), an unsupported memory type (UNIMPLEMENTED), a peer never connected
  // (FAILED_PRECONDITION) or one already failed (UNAVAILABLE). An empty group is valid and
  // done at once.
  virtual absl::StatusOr<ExchangeId> PostExchange(uint64_t tag, const Transfer* transfers,
                                                  size_t num_transfers) = 0;
  // Returns when every transfer of the group completed: OK; UNAVAILABLE naming the peer if
  // one failed; INTERNAL on a size mismatch; DEADLINE_EXCEEDED at the deadline. On error
  // the group is cancelled first (see Failure above). The id is forgotten afterwards
  // (NOT_FOUND for an id not, or no longer, known).
  virtual absl::Status WaitExchange(ExchangeId id, absl::Time deadline) = 0;
  // WaitExchange that, on success, also gives when each transfer of the group completed
  // ((*done)[i] for the group's transfer i, steady-clock nanoseconds since its epoch, as the
  // caller's progress saw it): where the time goes within one group, e.g. which peer
  // answered last (the attention side's per-EP-rank answer times, dxs_ep_answer_seconds).
  // The default knows no more than the group's end: every entry is the moment the wait
  // returned.
  virtual absl::Status WaitExchangeTimed(ExchangeId id, absl::Time deadline,
                                         std::vector<int64_t>* done, size_t num_transfers) {
    absl::Status s = WaitExchange(id, deadline);
    if (s.ok() && done != nullptr) {
      done->assign(num_transfers, std::chrono::duration_cast<std::chrono::nanoseconds>(
                                      std::chrono::steady_clock::now().time_since_epoch())
                                      .count());
    }
    return s;
  }
  // Makes progress without blocking; true once WaitExchange(id) would return at once.
  virtual bool ExchangeDone(ExchangeId id) = 0;
  // Whether transfers of this memory type can be posted (callers stage device memory
  // through host buffers when not).
  virtual bool SupportsMemory(MemoryType memory) const { return memory == MemoryType::kHost; }

  // ---- Mapped regions (see above) ----
  // At least `bytes` bytes of zeroed host memory that peers may map, page aligned.
  // UNIMPLEMENTED where the backend maps nothing; RESOURCE_EXHAUSTED where the memory
  // cannot be had.
  virtual absl::StatusOr<MappedRegion> MapRegion(size_t bytes) {
    return absl::UnimplementedError("this transport maps no memory for its peers");
  }
  // Gives back a region of MapRegion (by its data pointer); unknown pointers are ignored.
  virtual void UnmapRegion(void* data) {}
  // Whether regions of `peer` can be mapped here (and this transport's there): peers of
  // one host that share memory.
  virtual bool CanAttachPeerRegions(int peer) { return false; }
  // `peer`'s region named `key`, mapped here; repeated calls with one key return the same
  // mapping. Valid until `peer` is connected again or disconnected, or the transport goes.
  // INVALID_ARGUMENT for a key that names no region of that peer; UNIMPLEMENTED where the
  // peer's memory cannot be mapped from here; UNAVAILABLE if the peer has failed.
  virtual absl::StatusOr<PeerRegion> AttachPeerRegion(int peer, std::string_view key) {
    return absl::UnimplementedError("this transport maps no peer memory");
  }
};

}  // namespace dxs
