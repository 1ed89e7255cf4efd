// Transport ping-pong: raw UCP active messages (the baseline, written straight against
// UCP: preallocated buffers, busy-polling progress) against the dxs UcxTransport (sender
// header, blocking waits with a short spin, a fresh payload vector per message) moving the
// same bytes between the same two processes. Both use the same UCX configuration, peer
// error handling with shared memory kept, so the ratio is the cost of the dxs layer.
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
#include "router/transport/transport.h"

namespace {

constexpr unsigned kRawAmId = 7;
constexpr size_t kMaxBytes = size_t{16} << 20;

struct SizeCase {
  size_t bytes;
  int iterations;
};
constexpr SizeCase kCases[] = {
    {0, 5000}, {1 << 10, 5000}, {64 << 10, 2000}, {1 << 20, 300}, {16 << 20, 40},
};

[[noreturn]] void Die(const std::string& what) {
  std::fprintf(stderr, "transport_bench: %s\n", what.c_str());
  std::exit(1);
}

void WriteAll(int fd, const void* data, size_t bytes) {
  const char* p = static_cast<const char*>(data);
  while (bytes > 0) {
    ssize_t n = write(fd, p, bytes);
    if (n <= 0) Die("pipe write failed");
    p += n;
    bytes -= static_cast<size_t>(n);
  }
}

void ReadAll(int fd, void* data, size_t bytes) {
  char* p = static_cast<char*>(data);
  while (bytes > 0) {
    ssize_t n = read(fd, p, bytes);
    if (n <= 0) Die("pipe read failed");
    p += n;
    bytes -= static_cast<size_t>(n);
  }
}

// Sends our address, returns the peer's.
std::string TradeAddresses(int read_fd, int write_fd, const std::string& own) {
  const uint64_t bytes = own.size();
  WriteAll(write_fd, &bytes, sizeof(bytes));
  WriteAll(write_fd, own.data(), own.size());
  uint64_t peer_bytes = 0;
  ReadAll(read_fd, &peer_bytes, sizeof(peer_bytes));
  std::string peer(peer_bytes, '\0');
  ReadAll(read_fd, peer.data(), peer.size());
  return peer;
}

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

class RawPeer {
 public:
  void Init(int read_fd, int write_fd) {
    ucp_config_t* config = nullptr;
    Check(ucp_config_read(nullptr, nullptr, &config), "ucp_config_read");
    ucp_params_t params = {};
    params.field_mask = UCP_PARAM_FIELD_FEATURES;
    params.features = UCP_FEATURE_AM;
    Check(ucp_init(&params, config, &context_), "ucp_init");
    ucp_config_release(config);
    ucp_worker_params_t worker_params = {};
    worker_params.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
    worker_params.thread_mode = UCS_THREAD_MODE_SINGLE;
    Check(ucp_worker_create(context_, &worker_params, &worker_), "ucp_worker_create");
    ucp_am_handler_param_t handler = {};
    handler.field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID | UCP_AM_HANDLER_PARAM_FIELD_FLAGS |
                         UCP_AM_HANDLER_PARAM_FIELD_CB | UCP_AM_HANDLER_PARAM_FIELD_ARG;
    handler.id = kRawAmId;
    handler.flags = UCP_AM_FLAG_WHOLE_MSG;
    handler.cb = &RawPeer::OnMessage;
    handler.arg = this;
    Check(ucp_worker_set_am_recv_handler(worker_, &handler), "set_am_recv_handler");

    ucp_address_t* address = nullptr;
    size_t address_bytes = 0;
    Check(ucp_worker_get_address(worker_, &address, &address_bytes), "get_address");
    const std::string peer = TradeAddresses(
        read_fd, write_fd, std::string(reinterpret_cast<char*>(address), address_bytes));
    ucp_worker_release_address(worker_, address);
    ucp_ep_params_t ep_params = {};
    ep_params.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE;
    ep_params.address = reinterpret_cast<const ucp_address_t*>(peer.data());
    ep_params.err_mode = UCP_ERR_HANDLING_MODE_PEER;
    Check(ucp_ep_create(worker_, &ep_params, &ep_), "ucp_ep_create");
    buffer_.resize(kMaxBytes);
  }

  void Close() {
    ucp_request_param_t params = {};
    params.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
    params.flags = UCP_EP_CLOSE_FLAG_FORCE;
    Wait(ucp_ep_close_nbx(ep_, &params), "ucp_ep_close_nbx");
    ucp_worker_destroy(worker_);
    ucp_cleanup(context_);
  }

  void Send(size_t bytes, bool quit = false) {
    const char quit_header = 'q';
    ucp_request_param_t params = {};
    Wait(ucp_am_send_nbx(ep_, kRawAmId, quit ? &quit_header : nullptr, quit ? 1 : 0, buffer_.data(),
                         bytes, &params),
         "ucp_am_send_nbx");
  }

  // Busy-polls until a message arrives; its size, or -1 for "quit".
  long Receive() {
    while (!received_) ucp_worker_progress(worker_);
    received_ = false;
    return quit_ ? -1 : static_cast<long>(received_bytes_);
  }

  uint8_t* data() { return buffer_.data(); }

 private:
  static void Check(ucs_status_t status, const char* what) {
    if (status != UCS_OK) Die(std::string(what) + ": " + ucs_status_string(status));
  }

  void Wait(ucs_status_ptr_t request, const char* what) {
    if (request == nullptr) return;
    if (UCS_PTR_IS_ERR(request)) Check(UCS_PTR_STATUS(request), what);
    while (ucp_request_check_status(request) == UCS_INPROGRESS) ucp_worker_progress(worker_);
    ucp_request_free(request);
  }

  static ucs_status_t OnMessage(void* arg, const void* header, size_t header_length, void* data,
                                size_t length, const ucp_am_recv_param_t* param) {
    auto* self = static_cast<RawPeer*>(arg);
    self->quit_ = header_length == 1;
    self->received_bytes_ = length;
    if (!(param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV)) {
      if (length > 0) std::memcpy(self->buffer_.data(), data, length);
      self->received_ = true;
      return UCS_OK;
    }
    ucp_request_param_t params = {};
    params.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
    params.cb.recv_am = [](void* request, ucs_status_t status, size_t, void* user_data) {
      static_cast<RawPeer*>(user_data)->received_ = true;
      ucp_request_free(request);
    };
    params.user_data = self;
    ucs_status_ptr_t request =
        ucp_am_recv_data_nbx(self->worker_, data, self->buffer_.data(), length, &params);
    if (request == nullptr) {
      self->received_ = true;
      return UCS_OK;
    }
    if (UCS_PTR_IS_ERR(request)) Die("ucp_am_recv_data_nbx failed");
    return UCS_INPROGRESS;
  }

  ucp_context_h context_ = nullptr;
  ucp_worker_h worker_ = nullptr;
  ucp_ep_h ep_ = nullptr;
  std::vector<uint8_t> buffer_;
  bool received_ = false;
  bool quit_ = false;
  size_t received_bytes_ = 0;
};

std::vector<double> RawClient(int read_fd, int write_fd, int scale) {
  RawPeer peer;
  peer.Init(read_fd, write_fd);
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
  peer.Send(0, /*quit=*/true);
  peer.Close();
  return medians;
}

void RawServer(int read_fd, int write_fd) {
  RawPeer peer;
  peer.Init(read_fd, write_fd);
  for (long bytes; (bytes = peer.Receive()) >= 0;) peer.Send(static_cast<size_t>(bytes));
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
