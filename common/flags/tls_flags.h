// The TLS flags every dxs service takes, as abseil flags: --tls_cert FILE --tls_key FILE
// --tls_ca FILE [--mtls] (also spelled --tls-cert ..., see parse.h). common/grpc/tls.h says
// what they do. The dxs CLI takes the same flags through its own subcommand parser and
// passes them on to the services it starts with TlsArgv.
#pragma once

#include <string>
#include <vector>

#include "absl/flags/declare.h"
#include "absl/status/statusor.h"
#include "common/grpc/tls.h"

ABSL_DECLARE_FLAG(std::string, tls_cert);
ABSL_DECLARE_FLAG(std::string, tls_key);
ABSL_DECLARE_FLAG(std::string, tls_ca);
ABSL_DECLARE_FLAG(bool, mtls);

namespace dxs::flags {

// Reads and validates the TLS flags (`for_server`: this process serves gRPC).
absl::StatusOr<TlsConfig> TlsFromFlags(bool for_server);

// The same settings as command-line flags, for passing on to a child process.
std::vector<std::string> TlsArgv(const TlsConfig& tls);

}  // namespace dxs::flags
