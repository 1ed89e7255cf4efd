// Channels between the cluster's own processes: worker -> router (membership), router ->
// attention workers (the frontend's streams), router -> expert workers (EPLB).
//
// gRPC's default reconnect policy suits a client of a far-away service: after failures the
// wait before the next connection attempt grows to 120 s, and an attempt whose packets are
// dropped waits up to 20 s. Inside a cluster that turns a 10 s partition into a minute of
// lost service after the link is back: every channel sits out its backoff. Here a
// connection attempt is cheap (one TCP and HTTP/2 handshake on the same network), so the
// cluster's channels try again at least every kMaxReconnectBackoffMs and give each attempt
// kConnectTimeoutMs; a healed link is used within about a second.
#pragma once

#include <memory>
#include <string>

#include "grpcpp/channel.h"
#include "grpcpp/security/credentials.h"
#include "grpcpp/support/channel_arguments.h"

namespace dxs {

inline constexpr int kInitialReconnectBackoffMs = 100;
inline constexpr int kMaxReconnectBackoffMs = 1000;
// Generous for a handshake on one network, even on a loaded host.
inline constexpr int kConnectTimeoutMs = 2000;

// The reconnect arguments above; callers add their own (keepalive) to the result.
grpc::ChannelArguments ClusterChannelArguments();

std::shared_ptr<grpc::Channel> MakeClusterChannel(
    const std::string& address, const std::shared_ptr<grpc::ChannelCredentials>& credentials);

}  // namespace dxs
