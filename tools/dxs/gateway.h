// `dxs up --gateway-port P`: the SMG gateway (Shepherd Model Gateway, PyPI `smg`, pinned and
// installed into the project's .venv by scripts/setup.sh) in front of the router. It speaks
// OpenAI's HTTP API to applications and the gateway protocol (sglang.grpc.scheduler) to the
// router, holds the tokenizer (read from the model directory the router reports) and the
// chat template, and balances by the loads the router reports (policy least_load).
#pragma once

#include <functional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace dxs::cli {

// The smg executable: `flag` if set; else smg in the project's .venv beside the build
// (<bin>/../../.venv/bin/smg, where scripts/setup.sh puts it) or in $DXS_PY_VENV; else smg on
// PATH. NOT_FOUND saying how to install it.
absl::StatusOr<std::string> FindSmg(const std::string& flag, const std::string& bin_dir);

// smg's command line: `launch` against the router's gRPC address, serving HTTP on
// host:port and Prometheus metrics on host:metrics_port.
std::vector<std::string> GatewayArgv(const std::string& smg, const std::string& router_address,
                                     const std::string& host, int port, int metrics_port);

// Waits until the gateway on 127.0.0.1:port lists `model` on GET /v1/models (it has
// registered the router and loaded its tokenizer), or `timeout` passes (DEADLINE_EXCEEDED),
// or `alive()` turns false (UNAVAILABLE).
absl::Status WaitForGateway(int port, const std::string& model, absl::Duration timeout,
                            const std::function<bool()>& alive);

}  // namespace dxs::cli
