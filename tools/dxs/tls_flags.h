// The TLS flags of the dxs subcommands (up, generate, status, bench): --tls-cert FILE
// --tls-key FILE --tls-ca FILE [--mtls], read through the CLI's own parser (cli_args.h).
// The services take the same flags as abseil flags (common/flags/tls_flags.h, which also
// has TlsArgv for passing them on). See common/grpc/tls.h for what they do.
#pragma once

#include <set>
#include <string>

#include "absl/status/statusor.h"
#include "common/grpc/tls.h"
#include "tools/dxs/cli_args.h"

namespace dxs::cli {

// `flags` plus the TLS value flags / the TLS boolean flag, for Args::Parse.
std::set<std::string> WithTlsValueFlags(std::set<std::string> flags);
std::set<std::string> WithTlsBoolFlags(std::set<std::string> flags);

// Reads and validates the TLS flags (`for_server`: this process serves gRPC).
absl::StatusOr<TlsConfig> TlsFromArgs(const Args& args, bool for_server);

}  // namespace dxs::cli
