#include "common/flags/tls_flags.h"

#include "absl/flags/flag.h"

ABSL_FLAG(std::string, tls_cert, "",
          "PEM certificate chain this process presents (TLS on every gRPC connection).");
ABSL_FLAG(std::string, tls_key, "", "PEM private key of --tls_cert.");
ABSL_FLAG(std::string, tls_ca, "", "PEM CA bundle the peers' certificates are checked against.");
ABSL_FLAG(bool, mtls, false, "Require and check client certificates (mutual TLS).");

namespace dxs::flags {

absl::StatusOr<TlsConfig> TlsFromFlags(bool for_server) {
  TlsConfig tls;
  tls.cert_file = absl::GetFlag(FLAGS_tls_cert);
  tls.key_file = absl::GetFlag(FLAGS_tls_key);
  tls.ca_file = absl::GetFlag(FLAGS_tls_ca);
  tls.mutual = absl::GetFlag(FLAGS_mtls);
  if (absl::Status s = tls.Validate(for_server); !s.ok()) return s;
  return tls;
}

std::vector<std::string> TlsArgv(const TlsConfig& tls) {
  std::vector<std::string> argv;
  if (!tls.cert_file.empty()) argv.insert(argv.end(), {"--tls-cert", tls.cert_file});
  if (!tls.key_file.empty()) argv.insert(argv.end(), {"--tls-key", tls.key_file});
  if (!tls.ca_file.empty()) argv.insert(argv.end(), {"--tls-ca", tls.ca_file});
  if (tls.mutual) argv.push_back("--mtls");
  return argv;
}

}  // namespace dxs::flags
