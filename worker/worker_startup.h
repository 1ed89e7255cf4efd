// The start-up that dxs-attention and dxs-expert share around their own pieces: the flags
// both take (--model, --rank, --router, --listen, --metrics-listen, --device, --transport
// and the TLS flags, as abseil flags: common/flags/parse.h), the dxs_build_info metric,
// signal handlers, TLS, the model's config and checkpoint; later the gRPC server on
// --listen and /metrics on --metrics-listen.
#pragma once

#include <grpcpp/grpcpp.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "common/grpc/tls.h"
#include "common/model_config.h"
#include "common/safetensors.h"
#include "kernels/backend.h"
#include "model/weights.h"
#include "prometheus/collectable.h"
#include "prometheus/registry.h"
#include "worker/worker_runtime.h"

namespace dxs {

// The shared worker flags, checked.
struct WorkerFlags {
  std::string model_dir;
  int rank = 0;
  std::string router;
  std::string listen;          // default 127.0.0.1:0
  std::string metrics_listen;  // default 127.0.0.1:0
  std::string device;          // cpu, cuda or cuda:N (kernels/make_backend.h)
  std::string transport;       // ucx or nccl (worker_transport.h)
  TlsConfig tls;
};

// Checks the shared worker flags (each binary's own ValidateFlags calls this first);
// InvalidArgument naming the flag.
absl::StatusOr<WorkerFlags> ValidateWorkerFlags();

struct WorkerModel {
  ModelConfig config;
  // The checkpoint's tensors, or an in-place recipe's made on `backend`
  // (model/random_checkpoint.h: OpenWeightSource).
  std::unique_ptr<WeightSource> weights;
  std::unique_ptr<Backend> backend;  // on --device
};

// Registers build info for `role` in `registry`, installs the signal handlers, gives
// `runtime` the TLS of the flags, opens the checkpoint in --model and makes the backend
// of --device (FAILED_PRECONDITION when that device is not there).
absl::StatusOr<WorkerModel> PrepareWorker(const WorkerFlags& flags, const std::string& role,
                                          prometheus::Registry* registry, WorkerRuntime* runtime);

// Starts `service` on --listen and `collectables` on --metrics-listen (each default
// 127.0.0.1:0, any free port).
absl::Status StartServing(const WorkerFlags& flags, grpc::Service* service,
                          const std::vector<std::shared_ptr<prometheus::Collectable>>& collectables,
                          WorkerRuntime* runtime);

}  // namespace dxs
