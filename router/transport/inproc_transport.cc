// In-process backend of Transport for unit tests: the group shares one Hub, a set of
// mailboxes (one FIFO per (receiver, sender) pair) under one mutex, with a condition
// variable per receiver. Disconnect(peer) marks the pair failed in both directions, the
// way a broken connection looks to both ends, so tests can inject faults; Connect(peer)
// clears the caller's side only, like reconnecting one UCX endpoint.
//
// Receive targets: a message is offered to the receiver's ReceiveTargetProvider on the
// receiver's own thread (the provider is not thread-safe), the first time one of the
// receiver's calls finds it queued, in queue order; an accepted payload is copied into the
// target then.
#include <algorithm>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "router/transport/transport.h"

namespace dxs {
namespace {

// Longest single condition-variable wait; keeps far deadlines clear of clock overflow.
constexpr absl::Duration kMaxWaitSlice = absl::Hours(1);

struct Mailbox {
  explicit Mailbox(int num_peers) : from(num_peers), failure(num_peers) {}
  std::condition_variable cv;
  struct Queued {
    TransportMessage message;
    bool offered = false;  // the receiver's provider has seen it
  };
  std::vector<std::deque<Queued>> from;  // indexed by sender
  // This receiver's view of each peer: empty when OK, else why it is unavailable.
  std::vector<std::string> failure;
  bool wake_pending = false;
  bool failure_event = false;
};

struct Hub {
  explicit Hub(int num_peers) {
    for (int i = 0; i < num_peers; ++i) mailboxes.push_back(std::make_unique<Mailbox>(num_peers));
  }
  int num_peers() const { return static_cast<int>(mailboxes.size()); }
  std::mutex mu;
  std::vector<std::unique_ptr<Mailbox>> mailboxes;  // guarded by mu
};

class InprocTransport final : public Transport {
 public:
  InprocTransport(std::shared_ptr<Hub> hub, int self) : hub_(std::move(hub)), self_(self) {}

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
    std::lock_guard<std::mutex> lock(hub_->mu);
    Own().failure[peer].clear();
    return absl::OkStatus();
  }

  void Disconnect(int peer) override {
    if (!Valid(peer)) return;
    std::lock_guard<std::mutex> lock(hub_->mu);
    Own().failure[peer] = "disconnected";
    Mailbox& other = *hub_->mailboxes[peer];
    if (other.failure[self_].empty()) {
      other.failure[self_] = "failed: connection closed by the peer";
      other.failure_event = true;
      other.cv.notify_all();
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
    Mailbox::Queued queued;
    queued.message.header.assign(header.data(), header.size());
    queued.message.payload.resize(payload_bytes);
    uint8_t* p = queued.message.payload.data();
    for (size_t i = 0; i < num_segments; ++i) {
      if (segments[i].bytes == 0) continue;
      std::memcpy(p, segments[i].data, segments[i].bytes);
      p += segments[i].bytes;
    }
    std::lock_guard<std::mutex> lock(hub_->mu);
    OfferArrivalsLocked();
    if (!Own().failure[peer].empty()) return Unavailable(peer);
    Mailbox& other = *hub_->mailboxes[peer];
    other.from[self_].push_back(std::move(queued));
    other.cv.notify_all();
    return absl::OkStatus();
  }

  void SetReceiveTargetProvider(ReceiveTargetProvider* provider) override { provider_ = provider; }
  ReceiveTargetProvider* receive_target_provider() const override { return provider_; }

  // Targets are written while a message is offered, inside the receiver's own calls.
  absl::Status WaitTargetWrites(int peer, absl::Time deadline) override {
    if (!Valid(peer)) return BadPeer(peer);
    return absl::OkStatus();
  }

  absl::StatusOr<TransportMessage> Recv(int peer, absl::Time deadline) override {
    if (!Valid(peer)) return BadPeer(peer);
    std::unique_lock<std::mutex> lock(hub_->mu);
    Mailbox& own = Own();
    auto& queue = own.from[peer];
    WaitLocked(
        lock, deadline, [&] { return !queue.empty() || !own.failure[peer].empty(); },
        /*honor_wake=*/false);
    OfferArrivalsLocked();
    if (!queue.empty()) {
      TransportMessage message = std::move(queue.front().message);
      queue.pop_front();
      return message;
    }
    if (!own.failure[peer].empty()) return Unavailable(peer);
    return absl::DeadlineExceededError(
        absl::StrCat("no message from peer ", peer, " before the deadline"));
  }

  bool HasMessage(int peer) override {
    if (!Valid(peer)) return false;
    std::lock_guard<std::mutex> lock(hub_->mu);
    OfferArrivalsLocked();
    return !Own().from[peer].empty();
  }

  absl::Status WaitForActivity(absl::Time deadline) override {
    std::unique_lock<std::mutex> lock(hub_->mu);
    Mailbox& own = Own();
    WaitLocked(lock, deadline, [&] {
      return own.failure_event || std::any_of(own.from.begin(), own.from.end(),
                                              [](const auto& q) { return !q.empty(); });
    });
    own.failure_event = false;
    OfferArrivalsLocked();
    return absl::OkStatus();
  }

  void Wake() override {
    std::lock_guard<std::mutex> lock(hub_->mu);
    Own().wake_pending = true;
    Own().cv.notify_all();
  }

  absl::Status PeerStatus(int peer) override {
    if (!Valid(peer)) return BadPeer(peer);
    std::lock_guard<std::mutex> lock(hub_->mu);
    if (!Own().failure[peer].empty()) return Unavailable(peer);
    return absl::OkStatus();
  }

 private:
  bool Valid(int peer) const { return peer >= 0 && peer < hub_->num_peers(); }
  absl::Status BadPeer(int peer) const {
    return absl::InvalidArgumentError(
        absl::StrCat("peer ", peer, " is outside the inproc group of ", hub_->num_peers()));
  }
  Mailbox& Own() { return *hub_->mailboxes[self_]; }  // requires hub_->mu

  // Offers every queued message the provider has not seen, per sender in queue order, and
  // copies accepted payloads into their targets. Requires hub_->mu; runs on this
  // receiver's thread, as the provider requires.
  void OfferArrivalsLocked() {
    if (provider_ == nullptr) return;
    Mailbox& own = Own();
    for (int sender = 0; sender < hub_->num_peers(); ++sender) {
      for (Mailbox::Queued& q : own.from[sender]) {
        if (q.offered) continue;
        q.offered = true;
        TransportMessage& m = q.message;
        segments_.clear();
        if (!provider_->TargetFor(sender, m.header, m.payload.size(), &segments_)) continue;
        size_t total = 0;
        for (const ReceiveSegment& segment : segments_) total += segment.bytes;
        if (total != m.payload.size()) continue;  // a provider bug: keep the payload here
        const uint8_t* p = m.payload.data();
        for (const ReceiveSegment& segment : segments_) {
          if (segment.bytes > 0) std::memcpy(segment.data, p, segment.bytes);
          p += segment.bytes;
        }
        m.target = provider_;
        m.target_bytes = total;
        m.payload = PayloadBytes();
      }
    }
  }
  absl::Status Unavailable(int peer) {  // requires hub_->mu
    return absl::UnavailableError(absl::StrCat("peer ", peer, " ", Own().failure[peer]));
  }

  // Waits (hub_->mu held through `lock`) until ready(), a pending Wake(), or the deadline.
  // Returns true if a Wake() ended the wait.
  template <typename Ready>
  bool WaitLocked(std::unique_lock<std::mutex>& lock, absl::Time deadline, Ready ready,
                  bool honor_wake = true) {
    Mailbox& own = Own();
    for (;;) {
      if (ready()) return false;
      if (honor_wake && own.wake_pending) {
        own.wake_pending = false;
        return true;
      }
      const absl::Duration remaining = deadline - absl::Now();
      if (remaining <= absl::ZeroDuration()) return false;
      own.cv.wait_for(lock, absl::ToChronoNanoseconds(std::min(remaining, kMaxWaitSlice)));
    }
  }

  std::shared_ptr<Hub> hub_;
  const int self_;
  ReceiveTargetProvider* provider_ = nullptr;  // step thread only
  std::vector<ReceiveSegment> segments_;       // reused by OfferArrivalsLocked
};

}  // namespace

std::vector<std::unique_ptr<Transport>> MakeInprocTransportGroup(int num_peers) {
  auto hub = std::make_shared<Hub>(std::max(num_peers, 0));
  std::vector<std::unique_ptr<Transport>> group;
  for (int i = 0; i < num_peers; ++i) group.push_back(std::make_unique<InprocTransport>(hub, i));
  return group;
}

}  // namespace dxs
