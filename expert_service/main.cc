// dxs-expert: one expert worker (EP rank). Holds its experts of every MoE layer, serves
// dispatch rounds from all DP ranks and answers with pre-summed combine rows.
//
//   dxs-expert --model DIR --rank R --router HOST:PORT [--listen HOST:PORT]
//              [--experts 0-3,7]   (default: the contiguous block for this rank)
//              [--metrics-listen HOST:PORT]
//
// Prometheus metrics (docs/metrics.md) are served on --metrics-listen (default
// 127.0.0.1:0, any free port); the bound address is registered with the router (`dxs
// status` shows it) and printed in the start-up line: "... listening on A with N experts,
// metrics on B".
#include <iostream>

#include "common/metrics/registry.h"
#include "common/model_config.h"
#include "common/safetensors.h"
#include "expert_service/expert_metrics.h"
#include "expert_service/expert_step_server.h"
#include "expert_service/expert_worker_service.h"
#include "model/weights.h"
#include "router/dispatch/placement.h"
#include "router/membership/worker_runtime.h"
#include "router/membership/worker_startup.h"
#include "tools/dxs/cli_args.h"
#include "tools/dxs/tls_flags.h"

namespace dxs {
namespace {

int Main(int argc, char** argv) {
  absl::StatusOr<cli::Args> args = cli::Args::Parse(
      std::vector<std::string>(argv + 1, argv + argc),
      cli::WithTlsValueFlags({"model", "rank", "router", "listen", "experts", "metrics-listen"}),
      cli::WithTlsBoolFlags({}));
  auto fail = [](const absl::Status& s) {
    std::cerr << "dxs-expert: " << s.message() << "\n";
    return 2;
  };
  if (!args.ok()) return fail(args.status());
  if (absl::Status s = args->Require({"model", "rank", "router"}); !s.ok()) return fail(s);
  auto rank = args->GetInt("rank", 0);
  if (!rank.ok()) return fail(rank.status());
  std::vector<int> claim;
  if (args->Has("experts")) {
    absl::StatusOr<std::vector<int>> parsed = ParseExpertList(args->GetString("experts"));
    if (!parsed.ok()) return fail(parsed.status());
    claim = *parsed;
  }
  const std::string model_dir = args->GetString("model");
  metrics::Registry metrics_registry;  // outlives everything that records into it
  WorkerRuntime runtime("expert", static_cast<int>(*rank));
  absl::StatusOr<WorkerModel> prepared =
      PrepareWorker(*args, "expert", &metrics_registry, &runtime);
  if (!prepared.ok()) return fail(prepared.status());
  const ModelConfig& config = prepared->config;
  const Checkpoint& ckpt = *prepared->checkpoint;
  std::unique_ptr<Backend> backend = MakeCpuBackend();
  ExpertWorkerService service(static_cast<int>(*rank));
  if (absl::Status s = StartServing(*args, &service, &metrics_registry, &runtime); !s.ok()) {
    return fail(s);
  }

  std::unique_ptr<ExpertShard> shard;
  std::unique_ptr<ExpertMetrics> expert_metrics;
  std::unique_ptr<ExpertStepServer> server;
  v1::RegisterRequest reg = runtime.BaseRegistration(v1::ROLE_EXPERT, model_dir);
  for (int e : claim) reg.add_loaded_experts(static_cast<uint32_t>(e));
  absl::Status joined = runtime.Join(args->GetString("router"), reg, [&](v1::HeartbeatRequest* hb) {
    hb->set_state(service.serving() ? v1::WORKER_STATE_READY : v1::WORKER_STATE_JOINING);
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
      if (static_cast<int64_t>(r) == *rank) experts.push_back(e);
    }
  }
  if (experts.empty()) experts = claim;
  absl::StatusOr<ExpertWeightMap> weights = LoadExpertWeights(ckpt, config, experts, backend.get());
  if (!weights.ok()) return fail(weights.status());
  shard = std::make_unique<ExpertShard>(config, std::move(*weights), backend.get());
  ShardCompute compute(shard.get());
  service.set_shard(shard.get(), experts);
  absl::StatusOr<std::unique_ptr<ExpertMetrics>> made_metrics = ExpertMetrics::Create(
      &metrics_registry, static_cast<int>(*rank), experts, static_cast<int>(config.num_experts));
  if (!made_metrics.ok()) return fail(made_metrics.status());
  expert_metrics = std::move(*made_metrics);
  std::cout << "dxs-expert rank " << *rank << " listening on " << runtime.grpc_address() << " with "
            << experts.size() << " experts, metrics on " << runtime.metrics_address() << std::endl;

  while (!ShutdownRequested()) {
    std::optional<ClusterShape> shape = runtime.ApplyPendingView();
    if (shape && shape->num_attention > 0) {
      std::vector<int> dp_peers;
      for (int r = 0; r < shape->num_attention; ++r) dp_peers.push_back(r);
      if (!server) {
        server =
            std::make_unique<ExpertStepServer>(runtime.transport(), dp_peers, &compute, config);
        server->set_metrics(expert_metrics.get());
        service.set_step_server(server.get());
      }
    }
    service.set_serving(server != nullptr && runtime.cluster_complete());
    if (!server || !runtime.cluster_complete()) {
      (void)runtime.transport()->WaitForActivity(absl::Now() + absl::Milliseconds(50));
      continue;
    }
    absl::Status s = server->ServeRound(absl::Now() + absl::Milliseconds(100));
    if (!s.ok() && s.code() != absl::StatusCode::kDeadlineExceeded) {
      std::cerr << "dxs-expert rank " << *rank << ": " << s << "\n";
    }
  }
  runtime.Stop();
  return 0;
}

}  // namespace
}  // namespace dxs

int main(int argc, char** argv) { return dxs::Main(argc, argv); }
