// dxs-attention: one attention worker (DP rank). Runs everything but the experts: its own
// requests' embeddings, attention with KV cache, norms, router gate and top-k, lm_head and
// sampling; dispatches MoE rows to the expert workers and combines their results.
//
//   dxs-attention --model DIR --rank R --router HOST:PORT [--listen HOST:PORT]
//                 [--metrics-listen HOST:PORT] [--device cpu|cuda[:N]] [--kv-tokens N]
//                 [--prefill-chunk N]
//                 [--step-timeout-ms MS] [--overlap-min-tokens N] [--stream-interval N]
//                 [--dump-first-logits DIR]   (debugging: see AttentionWorkerService)
//
// --overlap-min-tokens: steps with at least N tokens over all DP ranks are split into two
// micro-batches whose attention and MoE overlap (two-batch overlap); 0 turns it off. The
// strictest setting among the DP ranks applies (AttentionStepLoop).
//
// --overlap-schedule (default true): a decode step sampled on the device is queued behind
// the running one, its input tokens taken on the device, while the host streams the running
// step's tokens (AttentionStepLoop); false is the A/B baseline. Not the two-batch overlap of
// --overlap-min-tokens, which splits one step in two.
//
// --mapped-exchange: workers of one host exchange rows through a region of the attention
// rank's memory that the expert ranks map (host memory, or GPU memory through CUDA IPC;
// dataplane/dispatch/dispatch_combine.h); false sends every row through the transport.
//
// --stream-interval: tokens per streamed chunk after the first (default 1: every token as
// it is produced; larger trades smoothness for throughput, as SGLang's flag of that name).
//
// Flags are abseil flags (common/flags/parse.h: --help, --helpfull, --flagfile FILE); bad
// flags: one line on stderr, exit status 2.
//
// Prometheus metrics (docs/metrics.md) are served on --metrics-listen (default
// 127.0.0.1:0, any free port); the bound address is registered with the router (`dxs
// status` shows it) and printed in the start-up line: "... listening on A, metrics on B".
#include <atomic>
#include <csignal>
#include <iostream>
#include <map>
#include <mutex>
#include <optional>
#include <set>

#include "absl/debugging/failure_signal_handler.h"
#include "absl/debugging/symbolize.h"
#include "absl/flags/flag.h"
#include "absl/strings/str_cat.h"
#include "attention_service/attention_metrics.h"
#include "attention_service/attention_step_loop.h"
#include "attention_service/attention_worker_service.h"
#include "common/flags/parse.h"
#include "common/grpc/server.h"
#include "common/metrics/callback_gauge.h"
#include "common/model_config.h"
#include "common/safetensors.h"
#include "common/status_macros.h"
#include "common/timeouts.h"
#include "common/tunables.h"
#include "model/weights.h"
#include "prometheus/registry.h"
#include "worker/worker_membership.h"
#include "worker/worker_runtime.h"
#include "worker/worker_startup.h"

ABSL_FLAG(int64_t, kv_tokens, 1 << 16, "KV cache positions this rank holds, >= 1.");
ABSL_FLAG(bool, kv_preallocate, true,
          "Take the whole --kv-tokens pool at start, so that one that does not fit fails the "
          "start rather than a step later (a growing pool holds its old and new copies at "
          "once); false grows it as requests need it.");
ABSL_FLAG(int64_t, prefill_chunk, 256, "Prompt tokens a request prefills per step, >= 1.");
ABSL_FLAG(int64_t, step_timeout_ms, absl::ToInt64Milliseconds(dxs::kDefaultStepTimeout),
          "A step exchange waiting longer than this for a peer fails, >= 1.");
ABSL_FLAG(int64_t, overlap_min_tokens, dxs::AttentionStepLoop::kDefaultOverlapMinTokens,
          "Two-batch overlap for steps with at least this many tokens over all DP ranks; "
          "0: off.");
ABSL_FLAG(bool, overlap_schedule, true,
          "Overlap scheduling: a decode step sampled on the device is queued behind the "
          "running one, its input tokens taken on the device, while the host streams the "
          "running step's tokens and checks their stops; false: every step's tokens are read "
          "before the next step is built.");
ABSL_FLAG(bool, piecewise_graphs, true,
          "On a GPU: decode steps below the two-batch-overlap threshold run the work between "
          "two exchanges as recorded CUDA graphs (vLLM's piecewise graphs); false: eagerly. "
          "No effect on the CPU.");
ABSL_FLAG(bool, mapped_exchange, true,
          "Workers on one host: the one-copy exchange, in which expert ranks read rows and "
          "store answers in place in a region of this rank's memory that they map (host "
          "memory on the CPU, GPU memory through CUDA IPC on a GPU); false: every row through "
          "the transport's transfers.");
ABSL_FLAG(int64_t, stream_interval, 1, "Tokens per streamed chunk after the first, >= 1.");
ABSL_FLAG(int64_t, step_retry_ms, 30000,
          "Elastic EP (dxs-router --elastic-ep): how long failed steps are run again before "
          "their requests fail, >= 1.");
ABSL_FLAG(int64_t, low_latency_capacity, 0,
          "On GPUs: decode steps in which every DP rank's padded batch is at most N tokens "
          "run their MoE over the low-latency exchange (fixed-capacity regions, no host "
          "synchronisation, one CUDA graph a step); larger steps and prefill go by the "
          "host-driven exchange. 0 (the default): off. Every DP rank must give the same N.");
ABSL_FLAG(std::string, dump_first_logits, "",
          "Debugging: write each request's first logits to this directory.");

namespace dxs {
namespace {

constexpr char kUsage[] =
    "one attention worker (DP rank) of a dxs cluster.\n\n"
    "usage: dxs-attention --model DIR --rank R --router HOST:PORT [--listen HOST:PORT]\n"
    "                     [--metrics-listen HOST:PORT] [--device cpu|cuda[:N]] [--kv-tokens N] "
    "[--kv-preallocate=true|false] [--prefill-chunk N]\n"
    "                     [--step-timeout-ms MS] [--overlap-min-tokens N] [--stream-interval N]\n"
    "                     [--overlap-schedule=true|false] [--piecewise-graphs=true|false]\n"
    "                     [--mapped-exchange=true|false]\n"
    "                     [--low-latency-capacity N]\n"
    "                     [--tls-cert FILE --tls-key FILE --tls-ca FILE [--mtls]]\n"
    "                     [--flagfile FILE]\n"
    "Flags may be spelled with dashes or underscores; a --flagfile uses underscores.";

struct Flags {
  WorkerFlags worker;
  int64_t kv_tokens = 0;
  int64_t prefill_chunk = 0;
  int64_t step_timeout_ms = 0;
  int64_t overlap_min_tokens = 0;
  int64_t stream_interval = 0;
  int64_t step_retry_ms = 0;
  int64_t low_latency_capacity = 0;
  bool kv_preallocate = true;
  bool overlap_schedule = true;
  bool piecewise_graphs = true;
  bool mapped_exchange = true;
  std::string dump_first_logits;
};

// The one place dxs-attention's flags are checked.
absl::StatusOr<Flags> ValidateFlags() {
  Flags flags;
  DXS_ASSIGN_OR_RETURN(flags.worker, ValidateWorkerFlags());
  flags.kv_tokens = absl::GetFlag(FLAGS_kv_tokens);
  flags.prefill_chunk = absl::GetFlag(FLAGS_prefill_chunk);
  flags.step_timeout_ms = absl::GetFlag(FLAGS_step_timeout_ms);
  flags.stream_interval = absl::GetFlag(FLAGS_stream_interval);
  flags.step_retry_ms = absl::GetFlag(FLAGS_step_retry_ms);
  for (const auto& [name, value] : {std::pair<const char*, int64_t>{"kv-tokens", flags.kv_tokens},
                                    {"step-retry-ms", flags.step_retry_ms},
                                    {"prefill-chunk", flags.prefill_chunk},
                                    {"step-timeout-ms", flags.step_timeout_ms},
                                    {"stream-interval", flags.stream_interval}}) {
    if (value < 1) {
      return absl::InvalidArgumentError(absl::StrCat("--", name, " must be >= 1, got ", value));
    }
  }
  flags.overlap_min_tokens = absl::GetFlag(FLAGS_overlap_min_tokens);
  if (flags.overlap_min_tokens < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("--overlap-min-tokens must be >= 0, got ", flags.overlap_min_tokens));
  }
  flags.low_latency_capacity = absl::GetFlag(FLAGS_low_latency_capacity);
  if (flags.low_latency_capacity < 0 ||
      flags.low_latency_capacity > Qwen3MoeModel::kMaxGraphBatch) {
    return absl::InvalidArgumentError(absl::StrCat("--low-latency-capacity must be in [0, ",
                                                   Qwen3MoeModel::kMaxGraphBatch, "], got ",
                                                   flags.low_latency_capacity));
  }
  flags.dump_first_logits = absl::GetFlag(FLAGS_dump_first_logits);
  flags.piecewise_graphs = absl::GetFlag(FLAGS_piecewise_graphs);
  flags.overlap_schedule = absl::GetFlag(FLAGS_overlap_schedule);
  flags.mapped_exchange = absl::GetFlag(FLAGS_mapped_exchange);
  flags.kv_preallocate = absl::GetFlag(FLAGS_kv_preallocate);
  return flags;
}

int Main(int argc, char** argv) {
  dxs::flags::ParseServiceCommandLine(argc, argv, "dxs-attention", kUsage);
  dxs::tunables::ValidateOrDie("dxs-attention");
  absl::StatusOr<Flags> flags = ValidateFlags();
  if (!flags.ok()) dxs::flags::ExitWithBadFlags("dxs-attention", flags.status());
  auto fail = [](const absl::Status& s) {
    std::cerr << "dxs-attention: " << s.message() << "\n";
    return 2;
  };
  const int rank = flags->worker.rank;
  const std::string& model_dir = flags->worker.model_dir;
  // Outlive everything that records into them.
  auto metrics_registry = std::make_shared<prometheus::Registry>();
  auto callback_gauges = std::make_shared<metrics::CallbackGauges>();
  WorkerRuntime runtime("attention", rank);
  absl::StatusOr<WorkerModel> prepared =
      PrepareWorker(flags->worker, "attention", metrics_registry.get(), &runtime);
  if (!prepared.ok()) return fail(prepared.status());
  const ModelConfig& config = prepared->config;
  const WeightSource& ckpt = *prepared->weights;
  std::unique_ptr<Backend> backend = std::move(prepared->backend);
  absl::StatusOr<AttentionWeights> weights = LoadAttentionWeights(ckpt, config, backend.get());
  if (!weights.ok()) return fail(weights.status());
  KvCache kv(config, backend.get(), flags->kv_tokens);
  if (flags->kv_preallocate) {
    if (absl::Status s = kv.Preallocate(); !s.ok()) {
      return fail(absl::Status(s.code(),
                               absl::StrCat("--kv-tokens ", flags->kv_tokens,
                                            ": the KV pool does not fit on this device (a smaller "
                                            "--kv-tokens fits): ",
                                            s.message())));
    }
  }
  Scheduler scheduler(config, &kv, {flags->prefill_chunk});
  AttentionWorkerService service(rank, config, &scheduler, &kv);
  service.set_first_logits_dir(flags->dump_first_logits);
  service.set_stream_interval(static_cast<int>(flags->stream_interval));
  absl::StatusOr<std::unique_ptr<AttentionMetrics>> attention_metrics = AttentionMetrics::Create(
      metrics_registry.get(), callback_gauges.get(), rank, &scheduler, &kv);
  if (!attention_metrics.ok()) return fail(attention_metrics.status());

  if (absl::Status s =
          StartServing(flags->worker, &service, {metrics_registry, callback_gauges}, &runtime);
      !s.ok()) {
    return fail(s);
  }

  // The MoE executor and step loop need the cluster shape; made on the first full view.
  const absl::Duration timeout = absl::Milliseconds(flags->step_timeout_ms);
  std::unique_ptr<RemoteMoeExecutor> moe;
  std::unique_ptr<LowLatencyDecode> low_latency;
  // The expert workers (rank, incarnation) the low-latency exchange was made with: a new
  // one (a restart) needs a new exchange.
  std::vector<std::pair<uint32_t, uint64_t>> expert_incarnations;
  std::unique_ptr<Qwen3MoeModel> model;
  std::unique_ptr<AttentionStepLoop> loop;
  AttentionWeights attention_weights = std::move(*weights);

  v1::RegisterRequest reg = runtime.BaseRegistration(v1::ROLE_ATTENTION, model_dir);
  // The placement version this rank's steps dispatch with, set between steps: once the
  // router sees the new one from every attention rank, no step uses the old placement and
  // the expert ranks may free what it alone needed.
  std::atomic<uint64_t> dispatch_placement_version{0};
  absl::Status joined = runtime.Join(flags->worker.router, reg, [&](v1::HeartbeatRequest* hb) {
    *hb->mutable_load() = service.Load();
    hb->set_placement_version(dispatch_placement_version.load());
    hb->set_state(service.ready() ? v1::WORKER_STATE_READY : v1::WORKER_STATE_JOINING);
    if (AttentionStepLoop* l = service.step_loop()) {  // published atomically
      FillStepCounters(l->counters(), hb->mutable_counters());
    }
  });
  if (!joined.ok()) return fail(joined);
  std::cout << "dxs-attention rank " << rank << " listening on " << runtime.grpc_address()
            << ", metrics on " << runtime.metrics_address() << std::endl;

  bool reported_idle = true;  // no step since the last idle report
  int num_attention = 0;
  // EP ranks (by WorkerId) already reported unreachable to the router.
  std::set<std::pair<uint32_t, uint64_t>> reported_unreachable;
  auto report_failed_ep_ranks = [&] {
    for (int r : moe->FailedEpRanks()) {
      std::optional<v1::WorkerId> id = runtime.WorkerAtTransportRank(num_attention + r);
      if (!id || id->role() != v1::ROLE_EXPERT) continue;
      if (!reported_unreachable.insert({id->rank(), id->incarnation()}).second) continue;
      absl::Status s = runtime.ReportUnreachable(*id, "a step's dispatch/combine failed");
      std::cerr << "dxs-attention rank " << rank << ": reported EP rank " << id->rank()
                << " unreachable: " << (s.ok() ? "marked dead" : s.ToString()) << "\n";
    }
  };
  while (!ShutdownRequested()) {
    std::optional<ClusterShape> shape = runtime.ApplyPendingView();
    if (shape && runtime.can_serve() && shape->placement.num_ranks() > 0) {
      num_attention = shape->num_attention;
      if (!loop) {
        std::vector<int> dp_peers, ep_peers;
        for (int r = 0; r < shape->num_attention; ++r) dp_peers.push_back(r);
        for (int r = 0; r < shape->num_expert; ++r) ep_peers.push_back(shape->num_attention + r);
        const bool fp8 = shape->wire_dtype == DType::kF8E4M3;
        if (fp8 && (!backend->capabilities().fp8_dispatch_rows || config.hidden_size % 4 != 0)) {
          return fail(absl::FailedPreconditionError(
              absl::StrCat("the cluster's wire dtype is fp8, which the ", backend->name(),
                           " backend cannot send",
                           config.hidden_size % 4 != 0 ? " (hidden size not a multiple of 4)" : "",
                           ": start the router with another --wire-dtype")));
        }
        DispatchOptions dispatch_options = DispatchOptionsForWire(shape->wire_dtype, timeout);
        dispatch_options.mapped_regions = flags->mapped_exchange;
        moe = std::make_unique<RemoteMoeExecutor>(backend.get(), runtime.transport(), ep_peers,
                                                  shape->placement, config.hidden_size,
                                                  dispatch_options);
        moe->set_observer(attention_metrics->get());
        if (flags->low_latency_capacity > 0) {
          absl::StatusOr<std::unique_ptr<LowLatencyDecode>> made = LowLatencyDecode::Make(
              rank, shape->num_attention, static_cast<int>(flags->low_latency_capacity), config,
              backend.get(), runtime.transport(), moe.get(), timeout, fp8);
          if (made.ok()) {
            low_latency = *std::move(made);
          } else {
            std::cerr << "dxs-attention rank " << rank
                      << ": --low-latency-capacity: " << made.status()
                      << "; every step goes by the host-driven exchange\n";
          }
        }
        model = std::make_unique<Qwen3MoeModel>(
            config, std::move(attention_weights), backend.get(),
            low_latency != nullptr ? low_latency->moe() : static_cast<MoeExecutor*>(moe.get()));
        loop = std::make_unique<AttentionStepLoop>(rank, dp_peers, runtime.transport(), model.get(),
                                                   moe.get(), &scheduler, &kv, timeout);
        loop->set_metrics(attention_metrics->get());
        loop->set_overlap_min_tokens(flags->overlap_min_tokens);
        loop->set_overlap_schedule(flags->overlap_schedule);
        loop->set_piecewise_decode(flags->piecewise_graphs && backend->SupportsGraphs()
                                       ? AttentionStepLoop::PiecewiseDecode::kGraphs
                                       : AttentionStepLoop::PiecewiseDecode::kOff);
        loop->set_on_step_end([&service] { service.FlushStreams(); });
        loop->set_on_step_failed(report_failed_ep_ranks);
        loop->set_low_latency(low_latency.get());
        service.set_step_loop(loop.get());
      } else {
        std::vector<int> ep_peers;
        for (int r = 0; r < shape->num_expert; ++r) ep_peers.push_back(shape->num_attention + r);
        moe->set_ep_peers(ep_peers);
        // Switched to at the step whose DP ranks all have it (AttentionStepLoop).
        moe->AddPlacement(shape->placement);
      }
      if (low_latency != nullptr) {
        std::vector<std::pair<uint32_t, uint64_t>> incarnations;
        for (int peer : moe->ep_peers()) {
          std::optional<v1::WorkerId> id = runtime.WorkerAtTransportRank(peer);
          if (id) incarnations.emplace_back(id->rank(), id->incarnation());
        }
        if (incarnations != expert_incarnations) low_latency->Reset();
        expert_incarnations = std::move(incarnations);
      }
      loop->set_dp_ranks(shape->live_attention, shape->view_version);
      loop->set_retry_window(shape->elastic_ep ? absl::Milliseconds(flags->step_retry_ms)
                                               : absl::ZeroDuration());
      if (moe->newest_placement_version() != dispatch_placement_version.load()) {
        dispatch_placement_version = moe->newest_placement_version();
        runtime.HeartbeatNow();
      }
    }
    if (const bool ready = loop != nullptr && runtime.can_serve(); ready != service.ready()) {
      service.set_ready(ready);
      runtime.HeartbeatNow();
    }
    if (!loop || !runtime.can_serve()) {
      // Requests of a cluster that became incomplete between steps (a step that lost a DP
      // rank, run again, then found an expert rank gone) end now, as a failed step's do.
      if (loop && scheduler.HasWork()) {
        loop->DropInFlightStep();
        scheduler.FailAll(absl::UnavailableError(
            absl::StrCat("attention rank ", rank, ": the cluster became incomplete")));
      }
      (void)runtime.transport()->WaitForActivity(absl::Now() + kWorkerIdleWait);
      continue;
    }
    absl::StatusOr<bool> ran = loop->RunOnce(kWorkerServeTurn);
    if (!ran.ok()) std::cerr << "dxs-attention: step loop: " << ran.status() << "\n";
    // Idle after work: the router's view gets this rank's counters and load now.
    if (ran.ok() && *ran) {
      reported_idle = false;
    } else if (ran.ok() && !reported_idle) {
      runtime.HeartbeatNow();
      reported_idle = true;
    }
  }
  service.set_ready(false);
  if (loop) loop->DropInFlightStep();
  scheduler.FailAll(absl::UnavailableError("attention worker shutting down"));
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
