// A minimal HTTP/1.1 client over a raw socket to a port on loopback: one request,
// "Connection: close", read to the end of the stream. For probes of local servers (`dxs up`
// waiting for the gateway, the metrics server tests); not for the network.
#pragma once

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <map>
#include <string>

namespace dxs {

struct HttpResponse {
  bool connected = false;
  int status = 0;
  std::map<std::string, std::string> headers;  // names lower-cased
  std::string body;
};

// `method path` to 127.0.0.1:port; connected false when nothing answers there.
inline HttpResponse HttpRequest(int port, const std::string& method, const std::string& path) {
  HttpResponse response;
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return response;
  timeval timeout{5, 0};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &timeout, sizeof(timeout));
  setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &timeout, sizeof(timeout));
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    close(fd);
    return response;
  }
  response.connected = true;
  const std::string request = method + " " + path +
                              " HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n"
                              "Content-Length: 0\r\n\r\n";
  if (send(fd, request.data(), request.size(), MSG_NOSIGNAL) !=
      static_cast<ssize_t>(request.size())) {
    close(fd);
    return response;
  }
  std::string raw;
  char buf[4096];
  for (ssize_t n; (n = recv(fd, buf, sizeof(buf), 0)) > 0;) raw.append(buf, n);
  close(fd);

  const size_t end_of_headers = raw.find("\r\n\r\n");
  if (end_of_headers == std::string::npos) return response;
  response.body = raw.substr(end_of_headers + 4);
  size_t line_start = 0;
  bool first = true;
  while (line_start < end_of_headers) {
    size_t line_end = raw.find("\r\n", line_start);
    const std::string line = raw.substr(line_start, line_end - line_start);
    line_start = line_end + 2;
    if (first) {  // HTTP/1.1 200 OK
      first = false;
      const size_t space = line.find(' ');
      if (space != std::string::npos) response.status = std::atoi(line.c_str() + space + 1);
      continue;
    }
    const size_t colon = line.find(':');
    if (colon == std::string::npos) continue;
    std::string name = line.substr(0, colon);
    std::transform(name.begin(), name.end(), name.begin(),
                   [](unsigned char c) { return std::tolower(c); });
    size_t value_start = line.find_first_not_of(' ', colon + 1);
    response.headers[name] = value_start == std::string::npos ? "" : line.substr(value_start);
  }
  return response;
}

}  // namespace dxs
