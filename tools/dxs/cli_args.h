// A small command-line parser for the `dxs` subcommands: `--name value` or `--name=value`,
// boolean `--flag`. Unknown or malformed flags are errors with one clear line.
#pragma once

#include <cstdint>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace dxs::cli {

class Args {
 public:
  // `value_flags` take a value; `bool_flags` do not. argv excludes the subcommand.
  static absl::StatusOr<Args> Parse(const std::vector<std::string>& argv,
                                    const std::set<std::string>& value_flags,
                                    const std::set<std::string>& bool_flags);

  bool Has(const std::string& name) const { return values_.count(name) > 0; }
  // INVALID_ARGUMENT "--NAME is required" for the first of `names` that is missing.
  absl::Status Require(const std::vector<std::string>& names) const;
  std::string GetString(const std::string& name, const std::string& fallback = "") const;
  absl::StatusOr<int64_t> GetInt(const std::string& name, int64_t fallback) const;
  absl::StatusOr<double> GetDouble(const std::string& name, double fallback) const;
  // "on" or "off".
  absl::StatusOr<bool> GetOnOff(const std::string& name, bool fallback) const;
  absl::StatusOr<uint64_t> GetUint(const std::string& name, uint64_t fallback) const;
  // Comma-separated int32 list, e.g. "1,2,3".
  absl::StatusOr<std::vector<int32_t>> GetIntList(const std::string& name) const;

 private:
  std::map<std::string, std::string> values_;
};

}  // namespace dxs::cli
