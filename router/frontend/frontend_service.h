// FrontendService: dxs.v1.Frontend, the router's front door (synchronous gRPC API), served
// next to the ControlPlane on the router's port.
//
// Generate, in order:
//   1. validate (ValidateGenerateRequest): INVALID_ARGUMENT naming the field;
//   2. the cluster must be complete (ClusterRegistry::IsComplete), else UNAVAILABLE;
//   3. assign a request id if empty ("r-<counter>-<random hex>");
//   4. admit (InflightTracker): ALREADY_EXISTS for an id in flight, RESOURCE_EXHAUSTED
//      beyond max_inflight, UNAVAILABLE when no rank (or not the pinned one) is live;
//      the rank is data_parallel_rank if set, else the one with least outstanding tokens;
//   5. an assigned id is sent at once in an empty first chunk, so the caller can Abort
//      before the first token;
//   6. submit it on the rank's AttentionWorker.Serve stream (AttentionStreams: one per
//      rank, shared by all its requests) and relay its events message by message (the
//      final `complete` gets the router's timings); a worker error keeps its code,
//      prefixed with the rank; a stream that breaks (an unreachable or dead worker) is
//      UNAVAILABLE. A worker without Serve gets one AttentionWorker.Generate per request,
//      relayed the same way.
// Caller cancellation and deadlines are noticed within kCancelPollInterval and sent
// upstream as an abort, which frees the request's KV cache. (On the Generate fallback
// the upstream call is a child of the caller's, so they carry over by themselves.)
//
// Abort sends an abort on the request's stream (AttentionWorker.Abort on the fallback).
// When the worker cannot be told (the request has not reached it yet, or the rank is
// unreachable), the router stops the request itself and ends the stream with
// FINISH_REASON_ABORTED.
//
// OnClusterView (from a ClusterWatcher) fails with UNAVAILABLE the requests whose rank's
// worker died or was replaced. Shutdown fails every in-flight request with UNAVAILABLE and
// refuses new ones; call it before grpc::Server::Shutdown.
//
// Threads: each in-flight Generate holds one gRPC server thread for its whole stream
// (bounded by max_inflight); each attention rank's stream has one reader thread. Errors become
// grpc::Status only in the handlers here.
//
// Thread safety: handlers run concurrently on gRPC's threads; OnClusterView and Shutdown
// may be called from any thread. The registry must outlive the service.
#pragma once

#include <atomic>
#include <cstdint>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/model_config.h"
#include "dxs/v1/frontend.grpc.pb.h"
#include "router/control_plane/cluster_registry.h"
#include "router/frontend/attention_stream.h"
#include "router/frontend/attention_stubs.h"
#include "router/frontend/frontend_metrics.h"
#include "router/frontend/generate_validation.h"
#include "router/frontend/inflight_tracker.h"

namespace dxs {

struct FrontendOptions {
  // Requests in flight cluster-wide (admitted, not yet finished); more are refused with
  // RESOURCE_EXHAUSTED. At least 1.
  int64_t max_inflight = 1024;
  // Deadline of each AttentionWorker.GetLoad behind Frontend.GetLoads; a rank that does
  // not answer in time is reported from its last heartbeat.
  absl::Duration get_load_timeout = absl::Milliseconds(500);
  // Deadline of the AttentionWorker.Abort behind Frontend.Abort.
  absl::Duration abort_timeout = absl::Seconds(2);
  // Credentials of the router's calls to attention workers (plaintext when null).
  std::shared_ptr<grpc::ChannelCredentials> worker_credentials;
  // Where request outcomes and latencies are recorded; not owned, must outlive the
  // service. Null: not recorded.
  FrontendMetrics* metrics = nullptr;
};

// Where one Generate's messages go: the dxs.v1 caller's stream, or a translation into
// another API's (SglangSchedulerService). Called from the request's own handler thread only.
class GenerateResponseWriter {
 public:
  virtual ~GenerateResponseWriter() = default;
  // False once the caller has gone away.
  virtual bool Write(v1::GenerateResponse& message) = 0;
  // The request's last message (its `complete`).
  virtual void WriteLast(v1::GenerateResponse& message) = 0;
};

class FrontendService final : public v1::Frontend::Service {
 public:
  // The name health checks use for this service.
  static constexpr char kServiceName[] = "dxs.v1.Frontend";

  // `registry` is not owned. `model_info` is what GetModelInfo returns; `config` gives the
  // vocabulary and context length requests are checked against.
  FrontendService(ClusterRegistry* registry, const ModelConfig& config, v1::ModelInfo model_info,
                  FrontendOptions options);

  FrontendService(const FrontendService&) = delete;
  FrontendService& operator=(const FrontendService&) = delete;

  // Stops the requests whose rank is no longer held by the worker they were sent to.
  void OnClusterView(const v1::ClusterView& view);
  void Shutdown();

  grpc::Status Generate(grpc::ServerContext* context, const v1::GenerateRequest* request,
                        grpc::ServerWriter<v1::GenerateResponse>* writer) override;
  grpc::Status Abort(grpc::ServerContext* context, const v1::AbortRequest* request,
                     v1::AbortResponse* response) override;
  grpc::Status GetModelInfo(grpc::ServerContext* context, const v1::GetModelInfoRequest* request,
                            v1::GetModelInfoResponse* response) override;
  grpc::Status GetLoads(grpc::ServerContext* context, const v1::GetLoadsRequest* request,
                        v1::GetLoadsResponse* response) override;

  // The request path every front-door API shares (validate, admit, relay; see the top of
  // this file), writing dxs.v1 messages to `writer`. Records the outcome in the metrics.
  absl::Status ServeGenerate(grpc::ServerContext* context, v1::GenerateRequest request,
                             GenerateResponseWriter& writer);
  absl::Status AbortRequest(const std::string& request_id);
  v1::GetLoadsResponse Loads();
  // The served model, or UNAVAILABLE until an attention worker has registered.
  absl::StatusOr<v1::ModelInfo> ServedModel() const;
  // Whether the cluster serves (every rank live): what health reports.
  bool Serving() const;
  int num_attention_ranks() const { return limits_.num_attention_ranks; }
  int64_t max_inflight() const { return options_.max_inflight; }
  const GenerateLimits& limits() const { return limits_; }

 private:
  // Where requests for one DP rank go, from a cluster view.
  struct RankTarget {
    RankCandidate candidate;
    std::string address;
  };

  struct Relay;

  // How long a request waiting for its worker's events goes without checking whether its
  // caller cancelled.
  static constexpr absl::Duration kCancelPollInterval = absl::Milliseconds(50);

  absl::Status GenerateImpl(grpc::ServerContext* context, v1::GenerateRequest request,
                            GenerateResponseWriter& writer);
  // Runs the request on the rank's Serve stream.
  absl::Status RelayServe(grpc::ServerContext* context, const v1::GenerateRequest& request,
                          const std::string& address, AttentionStream& stream, Relay& relay);
  // Runs the request as one AttentionWorker.Generate call.
  absl::Status RelayGenerate(grpc::ServerContext* context, const v1::GenerateRequest& request,
                             const std::string& address, v1::AttentionWorker::Stub& stub,
                             Relay& relay);
  std::vector<RankTarget> Targets(const v1::ClusterView& view) const;
  std::string NewRequestId();

  ClusterRegistry* const registry_;
  const v1::ModelInfo model_info_;
  const GenerateLimits limits_;
  const FrontendOptions options_;
  InflightTracker inflight_;
  AttentionStubs stubs_;
  AttentionStreams streams_;
  std::atomic<bool> shutting_down_{false};
  std::atomic<uint64_t> next_request_number_{1};
  absl::Mutex random_mu_;
  std::mt19937_64 random_ ABSL_GUARDED_BY(random_mu_);
};

}  // namespace dxs
