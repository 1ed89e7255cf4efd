// The `dxs` subcommands. Each returns the process exit code; errors are one line on stderr.
#pragma once

#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace dxs::cli {

int RunCommand(const std::vector<std::string>& args);          // dxs run
int GenModelCommand(const std::vector<std::string>& args);     // dxs gen-model
int FingerprintCommand(const std::vector<std::string>& args);  // dxs fingerprint
int UpCommand(const std::vector<std::string>& args);           // dxs up
int GenerateCommand(const std::vector<std::string>& args);     // dxs generate
int StatusCommand(const std::vector<std::string>& args);       // dxs status
int RebalanceCommand(const std::vector<std::string>& args);    // dxs rebalance
int DrainCommand(const std::vector<std::string>& args);        // dxs drain
int BenchCommand(const std::vector<std::string>& args);        // dxs bench
int TunablesCommand(const std::vector<std::string>& args);     // dxs tunables

// Where the embedded default model lives when --model is omitted: $DXS_CACHE_DIR, else
// $XDG_CACHE_HOME/dxs, else ~/.cache/dxs; it is written there on first use.
std::string DefaultModelDir();
// DefaultModelDir(), with the embedded default model written there if it is not yet, and
// the tokenizer files added to one written before dxs made them (the weights untouched).
absl::StatusOr<std::string> EnsureDefaultModel();

}  // namespace dxs::cli
