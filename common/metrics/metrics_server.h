// Serves collectables (a prometheus::Registry, CallbackGauges, the router's ClusterMetrics)
// over HTTP for Prometheus to scrape, through prometheus-cpp's pull exposer
// (prometheus::Exposer, on civetweb):
//
//   GET /metrics   200, Content-Type: text/plain; charset=utf-8, the text format 0.0.4
//                  (gzip when the scraper accepts it, as Prometheus does)
//
// The exposer adds its own series (exposer_scrapes_total, exposer_transferred_bytes_total,
// exposer_request_latencies); docs/metrics.md lists them.
//
// What this wrapper adds to prometheus::Exposer: absl::Status instead of exceptions, one
// plain host:port and nothing else (civetweb's listening_ports also takes lists and
// suffixes: "9100s" means TLS), and a Stop that takes milliseconds (see Stop).
//
//   MetricsServerOptions options;
//   options.address = "0.0.0.0:9100";
//   DXS_ASSIGN_OR_RETURN(std::unique_ptr<MetricsServer> server, MetricsServer::Start(options));
//   server->Expose(registry);  // a std::shared_ptr<prometheus::Collectable>
//
// Thread safety: every method may be called from any thread; scrapes run on civetweb's
// threads. The server keeps weak pointers: a collectable destroyed while still exposed is
// skipped, and one in the middle of a scrape stays alive until that scrape ends. Stop (or
// the destructor) returns after every request in progress has finished.
#pragma once

#include <sys/socket.h>

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "prometheus/collectable.h"
#include "prometheus/exposer.h"

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
  // Binds and starts serving (nothing is exposed until Expose). InvalidArgument for a
  // malformed address, Unavailable when the address cannot be bound (port in use, no such
  // interface), Unimplemented for IPv6 without civetweb support.
  static absl::StatusOr<std::unique_ptr<MetricsServer>> Start(MetricsServerOptions options);
  ~MetricsServer();
  MetricsServer(const MetricsServer&) = delete;
  MetricsServer& operator=(const MetricsServer&) = delete;

  // Adds `collectable` to what GET /metrics returns.
  void Expose(const std::shared_ptr<prometheus::Collectable>& collectable);
  // The bound port (the kernel's choice when the address asked for port 0).
  int port() const { return port_; }
  // Stops accepting, waits for requests in progress, releases the port. Idempotent.
  // civetweb's accept loop polls in 2 s quanta and only then sees the stop flag; Stop
  // connects to the port meanwhile, which wakes it, so it returns in milliseconds.
  void Stop();

 private:
  MetricsServer() = default;

  std::unique_ptr<prometheus::Exposer> exposer_;
  int port_ = 0;
  // Where Stop connects to wake civetweb's accept loop: the bound address and port, with a
  // wildcard host replaced by loopback.
  sockaddr_storage local_address_{};
};

}  // namespace dxs::metrics
