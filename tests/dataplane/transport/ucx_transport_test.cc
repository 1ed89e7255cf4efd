// UCX-only behaviour: environment set-up for shared memory, and a real second process
// that is pinged, killed with SIGKILL, and replaced.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <limits.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "dataplane/transport/transport.h"
#include "tests/common/scoped_env.h"
#include "tests/dataplane/transport/pipe_io.h"

namespace dxs {
namespace {

using testing::ReadAll;
using testing::ScopedEnv;
using testing::WriteAll;

std::string EnvOrEmpty(const char* name) {
  const char* value = std::getenv(name);
  return value == nullptr ? "" : value;
}

TEST(UcxTransportTest, KeepSharedMemorySetsErrorHandlingEnv) {
  ScopedEnv posix("UCX_POSIX_ERROR_HANDLING", nullptr);
  ScopedEnv sysv("UCX_SYSV_ERROR_HANDLING", nullptr);
  {
    UcxTransportOptions options;
    options.keep_shared_memory = false;
    ASSERT_TRUE(MakeUcxTransport(options).ok());
    EXPECT_EQ(std::getenv("UCX_POSIX_ERROR_HANDLING"), nullptr);
    EXPECT_EQ(std::getenv("UCX_SYSV_ERROR_HANDLING"), nullptr);
  }
  ASSERT_TRUE(MakeUcxTransport().ok());
  EXPECT_EQ(EnvOrEmpty("UCX_POSIX_ERROR_HANDLING"), "y");
  EXPECT_EQ(EnvOrEmpty("UCX_SYSV_ERROR_HANDLING"), "y");
}

TEST(UcxTransportTest, KeepSharedMemoryLeavesOperatorChoice) {
  ScopedEnv posix("UCX_POSIX_ERROR_HANDLING", "n");
  ScopedEnv sysv("UCX_SYSV_ERROR_HANDLING", nullptr);
  ASSERT_TRUE(MakeUcxTransport().ok());
  EXPECT_EQ(EnvOrEmpty("UCX_POSIX_ERROR_HANDLING"), "n");
  EXPECT_EQ(EnvOrEmpty("UCX_SYSV_ERROR_HANDLING"), "y");
}

TEST(UcxTransportTest, SendNeedsSelfAndConnection) {
  auto a = MakeUcxTransport();
  auto b = MakeUcxTransport();
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_FALSE((*a)->LocalAddress().empty());
  ASSERT_TRUE((*a)->Connect(1, (*b)->LocalAddress()).ok());
  EXPECT_EQ((*a)->Send(1, "", nullptr, 0).code(), absl::StatusCode::kFailedPrecondition);
  ASSERT_TRUE((*a)->SetSelf(0).ok());
  {
    // A first send may wait for connection setup, which needs b to make progress: b
    // receives on its own thread (each transport is used by one thread).
    std::thread receiver([&] { EXPECT_TRUE((*b)->Recv(0, absl::Now() + absl::Seconds(10)).ok()); });
    EXPECT_TRUE((*a)->Send(1, "", nullptr, 0).ok());
    receiver.join();
  }
  absl::Status unknown = (*a)->Send(7, "", nullptr, 0);
  EXPECT_EQ(unknown.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(unknown.message().find("peer 7"), std::string::npos) << unknown;
  EXPECT_EQ((*a)->Connect(2, "").code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ((*a)->SetSelf(-1).code(), absl::StatusCode::kInvalidArgument);
}

// The sender id travels in the message, not in the endpoint: b learns it is peer 0
// without ever connecting back.
TEST(UcxTransportTest, ReceiverNeedsNoConnection) {
  auto a = MakeUcxTransport();
  auto b = MakeUcxTransport();
  ASSERT_TRUE(a.ok() && b.ok());
  ASSERT_TRUE((*a)->SetSelf(5).ok());
  ASSERT_TRUE((*a)->Connect(9, (*b)->LocalAddress()).ok());
  // b receives on its own thread: a's first send may wait for b's progress.
  absl::StatusOr<TransportMessage> message = absl::UnknownError("not received");
  std::thread receiver([&] { message = (*b)->Recv(5, absl::Now() + absl::Seconds(10)); });
  ASSERT_TRUE((*a)->Send(9, "from five", nullptr, 0).ok());
  receiver.join();
  ASSERT_TRUE(message.ok()) << message.status();
  EXPECT_EQ(message->header, "from five");
}

// A child process running ucx_echo_peer as peer 1.
class EchoChild {
 public:
  // Starts the child and trades addresses with `parent` (peer 0).
  static std::unique_ptr<EchoChild> Start(Transport& parent) {
    int to_child[2], from_child[2];
    if (pipe(to_child) != 0 || pipe(from_child) != 0) return nullptr;
    const std::string helper = HelperPath();
    const pid_t pid = fork();
    if (pid < 0) return nullptr;
    if (pid == 0) {
      // Only async-signal-safe calls between fork and exec.
      close(to_child[1]);
      close(from_child[0]);
      char read_fd[16], write_fd[16];
      snprintf(read_fd, sizeof(read_fd), "%d", to_child[0]);
      snprintf(write_fd, sizeof(write_fd), "%d", from_child[1]);
      execl(helper.c_str(), helper.c_str(), read_fd, write_fd, static_cast<char*>(nullptr));
      _exit(127);
    }
    close(to_child[0]);
    close(from_child[1]);
    auto child = std::unique_ptr<EchoChild>(new EchoChild(pid, to_child[1], from_child[0]));
    uint64_t bytes = 0;
    if (!ReadAll(child->from_child_, &bytes, sizeof(bytes)) || bytes > (1 << 20)) return nullptr;
    child->address_.resize(bytes);
    if (!ReadAll(child->from_child_, child->address_.data(), bytes)) return nullptr;
    const std::string own = parent.LocalAddress();
    bytes = own.size();
    if (!WriteAll(child->to_child_, &bytes, sizeof(bytes)) ||
        !WriteAll(child->to_child_, own.data(), own.size())) {
      return nullptr;
    }
    return child;
  }

  ~EchoChild() {
    if (pid_ > 0) {
      kill(pid_, SIGKILL);
      waitpid(pid_, nullptr, 0);
    }
    close(to_child_);
    close(from_child_);
  }

  const std::string& address() const { return address_; }

  void Kill() {
    kill(pid_, SIGKILL);
    waitpid(pid_, nullptr, 0);
    pid_ = -1;
  }

  // Waits for the child to exit; its exit code, or -1.
  int Join() {
    int status = 0;
    if (waitpid(pid_, &status, 0) != pid_) return -1;
    pid_ = -1;
    return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  }

 private:
  EchoChild(pid_t pid, int to_child, int from_child)
      : pid_(pid), to_child_(to_child), from_child_(from_child) {}

  static std::string HelperPath() {
    char self[PATH_MAX] = {};
    ssize_t n = readlink("/proc/self/exe", self, sizeof(self) - 1);
    std::string path(self, n > 0 ? static_cast<size_t>(n) : 0);
    return path.substr(0, path.rfind('/') + 1) + "ucx_echo_peer";
  }
  pid_t pid_;
  int to_child_;
  int from_child_;
  std::string address_;
};

void PingPong(Transport& parent, const std::string& tag) {
  for (size_t bytes : {size_t{0}, size_t{1000}, size_t{3} << 20}) {
    std::vector<uint8_t> payload(bytes);
    for (size_t j = 0; j < bytes; ++j) payload[j] = static_cast<uint8_t>(j * 13 + bytes);
    const std::string header = tag + "/" + std::to_string(bytes);
    ASSERT_TRUE(parent.Send(1, header, payload.data(), payload.size()).ok());
    auto echo = parent.Recv(1, absl::Now() + absl::Seconds(20));
    ASSERT_TRUE(echo.ok()) << echo.status();
    EXPECT_EQ(echo->header, header);
    EXPECT_TRUE(AsVector(echo->payload) == payload);
  }
}

class UcxCrossProcessTest : public ::testing::TestWithParam<std::string> {
 protected:
  // The parent transport (peer 0) and an echo child (peer 1), connected; over TCP only
  // for the "tcp" parameter (UCX_TLS, inherited by the child through exec).
  void StartParentAndChild() {
    if (GetParam() == "tcp") tls_.emplace("UCX_TLS", "tcp");
    // "data_ep": the parent's exchange sends go on its data endpoint (no error handling),
    // as GPU memory does: a dead child must still fail them.
    UcxTransportOptions options;
    options.host_sends_on_data_endpoint = GetParam() == "data_ep";
    auto parent = MakeUcxTransport(options);
    ASSERT_TRUE(parent.ok()) << parent.status();
    parent_ = std::move(*parent);
    ASSERT_TRUE(parent_->SetSelf(0).ok());
    child_ = EchoChild::Start(*parent_);
    ASSERT_NE(child_, nullptr);
    ASSERT_TRUE(parent_->Connect(1, child_->address()).ok());
  }

  std::optional<ScopedEnv> tls_;
  std::unique_ptr<Transport> parent_;
  std::unique_ptr<EchoChild> child_;
};

TEST_P(UcxCrossProcessTest, KilledPeerIsUnavailableAndReplaceable) {
  ASSERT_NO_FATAL_FAILURE(StartParentAndChild());
  ASSERT_NO_FATAL_FAILURE(PingPong(*parent_, "first"));

  child_->Kill();
  const absl::Time start = absl::Now();
  auto message = parent_->Recv(1, start + absl::Seconds(30));
  const absl::Duration elapsed = absl::Now() - start;
  EXPECT_EQ(message.status().code(), absl::StatusCode::kUnavailable) << message.status();
  EXPECT_NE(message.status().message().find("peer 1"), std::string::npos) << message.status();
  EXPECT_LT(elapsed, absl::Seconds(5));
  std::printf("killed peer detected after %s: %s\n", absl::FormatDuration(elapsed).c_str(),
              message.status().ToString().c_str());
  EXPECT_EQ(parent_->Send(1, "x", nullptr, 0).code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(parent_->PeerStatus(1).code(), absl::StatusCode::kUnavailable);

  auto second = EchoChild::Start(*parent_);
  ASSERT_NE(second, nullptr);
  ASSERT_TRUE(parent_->Connect(1, second->address()).ok());
  EXPECT_TRUE(parent_->PeerStatus(1).ok());
  ASSERT_NO_FATAL_FAILURE(PingPong(*parent_, "second"));
  ASSERT_TRUE(parent_->Send(1, "quit", nullptr, 0).ok());
  EXPECT_EQ(second->Join(), 0);
}

// The child dies while large messages are moving both ways: the parent's blocked Send
// returns UNAVAILABLE instead of hanging, and half-received messages do not block the
// next child's.
TEST_P(UcxCrossProcessTest, PeerKilledMidTransfer) {
  ASSERT_NO_FATAL_FAILURE(StartParentAndChild());
  ASSERT_NO_FATAL_FAILURE(PingPong(*parent_, "warm"));

  const std::vector<uint8_t> big(size_t{64} << 20, 0x17);
  std::thread killer([&] {
    absl::SleepFor(absl::Milliseconds(30));
    child_->Kill();
  });
  const absl::Time start = absl::Now();
  absl::Status status;
  while (status.ok() && absl::Now() - start < absl::Seconds(10)) {
    status = parent_->Send(1, "big", big.data(), big.size());
  }
  const absl::Duration elapsed = absl::Now() - start;
  killer.join();
  EXPECT_EQ(status.code(), absl::StatusCode::kUnavailable) << status;
  EXPECT_LT(elapsed, absl::Seconds(5));
  for (;;) {  // echoes that made it, then the failure
    auto message = parent_->Recv(1, absl::Now() + absl::Seconds(30));
    if (message.ok()) continue;
    EXPECT_EQ(message.status().code(), absl::StatusCode::kUnavailable) << message.status();
    break;
  }

  auto second = EchoChild::Start(*parent_);
  ASSERT_NE(second, nullptr);
  ASSERT_TRUE(parent_->Connect(1, second->address()).ok());
  ASSERT_NO_FATAL_FAILURE(PingPong(*parent_, "second"));
  ASSERT_TRUE(parent_->Send(1, "quit", nullptr, 0).ok());
  EXPECT_EQ(second->Join(), 0);
}

// Round trips through the child's data exchange: the size goes ahead on the control
// channel, then the bytes as grouped transfers.
void ExchangePingPong(Transport& parent, uint64_t tag) {
  for (size_t bytes : {size_t{0}, size_t{1000}, size_t{3} << 20}) {
    std::vector<uint8_t> payload(bytes), echo(bytes, 0);
    for (size_t j = 0; j < bytes; ++j) payload[j] = static_cast<uint8_t>(j * 11 + bytes);
    ASSERT_TRUE(
        parent.Send(1, "xchg " + std::to_string(tag) + " " + std::to_string(bytes), nullptr, 0)
            .ok());
    const Transfer transfers[] = {{Transfer::Kind::kSend, 1, payload.data(), bytes},
                                  {Transfer::Kind::kRecv, 1, echo.data(), bytes}};
    auto id = parent.PostExchange(tag, transfers, 2);
    ASSERT_TRUE(id.ok()) << id.status();
    absl::Status status = parent.WaitExchange(*id, absl::Now() + absl::Seconds(20));
    ASSERT_TRUE(status.ok()) << status;
    EXPECT_TRUE(echo == payload) << bytes;
    ++tag;
  }
}

// The child dies while an exchange waits for it (a receive it never sends, and a large send
// it never receives): UNAVAILABLE naming it within fault detection, the receive memory is
// left alone, and a new child exchanges again.
TEST_P(UcxCrossProcessTest, PeerKilledDuringExchange) {
  ASSERT_NO_FATAL_FAILURE(StartParentAndChild());
  ASSERT_NO_FATAL_FAILURE(ExchangePingPong(*parent_, 10));

  const std::vector<uint8_t> big(size_t{16} << 20, 0x17);
  std::vector<uint8_t> target(size_t{1} << 20, 0xee);
  const Transfer transfers[] = {
      {Transfer::Kind::kSend, 1, const_cast<uint8_t*>(big.data()), big.size()},
      {Transfer::Kind::kRecv, 1, target.data(), target.size()}};
  auto id = parent_->PostExchange(99, transfers, 2);
  ASSERT_TRUE(id.ok()) << id.status();
  std::thread killer([&] {
    absl::SleepFor(absl::Milliseconds(50));
    child_->Kill();
  });
  const absl::Time start = absl::Now();
  absl::Status status = parent_->WaitExchange(*id, start + absl::Seconds(30));
  const absl::Duration elapsed = absl::Now() - start;
  killer.join();
  EXPECT_EQ(status.code(), absl::StatusCode::kUnavailable) << status;
  EXPECT_NE(status.message().find("peer 1"), std::string::npos) << status;
  EXPECT_LT(elapsed, absl::Seconds(5));
  std::printf("killed peer detected by the exchange after %s: %s\n",
              absl::FormatDuration(elapsed).c_str(), status.ToString().c_str());
  EXPECT_TRUE(std::all_of(target.begin(), target.end(), [](uint8_t b) { return b == 0xee; }));
  EXPECT_EQ(parent_->PostExchange(100, transfers, 2).status().code(),
            absl::StatusCode::kUnavailable);

  auto second = EchoChild::Start(*parent_);
  ASSERT_NE(second, nullptr);
  ASSERT_TRUE(parent_->Connect(1, second->address()).ok());
  ASSERT_NO_FATAL_FAILURE(ExchangePingPong(*parent_, 200));
  ASSERT_TRUE(parent_->Send(1, "quit", nullptr, 0).ok());
  EXPECT_EQ(second->Join(), 0);
}

INSTANTIATE_TEST_SUITE_P(Transports, UcxCrossProcessTest,
                         ::testing::Values("default", "tcp", "data_ep"),
                         [](const auto& info) { return info.param; });

}  // namespace
}  // namespace dxs
