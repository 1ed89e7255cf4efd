// Command-line parsing for the dxs services (dxs-router, dxs-attention, dxs-expert) on abseil
// flags: absl::ParseCommandLine with --help, --helpfull, --version and --flagfile=FILE (one
// --name=value per line: a config file), under the contract the services document:
//
//   - bad flags (unknown, malformed value, a value the service's validation refuses, a
//     stray positional argument): one line "PROGRAM: what is wrong" on stderr, exit 2;
//   - --help and friends: the usage on stdout, exit 0.
//
// Flag names: abseil names flags with underscores (--metrics_listen); dxs has always
// spelled them with dashes (--metrics-listen), as do the manifests, `dxs up` and scripts.
// Both are accepted on the command line: dashes in a flag's name are read as underscores.
// A --flagfile holds abseil's own spelling, underscores.
//
// Validation: each service checks every flag in one function that returns the checked
// configuration or an InvalidArgument status; ExitWithBadFlags turns that into the line
// and exit status above.
#pragma once

#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"

namespace dxs::flags {

// Parses argv into the abseil flags linked into this binary; returns argv[0] (positional
// arguments are refused). Exits as described above on a bad flag or a usage flag.
// `usage`: the synopsis --help prints above the flags.
void ParseServiceCommandLine(int argc, char** argv, std::string_view program,
                             std::string_view usage);

// "program: message" on stderr, exit status 2.
[[noreturn]] void ExitWithBadFlags(std::string_view program, const absl::Status& status);

// argv with "--a-b[=v]" (and "-a-b") read as "--a_b[=v]", up to a lone "--". Exposed for
// tests.
std::vector<std::string> NormalizeFlagNames(const std::vector<std::string>& argv);

}  // namespace dxs::flags
