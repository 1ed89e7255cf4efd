// The start-up that dxs-attention and dxs-expert share around their own pieces: the
// dxs_build_info metric, signal handlers, TLS from the --tls-* flags, the model's config
// and checkpoint; later the gRPC server on --listen and /metrics on --metrics-listen.
#pragma once

#include <grpcpp/grpcpp.h>

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "common/metrics/registry.h"
#include "common/model_config.h"
#include "common/safetensors.h"
#include "router/membership/worker_runtime.h"
#include "tools/dxs/cli_args.h"

namespace dxs {

struct WorkerModel {
  ModelConfig config;
  std::unique_ptr<Checkpoint> checkpoint;
};

// Registers build info for `role` in `registry`, installs the signal handlers, gives
// `runtime` the TLS the flags name and opens the checkpoint in --model.
absl::StatusOr<WorkerModel> PrepareWorker(const cli::Args& args, const std::string& role,
                                          metrics::Registry* registry, WorkerRuntime* runtime);

// Starts `service` on --listen and `registry` on --metrics-listen (each default
// 127.0.0.1:0, any free port).
absl::Status StartServing(const cli::Args& args, grpc::Service* service,
                          const metrics::Registry* registry, WorkerRuntime* runtime);

}  // namespace dxs
