#include "worker/worker_startup.h"

#include <tuple>

#include "absl/flags/flag.h"
#include "absl/strings/str_cat.h"
#include "common/flags/tls_flags.h"
#include "common/metrics/build_info.h"
#include "kernels/make_backend.h"
#include "model/random_checkpoint.h"
#include "worker/worker_transport.h"

ABSL_FLAG(std::string, model, "", "Checkpoint directory (Hugging Face layout); required.");
ABSL_FLAG(int, rank, -1, "This worker's rank in its role, from 0; required.");
ABSL_FLAG(std::string, router, "", "The router's control plane, HOST:PORT; required.");
ABSL_FLAG(std::string, listen, "127.0.0.1:0",
          "gRPC HOST:PORT (port 0: any free port); registered with the router, so other "
          "pods must reach HOST.");
ABSL_FLAG(std::string, metrics_listen, "127.0.0.1:0",
          "Prometheus /metrics on HOST:PORT (port 0: any free port).");
ABSL_FLAG(std::string, device, "cpu",
          "Where this worker computes: cpu, cuda (GPU 0) or cuda:N. A GPU asked for and not "
          "there is a start-up error.");

ABSL_FLAG(std::string, transport, "ucx",
          "The data path's transport, as the router's --transport: ucx, or nccl (GPU memory "
          "over one NCCL communicator of the cluster; needs --device cuda[:N] and "
          "libdxs_nccl.so beside the binary).");

namespace dxs {

absl::StatusOr<WorkerFlags> ValidateWorkerFlags() {
  WorkerFlags flags;
  flags.model_dir = absl::GetFlag(FLAGS_model);
  if (flags.model_dir.empty()) return absl::InvalidArgumentError("--model is required");
  flags.rank = absl::GetFlag(FLAGS_rank);
  if (flags.rank == -1) return absl::InvalidArgumentError("--rank is required");
  if (flags.rank < 0 || flags.rank > 65535) {
    return absl::InvalidArgumentError(absl::StrCat("--rank must be in 0..65535, got ", flags.rank));
  }
  flags.router = absl::GetFlag(FLAGS_router);
  if (flags.router.empty()) return absl::InvalidArgumentError("--router is required");
  for (const auto& [name, value, out] :
       {std::tuple<const char*, std::string, std::string*>{"listen", absl::GetFlag(FLAGS_listen),
                                                           &flags.listen},
        std::tuple<const char*, std::string, std::string*>{
            "metrics-listen", absl::GetFlag(FLAGS_metrics_listen), &flags.metrics_listen}}) {
    if (value.rfind(':') == std::string::npos) {
      return absl::InvalidArgumentError(
          absl::StrCat("--", name, ": '", value, "' is not HOST:PORT"));
    }
    *out = value;
  }
  flags.device = absl::GetFlag(FLAGS_device);
  if (absl::Status s = ValidateDeviceName(flags.device); !s.ok()) return s;
  flags.transport = absl::GetFlag(FLAGS_transport);
  if (absl::Status s = ValidateWorkerTransport(flags.transport, flags.device); !s.ok()) return s;
  absl::StatusOr<TlsConfig> tls = flags::TlsFromFlags(/*for_server=*/true);
  if (!tls.ok()) return tls.status();
  flags.tls = *tls;
  return flags;
}

absl::StatusOr<WorkerModel> PrepareWorker(const WorkerFlags& flags, const std::string& role,
                                          prometheus::Registry* registry, WorkerRuntime* runtime) {
  if (absl::Status s = metrics::RegisterBuildInfo(registry, role); !s.ok()) return s;
  InstallSignalHandlers();
  runtime->set_tls(flags.tls);
  WorkerModel model;
  absl::StatusOr<ModelConfig> config = LoadModelConfig(flags.model_dir);
  if (!config.ok()) return config.status();
  model.config = *config;
  absl::StatusOr<std::unique_ptr<WeightSource>> weights = OpenWeightSource(flags.model_dir);
  if (!weights.ok()) return weights.status();
  model.weights = std::move(*weights);
  absl::StatusOr<std::unique_ptr<Backend>> backend = MakeBackend(flags.device);
  if (!backend.ok()) return backend.status();
  model.backend = std::move(*backend);
  return model;
}

absl::Status StartServing(const WorkerFlags& flags, grpc::Service* service,
                          const std::vector<std::shared_ptr<prometheus::Collectable>>& collectables,
                          WorkerRuntime* runtime) {
  if (absl::Status s = runtime->Start(flags.listen, service, flags.transport, flags.device);
      !s.ok()) {
    return s;
  }
  return runtime->StartMetrics(flags.metrics_listen, collectables);
}

}  // namespace dxs
