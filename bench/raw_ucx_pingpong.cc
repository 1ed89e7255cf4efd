#include "bench/raw_ucx_pingpong.h"

#include <errno.h>
#include <sched.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>

namespace dxs::bench {
namespace {

constexpr unsigned kRawAmId = 7;
constexpr char kQuitHeader = 'q';

}  // namespace

void Die(const std::string& what) {
  std::fprintf(stderr, "%s: %s\n", program_invocation_short_name, what.c_str());
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

void WriteString(int fd, const std::string& s) {
  const uint64_t bytes = s.size();
  WriteAll(fd, &bytes, sizeof(bytes));
  if (bytes > 0) WriteAll(fd, s.data(), bytes);
}

std::string ReadString(int fd) {
  uint64_t bytes = 0;
  ReadAll(fd, &bytes, sizeof(bytes));
  std::string s(bytes, '\0');
  if (bytes > 0) ReadAll(fd, s.data(), bytes);
  return s;
}

std::string TradeAddresses(int read_fd, int write_fd, const std::string& own) {
  WriteString(write_fd, own);
  return ReadString(read_fd);
}

void CheckUcs(ucs_status_t status, const char* what) {
  if (status != UCS_OK) Die(std::string(what) + ": " + ucs_status_string(status));
}

void RawUcxConnection::Open(int read_fd, int write_fd, uint64_t features,
                            const std::function<void(ucp_worker_h)>& before_connect) {
  ucp_config_t* config = nullptr;
  CheckUcs(ucp_config_read(nullptr, nullptr, &config), "ucp_config_read");
  ucp_params_t params = {};
  params.field_mask = UCP_PARAM_FIELD_FEATURES;
  params.features = features;
  CheckUcs(ucp_init(&params, config, &context), "ucp_init");
  ucp_config_release(config);
  ucp_worker_params_t worker_params = {};
  worker_params.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
  worker_params.thread_mode = UCS_THREAD_MODE_SINGLE;
  CheckUcs(ucp_worker_create(context, &worker_params, &worker), "ucp_worker_create");
  if (before_connect) before_connect(worker);
  ucp_address_t* address = nullptr;
  size_t address_bytes = 0;
  CheckUcs(ucp_worker_get_address(worker, &address, &address_bytes), "get_address");
  const std::string peer = TradeAddresses(
      read_fd, write_fd, std::string(reinterpret_cast<char*>(address), address_bytes));
  ucp_worker_release_address(worker, address);
  ucp_ep_params_t ep_params = {};
  ep_params.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE;
  ep_params.address = reinterpret_cast<const ucp_address_t*>(peer.data());
  ep_params.err_mode = UCP_ERR_HANDLING_MODE_PEER;
  CheckUcs(ucp_ep_create(worker, &ep_params, &ep), "ucp_ep_create");
}

void RawUcxConnection::Close() {
  ucp_request_param_t params = {};
  params.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
  params.flags = UCP_EP_CLOSE_FLAG_FORCE;
  Wait(ucp_ep_close_nbx(ep, &params), "ucp_ep_close_nbx");
  ucp_worker_destroy(worker);
  ucp_cleanup(context);
}

void RawUcxConnection::Wait(ucs_status_ptr_t request, const char* what) {
  if (request == nullptr) return;
  if (UCS_PTR_IS_ERR(request)) CheckUcs(UCS_PTR_STATUS(request), what);
  while (ucp_request_check_status(request) == UCS_INPROGRESS) ucp_worker_progress(worker);
  CheckUcs(ucp_request_check_status(request), what);
  ucp_request_free(request);
}

void RawUcxPeer::Init(int read_fd, int write_fd, size_t max_bytes) {
  ucx_.Open(read_fd, write_fd, UCP_FEATURE_AM, [this](ucp_worker_h worker) {
    ucp_am_handler_param_t handler = {};
    handler.field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID | UCP_AM_HANDLER_PARAM_FIELD_FLAGS |
                         UCP_AM_HANDLER_PARAM_FIELD_CB | UCP_AM_HANDLER_PARAM_FIELD_ARG;
    handler.id = kRawAmId;
    handler.flags = UCP_AM_FLAG_WHOLE_MSG;
    handler.cb = &RawUcxPeer::OnMessage;
    handler.arg = this;
    CheckUcs(ucp_worker_set_am_recv_handler(worker, &handler), "set_am_recv_handler");
  });
  buffer_.resize(max_bytes);
}

void RawUcxPeer::Close() { ucx_.Close(); }

void RawUcxPeer::Send(size_t bytes) { SendAm(nullptr, 0, bytes); }

void RawUcxPeer::SendWithReply(size_t bytes, size_t reply_bytes) {
  const uint64_t header = reply_bytes;
  SendAm(&header, sizeof(header), bytes);
}

void RawUcxPeer::SendQuit() { SendAm(&kQuitHeader, 1, 0); }

void RawUcxPeer::SendAm(const void* header, size_t header_bytes, size_t bytes) {
  if (bytes > buffer_.size()) Die("raw: message larger than the buffer");
  ucp_request_param_t params = {};
  ucx_.Wait(
      ucp_am_send_nbx(ucx_.ep, kRawAmId, header, header_bytes, buffer_.data(), bytes, &params),
      "ucp_am_send_nbx");
}

long RawUcxPeer::Receive() {
  while (!received_) ucp_worker_progress(ucx_.worker);
  received_ = false;
  return quit_ ? -1 : static_cast<long>(received_bytes_);
}

void RawUcxPeer::Serve(long max_requests) {
  for (long served = 0; max_requests < 0 || served < max_requests; ++served) {
    const long bytes = Receive();
    if (bytes < 0) return;
    Send(requested_reply_bytes_ < 0 ? static_cast<size_t>(bytes)
                                    : static_cast<size_t>(requested_reply_bytes_));
  }
}

ucs_status_t RawUcxPeer::OnMessage(void* arg, const void* header, size_t header_length, void* data,
                                   size_t length, const ucp_am_recv_param_t* param) {
  auto* self = static_cast<RawUcxPeer*>(arg);
  self->quit_ = header_length == 1;
  self->requested_reply_bytes_ = -1;
  if (header_length == sizeof(uint64_t)) {
    uint64_t reply_bytes;
    std::memcpy(&reply_bytes, header, sizeof(reply_bytes));
    self->requested_reply_bytes_ = static_cast<long>(reply_bytes);
  }
  self->received_bytes_ = length;
  if (length > self->buffer_.size()) Die("raw: received a message larger than the buffer");
  if (!(param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV)) {
    if (length > 0) std::memcpy(self->buffer_.data(), data, length);
    self->received_ = true;
    return UCS_OK;
  }
  ucp_request_param_t params = {};
  params.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
  params.cb.recv_am = [](void* request, ucs_status_t status, size_t, void* user_data) {
    static_cast<RawUcxPeer*>(user_data)->received_ = true;
    ucp_request_free(request);
  };
  params.user_data = self;
  ucs_status_ptr_t request =
      ucp_am_recv_data_nbx(self->ucx_.worker, data, self->buffer_.data(), length, &params);
  if (request == nullptr) {
    self->received_ = true;
    return UCS_OK;
  }
  if (UCS_PTR_IS_ERR(request)) Die("ucp_am_recv_data_nbx failed");
  return UCS_INPROGRESS;
}

void PinToCpu(int cpu) {
  cpu_set_t set;
  CPU_ZERO(&set);
  CPU_SET(cpu, &set);
  if (sched_setaffinity(0, sizeof(set), &set) != 0) Die("sched_setaffinity");
}

}  // namespace dxs::bench
