#include "common/tunables.h"

#include <errno.h>  // program_invocation_short_name

#include <cstdlib>
#include <cstring>
#include <iostream>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"

namespace dxs::tunables {
namespace {

// "a, b or c".
std::string Alternatives(const std::vector<std::string>& values) {
  std::string out;
  for (size_t i = 0; i < values.size(); ++i) {
    if (i > 0) out += i + 1 == values.size() ? " or " : ", ";
    out += values[i];
  }
  return out;
}

const char* TypeName(Type type) { return type == Type::kEnum ? "enum" : "path"; }

}  // namespace

#define DXS_TUNABLE(id, name, type, values, default_value, doc) \
  const Tunable k##id{name, Type::type, values, default_value, doc};
#include "common/tunables.def"
#undef DXS_TUNABLE

const std::vector<const Tunable*>& All() {
  static const auto* all = new std::vector<const Tunable*>{
#define DXS_TUNABLE(id, ...) &k##id,
#include "common/tunables.def"
#undef DXS_TUNABLE
  };
  return *all;
}

std::vector<std::string> AcceptedValues(const Tunable& t) {
  if (t.type != Type::kEnum) return {};
  return absl::StrSplit(t.values, '|');
}

absl::StatusOr<std::string> Parse(const Tunable& t, const char* raw) {
  if (raw == nullptr || *raw == '\0') {
    return std::string(t.type == Type::kEnum ? t.default_value : "");
  }
  if (t.type == Type::kPath) return std::string(raw);
  const std::vector<std::string> accepted = AcceptedValues(t);
  for (const std::string& value : accepted) {
    if (value == raw) return value;
  }
  return absl::InvalidArgumentError(
      absl::StrCat(t.name, "=", raw, ": expected ", Alternatives(accepted)));
}

absl::StatusOr<std::string> Read(const Tunable& t) { return Parse(t, std::getenv(t.name)); }

std::string Get(const Tunable& t) {
  absl::StatusOr<std::string> value = Read(t);
  if (!value.ok()) {
    std::cerr << program_invocation_short_name << ": " << value.status().message() << std::endl;
    // Not exit(): a lazy read may run on any thread, with others still using statics.
    std::_Exit(2);
  }
  return *std::move(value);
}

bool On(const Tunable& t) { return Get(t) != "off"; }

absl::Status Validate() {
  std::vector<std::string> problems;
  for (const Tunable* t : All()) {
    if (absl::StatusOr<std::string> value = Read(*t); !value.ok()) {
      problems.emplace_back(value.status().message());
    }
  }
  if (problems.empty()) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrJoin(problems, "; "));
}

void ValidateOrDie(std::string_view program) {
  if (absl::Status s = Validate(); !s.ok()) {
    std::cerr << program << ": " << s.message() << std::endl;
    std::exit(2);
  }
}

std::string MarkdownTable() {
  std::string out =
      "| Variable | Type | Accepted | Default | What it does |\n"
      "|---|---|---|---|---|\n";
  for (const Tunable* t : All()) {
    std::vector<std::string> accepted = AcceptedValues(*t);
    for (std::string& v : accepted) v = absl::StrCat("`", v, "`");
    const bool is_enum = t->type == Type::kEnum;
    absl::StrAppend(&out, "| `", t->name, "` | ", TypeName(t->type), " | ",
                    is_enum ? absl::StrJoin(accepted, ", ") : "a path", " | ",
                    is_enum ? absl::StrCat("`", t->default_value, "`") : t->default_value, " | ",
                    t->doc, " |\n");
  }
  return out;
}

}  // namespace dxs::tunables
