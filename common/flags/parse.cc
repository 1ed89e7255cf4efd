#include "common/flags/parse.h"

#include <unistd.h>

#include <cstdlib>
#include <iostream>
#include <sstream>
#include <string>

#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/flags/usage_config.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"

#ifndef DXS_VERSION_STRING
#define DXS_VERSION_STRING "unknown"
#endif

namespace dxs::flags {
namespace {

// absl 20220623's ParseCommandLine reports a bad flag as "ERROR: ..." on std::cerr and then
// calls std::exit(1); after a usage flag it prints the usage and calls std::exit(1) as well.
// Neither is the services' contract (one "program: ..." line and 2; usage and 0), and absl
// has no hook to change it. So while it parses, std::cerr goes to a buffer, and an atexit
// handler tells the two cases apart (an error wrote to the buffer, a usage flag did not)
// and leaves with the right line and status.
struct ParseState {
  bool parsing = false;
  std::string program;
  std::ostringstream captured_cerr;
  std::streambuf* real_cerr = nullptr;
};

ParseState& State() {
  static ParseState* state = new ParseState();
  return *state;
}

void OnExitDuringParse() {
  ParseState& state = State();
  if (!state.parsing) return;
  std::cerr.rdbuf(state.real_cerr);
  std::cout.flush();
  std::string text = state.captured_cerr.str();
  if (text.empty()) std::_Exit(0);  // a usage flag: the usage is on stdout
  // The first error is enough to act on; absl lists one per bad flag.
  text = text.substr(0, text.find('\n'));
  if (absl::StartsWith(text, "ERROR: ")) text = text.substr(7);
  const std::string line = absl::StrCat(state.program, ": ", text, "\n");
  (void)!write(STDERR_FILENO, line.data(), line.size());
  std::_Exit(2);
}

// Flags defined in dxs's own files; abseil's --help shows only those (--helpfull: all).
bool IsDxsFlagFile(absl::string_view file) { return !absl::StrContains(file, "absl/"); }

}  // namespace

std::vector<std::string> NormalizeFlagNames(const std::vector<std::string>& argv) {
  std::vector<std::string> out = argv;
  for (size_t i = 1; i < out.size(); ++i) {
    std::string& a = out[i];
    if (a == "--") break;
    if (a.size() < 2 || a[0] != '-') continue;
    const size_t name_start = a[1] == '-' ? 2 : 1;
    const size_t name_end = std::min(a.find('='), a.size());
    for (size_t c = name_start; c < name_end; ++c) {
      if (a[c] == '-') a[c] = '_';
    }
  }
  return out;
}

void ParseServiceCommandLine(int argc, char** argv, std::string_view program,
                             std::string_view usage) {
  absl::FlagsUsageConfig config;
  config.contains_helpshort_flags = IsDxsFlagFile;
  config.contains_help_flags = IsDxsFlagFile;
  config.version_string = [] { return std::string(DXS_VERSION_STRING) + "\n"; };
  absl::SetFlagsUsageConfig(config);
  absl::SetProgramUsageMessage(std::string(usage));

  // Storage for the normalized arguments; absl keeps pointers into it.
  static std::vector<std::string>* args =
      new std::vector<std::string>(NormalizeFlagNames(std::vector<std::string>(argv, argv + argc)));
  static std::vector<char*>* pointers = new std::vector<char*>();
  for (std::string& a : *args) pointers->push_back(a.data());

  ParseState& state = State();
  state.program = std::string(program);
  state.real_cerr = std::cerr.rdbuf(state.captured_cerr.rdbuf());
  state.parsing = true;
  std::atexit(OnExitDuringParse);
  const std::vector<char*> rest =
      absl::ParseCommandLine(static_cast<int>(pointers->size()), pointers->data());
  state.parsing = false;
  std::cerr.rdbuf(state.real_cerr);
  // Parsing succeeded; anything absl wrote (warnings) still belongs on stderr.
  std::cerr << state.captured_cerr.str();
  if (rest.size() > 1) {
    ExitWithBadFlags(
        program, absl::InvalidArgumentError(absl::StrCat("unexpected argument '", rest[1], "'")));
  }
}

void ExitWithBadFlags(std::string_view program, const absl::Status& status) {
  std::cerr << program << ": " << status.message() << std::endl;
  std::exit(2);
}

}  // namespace dxs::flags
