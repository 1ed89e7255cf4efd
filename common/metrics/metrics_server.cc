#include "common/metrics/metrics_server.h"

#include <arpa/inet.h>
#include <civetweb.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <string_view>
#include <thread>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"

namespace dxs::metrics {
namespace {

absl::Status BadAddress(std::string_view address, std::string_view why) {
  return absl::InvalidArgumentError(
      absl::StrCat("metrics address \"", std::string(address), "\": ", std::string(why)));
}

// Parses host:port into the address a local client reaches the server on (the wildcard
// addresses become loopback), port left 0. civetweb's listening_ports also takes lists and
// suffixes ("9100s" means TLS, "9100r" a redirect); only one plain host:port is accepted,
// so an address means what it says.
absl::StatusOr<sockaddr_storage> ParseAddress(std::string_view address) {
  const size_t colon = address.rfind(':');
  if (colon == std::string_view::npos) return BadAddress(address, "not host:port");
  const std::string host(address.substr(0, colon));
  const std::string_view port_text = address.substr(colon + 1);
  int port = -1;
  if (port_text.empty() || port_text.find_first_not_of("0123456789") != std::string_view::npos ||
      !absl::SimpleAtoi(std::string(port_text), &port) || port > 65535) {
    return BadAddress(address, "port must be 0..65535");
  }
  sockaddr_storage storage;
  std::memset(&storage, 0, sizeof(storage));
  auto* v4 = reinterpret_cast<sockaddr_in*>(&storage);
  auto* v6 = reinterpret_cast<sockaddr_in6*>(&storage);
  if (inet_pton(AF_INET, host.c_str(), &v4->sin_addr) == 1) {
    v4->sin_family = AF_INET;
    if (v4->sin_addr.s_addr == htonl(INADDR_ANY)) v4->sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  } else if (host.size() > 2 && host.front() == '[' && host.back() == ']' &&
             inet_pton(AF_INET6, host.substr(1, host.size() - 2).c_str(), &v6->sin6_addr) == 1) {
    v6->sin6_family = AF_INET6;
    if (IN6_IS_ADDR_UNSPECIFIED(&v6->sin6_addr)) v6->sin6_addr = in6addr_loopback;
  } else {
    return BadAddress(address, "host must be an IPv4 address or a bracketed IPv6 address");
  }
  return storage;
}

// Opens and closes one connection to the server, which wakes civetweb's accept loop.
void Poke(const sockaddr_storage& address) {
  const int fd = socket(address.ss_family, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return;
  const socklen_t size = address.ss_family == AF_INET ? sizeof(sockaddr_in) : sizeof(sockaddr_in6);
  connect(fd, reinterpret_cast<const sockaddr*>(&address), size);
  close(fd);
}

}  // namespace

absl::StatusOr<std::unique_ptr<MetricsServer>> MetricsServer::Start(MetricsServerOptions options) {
  absl::StatusOr<sockaddr_storage> local_address = ParseAddress(options.address);
  if (!local_address.ok()) return local_address.status();
  if (options.num_threads < 1) {
    return absl::InvalidArgumentError("metrics server needs num_threads >= 1");
  }
  if (local_address->ss_family == AF_INET6 && mg_check_feature(MG_FEATURES_IPV6) == 0) {
    return absl::UnimplementedError(absl::StrCat("metrics address ", options.address,
                                                 ": this civetweb was built without IPv6"));
  }
  std::unique_ptr<MetricsServer> server(new MetricsServer());
  try {
    // No document root: civetweb serves nothing but the exposer's /metrics handler.
    server->exposer_ = std::make_unique<prometheus::Exposer>(
        std::vector<std::string>{"listening_ports", options.address, "num_threads",
                                 absl::StrCat(options.num_threads), "request_timeout_ms", "10000"});
  } catch (const std::exception& e) {  // CivetException: the port cannot be bound
    return absl::UnavailableError(
        absl::StrCat("metrics server cannot listen on ", options.address, ": ", e.what()));
  }
  const std::vector<int> ports = server->exposer_->GetListeningPorts();
  if (ports.size() != 1 || ports[0] <= 0) {
    return absl::InternalError(
        absl::StrCat("metrics server on ", options.address, " reports no bound port"));
  }
  server->port_ = ports[0];
  server->local_address_ = *local_address;
  const uint16_t port = htons(static_cast<uint16_t>(server->port_));
  if (server->local_address_.ss_family == AF_INET) {
    reinterpret_cast<sockaddr_in*>(&server->local_address_)->sin_port = port;
  } else {
    reinterpret_cast<sockaddr_in6*>(&server->local_address_)->sin6_port = port;
  }
  return server;
}

MetricsServer::~MetricsServer() { Stop(); }

void MetricsServer::Expose(const std::shared_ptr<prometheus::Collectable>& collectable) {
  if (exposer_ != nullptr) exposer_->RegisterCollectable(collectable);
}

void MetricsServer::Stop() {
  if (exposer_ == nullptr) return;
  std::atomic<bool> stopped{false};
  std::thread waker([this, &stopped] {
    while (!stopped.load()) {
      Poke(local_address_);
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
  });
  exposer_.reset();  // mg_stop: returns once civetweb's threads are done
  stopped.store(true);
  waker.join();
}

}  // namespace dxs::metrics
