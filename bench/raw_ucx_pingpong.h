// Raw UCP active-message ping-pong: the baseline the transport and dispatch benchmarks
// measure dxs against. Written straight against UCP (preallocated buffers, busy-polling
// progress, no dxs framing), so its round trip is what UCX itself costs on this machine.
//
// Two processes, forked before either touches UCX (UCX state must not cross fork());
// worker addresses travel over pipes. Endpoints use peer error handling, as the dxs
// transport does; callers set UCX_POSIX_ERROR_HANDLING / UCX_SYSV_ERROR_HANDLING before
// Init so both sides of a comparison keep shared memory.
//
// Protocol: one active message per request and per answer. The server answers each
// request with a message of the size the request's AM header asks for (8 bytes), or of
// the request's own size when the header is empty (echo); a 1-byte header means "quit".
//
// Thread safety: a RawUcxPeer is used by one thread. Any UCX or pipe failure ends the
// process with a message (these are benchmarks).
#pragma once

#include <ucp/api/ucp.h>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace dxs::bench {

// Prints "<program>: what" to stderr and exits 1.
[[noreturn]] void Die(const std::string& what);
// Pins the calling process to one CPU: the two ends of a ping-pong on a small machine,
// which the scheduler otherwise sometimes stacks on one CPU (about 2.5 us more per round
// trip and half the copy bandwidth, for every method alike).
void PinToCpu(int cpu);

// Pipe helpers shared by the two-process benches.
void WriteAll(int fd, const void* data, size_t bytes);
void ReadAll(int fd, void* data, size_t bytes);
// A length-prefixed string over a pipe.
void WriteString(int fd, const std::string& s);
std::string ReadString(int fd);
// Sends `own` (WriteString) and returns the peer's.
std::string TradeAddresses(int read_fd, int write_fd, const std::string& own);

// Dies naming `what` unless `status` is UCS_OK.
void CheckUcs(ucs_status_t status, const char* what);

// What both raw UCP baselines start from: a context with `features`, a single-threaded
// worker, and one endpoint (peer error handling, as dxs uses) to the process at the other
// end of the pipes, whose worker address is traded over them. `before_connect` runs on the
// new worker before the trade (AM handlers are set there).
struct RawUcxConnection {
  void Open(int read_fd, int write_fd, uint64_t features,
            const std::function<void(ucp_worker_h)>& before_connect = {});
  // Force-closes the endpoint, then destroys the worker and the context.
  void Close();
  // Progresses the worker until `request` completes (null: it already did), then frees it;
  // dies if it failed.
  void Wait(ucs_status_ptr_t request, const char* what);

  ucp_context_h context = nullptr;
  ucp_worker_h worker = nullptr;
  ucp_ep_h ep = nullptr;
};

class RawUcxPeer {
 public:
  // Creates the UCP context and worker, trades worker addresses with the peer over the
  // pipes and connects. Messages of up to `max_bytes` fit the buffer.
  void Init(int read_fd, int write_fd, size_t max_bytes);
  void Close();

  // Sends `bytes` from data(), asking the server to echo the same size.
  void Send(size_t bytes);
  // Sends `bytes` from data(), asking the server to answer with `reply_bytes`.
  void SendWithReply(size_t bytes, size_t reply_bytes);
  void SendQuit();

  // Busy-polls until a message arrives (its data lands in data()); its size, or -1 for
  // "quit".
  long Receive();

  // Server side: answers requests until "quit", or until `max_requests` (when >= 0) were
  // answered.
  void Serve(long max_requests = -1);

  uint8_t* data() { return buffer_.data(); }

 private:
  void SendAm(const void* header, size_t header_bytes, size_t bytes);
  static ucs_status_t OnMessage(void* arg, const void* header, size_t header_length, void* data,
                                size_t length, const ucp_am_recv_param_t* param);

  RawUcxConnection ucx_;
  std::vector<uint8_t> buffer_;
  bool received_ = false;
  bool quit_ = false;
  size_t received_bytes_ = 0;
  // Answer size the last request asked for; -1: echo.
  long requested_reply_bytes_ = -1;
};

}  // namespace dxs::bench
