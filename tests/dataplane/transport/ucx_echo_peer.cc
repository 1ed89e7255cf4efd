// The peer process ucx_transport_test starts (not a test: it asserts nothing itself). It
// creates its own UCX transport as peer 1, trades
// addresses with the parent over two pipes (length-prefixed), then echoes every message
// from peer 0 back until the header is "quit" or peer 0 goes away. A message whose header
// is "xchg <tag> <bytes>" is answered through the data exchange instead: the child
// receives <bytes> from peer 0 under <tag>, then sends them back under the same tag.
//
// Each failure exits with its own non-zero status, which the test asserts (EchoChild::Join
// expects 0); the echoed bytes are checked by the test.
//
// Usage: ucx_echo_peer <read_fd> <write_fd>
#include <sys/prctl.h>
#include <unistd.h>

#include <csignal>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "dataplane/transport/transport.h"
#include "tests/dataplane/transport/pipe_io.h"

namespace {

using ::dxs::testing::ReadAll;
using ::dxs::testing::WriteAll;

// Receives `bytes` under `tag` from peer 0 and sends them back, each as a group.
bool EchoExchange(dxs::Transport& transport, uint64_t tag, size_t bytes) {
  std::vector<uint8_t> data(bytes);
  const absl::Time deadline = absl::Now() + absl::Seconds(60);
  for (auto kind : {dxs::Transfer::Kind::kRecv, dxs::Transfer::Kind::kSend}) {
    const dxs::Transfer transfer = {kind, 0, data.data(), bytes};
    auto id = transport.PostExchange(tag, &transfer, 1);
    if (!id.ok() || !transport.WaitExchange(*id, deadline).ok()) return false;
  }
  return true;
}

int Run(int read_fd, int write_fd) {
  auto transport = dxs::MakeUcxTransport();
  if (!transport.ok() || !(*transport)->SetSelf(1).ok()) return 2;
  const std::string address = (*transport)->LocalAddress();
  const uint64_t address_bytes = address.size();
  if (!WriteAll(write_fd, &address_bytes, sizeof(address_bytes)) ||
      !WriteAll(write_fd, address.data(), address.size())) {
    return 3;
  }
  uint64_t parent_bytes = 0;
  if (!ReadAll(read_fd, &parent_bytes, sizeof(parent_bytes)) || parent_bytes > (1 << 20)) return 4;
  std::string parent(parent_bytes, '\0');
  if (!ReadAll(read_fd, parent.data(), parent.size())) return 4;
  if (!(*transport)->Connect(0, parent).ok()) return 5;
  for (;;) {
    auto message = (*transport)->Recv(0, absl::Now() + absl::Seconds(60));
    if (!message.ok()) return 6;
    if (message->header == "quit") return 0;
    const std::vector<std::string> words = absl::StrSplit(message->header, ' ');
    if (words.size() == 3 && words[0] == "xchg") {
      uint64_t tag = 0, bytes = 0;
      if (!absl::SimpleAtoi(words[1], &tag) || !absl::SimpleAtoi(words[2], &bytes)) return 8;
      if (!EchoExchange(**transport, tag, bytes)) return 9;
      continue;
    }
    if (!(*transport)
             ->Send(0, message->header, message->payload.data(), message->payload.size())
             .ok()) {
      return 7;
    }
  }
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 3) {
    std::fprintf(stderr, "usage: %s <read_fd> <write_fd>\n", argv[0]);
    return 1;
  }
  prctl(PR_SET_PDEATHSIG, SIGKILL);  // never outlive a crashed test
  return Run(std::atoi(argv[1]), std::atoi(argv[2]));
}
