// UCX backend of Transport: UCP active messages on one worker.
//
// Wire format: every message is one active message (id kAmId). Its UCP header is a
// WireHeader (magic, sender rank, flags, user header length) followed by the user header;
// the payload is the AM data. When the two headers together exceed the worker's maximum
// AM header size, the user header travels in front of the payload instead
// (kFlagHeaderInData). Payloads of several segments go out as one IOV (with the user header
// as its first element when it travels in the data), so nothing is copied on the send side.
//
// Receiving: the AM callback runs inside ucp_worker_progress on the step thread. The
// payload goes to a buffer of the Inbound: eager data is copied there at once; for
// rendezvous the Inbound is queued first (so it keeps its place in the sender's FIFO) and
// filled by ucp_am_recv_data_nbx. Recv hands out the front Inbound of a peer only once it
// is complete.
//
// Ordering: UCP delivers one endpoint's active messages in send order (a single AM lane,
// and Send does not return before the message left, or for rendezvous was fetched), and
// an Inbound's queue position is fixed when its callback runs, so FIFO per peer holds.
//
// Blocking: WaitUntil spins on progress briefly, yielding the core on each turn, then
// ucp_worker_arm + epoll_wait on the worker's event fd. Sleeps are capped at kMaxSleep so
// UCP's keepalive (which runs from progress) notices peers that die without closing a
// socket, e.g. over shared memory.
//
// Faults: endpoints use UCP_ERR_HANDLING_MODE_PEER; the error callback marks the peer
// failed and records a failure event for WaitForActivity.
//
// Device memory: tagged sends of GPU memory go on a second endpoint to the peer, its data
// endpoint, made at the first such send with UCP_ERR_HANDLING_MODE_NONE. An endpoint with
// peer error handling gets shared memory only while UCX_POSIX/SYSV_ERROR_HANDLING are on
// (UcxTransportOptions::keep_shared_memory); without them it gets TCP alone, and UCX 1.22
// then hands GPU buffers to TCP (send() fails with EIO, seen on the H200 machine) instead
// of using cuda_ipc. Without error handling UCX picks shared memory for its messages and
// cuda_ipc for the rows whatever those switches say. Faults are still seen: the peer's first
// endpoint keeps peer error handling (keepalive), its failure fails the groups of both,
// and the data endpoint is closed (forced) with it. Receives are posted on the worker, so
// the receiver does not care which endpoint a send came on; since UCP orders sends per
// endpoint, a group may not send both host and device memory to one peer.
//
// Data exchange: tagged sends and receives on the same worker and endpoints. The UCP tag is
// the source's transport rank above kExchangeTagBits and the caller's tag below, and
// receives match it exactly, so each matches one source; UCP matches one endpoint's sends
// under one tag in order against receives in posting order, which is the DataExchange
// ordering. Every operation is posted non-blocking with the buffer's memory type and
// completes through a callback into its ExchangeOp. UCP picks the protocol per size: eager
// up to 8 KiB on shared memory, rendezvous above (zero-copy where a transport has it; with
// peer error handling UCX 1.13 keeps no zero-copy shared memory transport, so there the
// rendezvous data is pipelined through sysv). An unmatched rendezvous send waits for its
// receive, so nothing relies on buffering. Receives are posted on the worker, not on an
// endpoint, so a peer's failure does not end them: WaitExchange checks the peers of pending
// transfers itself.
//
// Mapped regions: ucp_mem_map allocates them (UCP_MEM_MAP_ALLOCATE: shared memory, sysv or
// posix by UCX_ALLOC_PRIO); the key is the address, the size and the packed remote key. A
// peer unpacks that key on its endpoint to the owner and ucp_rkey_ptr maps the segment
// into its own address space; the remote keys are kept per peer (a bounded cache) and
// destroyed, unmapping the segment, when the peer's endpoint closes. An endpoint without
// a shared-memory path (another host) cannot map: ucp_rkey_ptr says UNREACHABLE, which is
// how CanAttachPeerRegions probes a peer, with a small region of its own.
//
// Cancelling: ucp_request_cancel withdraws only receives that are not matched yet. Matched
// ones finish or fail before WaitExchange returns (their peer's endpoint is closed if they
// have not within kCancelTimeout). Sends cannot be withdrawn: they keep their group alive as
// a zombie until UCP completes them, since their callbacks write into it.
#include <malloc.h>
#include <sched.h>
#include <sys/epoll.h>
#include <ucp/api/ucp.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "dataplane/transport/transport.h"
#include "dataplane/transport/transport_factory.h"

namespace dxs {
namespace {

constexpr unsigned kAmId = 0x44;
constexpr uint32_t kMagic = 0x31535844;  // "DXS1"
constexpr uint32_t kFlagHeaderInData = 1u << 0;

// Progress-only spin before sleeping: round trips over shared memory finish well inside
// it, so a ping-pong does not pay two wake-ups per message. The spin yields the core on
// every turn (measured on 2 cores, 2 attention + 2 expert ranks + router, concurrency 64:
// a busy spin cost 20% of all CPU time; yielding raised serving throughput by a quarter).
constexpr absl::Duration kSpinBeforeSleep = absl::Microseconds(50);
// Longest single sleep; bounds how late keepalive runs. See the file comment.
constexpr absl::Duration kMaxSleep = absl::Milliseconds(100);
// UCP keepalive interval unless UCX_KEEPALIVE_INTERVAL is set (UCX's default is 20 s). A
// peer that dies while a receive waits on it (over shared memory nothing else tells) is
// found at the next keepalive, so this bounds how long an attention rank's step stalls on
// a killed expert rank before the step is run again without it (EPLB's bound: at most 1 s).
// Measured on 2 cores, 1 attention + 4 expert ranks, 32 streams, kill -9 of a covered EP
// rank: the longest gap between two tokens across the kill was 0.6-1.1 s at 1 s and
// 0.19-0.22 s at 200 ms. A keepalive checks the peer's process (shared memory) or sends a
// few bytes (TCP); it never fails a slow but live peer.
constexpr const char* kKeepaliveInterval = "200ms";
// Bound on waiting for a forced endpoint close.
constexpr absl::Duration kCloseTimeout = absl::Seconds(2);
// Bound on waiting for matched receives of a cancelled exchange to finish before their
// peers' endpoints are closed to end them.
constexpr absl::Duration kCancelTimeout = absl::Seconds(2);
// How long a cancelled group waits for the matched receives of a failed peer.
constexpr absl::Duration kFailedPeerSettle = absl::Milliseconds(100);

// Exchange tags: source rank in the bits above the caller's tag.
constexpr int kMaxExchangeRank = (1 << (64 - kExchangeTagBits)) - 1;
constexpr ucp_tag_t kFullTagMask = ~ucp_tag_t{0};
ucp_tag_t ExchangeWireTag(int source, uint64_t tag) {
  return (static_cast<ucp_tag_t>(source) << kExchangeTagBits) | tag;
}
// UCP is handed this for zero-byte transfers without a buffer.
uint8_t zero_byte_buffer;

struct WireHeader {
  uint32_t magic;
  int32_t sender;
  uint32_t flags;
  uint32_t user_header_bytes;
};
static_assert(sizeof(WireHeader) == 16, "WireHeader is part of the wire format");

std::string UcsError(ucs_status_t status) { return ucs_status_string(status); }

// One received (or being received) message.
struct Inbound {
  TransportMessage message;
  bool header_in_data = false;
  size_t user_header_bytes = 0;
  bool done = false;
  ucs_status_t status = UCS_OK;
  void* request = nullptr;  // outstanding ucp_am_recv_data_nbx request
  size_t expected_bytes = 0;
};

// Marks `in` complete with `status`; splits a user header sent in front of the payload.
void CompleteInbound(Inbound* in, ucs_status_t status) {
  in->status = status;
  if (status == UCS_OK && in->header_in_data) {
    auto& payload = in->message.payload;
    in->message.header.assign(reinterpret_cast<const char*>(payload.data()), in->user_header_bytes);
    payload.erase(payload.begin(), payload.begin() + in->user_header_bytes);
  }
  in->done = true;
}

struct SendState {
  bool done = false;
  ucs_status_t status = UCS_OK;
};

class UcxTransport;
struct PeerState;
struct ExchangeGroup;

// One posted transfer of an exchange; UCP's callback completes it.
struct ExchangeOp {
  ExchangeGroup* group = nullptr;
  Transfer transfer;
  PeerState* peer_state = nullptr;  // stable: peers_ never erases
  void* request = nullptr;          // outstanding UCP request, freed by the callback
  bool done = false;
  ucs_status_t status = UCS_OK;
  ucp_tag_recv_info_t info = {};  // receives: what arrived
  bool short_message = false;     // a receive completed with fewer bytes than expected
  int64_t done_ns = 0;            // when it completed (steady clock), for WaitExchangeTimed
};

struct ExchangeGroup {
  uint64_t tag = 0;
  std::vector<ExchangeOp> ops;  // sized once: UCP holds pointers to the ops
  size_t num_pending = 0;
};

// Argument of one endpoint's error callback; lives until the endpoint's close completed.
struct EndpointContext {
  UcxTransport* transport;
  int peer;
  bool closing = false;
};

struct PeerState {
  ucp_ep_h ep = nullptr;
  std::unique_ptr<EndpointContext> ep_context;
  std::string address;         // the peer's worker address, for its data endpoint
  ucp_ep_h data_ep = nullptr;  // GPU-memory sends (error handling NONE); made on first use
  bool ever_connected = false;
  // Regions of this peer mapped here, by key (AttachPeerRegion), oldest first.
  std::vector<std::pair<std::string, std::pair<ucp_rkey_h, PeerRegion>>> attached;
  std::optional<bool> can_attach;  // CanAttachPeerRegions's answer, until the next Connect
  // Set when the connection failed or was closed by Disconnect(); cleared by Connect().
  std::string failure;
  std::deque<std::unique_ptr<Inbound>> inbox;
};

class UcxTransport final : public Transport {
 public:
  explicit UcxTransport(const UcxTransportOptions& options) : options_(options) {}
  ~UcxTransport() override;

  absl::Status Init();

  std::string name() const override { return "ucx"; }
  std::string LocalAddress() const override { return local_address_; }
  absl::Status SetSelf(int peer) override;
  absl::Status Connect(int peer, const std::string& address) override;
  void Disconnect(int peer) override;
  absl::Status SendV(int peer, std::string_view header, const PayloadSegment* segments,
                     size_t num_segments) override;
  absl::StatusOr<TransportMessage> Recv(int peer, absl::Time deadline) override;
  bool HasMessage(int peer) override;
  absl::Status WaitForActivity(absl::Time deadline) override;
  void Wake() override;
  absl::Status PeerStatus(int peer) override;
  void SetPeerDeclaredDead(int peer, std::string reason) override;
  bool PeerDeclaredDead(int peer) const override { return !DeclaredDead(peer).empty(); }

  absl::StatusOr<ExchangeId> PostExchange(uint64_t tag, const Transfer* transfers,
                                          size_t num_transfers) override;
  absl::Status WaitExchange(ExchangeId id, absl::Time deadline) override {
    return WaitExchangeTimed(id, deadline, nullptr, 0);
  }
  absl::Status WaitExchangeTimed(ExchangeId id, absl::Time deadline, std::vector<int64_t>* done,
                                 size_t num_transfers) override;
  bool ExchangeDone(ExchangeId id) override;
  bool SupportsMemory(MemoryType memory) const override {
    return memory == MemoryType::kHost || device_memory_;
  }
  absl::StatusOr<MappedRegion> MapRegion(size_t bytes) override;
  void UnmapRegion(void* data) override;
  bool CanAttachPeerRegions(int peer) override;
  absl::StatusOr<PeerRegion> AttachPeerRegion(int peer, std::string_view key) override;

 private:
  enum class WaitResult { kReady, kWoken, kDeadline, kError };

  static ucs_status_t AmCallback(void* arg, const void* header, size_t header_length, void* data,
                                 size_t length, const ucp_am_recv_param_t* param);
  static void RecvDataCallback(void* request, ucs_status_t status, size_t length, void* user_data);
  static void SendCallback(void* request, ucs_status_t status, void* user_data);
  static void ErrorCallback(void* arg, ucp_ep_h ep, ucs_status_t status);
  static void ExchangeSendCallback(void* request, ucs_status_t status, void* user_data);
  static void ExchangeRecvCallback(void* request, ucs_status_t status,
                                   const ucp_tag_recv_info_t* info, void* user_data);
  static void CompleteExchangeOp(ExchangeOp* op, ucs_status_t status);

  ucs_status_t OnActiveMessage(const void* header, size_t header_length, void* data, size_t length,
                               const ucp_am_recv_param_t* param);
  void OnEndpointError(EndpointContext* context, ucs_status_t status);

  // Progresses until idle. Returns the number of events processed.
  unsigned ProgressAll();
  // Progresses and sleeps until ready() holds, Wake() (if honor_wake), or the deadline.
  template <typename Ready>
  WaitResult WaitUntil(absl::Time deadline, bool honor_wake, Ready ready);
  // Sleeps on the worker's event fd for at most `timeout`; false on an arm/epoll error.
  bool SleepOnEventFd(absl::Duration timeout);

  // Pops a failed front Inbound; true if the front one is complete.
  bool FrontReady(PeerState& state);
  bool AnyFrontReady();
  // Closes the peer's endpoints (the first always forced). `flush_data`: its data
  // endpoint is flushed first (the destructor, while the peer may live and be receiving);
  // otherwise it is forced too, which completes its sends, cancelled.
  void CloseEndpoint(PeerState& state, bool flush_data = false);
  absl::Status Unavailable(int peer, const PeerState& state) const;
  // Why the control plane declared `peer` dead (SetPeerDeclaredDead), or empty. Cheap
  // while no peer is declared dead.
  std::string DeclaredDead(int peer) const;
  // The first peer with a pending transfer in the group that is declared dead, as an
  // UNAVAILABLE status; OK if none.
  absl::Status DeclaredDeadError(const ExchangeGroup& group) const;

  // Posts one transfer; a refused post completes the op with the error.
  void PostExchangeOp(ExchangeOp& op, uint64_t tag);
  // OK while the group can still complete; else why it cannot.
  absl::Status GroupError(const ExchangeGroup& group) const;
  // Cancels what UCP can withdraw and waits out matched receives (see the file comment);
  // keeps the group as a zombie while UCP still holds some of its requests.
  void CancelGroup(std::unique_ptr<ExchangeGroup> group);
  // The peer's data endpoint, made on first use.
  absl::Status EnsureDataEndpoint(int peer, PeerState& state);
  // Closes ep: forced (requests completed with UCS_ERR_CANCELED) or flushed; waits up to
  // kCloseTimeout. True if the close completed.
  bool CloseUcpEndpoint(ucp_ep_h ep, bool force);
  void ReapZombies();
  // Unmaps the peer's regions mapped here (destroys their remote keys).
  void DetachPeerRegions(PeerState& state);
  // The remote key and mapping of `key` on the peer's endpoint.
  absl::StatusOr<std::pair<ucp_rkey_h, PeerRegion>> MapPeerKey(int peer, PeerState& state,
                                                               std::string_view key);

  ucp_context_h context_ = nullptr;
  ucp_worker_h worker_ = nullptr;
  int epoll_fd_ = -1;
  std::string local_address_;
  size_t max_am_header_bytes_ = 0;
  int self_ = -1;
  std::map<int, PeerState> peers_;
  // Contexts of endpoints whose forced close did not finish in time: UCX may still call
  // their error callbacks, so they are freed only with the transport.
  std::vector<std::unique_ptr<EndpointContext>> orphaned_contexts_;
  bool failure_event_ = false;
  uint64_t dropped_messages_ = 0;
  std::vector<ucp_dt_iov_t> send_iov_;  // reused by SendV
  std::atomic<bool> wake_pending_{false};
  // SetPeerDeclaredDead's peers and reasons, written from the membership thread.
  mutable absl::Mutex declared_dead_mu_;
  std::map<int, std::string> declared_dead_ ABSL_GUARDED_BY(declared_dead_mu_);
  std::atomic<int> num_declared_dead_{0};
  bool device_memory_ = false;  // UCP moves UCS_MEMORY_TYPE_CUDA
  UcxTransportOptions options_;
  absl::flat_hash_map<int, MemoryType> send_memory_;  // PostExchange's check, reused
  // Whether a send travels on the peer's data endpoint.
  bool OnDataEndpoint(const Transfer& t) const {
    return t.kind == Transfer::Kind::kSend &&
           (t.memory == MemoryType::kDevice || options_.host_sends_on_data_endpoint);
  }
  std::map<ExchangeId, std::unique_ptr<ExchangeGroup>> exchanges_;
  // Cancelled groups UCP still holds requests of (unmatched sends).
  std::vector<std::unique_ptr<ExchangeGroup>> zombie_exchanges_;
  ExchangeId next_exchange_id_ = 1;
  std::map<void*, ucp_mem_h> mapped_regions_;  // MapRegion's, by address
  std::optional<MappedRegion> probe_region_;   // CanAttachPeerRegions's, made on first use
};

absl::Status UcxTransport::Init() {
  if (options_.keep_shared_memory) {
    // overwrite=0: an operator's explicit choice wins. (UCX may still list them as "unused
    // environment variables" at ucp_init, before its shared-memory transports read them.)
    setenv("UCX_POSIX_ERROR_HANDLING", "y", 0);
    setenv("UCX_SYSV_ERROR_HANDLING", "y", 0);
  }
  ucp_config_t* config = nullptr;
  ucs_status_t status = ucp_config_read(nullptr, nullptr, &config);
  if (status != UCS_OK) {
    return absl::InternalError(absl::StrCat("ucp_config_read: ", UcsError(status)));
  }
  if (std::getenv("UCX_KEEPALIVE_INTERVAL") == nullptr) {
    status = ucp_config_modify(config, "KEEPALIVE_INTERVAL", kKeepaliveInterval);
    if (status != UCS_OK) {
      ucp_config_release(config);
      return absl::InternalError(
          absl::StrCat("ucp_config_modify(KEEPALIVE_INTERVAL): ", UcsError(status)));
    }
  }
  if (std::getenv("UCX_MEMTYPE_CACHE") == nullptr) {
    // Every send and receive names its buffer's memory type, so UCX need not guess it. Its
    // guess is wrong here: the memory-type cache learns of GPU allocations from hooks on
    // the CUDA runtime, which do not see the CUDA plugin's statically linked runtime, so a
    // small send of GPU memory was packed as host memory (a segfault in
    // ucp_eager_single_pack on the H200 machine).
    status = ucp_config_modify(config, "MEMTYPE_CACHE", "n");
    if (status != UCS_OK) {
      ucp_config_release(config);
      return absl::InternalError(
          absl::StrCat("ucp_config_modify(MEMTYPE_CACHE): ", UcsError(status)));
    }
  }
  ucp_params_t params = {};
  params.field_mask = UCP_PARAM_FIELD_FEATURES | UCP_PARAM_FIELD_NAME;
  params.features = UCP_FEATURE_AM | UCP_FEATURE_TAG | UCP_FEATURE_WAKEUP;
  params.name = "dxs";
  status = ucp_init(&params, config, &context_);
  ucp_config_release(config);
  if (status != UCS_OK) {
    context_ = nullptr;
    return absl::InternalError(absl::StrCat("ucp_init: ", UcsError(status)));
  }
  ucp_context_attr_t context_attr = {};
  context_attr.field_mask = UCP_ATTR_FIELD_MEMORY_TYPES;
  status = ucp_context_query(context_, &context_attr);
  if (status != UCS_OK) {
    return absl::InternalError(absl::StrCat("ucp_context_query: ", UcsError(status)));
  }
  device_memory_ = (context_attr.memory_types & UCS_BIT(UCS_MEMORY_TYPE_CUDA)) != 0;

  ucp_worker_params_t worker_params = {};
  worker_params.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
  // Single-threaded: only the step thread touches the worker; Wake() uses
  // ucp_worker_signal, which UCX documents as safe from any thread in any mode.
  worker_params.thread_mode = UCS_THREAD_MODE_SINGLE;
  status = ucp_worker_create(context_, &worker_params, &worker_);
  if (status != UCS_OK) {
    worker_ = nullptr;
    return absl::InternalError(absl::StrCat("ucp_worker_create: ", UcsError(status)));
  }

  ucp_worker_attr_t attr = {};
  attr.field_mask = UCP_WORKER_ATTR_FIELD_MAX_AM_HEADER;
  status = ucp_worker_query(worker_, &attr);
  if (status != UCS_OK) {
    return absl::InternalError(absl::StrCat("ucp_worker_query: ", UcsError(status)));
  }
  max_am_header_bytes_ = attr.max_am_header;
  if (max_am_header_bytes_ < sizeof(WireHeader)) {
    return absl::InternalError(
        absl::StrCat("UCX allows only ", max_am_header_bytes_, "-byte active message headers"));
  }

  ucp_address_t* address = nullptr;
  size_t address_bytes = 0;
  status = ucp_worker_get_address(worker_, &address, &address_bytes);
  if (status != UCS_OK) {
    return absl::InternalError(absl::StrCat("ucp_worker_get_address: ", UcsError(status)));
  }
  local_address_.assign(reinterpret_cast<const char*>(address), address_bytes);
  ucp_worker_release_address(worker_, address);

  ucp_am_handler_param_t handler = {};
  handler.field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID | UCP_AM_HANDLER_PARAM_FIELD_FLAGS |
                       UCP_AM_HANDLER_PARAM_FIELD_CB | UCP_AM_HANDLER_PARAM_FIELD_ARG;
  handler.id = kAmId;
  handler.flags = UCP_AM_FLAG_WHOLE_MSG;
  handler.cb = &UcxTransport::AmCallback;
  handler.arg = this;
  status = ucp_worker_set_am_recv_handler(worker_, &handler);
  if (status != UCS_OK) {
    return absl::InternalError(absl::StrCat("ucp_worker_set_am_recv_handler: ", UcsError(status)));
  }

  int event_fd = -1;
  status = ucp_worker_get_efd(worker_, &event_fd);
  if (status != UCS_OK) {
    return absl::InternalError(absl::StrCat("ucp_worker_get_efd: ", UcsError(status)));
  }
  epoll_fd_ = epoll_create1(EPOLL_CLOEXEC);
  if (epoll_fd_ < 0) {
    return absl::InternalError(absl::StrCat("epoll_create1: ", std::strerror(errno)));
  }
  epoll_event event = {};
  event.events = EPOLLIN;
  event.data.fd = event_fd;
  if (epoll_ctl(epoll_fd_, EPOLL_CTL_ADD, event_fd, &event) != 0) {
    return absl::InternalError(absl::StrCat("epoll_ctl: ", std::strerror(errno)));
  }
  return absl::OkStatus();
}

UcxTransport::~UcxTransport() {
  for (auto& [peer, state] : peers_) DetachPeerRegions(state);
  if (context_ != nullptr) {
    for (auto& [data, memh] : mapped_regions_) ucp_mem_unmap(context_, memh);
  }
  if (worker_ != nullptr) {
    for (auto& [peer, state] : peers_) CloseEndpoint(state, /*flush_data=*/state.failure.empty());
    // Cancel rendezvous receives still in flight; their callbacks run during progress and
    // touch only their Inbound, which lives until after the worker is gone.
    for (auto& [peer, state] : peers_) {
      for (auto& inbound : state.inbox) {
        if (inbound->request != nullptr) ucp_request_cancel(worker_, inbound->request);
      }
    }
    // Exchange receives likewise; the groups (members) outlive the worker.
    for (auto& [id, group] : exchanges_) {
      for (ExchangeOp& op : group->ops) {
        if (op.request != nullptr) ucp_request_cancel(worker_, op.request);
      }
    }
    for (auto& group : zombie_exchanges_) {
      for (ExchangeOp& op : group->ops) {
        if (op.request != nullptr) ucp_request_cancel(worker_, op.request);
      }
    }
    ProgressAll();
    ucp_worker_destroy(worker_);
  }
  if (context_ != nullptr) ucp_cleanup(context_);
  if (epoll_fd_ >= 0) close(epoll_fd_);
}

absl::Status UcxTransport::SetSelf(int peer) {
  if (peer < 0) return absl::InvalidArgumentError(absl::StrCat("bad self rank ", peer));
  self_ = peer;
  return absl::OkStatus();
}

absl::Status UcxTransport::Connect(int peer, const std::string& address) {
  if (peer < 0) return absl::InvalidArgumentError(absl::StrCat("bad peer ", peer));
  if (address.empty()) {
    return absl::InvalidArgumentError(absl::StrCat("empty UCX address for peer ", peer));
  }
  PeerState& state = peers_[peer];
  CloseEndpoint(state);

  auto context = std::make_unique<EndpointContext>();
  context->transport = this;
  context->peer = peer;

  ucp_ep_params_t params = {};
  params.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                      UCP_EP_PARAM_FIELD_ERR_HANDLER;
  params.address = reinterpret_cast<const ucp_address_t*>(address.data());
  params.err_mode = UCP_ERR_HANDLING_MODE_PEER;
  params.err_handler.cb = &UcxTransport::ErrorCallback;
  params.err_handler.arg = context.get();
  ucp_ep_h ep = nullptr;
  ucs_status_t status = ucp_ep_create(worker_, &params, &ep);
  if (status != UCS_OK) {
    state.failure = absl::StrCat("connect failed: ", UcsError(status));
    return absl::UnavailableError(
        absl::StrCat("connect to peer ", peer, " failed: ", UcsError(status)));
  }
  state.ep = ep;
  state.ep_context = std::move(context);
  state.address = address;
  state.ever_connected = true;
  state.failure.clear();
  return absl::OkStatus();
}

void UcxTransport::Disconnect(int peer) {
  auto it = peers_.find(peer);
  if (it == peers_.end()) return;
  CloseEndpoint(it->second);
  if (it->second.failure.empty()) it->second.failure = "disconnected";
}

bool UcxTransport::CloseUcpEndpoint(ucp_ep_h ep, bool force) {
  ucp_request_param_t params = {};
  params.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
  params.flags = force ? UCP_EP_CLOSE_FLAG_FORCE : 0;
  ucs_status_ptr_t request = ucp_ep_close_nbx(ep, &params);
  bool closed = true;
  if (UCS_PTR_IS_PTR(request)) {
    const absl::Time deadline = absl::Now() + kCloseTimeout;
    closed = WaitUntil(deadline, /*honor_wake=*/false, [&] {
               return ucp_request_check_status(request) != UCS_INPROGRESS;
             }) == WaitResult::kReady;
    // Frees now if complete, otherwise when UCX completes it.
    ucp_request_free(request);
  }
  return closed;
}

void UcxTransport::CloseEndpoint(PeerState& state, bool flush_data) {
  DetachPeerRegions(state);
  state.can_attach.reset();
  if (state.data_ep != nullptr) {
    (void)CloseUcpEndpoint(state.data_ep, /*force=*/!flush_data);
    state.data_ep = nullptr;
  }
  if (state.ep == nullptr) return;
  state.ep_context->closing = true;
  if (!CloseUcpEndpoint(state.ep, /*force=*/true)) {
    orphaned_contexts_.push_back(std::move(state.ep_context));
  }
  state.ep = nullptr;
  state.ep_context.reset();
}

absl::Status UcxTransport::EnsureDataEndpoint(int peer, PeerState& state) {
  if (state.data_ep != nullptr) return absl::OkStatus();
  ucp_ep_params_t params = {};
  params.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE;
  params.address = reinterpret_cast<const ucp_address_t*>(state.address.data());
  params.err_mode = UCP_ERR_HANDLING_MODE_NONE;
  ucs_status_t status = ucp_ep_create(worker_, &params, &state.data_ep);
  if (status != UCS_OK) {
    state.data_ep = nullptr;
    return absl::UnavailableError(
        absl::StrCat("data endpoint to peer ", peer, " failed: ", UcsError(status)));
  }
  return absl::OkStatus();
}

namespace {

// How many of one peer's regions stay mapped here at once: the oldest is unmapped beyond it
// (an owner replaces a region when it outgrows it; a round uses at most a few).
constexpr size_t kMaxAttachedPerPeer = 16;

// A region's key: its address and size, then the packed remote key.
constexpr size_t kRegionKeyPrefix = 2 * sizeof(uint64_t);

}  // namespace

absl::StatusOr<MappedRegion> UcxTransport::MapRegion(size_t bytes) {
  if (bytes == 0) return absl::InvalidArgumentError("a mapped region of 0 bytes");
  ucp_mem_map_params_t params = {};
  params.field_mask = UCP_MEM_MAP_PARAM_FIELD_LENGTH | UCP_MEM_MAP_PARAM_FIELD_FLAGS;
  params.length = bytes;
  params.flags = UCP_MEM_MAP_ALLOCATE;
  ucp_mem_h memh = nullptr;
  ucs_status_t status = ucp_mem_map(context_, &params, &memh);
  if (status != UCS_OK) {
    return absl::ResourceExhaustedError(
        absl::StrCat("ucp_mem_map of ", bytes, " bytes: ", UcsError(status)));
  }
  ucp_mem_attr_t attr = {};
  attr.field_mask = UCP_MEM_ATTR_FIELD_ADDRESS | UCP_MEM_ATTR_FIELD_LENGTH;
  void* packed = nullptr;
  size_t packed_bytes = 0;
  status = ucp_mem_query(memh, &attr);
  if (status == UCS_OK) status = ucp_rkey_pack(context_, memh, &packed, &packed_bytes);
  if (status != UCS_OK) {
    ucp_mem_unmap(context_, memh);
    return absl::InternalError(absl::StrCat("mapping a region: ", UcsError(status)));
  }
  MappedRegion region;
  region.data = attr.address;
  region.bytes = attr.length;
  const uint64_t prefix[2] = {reinterpret_cast<uint64_t>(attr.address), attr.length};
  region.key.assign(reinterpret_cast<const char*>(prefix), kRegionKeyPrefix);
  region.key.append(static_cast<const char*>(packed), packed_bytes);
  ucp_rkey_buffer_release(packed);
  std::memset(region.data, 0, region.bytes);
  mapped_regions_[region.data] = memh;
  return region;
}

void UcxTransport::UnmapRegion(void* data) {
  auto it = mapped_regions_.find(data);
  if (it == mapped_regions_.end()) return;
  ucp_mem_unmap(context_, it->second);
  mapped_regions_.erase(it);
}

void UcxTransport::DetachPeerRegions(PeerState& state) {
  for (auto& [key, mapping] : state.attached) ucp_rkey_destroy(mapping.first);
  state.attached.clear();
}

absl::StatusOr<std::pair<ucp_rkey_h, PeerRegion>> UcxTransport::MapPeerKey(int peer,
                                                                           PeerState& state,
                                                                           std::string_view key) {
  if (key.size() <= kRegionKeyPrefix) {
    return absl::InvalidArgumentError(
        absl::StrCat("a region key of ", key.size(), " bytes from peer ", peer));
  }
  uint64_t prefix[2];
  std::memcpy(prefix, key.data(), kRegionKeyPrefix);
  ucp_rkey_h rkey = nullptr;
  ucs_status_t status = ucp_ep_rkey_unpack(state.ep, key.data() + kRegionKeyPrefix, &rkey);
  if (status != UCS_OK) {
    return absl::InvalidArgumentError(
        absl::StrCat("peer ", peer, "'s region key does not unpack: ", UcsError(status)));
  }
  void* local = nullptr;
  status = ucp_rkey_ptr(rkey, prefix[0], &local);
  if (status != UCS_OK) {
    ucp_rkey_destroy(rkey);
    if (status == UCS_ERR_UNREACHABLE) {
      return absl::UnimplementedError(
          absl::StrCat("peer ", peer, "'s memory cannot be mapped from here (no shared memory)"));
    }
    return absl::InvalidArgumentError(
        absl::StrCat("peer ", peer, "'s region does not map: ", UcsError(status)));
  }
  return std::make_pair(rkey, PeerRegion{local, static_cast<size_t>(prefix[1])});
}

bool UcxTransport::CanAttachPeerRegions(int peer) {
  auto it = peers_.find(peer);
  if (it == peers_.end() || it->second.ep == nullptr || !it->second.failure.empty()) return false;
  PeerState& state = it->second;
  if (state.can_attach) return *state.can_attach;
  // Mapping is symmetric between two processes: can our own small region be mapped
  // through the endpoint to this peer?
  if (!probe_region_) {
    absl::StatusOr<MappedRegion> probe = MapRegion(4096);
    if (!probe.ok()) return false;
    probe_region_ = *std::move(probe);
  }
  absl::StatusOr<std::pair<ucp_rkey_h, PeerRegion>> mapping =
      MapPeerKey(peer, state, probe_region_->key);
  if (mapping.ok()) ucp_rkey_destroy(mapping->first);
  state.can_attach = mapping.ok();
  return *state.can_attach;
}

absl::StatusOr<PeerRegion> UcxTransport::AttachPeerRegion(int peer, std::string_view key) {
  auto it = peers_.find(peer);
  if (it == peers_.end() || !it->second.ever_connected) {
    return absl::FailedPreconditionError(absl::StrCat("peer ", peer, " is not connected"));
  }
  PeerState& state = it->second;
  if (!state.failure.empty()) return Unavailable(peer, state);
  for (const auto& [known, mapping] : state.attached) {
    if (known == key) return mapping.second;
  }
  absl::StatusOr<std::pair<ucp_rkey_h, PeerRegion>> mapping = MapPeerKey(peer, state, key);
  if (!mapping.ok()) return mapping.status();
  if (state.attached.size() >= kMaxAttachedPerPeer) {
    ucp_rkey_destroy(state.attached.front().second.first);
    state.attached.erase(state.attached.begin());
  }
  state.attached.emplace_back(std::string(key), *mapping);
  return mapping->second;
}

absl::Status UcxTransport::Unavailable(int peer, const PeerState& state) const {
  return absl::UnavailableError(absl::StrCat("peer ", peer, " ", state.failure));
}

absl::Status UcxTransport::SendV(int peer, std::string_view header, const PayloadSegment* segments,
                                 size_t num_segments) {
  if (self_ < 0) {
    return absl::FailedPreconditionError(
        absl::StrCat("send to peer ", peer, ": SetSelf() was not called"));
  }
  for (size_t i = 0; i < num_segments; ++i) {
    if (segments[i].bytes > 0 && segments[i].data == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat(
          "send to peer ", peer, ": null payload segment of ", segments[i].bytes, " bytes"));
    }
  }
  auto it = peers_.find(peer);
  if (it == peers_.end() || !it->second.ever_connected) {
    return absl::FailedPreconditionError(absl::StrCat("peer ", peer, " is not connected"));
  }
  PeerState& state = it->second;
  if (!state.failure.empty()) return Unavailable(peer, state);

  WireHeader wire = {};
  wire.magic = kMagic;
  wire.sender = self_;
  wire.user_header_bytes = static_cast<uint32_t>(header.size());
  const bool header_in_data = sizeof(WireHeader) + header.size() > max_am_header_bytes_;
  if (header_in_data) wire.flags |= kFlagHeaderInData;
  std::string am_header(reinterpret_cast<const char*>(&wire), sizeof(wire));
  if (!header_in_data) am_header.append(header);

  SendState send_state;
  ucp_request_param_t params = {};
  params.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
  params.cb.send = &UcxTransport::SendCallback;
  params.user_data = &send_state;
  // The data: nothing, one contiguous buffer, or an IOV of the non-empty pieces. UCX reads
  // the IOV array until the request completes, which Send waits for.
  send_iov_.clear();
  if (header_in_data) send_iov_.push_back({const_cast<char*>(header.data()), header.size()});
  for (size_t i = 0; i < num_segments; ++i) {
    if (segments[i].bytes > 0) {
      send_iov_.push_back({const_cast<void*>(segments[i].data), segments[i].bytes});
    }
  }
  const void* buffer = nullptr;
  size_t count = 0;
  if (send_iov_.size() == 1) {
    buffer = send_iov_[0].buffer;
    count = send_iov_[0].length;
  } else if (send_iov_.size() > 1) {
    params.op_attr_mask |= UCP_OP_ATTR_FIELD_DATATYPE;
    params.datatype = ucp_dt_make_iov();
    buffer = send_iov_.data();
    count = send_iov_.size();
  }
  ucs_status_ptr_t request =
      ucp_am_send_nbx(state.ep, kAmId, am_header.data(), am_header.size(), buffer, count, &params);
  if (request == nullptr) return absl::OkStatus();
  if (UCS_PTR_IS_ERR(request)) {
    return absl::UnavailableError(
        absl::StrCat("send to peer ", peer, " failed: ", UcsError(UCS_PTR_STATUS(request))));
  }
  // No deadline: the request ends when the data has left (eager), the receiver fetched it
  // (rendezvous), or the endpoint fails, which completes it with an error.
  WaitResult result =
      WaitUntil(absl::InfiniteFuture(), /*honor_wake=*/false, [&] { return send_state.done; });
  if (result != WaitResult::kReady) {
    // The event fd broke. The callback writes to send_state, so it must run before this
    // frame goes away: cancel, and progress without sleeping until it has.
    ucp_request_cancel(worker_, request);
    while (!send_state.done) ProgressAll();
    ucp_request_free(request);
    return absl::InternalError(absl::StrCat("send to peer ", peer, ": waiting failed"));
  }
  ucp_request_free(request);
  if (send_state.status != UCS_OK) {
    return absl::UnavailableError(
        absl::StrCat("send to peer ", peer, " failed: ", UcsError(send_state.status)));
  }
  return absl::OkStatus();
}

bool UcxTransport::FrontReady(PeerState& state) {
  while (!state.inbox.empty()) {
    Inbound& front = *state.inbox.front();
    if (!front.done) return false;
    if (front.status == UCS_OK) return true;
    // A rendezvous receive that failed (the sender died mid-transfer): not a message.
    ++dropped_messages_;
    state.inbox.pop_front();
  }
  return false;
}

bool UcxTransport::AnyFrontReady() {
  for (auto& [peer, state] : peers_) {
    if (FrontReady(state)) return true;
  }
  return false;
}

absl::StatusOr<TransportMessage> UcxTransport::Recv(int peer, absl::Time deadline) {
  if (peer < 0) return absl::InvalidArgumentError(absl::StrCat("bad peer ", peer));
  PeerState& state = peers_[peer];
  WaitResult result = WaitUntil(deadline, /*honor_wake=*/false, [&] {
    return FrontReady(state) || !state.failure.empty() || !DeclaredDead(peer).empty();
  });
  if (FrontReady(state)) {
    TransportMessage message = std::move(state.inbox.front()->message);
    state.inbox.pop_front();
    return message;
  }
  if (!state.failure.empty()) return Unavailable(peer, state);
  if (std::string why = DeclaredDead(peer); !why.empty()) {
    return absl::UnavailableError(absl::StrCat("peer ", peer, " ", why));
  }
  switch (result) {
    case WaitResult::kError:
      return absl::InternalError(absl::StrCat("recv from peer ", peer, ": waiting failed"));
    default:
      return absl::DeadlineExceededError(absl::StrCat(
          "no message from peer ", peer, " before the deadline (", state.inbox.size(), " queued",
          state.inbox.empty() || state.inbox.front()->done ? "" : ", the first incomplete", ")"));
  }
}

bool UcxTransport::HasMessage(int peer) {
  ProgressAll();
  auto it = peers_.find(peer);
  return it != peers_.end() && FrontReady(it->second);
}

absl::Status UcxTransport::WaitForActivity(absl::Time deadline) {
  WaitResult result =
      WaitUntil(deadline, /*honor_wake=*/true, [&] { return failure_event_ || AnyFrontReady(); });
  failure_event_ = false;
  if (result == WaitResult::kError) {
    return absl::InternalError("waiting on the UCX worker failed");
  }
  return absl::OkStatus();
}

void UcxTransport::Wake() {
  wake_pending_.store(true, std::memory_order_release);
  ucp_worker_signal(worker_);
}

absl::Status UcxTransport::PeerStatus(int peer) {
  auto it = peers_.find(peer);
  if (it == peers_.end() || !it->second.ever_connected) {
    return absl::FailedPreconditionError(absl::StrCat("peer ", peer, " is not connected"));
  }
  ProgressAll();
  if (!it->second.failure.empty()) return Unavailable(peer, it->second);
  return absl::OkStatus();
}

void UcxTransport::SetPeerDeclaredDead(int peer, std::string reason) {
  {
    absl::MutexLock lock(&declared_dead_mu_);
    if (reason.empty()) {
      declared_dead_.erase(peer);
    } else {
      declared_dead_[peer] = std::move(reason);
    }
    num_declared_dead_.store(static_cast<int>(declared_dead_.size()), std::memory_order_release);
  }
  // A wait on the peer ends at its next turn: wakes a sleeping one, without marking a
  // Wake() (which would end the next WaitForActivity for nothing).
  ucp_worker_signal(worker_);
}

std::string UcxTransport::DeclaredDead(int peer) const {
  if (num_declared_dead_.load(std::memory_order_acquire) == 0) return "";
  absl::MutexLock lock(&declared_dead_mu_);
  auto it = declared_dead_.find(peer);
  return it == declared_dead_.end() ? "" : it->second;
}

absl::Status UcxTransport::DeclaredDeadError(const ExchangeGroup& group) const {
  if (num_declared_dead_.load(std::memory_order_acquire) == 0) return absl::OkStatus();
  for (const ExchangeOp& op : group.ops) {
    if (op.done) continue;
    std::string why = DeclaredDead(op.transfer.peer);
    if (!why.empty()) {
      return absl::UnavailableError(
          absl::StrCat("exchange tag ", group.tag, ": peer ", op.transfer.peer, " ", why));
    }
  }
  return absl::OkStatus();
}

unsigned UcxTransport::ProgressAll() {
  unsigned total = 0;
  while (unsigned n = ucp_worker_progress(worker_)) total += n;
  return total;
}

template <typename Ready>
UcxTransport::WaitResult UcxTransport::WaitUntil(absl::Time deadline, bool honor_wake,
                                                 Ready ready) {
  for (;;) {
    const absl::Time spin_end = absl::Now() + kSpinBeforeSleep;
    absl::Time now;
    do {
      const unsigned events = ProgressAll();
      if (ready()) return WaitResult::kReady;
      if (honor_wake && wake_pending_.exchange(false, std::memory_order_acq_rel)) {
        return WaitResult::kWoken;
      }
      now = absl::Now();
      if (now >= deadline) return WaitResult::kDeadline;
      // Hand the core to whoever is runnable: with more processes than cores the peer we
      // wait for may be the one that needs it. Costs a syscall when nothing else runs.
      // Not while the worker made progress: then a transfer is moving (a rendezvous is
      // pipelined through shared memory fragment by fragment) and both ends must keep
      // copying; yielding there hands the core away mid-transfer.
      if (events == 0) sched_yield();
    } while (now < spin_end);
    if (!SleepOnEventFd(std::min(deadline - now, kMaxSleep))) return WaitResult::kError;
  }
}

bool UcxTransport::SleepOnEventFd(absl::Duration timeout) {
  ucs_status_t status = ucp_worker_arm(worker_);
  if (status == UCS_ERR_BUSY) return true;  // events pending: progress again
  if (status != UCS_OK) return false;
  // Round up so a wait never ends before its deadline and then spins on the remainder.
  const int timeout_ms =
      static_cast<int>(absl::ToInt64Milliseconds(absl::Ceil(timeout, absl::Milliseconds(1))));
  epoll_event event;
  int n = epoll_wait(epoll_fd_, &event, 1, timeout_ms);
  return n >= 0 || errno == EINTR;
}

ucs_status_t UcxTransport::AmCallback(void* arg, const void* header, size_t header_length,
                                      void* data, size_t length, const ucp_am_recv_param_t* param) {
  return static_cast<UcxTransport*>(arg)->OnActiveMessage(header, header_length, data, length,
                                                          param);
}

ucs_status_t UcxTransport::OnActiveMessage(const void* header, size_t header_length, void* data,
                                           size_t length, const ucp_am_recv_param_t* param) {
  WireHeader wire;
  if (header_length < sizeof(wire)) {
    ++dropped_messages_;
    return UCS_OK;
  }
  std::memcpy(&wire, header, sizeof(wire));
  const bool header_in_data = (wire.flags & kFlagHeaderInData) != 0;
  const size_t inline_header_bytes = header_in_data ? 0 : wire.user_header_bytes;
  if (wire.magic != kMagic || wire.sender < 0 ||
      header_length != sizeof(wire) + inline_header_bytes ||
      (header_in_data && length < wire.user_header_bytes)) {
    ++dropped_messages_;
    return UCS_OK;
  }
  const bool rendezvous = (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) != 0;

  auto inbound = std::make_unique<Inbound>();
  Inbound* raw = inbound.get();
  raw->header_in_data = header_in_data;
  raw->user_header_bytes = wire.user_header_bytes;
  raw->message.header.assign(static_cast<const char*>(header) + sizeof(wire), inline_header_bytes);
  peers_[wire.sender].inbox.push_back(std::move(inbound));

  if (!rendezvous) {
    const auto* bytes = static_cast<const uint8_t*>(data);
    raw->message.payload.assign(bytes, bytes + length);
    CompleteInbound(raw, UCS_OK);
    return UCS_OK;
  }

  raw->expected_bytes = length;
  ucp_request_param_t params = {};
  params.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
  params.cb.recv_am = &UcxTransport::RecvDataCallback;
  params.user_data = raw;
  raw->message.payload.resize(length);
  ucs_status_ptr_t request =
      ucp_am_recv_data_nbx(worker_, data, raw->message.payload.data(), length, &params);
  if (request == nullptr) {
    CompleteInbound(raw, UCS_OK);
    return UCS_OK;
  }
  if (UCS_PTR_IS_ERR(request)) {
    CompleteInbound(raw, UCS_PTR_STATUS(request));  // dropped by FrontReady
    return UCS_OK;
  }
  raw->request = request;
  return UCS_INPROGRESS;
}

void UcxTransport::RecvDataCallback(void* request, ucs_status_t status, size_t length,
                                    void* user_data) {
  auto* in = static_cast<Inbound*>(user_data);
  in->request = nullptr;
  if (status == UCS_OK && length != in->expected_bytes) status = UCS_ERR_MESSAGE_TRUNCATED;
  CompleteInbound(in, status);
  ucp_request_free(request);
}

void UcxTransport::SendCallback(void* request, ucs_status_t status, void* user_data) {
  auto* state = static_cast<SendState*>(user_data);
  state->status = status;
  state->done = true;
}

void UcxTransport::ErrorCallback(void* arg, ucp_ep_h ep, ucs_status_t status) {
  auto* context = static_cast<EndpointContext*>(arg);
  context->transport->OnEndpointError(context, status);
}

void UcxTransport::OnEndpointError(EndpointContext* context, ucs_status_t status) {
  if (context->closing) return;
  PeerState& state = peers_[context->peer];
  if (state.ep_context.get() != context) return;
  state.failure = absl::StrCat("failed: ", UcsError(status));
  failure_event_ = true;
  // The failed endpoint is closed by the next Connect/Disconnect or the destructor; UCX
  // allows only a forced close, which must not run inside this callback.
}

absl::StatusOr<ExchangeId> UcxTransport::PostExchange(uint64_t tag, const Transfer* transfers,
                                                      size_t num_transfers) {
  if (tag > kMaxExchangeTag) {
    return absl::InvalidArgumentError(absl::StrCat("exchange tag ", tag, " is too large"));
  }
  for (size_t i = 0; i < num_transfers; ++i) {
    const Transfer& t = transfers[i];
    if (t.peer < 0 || t.peer > kMaxExchangeRank) {
      return absl::InvalidArgumentError(absl::StrCat("exchange tag ", tag, ": bad peer ", t.peer));
    }
    if (t.bytes > 0 && t.data == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat("exchange tag ", tag, ": transfer ", i, " of ",
                                                     t.bytes, " bytes with peer ", t.peer,
                                                     " has no buffer"));
    }
    if (t.memory == MemoryType::kDevice && !device_memory_) {
      return absl::UnimplementedError(absl::StrCat(
          "exchange tag ", tag, ": UCX ", ucp_get_version_string(),
          " was built without CUDA support, so it cannot move device memory (peer ", t.peer, ")"));
    }
    auto it = peers_.find(t.peer);
    if (it == peers_.end() || !it->second.ever_connected) {
      return absl::FailedPreconditionError(
          absl::StrCat("exchange tag ", tag, ": peer ", t.peer, " is not connected"));
    }
    if (!it->second.failure.empty()) {
      return absl::UnavailableError(
          absl::StrCat("exchange tag ", tag, ": ", Unavailable(t.peer, it->second).message()));
    }
  }
  if (num_transfers > 0 && (self_ < 0 || self_ > kMaxExchangeRank)) {
    return absl::FailedPreconditionError(
        absl::StrCat("exchange tag ", tag, ": SetSelf() was not called"));
  }
  // Sends of device memory travel on the peer's data endpoint, the others on its first;
  // UCP orders sends per endpoint, so one peer's sends in a group share a memory type.
  send_memory_.clear();
  for (size_t i = 0; i < num_transfers; ++i) {
    const Transfer& t = transfers[i];
    if (t.kind != Transfer::Kind::kSend) continue;
    const auto [first, inserted] = send_memory_.try_emplace(t.peer, t.memory);
    if (!inserted && first->second != t.memory) {
      return absl::InvalidArgumentError(absl::StrCat("exchange tag ", tag, ": sends to peer ",
                                                     t.peer, " mix host and device memory"));
    }
    if (!OnDataEndpoint(t)) continue;
    if (absl::Status s = EnsureDataEndpoint(t.peer, peers_.find(t.peer)->second); !s.ok()) {
      return absl::UnavailableError(absl::StrCat("exchange tag ", tag, ": ", s.message()));
    }
  }
  ReapZombies();
  auto group = std::make_unique<ExchangeGroup>();
  group->tag = tag;
  group->ops.resize(num_transfers);
  group->num_pending = num_transfers;
  for (size_t i = 0; i < num_transfers; ++i) {
    ExchangeOp& op = group->ops[i];
    op.group = group.get();
    op.transfer = transfers[i];
    op.peer_state = &peers_.find(op.transfer.peer)->second;
    PostExchangeOp(op, tag);
  }
  const ExchangeId id = next_exchange_id_++;
  exchanges_.emplace(id, std::move(group));
  return id;
}

void UcxTransport::PostExchangeOp(ExchangeOp& op, uint64_t tag) {
  const Transfer& t = op.transfer;
  ucp_request_param_t params = {};
  params.op_attr_mask =
      UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_MEMORY_TYPE;
  params.user_data = &op;
  // Zero bytes touch no memory: declared host memory, whatever the transfer says.
  params.memory_type =
      t.memory == MemoryType::kDevice && t.bytes > 0 ? UCS_MEMORY_TYPE_CUDA : UCS_MEMORY_TYPE_HOST;
  void* buffer = t.data != nullptr ? t.data : &zero_byte_buffer;
  ucs_status_ptr_t request;
  if (t.kind == Transfer::Kind::kSend) {
    params.cb.send = &UcxTransport::ExchangeSendCallback;
    ucp_ep_h ep = OnDataEndpoint(t) ? op.peer_state->data_ep : op.peer_state->ep;
    request = ucp_tag_send_nbx(ep, buffer, t.bytes, ExchangeWireTag(self_, tag), &params);
  } else {
    // UCX 1.13 leaves recv_info unfilled on some immediate completions (an unexpected
    // message received at once), so the size could not be checked: receives always
    // complete through the callback, which reports it. (The callback may run inside
    // ucp_tag_recv_nbx then.)
    params.op_attr_mask |= UCP_OP_ATTR_FLAG_NO_IMM_CMPL;
    params.cb.recv = &UcxTransport::ExchangeRecvCallback;
    request = ucp_tag_recv_nbx(worker_, buffer, t.bytes, ExchangeWireTag(t.peer, tag), kFullTagMask,
                               &params);
  }
  if (request == nullptr) {
    CompleteExchangeOp(&op, UCS_OK);  // a send done at once
  } else if (UCS_PTR_IS_ERR(request)) {
    CompleteExchangeOp(&op, UCS_PTR_STATUS(request));
  } else if (!op.done) {  // else the callback ran already and freed the request
    op.request = request;
  }
}

void UcxTransport::CompleteExchangeOp(ExchangeOp* op, ucs_status_t status) {
  op->request = nullptr;
  op->status = status;
  if (status == UCS_OK && op->transfer.kind == Transfer::Kind::kRecv &&
      op->info.length != op->transfer.bytes) {
    op->status = UCS_ERR_MESSAGE_TRUNCATED;  // shorter than expected
    op->short_message = true;
  }
  op->done = true;
  op->done_ns = std::chrono::duration_cast<std::chrono::nanoseconds>(
                    std::chrono::steady_clock::now().time_since_epoch())
                    .count();
  --op->group->num_pending;
}

void UcxTransport::ExchangeSendCallback(void* request, ucs_status_t status, void* user_data) {
  CompleteExchangeOp(static_cast<ExchangeOp*>(user_data), status);
  ucp_request_free(request);
}

void UcxTransport::ExchangeRecvCallback(void* request, ucs_status_t status,
                                        const ucp_tag_recv_info_t* info, void* user_data) {
  auto* op = static_cast<ExchangeOp*>(user_data);
  if (info != nullptr) op->info = *info;
  CompleteExchangeOp(op, status);
  ucp_request_free(request);
}

absl::Status UcxTransport::GroupError(const ExchangeGroup& group) const {
  for (const ExchangeOp& op : group.ops) {
    const Transfer& t = op.transfer;
    const bool send = t.kind == Transfer::Kind::kSend;
    if (op.done) {
      if (op.status == UCS_OK) continue;
      if (op.status == UCS_ERR_MESSAGE_TRUNCATED && !send) {
        // UCP does not report the size of a message too large for the receive.
        const std::string arrived = op.short_message
                                        ? absl::StrCat(op.info.length, " bytes arrived")
                                        : "a larger message arrived";
        return absl::InternalError(absl::StrCat("exchange tag ", group.tag,
                                                ": size mismatch receiving ", t.bytes,
                                                " bytes from peer ", t.peer, ": ", arrived));
      }
      if (!op.peer_state->failure.empty()) {
        return absl::UnavailableError(absl::StrCat("exchange tag ", group.tag, ": ",
                                                   Unavailable(t.peer, *op.peer_state).message()));
      }
      return absl::UnavailableError(absl::StrCat("exchange tag ", group.tag, ": ",
                                                 send ? "send to" : "receive from", " peer ",
                                                 t.peer, " failed: ", UcsError(op.status)));
    }
    if (!op.peer_state->failure.empty()) {
      return absl::UnavailableError(absl::StrCat("exchange tag ", group.tag, ": ",
                                                 Unavailable(t.peer, *op.peer_state).message()));
    }
  }
  return absl::OkStatus();
}

absl::Status UcxTransport::WaitExchangeTimed(ExchangeId id, absl::Time deadline,
                                             std::vector<int64_t>* done, size_t num_transfers) {
  auto it = exchanges_.find(id);
  if (it == exchanges_.end()) {
    return absl::NotFoundError(absl::StrCat("no exchange ", id, " in flight"));
  }
  ExchangeGroup& group = *it->second;
  const WaitResult result = WaitUntil(deadline, /*honor_wake=*/false, [&] {
    return group.num_pending == 0 || !GroupError(group).ok() || !DeclaredDeadError(group).ok();
  });
  absl::Status status = GroupError(group);
  if (status.ok() && group.num_pending == 0) {
    if (done != nullptr) {
      done->assign(num_transfers, 0);
      for (size_t i = 0; i < group.ops.size() && i < num_transfers; ++i) {
        (*done)[i] = group.ops[i].done_ns;
      }
    }
    exchanges_.erase(it);
    return absl::OkStatus();
  }
  if (status.ok()) status = DeclaredDeadError(group);
  if (status.ok()) {
    if (result == WaitResult::kError) {
      status = absl::InternalError(
          absl::StrCat("exchange tag ", group.tag, ": waiting on the UCX worker failed"));
    } else {
      status = ExchangeDeadlineError(group.tag, group.ops, group.num_pending);
    }
  }
  std::unique_ptr<ExchangeGroup> owned = std::move(it->second);
  exchanges_.erase(it);
  CancelGroup(std::move(owned));
  return status;
}

bool UcxTransport::ExchangeDone(ExchangeId id) {
  ProgressAll();
  auto it = exchanges_.find(id);
  if (it == exchanges_.end()) return true;
  return it->second->num_pending == 0 || !GroupError(*it->second).ok();
}

void UcxTransport::CancelGroup(std::unique_ptr<ExchangeGroup> group) {
  for (ExchangeOp& op : group->ops) {
    if (op.request != nullptr && op.transfer.kind == Transfer::Kind::kRecv) {
      ucp_request_cancel(worker_, op.request);  // completes it now unless matched
    }
  }
  // A matched receive is being written. It ends by itself (the data is on its way) or with
  // its peer's endpoint (UCP purges that endpoint's requests when it fails or is closed).
  // A failed peer writes nothing more, but a receive it matched may never end: one that
  // came on its data endpoint (no error handling) is purged by nothing. Such receives get a
  // short settling time, not the full wait: a killed expert must fail its step within
  // seconds (on the H200 the two full waits made it 5.1 s).
  std::vector<bool> peer_failed(group->ops.size());
  for (size_t i = 0; i < group->ops.size(); ++i) {
    peer_failed[i] = !group->ops[i].peer_state->failure.empty();
  }
  auto receives_done = [&](bool of_failed_peers) {
    for (size_t i = 0; i < group->ops.size(); ++i) {
      const ExchangeOp& op = group->ops[i];
      if (op.done || op.transfer.kind != Transfer::Kind::kRecv) continue;
      if (of_failed_peers || !peer_failed[i]) return false;
    }
    return true;
  };
  (void)WaitUntil(absl::Now() + kFailedPeerSettle, /*honor_wake=*/false,
                  [&] { return receives_done(/*of_failed_peers=*/true); });
  auto live_receives_done = [&] { return receives_done(/*of_failed_peers=*/false); };
  if (WaitUntil(absl::Now() + kCancelTimeout, /*honor_wake=*/false, live_receives_done) !=
      WaitResult::kReady) {
    // Still being written: close those peers' endpoints, which ends their transfers.
    for (ExchangeOp& op : group->ops) {
      if (op.done || op.transfer.kind != Transfer::Kind::kRecv || op.peer_state->ep == nullptr) {
        continue;
      }
      CloseEndpoint(*op.peer_state);
      if (op.peer_state->failure.empty()) {
        op.peer_state->failure = "closed: a receive of a cancelled exchange did not end";
        failure_event_ = true;
      }
    }
    (void)WaitUntil(absl::Now() + kCancelTimeout, /*honor_wake=*/false, live_receives_done);
  }
  if (group->num_pending > 0) zombie_exchanges_.push_back(std::move(group));
}

void UcxTransport::ReapZombies() {
  zombie_exchanges_.erase(
      std::remove_if(zombie_exchanges_.begin(), zombie_exchanges_.end(),
                     [](const std::unique_ptr<ExchangeGroup>& g) { return g->num_pending == 0; }),
      zombie_exchanges_.end());
}

}  // namespace

absl::StatusOr<std::unique_ptr<Transport>> MakeUcxTransport(const UcxTransportOptions& options) {
  // Messages of megabytes arrive every layer step. By default glibc serves each from fresh
  // mmap'd pages and unmaps them on free, so every message pays page faults on first
  // touch (measured: most of a 16 MiB round trip). Keep large blocks in the heap instead.
  static const bool tuned = [] {
    mallopt(M_MMAP_THRESHOLD, 256 << 20);
    mallopt(M_TRIM_THRESHOLD, 512 << 20);
    return true;
  }();
  (void)tuned;
  auto transport = std::make_unique<UcxTransport>(options);
  absl::Status status = transport->Init();
  if (!status.ok()) return status;
  return std::unique_ptr<Transport>(std::move(transport));
}

// The ucx row's Factory (transports.def): the default options; ucx has no control row.
absl::StatusOr<MadeTransport> UcxFactory(std::unique_ptr<Transport> control_transport,
                                         int cuda_device) {
  absl::StatusOr<std::unique_ptr<Transport>> transport = MakeUcxTransport();
  if (!transport.ok()) return transport.status();
  MadeTransport made;
  made.transport = *std::move(transport);
  return made;
}

}  // namespace dxs
