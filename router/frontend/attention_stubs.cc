#include "router/frontend/attention_stubs.h"

#include "common/grpc/cluster_channel.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/security/credentials.h"
#include "grpcpp/support/channel_arguments.h"

namespace dxs {
namespace {

// Ping every 2 s during calls; the workers' servers accept pings every 1 s
// (GrpcServerOptions::min_client_ping_interval_ms), so this never earns a GOAWAY.
constexpr int kKeepaliveTimeMs = 2000;
constexpr int kKeepaliveTimeoutMs = 2000;

}  // namespace

AttentionStubs::AttentionStubs(int num_ranks, std::shared_ptr<grpc::ChannelCredentials> credentials)
    : credentials_(credentials ? std::move(credentials) : grpc::InsecureChannelCredentials()),
      stubs_(static_cast<size_t>(num_ranks)) {}

std::shared_ptr<v1::AttentionWorker::Stub> AttentionStubs::Get(int rank,
                                                               const std::string& address) {
  absl::MutexLock lock(&mu_);
  if (rank < 0 || rank >= static_cast<int>(stubs_.size())) return nullptr;
  auto& [cached_address, stub] = stubs_[rank];
  if (stub == nullptr || cached_address != address) {
    grpc::ChannelArguments args = ClusterChannelArguments();
    args.SetInt(GRPC_ARG_KEEPALIVE_TIME_MS, kKeepaliveTimeMs);
    args.SetInt(GRPC_ARG_KEEPALIVE_TIMEOUT_MS, kKeepaliveTimeoutMs);
    // Long prefills send no data for a while; keep pinging through them.
    args.SetInt(GRPC_ARG_HTTP2_MAX_PINGS_WITHOUT_DATA, 0);
    cached_address = address;
    stub = v1::AttentionWorker::NewStub(grpc::CreateCustomChannel(address, credentials_, args));
  }
  return stub;
}

}  // namespace dxs
