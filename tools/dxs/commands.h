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

// Where the embedded default model lives when --model is omitted: $DXS_CACHE_DIR, else
// $XDG_CACHE_HOME/dxs, else ~/.cache/dxs; it is written there on first use.
std::string DefaultModelDir();

// `dxs up`'s device per worker: attention ranks 0..M-1, then expert ranks 0..N-1. Without
// `gpus` every worker gets `device`; with it (a list like "0,1", and device cuda) the
// workers go round the list in that order, so several may share a GPU.
absl::StatusOr<std::vector<std::string>> WorkerDevices(const std::string& device,
                                                       const std::string& gpus, int num_attention,
                                                       int num_experts);

}  // namespace dxs::cli
