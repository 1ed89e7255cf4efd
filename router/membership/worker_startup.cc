#include "router/membership/worker_startup.h"

#include "common/metrics/build_info.h"
#include "tools/dxs/tls_flags.h"

namespace dxs {

absl::StatusOr<WorkerModel> PrepareWorker(const cli::Args& args, const std::string& role,
                                          metrics::Registry* registry, WorkerRuntime* runtime) {
  if (absl::Status s = metrics::RegisterBuildInfo(registry, role); !s.ok()) return s;
  InstallSignalHandlers();
  absl::StatusOr<TlsConfig> tls = cli::TlsFromArgs(args, /*for_server=*/true);
  if (!tls.ok()) return tls.status();
  runtime->set_tls(*tls);
  const std::string model_dir = args.GetString("model");
  WorkerModel model;
  absl::StatusOr<ModelConfig> config = LoadModelConfig(model_dir);
  if (!config.ok()) return config.status();
  model.config = *config;
  absl::StatusOr<std::unique_ptr<Checkpoint>> checkpoint = Checkpoint::Open(model_dir);
  if (!checkpoint.ok()) return checkpoint.status();
  model.checkpoint = std::move(*checkpoint);
  return model;
}

absl::Status StartServing(const cli::Args& args, grpc::Service* service,
                          const metrics::Registry* registry, WorkerRuntime* runtime) {
  if (absl::Status s = runtime->Start(args.GetString("listen", "127.0.0.1:0"), service); !s.ok()) {
    return s;
  }
  return runtime->StartMetrics(args.GetString("metrics-listen", "127.0.0.1:0"), registry);
}

}  // namespace dxs
