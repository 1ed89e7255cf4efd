// Conformance suite of DataExchange, run against inproc, UCX (shared memory between the
// in-process workers) and UCX restricted to TCP. Every peer runs on its own thread, as step
// threads do, and posts in its own order; nothing waits for a send before posting the
// receives that would let it finish.
#include "dataplane/transport/data_exchange.h"

#include <gtest/gtest.h>
#include <time.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <numeric>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "dataplane/transport/transport.h"
#include "tests/common/scoped_env.h"

namespace dxs {
namespace {

constexpr int kNumPeers = 4;
constexpr uint8_t kUntouched = 0xee;

using testing::ScopedEnv;

// How late a wake-up or a deadline may be noticed: far above the scheduling delays of a
// loaded machine, far below the 10 s fallback deadlines, so that a wait that runs to its
// fallback instead of waking still fails.
constexpr absl::Duration kLate = absl::Seconds(3);

// An idle wait's CPU time is measured over kIdleWindow and must stay under a tenth of it: a
// spinning loop burns close to all of it, ten times the bound, while a wait that sleeps in
// the kernel burns next to nothing, however fast or loaded the machine is.
constexpr absl::Duration kIdleWindow = absl::Seconds(1);
constexpr absl::Duration kIdleCpu = absl::Milliseconds(100);  // a tenth of kIdleWindow

uint8_t PatternByte(uint64_t seed, size_t j) {
  return static_cast<uint8_t>(seed * 131 + j * 7 + (j >> 9) + (seed >> 8));
}
std::vector<uint8_t> Pattern(uint64_t seed, size_t bytes) {
  std::vector<uint8_t> data(bytes);
  for (size_t j = 0; j < bytes; ++j) data[j] = PatternByte(seed, j);
  return data;
}

// Receive memory with guard bytes on both sides, initially kUntouched.
class GuardedBuffer {
 public:
  explicit GuardedBuffer(size_t bytes) : memory_(bytes + 2 * kGuard, kUntouched) {}
  uint8_t* data() { return memory_.data() + kGuard; }
  size_t size() const { return memory_.size() - 2 * kGuard; }
  std::vector<uint8_t> contents() const {
    return {memory_.begin() + kGuard, memory_.end() - kGuard};
  }
  bool GuardsIntact() const {
    for (size_t i = 0; i < kGuard; ++i) {
      if (memory_[i] != kUntouched || memory_[memory_.size() - 1 - i] != kUntouched) return false;
    }
    return true;
  }
  bool Untouched() const {
    return std::all_of(memory_.begin(), memory_.end(), [](uint8_t b) { return b == kUntouched; });
  }

 private:
  static constexpr size_t kGuard = 16;
  std::vector<uint8_t> memory_;
};

absl::Duration ThreadCpuTime() {
  timespec ts;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return absl::DurationFromTimespec(ts);
}

Transfer SendTo(int peer, const void* data, size_t bytes) {
  return {Transfer::Kind::kSend, peer, const_cast<void*>(data), bytes};
}
Transfer RecvFrom(int peer, void* data, size_t bytes) {
  return {Transfer::Kind::kRecv, peer, data, bytes};
}

class DataExchangeTest : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    const std::string& backend = GetParam();
    if (backend == "inproc") {
      group_ = MakeInprocTransportGroup(kNumPeers);
    } else {
      std::optional<ScopedEnv> tls;
      if (backend == "ucx_tcp") tls.emplace("UCX_TLS", "tcp");
      // ucx_data_ep: every send on the peers' data endpoints, the path of GPU memory.
      UcxTransportOptions options;
      options.host_sends_on_data_endpoint = backend == "ucx_data_ep";
      for (int i = 0; i < kNumPeers; ++i) {
        auto transport = MakeUcxTransport(options);
        ASSERT_TRUE(transport.ok()) << transport.status();
        group_.push_back(std::move(*transport));
      }
    }
    for (int i = 0; i < kNumPeers; ++i) {
      ASSERT_TRUE(group_[i]->SetSelf(i).ok());
      addresses_.push_back(group_[i]->LocalAddress());
    }
    for (int i = 0; i < kNumPeers; ++i) {
      for (int j = 0; j < kNumPeers; ++j) {
        if (i == j) continue;
        ASSERT_TRUE(group_[i]->Connect(j, addresses_[j]).ok());
      }
    }
    // Zero-size all-to-all: UCX sets connections up while every side makes progress.
    RunPeers([&](int self) {
      std::vector<Transfer> transfers;
      for (int peer = 0; peer < kNumPeers; ++peer) {
        if (peer == self) continue;
        transfers.push_back(SendTo(peer, nullptr, 0));
        transfers.push_back(RecvFrom(peer, nullptr, 0));
      }
      EXPECT_TRUE(Exchange(self, /*tag=*/0, transfers).ok());
    });
  }

  bool IsUcx() const { return GetParam() != "inproc"; }
  Transport& peer(int i) { return *group_[i]; }

  // Runs fn(i) for every peer i on a thread of its own.
  void RunPeers(const std::function<void(int)>& fn, int num_peers = kNumPeers) {
    std::vector<std::thread> threads;
    for (int i = 0; i < num_peers; ++i) threads.emplace_back(fn, i);
    for (std::thread& t : threads) t.join();
  }

  // Posts and waits for one group.
  absl::Status Exchange(int self, uint64_t tag, const std::vector<Transfer>& transfers,
                        absl::Duration timeout = absl::Seconds(30)) {
    auto id = peer(self).PostExchange(tag, transfers.data(), transfers.size());
    if (!id.ok()) return id.status();
    return peer(self).WaitExchange(*id, absl::Now() + timeout);
  }

  // Takes peer i down the way a crash looks to the others. UCX: the transport goes away,
  // closing its sockets (it first makes progress, as a live process does, so that UCX's
  // connection set-up has finished: 1.13 asserts when a worker is destroyed with a wireup
  // reply still queued). inproc: every pair with it fails. Peer i's own thread must be idle.
  void KillPeer(int i) {
    if (IsUcx()) {
      (void)group_[i]->WaitForActivity(absl::Now() + absl::Milliseconds(20));
      group_[i].reset();
      return;
    }
    for (int j = 0; j < kNumPeers; ++j) {
      if (j != i) group_[i]->Disconnect(j);
    }
  }

  std::vector<std::unique_ptr<Transport>> group_;
  std::vector<std::string> addresses_;
};

// Sizes crossing UCX's eager/rendezvous switch, zero included.
const size_t kSizes[] = {0, 1, 1000, 8 << 10, 64 << 10, 300 << 10, (1 << 20) + 3, 4 << 20};

// Bytes of the k-th message from src to dst in round `round`.
size_t SizeOf(int src, int dst, int k, int round) {
  return kSizes[(src * 7 + dst * 3 + k * 5 + round) % std::size(kSizes)];
}
uint64_t SeedOf(int src, int dst, int k, int round) {
  return (static_cast<uint64_t>(round) << 24) | (src << 16) | (dst << 8) | k;
}

// Every peer sends three messages to every other and receives theirs, after a random delay,
// in entries shuffled per peer and round and spread over three groups under three tags
// (which tag a message travels under depends on its pair and index, so both sides agree),
// posted and waited for in random orders: matching must follow the k-th send / k-th receive
// rule per tag whatever the order of posting.
TEST_P(DataExchangeTest, AllToAllInRandomOrders) {
  constexpr int kRounds = 20;
  constexpr int kPerPair = 3;
  constexpr int kTagsPerRound = 3;
  // The group, and so the tag, of message k from src to dst.
  auto group_of = [](int src, int dst, int k, int round) {
    return (src * 5 + dst * 3 + k * 7 + round) % kTagsPerRound;
  };
  RunPeers([&](int self) {
    std::mt19937 rng(1234 + self);
    for (int round = 0; round < kRounds; ++round) {
      struct Entry {
        Transfer::Kind kind;
        int peer;
      };
      std::vector<Entry> entries;
      for (int p = 0; p < kNumPeers; ++p) {
        if (p == self) continue;
        for (int k = 0; k < kPerPair; ++k) {
          entries.push_back({Transfer::Kind::kSend, p});
          entries.push_back({Transfer::Kind::kRecv, p});
        }
      }
      std::shuffle(entries.begin(), entries.end(), rng);
      // The k-th entry of a (kind, peer) in posting order carries message k; it goes into
      // the group of its tag, keeping that order.
      std::vector<std::vector<uint8_t>> sends;
      std::vector<std::unique_ptr<GuardedBuffer>> recvs;
      std::vector<std::pair<int, int>> recv_ids;  // (peer, k)
      std::vector<int> sent(kNumPeers), received(kNumPeers);
      std::vector<std::vector<Transfer>> groups(kTagsPerRound);
      sends.reserve(entries.size());
      for (const Entry& e : entries) {
        if (e.kind == Transfer::Kind::kSend) {
          const int k = sent[e.peer]++;
          sends.push_back(Pattern(SeedOf(self, e.peer, k, round), SizeOf(self, e.peer, k, round)));
          groups[group_of(self, e.peer, k, round)].push_back(
              SendTo(e.peer, sends.back().data(), sends.back().size()));
        } else {
          const int k = received[e.peer]++;
          recvs.push_back(std::make_unique<GuardedBuffer>(SizeOf(e.peer, self, k, round)));
          recv_ids.emplace_back(e.peer, k);
          groups[group_of(e.peer, self, k, round)].push_back(
              RecvFrom(e.peer, recvs.back()->data(), recvs.back()->size()));
        }
      }
      absl::SleepFor(absl::Microseconds(std::uniform_int_distribution<int>(0, 2000)(rng)));
      std::vector<int> order(kTagsPerRound);
      std::iota(order.begin(), order.end(), 0);
      std::shuffle(order.begin(), order.end(), rng);
      std::vector<ExchangeId> ids(kTagsPerRound);
      for (int g : order) {
        const uint64_t tag = 100 + round * kTagsPerRound + g;
        auto id = peer(self).PostExchange(tag, groups[g].data(), groups[g].size());
        ASSERT_TRUE(id.ok()) << id.status();
        ids[g] = *id;
      }
      std::shuffle(order.begin(), order.end(), rng);
      for (int g : order) {
        absl::Status status = peer(self).WaitExchange(ids[g], absl::Now() + absl::Seconds(30));
        ASSERT_TRUE(status.ok()) << "peer " << self << " round " << round << ": " << status;
      }
      for (size_t i = 0; i < recvs.size(); ++i) {
        const auto [from, k] = recv_ids[i];
        ASSERT_TRUE(recvs[i]->contents() ==
                    Pattern(SeedOf(from, self, k, round), SizeOf(from, self, k, round)))
            << "peer " << self << " round " << round << ": message " << k << " from " << from;
        ASSERT_TRUE(recvs[i]->GuardsIntact());
      }
    }
  });
}

// Every peer posts its sends as one group and its receives as a second, then waits for the
// sends first: large payloads both ways at once finish only if no backend needs the receive
// posted before it accepts a send, or buffers the sends.
TEST_P(DataExchangeTest, SendsPostedBeforeReceives) {
  constexpr size_t kBytes = 8 << 20;
  RunPeers([&](int self) {
    const std::vector<uint8_t> payload = Pattern(self, kBytes);
    std::vector<GuardedBuffer> inputs;
    for (int p = 0; p < kNumPeers; ++p) inputs.emplace_back(p == self ? 0 : kBytes);
    std::vector<Transfer> sends, recvs;
    for (int p = 0; p < kNumPeers; ++p) {
      if (p == self) continue;
      sends.push_back(SendTo(p, payload.data(), payload.size()));
      recvs.push_back(RecvFrom(p, inputs[p].data(), kBytes));
    }
    auto send_id = peer(self).PostExchange(7, sends.data(), sends.size());
    ASSERT_TRUE(send_id.ok()) << send_id.status();
    auto recv_id = peer(self).PostExchange(7, recvs.data(), recvs.size());
    ASSERT_TRUE(recv_id.ok()) << recv_id.status();
    const absl::Time deadline = absl::Now() + absl::Seconds(60);
    ASSERT_TRUE(peer(self).WaitExchange(*send_id, deadline).ok());
    ASSERT_TRUE(peer(self).WaitExchange(*recv_id, deadline).ok());
    for (int p = 0; p < kNumPeers; ++p) {
      if (p == self) continue;
      EXPECT_TRUE(inputs[p].contents() == Pattern(p, kBytes)) << self << "<-" << p;
    }
  });
}

// Zero-size entries, with and without a buffer, among others: each matches one zero-size
// entry of the peer, and nothing is written for it.
TEST_P(DataExchangeTest, ZeroSizeEntriesAreTransfers) {
  RunPeers(
      [&](int self) {
        const int other = 1 - self;
        const std::vector<uint8_t> payload = Pattern(self, 5000);
        GuardedBuffer empty_target(0), first(5000), second(0), third(5000);
        std::vector<Transfer> transfers = {
            SendTo(other, nullptr, 0),
            SendTo(other, payload.data(), payload.size()),
            SendTo(other, payload.data(), 0),
            SendTo(other, payload.data(), payload.size()),
            RecvFrom(other, nullptr, 0),
            RecvFrom(other, first.data(), 5000),
            RecvFrom(other, empty_target.data(), 0),
            RecvFrom(other, third.data(), 5000),
        };
        // Peer 1 posts its receives first; each kind keeps its order, which matching follows.
        if (self == 1) std::rotate(transfers.begin(), transfers.begin() + 4, transfers.end());
        ASSERT_TRUE(Exchange(self, 9, transfers).ok());
        EXPECT_TRUE(first.contents() == Pattern(other, 5000));
        EXPECT_TRUE(third.contents() == Pattern(other, 5000));
        EXPECT_TRUE(empty_target.Untouched());
        EXPECT_TRUE(first.GuardsIntact() && third.GuardsIntact());
      },
      2);
}

// An exchange where nobody has anything to send still takes place on every pair (the
// empty-batch step), and an empty group is done at once.
TEST_P(DataExchangeTest, GroupOfOnlyZeroSizeEntries) {
  RunPeers([&](int self) {
    for (int round = 0; round < 20; ++round) {
      std::vector<Transfer> transfers;
      for (int p = 0; p < kNumPeers; ++p) {
        if (p == self) continue;
        transfers.push_back(RecvFrom(p, nullptr, 0));
        transfers.push_back(SendTo(p, nullptr, 0));
      }
      ASSERT_TRUE(Exchange(self, 300 + round, transfers).ok()) << self << " round " << round;
    }
  });
  auto empty = peer(0).PostExchange(1, nullptr, 0);
  ASSERT_TRUE(empty.ok()) << empty.status();
  EXPECT_TRUE(peer(0).ExchangeDone(*empty));
  EXPECT_TRUE(peer(0).WaitExchange(*empty, absl::Now()).ok());
}

// The receiving group fails with INTERNAL whether the message is shorter or longer than the
// receive, eager or rendezvous; the sending group completes or fails, but never hangs.
TEST_P(DataExchangeTest, SizeMismatchFailsTheGroup) {
  struct Case {
    size_t sent, expected;
  };
  const Case kCases[] = {{100, 200}, {300, 200}, {1 << 20, 2 << 20}, {3 << 20, 2 << 20}, {0, 8}};
  uint64_t tag = 400;
  for (const Case& c : kCases) {
    const std::vector<uint8_t> payload = Pattern(1, c.sent);
    GuardedBuffer target(c.expected);
    absl::Status send_status, recv_status;
    RunPeers(
        [&](int self) {
          if (self == 0) {
            send_status = Exchange(0, tag, {SendTo(1, payload.data(), c.sent)}, absl::Seconds(10));
          } else {
            recv_status =
                Exchange(1, tag, {RecvFrom(0, target.data(), c.expected)}, absl::Seconds(10));
          }
        },
        2);
    EXPECT_EQ(recv_status.code(), absl::StatusCode::kInternal)
        << c.sent << " sent, " << c.expected << " expected: " << recv_status;
    EXPECT_NE(recv_status.message().find("peer 0"), std::string::npos) << recv_status;
    EXPECT_TRUE(send_status.ok() || send_status.code() == absl::StatusCode::kInternal)
        << send_status;
    EXPECT_TRUE(target.GuardsIntact());
    ++tag;
  }
  // The pair still exchanges under other tags afterwards.
  RunPeers(
      [&](int self) {
        uint8_t byte = 1;
        ASSERT_TRUE(
            Exchange(self, 499, {SendTo(1 - self, &byte, 1), RecvFrom(1 - self, &byte, 1)}).ok());
      },
      2);
}

// Several groups in flight: different tags posted in different orders on the two sides,
// and two groups under one tag that match in posting order; waited for in either order.
TEST_P(DataExchangeTest, GroupsInFlightCompleteInEitherOrder) {
  constexpr size_t kBytes = 2 << 20;  // rendezvous: a group's sends wait for its receives
  RunPeers(
      [&](int self) {
        const int other = 1 - self;
        // (tag, seed) of the groups in this side's posting order; the two tag-5 groups keep
        // their relative order on both sides.
        std::vector<std::pair<uint64_t, int>> groups = {{5, 0}, {6, 1}, {5, 2}, {7, 3}};
        if (self == 1) groups = {{7, 3}, {6, 1}, {5, 0}, {5, 2}};
        std::vector<std::vector<uint8_t>> payloads;
        std::vector<std::unique_ptr<GuardedBuffer>> targets;
        std::vector<ExchangeId> ids;
        for (const auto& [tag, seed] : groups) {
          payloads.push_back(Pattern(seed * 2 + self, kBytes + seed));
          targets.push_back(std::make_unique<GuardedBuffer>(kBytes + seed));
          const Transfer transfers[] = {SendTo(other, payloads.back().data(), kBytes + seed),
                                        RecvFrom(other, targets.back()->data(), kBytes + seed)};
          auto id = peer(self).PostExchange(tag, transfers, 2);
          ASSERT_TRUE(id.ok()) << id.status();
          ids.push_back(*id);
        }
        std::vector<size_t> order = {0, 1, 2, 3};
        if (self == 0) order = {3, 2, 1, 0};
        for (size_t i : order) {
          ASSERT_TRUE(peer(self).WaitExchange(ids[i], absl::Now() + absl::Seconds(30)).ok());
          const int seed = groups[i].second;
          EXPECT_TRUE(targets[i]->contents() == Pattern(seed * 2 + other, kBytes + seed))
              << "side " << self << " group " << seed;
        }
        // Waited for: forgotten.
        EXPECT_EQ(peer(self).WaitExchange(ids[0], absl::Now()).code(), absl::StatusCode::kNotFound);
      },
      2);
}

TEST_P(DataExchangeTest, ExchangeDoneIsANonBlockingCheck) {
  GuardedBuffer target(64 << 10);
  const Transfer recv = RecvFrom(1, target.data(), target.size());
  auto id = peer(0).PostExchange(11, &recv, 1);
  ASSERT_TRUE(id.ok()) << id.status();
  absl::SleepFor(absl::Milliseconds(20));
  EXPECT_FALSE(peer(0).ExchangeDone(*id));
  const std::vector<uint8_t> payload = Pattern(3, target.size());
  std::thread sender(
      [&] { EXPECT_TRUE(Exchange(1, 11, {SendTo(0, payload.data(), payload.size())}).ok()); });
  const absl::Time give_up = absl::Now() + absl::Seconds(10);
  while (!peer(0).ExchangeDone(*id) && absl::Now() < give_up) {
    absl::SleepFor(absl::Microseconds(50));
  }
  sender.join();
  EXPECT_TRUE(peer(0).ExchangeDone(*id));
  const absl::Time start = absl::Now();
  EXPECT_TRUE(peer(0).WaitExchange(*id, start + absl::Seconds(10)).ok());
  EXPECT_LT(absl::Now() - start, kLate);
  EXPECT_TRUE(target.contents() == payload);
  EXPECT_TRUE(peer(0).ExchangeDone(*id));  // unknown ids are done
}

// At the deadline the group is cancelled: a send that arrives later under the same tag is
// not written into the receive memory the caller got back.
TEST_P(DataExchangeTest, DeadlineCancelsTheGroup) {
  for (size_t bytes : {size_t{1000}, size_t{2} << 20}) {
    const uint64_t tag = 500 + bytes % 97;
    GuardedBuffer target(bytes);
    std::vector<Transfer> transfers = {RecvFrom(1, target.data(), bytes), SendTo(2, nullptr, 0)};
    const absl::Duration wait = absl::Milliseconds(200);
    const absl::Time start = absl::Now();
    absl::Status status = Exchange(0, tag, transfers, wait);
    const absl::Duration elapsed = absl::Now() - start;
    EXPECT_EQ(status.code(), absl::StatusCode::kDeadlineExceeded) << status;
    EXPECT_NE(status.message().find("receive from 1"), std::string::npos) << status;
    EXPECT_GE(elapsed, wait);
    EXPECT_LT(elapsed, wait + kLate);
    // Peer 1 sends under the cancelled tag now; peer 0 keeps making progress (an exchange
    // with peer 3) while it could arrive.
    const std::vector<uint8_t> payload = Pattern(9, bytes);
    absl::Status late_send;
    RunPeers([&](int self) {
      if (self == 1) {
        late_send = Exchange(1, tag, {SendTo(0, payload.data(), bytes)}, absl::Milliseconds(300));
      } else if (self == 0 || self == 3) {
        const int other = 3 - self;
        for (int i = 0; i < 20; ++i) {
          uint8_t byte = 0;
          ASSERT_TRUE(
              Exchange(self, 600 + i, {SendTo(other, &byte, 1), RecvFrom(other, &byte, 1)}).ok());
          absl::SleepFor(absl::Milliseconds(10));
        }
      }
    });
    // Unmatched: it may stay pending (rendezvous, inproc) or have left (eager).
    EXPECT_TRUE(late_send.ok() || late_send.code() == absl::StatusCode::kDeadlineExceeded)
        << late_send;
    EXPECT_TRUE(target.Untouched()) << bytes << " bytes";
  }
}

// A peer that fails while the group waits for it: UNAVAILABLE naming it, within the
// transport's fault detection, and the rest of the group (transfers with live peers) is
// cancelled without writing.
TEST_P(DataExchangeTest, FailedPeerMakesTheGroupUnavailable) {
  if (GetParam() == "ucx" || GetParam() == "ucx_data_ep") {
    GTEST_SKIP() << "over shared memory UCX notices a dead peer by its process, which here is "
                    "this one; ucx_transport_test kills a real process mid-exchange";
  }
  constexpr size_t kBytes = 1 << 20;
  GuardedBuffer from_dead(kBytes), from_live(kBytes);
  const std::vector<uint8_t> payload = Pattern(4, kBytes);
  const std::vector<Transfer> transfers = {RecvFrom(1, from_dead.data(), kBytes),
                                           RecvFrom(2, from_live.data(), kBytes),
                                           SendTo(1, payload.data(), kBytes)};
  auto id = peer(0).PostExchange(700, transfers.data(), transfers.size());
  ASSERT_TRUE(id.ok()) << id.status();
  std::thread killer([&] {
    absl::SleepFor(absl::Milliseconds(50));
    KillPeer(1);
  });
  const absl::Time start = absl::Now();
  absl::Status status = peer(0).WaitExchange(*id, start + absl::Seconds(30));
  const absl::Duration elapsed = absl::Now() - start;
  killer.join();
  EXPECT_EQ(status.code(), absl::StatusCode::kUnavailable) << status;
  EXPECT_NE(status.message().find("peer 1"), std::string::npos) << status;
  EXPECT_LT(elapsed, absl::Seconds(5));
  std::printf("failed peer detected after %s: %s\n", absl::FormatDuration(elapsed).c_str(),
              status.ToString().c_str());
  EXPECT_EQ(peer(0).PostExchange(701, transfers.data(), 1).status().code(),
            absl::StatusCode::kUnavailable);
  // Peer 2 sends what peer 0 had asked for, too late: nothing is written.
  RunPeers([&](int self) {
    if (self == 2) {
      (void)Exchange(2, 700, {SendTo(0, payload.data(), kBytes)}, absl::Milliseconds(300));
    } else if (self == 0) {
      for (int i = 0; i < 30; ++i) {
        (void)peer(0).ExchangeDone(999);  // makes progress
        absl::SleepFor(absl::Milliseconds(10));
      }
    }
  });
  EXPECT_TRUE(from_dead.Untouched());
  EXPECT_TRUE(from_live.Untouched());
}

// A peer the control plane declares dead (SetPeerDeclaredDead, from another thread, as the
// membership thread does) ends a wait on it at once with UNAVAILABLE, the group's and a
// Recv's, though its connection is fine: a partitioned or frozen peer closes nothing. Once
// declared live again, the same connection exchanges again.
TEST_P(DataExchangeTest, DeclaredDeadPeerEndsTheWait) {
  if (!IsUcx()) GTEST_SKIP() << "inproc ignores the control plane's view";
  GuardedBuffer target(1000);
  const Transfer recv = RecvFrom(1, target.data(), 1000);
  auto id = peer(0).PostExchange(900, &recv, 1);
  ASSERT_TRUE(id.ok()) << id.status();
  std::thread declare([&] {
    absl::SleepFor(absl::Milliseconds(50));
    peer(0).SetPeerDeclaredDead(1, "is dead in the test's view");
  });
  const absl::Time start = absl::Now();
  absl::Status status = peer(0).WaitExchange(*id, start + absl::Seconds(30));
  declare.join();
  EXPECT_EQ(status.code(), absl::StatusCode::kUnavailable) << status;
  EXPECT_NE(status.message().find("peer 1 is dead in the test's view"), std::string::npos)
      << status;
  EXPECT_LT(absl::Now() - start, absl::Seconds(5));
  absl::StatusOr<TransportMessage> m = peer(0).Recv(1, absl::Now() + absl::Seconds(30));
  EXPECT_EQ(m.status().code(), absl::StatusCode::kUnavailable) << m.status();
  EXPECT_TRUE(target.Untouched());
  peer(0).SetPeerDeclaredDead(1, "");
  RunPeers(
      [&](int self) {
        const uint8_t out = static_cast<uint8_t>(self);
        uint8_t in = 0xff;
        ASSERT_TRUE(
            Exchange(self, 901, {SendTo(1 - self, &out, 1), RecvFrom(1 - self, &in, 1)}).ok());
        EXPECT_EQ(in, 1 - self);
      },
      2);
}

// Disconnect on the waiting side ends the wait at once.
TEST_P(DataExchangeTest, DisconnectEndsTheWait) {
  GuardedBuffer target(1000);
  const Transfer recv = RecvFrom(1, target.data(), 1000);
  auto id = peer(0).PostExchange(800, &recv, 1);
  ASSERT_TRUE(id.ok()) << id.status();
  std::thread disconnect([&] {
    absl::SleepFor(absl::Milliseconds(50));
    if (!IsUcx()) peer(0).Disconnect(1);  // inproc: from another thread
  });
  if (IsUcx()) {
    // UCX's worker is the step thread's alone: disconnect from it, before waiting.
    disconnect.join();
    peer(0).Disconnect(1);
  }
  const absl::Time start = absl::Now();
  absl::Status status = peer(0).WaitExchange(*id, start + absl::Seconds(30));
  if (disconnect.joinable()) disconnect.join();
  EXPECT_EQ(status.code(), absl::StatusCode::kUnavailable) << status;
  EXPECT_NE(status.message().find("peer 1"), std::string::npos) << status;
  EXPECT_LT(absl::Now() - start, absl::Seconds(1));
  // Reconnected, the pair exchanges again (under a fresh tag).
  ASSERT_TRUE(peer(0).Connect(1, addresses_[1]).ok());
  RunPeers(
      [&](int self) {
        // Peer 1 replaces its side as well: its endpoint still points at the closed one.
        if (self == 1) {
          ASSERT_TRUE(peer(1).Connect(0, addresses_[0]).ok());
        }
        const uint8_t out = static_cast<uint8_t>(self);
        uint8_t in = 0xff;
        ASSERT_TRUE(
            Exchange(self, 801, {SendTo(1 - self, &out, 1), RecvFrom(1 - self, &in, 1)}).ok());
        EXPECT_EQ(in, 1 - self);
      },
      2);
}

// A step waiting for its exchange is not cut short by new work arriving; the wake is kept
// for the next WaitForActivity.
TEST_P(DataExchangeTest, WakeDoesNotInterruptWaitExchange) {
  GuardedBuffer target(1000);
  const Transfer recv = RecvFrom(1, target.data(), 1000);
  auto id = peer(0).PostExchange(950, &recv, 1);
  ASSERT_TRUE(id.ok()) << id.status();
  std::thread waker([&] {
    absl::SleepFor(absl::Milliseconds(20));
    peer(0).Wake();
  });
  const absl::Time start = absl::Now();
  absl::Status status = peer(0).WaitExchange(*id, start + absl::Milliseconds(150));
  waker.join();
  EXPECT_EQ(status.code(), absl::StatusCode::kDeadlineExceeded) << status;
  EXPECT_GE(absl::Now() - start, absl::Milliseconds(150));
  const absl::Time wait_start = absl::Now();
  ASSERT_TRUE(peer(0).WaitForActivity(wait_start + absl::Seconds(10)).ok());
  EXPECT_LT(absl::Now() - wait_start, kLate);
}

TEST_P(DataExchangeTest, IdleWaitDoesNotBurnCpu) {
  GuardedBuffer target(1000);
  const Transfer recv = RecvFrom(1, target.data(), 1000);
  auto id = peer(0).PostExchange(900, &recv, 1);
  ASSERT_TRUE(id.ok()) << id.status();
  const absl::Duration cpu_before = ThreadCpuTime();
  EXPECT_EQ(peer(0).WaitExchange(*id, absl::Now() + kIdleWindow).code(),
            absl::StatusCode::kDeadlineExceeded);
  const absl::Duration cpu = ThreadCpuTime() - cpu_before;
  EXPECT_LT(cpu, kIdleCpu) << "CPU time spent waiting " << kIdleWindow << ": " << cpu;
}

// The control channel and the exchange share connections without disturbing each other:
// counts go first as messages, then the rows they size.
TEST_P(DataExchangeTest, CountsOverMessagesThenRows) {
  RunPeers(
      [&](int self) {
        const int other = 1 - self;
        for (int step = 0; step < 10; ++step) {
          const uint64_t rows = (step * 37 + self * 11) % 9;  // 0 included
          const std::vector<uint8_t> payload = Pattern(step * 2 + self, rows * 4096);
          ASSERT_TRUE(peer(self).Send(other, "", &rows, sizeof(rows)).ok());
          auto counts = peer(self).Recv(other, absl::Now() + absl::Seconds(10));
          ASSERT_TRUE(counts.ok()) << counts.status();
          uint64_t incoming = 0;
          ASSERT_EQ(counts->payload.size(), sizeof(incoming));
          std::memcpy(&incoming, counts->payload.data(), sizeof(incoming));
          GuardedBuffer target(incoming * 4096);
          ASSERT_TRUE(Exchange(self, 1000 + step,
                               {SendTo(other, payload.data(), payload.size()),
                                RecvFrom(other, target.data(), target.size())})
                          .ok());
          EXPECT_TRUE(target.contents() == Pattern(step * 2 + other, incoming * 4096));
        }
      },
      2);
}

TEST_P(DataExchangeTest, BadArgumentsPostNothing) {
  uint8_t byte = 0;
  const Transfer too_large_tag = SendTo(1, &byte, 1);
  EXPECT_EQ(peer(0).PostExchange(kMaxExchangeTag + 1, &too_large_tag, 1).status().code(),
            absl::StatusCode::kInvalidArgument);
  const Transfer no_buffer = RecvFrom(1, nullptr, 10);
  EXPECT_EQ(peer(0).PostExchange(1, &no_buffer, 1).status().code(),
            absl::StatusCode::kInvalidArgument);
  const Transfer bad_peer = SendTo(-1, &byte, 1);
  EXPECT_EQ(peer(0).PostExchange(1, &bad_peer, 1).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(peer(0).WaitExchange(12345, absl::Now()).code(), absl::StatusCode::kNotFound);
  // Nothing was posted: a matching exchange pairs with the sender's first real send.
  RunPeers(
      [&](int self) {
        uint8_t value = static_cast<uint8_t>(10 + self);
        const Transfer t = self == 0 ? SendTo(1, &value, 1) : RecvFrom(0, &value, 1);
        ASSERT_TRUE(Exchange(self, 1, {t}).ok());
        EXPECT_EQ(value, 10);
      },
      2);
}

TEST_P(DataExchangeTest, DeviceMemoryIsPassedOrRefused) {
  uint8_t byte = 0;
  Transfer device = SendTo(1, &byte, 1);
  device.memory = MemoryType::kDevice;
  EXPECT_TRUE(peer(0).SupportsMemory(MemoryType::kHost));
  auto id = peer(0).PostExchange(1, &device, 1);
  EXPECT_EQ(id.ok(), peer(0).SupportsMemory(MemoryType::kDevice)) << id.status();
  if (IsUcx()) {
    // Debian's UCX has no CUDA; a UCX with CUDA would accept (and need real device memory).
    if (id.ok()) GTEST_SKIP() << "UCX supports device memory here";
    EXPECT_EQ(id.status().code(), absl::StatusCode::kUnimplemented) << id.status();
    EXPECT_NE(id.status().message().find("CUDA"), std::string::npos) << id.status();
  } else {
    ASSERT_TRUE(id.ok()) << id.status();  // one address space: copied like host memory
    RunPeers(
        [&](int self) {
          if (self == 1) {
            uint8_t value = 0;
            Transfer recv = RecvFrom(0, &value, 1);
            recv.memory = MemoryType::kDevice;
            ASSERT_TRUE(Exchange(1, 1, {recv}).ok());
          } else {
            EXPECT_TRUE(peer(0).WaitExchange(*id, absl::Now() + absl::Seconds(5)).ok());
          }
        },
        2);
  }
}

// A mapped region: peer 1 maps peer 0's region, stores into it and publishes with a
// zero-size transfer; peer 0 reads the stores after receiving it, then answers in place
// the same way. Where no memory is shared (UCX over TCP) the peers say so and nothing maps.
TEST_P(DataExchangeTest, MappedRegionsCarryStoresPublishedByATransfer) {
  constexpr size_t kBytes = (1 << 20) + 123;
  absl::StatusOr<MappedRegion> region = peer(0).MapRegion(kBytes);
  ASSERT_TRUE(region.ok()) << region.status();
  ASSERT_GE(region->bytes, kBytes);
  ASSERT_EQ(reinterpret_cast<uintptr_t>(region->data) % 4096, 0u);
  const auto* bytes = static_cast<const uint8_t*>(region->data);
  EXPECT_TRUE(std::all_of(bytes, bytes + kBytes, [](uint8_t b) { return b == 0; }));
  const bool shared = GetParam() != "ucx_tcp";
  EXPECT_EQ(peer(1).CanAttachPeerRegions(0), shared);
  EXPECT_EQ(peer(0).CanAttachPeerRegions(1), shared);
  absl::StatusOr<PeerRegion> mapped = peer(1).AttachPeerRegion(0, region->key);
  if (!shared) {
    EXPECT_EQ(mapped.status().code(), absl::StatusCode::kUnimplemented) << mapped.status();
    peer(0).UnmapRegion(region->data);
    return;
  }
  ASSERT_TRUE(mapped.ok()) << mapped.status();
  EXPECT_EQ(mapped->bytes, region->bytes);
  absl::StatusOr<PeerRegion> again = peer(1).AttachPeerRegion(0, region->key);
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(again->data, mapped->data);
  const std::vector<uint8_t> request = Pattern(7, kBytes), answer = Pattern(8, kBytes / 2);
  RunPeers(
      [&](int self) {
        if (self == 1) {
          std::memcpy(mapped->data, request.data(), kBytes);
          ASSERT_TRUE(Exchange(1, 5, {SendTo(0, nullptr, 0)}).ok());
          ASSERT_TRUE(Exchange(1, 6, {RecvFrom(0, nullptr, 0)}).ok());
          EXPECT_EQ(std::memcmp(mapped->data, answer.data(), answer.size()), 0);
        } else {
          ASSERT_TRUE(Exchange(0, 5, {RecvFrom(1, nullptr, 0)}).ok());
          EXPECT_EQ(std::memcmp(region->data, request.data(), kBytes), 0);
          std::memcpy(region->data, answer.data(), answer.size());
          ASSERT_TRUE(Exchange(0, 6, {SendTo(1, nullptr, 0)}).ok());
        }
      },
      2);
  peer(0).UnmapRegion(region->data);
}

TEST_P(DataExchangeTest, BadRegionKeysAreRefused) {
  absl::StatusOr<MappedRegion> region = peer(0).MapRegion(4096);
  ASSERT_TRUE(region.ok()) << region.status();
  EXPECT_EQ(peer(0).MapRegion(0).status().code(), absl::StatusCode::kInvalidArgument);
  if (GetParam() == "ucx_tcp") GTEST_SKIP() << "nothing maps over TCP";
  for (const std::string& key : {std::string(), std::string("short"), std::string(64, 'x')}) {
    absl::StatusOr<PeerRegion> mapped = peer(1).AttachPeerRegion(0, key);
    EXPECT_EQ(mapped.status().code(), absl::StatusCode::kInvalidArgument) << mapped.status();
  }
  if (!IsUcx()) {
    // inproc knows every region: another peer's key, or one unmapped, names none of 0's.
    EXPECT_FALSE(peer(1).AttachPeerRegion(2, region->key).ok());
    absl::StatusOr<MappedRegion> other = peer(0).MapRegion(4096);
    ASSERT_TRUE(other.ok());
    peer(0).UnmapRegion(other->data);
    EXPECT_EQ(peer(1).AttachPeerRegion(0, other->key).status().code(),
              absl::StatusCode::kInvalidArgument);
  }
  peer(1).Disconnect(0);
  EXPECT_EQ(peer(1).AttachPeerRegion(0, region->key).status().code(),
            absl::StatusCode::kUnavailable);
  EXPECT_FALSE(peer(1).CanAttachPeerRegions(0));
  peer(0).UnmapRegion(region->data);
}

INSTANTIATE_TEST_SUITE_P(Backends, DataExchangeTest,
                         ::testing::Values("inproc", "ucx", "ucx_tcp", "ucx_data_ep"),
                         [](const auto& info) { return info.param; });

}  // namespace
}  // namespace dxs
