// In-process backend of Transport for unit tests: the group shares one Hub, a set of
// mailboxes (one FIFO per (receiver, sender) pair) under one mutex, with a condition
// variable per receiver. Disconnect(peer) marks the pair failed in both directions, the
// way a broken connection looks to both ends, so tests can inject faults; Connect(peer)
// clears the caller's side only, like reconnecting one UCX endpoint.
#include <algorithm>
#include <condition_variable>
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
  std::vector<std::deque<TransportMessage>> from;  // indexed by sender
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

  absl::Status Send(int peer, std::string_view header, const void* payload,
                    size_t payload_bytes) override {
    if (!Valid(peer)) return BadPeer(peer);
    if (payload_bytes > 0 && payload == nullptr) {
      return absl::InvalidArgumentError(
          absl::StrCat("send to peer ", peer, ": null payload of ", payload_bytes, " bytes"));
    }
    TransportMessage message;
    message.header.assign(header.data(), header.size());
    const auto* bytes = static_cast<const uint8_t*>(payload);
    message.payload.assign(bytes, bytes + payload_bytes);
    std::lock_guard<std::mutex> lock(hub_->mu);
    if (!Own().failure[peer].empty()) return Unavailable(peer);
    Mailbox& other = *hub_->mailboxes[peer];
    other.from[self_].push_back(std::move(message));
    other.cv.notify_all();
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
    std::lock_guard<std::mutex> lock(hub_->mu);
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
  absl::Status Unavailable(int peer) {                // requires hub_->mu
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
};

}  // namespace

std::vector<std::unique_ptr<Transport>> MakeInprocTransportGroup(int num_peers) {
  auto hub = std::make_shared<Hub>(std::max(num_peers, 0));
  std::vector<std::unique_ptr<Transport>> group;
  for (int i = 0; i < num_peers; ++i) group.push_back(std::make_unique<InprocTransport>(hub, i));
  return group;
}

}  // namespace dxs
