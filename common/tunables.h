// Tunables: the DXS_* environment variables dxs's programs read, declared once each in
// common/tunables.def with their type, accepted values, default and documentation, and read
// only through this header, so that every one is parsed the same way:
//
//   - unset and empty are the same: the default;
//   - a kEnum variable is exactly one of its accepted values; anything else is an error
//     "DXS_NAME=value: expected a, b or c", never taken as the default;
//   - a kPath variable is any non-empty string; unset leaves the fallback to its reader.
//
// Every program calls ValidateOrDie() first thing in main, so a bad value stops it at
// start-up with that message (exit 2). Reads after that cannot fail; Read() still returns
// the error for code that runs without a main of ours (tests, the CUDA plugin's own checks),
// and Get() ends the process with the message where no status can be returned.
//
// Reads are not cached: each call reads the environment, as getenv does (tests and
// gpu_bench set variables between backends). Readers that want "read once" keep a static.
//
// Thread safety: every function may be called from any thread; like getenv, not
// concurrently with a setenv of the same process.
#pragma once

#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace dxs::tunables {

enum class Type { kEnum, kPath };

struct Tunable {
  const char* name;  // "DXS_CUDA_PDL"
  Type type;
  const char* values;         // kEnum: the accepted values, "auto|off"; kPath: ""
  const char* default_value;  // kEnum: one of values; kPath: a description of the fallback
  const char* doc;
};

// kCudaPdl, kCacheDir, ...: one constant a row of tunables.def.
#define DXS_TUNABLE(id, ...) extern const Tunable k##id;
#include "common/tunables.def"
#undef DXS_TUNABLE

// Every tunable, in the order of tunables.def (and of docs/tunables.md).
const std::vector<const Tunable*>& All();

// The accepted values of a kEnum tunable, in order ({} for a kPath one).
std::vector<std::string> AcceptedValues(const Tunable& t);

// `raw` (the environment's text, null when unset) as `t` reads it: the default for
// null or empty; for kEnum, INVALID_ARGUMENT "NAME=raw: expected a, b or c" unless raw is
// one of those; for kPath, raw ("" when unset). Exposed for tests.
absl::StatusOr<std::string> Parse(const Tunable& t, const char* raw);

// Parse(t, getenv(t.name)).
absl::StatusOr<std::string> Read(const Tunable& t);

// Read(t)'s value; on an error, "dxs: <message>" on stderr and exit status 2. For readers
// that cannot return a status (kernel launch helpers); ValidateOrDie has made the error
// unreachable in our programs.
std::string Get(const Tunable& t);

// Whether a kEnum tunable of the auto|off kind is on (not "off"); Get's error handling.
bool On(const Tunable& t);

// Every tunable read from the environment: OK, or INVALID_ARGUMENT with the message of each
// bad one, "; " between them.
absl::Status Validate();

// Validate(), or "<program>: <message>" on stderr and exit status 2 (the services' contract
// for a bad configuration: common/flags/parse.h).
void ValidateOrDie(std::string_view program);

// The table as docs/tunables.md holds it: a Markdown table with one row a tunable (name,
// type, accepted values, default, documentation).
std::string MarkdownTable();

}  // namespace dxs::tunables
