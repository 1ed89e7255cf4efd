#include "tools/dxs/gateway.h"

#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <functional>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "common/http_client.h"
#include "common/tunables.h"
#include "nlohmann/json.hpp"

namespace dxs::cli {
namespace {

bool IsExecutable(const std::filesystem::path& path) {
  return !path.empty() && access(path.c_str(), X_OK) == 0 && std::filesystem::is_regular_file(path);
}

}  // namespace

absl::StatusOr<std::string> FindSmg(const std::string& flag, const std::string& bin_dir) {
  if (!flag.empty()) {
    if (IsExecutable(flag)) return flag;
    return absl::NotFoundError(absl::StrCat("--smg: '", flag, "' is not an executable"));
  }
  std::vector<std::filesystem::path> candidates;
  if (const std::string venv = tunables::Get(tunables::kPyVenv); !venv.empty()) {
    candidates.push_back(std::filesystem::path(venv) / "bin" / "smg");
  }
  candidates.push_back(std::filesystem::path(bin_dir) / ".." / ".." / ".venv" / "bin" / "smg");
  if (const char* path = std::getenv("PATH"); path != nullptr) {
    for (absl::string_view dir : absl::StrSplit(path, ':')) {
      if (!dir.empty()) candidates.push_back(std::filesystem::path(std::string(dir)) / "smg");
    }
  }
  for (const std::filesystem::path& c : candidates) {
    if (IsExecutable(c)) return std::filesystem::weakly_canonical(c).string();
  }
  return absl::NotFoundError(
      "the SMG gateway (smg) is not installed: scripts/setup.sh installs it into the "
      "project's .venv, or pass --smg PATH");
}

std::vector<std::string> GatewayArgv(const std::string& smg, const std::string& router_address,
                                     const std::string& host, int port, int metrics_port) {
  return {smg, "launch", "--worker-urls", absl::StrCat("grpc://", router_address), "--host", host,
          "--port", std::to_string(port), "--prometheus-host", host, "--prometheus-port",
          std::to_string(metrics_port),
          // Load-aware: the router's GetLoads (per DP rank running, waiting, KV usage). The
          // cache-aware default would need KV events, which dxs (no prefix cache) has none of.
          "--policy", "least_load",
          // A line per request at info: its cost grows with the request rate.
          "--log-level", "warn"};
}

absl::Status WaitForGateway(int port, const std::string& model, absl::Duration timeout,
                            const std::function<bool()>& alive) {
  const absl::Time deadline = absl::Now() + timeout;
  std::string last = "no answer yet";
  while (absl::Now() < deadline) {
    if (!alive()) return absl::UnavailableError("the gateway exited");
    const HttpResponse r = HttpRequest(port, "GET", "/v1/models");
    if (r.status == 200) {
      const nlohmann::json models = nlohmann::json::parse(r.body, nullptr, false);
      if (models.is_object() && models.contains("data") && models["data"].is_array()) {
        for (const nlohmann::json& m : models["data"]) {
          if (m.is_object() && m.value("id", "") == model) return absl::OkStatus();
        }
      }
      last = absl::StrCat("GET /v1/models does not list '", model, "' yet");
    } else {
      last = r.connected ? absl::StrCat("GET /v1/models: HTTP ", r.status)
                         : std::string("nothing answers on the port yet");
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
  }
  return absl::DeadlineExceededError(absl::StrCat("the gateway did not come up within ",
                                                  absl::FormatDuration(timeout), ": ", last));
}

}  // namespace dxs::cli
