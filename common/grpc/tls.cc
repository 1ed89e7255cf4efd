#include "common/grpc/tls.h"

#include <fstream>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/security/auth_context.h"

namespace dxs {
namespace {

absl::StatusOr<std::string> ReadPem(const std::string& path, const char* flag) {
  std::ifstream f(path);
  if (!f.good()) {
    return absl::InvalidArgumentError(absl::StrCat(flag, ": cannot read '", path, "'"));
  }
  std::stringstream ss;
  ss << f.rdbuf();
  if (ss.str().find("-----BEGIN") == std::string::npos) {
    return absl::InvalidArgumentError(absl::StrCat(flag, ": '", path, "' is not PEM"));
  }
  return ss.str();
}

}  // namespace

absl::Status TlsConfig::Validate(bool for_server) const {
  if (!enabled()) {
    if (mutual) return absl::InvalidArgumentError("--mtls needs --tls-cert, --tls-key, --tls-ca");
    return absl::OkStatus();
  }
  if (cert_file.empty() != key_file.empty()) {
    return absl::InvalidArgumentError("--tls-cert and --tls-key go together");
  }
  if (for_server && cert_file.empty()) {
    return absl::InvalidArgumentError("a TLS server needs --tls-cert and --tls-key");
  }
  if (ca_file.empty()) {
    return absl::InvalidArgumentError("--tls-ca is required with TLS (peers are verified)");
  }
  for (const auto& [path, flag] : {std::pair<std::string, const char*>{cert_file, "--tls-cert"},
                                   {key_file, "--tls-key"},
                                   {ca_file, "--tls-ca"}}) {
    if (path.empty()) continue;
    absl::StatusOr<std::string> pem = ReadPem(path, flag);
    if (!pem.ok()) return pem.status();
  }
  return absl::OkStatus();
}

absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> MakeServerCredentials(
    const TlsConfig& tls) {
  if (!tls.enabled()) return grpc::InsecureServerCredentials();
  if (absl::Status s = tls.Validate(/*for_server=*/true); !s.ok()) return s;
  grpc::SslServerCredentialsOptions options(tls.mutual
                                                ? GRPC_SSL_REQUEST_CLIENT_CERTIFICATE_AND_VERIFY
                                                : GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE);
  absl::StatusOr<std::string> ca = ReadPem(tls.ca_file, "--tls-ca");
  absl::StatusOr<std::string> cert = ReadPem(tls.cert_file, "--tls-cert");
  absl::StatusOr<std::string> key = ReadPem(tls.key_file, "--tls-key");
  if (!ca.ok()) return ca.status();
  if (!cert.ok()) return cert.status();
  if (!key.ok()) return key.status();
  options.pem_root_certs = *ca;
  options.pem_key_cert_pairs.push_back({*key, *cert});
  return grpc::SslServerCredentials(options);
}

absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> MakeChannelCredentials(
    const TlsConfig& tls) {
  if (!tls.enabled()) return grpc::InsecureChannelCredentials();
  if (absl::Status s = tls.Validate(/*for_server=*/false); !s.ok()) return s;
  grpc::SslCredentialsOptions options;
  absl::StatusOr<std::string> ca = ReadPem(tls.ca_file, "--tls-ca");
  if (!ca.ok()) return ca.status();
  options.pem_root_certs = *ca;
  if (!tls.cert_file.empty()) {
    absl::StatusOr<std::string> cert = ReadPem(tls.cert_file, "--tls-cert");
    absl::StatusOr<std::string> key = ReadPem(tls.key_file, "--tls-key");
    if (!cert.ok()) return cert.status();
    if (!key.ok()) return key.status();
    options.pem_cert_chain = *cert;
    options.pem_private_key = *key;
  }
  return grpc::SslCredentials(options);
}

absl::StatusOr<std::shared_ptr<grpc::Channel>> MakeChannel(const std::string& address,
                                                           const TlsConfig& tls) {
  absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> creds = MakeChannelCredentials(tls);
  if (!creds.ok()) return creds.status();
  return grpc::CreateChannel(address, *creds);
}

absl::Status RequireClusterPeer(const grpc::ServerContext& context, const TlsConfig& tls) {
  if (!tls.mutual) return absl::OkStatus();
  std::shared_ptr<const grpc::AuthContext> auth = context.auth_context();
  // With REQUEST_..._AND_VERIFY, a presented certificate that fails verification ends the
  // handshake; so a peer identity here is a certificate the cluster CA signed.
  if (auth == nullptr || !auth->IsPeerAuthenticated()) {
    return absl::UnauthenticatedError(
        "this RPC is for cluster members: present a certificate signed by the cluster CA");
  }
  return absl::OkStatus();
}

}  // namespace dxs
