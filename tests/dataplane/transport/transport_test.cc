// Behaviour every Transport backend shares, run against inproc, UCX (default transports:
// shared memory between the two in-process workers) and UCX restricted to TCP.
#include "dataplane/transport/transport.h"

#include <gtest/gtest.h>
#include <time.h>

#include <cstdlib>
#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "tests/common/scoped_env.h"

namespace dxs {
namespace {

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

std::vector<uint8_t> Pattern(int seed, size_t bytes) {
  std::vector<uint8_t> data(bytes);
  for (size_t j = 0; j < bytes; ++j) data[j] = static_cast<uint8_t>(seed * 131 + j * 7 + (j >> 9));
  return data;
}

absl::Duration ProcessCpuTime() {
  timespec ts;
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
  return absl::DurationFromTimespec(ts);
}

class TransportTest : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    const std::string& backend = GetParam();
    if (backend == "inproc") {
      group_ = MakeInprocTransportGroup(2);
    } else {
      std::optional<ScopedEnv> tls;
      if (backend == "ucx_tcp") tls.emplace("UCX_TLS", "tcp");
      for (int i = 0; i < 2; ++i) {
        auto transport = MakeUcxTransport();
        ASSERT_TRUE(transport.ok()) << transport.status();
        group_.push_back(std::move(*transport));
      }
    }
    for (int i = 0; i < 2; ++i) ASSERT_TRUE(group_[i]->SetSelf(i).ok());
    addresses_ = {group_[0]->LocalAddress(), group_[1]->LocalAddress()};
    ASSERT_TRUE(a().Connect(1, addresses_[1]).ok());
    ASSERT_TRUE(b().Connect(0, addresses_[0]).ok());
    // A first UCX send may wait for connection setup, which needs the receiver to make
    // progress; tests that then send and receive on one thread need that done already.
    Handshake();
  }

  // One zero-size message each way, with both sides in their own thread.
  void Handshake() {
    auto both_ways = [](Transport& self, int peer) {
      ASSERT_TRUE(self.Send(peer, "handshake", nullptr, 0).ok());
      auto message = self.Recv(peer, absl::Now() + absl::Seconds(10));
      ASSERT_TRUE(message.ok()) << message.status();
      ASSERT_EQ(message->header, "handshake");
    };
    std::thread other([&] { both_ways(b(), 0); });
    both_ways(a(), 1);
    other.join();
  }

  Transport& a() { return *group_[0]; }
  Transport& b() { return *group_[1]; }

  std::vector<std::unique_ptr<Transport>> group_;
  std::vector<std::string> addresses_;
};

TEST_P(TransportTest, Name) { EXPECT_EQ(a().name(), GetParam() == "inproc" ? "inproc" : "ucx"); }

TEST_P(TransportTest, ZeroSizeMessagesAreDelivered) {
  ASSERT_TRUE(a().Send(1, "", nullptr, 0).ok());
  ASSERT_TRUE(b().Send(0, "", nullptr, 0).ok());
  for (auto [receiver, sender] : {std::pair{&b(), 0}, std::pair{&a(), 1}}) {
    auto message = receiver->Recv(sender, absl::Now() + absl::Seconds(5));
    ASSERT_TRUE(message.ok()) << message.status();
    EXPECT_TRUE(message->header.empty());
    EXPECT_TRUE(message->payload.empty());
  }
  EXPECT_FALSE(a().HasMessage(1));
  EXPECT_FALSE(b().HasMessage(0));
}

// Sizes cross the eager/rendezvous boundary in both directions, and some headers are too
// large for a UCX active-message header, so every wire path carries part of the sequence.
TEST_P(TransportTest, FifoOrderOfMixedSizes) {
  constexpr int kNumMessages = 100;
  const size_t kSizes[] = {0, 1, 100, 8 << 10, 64 << 10, 300 << 10, (1 << 20) + 3, 3 << 20};
  auto size_of = [&](int i) { return kSizes[(i * 5) % std::size(kSizes)]; };
  auto header_of = [](int i) {
    std::string header = "msg-" + std::to_string(i);
    if (i % 7 == 3) header.append(20000, static_cast<char>('a' + i % 26));
    return header;
  };
  absl::Status send_status;
  std::thread sender([&] {
    for (int i = 0; i < kNumMessages && send_status.ok(); ++i) {
      const std::vector<uint8_t> payload = Pattern(i, size_of(i));
      send_status = a().Send(1, header_of(i), payload.data(), payload.size());
    }
  });
  for (int i = 0; i < kNumMessages; ++i) {
    auto message = b().Recv(0, absl::Now() + absl::Seconds(20));
    ASSERT_TRUE(message.ok()) << "message " << i << ": " << message.status();
    ASSERT_EQ(message->header, header_of(i));
    ASSERT_EQ(message->payload.size(), size_of(i)) << "message " << i;
    ASSERT_TRUE(AsVector(message->payload) == Pattern(i, size_of(i))) << "message " << i;
  }
  sender.join();
  EXPECT_TRUE(send_status.ok()) << send_status;
}

TEST_P(TransportTest, BothDirectionsAtOnce) {
  constexpr int kNumMessages = 20;
  constexpr size_t kBytes = 2 << 20;  // rendezvous both ways while both sides send
  auto exchange = [&](Transport& self, int peer, absl::Status* status) {
    const std::vector<uint8_t> payload = Pattern(peer, kBytes);
    for (int i = 0; i < kNumMessages && status->ok(); ++i) {
      *status = self.Send(peer, "x", payload.data(), payload.size());
      if (!status->ok()) break;
      auto message = self.Recv(peer, absl::Now() + absl::Seconds(20));
      if (!message.ok()) {
        *status = message.status();
      } else if (AsVector(message->payload) != Pattern(1 - peer, kBytes)) {
        *status = absl::DataLossError("payload mismatch");
      }
    }
  };
  absl::Status status_a, status_b;
  std::thread thread_b([&] { exchange(b(), 0, &status_b); });
  exchange(a(), 1, &status_a);
  thread_b.join();
  EXPECT_TRUE(status_a.ok()) << status_a;
  EXPECT_TRUE(status_b.ok()) << status_b;
}

TEST_P(TransportTest, RecvDeadline) {
  const absl::Duration wait = absl::Milliseconds(200);
  const absl::Time start = absl::Now();
  auto message = b().Recv(0, start + wait);
  const absl::Duration elapsed = absl::Now() - start;
  EXPECT_EQ(message.status().code(), absl::StatusCode::kDeadlineExceeded) << message.status();
  EXPECT_NE(message.status().message().find("peer 0"), std::string::npos) << message.status();
  EXPECT_GE(elapsed, wait);
  EXPECT_LT(elapsed, wait + kLate);
}

TEST_P(TransportTest, WaitForActivityReturnsOnDeadline) {
  const absl::Time start = absl::Now();
  EXPECT_TRUE(b().WaitForActivity(start + absl::Milliseconds(100)).ok());
  const absl::Duration elapsed = absl::Now() - start;
  EXPECT_GE(elapsed, absl::Milliseconds(100));
  EXPECT_LT(elapsed, absl::Milliseconds(100) + kLate);
}

TEST_P(TransportTest, WaitForActivityWakesOnMessage) {
  absl::Time sent;
  std::thread sender([&] {
    absl::SleepFor(absl::Milliseconds(100));
    sent = absl::Now();
    ASSERT_TRUE(a().Send(1, "hello", nullptr, 0).ok());
  });
  ASSERT_TRUE(b().WaitForActivity(absl::Now() + absl::Seconds(10)).ok());
  const absl::Time woke = absl::Now();
  sender.join();
  EXPECT_TRUE(b().HasMessage(0));
  EXPECT_LT(woke - sent, kLate);
  auto message = b().Recv(0, absl::Now());
  ASSERT_TRUE(message.ok()) << message.status();
  EXPECT_EQ(message->header, "hello");
}

TEST_P(TransportTest, WakeInterruptsWaitForActivity) {
  absl::Time woken_at;
  // Before the waker starts: its wake comes at least 100 ms after it.
  const absl::Time start = absl::Now();
  std::thread waker([&] {
    absl::SleepFor(absl::Milliseconds(100));
    woken_at = absl::Now();
    b().Wake();
  });
  ASSERT_TRUE(b().WaitForActivity(start + absl::Seconds(10)).ok());
  const absl::Time returned = absl::Now();
  waker.join();
  EXPECT_LT(returned - woken_at, kLate);
  EXPECT_GE(returned - start, absl::Milliseconds(90));
}

// Wake() is for WaitForActivity only: a step waiting for its peers is not cut short. The
// wake is kept for the next WaitForActivity.
TEST_P(TransportTest, WakeDoesNotInterruptRecv) {
  std::thread waker([&] {
    absl::SleepFor(absl::Milliseconds(20));
    b().Wake();
  });
  const absl::Time start = absl::Now();
  auto message = b().Recv(0, start + absl::Milliseconds(150));
  waker.join();
  EXPECT_EQ(message.status().code(), absl::StatusCode::kDeadlineExceeded) << message.status();
  EXPECT_GE(absl::Now() - start, absl::Milliseconds(150));
  const absl::Time wait_start = absl::Now();
  ASSERT_TRUE(b().WaitForActivity(wait_start + absl::Seconds(10)).ok());
  EXPECT_LT(absl::Now() - wait_start, kLate);
}

TEST_P(TransportTest, EarlyWakeEndsTheNextWait) {
  b().Wake();
  const absl::Time start = absl::Now();
  ASSERT_TRUE(b().WaitForActivity(start + absl::Seconds(10)).ok());
  EXPECT_LT(absl::Now() - start, kLate);
  // Consumed: the following wait runs to its deadline.
  const absl::Time again = absl::Now();
  ASSERT_TRUE(b().WaitForActivity(again + absl::Milliseconds(50)).ok());
  EXPECT_GE(absl::Now() - again, absl::Milliseconds(50));
}

TEST_P(TransportTest, IdleWaitDoesNotBurnCpu) {
  const absl::Duration cpu_before = ProcessCpuTime();
  const absl::Time start = absl::Now();
  ASSERT_TRUE(b().WaitForActivity(start + kIdleWindow).ok());
  const absl::Duration cpu = ProcessCpuTime() - cpu_before;
  EXPECT_GE(absl::Now() - start, kIdleWindow);
  EXPECT_LT(cpu, kIdleCpu) << "CPU time spent waiting " << kIdleWindow << ": " << cpu;
}

TEST_P(TransportTest, IdleRecvDoesNotBurnCpu) {
  const absl::Duration cpu_before = ProcessCpuTime();
  auto message = b().Recv(0, absl::Now() + kIdleWindow);
  const absl::Duration cpu = ProcessCpuTime() - cpu_before;
  EXPECT_EQ(message.status().code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_LT(cpu, kIdleCpu) << "CPU time spent waiting " << kIdleWindow << ": " << cpu;
}

TEST_P(TransportTest, DisconnectMakesPeerUnavailableUntilReconnect) {
  // A message that arrived before the fault is still delivered, then the fault shows.
  ASSERT_TRUE(b().Send(0, "before", nullptr, 0).ok());
  const absl::Time give_up = absl::Now() + absl::Seconds(5);
  while (!a().HasMessage(1) && absl::Now() < give_up) absl::SleepFor(absl::Milliseconds(1));
  a().Disconnect(1);

  absl::Status send = a().Send(1, "x", nullptr, 0);
  EXPECT_EQ(send.code(), absl::StatusCode::kUnavailable) << send;
  EXPECT_NE(send.message().find("peer 1"), std::string::npos) << send;
  EXPECT_EQ(a().PeerStatus(1).code(), absl::StatusCode::kUnavailable);

  auto before = a().Recv(1, absl::Now() + absl::Seconds(5));
  ASSERT_TRUE(before.ok()) << before.status();
  EXPECT_EQ(before->header, "before");
  const absl::Time start = absl::Now();
  auto after = a().Recv(1, start + absl::Seconds(30));
  EXPECT_EQ(after.status().code(), absl::StatusCode::kUnavailable) << after.status();
  EXPECT_NE(after.status().message().find("peer 1"), std::string::npos) << after.status();
  EXPECT_LT(absl::Now() - start, absl::Seconds(1));

  // Reconnecting sets up a new UCX endpoint, so the receiver runs in its own thread.
  ASSERT_TRUE(a().Connect(1, addresses_[1]).ok());
  EXPECT_TRUE(a().PeerStatus(1).ok());
  absl::StatusOr<TransportMessage> again;
  std::thread receiver([&] { again = b().Recv(0, absl::Now() + absl::Seconds(5)); });
  EXPECT_TRUE(a().Send(1, "again", nullptr, 0).ok());
  receiver.join();
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(again->header, "again");
}

TEST_P(TransportTest, NullPayloadWithBytesIsRejected) {
  EXPECT_EQ(a().Send(1, "", nullptr, 10).code(), absl::StatusCode::kInvalidArgument);
  const uint8_t byte = 1;
  const PayloadSegment segments[] = {{&byte, 1}, {nullptr, 4}};
  EXPECT_EQ(a().SendV(1, "", segments, 2).code(), absl::StatusCode::kInvalidArgument);
}

// Eager and rendezvous sizes on every backend (UCX switches protocol well below 1 MiB).
const size_t kPayloadSizes[] = {0, 1, 1000, 64 << 10, (1 << 20) + 5, 3 << 20};

// Splits `data` into `n` segments of uneven sizes, some empty.
std::vector<PayloadSegment> Split(const std::vector<uint8_t>& data, int n) {
  std::vector<PayloadSegment> segments;
  size_t offset = 0;
  for (int i = 0; i < n; ++i) {
    const size_t left = data.size() - offset;
    const size_t bytes = i == n - 1 ? left : (i % 3 == 1 ? 0 : left / 3);
    segments.push_back({data.data() + offset, bytes});
    offset += bytes;
  }
  return segments;
}

TEST_P(TransportTest, SendVSendsTheConcatenation) {
  for (size_t bytes : kPayloadSizes) {
    for (int n : {0, 1, 2, 5, 40}) {
      if (n == 0 && bytes > 0) continue;
      const std::vector<uint8_t> payload = Pattern(n, bytes);
      const std::vector<PayloadSegment> segments = Split(payload, n);
      const std::string header = "v" + std::to_string(bytes) + "/" + std::to_string(n);
      std::thread sender([&] { ASSERT_TRUE(a().SendV(1, header, segments.data(), n).ok()); });
      auto message = b().Recv(0, absl::Now() + absl::Seconds(20));
      sender.join();
      ASSERT_TRUE(message.ok()) << message.status();
      EXPECT_EQ(message->header, header);
      EXPECT_TRUE(AsVector(message->payload) == payload) << header;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Backends, TransportTest, ::testing::Values("inproc", "ucx", "ucx_tcp"),
                         [](const auto& info) { return info.param; });

TEST(InprocTransportTest, DisconnectIsSeenByBothSides) {
  auto group = MakeInprocTransportGroup(3);
  group[0]->Disconnect(1);
  EXPECT_EQ(group[1]->PeerStatus(0).code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(group[1]->Send(0, "", nullptr, 0).code(), absl::StatusCode::kUnavailable);
  EXPECT_TRUE(group[2]->Send(0, "", nullptr, 0).ok());
  EXPECT_TRUE(group[0]->PeerStatus(2).ok());
}

TEST(InprocTransportTest, FailureWakesWaitForActivity) {
  auto group = MakeInprocTransportGroup(2);
  std::thread fault([&] {
    absl::SleepFor(absl::Milliseconds(50));
    group[0]->Disconnect(1);
  });
  const absl::Time start = absl::Now();
  ASSERT_TRUE(group[1]->WaitForActivity(start + absl::Seconds(10)).ok());
  fault.join();
  EXPECT_LT(absl::Now() - start, absl::Seconds(1));
}

TEST(InprocTransportTest, RejectsPeersOutsideTheGroup) {
  auto group = MakeInprocTransportGroup(2);
  EXPECT_EQ(group[0]->Send(2, "", nullptr, 0).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(group[0]->Recv(-1, absl::Now()).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(group[0]->SetSelf(1).code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace dxs
