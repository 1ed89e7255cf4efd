// Helpers for the tests that read a cluster's Prometheus metrics: scraping a process's
// /metrics, reading samples out of the text format, `promtool check metrics`, and plain
// HTTP GETs to a Prometheus server.
#pragma once

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "tests/common/metrics/http_get.h"

namespace dxs::testing {

// The port of "HOST:PORT"; 0 if there is none.
inline int PortOf(const std::string& address) {
  const size_t colon = address.rfind(':');
  return colon == std::string::npos ? 0 : std::atoi(address.c_str() + colon + 1);
}

// GET /metrics from a loopback HOST:PORT; the body on 200.
inline absl::StatusOr<std::string> Scrape(const std::string& address) {
  metrics::testing::HttpResponse r =
      metrics::testing::HttpRequest(PortOf(address), "GET", "/metrics");
  if (!r.connected) return absl::UnavailableError(absl::StrCat("cannot connect to ", address));
  if (r.status != 200) {
    return absl::InternalError(absl::StrCat("GET ", address, "/metrics: HTTP ", r.status));
  }
  return r.body;
}

// `name{label="value",...}` with its labels sorted by name, so that a series reads the same
// whatever order the exporter wrote its labels in (the text format leaves it open).
inline std::string CanonicalSeries(const std::string& series) {
  const size_t open = series.find('{');
  if (open == std::string::npos || series.back() != '}') return series;
  std::vector<std::string> labels;
  std::string label;
  bool quoted = false;
  for (size_t i = open + 1; i + 1 < series.size(); ++i) {
    const char c = series[i];
    if (quoted && c == '\\' && i + 2 < series.size()) {
      label += c;
      label += series[++i];
      continue;
    }
    if (c == '"') quoted = !quoted;
    if (c == ',' && !quoted) {
      labels.push_back(label);
      label.clear();
    } else {
      label += c;
    }
  }
  if (!label.empty()) labels.push_back(label);
  std::sort(labels.begin(), labels.end());
  std::string out = series.substr(0, open + 1);
  for (size_t i = 0; i < labels.size(); ++i) out += (i > 0 ? "," : "") + labels[i];
  return out + "}";
}

// Every sample line of a text exposition, keyed by the series with its labels in name
// order (CanonicalSeries): `name{label="value",...}` or `name`.
inline std::map<std::string, double> ParseSamples(const std::string& text) {
  std::map<std::string, double> out;
  std::istringstream in(text);
  for (std::string line; std::getline(in, line);) {
    if (line.empty() || line[0] == '#') continue;
    const size_t space = line.rfind(' ');
    if (space == std::string::npos) continue;
    out[CanonicalSeries(line.substr(0, space))] = std::strtod(line.c_str() + space + 1, nullptr);
  }
  return out;
}

// The value of `series` (labels in any order) in `samples`, or -1 when absent (every dxs
// value is >= 0).
inline double Value(const std::map<std::string, double>& samples, const std::string& series) {
  auto it = samples.find(CanonicalSeries(series));
  return it == samples.end() ? -1 : it->second;
}

// Sum of every series whose name (the part before '{') is `name`.
inline double SumOf(const std::map<std::string, double>& samples, const std::string& name) {
  double sum = 0;
  for (const auto& [series, value] : samples) {
    if (series == name || series.rfind(name + "{", 0) == 0) sum += value;
  }
  return sum;
}

struct PromtoolResult {
  int exit_code = -1;
  std::string output;  // stdout and stderr together
};

constexpr char kPromtool[] = "/usr/bin/promtool";

// Pipes `text` into `promtool check metrics`.
inline PromtoolResult CheckMetrics(const std::string& text) {
  char path[] = "/tmp/dxs_promtool_XXXXXX";
  const int fd = mkstemp(path);
  if (fd < 0) return {};
  close(fd);
  PromtoolResult result;
  const std::string command = std::string(kPromtool) + " check metrics >" + path + " 2>&1";
  if (FILE* pipe = popen(command.c_str(), "w")) {
    std::fwrite(text.data(), 1, text.size(), pipe);
    const int status = pclose(pipe);
    result.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  }
  std::ifstream in(path);
  std::stringstream output;
  output << in.rdbuf();
  result.output = output.str();
  unlink(path);
  return result;
}

// A loopback port free just now (bound to port 0, then released).
inline int FreeLoopbackPort() {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof(addr);
  int port = 0;
  if (bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0 &&
      getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) == 0) {
    port = ntohs(addr.sin_port);
  }
  close(fd);
  return port;
}

// Percent-encodes a query-string value.
inline std::string UrlEncode(const std::string& s) {
  std::string out;
  for (unsigned char c : s) {
    if (std::isalnum(c) || c == '-' || c == '_' || c == '.' || c == '~') {
      out += static_cast<char>(c);
    } else {
      char buf[4];
      std::snprintf(buf, sizeof(buf), "%%%02X", c);
      out += buf;
    }
  }
  return out;
}

// Decodes a body sent with Transfer-Encoding: chunked (Go's servers, Prometheus among
// them, chunk larger responses).
inline std::string Dechunk(const std::string& body) {
  std::string out;
  size_t at = 0;
  while (at < body.size()) {
    const size_t line_end = body.find("\r\n", at);
    if (line_end == std::string::npos) break;
    const size_t size = std::strtoul(body.substr(at, line_end - at).c_str(), nullptr, 16);
    if (size == 0) break;
    out += body.substr(line_end + 2, size);
    at = line_end + 2 + size + 2;
  }
  return out;
}

// GET `path` from a loopback port: HTTP status and the (de-chunked) body.
inline std::pair<int, std::string> HttpGet(int port, const std::string& path) {
  metrics::testing::HttpResponse r = metrics::testing::HttpRequest(port, "GET", path);
  if (!r.connected) return {0, ""};
  auto te = r.headers.find("transfer-encoding");
  if (te != r.headers.end() && te->second.find("chunked") != std::string::npos) {
    return {r.status, Dechunk(r.body)};
  }
  return {r.status, r.body};
}

}  // namespace dxs::testing
