// dxs-attention: one attention worker (DP rank). Runs everything but the experts: its own
// requests' embeddings, attention with KV cache, norms, router gate and top-k, lm_head and
// sampling; dispatches MoE rows to the expert workers and combines their results.
//
//   dxs-attention --model DIR --rank R --router HOST:PORT [--listen HOST:PORT]
//                 [--metrics-listen HOST:PORT] [--kv-tokens N] [--prefill-chunk N]
//                 [--step-timeout-ms MS] [--overlap-min-tokens N] [--stream-interval N]
//                 [--dump-first-logits DIR]   (debugging: see AttentionWorkerService)
//
// --overlap-min-tokens: steps with at least N tokens over all DP ranks are split into two
// micro-batches whose attention and MoE overlap (two-batch overlap); 0 turns it off. The
// strictest setting among the DP ranks applies (AttentionStepLoop).
//
// --stream-interval: tokens per streamed chunk after the first (default 1: every token as
// it is produced; larger trades smoothness for throughput, as SGLang's flag of that name).
//
// Prometheus metrics (docs/metrics.md) are served on --metrics-listen (default
// 127.0.0.1:0, any free port); the bound address is registered with the router (`dxs
// status` shows it) and printed in the start-up line: "... listening on A, metrics on B".
#include <csignal>
#include <iostream>
#include <map>
#include <mutex>
#include <optional>

#include "absl/strings/str_cat.h"
#include "attention_service/attention_metrics.h"
#include "attention_service/attention_step_loop.h"
#include "attention_service/attention_worker_service.h"
#include "common/grpc/server.h"
#include "common/metrics/registry.h"
#include "common/model_config.h"
#include "common/safetensors.h"
#include "model/weights.h"
#include "router/membership/worker_membership.h"
#include "router/membership/worker_runtime.h"
#include "router/membership/worker_startup.h"
#include "tools/dxs/cli_args.h"
#include "tools/dxs/tls_flags.h"

namespace dxs {
namespace {

int Main(int argc, char** argv) {
  absl::StatusOr<cli::Args> args = cli::Args::Parse(
      std::vector<std::string>(argv + 1, argv + argc),
      cli::WithTlsValueFlags({"model", "rank", "router", "listen", "kv-tokens", "prefill-chunk",
                              "step-timeout-ms", "dump-first-logits", "metrics-listen",
                              "overlap-min-tokens", "stream-interval"}),
      cli::WithTlsBoolFlags({}));
  auto fail = [](const absl::Status& s) {
    std::cerr << "dxs-attention: " << s.message() << "\n";
    return 2;
  };
  if (!args.ok()) return fail(args.status());
  if (absl::Status s = args->Require({"model", "rank", "router"}); !s.ok()) return fail(s);
  auto rank = args->GetInt("rank", 0);
  auto kv_tokens = args->GetInt("kv-tokens", 1 << 16);
  auto chunk = args->GetInt("prefill-chunk", 256);
  auto timeout_ms = args->GetInt("step-timeout-ms", 5000);
  auto overlap_min_tokens =
      args->GetInt("overlap-min-tokens", AttentionStepLoop::kDefaultOverlapMinTokens);
  auto stream_interval = args->GetInt("stream-interval", 1);
  for (const absl::Status& s :
       {rank.status(), kv_tokens.status(), chunk.status(), timeout_ms.status(),
        overlap_min_tokens.status(), stream_interval.status()}) {
    if (!s.ok()) return fail(s);
  }
  const std::string model_dir = args->GetString("model");
  metrics::Registry metrics_registry;  // outlives everything that records into it
  WorkerRuntime runtime("attention", static_cast<int>(*rank));
  absl::StatusOr<WorkerModel> prepared =
      PrepareWorker(*args, "attention", &metrics_registry, &runtime);
  if (!prepared.ok()) return fail(prepared.status());
  const ModelConfig& config = prepared->config;
  const Checkpoint& ckpt = *prepared->checkpoint;
  std::unique_ptr<Backend> backend = MakeCpuBackend();
  absl::StatusOr<AttentionWeights> weights = LoadAttentionWeights(ckpt, config, backend.get());
  if (!weights.ok()) return fail(weights.status());
  KvCache kv(config, backend.get(), *kv_tokens);
  Scheduler scheduler(config, &kv, {*chunk});
  AttentionWorkerService service(static_cast<int>(*rank), config, &scheduler, &kv);
  if (*stream_interval < 1) {
    return fail(absl::InvalidArgumentError(
        absl::StrCat("--stream-interval must be >= 1, got ", *stream_interval)));
  }
  service.set_first_logits_dir(args->GetString("dump-first-logits"));
  service.set_stream_interval(static_cast<int>(*stream_interval));
  absl::StatusOr<std::unique_ptr<AttentionMetrics>> attention_metrics =
      AttentionMetrics::Create(&metrics_registry, static_cast<int>(*rank), &scheduler, &kv);
  if (!attention_metrics.ok()) return fail(attention_metrics.status());

  if (absl::Status s = StartServing(*args, &service, &metrics_registry, &runtime); !s.ok()) {
    return fail(s);
  }

  // The MoE executor and step loop need the cluster shape; made on the first full view.
  const absl::Duration timeout = absl::Milliseconds(*timeout_ms);
  std::unique_ptr<RemoteMoeExecutor> moe;
  std::unique_ptr<Qwen3MoeModel> model;
  std::unique_ptr<AttentionStepLoop> loop;
  AttentionWeights attention_weights = std::move(*weights);

  v1::RegisterRequest reg = runtime.BaseRegistration(v1::ROLE_ATTENTION, model_dir);
  absl::Status joined = runtime.Join(args->GetString("router"), reg, [&](v1::HeartbeatRequest* hb) {
    *hb->mutable_load() = service.Load();
    hb->set_state(service.ready() ? v1::WORKER_STATE_READY : v1::WORKER_STATE_JOINING);
    if (AttentionStepLoop* l = service.step_loop()) {  // published atomically
      FillStepCounters(l->counters(), hb->mutable_counters());
    }
  });
  if (!joined.ok()) return fail(joined);
  std::cout << "dxs-attention rank " << *rank << " listening on " << runtime.grpc_address()
            << ", metrics on " << runtime.metrics_address() << std::endl;

  while (!ShutdownRequested()) {
    std::optional<ClusterShape> shape = runtime.ApplyPendingView();
    if (shape && runtime.cluster_complete()) {
      if (!loop) {
        std::vector<int> dp_peers, ep_peers;
        for (int r = 0; r < shape->num_attention; ++r) dp_peers.push_back(r);
        for (int r = 0; r < shape->num_expert; ++r) ep_peers.push_back(shape->num_attention + r);
        moe = std::make_unique<RemoteMoeExecutor>(backend.get(), runtime.transport(), ep_peers,
                                                  shape->placement, config.hidden_size,
                                                  DispatchOptions{shape->wire_dtype, timeout});
        moe->set_observer(attention_metrics->get());
        model = std::make_unique<Qwen3MoeModel>(config, std::move(attention_weights), backend.get(),
                                                moe.get());
        loop = std::make_unique<AttentionStepLoop>(static_cast<int>(*rank), dp_peers,
                                                   runtime.transport(), model.get(), moe.get(),
                                                   &scheduler, &kv, timeout);
        loop->set_metrics(attention_metrics->get());
        loop->set_overlap_min_tokens(*overlap_min_tokens);
        loop->set_on_step_end([&service] { service.FlushStreams(); });
        service.set_step_loop(loop.get());
      } else {
        moe->set_placement(shape->placement);
      }
    }
    service.set_ready(loop != nullptr && runtime.cluster_complete());
    if (!loop || !runtime.cluster_complete()) {
      (void)runtime.transport()->WaitForActivity(absl::Now() + absl::Milliseconds(50));
      continue;
    }
    absl::StatusOr<bool> ran = loop->RunOnce(absl::Milliseconds(100));
    if (!ran.ok()) std::cerr << "dxs-attention: step loop: " << ran.status() << "\n";
  }
  service.set_ready(false);
  scheduler.FailAll(absl::UnavailableError("attention worker shutting down"));
  runtime.Stop();
  return 0;
}

}  // namespace
}  // namespace dxs

int main(int argc, char** argv) { return dxs::Main(argc, argv); }
