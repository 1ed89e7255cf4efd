// Transport ping-pong: raw UCP active messages (the baseline in bench/raw_ucx_pingpong.h,
// written straight against UCP: preallocated buffers, busy-polling progress) against the dxs
// UcxTransport (sender header, blocking waits with a short spin, a fresh payload vector per
// message) moving the same bytes between the same two processes. Both use the same UCX
// configuration, peer error handling with shared memory kept, so the ratio is the cost of the dxs
// layer.
//
// The process forks before either side touches UCX; the parent is the client and
// measures, the child echoes. Addresses travel over pipes.
//
// Usage: transport_bench [--quick]
// Output: median round trip in microseconds and GB/s (2 * bytes per round trip / time)
// for each size, and dxs/raw round-trip ratio.
#include <sys/prctl.h>
#include <sys/wait.h>
#include <ucp/api/ucp.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <csignal>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "absl/time/clock.h"
#include "bench/raw_ucx_pingpong.h"
#include "router/transport/transport.h"

namespace {

constexpr size_t kMaxBytes = size_t{16} << 20;

struct SizeCase {
  size_t bytes;
  int iterations;
};
constexpr SizeCase kCases[] = {
    {0, 5000}, {1 << 10, 5000}, {64 << 10, 2000}, {1 << 20, 300}, {16 << 20, 40},
};

using dxs::bench::Die;
using dxs::bench::TradeAddresses;

double Median(std::vector<double> values) {
  std::sort(values.begin(), values.end());
  return values[values.size() / 2];
}

double NowUs() {
  return std::chrono::duration<double, std::micro>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// ---- Raw UCP baseline -------------------------------------------------------------------

std::vector<double> RawClient(int read_fd, int write_fd, int scale) {
  dxs::bench::RawUcxPeer peer;
  peer.Init(read_fd, write_fd, kMaxBytes);
  std::vector<double> medians;
  for (const SizeCase& c : kCases) {
    const int iterations = std::max(5, c.iterations / scale);
    std::memset(peer.data(), 0x5a, c.bytes);
    std::vector<double> rtt_us;
    for (int i = -iterations / 10 - 1; i < iterations; ++i) {
      const double start = NowUs();
      peer.Send(c.bytes);
      if (peer.Receive() != static_cast<long>(c.bytes)) Die("raw: wrong echo size");
      if (i >= 0) rtt_us.push_back(NowUs() - start);
    }
    medians.push_back(Median(rtt_us));
  }
  peer.SendQuit();
  peer.Close();
  return medians;
}

void RawServer(int read_fd, int write_fd) {
  dxs::bench::RawUcxPeer peer;
  peer.Init(read_fd, write_fd, kMaxBytes);
  peer.Serve();
  peer.Close();
}

// ---- dxs UcxTransport -------------------------------------------------------------------

std::unique_ptr<dxs::Transport> ConnectDxs(int self, int read_fd, int write_fd) {
  auto transport = dxs::MakeUcxTransport(dxs::UcxTransportOptions{});
  if (!transport.ok()) Die(transport.status().ToString());
  if (!(*transport)->SetSelf(self).ok()) Die("SetSelf");
  const std::string peer = TradeAddresses(read_fd, write_fd, (*transport)->LocalAddress());
  absl::Status status = (*transport)->Connect(1 - self, peer);
  if (!status.ok()) Die(status.ToString());
  return std::move(*transport);
}

std::vector<double> DxsClient(int read_fd, int write_fd, int scale) {
  auto transport = ConnectDxs(0, read_fd, write_fd);
  std::vector<uint8_t> payload(kMaxBytes, 0x5a);
  std::vector<double> medians;
  for (const SizeCase& c : kCases) {
    const int iterations = std::max(5, c.iterations / scale);
    std::vector<double> rtt_us;
    for (int i = -iterations / 10 - 1; i < iterations; ++i) {
      const double start = NowUs();
      absl::Status status = transport->Send(1, "", payload.data(), c.bytes);
      if (!status.ok()) Die(status.ToString());
      auto echo = transport->Recv(1, absl::Now() + absl::Seconds(60));
      if (!echo.ok()) Die(echo.status().ToString());
      if (echo->payload.size() != c.bytes) Die("dxs: wrong echo size");
      if (i >= 0) rtt_us.push_back(NowUs() - start);
    }
    medians.push_back(Median(rtt_us));
  }
  if (!transport->Send(1, "quit", nullptr, 0).ok()) Die("dxs: quit");
  return medians;
}

void DxsServer(int read_fd, int write_fd) {
  auto transport = ConnectDxs(1, read_fd, write_fd);
  for (;;) {
    auto message = transport->Recv(0, absl::Now() + absl::Seconds(60));
    if (!message.ok()) Die(message.status().ToString());
    if (message->header == "quit") break;
    absl::Status status = transport->Send(0, "", message->payload.data(), message->payload.size());
    if (!status.ok()) Die(status.ToString());
  }
  // Let the quit message's sender see completion before this process goes away.
  (void)transport->WaitForActivity(absl::Now() + absl::Milliseconds(100));
}

}  // namespace

int main(int argc, char** argv) {
  const int scale = (argc > 1 && std::string(argv[1]) == "--quick") ? 10 : 1;
  // What UcxTransport does with keep_shared_memory, done up front so both sides of the
  // comparison run over the same UCX transports.
  setenv("UCX_POSIX_ERROR_HANDLING", "y", 0);
  setenv("UCX_SYSV_ERROR_HANDLING", "y", 0);
  int to_child[2], from_child[2];
  if (pipe(to_child) != 0 || pipe(from_child) != 0) Die("pipe");
  const pid_t pid = fork();
  if (pid < 0) Die("fork");
  if (pid == 0) {
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    RawServer(to_child[0], from_child[1]);
    DxsServer(to_child[0], from_child[1]);
    _exit(0);
  }
  const std::vector<double> raw = RawClient(from_child[0], to_child[1], scale);
  const std::vector<double> dxs = DxsClient(from_child[0], to_child[1], scale);
  int status = 0;
  waitpid(pid, &status, 0);

  std::printf("UCX %s ping-pong between two processes; median round trip\n",
              ucp_get_version_string());
  std::printf("%10s %12s %10s %12s %10s %10s\n", "bytes", "raw_rtt_us", "raw_GB/s", "dxs_rtt_us",
              "dxs_GB/s", "dxs/raw");
  for (size_t i = 0; i < std::size(kCases); ++i) {
    const double bytes = static_cast<double>(kCases[i].bytes);
    std::printf("%10zu %12.2f %10.3f %12.2f %10.3f %10.2f\n", kCases[i].bytes, raw[i],
                2 * bytes / (raw[i] * 1e3), dxs[i], 2 * bytes / (dxs[i] * 1e3), dxs[i] / raw[i]);
  }
  return WIFEXITED(status) && WEXITSTATUS(status) == 0 ? 0 : 1;
}
