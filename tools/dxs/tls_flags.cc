#include "tools/dxs/tls_flags.h"

namespace dxs::cli {

std::set<std::string> WithTlsValueFlags(std::set<std::string> flags) {
  flags.insert({"tls-cert", "tls-key", "tls-ca"});
  return flags;
}

std::set<std::string> WithTlsBoolFlags(std::set<std::string> flags) {
  flags.insert("mtls");
  return flags;
}

absl::StatusOr<TlsConfig> TlsFromArgs(const Args& args, bool for_server) {
  TlsConfig tls;
  tls.cert_file = args.GetString("tls-cert");
  tls.key_file = args.GetString("tls-key");
  tls.ca_file = args.GetString("tls-ca");
  tls.mutual = args.Has("mtls");
  if (absl::Status s = tls.Validate(for_server); !s.ok()) return s;
  return tls;
}

}  // namespace dxs::cli
