// The TLS flags every dxs binary takes: --tls-cert FILE --tls-key FILE --tls-ca FILE
// [--mtls]. See common/grpc/tls.h for what they do.
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

// The same flags again, for passing on to a child process.
std::vector<std::string> TlsArgv(const TlsConfig& tls);

}  // namespace dxs::cli
