// Builds and starts a grpc::Server the way every dxs service wants it: the standard
// grpc.health.v1.Health service (Kubernetes gRPC probes, `grpc_health_probe`) and server
// reflection (`grpcurl list`) enabled, bound to one address, port 0 allowed.
//
// Listening sockets are exclusive (no SO_REUSEPORT), so a second process on the same port
// fails to start instead of silently sharing traffic with the first. Clients may send
// keepalive pings as often as once per min_client_ping_interval_ms, which lets the router
// notice a dead worker within seconds (DESIGN: in-flight requests fail with UNAVAILABLE).
// Connections are plaintext; encryption, if any, is the service mesh's job.
//
// Thread safety: StartGrpcServer may be called from any thread; the returned server is
// gRPC's and as thread-safe as it is. Health status is "" -> SERVING once started; use
// server->GetHealthCheckService()->SetServingStatus(false) while draining.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "grpcpp/security/server_credentials.h"
#include "grpcpp/server.h"
#include "grpcpp/server_builder.h"

namespace dxs {

struct GrpcServerOptions {
  // host:port to listen on, e.g. "0.0.0.0:50051", "[::]:0", "127.0.0.1:0". Port 0 asks
  // the kernel for a free port; GrpcServer::port reports it.
  std::string address;
  // Largest request message accepted; 0 keeps gRPC's default (4 MiB).
  int max_receive_message_bytes = 0;
  // Shortest interval between client keepalive pings the server tolerates.
  int min_client_ping_interval_ms = 1000;
  // Transport security; plaintext when null (see common/grpc/tls.h).
  std::shared_ptr<grpc::ServerCredentials> credentials;
  // Called last, before BuildAndStart, for what this helper does not cover (completion
  // queues of async services, extra channel arguments).
  std::function<void(grpc::ServerBuilder&)> configure;
};

struct GrpcServer {
  std::unique_ptr<grpc::Server> server;
  // The port actually bound.
  int port = 0;
};

// Registers `services` (not owned; they must outlive the server), enables health checking
// and reflection, and starts serving. Errors: INVALID_ARGUMENT for an empty address or a
// null service, UNAVAILABLE when the address cannot be bound (in use, bad host).
absl::StatusOr<GrpcServer> StartGrpcServer(const GrpcServerOptions& options,
                                           const std::vector<grpc::Service*>& services);

}  // namespace dxs
