// Transport: how dispatch and combine bytes move between attention and expert workers.
//
// Two parts on one object, sharing its peers, connections and failure state: the message
// API below, the control channel (step headers, counts, lockstep), and the DataExchange
// (data_exchange.h): pre-sized sends and receives posted as one group, which carries the
// rows themselves once the counts are known.
//
// Peers are numbered in the cluster's transport world (WorkerInfo.transport_rank, assigned
// by the router: attention ranks first, then expert ranks). A message is a small header
// (the engine's step/layer/kind and counts) plus a payload; either may be empty, and
// zero-size messages are sent like any other.
//
// Ordering: messages from one peer are delivered in the order they were sent (the engine
// keeps at most one message per (peer, kind) in flight, so this holds for every backend).
//
// Blocking: nothing spins (UCX: a spin of tens of microseconds, then ucp_worker_arm + the
// worker's event fd). Recv sleeps until a message arrives, the peer fails, or the
// deadline passes; WaitForActivity also returns on Wake().
//
// Faults: a peer whose connection fails is marked failed; Send/Recv to it return
// UNAVAILABLE naming the peer, at once, until Connect() is called for it again.
//
// Rows: the rows themselves travel on the DataExchange, into and out of buffers the
// engine sized from the counts (its input tensor, say), so neither side copies them
// through a transport buffer. The message API carries control messages and small
// payloads, each received into a buffer the transport owns; SendV gathers a payload from
// several segments without packing it first.
//
// Identity: a UCX receiver learns who sent a message from the message itself, so each
// transport must know its own transport rank (SetSelf) before its first Send.
//
// Thread safety: one thread (the step thread) calls everything, the DataExchange included,
// but Wake(), which any thread may call.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "dataplane/transport/data_exchange.h"

namespace dxs {

// An allocator whose resize() leaves new elements uninitialised: receive buffers are
// overwritten at once, and zero-filling megabytes per message costs a full extra pass.
template <typename T>
struct DefaultInitAllocator : std::allocator<T> {
  template <typename U>
  struct rebind {
    using other = DefaultInitAllocator<U>;
  };
  using std::allocator<T>::allocator;
  template <typename U>
  void construct(U* p) noexcept(std::is_nothrow_default_constructible<U>::value) {
    ::new (static_cast<void*>(p)) U;
  }
  template <typename U, typename... Args>
  void construct(U* p, Args&&... args) {
    ::new (static_cast<void*>(p)) U(std::forward<Args>(args)...);
  }
};
using PayloadBytes = std::vector<uint8_t, DefaultInitAllocator<uint8_t>>;

// A payload as a plain byte vector (tests compare payloads with expected bytes).
inline std::vector<uint8_t> AsVector(const PayloadBytes& p) { return {p.begin(), p.end()}; }

// `bytes` bytes at `data`: one piece of a payload that is sent.
struct PayloadSegment {
  const void* data = nullptr;
  size_t bytes = 0;
};

struct TransportMessage {
  std::string header;
  PayloadBytes payload;
  size_t payload_size() const { return payload.size(); }
};

class Transport : public DataExchange {
 public:
  virtual ~Transport() = default;
  virtual std::string name() const = 0;  // its row of transports.def: "ucx", "nccl", ...
  // This endpoint's address, published through the router (opaque bytes).
  virtual std::string LocalAddress() const = 0;
  // Sets this endpoint's own transport rank, carried in every message it sends. Required
  // by backends that cannot infer it (ucx); others check it matches or ignore it.
  virtual absl::Status SetSelf(int peer) { return absl::OkStatus(); }

  // Connects to `peer` at `address` (another transport's LocalAddress()); replaces any
  // previous connection to that peer and clears its failed state.
  virtual absl::Status Connect(int peer, const std::string& address) = 0;
  virtual void Disconnect(int peer) = 0;

  // Sends header + payload (each may be empty) to `peer`; the payload is the
  // concatenation of `num_segments` segments (empty ones are allowed). When it returns,
  // the buffers may be reused. UNAVAILABLE if the peer has failed.
  virtual absl::Status SendV(int peer, std::string_view header, const PayloadSegment* segments,
                             size_t num_segments) = 0;
  // SendV of one segment.
  absl::Status Send(int peer, std::string_view header, const void* payload, size_t payload_bytes) {
    const PayloadSegment segment = {payload, payload_bytes};
    return SendV(peer, header, &segment, 1);
  }
  // The next message from `peer`. DEADLINE_EXCEEDED at the deadline; UNAVAILABLE if the
  // peer fails first (messages that arrived before the failure are still returned first).
  // Wake() does not interrupt it: a step waiting for its peers must not be cut short by
  // new work arriving.
  virtual absl::StatusOr<TransportMessage> Recv(int peer, absl::Time deadline) = 0;
  // True if a message from `peer` is queued (after making progress, without blocking).
  virtual bool HasMessage(int peer) = 0;
  // Sleeps until any message is queued, a peer fails, Wake() is called, or the deadline.
  // Returns OK in all those cases; callers then check HasMessage / their own state.
  virtual absl::Status WaitForActivity(absl::Time deadline) = 0;
  // Interrupts WaitForActivity in the step thread. Thread-safe. A Wake() that comes
  // while nothing waits is kept, and ends the next WaitForActivity at once.
  virtual void Wake() = 0;
  // OK, or UNAVAILABLE if the connection to `peer` failed.
  virtual absl::Status PeerStatus(int peer) = 0;
  // From any thread: the control plane's view says `peer` is dead (`reason`), or, with an
  // empty reason, that it is not. While a peer is declared dead, an exchange waiting on a
  // transfer with it and a Recv from it fail with UNAVAILABLE at once instead of at their
  // deadlines: a partitioned or frozen peer closes no connection, so nothing else ends
  // those waits before the step timeout. The connection itself is left as it is (a peer
  // that comes back on it is used again once declared live). Default: ignored.
  virtual void SetPeerDeclaredDead(int peer, std::string reason) {}
  // Whether `peer` is declared dead just now (SetPeerDeclaredDead). Any thread.
  virtual bool PeerDeclaredDead(int peer) const { return false; }
};

// UCP active messages (control) and tagged sends/receives (data exchange); addresses
// exchanged out of band (through the router). UCX 1.22 (the libucx-cu13 wheel): shared
// memory between processes of one host, with peer error handling, and GPU memory through
// cuda_ipc where UCX's CUDA module loads (SupportsMemory(kDevice) says whether it did).
struct UcxTransportOptions {
  // Keep shared memory with peer error handling: sets UCX_POSIX_ERROR_HANDLING=y and
  // UCX_SYSV_ERROR_HANDLING=y unless already set. Without them UCX (1.13 and 1.22 alike)
  // gives endpoints with peer error handling no shared-memory transport ("no peer failure
  // handler"), and everything between processes of one host goes over TCP, which makes a
  // large dispatch round trip several times slower than over shared memory.
  bool keep_shared_memory = true;
  // Tagged sends of host memory also go on the peer's data endpoint (ucx_transport.cc: the
  // endpoint without error handling that carries GPU memory), so that tests exercise it on
  // machines without a GPU.
  bool host_sends_on_data_endpoint = false;
};
absl::StatusOr<std::unique_ptr<Transport>> MakeUcxTransport(
    const UcxTransportOptions& options = {});

// A group of in-process transports for unit tests: element i is peer i; addresses are
// ignored and every pair is connected from the start.
std::vector<std::unique_ptr<Transport>> MakeInprocTransportGroup(int num_peers);

}  // namespace dxs
