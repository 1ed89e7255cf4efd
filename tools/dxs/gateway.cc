#include "tools/dxs/gateway.h"

#include <netdb.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <functional>
#include <thread>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
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
  if (const char* venv = std::getenv("DXS_PY_VENV"); venv != nullptr && *venv != '\0') {
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

absl::StatusOr<HttpResponse> HttpGet(const std::string& host, int port, const std::string& path) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* found = nullptr;
  if (getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &found) != 0) {
    return absl::InvalidArgumentError(absl::StrCat("cannot resolve ", host));
  }
  int fd = -1;
  for (addrinfo* a = found; a != nullptr && fd < 0; a = a->ai_next) {
    fd = socket(a->ai_family, a->ai_socktype, a->ai_protocol);
    if (fd >= 0 && connect(fd, a->ai_addr, a->ai_addrlen) != 0) {
      close(fd);
      fd = -1;
    }
  }
  freeaddrinfo(found);
  if (fd < 0) return absl::UnavailableError(absl::StrCat("cannot connect to ", host, ":", port));
  timeval timeout{5, 0};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &timeout, sizeof(timeout));
  const std::string request =
      absl::StrCat("GET ", path, " HTTP/1.0\r\nHost: ", host, "\r\nConnection: close\r\n\r\n");
  if (send(fd, request.data(), request.size(), MSG_NOSIGNAL) !=
      static_cast<ssize_t>(request.size())) {
    close(fd);
    return absl::UnavailableError("send failed");
  }
  std::string reply;
  char buffer[4096];
  ssize_t n;
  while ((n = recv(fd, buffer, sizeof(buffer), 0)) > 0)
    reply.append(buffer, static_cast<size_t>(n));
  close(fd);
  // "HTTP/1.x NNN ..." then headers, a blank line, the body.
  HttpResponse response;
  const std::vector<absl::string_view> status_line =
      absl::StrSplit(reply.substr(0, reply.find("\r\n")), ' ');
  if (status_line.size() < 2 || !absl::SimpleAtoi(status_line[1], &response.status)) {
    return absl::UnavailableError("no HTTP status line in the reply");
  }
  const size_t body = reply.find("\r\n\r\n");
  if (body != std::string::npos) response.body = reply.substr(body + 4);
  return response;
}

absl::Status WaitForGateway(const std::string& host, int port, const std::string& model,
                            absl::Duration timeout, const std::function<bool()>& alive) {
  const absl::Time deadline = absl::Now() + timeout;
  std::string last = "no answer yet";
  while (absl::Now() < deadline) {
    if (!alive()) return absl::UnavailableError("the gateway exited");
    absl::StatusOr<HttpResponse> r = HttpGet(host, port, "/v1/models");
    if (r.ok() && r->status == 200) {
      const nlohmann::json models = nlohmann::json::parse(r->body, nullptr, false);
      if (models.is_object() && models.contains("data") && models["data"].is_array()) {
        for (const nlohmann::json& m : models["data"]) {
          if (m.is_object() && m.value("id", "") == model) return absl::OkStatus();
        }
      }
      last = absl::StrCat("GET /v1/models does not list '", model, "' yet");
    } else {
      last = r.ok() ? absl::StrCat("GET /v1/models: HTTP ", r->status) : r.status().ToString();
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
  }
  return absl::DeadlineExceededError(absl::StrCat("the gateway did not come up within ",
                                                  absl::FormatDuration(timeout), ": ", last));
}

}  // namespace dxs::cli
