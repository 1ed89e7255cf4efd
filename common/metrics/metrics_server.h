// Serves a Registry's exposition over HTTP, for Prometheus to scrape:
//
//   GET /metrics   200, Content-Type: text/plain; version=0.0.4; charset=utf-8
//   HEAD /metrics  the same headers, no body
//   other methods  405; other paths 404
//
// Built on civetweb with a small fixed pool of threads; nothing but /metrics is served
// (no document root). Plain HTTP: encryption, if any, is the service mesh's job.
//
//   MetricsServerOptions options;
//   options.address = "0.0.0.0:9100";
//   DXS_ASSIGN_OR_RETURN(std::unique_ptr<MetricsServer> server,
//                        MetricsServer::Start(&registry, options));
//
// Thread safety: Start and Stop may be called from any thread; scrapes run on civetweb's
// threads and only read the registry. Stop (or the destructor) returns after every request
// in progress has finished, so the registry may be destroyed after it.
#pragma once

#include <sys/socket.h>

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "common/metrics/registry.h"

struct mg_connection;
struct mg_context;

namespace dxs::metrics {

struct MetricsServerOptions {
  // host:port; host an IPv4 literal or a bracketed IPv6 literal: "0.0.0.0:9100" (every
  // interface), "127.0.0.1:0", "[::]:9100". Port 0 asks the kernel for a free port;
  // MetricsServer::port reports it. IPv6 needs a civetweb built with it (Debian 12's is not:
  // Start then fails with Unimplemented).
  std::string address = "0.0.0.0:9100";
  // Threads serving requests; scrapes are rare, a few suffice.
  int num_threads = 2;
};

class MetricsServer {
 public:
  // Binds and starts serving. InvalidArgument for a malformed address, Unavailable when the
  // address cannot be bound (port in use, no such interface), Unimplemented for IPv6
  // without civetweb support. registry must outlive the server.
  static absl::StatusOr<std::unique_ptr<MetricsServer>> Start(const Registry* registry,
                                                              MetricsServerOptions options);
  ~MetricsServer();
  MetricsServer(const MetricsServer&) = delete;
  MetricsServer& operator=(const MetricsServer&) = delete;

  // The bound port (the kernel's choice when the address asked for port 0).
  int port() const { return port_; }
  // Stops accepting, waits for requests in progress, releases the port. Idempotent.
  void Stop();

 private:
  explicit MetricsServer(const Registry* registry) : registry_(registry) {}
  static int HandleMetrics(mg_connection* conn, void* self);

  const Registry* registry_;
  mg_context* context_ = nullptr;
  int port_ = 0;
  // Where Stop connects to wake civetweb's accept loop: the bound address and port, with a
  // wildcard host replaced by loopback.
  sockaddr_storage local_address_{};
};

}  // namespace dxs::metrics
