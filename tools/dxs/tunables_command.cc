// dxs tunables: the DXS_* environment variables dxs reads (common/tunables.def), with what
// each is set to here; --markdown prints docs/tunables.md's table.
#include <cstdlib>
#include <iostream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "common/tunables.h"
#include "tools/dxs/commands.h"

namespace dxs::cli {

int TunablesCommand(const std::vector<std::string>& args) {
  if (args.size() == 1 && args[0] == "--markdown") {
    std::cout << tunables::MarkdownTable();
    return 0;
  }
  if (!args.empty()) {
    std::cerr << "dxs tunables: unexpected argument '" << args[0] << "'\n";
    return 2;
  }
  for (const tunables::Tunable* t : tunables::All()) {
    const bool is_enum = t->type == tunables::Type::kEnum;
    std::cout << t->name << "  " << (is_enum ? t->values : "path") << "  (default "
              << t->default_value << ")";
    // main() validated the environment, so Get cannot fail; empty is unset.
    if (const char* raw = std::getenv(t->name); raw != nullptr && *raw != '\0') {
      std::cout << "  set: " << tunables::Get(*t);
    }
    std::cout << "\n";
    // The documentation, indented, in lines of at most 92 columns besides.
    std::string line;
    for (absl::string_view word : absl::StrSplit(t->doc, ' ')) {
      if (!line.empty() && line.size() + 1 + word.size() > 92) {
        std::cout << "    " << line << "\n";
        line.clear();
      }
      absl::StrAppend(&line, line.empty() ? "" : " ", word);
    }
    std::cout << "    " << line << "\n";
  }
  return 0;
}

}  // namespace dxs::cli
