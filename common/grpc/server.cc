#include "common/grpc/server.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "grpcpp/ext/proto_server_reflection_plugin.h"
#include "grpcpp/health_check_service_interface.h"
#include "grpcpp/security/server_credentials.h"

namespace dxs {

absl::StatusOr<GrpcServer> StartGrpcServer(const GrpcServerOptions& options,
                                           const std::vector<grpc::Service*>& services) {
  if (options.address.empty()) {
    return absl::InvalidArgumentError("gRPC server address is empty");
  }
  for (const grpc::Service* service : services) {
    if (service == nullptr) return absl::InvalidArgumentError("null gRPC service");
  }
  // Both are process-wide switches read when a ServerBuilder is created and built, so they
  // must come first. Each is idempotent.
  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();

  grpc::ServerBuilder builder;
  int port = 0;
  builder.AddListeningPort(
      options.address,
      options.credentials ? options.credentials : grpc::InsecureServerCredentials(), &port);
  builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
  builder.AddChannelArgument(GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS,
                             options.min_client_ping_interval_ms);
  builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 1);
  if (options.max_receive_message_bytes > 0) {
    builder.SetMaxReceiveMessageSize(options.max_receive_message_bytes);
  }
  for (grpc::Service* service : services) builder.RegisterService(service);
  if (options.configure) options.configure(builder);

  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (server == nullptr || port == 0) {
    if (server != nullptr) server->Shutdown();
    return absl::UnavailableError(
        absl::StrCat("cannot listen on ", options.address, " (address in use or invalid)"));
  }
  return GrpcServer{std::move(server), port};
}

}  // namespace dxs
