#include "tools/dxs/cli_args.h"

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"

namespace dxs::cli {

absl::StatusOr<Args> Args::Parse(const std::vector<std::string>& argv,
                                 const std::set<std::string>& value_flags,
                                 const std::set<std::string>& bool_flags) {
  Args args;
  for (size_t i = 0; i < argv.size(); ++i) {
    const std::string& a = argv[i];
    if (a.rfind("--", 0) != 0) {
      return absl::InvalidArgumentError(absl::StrCat("unexpected argument '", a, "'"));
    }
    std::string name = a.substr(2), value;
    bool has_value = false;
    if (size_t eq = name.find('='); eq != std::string::npos) {
      value = name.substr(eq + 1);
      name = name.substr(0, eq);
      has_value = true;
    }
    if (bool_flags.count(name)) {
      if (has_value) return absl::InvalidArgumentError(absl::StrCat("--", name, " takes no value"));
      args.values_[name] = "true";
    } else if (value_flags.count(name)) {
      if (!has_value) {
        if (i + 1 >= argv.size()) {
          return absl::InvalidArgumentError(absl::StrCat("--", name, " needs a value"));
        }
        value = argv[++i];
      }
      args.values_[name] = value;
    } else {
      return absl::InvalidArgumentError(absl::StrCat("unknown flag --", name));
    }
  }
  return args;
}

absl::Status Args::Require(const std::vector<std::string>& names) const {
  for (const std::string& n : names) {
    if (!Has(n)) return absl::InvalidArgumentError(absl::StrCat("--", n, " is required"));
  }
  return absl::OkStatus();
}

std::string Args::GetString(const std::string& name, const std::string& fallback) const {
  auto it = values_.find(name);
  return it == values_.end() ? fallback : it->second;
}

absl::StatusOr<int64_t> Args::GetInt(const std::string& name, int64_t fallback) const {
  auto it = values_.find(name);
  if (it == values_.end()) return fallback;
  int64_t v;
  if (!absl::SimpleAtoi(it->second, &v)) {
    return absl::InvalidArgumentError(
        absl::StrCat("--", name, ": '", it->second, "' is not an integer"));
  }
  return v;
}

absl::StatusOr<uint64_t> Args::GetUint(const std::string& name, uint64_t fallback) const {
  auto it = values_.find(name);
  if (it == values_.end()) return fallback;
  uint64_t v;
  if (!absl::SimpleAtoi(it->second, &v)) {
    return absl::InvalidArgumentError(
        absl::StrCat("--", name, ": '", it->second, "' is not a non-negative integer"));
  }
  return v;
}

absl::StatusOr<double> Args::GetDouble(const std::string& name, double fallback) const {
  auto it = values_.find(name);
  if (it == values_.end()) return fallback;
  double v;
  if (!absl::SimpleAtod(it->second, &v)) {
    return absl::InvalidArgumentError(
        absl::StrCat("--", name, ": '", it->second, "' is not a number"));
  }
  return v;
}

absl::StatusOr<bool> Args::GetOnOff(const std::string& name, bool fallback) const {
  auto it = values_.find(name);
  if (it == values_.end()) return fallback;
  if (it->second == "on") return true;
  if (it->second == "off") return false;
  return absl::InvalidArgumentError(
      absl::StrCat("--", name, ": '", it->second, "' is not on or off"));
}

absl::StatusOr<std::vector<int32_t>> Args::GetIntList(const std::string& name) const {
  std::vector<int32_t> out;
  auto it = values_.find(name);
  if (it == values_.end()) return out;
  for (absl::string_view part : absl::StrSplit(it->second, ',')) {
    int32_t v;
    if (!absl::SimpleAtoi(part, &v)) {
      return absl::InvalidArgumentError(
          absl::StrCat("--", name, ": '", std::string(part), "' is not an integer"));
    }
    out.push_back(v);
  }
  return out;
}

}  // namespace dxs::cli
