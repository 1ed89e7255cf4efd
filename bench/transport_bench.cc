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
// The dxs side also sends payloads gathered from several segments (SendV). Each variant is
// named sN: the request goes out in N segments (s4: split the way a message of rows and
// routing pairs would be; s64 and s512: rows scattered over that many runs); the echo goes
// back in one segment.
//
// The data exchange (DataExchange on the same UcxTransport: tagged sends and receives,
// posted as groups) runs the same round trip: the client posts one group {send to the
// server, receive from it}, the server a group {receive} and then a group {send}, sizes
// known to both sides in advance as an engine's counts would be. It also runs the engine's
// shape, both sides posting {send, receive} at once: one exchange moves the bytes both
// ways, so it is compared with the round trip.
//
// Usage: transport_bench [--quick] [--pin]
// --pin puts the client on CPU 0 and the server on CPU 1: on a small machine shared with
// other work, the scheduler otherwise sometimes stacks both on one CPU, which adds about
// 2.5 us to every round trip and halves copy bandwidth for the whole run.
// Output: median round trip in microseconds and GB/s (2 * bytes per round trip / time)
// for each size, dxs/raw round-trip ratio, and each SendV variant's round trip; then the data
// exchange's round trip against raw UCX and the message path.
#include <sched.h>
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
#include <initializer_list>
#include <memory>
#include <string>
#include <vector>

#include "absl/time/clock.h"
#include "bench/raw_ucx_pingpong.h"
#include "dataplane/transport/transport.h"

namespace {

constexpr size_t kMaxBytes = size_t{16} << 20;

struct SizeCase {
  size_t bytes;
  int iterations;
};
constexpr SizeCase kCases[] = {
    {0, 5000}, {1 << 10, 5000}, {64 << 10, 2000}, {1 << 20, 300}, {16 << 20, 40},
};

// Request segments of each dxs SendV variant; the first is the plain path.
constexpr int kSendSegments[] = {1, 4, 64, 512};

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

// ---- Raw UCP tagged ping-pong ------------------------------------------------------------
// The data exchange's baseline: the same tagged sends and receives written straight against
// UCP (one preallocated buffer, busy-polling progress, no groups), so xchg/raw_tag is the
// cost of the dxs layer and raw_tag/raw the cost of UCX's tag protocols against its AMs.

class RawTagPeer {
 public:
  void Init(int read_fd, int write_fd) {
    ucx_.Open(read_fd, write_fd, UCP_FEATURE_TAG);
    buffer_.resize(kMaxBytes);
  }
  void Close() { ucx_.Close(); }
  // Posts the receive first, then the send, and waits for both (the client's round trip);
  // the server passes send_after_recv to answer only once the request is in.
  void Transfer(size_t bytes, bool send_after_recv) {
    ucp_request_param_t params = {};
    void* recv = ucp_tag_recv_nbx(ucx_.worker, buffer_.data(), bytes, 1, ~ucp_tag_t{0}, &params);
    if (send_after_recv) ucx_.Wait(recv, "raw tag transfer");
    void* send = ucp_tag_send_nbx(ucx_.ep, buffer_.data(), bytes, 1, &params);
    ucx_.Wait(send, "raw tag transfer");
    if (!send_after_recv) ucx_.Wait(recv, "raw tag transfer");
  }

 private:
  dxs::bench::RawUcxConnection ucx_;
  std::vector<uint8_t> buffer_;
};

int IterationsOf(const SizeCase& c, int scale) { return std::max(5, c.iterations / scale); }

std::vector<double> RawTagClient(int read_fd, int write_fd, int scale) {
  RawTagPeer peer;
  peer.Init(read_fd, write_fd);
  std::vector<double> medians;
  for (const SizeCase& c : kCases) {
    std::vector<double> rtt_us;
    for (int i = -IterationsOf(c, scale) / 10 - 1; i < IterationsOf(c, scale); ++i) {
      const double start = NowUs();
      peer.Transfer(c.bytes, /*send_after_recv=*/false);
      if (i >= 0) rtt_us.push_back(NowUs() - start);
    }
    medians.push_back(Median(rtt_us));
  }
  peer.Transfer(0, false);  // both sides are done before either closes
  peer.Close();
  return medians;
}

void RawTagServer(int read_fd, int write_fd, int scale) {
  RawTagPeer peer;
  peer.Init(read_fd, write_fd);
  for (const SizeCase& c : kCases) {
    for (int i = -IterationsOf(c, scale) / 10 - 1; i < IterationsOf(c, scale); ++i) {
      peer.Transfer(c.bytes, /*send_after_recv=*/true);
    }
  }
  peer.Transfer(0, true);
  peer.Close();
}

// ---- dxs UcxTransport -------------------------------------------------------------------

std::unique_ptr<dxs::Transport> ConnectDxs(int self, int read_fd, int write_fd) {
  auto transport = dxs::MakeUcxTransport();
  if (!transport.ok()) Die(transport.status().ToString());
  if (!(*transport)->SetSelf(self).ok()) Die("SetSelf");
  const std::string peer = TradeAddresses(read_fd, write_fd, (*transport)->LocalAddress());
  absl::Status status = (*transport)->Connect(1 - self, peer);
  if (!status.ok()) Die(status.ToString());
  return std::move(*transport);
}

// Splits `bytes` at `data` into `n` pieces: up to 4, the first 98% (rows) and the rest
// evenly (routing pairs); more, all even (scattered rows).
std::vector<dxs::PayloadSegment> Pieces(const uint8_t* data, size_t bytes, int n) {
  std::vector<dxs::PayloadSegment> pieces;
  if (n == 1) return {{data, bytes}};
  if (n > 4) {
    for (int i = 0; i < n; ++i) {
      const size_t begin = bytes * i / n, end = bytes * (i + 1) / n;
      pieces.push_back({data + begin, end - begin});
    }
    return pieces;
  }
  const size_t head = bytes / 50 * 49;
  pieces.push_back({data, head});
  size_t offset = head;
  for (int i = 1; i < n; ++i) {
    const size_t piece = i == n - 1 ? bytes - offset : (bytes - head) / (n - 1);
    pieces.push_back({data + offset, piece});
    offset += piece;
  }
  return pieces;
}

// Medians per variant, then per size.
std::vector<std::vector<double>> DxsClient(int read_fd, int write_fd, int scale) {
  auto transport = ConnectDxs(0, read_fd, write_fd);
  std::vector<uint8_t> payload(kMaxBytes, 0x5a);
  std::vector<std::vector<double>> medians;
  for (int send_segments : kSendSegments) {
    medians.emplace_back();
    for (const SizeCase& c : kCases) {
      const int iterations = std::max(5, c.iterations / scale);
      const auto segments = Pieces(payload.data(), c.bytes, send_segments);
      std::vector<double> rtt_us;
      for (int i = -iterations / 10 - 1; i < iterations; ++i) {
        const double start = NowUs();
        absl::Status status = transport->SendV(1, "-", segments.data(), segments.size());
        if (!status.ok()) Die(status.ToString());
        auto echo = transport->Recv(1, absl::Now() + absl::Seconds(60));
        if (!echo.ok()) Die(echo.status().ToString());
        if (echo->payload.size() != c.bytes) Die("dxs: wrong echo size");
        if (i >= 0) rtt_us.push_back(NowUs() - start);
      }
      medians.back().push_back(Median(rtt_us));
    }
  }
  if (!transport->Send(1, "quit", nullptr, 0).ok()) Die("dxs: quit");
  return medians;
}

// ---- dxs data exchange ------------------------------------------------------------------

absl::Status PostAndWait(dxs::Transport& transport, uint64_t tag,
                         std::initializer_list<dxs::Transfer> transfers) {
  auto id = transport.PostExchange(tag, transfers.begin(), transfers.size());
  if (!id.ok()) return id.status();
  return transport.WaitExchange(*id, absl::Now() + absl::Seconds(60));
}

dxs::Transfer RecvOf(int peer, void* data, size_t bytes) {
  return {dxs::Transfer::Kind::kRecv, peer, data, bytes};
}

// Medians per size: the round trip, then the symmetric exchange.
std::vector<std::vector<double>> ExchangeClient(int read_fd, int write_fd, int scale) {
  auto transport = ConnectDxs(0, read_fd, write_fd);
  std::vector<uint8_t> out(kMaxBytes, 0x5a), in(kMaxBytes);
  std::vector<std::vector<double>> medians(2);
  uint64_t tag = 0;
  for (int symmetric = 0; symmetric < 2; ++symmetric) {
    for (const SizeCase& c : kCases) {
      const int iterations = std::max(5, c.iterations / scale);
      std::vector<double> us;
      for (int i = -iterations / 10 - 1; i < iterations; ++i) {
        const double start = NowUs();
        // The round trip receives into the buffer it sends from, as the raw baseline does
        // (the same memory traffic: at 16 MiB, a third buffer costs a fifth of the time):
        // the server sends only after receiving all of it. Both ways at once need two.
        uint8_t* target = symmetric ? in.data() : out.data();
        absl::Status status = PostAndWait(
            *transport, ++tag,
            {{dxs::Transfer::Kind::kSend, 1, out.data(), c.bytes}, RecvOf(1, target, c.bytes)});
        if (!status.ok()) Die(status.ToString());
        if (i >= 0) us.push_back(NowUs() - start);
      }
      medians[symmetric].push_back(Median(us));
    }
  }
  if (!transport->Send(1, "quit", nullptr, 0).ok()) Die("exchange: quit");
  return medians;
}

void ExchangeServer(int read_fd, int write_fd, int scale) {
  auto transport = ConnectDxs(1, read_fd, write_fd);
  std::vector<uint8_t> buffer(kMaxBytes);
  uint64_t tag = 0;
  for (int symmetric = 0; symmetric < 2; ++symmetric) {
    for (const SizeCase& c : kCases) {
      const int iterations = std::max(5, c.iterations / scale);
      for (int i = -iterations / 10 - 1; i < iterations; ++i) {
        const dxs::Transfer to_client = {dxs::Transfer::Kind::kSend, 0, buffer.data(), c.bytes};
        const dxs::Transfer from_client = RecvOf(0, buffer.data(), c.bytes);
        absl::Status status;
        ++tag;
        if (symmetric == 1) {
          // Both directions at once: the echo is whatever the buffer held (timing only).
          status = PostAndWait(*transport, tag, {to_client, from_client});
        } else {
          status = PostAndWait(*transport, tag, {from_client});
          if (status.ok()) status = PostAndWait(*transport, tag, {to_client});
        }
        if (!status.ok()) Die(status.ToString());
      }
    }
  }
  auto quit = transport->Recv(0, absl::Now() + absl::Seconds(60));
  if (!quit.ok() || quit->header != "quit") Die("exchange: no quit");
  (void)transport->WaitForActivity(absl::Now() + absl::Milliseconds(100));
}

void DxsServer(int read_fd, int write_fd) {
  auto transport = ConnectDxs(1, read_fd, write_fd);
  for (;;) {
    auto message = transport->Recv(0, absl::Now() + absl::Seconds(60));
    if (!message.ok()) Die(message.status().ToString());
    if (message->header == "quit") break;
    absl::Status status = transport->Send(0, "-", message->payload.data(), message->payload.size());
    if (!status.ok()) Die(status.ToString());
  }
  // Let the quit message's sender see completion before this process goes away.
  (void)transport->WaitForActivity(absl::Now() + absl::Milliseconds(100));
}

}  // namespace

int main(int argc, char** argv) {
  int scale = 1;
  bool pin = false;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--quick") {
      scale = 10;
    } else if (arg == "--pin") {
      pin = true;
    } else {
      Die("usage: transport_bench [--quick] [--pin]");
    }
  }
  // What UcxTransport does with keep_shared_memory, done up front so both sides of the
  // comparison run over the same UCX transports.
  setenv("UCX_POSIX_ERROR_HANDLING", "y", 0);
  setenv("UCX_SYSV_ERROR_HANDLING", "y", 0);
  int to_child[2], from_child[2];
  if (pipe(to_child) != 0 || pipe(from_child) != 0) Die("pipe");
  const pid_t pid = fork();
  if (pid < 0) Die("fork");
  if (pin) dxs::bench::PinToCpu(pid == 0 ? 1 : 0);
  if (pid == 0) {
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    RawServer(to_child[0], from_child[1]);
    DxsServer(to_child[0], from_child[1]);
    ExchangeServer(to_child[0], from_child[1], scale);
    RawTagServer(to_child[0], from_child[1], scale);
    _exit(0);
  }
  const std::vector<double> raw = RawClient(from_child[0], to_child[1], scale);
  const std::vector<std::vector<double>> variants = DxsClient(from_child[0], to_child[1], scale);
  const std::vector<double>& dxs = variants[0];
  const std::vector<std::vector<double>> exchange =
      ExchangeClient(from_child[0], to_child[1], scale);
  const std::vector<double> raw_tag = RawTagClient(from_child[0], to_child[1], scale);
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
  std::printf(
      "\ndxs SendV variants (sN: request sent in N segments); median round trip in us\n%10s",
      "bytes");
  for (int send_segments : kSendSegments) {
    std::printf(" %9s", ("s" + std::to_string(send_segments)).c_str());
  }
  std::printf("\n");
  for (size_t i = 0; i < std::size(kCases); ++i) {
    std::printf("%10zu", kCases[i].bytes);
    for (const auto& medians : variants) std::printf(" %9.2f", medians[i]);
    std::printf("\n");
  }
  std::printf(
      "\ndxs data exchange (grouped tagged transfers, host memory), median us: xchg = round "
      "trip, client group {send, recv}, server {recv} then {send}; raw_tag = the same on bare "
      "UCP tags; sym = both post {send, recv} at once (one exchange, bytes both ways)\n"
      "%10s %10s %10s %10s %10s %9s %9s %9s %9s\n",
      "bytes", "raw_am", "raw_tag", "xchg", "xchg_GB/s", "xchg/am", "xchg/tag", "xchg/msg", "sym");
  for (size_t i = 0; i < std::size(kCases); ++i) {
    const double bytes = static_cast<double>(kCases[i].bytes);
    const double rtt = exchange[0][i];
    std::printf("%10zu %10.2f %10.2f %10.2f %10.3f %9.2f %9.2f %9.2f %9.2f\n", kCases[i].bytes,
                raw[i], raw_tag[i], rtt, 2 * bytes / (rtt * 1e3), rtt / raw[i], rtt / raw_tag[i],
                rtt / dxs[i], exchange[1][i]);
  }
  return WIFEXITED(status) && WEXITSTATUS(status) == 0 ? 0 : 1;
}
