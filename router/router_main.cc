// dxs-router: the router process. Serves, on one gRPC port with health and reflection,
// the front door (dxs.v1.Frontend: Generate, Abort, GetModelInfo, GetLoads; see
// router/frontend/frontend_service.h) and the control plane (membership, expert
// placement, transport set-up).
//
//   dxs-router --model DIR --attention M --experts N [--listen HOST:PORT]
//              [--metrics-listen HOST:PORT] [--transport ucx|nccl|inproc]
//              [--wire-dtype f32|bf16] [--lease-ms 3000] [--heartbeat-ms 500]
//              [--max-inflight 1024]
//
// --max-inflight bounds the Generate requests in flight cluster-wide; beyond it Generate
// is refused with RESOURCE_EXHAUSTED.
//
// Health (grpc.health.v1): "" and "dxs.v1.Frontend" are NOT_SERVING until every attention
// and expert rank is live and every expert has a rank (ClusterRegistry::IsComplete), and
// again whenever that stops being true; "dxs.v1.ControlPlane" is SERVING throughout, since
// workers must reach it to complete the cluster (probe that one for liveness, or publish
// not-ready addresses to the workers' Service).
//
// Prometheus metrics (docs/metrics.md: request outcomes and latencies, and the cluster-wide
// view of empty ranks gathered from heartbeats) are served on --metrics-listen (default
// 127.0.0.1:0, any free port).
//
// Prints exactly one line on stdout once serving, "dxs-router listening on HOST:PORT,
// metrics on HOST:PORT" with the bound ports (so --listen HOST:0 works for tests and
// scripts), then logs membership events on stderr. SIGTERM or SIGINT shuts it down
// cleanly with exit status 0. Bad flags: one line on stderr, exit status 2; start-up
// failures: one line, exit status 1.
#include <pthread.h>
#include <signal.h>

#include <chrono>
#include <cstdio>
#include <iostream>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "common/grpc/server.h"
#include "common/metrics/build_info.h"
#include "common/metrics/metrics_server.h"
#include "common/metrics/registry.h"
#include "common/model_config.h"
#include "grpcpp/health_check_service_interface.h"
#include "router/control_plane/cluster_metrics.h"
#include "router/control_plane/cluster_registry.h"
#include "router/control_plane/control_plane_service.h"
#include "router/control_plane/model_identity.h"
#include "router/frontend/cluster_watcher.h"
#include "router/frontend/frontend_metrics.h"
#include "router/frontend/frontend_service.h"
#include "router/frontend/model_info.h"
#include "tools/dxs/cli_args.h"
#include "tools/dxs/tls_flags.h"

namespace {

constexpr char kUsage[] =
    "usage: dxs-router --model DIR --attention M --experts N [--listen HOST:PORT]\n"
    "                  [--metrics-listen HOST:PORT] [--transport ucx|nccl|inproc]\n"
    "                  [--wire-dtype f32|bf16]\n"
    "                  [--lease-ms MS] [--heartbeat-ms MS] [--max-inflight N]\n";

int BadFlags(const std::string& message) {
  std::cerr << "dxs-router: " << message << "\n";
  return 2;
}

int Fail(const absl::Status& status) {
  std::cerr << "dxs-router: " << status.ToString() << "\n";
  return 1;
}

// Flags, checked and converted; nullopt after printing the problem.
struct Flags {
  dxs::TlsConfig tls;
  std::string listen;
  std::string metrics_listen;
  std::string model_dir;
  int num_attention_ranks = 0;
  int num_expert_ranks = 0;
  std::string transport;
  dxs::v1::DType wire_dtype = dxs::v1::DTYPE_FLOAT32;
  int64_t lease_ms = 0;
  int64_t heartbeat_ms = 0;
  int64_t max_inflight = 0;
};

absl::StatusOr<Flags> ParseFlags(const std::vector<std::string>& argv) {
  absl::StatusOr<dxs::cli::Args> args = dxs::cli::Args::Parse(
      argv,
      dxs::cli::WithTlsValueFlags({"listen", "metrics-listen", "attention", "experts", "model",
                                   "transport", "wire-dtype", "lease-ms", "heartbeat-ms",
                                   "max-inflight"}),
      dxs::cli::WithTlsBoolFlags({"help"}));
  if (!args.ok()) return args.status();
  if (args->Has("help")) return absl::CancelledError("help");
  Flags flags;
  flags.listen = args->GetString("listen", "127.0.0.1:50051");
  if (flags.listen.rfind(':') == std::string::npos) {
    return absl::InvalidArgumentError(
        absl::StrCat("--listen: '", flags.listen, "' is not HOST:PORT"));
  }
  flags.metrics_listen = args->GetString("metrics-listen", "127.0.0.1:0");
  if (flags.metrics_listen.rfind(':') == std::string::npos) {
    return absl::InvalidArgumentError(
        absl::StrCat("--metrics-listen: '", flags.metrics_listen, "' is not HOST:PORT"));
  }
  flags.model_dir = args->GetString("model");
  if (flags.model_dir.empty()) return absl::InvalidArgumentError("--model DIR is required");
  for (const auto& [name, out] :
       {std::pair<const char*, int*>{"attention", &flags.num_attention_ranks},
        std::pair<const char*, int*>{"experts", &flags.num_expert_ranks}}) {
    if (!args->Has(name)) {
      return absl::InvalidArgumentError(absl::StrCat("--", name, " is required"));
    }
    absl::StatusOr<int64_t> v = args->GetInt(name, 0);
    if (!v.ok()) return v.status();
    if (*v < 1 || *v > 65536) {
      return absl::InvalidArgumentError(absl::StrCat("--", name, " must be in 1..65536"));
    }
    *out = static_cast<int>(*v);
  }
  flags.transport = args->GetString("transport", "ucx");
  if (flags.transport != "ucx" && flags.transport != "nccl" && flags.transport != "inproc") {
    return absl::InvalidArgumentError(
        absl::StrCat("--transport must be ucx, nccl or inproc, got '", flags.transport, "'"));
  }
  const std::string dtype = args->GetString("wire-dtype", "f32");
  if (dtype == "f32") {
    flags.wire_dtype = dxs::v1::DTYPE_FLOAT32;
  } else if (dtype == "bf16") {
    flags.wire_dtype = dxs::v1::DTYPE_BFLOAT16;
  } else {
    return absl::InvalidArgumentError(
        absl::StrCat("--wire-dtype must be f32 or bf16, got '", dtype, "'"));
  }
  for (const auto& [name, fallback, out] :
       {std::tuple<const char*, int64_t, int64_t*>{"lease-ms", 3000, &flags.lease_ms},
        std::tuple<const char*, int64_t, int64_t*>{"heartbeat-ms", 500, &flags.heartbeat_ms}}) {
    absl::StatusOr<int64_t> v = args->GetInt(name, fallback);
    if (!v.ok()) return v.status();
    if (*v < 1 || *v > 3600 * 1000) {
      return absl::InvalidArgumentError(absl::StrCat("--", name, " must be in 1..3600000"));
    }
    *out = *v;
  }
  absl::StatusOr<int64_t> max_inflight = args->GetInt("max-inflight", 1024);
  if (!max_inflight.ok()) return max_inflight.status();
  if (*max_inflight < 1 || *max_inflight > 1000000) {
    return absl::InvalidArgumentError("--max-inflight must be in 1..1000000");
  }
  flags.max_inflight = *max_inflight;
  absl::StatusOr<dxs::TlsConfig> tls = dxs::cli::TlsFromArgs(*args, /*for_server=*/true);
  if (!tls.ok()) return tls.status();
  flags.tls = *tls;
  return flags;
}

}  // namespace

int main(int argc, char** argv) {
  absl::StatusOr<Flags> flags = ParseFlags(std::vector<std::string>(argv + 1, argv + argc));
  if (!flags.ok()) {
    if (absl::IsCancelled(flags.status())) {
      std::cout << kUsage;
      return 0;
    }
    return BadFlags(std::string(flags.status().message()));
  }

  absl::StatusOr<dxs::ModelConfig> config = dxs::LoadModelConfig(flags->model_dir);
  if (!config.ok()) return Fail(config.status());
  absl::StatusOr<dxs::v1::ModelFingerprint> fingerprint = dxs::ModelIdentity(flags->model_dir);
  if (!fingerprint.ok()) return Fail(fingerprint.status());

  dxs::ClusterRegistryOptions options;
  options.num_attention_ranks = flags->num_attention_ranks;
  options.num_expert_ranks = flags->num_expert_ranks;
  options.num_experts = static_cast<int>(config->num_experts);
  options.num_layers = static_cast<int>(config->num_hidden_layers);
  options.fingerprint = *fingerprint;
  options.transport_backend = flags->transport;
  options.wire_dtype = flags->wire_dtype;
  options.heartbeat_interval = absl::Milliseconds(flags->heartbeat_ms);
  options.lease_timeout = absl::Milliseconds(flags->lease_ms);
  if (absl::Status s = options.Validate(); !s.ok()) {
    return Fail(absl::InvalidArgumentError(absl::StrCat(flags->model_dir, ": ", s.message())));
  }

  // Signals are taken by sigwait below; block them before any thread starts so that none
  // of gRPC's threads receives them.
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGTERM);
  sigaddset(&signals, SIGINT);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);

  // Outlives everything that records into it (declared first, destroyed last).
  dxs::metrics::Registry metrics_registry;
  if (absl::Status s = dxs::metrics::RegisterBuildInfo(&metrics_registry, "router"); !s.ok()) {
    return Fail(s);
  }
  absl::StatusOr<std::unique_ptr<dxs::FrontendMetrics>> frontend_metrics =
      dxs::FrontendMetrics::Create(&metrics_registry);
  if (!frontend_metrics.ok()) return Fail(frontend_metrics.status());

  dxs::ClusterRegistry registry(options);
  dxs::ClusterMetricsOptions cluster_metrics_options;
  cluster_metrics_options.interval = options.heartbeat_interval;
  absl::StatusOr<std::unique_ptr<dxs::ClusterMetrics>> cluster_metrics =
      dxs::ClusterMetrics::Create(&metrics_registry, &registry, cluster_metrics_options);
  if (!cluster_metrics.ok()) return Fail(cluster_metrics.status());
  // GET /metrics; stopped (and waited for) before the families it reads go away.
  dxs::metrics::MetricsServerOptions metrics_options;
  metrics_options.address = flags->metrics_listen;
  absl::StatusOr<std::unique_ptr<dxs::metrics::MetricsServer>> metrics_server =
      dxs::metrics::MetricsServer::Start(&metrics_registry, metrics_options);
  if (!metrics_server.ok()) {
    return Fail(
        absl::Status(metrics_server.status().code(),
                     absl::StrCat("--metrics-listen: ", metrics_server.status().message())));
  }

  dxs::ControlPlaneService service(&registry);
  service.set_tls(flags->tls);
  absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> server_credentials =
      dxs::MakeServerCredentials(flags->tls);
  if (!server_credentials.ok()) return Fail(server_credentials.status());
  absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> worker_credentials =
      dxs::MakeChannelCredentials(flags->tls);
  if (!worker_credentials.ok()) return Fail(worker_credentials.status());
  dxs::FrontendOptions frontend_options;
  frontend_options.max_inflight = flags->max_inflight;
  frontend_options.worker_credentials = *worker_credentials;
  frontend_options.metrics = frontend_metrics->get();
  dxs::FrontendService frontend(&registry, *config,
                                dxs::MakeModelInfo(*config, flags->model_dir, *fingerprint),
                                frontend_options);
  dxs::GrpcServerOptions server_options;
  server_options.address = flags->listen;
  server_options.credentials = *server_credentials;
  absl::StatusOr<dxs::GrpcServer> server =
      dxs::StartGrpcServer(server_options, {&service, &frontend});
  if (!server.ok()) return Fail(server.status());

  // Health follows the registry from here on; the first call (before the listening line)
  // turns "" NOT_SERVING, since StartGrpcServer starts it SERVING.
  grpc::HealthCheckServiceInterface* health = server->server->GetHealthCheckService();
  health->SetServingStatus(dxs::v1::ControlPlane::service_full_name(), true);
  dxs::ClusterWatcher watcher(&registry, [&](const dxs::v1::ClusterView& view, bool complete) {
    health->SetServingStatus("", complete);
    health->SetServingStatus(dxs::FrontendService::kServiceName, complete);
    frontend.OnClusterView(view);
  });

  (*cluster_metrics)->Start();

  const std::string host = flags->listen.substr(0, flags->listen.rfind(':'));
  const std::string metrics_host =
      flags->metrics_listen.substr(0, flags->metrics_listen.rfind(':'));
  std::cout << "dxs-router listening on " << host << ":" << server->port << ", metrics on "
            << metrics_host << ":" << (*metrics_server)->port() << std::endl;
  std::fprintf(stderr,
               "dxs-router: model %s (%lld experts, %lld layers, checkpoint %s config %s); "
               "%d attention + %d expert ranks; transport %s; lease %lld ms, heartbeat %lld ms; "
               "at most %lld requests in flight\n",
               flags->model_dir.c_str(), static_cast<long long>(config->num_experts),
               static_cast<long long>(config->num_hidden_layers),
               fingerprint->checkpoint_fingerprint().c_str(),
               fingerprint->config_fingerprint().c_str(), options.num_attention_ranks,
               options.num_expert_ranks, options.transport_backend.c_str(),
               static_cast<long long>(flags->lease_ms), static_cast<long long>(flags->heartbeat_ms),
               static_cast<long long>(flags->max_inflight));

  int signal_number = 0;
  sigwait(&signals, &signal_number);
  std::fprintf(stderr, "dxs-router: %s received, shutting down\n",
               signal_number == SIGTERM ? "SIGTERM" : "SIGINT");
  // Streams first (Generate streams end with UNAVAILABLE at once, WatchCluster streams
  // within the poll interval), then the server, with a deadline for unary calls still
  // running.
  watcher.Stop();
  health->Shutdown();
  frontend.Shutdown();
  service.Shutdown();
  server->server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(2));
  server->server->Wait();
  (*cluster_metrics)->Stop();
  (*metrics_server)->Stop();
  std::fprintf(stderr, "dxs-router: stopped\n");
  return 0;
}
