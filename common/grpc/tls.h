// TLS for every dxs gRPC server and client, from PEM files named on the command line
// (--tls-cert, --tls-key, --tls-ca, --mtls on every binary).
//
// Off (no files): plaintext, for loopback development. On: servers present cert/key;
// clients verify the server against the CA and, when they have cert/key, present them.
// Mutual TLS: servers ask every client for a certificate and verify any that is offered
// against the cluster CA; RPCs that only cluster members may call (registration, drain,
// placement) then require one (RequireClusterPeer), while the frontend API stays open to
// clients without a cluster certificate.
#pragma once

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "grpcpp/security/credentials.h"
#include "grpcpp/security/server_credentials.h"
#include "grpcpp/server_context.h"

namespace dxs {

struct TlsConfig {
  std::string cert_file;  // this process's certificate chain (PEM)
  std::string key_file;   // its private key (PEM)
  std::string ca_file;    // the cluster CA: verifies peers (PEM)
  bool mutual = false;    // servers verify client certificates; cluster RPCs require one

  bool enabled() const { return !cert_file.empty() || !key_file.empty() || !ca_file.empty(); }
  // Checks the combination (a server needs cert and key; mTLS needs a CA) and that the
  // files are readable. INVALID_ARGUMENT naming the flag otherwise.
  absl::Status Validate(bool for_server) const;
};

absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> MakeServerCredentials(
    const TlsConfig& tls);
absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> MakeChannelCredentials(
    const TlsConfig& tls);
// A channel to `address` with `tls`'s credentials (plaintext when TLS is off).
absl::StatusOr<std::shared_ptr<grpc::Channel>> MakeChannel(const std::string& address,
                                                           const TlsConfig& tls);

// OK unless mutual TLS is on and the caller presented no certificate verified by the
// cluster CA: then UNAUTHENTICATED.
absl::Status RequireClusterPeer(const grpc::ServerContext& context, const TlsConfig& tls);

}  // namespace dxs
