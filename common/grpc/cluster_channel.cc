#include "common/grpc/cluster_channel.h"

#include "grpcpp/create_channel.h"

namespace dxs {

grpc::ChannelArguments ClusterChannelArguments() {
  grpc::ChannelArguments args;
  args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, kInitialReconnectBackoffMs);
  args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, kMaxReconnectBackoffMs);
  // gRPC names the connection attempt's minimum deadline "min reconnect backoff".
  args.SetInt(GRPC_ARG_MIN_RECONNECT_BACKOFF_MS, kConnectTimeoutMs);
  return args;
}

std::shared_ptr<grpc::Channel> MakeClusterChannel(
    const std::string& address, const std::shared_ptr<grpc::ChannelCredentials>& credentials) {
  return grpc::CreateCustomChannel(address, credentials, ClusterChannelArguments());
}

}  // namespace dxs
