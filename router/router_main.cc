// dxs-router: the router process. Serves, on one gRPC port with health and reflection,
// the front door (dxs.v1.Frontend: Generate, Abort, GetModelInfo, GetLoads; see
// router/frontend/frontend_service.h) and the control plane (membership, expert
// placement, transport set-up).
//
//   dxs-router --model DIR --attention M --experts N [--listen HOST:PORT]
//              [--metrics-listen HOST:PORT] [--transport ucx|nccl|inproc]
//              [--wire-dtype f32|bf16|fp8] [--lease-ms 3000] [--heartbeat-ms 500]
//              [--max-inflight 1024] [--num-redundant-experts R]
//              [--enable-eplb [--eplb-interval N]]
//
// --enable-eplb rebalances experts live every --eplb-interval steps (EPLB;
// router/control_plane/rebalancer.h): a placement from measured tokens per expert, loaded
// by the expert ranks before it is published. `dxs rebalance` (ControlPlane.Rebalance)
// runs one rebalance by hand, with or without --enable-eplb.
// --num-redundant-experts R adds R expert slots beyond one per expert: replicas placed by
// Placement::WithRedundantExperts (dataplane/dispatch/placement.h) on distinct EP ranks; a
// DP rank sends each routed pair to exactly one replica (the rule is in that header).
// --max-inflight bounds the Generate requests in flight cluster-wide; beyond it Generate
// is refused with RESOURCE_EXHAUSTED.
//
// Health (grpc.health.v1): "" and "dxs.v1.Frontend" are NOT_SERVING until every attention
// and expert rank is live and every expert has a rank (ClusterRegistry::IsComplete) and
// every worker reports READY (its step loop runs; workers report the change at once), and
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
// cleanly with exit status 0. Flags are abseil flags (common/flags/parse.h: --help,
// --helpfull, --flagfile FILE); bad flags: one line on stderr, exit status 2; start-up
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

#include "absl/flags/flag.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "common/flags/parse.h"
#include "common/flags/tls_flags.h"
#include "common/grpc/server.h"
#include "common/metrics/build_info.h"
#include "common/metrics/metrics_server.h"
#include "common/model_config.h"
#include "common/tunables.h"
#include "dataplane/transport/transport_table.h"
#include "grpcpp/health_check_service_interface.h"
#include "prometheus/registry.h"
#include "router/control_plane/cluster_metrics.h"
#include "router/control_plane/cluster_registry.h"
#include "router/control_plane/control_plane_service.h"
#include "router/control_plane/model_identity.h"
#include "router/control_plane/nccl_unique_id.h"
#include "router/control_plane/rebalancer.h"
#include "router/frontend/cluster_watcher.h"
#include "router/frontend/frontend_metrics.h"
#include "router/frontend/frontend_service.h"
#include "router/frontend/model_info.h"
#include "router/frontend/sglang_scheduler_service.h"

ABSL_FLAG(std::string, model, "", "Checkpoint directory (Hugging Face layout); required.");
ABSL_FLAG(int, attention, 0, "Attention workers (DP ranks), 1..65536; required.");
ABSL_FLAG(int, experts, 0,
          "Expert workers (EP ranks) at start, 1..65536; required. With --elastic-ep more "
          "join, each with the next rank number.");
ABSL_FLAG(std::string, listen, "127.0.0.1:50051", "gRPC HOST:PORT (port 0: any free port).");
ABSL_FLAG(std::string, metrics_listen, "127.0.0.1:0",
          "Prometheus /metrics on HOST:PORT (port 0: any free port).");
ABSL_FLAG(std::string, transport, "ucx", "Dispatch/combine transport: ucx, nccl or inproc.");
ABSL_FLAG(std::string, wire_dtype, "f32",
          "Dispatch/combine payload type: f32, bf16 or fp8 (FP8 dispatch rows with a scale per "
          "token and 128 channels, bf16 answers).");
ABSL_FLAG(int64_t, lease_ms, 3000,
          "A worker without a heartbeat for this long is dead, 1..3600000.");
ABSL_FLAG(int64_t, heartbeat_ms, 500, "Workers' heartbeat interval, 1..3600000.");
ABSL_FLAG(int, num_redundant_experts, 0,
          "Expert slots beyond one per expert (replicas of experts on other EP ranks, as "
          "vLLM's --num-redundant-experts), 0..experts*(EP ranks-1); 0: no replicas.");
ABSL_FLAG(bool, enable_eplb, false,
          "Rebalance experts live from measured load every --eplb-interval steps (EPLB).");
ABSL_FLAG(int64_t, eplb_interval, 1000,
          "Steps between EPLB rebalances with --enable-eplb, 1..1000000000.");
ABSL_FLAG(bool, elastic_ep, false,
          "Elastic EP: keep serving when an EP rank dies (its experts' replicas take over, "
          "experts it alone held are reloaded on live ranks, failed steps are run again), and "
          "move a drained EP rank's experts off before it leaves (dxs drain); an EP rank "
          "started with the next rank number joins and is rebalanced onto.");
ABSL_FLAG(std::string, served_model_name, "",
          "The model's name on the gateway protocol (the `model` OpenAI clients send through "
          "SMG); empty: the --model directory's last component.");
ABSL_FLAG(int64_t, max_inflight, 1024,
          "Generate requests in flight cluster-wide, 1..1000000; beyond: RESOURCE_EXHAUSTED.");

namespace {

constexpr char kUsage[] =
    "the router of a dxs cluster: front door and control plane.\n\n"
    "usage: dxs-router --model DIR --attention M --experts N [--listen HOST:PORT]\n"
    "                  [--metrics-listen HOST:PORT] [--transport ucx|nccl|inproc]\n"
    "                  [--wire-dtype f32|bf16|fp8]\n"
    "                  [--lease-ms MS] [--heartbeat-ms MS] [--max-inflight N]\n"
    "                  [--num-redundant-experts R] [--enable-eplb [--eplb-interval N]]\n"
    "                  [--elastic-ep] [--served-model-name NAME]\n"
    "                  [--tls-cert FILE --tls-key FILE --tls-ca FILE [--mtls]]\n"
    "                  [--flagfile FILE]\n"
    "Flags may be spelled with dashes or underscores; a --flagfile uses underscores.";

int Fail(const absl::Status& status) {
  std::cerr << "dxs-router: " << status.ToString() << "\n";
  return 1;
}

// The flags, checked and converted.
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
  int num_redundant_experts = 0;
  int64_t eplb_interval = 0;  // 0: --enable-eplb off
};

// The one place the router's flags are checked.
absl::StatusOr<Flags> ValidateFlags() {
  Flags flags;
  flags.listen = absl::GetFlag(FLAGS_listen);
  if (flags.listen.rfind(':') == std::string::npos) {
    return absl::InvalidArgumentError(
        absl::StrCat("--listen: '", flags.listen, "' is not HOST:PORT"));
  }
  flags.metrics_listen = absl::GetFlag(FLAGS_metrics_listen);
  if (flags.metrics_listen.rfind(':') == std::string::npos) {
    return absl::InvalidArgumentError(
        absl::StrCat("--metrics-listen: '", flags.metrics_listen, "' is not HOST:PORT"));
  }
  flags.model_dir = absl::GetFlag(FLAGS_model);
  if (flags.model_dir.empty()) return absl::InvalidArgumentError("--model DIR is required");
  for (const auto& [name, value, out] :
       {std::tuple<const char*, int, int*>{"attention", absl::GetFlag(FLAGS_attention),
                                           &flags.num_attention_ranks},
        std::tuple<const char*, int, int*>{"experts", absl::GetFlag(FLAGS_experts),
                                           &flags.num_expert_ranks}}) {
    if (value == 0) return absl::InvalidArgumentError(absl::StrCat("--", name, " is required"));
    if (value < 1 || value > 65536) {
      return absl::InvalidArgumentError(absl::StrCat("--", name, " must be in 1..65536"));
    }
    *out = value;
  }
  flags.transport = absl::GetFlag(FLAGS_transport);
  if (dxs::FindTransport(flags.transport) == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat("--transport must be ", dxs::TransportNames(),
                                                   ", got '", flags.transport, "'"));
  }
  const std::string dtype = absl::GetFlag(FLAGS_wire_dtype);
  if (dtype == "f32") {
    flags.wire_dtype = dxs::v1::DTYPE_FLOAT32;
  } else if (dtype == "bf16") {
    flags.wire_dtype = dxs::v1::DTYPE_BFLOAT16;
  } else if (dtype == "fp8") {
    flags.wire_dtype = dxs::v1::DTYPE_FLOAT8_E4M3;  // FP8 dispatch rows, bf16 answers
  } else {
    return absl::InvalidArgumentError(
        absl::StrCat("--wire-dtype must be f32, bf16 or fp8, got '", dtype, "'"));
  }
  for (const auto& [name, value, out] :
       {std::tuple<const char*, int64_t, int64_t*>{"lease-ms", absl::GetFlag(FLAGS_lease_ms),
                                                   &flags.lease_ms},
        std::tuple<const char*, int64_t, int64_t*>{
            "heartbeat-ms", absl::GetFlag(FLAGS_heartbeat_ms), &flags.heartbeat_ms}}) {
    if (value < 1 || value > 3600 * 1000) {
      return absl::InvalidArgumentError(absl::StrCat("--", name, " must be in 1..3600000"));
    }
    *out = value;
  }
  flags.max_inflight = absl::GetFlag(FLAGS_max_inflight);
  if (flags.max_inflight < 1 || flags.max_inflight > 1000000) {
    return absl::InvalidArgumentError("--max-inflight must be in 1..1000000");
  }
  flags.num_redundant_experts = absl::GetFlag(FLAGS_num_redundant_experts);
  if (flags.num_redundant_experts < 0) {
    return absl::InvalidArgumentError("--num-redundant-experts must be >= 0");
  }
  if (absl::GetFlag(FLAGS_enable_eplb)) {
    flags.eplb_interval = absl::GetFlag(FLAGS_eplb_interval);
    if (flags.eplb_interval < 1 || flags.eplb_interval > 1000000000) {
      return absl::InvalidArgumentError("--eplb-interval must be in 1..1000000000");
    }
  }
  absl::StatusOr<dxs::TlsConfig> tls = dxs::flags::TlsFromFlags(/*for_server=*/true);
  if (!tls.ok()) return tls.status();
  flags.tls = *tls;
  return flags;
}

// Every worker in the view says it serves (READY, or DRAINING: still serving what it has).
// A worker reports READY once its step loop runs; until then the view shows JOINING, and
// health must not say SERVING while the view (what `dxs status` shows) says otherwise.
bool EveryWorkerServes(const dxs::v1::ClusterView& view) {
  for (const dxs::v1::WorkerInfo& w : view.workers()) {
    if (w.state() != dxs::v1::WORKER_STATE_READY && w.state() != dxs::v1::WORKER_STATE_DRAINING) {
      return false;
    }
  }
  return true;
}

}  // namespace

int main(int argc, char** argv) {
  dxs::flags::ParseServiceCommandLine(argc, argv, "dxs-router", kUsage);
  dxs::tunables::ValidateOrDie("dxs-router");
  absl::StatusOr<Flags> flags = ValidateFlags();
  if (!flags.ok()) dxs::flags::ExitWithBadFlags("dxs-router", flags.status());

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
  if (dxs::FindTransport(flags->transport)->Has(dxs::kCommunicatorPerView)) {
    // The communicators' ids come from the router's NCCL (loaded at run time).
    if (absl::Status s = dxs::CheckNcclLoads(); !s.ok()) return Fail(s);
    options.nccl_unique_id = dxs::NewNcclUniqueId;
  }
  options.wire_dtype = flags->wire_dtype;
  options.heartbeat_interval = absl::Milliseconds(flags->heartbeat_ms);
  options.lease_timeout = absl::Milliseconds(flags->lease_ms);
  options.num_redundant_experts = flags->num_redundant_experts;
  options.elastic_ep = absl::GetFlag(FLAGS_elastic_ep);
  // A restarted router's incarnations, views and placements come after the last one's.
  options.first_version = static_cast<uint64_t>(absl::ToUnixMicros(absl::Now()));
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
  auto metrics_registry = std::make_shared<prometheus::Registry>();
  if (absl::Status s = dxs::metrics::RegisterBuildInfo(metrics_registry.get(), "router"); !s.ok()) {
    return Fail(s);
  }
  absl::StatusOr<std::unique_ptr<dxs::FrontendMetrics>> frontend_metrics =
      dxs::FrontendMetrics::Create(metrics_registry.get());
  if (!frontend_metrics.ok()) return Fail(frontend_metrics.status());

  dxs::ClusterRegistry registry(options);
  dxs::ClusterMetricsOptions cluster_metrics_options;
  cluster_metrics_options.interval = options.heartbeat_interval;
  absl::StatusOr<std::shared_ptr<dxs::ClusterMetrics>> cluster_metrics =
      dxs::ClusterMetrics::Create(&registry, cluster_metrics_options);
  if (!cluster_metrics.ok()) return Fail(cluster_metrics.status());
  // GET /metrics: the registry and the cluster-wide view, sampled at each scrape; stopped
  // (and waited for) before the registry the view reads goes away.
  dxs::metrics::MetricsServerOptions metrics_options;
  metrics_options.address = flags->metrics_listen;
  absl::StatusOr<std::unique_ptr<dxs::metrics::MetricsServer>> metrics_server =
      dxs::metrics::MetricsServer::Start(metrics_options);
  if (!metrics_server.ok()) {
    return Fail(
        absl::Status(metrics_server.status().code(),
                     absl::StrCat("--metrics-listen: ", metrics_server.status().message())));
  }
  (*metrics_server)->Expose(metrics_registry);
  (*metrics_server)->Expose(*cluster_metrics);

  dxs::ControlPlaneService service(&registry);
  service.set_tls(flags->tls);
  absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> server_credentials =
      dxs::MakeServerCredentials(flags->tls);
  if (!server_credentials.ok()) return Fail(server_credentials.status());
  absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> worker_credentials =
      dxs::MakeChannelCredentials(flags->tls);
  if (!worker_credentials.ok()) return Fail(worker_credentials.status());
  dxs::RebalancerOptions rebalancer_options;
  rebalancer_options.interval_steps = flags->eplb_interval;
  rebalancer_options.num_redundant_experts = flags->num_redundant_experts;
  rebalancer_options.credentials = *worker_credentials;
  rebalancer_options.elastic_ep = options.elastic_ep;
  absl::StatusOr<std::unique_ptr<dxs::Rebalancer>> rebalancer =
      dxs::Rebalancer::Create(&registry, rebalancer_options, metrics_registry.get());
  if (!rebalancer.ok()) return Fail(rebalancer.status());
  service.set_rebalance([r = rebalancer->get()] { return r->Rebalance(); });
  dxs::FrontendOptions frontend_options;
  frontend_options.max_inflight = flags->max_inflight;
  frontend_options.worker_credentials = *worker_credentials;
  frontend_options.metrics = frontend_metrics->get();
  dxs::v1::ModelInfo model_info = dxs::MakeModelInfo(*config, flags->model_dir, *fingerprint);
  if (!absl::GetFlag(FLAGS_served_model_name).empty()) {
    model_info.set_model_name(absl::GetFlag(FLAGS_served_model_name));
  }
  dxs::FrontendService frontend(&registry, *config, model_info, frontend_options);
  // The gateway protocol (SMG in front of the cluster), on the same port and request path.
  dxs::SglangSchedulerOptions sglang_options;
  sglang_options.model_dir = flags->model_dir;
  sglang_options.served_model_name = model_info.model_name();
  sglang_options.version = absl::StrCat("dxs ", DXS_VERSION_STRING);
  dxs::SglangSchedulerService sglang_scheduler(&frontend, *config, sglang_options);
  dxs::GrpcServerOptions server_options;
  server_options.address = flags->listen;
  server_options.credentials = *server_credentials;
  absl::StatusOr<dxs::GrpcServer> server =
      dxs::StartGrpcServer(server_options, {&service, &frontend, &sglang_scheduler});
  if (!server.ok()) return Fail(server.status());

  // Health follows the registry from here on; the first call (before the listening line)
  // turns "" NOT_SERVING, since StartGrpcServer starts it SERVING.
  grpc::HealthCheckServiceInterface* health = server->server->GetHealthCheckService();
  health->SetServingStatus(dxs::v1::ControlPlane::service_full_name(), true);
  dxs::ClusterWatcher watcher(&registry, [&](const dxs::v1::ClusterView& view, bool complete) {
    const bool serving = complete && EveryWorkerServes(view);
    health->SetServingStatus("", serving);
    health->SetServingStatus(dxs::FrontendService::kServiceName, serving);
    health->SetServingStatus(dxs::SglangSchedulerService::kServiceName, serving);
    frontend.OnClusterView(view);
  });

  (*cluster_metrics)->Start();
  (*rebalancer)->Start();

  const std::string host = flags->listen.substr(0, flags->listen.rfind(':'));
  const std::string metrics_host =
      flags->metrics_listen.substr(0, flags->metrics_listen.rfind(':'));
  std::cout << "dxs-router listening on " << host << ":" << server->port << ", metrics on "
            << metrics_host << ":" << (*metrics_server)->port() << std::endl;
  std::fprintf(stderr,
               "dxs-router: model %s (%lld experts, %lld layers, checkpoint %s config %s); "
               "%d attention + %d expert ranks; transport %s; lease %lld ms, heartbeat %lld ms; "
               "at most %lld requests in flight; %d redundant experts\n",
               flags->model_dir.c_str(), static_cast<long long>(config->num_experts),
               static_cast<long long>(config->num_hidden_layers),
               fingerprint->checkpoint_fingerprint().c_str(),
               fingerprint->config_fingerprint().c_str(), options.num_attention_ranks,
               options.num_expert_ranks, options.transport_backend.c_str(),
               static_cast<long long>(flags->lease_ms), static_cast<long long>(flags->heartbeat_ms),
               static_cast<long long>(flags->max_inflight), options.num_redundant_experts);

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
  (*rebalancer)->Stop();
  server->server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(2));
  server->server->Wait();
  (*cluster_metrics)->Stop();
  (*metrics_server)->Stop();
  std::fprintf(stderr, "dxs-router: stopped\n");
  return 0;
}
