// In-process backend of Transport for unit tests: the group shares one Hub, a set of
// mailboxes (one FIFO per (receiver, sender) pair) under one mutex, with a condition
// variable per receiver. Disconnect(peer) marks the pair failed in both directions, the
// way a broken connection looks to both ends, so tests can inject faults; Connect(peer)
// clears the caller's side only, like reconnecting one UCX endpoint.
//
// Data exchange: the Hub keeps a matching queue per (source, destination, tag): posted
// sends on one side, posted receives on the other. Whichever side posts second finds the
// other's entry at the front and copies the bytes, under the Hub's mutex, so a cancelled
// entry (taken off its queue under the same mutex) is never written afterwards. Both
// entries complete at once; a size mismatch fails both. kDevice memory is copied like
// host memory: inproc runs in one address space, so device buffers must be addressable
// there (the CPU backend's are).
//
// Mapped regions are host memory the Hub keeps: a key names its owner and number, and an
// attach is a lookup. An unmapped region is kept until the Hub goes, so a peer that still
// writes into it writes into memory that is no one else's.
#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <map>
#include <memory>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
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

struct ExchangeGroup;

// One posted transfer. done/status are written under the Hub's mutex by whichever thread
// matches it.
struct ExchangeOp {
  ExchangeGroup* group = nullptr;
  Transfer transfer;
  bool done = false;
  absl::Status status;
};

struct ExchangeGroup {
  int owner = -1;
  uint64_t tag = 0;
  std::vector<ExchangeOp> ops;  // sized once: ops are referenced from the queues
  size_t num_pending = 0;
};

// The queue that pairs sends from `source` to `destination` under one tag with the
// destination's receives: at most one of the two deques is non-empty.
struct Channel {
  std::deque<ExchangeOp*> sends;
  std::deque<ExchangeOp*> recvs;
};
using ChannelKey = std::tuple<int, int, uint64_t>;  // source, destination, tag

struct Mailbox {
  explicit Mailbox(int num_peers) : from(num_peers), failure(num_peers) {}
  absl::CondVar cv;
  std::vector<std::deque<TransportMessage>> from;  // indexed by sender
  // This receiver's view of each peer: empty when OK, else why it is unavailable.
  std::vector<std::string> failure;
  bool wake_pending = false;
  bool failure_event = false;
};

// One region of MapRegion: page-aligned, zeroed host memory.
struct HubRegion {
  explicit HubRegion(size_t num_bytes)
      : bytes(num_bytes),
        data(static_cast<uint8_t*>(
                 std::aligned_alloc(kPage, (num_bytes + kPage - 1) / kPage * kPage)),
             &std::free) {
    if (data != nullptr) std::memset(data.get(), 0, bytes);
  }
  static constexpr size_t kPage = 4096;
  size_t bytes;
  std::unique_ptr<uint8_t, decltype(&std::free)> data;
  bool mapped = true;
};

// A region's key: its owner and number, 16 bytes.
std::string RegionKey(int owner, uint64_t id) {
  std::string key(16, '\0');
  const uint64_t owner64 = static_cast<uint64_t>(owner);
  std::memcpy(key.data(), &owner64, 8);
  std::memcpy(key.data() + 8, &id, 8);
  return key;
}

struct Hub {
  explicit Hub(int num_peers) {
    for (int i = 0; i < num_peers; ++i) mailboxes.push_back(std::make_unique<Mailbox>(num_peers));
  }
  int num_peers() const ABSL_NO_THREAD_SAFETY_ANALYSIS {
    return static_cast<int>(mailboxes.size());
  }
  absl::Mutex mu;
  // The vector is fixed at construction; the Mailboxes' contents are guarded by mu.
  std::vector<std::unique_ptr<Mailbox>> mailboxes ABSL_GUARDED_BY(mu);
  std::map<ChannelKey, Channel> channels ABSL_GUARDED_BY(mu);
  // Mapped regions by (owner, number); kept until the Hub goes (see the file comment).
  std::map<std::pair<int, uint64_t>, std::unique_ptr<HubRegion>> regions ABSL_GUARDED_BY(mu);
  uint64_t next_region = 1 ABSL_GUARDED_BY(mu);
};

class InprocTransport final : public Transport {
 public:
  InprocTransport(std::shared_ptr<Hub> hub, int self) : hub_(std::move(hub)), self_(self) {}
  ~InprocTransport() override {
    absl::MutexLock lock(&hub_->mu);
    for (auto& [id, group] : groups_) UnpostLocked(*group);
  }

  std::string name() const override { return "inproc"; }
  std::string LocalAddress() const override { return absl::StrCat("inproc:", self_); }

  absl::Status SetSelf(int peer) override {
    if (peer != self_) {
      return absl::InvalidArgumentError(
          absl::StrCat("inproc transport ", self_, " cannot become peer ", peer));
    }
    return absl::OkStatus();
  }

  absl::Status Connect(int peer, const std::string& address) override {
    if (!Valid(peer)) return BadPeer(peer);
    absl::MutexLock lock(&hub_->mu);
    Own().failure[peer].clear();
    return absl::OkStatus();
  }

  void Disconnect(int peer) override {
    if (!Valid(peer)) return;
    absl::MutexLock lock(&hub_->mu);
    Own().failure[peer] = "disconnected";
    Own().cv.SignalAll();  // our own exchange waits (another thread's, in tests) see it too
    Mailbox& other = *hub_->mailboxes[peer];
    if (other.failure[self_].empty()) {
      other.failure[self_] = "failed: connection closed by the peer";
      other.failure_event = true;
      other.cv.SignalAll();
    }
  }

  absl::Status SendV(int peer, std::string_view header, const PayloadSegment* segments,
                     size_t num_segments) override {
    if (!Valid(peer)) return BadPeer(peer);
    size_t payload_bytes = 0;
    for (size_t i = 0; i < num_segments; ++i) {
      if (segments[i].bytes > 0 && segments[i].data == nullptr) {
        return absl::InvalidArgumentError(absl::StrCat(
            "send to peer ", peer, ": null payload segment of ", segments[i].bytes, " bytes"));
      }
      payload_bytes += segments[i].bytes;
    }
    TransportMessage message;
    message.header.assign(header.data(), header.size());
    message.payload.resize(payload_bytes);
    uint8_t* p = message.payload.data();
    for (size_t i = 0; i < num_segments; ++i) {
      if (segments[i].bytes == 0) continue;
      std::memcpy(p, segments[i].data, segments[i].bytes);
      p += segments[i].bytes;
    }
    absl::MutexLock lock(&hub_->mu);
    if (!Own().failure[peer].empty()) return Unavailable(peer);
    Mailbox& other = *hub_->mailboxes[peer];
    other.from[self_].push_back(std::move(message));
    other.cv.SignalAll();
    return absl::OkStatus();
  }

  absl::StatusOr<TransportMessage> Recv(int peer, absl::Time deadline) override {
    if (!Valid(peer)) return BadPeer(peer);
    absl::MutexLock lock(&hub_->mu);
    Mailbox& own = Own();
    auto& queue = own.from[peer];
    WaitLocked(
        deadline, [&] { return !queue.empty() || !own.failure[peer].empty(); },
        /*honor_wake=*/false);
    if (!queue.empty()) {
      TransportMessage message = std::move(queue.front());
      queue.pop_front();
      return message;
    }
    if (!own.failure[peer].empty()) return Unavailable(peer);
    return absl::DeadlineExceededError(
        absl::StrCat("no message from peer ", peer, " before the deadline"));
  }

  bool HasMessage(int peer) override {
    if (!Valid(peer)) return false;
    absl::MutexLock lock(&hub_->mu);
    return !Own().from[peer].empty();
  }

  absl::Status WaitForActivity(absl::Time deadline) override {
    absl::MutexLock lock(&hub_->mu);
    Mailbox& own = Own();
    WaitLocked(deadline, [&] {
      return own.failure_event || std::any_of(own.from.begin(), own.from.end(),
                                              [](const auto& q) { return !q.empty(); });
    });
    own.failure_event = false;
    return absl::OkStatus();
  }

  void Wake() override {
    absl::MutexLock lock(&hub_->mu);
    Own().wake_pending = true;
    Own().cv.SignalAll();
  }

  absl::Status PeerStatus(int peer) override {
    if (!Valid(peer)) return BadPeer(peer);
    absl::MutexLock lock(&hub_->mu);
    if (!Own().failure[peer].empty()) return Unavailable(peer);
    return absl::OkStatus();
  }

  absl::StatusOr<ExchangeId> PostExchange(uint64_t tag, const Transfer* transfers,
                                          size_t num_transfers) override {
    if (tag > kMaxExchangeTag) {
      return absl::InvalidArgumentError(absl::StrCat("exchange tag ", tag, " is too large"));
    }
    for (size_t i = 0; i < num_transfers; ++i) {
      const Transfer& t = transfers[i];
      if (!Valid(t.peer)) return BadPeer(t.peer);
      if (t.bytes > 0 && t.data == nullptr) {
        return absl::InvalidArgumentError(absl::StrCat("exchange tag ", tag, ": transfer ", i,
                                                       " of ", t.bytes, " bytes with peer ", t.peer,
                                                       " has no buffer"));
      }
    }
    auto group = std::make_unique<ExchangeGroup>();
    group->owner = self_;
    group->tag = tag;
    group->ops.resize(num_transfers);
    group->num_pending = num_transfers;
    absl::MutexLock lock(&hub_->mu);
    for (size_t i = 0; i < num_transfers; ++i) {
      if (!Own().failure[transfers[i].peer].empty()) {
        return absl::UnavailableError(absl::StrCat("exchange tag ", tag, ": peer ",
                                                   transfers[i].peer, " ",
                                                   Own().failure[transfers[i].peer]));
      }
    }
    for (size_t i = 0; i < num_transfers; ++i) {
      ExchangeOp& op = group->ops[i];
      op.group = group.get();
      op.transfer = transfers[i];
      const bool send = op.transfer.kind == Transfer::Kind::kSend;
      const ChannelKey key = send ? ChannelKey{self_, op.transfer.peer, tag}
                                  : ChannelKey{op.transfer.peer, self_, tag};
      auto channel = hub_->channels.try_emplace(key).first;
      (send ? channel->second.sends : channel->second.recvs).push_back(&op);
      MatchLocked(channel);
    }
    const ExchangeId id = next_exchange_id_++;
    groups_.emplace(id, std::move(group));
    return id;
  }

  absl::Status WaitExchange(ExchangeId id, absl::Time deadline) override {
    auto it = groups_.find(id);
    if (it == groups_.end()) return UnknownExchange(id);
    ExchangeGroup& group = *it->second;
    absl::Status status;
    {
      absl::MutexLock lock(&hub_->mu);
      Mailbox& own = Own();
      for (;;) {
        status = GroupErrorLocked(group);
        if (!status.ok() || group.num_pending == 0) break;
        if (own.cv.WaitWithDeadline(&hub_->mu, deadline)) {
          status = GroupErrorLocked(group);
          if (status.ok() && group.num_pending > 0)
            status = ExchangeDeadlineError(group.tag, group.ops, group.num_pending);
          break;
        }
      }
      if (!status.ok()) UnpostLocked(group);
    }
    groups_.erase(it);
    return status;
  }

  // One address space: device buffers are copied like host memory (see the file comment).
  bool SupportsMemory(MemoryType memory) const override { return true; }

  absl::StatusOr<MappedRegion> MapRegion(size_t bytes) override {
    if (bytes == 0) return absl::InvalidArgumentError("a mapped region of 0 bytes");
    auto region = std::make_unique<HubRegion>(bytes);
    if (region->data == nullptr) {
      return absl::ResourceExhaustedError(absl::StrCat("no memory for a ", bytes, "-byte region"));
    }
    absl::MutexLock lock(&hub_->mu);
    const uint64_t id = hub_->next_region++;
    MappedRegion mapped = {region->data.get(), bytes, RegionKey(self_, id)};
    hub_->regions[{self_, id}] = std::move(region);
    return mapped;
  }

  void UnmapRegion(void* data) override {
    absl::MutexLock lock(&hub_->mu);
    for (auto& [key, region] : hub_->regions) {
      if (key.first == self_ && region->data.get() == data) region->mapped = false;
    }
  }

  bool CanAttachPeerRegions(int peer) override {
    if (!Valid(peer)) return false;
    absl::MutexLock lock(&hub_->mu);
    return Own().failure[peer].empty();
  }

  absl::StatusOr<PeerRegion> AttachPeerRegion(int peer, std::string_view key) override {
    if (!Valid(peer)) return BadPeer(peer);
    absl::MutexLock lock(&hub_->mu);
    if (!Own().failure[peer].empty()) {
      return absl::UnavailableError(absl::StrCat("peer ", peer, " ", Own().failure[peer]));
    }
    uint64_t owner = 0, id = 0;
    if (key.size() == 16) {
      std::memcpy(&owner, key.data(), 8);
      std::memcpy(&id, key.data() + 8, 8);
    }
    auto it = hub_->regions.find({static_cast<int>(owner), id});
    if (key.size() != 16 || owner != static_cast<uint64_t>(peer) || it == hub_->regions.end() ||
        !it->second->mapped) {
      return absl::InvalidArgumentError(
          absl::StrCat("no mapped region of peer ", peer, " has that key"));
    }
    return PeerRegion{it->second->data.get(), it->second->bytes};
  }

  bool ExchangeDone(ExchangeId id) override {
    auto it = groups_.find(id);
    if (it == groups_.end()) return true;
    absl::MutexLock lock(&hub_->mu);
    return it->second->num_pending == 0 || !GroupErrorLocked(*it->second).ok();
  }

 private:
  bool Valid(int peer) const { return peer >= 0 && peer < hub_->num_peers(); }
  absl::Status BadPeer(int peer) const {
    return absl::InvalidArgumentError(
        absl::StrCat("peer ", peer, " is outside the inproc group of ", hub_->num_peers()));
  }
  absl::Status UnknownExchange(ExchangeId id) const {
    return absl::NotFoundError(absl::StrCat("no exchange ", id, " in flight"));
  }
  Mailbox& Own() ABSL_EXCLUSIVE_LOCKS_REQUIRED(hub_->mu) { return *hub_->mailboxes[self_]; }

  // Pairs the fronts of a channel's queues while both have entries, copying each send into
  // its receive. Runs on whichever side posted second.
  void MatchLocked(std::map<ChannelKey, Channel>::iterator channel)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(hub_->mu) {
    Channel& c = channel->second;
    while (!c.sends.empty() && !c.recvs.empty()) {
      ExchangeOp* send = c.sends.front();
      ExchangeOp* recv = c.recvs.front();
      c.sends.pop_front();
      c.recvs.pop_front();
      absl::Status status;
      if (send->transfer.bytes != recv->transfer.bytes) {
        status = absl::InternalError(absl::StrCat(
            "exchange tag ", std::get<2>(channel->first), ": peer ", std::get<0>(channel->first),
            " sends ", send->transfer.bytes, " bytes, peer ", std::get<1>(channel->first),
            " receives ", recv->transfer.bytes));
      } else if (send->transfer.bytes > 0) {
        std::memcpy(recv->transfer.data, send->transfer.data, send->transfer.bytes);
      }
      for (ExchangeOp* op : {send, recv}) {
        op->done = true;
        op->status = status;
        --op->group->num_pending;
        hub_->mailboxes[op->group->owner]->cv.SignalAll();
      }
    }
    if (c.sends.empty() && c.recvs.empty()) hub_->channels.erase(channel);
  }

  // OK while the group can still complete; else why it cannot.
  absl::Status GroupErrorLocked(const ExchangeGroup& group)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(hub_->mu) {
    for (const ExchangeOp& op : group.ops) {
      if (op.done) {
        if (!op.status.ok()) return op.status;
      } else if (!Own().failure[op.transfer.peer].empty()) {
        return absl::UnavailableError(absl::StrCat("exchange tag ", group.tag, ": peer ",
                                                   op.transfer.peer, " ",
                                                   Own().failure[op.transfer.peer]));
      }
    }
    return absl::OkStatus();
  }

  // Takes the group's unmatched entries off their queues: nothing writes them afterwards.
  void UnpostLocked(ExchangeGroup& group) ABSL_EXCLUSIVE_LOCKS_REQUIRED(hub_->mu) {
    for (ExchangeOp& op : group.ops) {
      if (op.done) continue;
      const bool send = op.transfer.kind == Transfer::Kind::kSend;
      const ChannelKey key = send ? ChannelKey{self_, op.transfer.peer, group.tag}
                                  : ChannelKey{op.transfer.peer, self_, group.tag};
      auto channel = hub_->channels.find(key);
      if (channel == hub_->channels.end()) continue;
      auto& queue = send ? channel->second.sends : channel->second.recvs;
      queue.erase(std::remove(queue.begin(), queue.end(), &op), queue.end());
      if (channel->second.sends.empty() && channel->second.recvs.empty()) {
        hub_->channels.erase(channel);
      }
      op.done = true;
      op.status = absl::CancelledError("cancelled");
      --group.num_pending;
    }
  }

  absl::Status Unavailable(int peer) ABSL_EXCLUSIVE_LOCKS_REQUIRED(hub_->mu) {
    return absl::UnavailableError(absl::StrCat("peer ", peer, " ", Own().failure[peer]));
  }

  // Waits until ready(), a pending Wake() (if honor_wake), or the deadline. Returns true if
  // a Wake() ended the wait.
  template <typename Ready>
  bool WaitLocked(absl::Time deadline, Ready ready, bool honor_wake = true)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(hub_->mu) {
    Mailbox& own = Own();
    for (;;) {
      if (ready()) return false;
      if (honor_wake && own.wake_pending) {
        own.wake_pending = false;
        return true;
      }
      if (absl::Now() >= deadline) return false;
      own.cv.WaitWithDeadline(&hub_->mu, deadline);
    }
  }

  std::shared_ptr<Hub> hub_;
  const int self_;
  // Step thread only; the groups' ops are referenced from the Hub's channels (under its
  // mutex) until matched or unposted.
  std::map<ExchangeId, std::unique_ptr<ExchangeGroup>> groups_;
  ExchangeId next_exchange_id_ = 1;
};

}  // namespace

std::vector<std::unique_ptr<Transport>> MakeInprocTransportGroup(int num_peers) {
  auto hub = std::make_shared<Hub>(std::max(num_peers, 0));
  std::vector<std::unique_ptr<Transport>> group;
  for (int i = 0; i < num_peers; ++i) group.push_back(std::make_unique<InprocTransport>(hub, i));
  return group;
}

// The inproc row's Factory (transports.def): its transports share a Hub, so they are made
// as a group (MakeInprocTransportGroup), never one by one. No worker reaches this: inproc
// has no kWorkers.
absl::StatusOr<MadeTransport> InprocFactory(std::unique_ptr<Transport> control_transport,
                                            int cuda_device) {
  return absl::UnimplementedError(
      "inproc transports are made as a group in one process (MakeInprocTransportGroup)");
}

}  // namespace dxs
