// dxs-expert: one expert worker (EP rank). Holds its experts of every MoE layer, serves
// dispatch rounds from all DP ranks and answers with pre-summed combine rows.
//
//   dxs-expert --model DIR --rank R --router HOST:PORT [--listen HOST:PORT]
//              [--experts 0-3,7]   (default: the contiguous block for this rank)
//              [--metrics-listen HOST:PORT] [--device cpu|cuda[:N]]
//
// Flags are abseil flags (common/flags/parse.h: --help, --helpfull, --flagfile FILE); bad
// flags: one line on stderr, exit status 2.
//
// Prometheus metrics (docs/metrics.md) are served on --metrics-listen (default
// 127.0.0.1:0, any free port); the bound address is registered with the router (`dxs
// status` shows it) and printed in the start-up line: "... listening on A with N experts,
// metrics on B".
#include <iostream>

#include "absl/debugging/failure_signal_handler.h"
#include "absl/debugging/symbolize.h"
#include "absl/flags/flag.h"
#include "absl/strings/str_cat.h"
#include "common/flags/parse.h"
#include "common/model_config.h"
#include "common/safetensors.h"
#include "common/status_macros.h"
#include "common/step_trace.h"
#include "common/timeouts.h"
#include "common/tunables.h"
#include "dataplane/dispatch/placement.h"
#include "expert_service/expert_metrics.h"
#include "expert_service/expert_step_server.h"
#include "expert_service/expert_worker_service.h"
#include "expert_service/low_latency_expert_steps.h"
#include "model/weights.h"
#include "prometheus/registry.h"
#include "worker/worker_runtime.h"
#include "worker/worker_startup.h"

ABSL_FLAG(std::string, experts, "",
          "The experts this rank holds, e.g. 0-3,7; default: the contiguous block the router "
          "places on this rank.");

namespace dxs {
namespace {

constexpr char kUsage[] =
    "one expert worker (EP rank) of a dxs cluster.\n\n"
    "usage: dxs-expert --model DIR --rank R --router HOST:PORT [--listen HOST:PORT]\n"
    "                  [--experts 0-3,7] [--metrics-listen HOST:PORT] [--device cpu|cuda[:N]]\n"
    "                  [--tls-cert FILE --tls-key FILE --tls-ca FILE [--mtls]]\n"
    "                  [--flagfile FILE]\n"
    "Flags may be spelled with dashes or underscores; a --flagfile uses underscores.";

struct Flags {
  WorkerFlags worker;
  std::vector<int> claim;  // --experts; empty: what the router places here
};

// The one place dxs-expert's flags are checked.
absl::StatusOr<Flags> ValidateFlags() {
  Flags flags;
  DXS_ASSIGN_OR_RETURN(flags.worker, ValidateWorkerFlags());
  const std::string experts = absl::GetFlag(FLAGS_experts);
  if (!experts.empty()) {
    absl::StatusOr<std::vector<int>> parsed = ParseExpertList(experts);
    if (!parsed.ok()) {
      return absl::InvalidArgumentError(absl::StrCat("--experts: ", parsed.status().message()));
    }
    flags.claim = *parsed;
  }
  return flags;
}

int Main(int argc, char** argv) {
  dxs::flags::ParseServiceCommandLine(argc, argv, "dxs-expert", kUsage);
  dxs::tunables::ValidateOrDie("dxs-expert");
  absl::StatusOr<Flags> flags = ValidateFlags();
  if (!flags.ok()) dxs::flags::ExitWithBadFlags("dxs-expert", flags.status());
  auto fail = [](const absl::Status& s) {
    std::cerr << "dxs-expert: " << s.message() << "\n";
    return 2;
  };
  const int rank = flags->worker.rank;
  const std::vector<int>& claim = flags->claim;
  const std::string& model_dir = flags->worker.model_dir;
  // Outlives everything that records into it.
  auto metrics_registry = std::make_shared<prometheus::Registry>();
  WorkerRuntime runtime("expert", rank);
  absl::StatusOr<WorkerModel> prepared =
      PrepareWorker(flags->worker, "expert", metrics_registry.get(), &runtime);
  if (!prepared.ok()) return fail(prepared.status());
  const ModelConfig& config = prepared->config;
  const WeightSource& ckpt = *prepared->weights;
  std::unique_ptr<Backend> backend = std::move(prepared->backend);
  ExpertWorkerService service(rank);
  if (absl::Status s = StartServing(flags->worker, &service, {metrics_registry}, &runtime);
      !s.ok()) {
    return fail(s);
  }

  std::unique_ptr<ExpertShard> shard;
  std::unique_ptr<ExpertMetrics> expert_metrics;
  std::unique_ptr<ExpertStepServer> server;
  std::unique_ptr<LowLatencyExpertSteps> low_latency;
  v1::RegisterRequest reg = runtime.BaseRegistration(v1::ROLE_EXPERT, model_dir);
  for (int e : claim) reg.add_loaded_experts(static_cast<uint32_t>(e));
  absl::Status joined = runtime.Join(flags->worker.router, reg, [&](v1::HeartbeatRequest* hb) {
    hb->set_state(service.serving() ? v1::WORKER_STATE_READY : v1::WORKER_STATE_JOINING);
    hb->set_placement_version(service.placement_version());
    if (ExpertStepServer* s = service.step_server()) {  // published atomically
      FillStepCounters(s->counters(), hb->mutable_counters());
    }
  });
  if (!joined.ok()) return fail(joined);

  // The experts this rank holds: its claim, or what the router placed here.
  const v1::ExpertPlacement placement = runtime.registration().placement();
  std::vector<int> experts;
  for (int e = 0; e < placement.expert_to_rank_size(); ++e) {
    for (uint32_t r : placement.expert_to_rank(e).ep_ranks()) {
      if (static_cast<int64_t>(r) == rank) experts.push_back(e);
    }
  }
  if (experts.empty()) experts = claim;
  absl::StatusOr<ExpertWeightMap> weights = LoadExpertWeights(ckpt, config, experts, backend.get());
  if (!weights.ok()) return fail(weights.status());
  shard = std::make_unique<ExpertShard>(config, std::move(*weights), backend.get());
  ShardCompute compute(shard.get());
  service.set_shard(shard.get(), experts, placement.version(),
                    [&ckpt, &config, b = backend.get()](const std::vector<int>& more) {
                      return LoadExpertWeights(ckpt, config, more, b);
                    });
  absl::StatusOr<std::unique_ptr<ExpertMetrics>> made_metrics = ExpertMetrics::Create(
      metrics_registry.get(), rank, experts, static_cast<int>(config.num_experts));
  if (!made_metrics.ok()) return fail(made_metrics.status());
  expert_metrics = std::move(*made_metrics);
  std::cout << "dxs-expert rank " << rank << " listening on " << runtime.grpc_address() << " with "
            << experts.size() << " experts, metrics on " << runtime.metrics_address() << std::endl;

  bool reported_idle = true;  // no round since the last idle report
  // The last failure said, and how often it came again since: a failure that repeats every
  // turn (a fenced worker's, a dead peer's) is said once, not once a turn.
  std::string last_failure;
  int64_t repeats = 0;
  bool draining = false, holds_none = false;
  while (!ShutdownRequested()) {
    service.InstallPending();  // a LoadPlacement's experts, between rounds
    std::optional<ClusterShape> shape = runtime.ApplyPendingView();
    if (shape) {
      draining = shape->elastic_ep && shape->self_state == v1::WORKER_STATE_DRAINING;
      holds_none = shape->placement.num_ranks() > rank && shape->placement.experts_of(rank).empty();
    }
    // Drained (elastic EP): the router moved this rank's experts off and, once no attention
    // rank dispatches here any more, freed them; nothing is left to serve.
    if (draining && holds_none && service.resident_experts().empty()) {
      std::cout << "dxs-expert rank " << rank << ": drained, leaving the cluster" << std::endl;
      break;
    }
    if (shape && shape->num_attention > 0) {
      std::vector<int> dp_peers;
      for (int r = 0; r < shape->num_attention; ++r) dp_peers.push_back(r);
      if (!server) {
        server =
            std::make_unique<ExpertStepServer>(runtime.transport(), dp_peers, &compute, config);
        server->set_metrics(expert_metrics.get());
        // Decode steps the DP ranks run over the low-latency exchange (GPU backends; the
        // CPU's answers that it has none and the DP ranks keep to the host-driven one).
        low_latency =
            std::make_unique<LowLatencyExpertSteps>(runtime.transport(), shard.get(), config);
        server->set_low_latency(low_latency.get());
        service.set_step_server(server.get());
      }
    }
    if (shape && server) {
      server->set_dp_view(shape->live_attention, shape->dead_attention, shape->view_version);
    }
    if (const bool serving = server != nullptr && runtime.can_serve();
        serving != service.serving()) {
      service.set_serving(serving);
      runtime.HeartbeatNow();
    }
    if (!server || !runtime.can_serve()) {
      (void)runtime.transport()->WaitForActivity(absl::Now() + kWorkerIdleWait);
      continue;
    }
    absl::Status s = server->ServeRound(absl::Now() + kWorkerServeTurn);
    if (!s.ok() && s.code() != absl::StatusCode::kDeadlineExceeded) {
      const std::string failure = s.ToString();
      TraceStep("expert ", rank, ": round failed: ", failure);
      if (failure == last_failure) {
        ++repeats;
      } else {
        if (repeats > 0) {
          std::cerr << "dxs-expert rank " << rank << ": (the last failure came " << repeats
                    << " more times)\n";
        }
        std::cerr << "dxs-expert rank " << rank << ": " << failure << "\n";
        last_failure = failure;
        repeats = 0;
      }
      // A round that failed at once (its peers declared dead) would fail again at once:
      // wait for a message or a new view instead of spinning on the core.
      (void)runtime.transport()->WaitForActivity(absl::Now() + kWorkerIdleWait);
    } else if (s.ok() && !last_failure.empty()) {
      if (repeats > 0) {
        std::cerr << "dxs-expert rank " << rank << ": (the last failure came " << repeats
                  << " more times)\n";
      }
      last_failure.clear();
      repeats = 0;
    }
    // Idle after work (no round for a whole turn): the router's view gets this rank's counters now.
    if (s.ok()) {
      reported_idle = false;
    } else if (s.code() == absl::StatusCode::kDeadlineExceeded && !reported_idle) {
      runtime.HeartbeatNow();
      reported_idle = true;
    }
  }
  service.Stop();
  runtime.Stop();
  return 0;
}

}  // namespace
}  // namespace dxs

int main(int argc, char** argv) {
  // A crash (in a CUDA or UCX library as much as in dxs) leaves a symbolized stack in the
  // worker's log. UCX_HANDLE_ERRORS=none keeps UCX from replacing the handler with its own.
  absl::InitializeSymbolizer(argv[0]);
  absl::InstallFailureSignalHandler(absl::FailureSignalHandlerOptions());
  return dxs::Main(argc, argv);
}
