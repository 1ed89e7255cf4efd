// A real local cluster for multi-process tests: dxs-router, M dxs-attention and N
// dxs-expert processes on loopback, talking over real gRPC and UCX. Processes are killed
// (SIGTERM, then SIGKILL) when the cluster object dies; their output goes to log files
// under the cluster's temp directory and is printed if a test fails.
#pragma once

#include <sys/types.h>

#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "dxs/v1/attention_worker.grpc.pb.h"
#include "dxs/v1/control_plane.grpc.pb.h"
#include "dxs/v1/frontend.grpc.pb.h"
#include "grpcpp/security/credentials.h"

namespace dxs::testing {

struct ChildProcess {
  pid_t pid = -1;
  std::string name;
  std::string log_path;
};

// Starts `argv` with stdout+stderr to `log_path`; waits until the log contains `ready_text`.
absl::StatusOr<ChildProcess> SpawnAndWait(const std::vector<std::string>& argv,
                                          const std::string& name, const std::string& log_path,
                                          const std::string& ready_text, absl::Duration timeout);
void Terminate(ChildProcess* p);
std::string ReadFile(const std::string& path);
// First "HOST:PORT" after `marker` in the file.
std::string AddressAfter(const std::string& path, const std::string& marker);

struct ClusterSpec {
  std::string model_dir;
  int num_attention = 1;
  int num_expert = 1;
  std::vector<std::string> expert_claims;  // per EP rank; empty: default placement
  std::string wire_dtype = "f32";
  std::vector<std::string> attention_args = {};  // extra dxs-attention flags
};

struct GenerateResult {
  std::vector<int32_t> tokens;
  v1::FinishReason finish_reason = v1::FINISH_REASON_UNSPECIFIED;
  grpc::Status status;
};

class ProcessCluster {
 public:
  explicit ProcessCluster(std::string work_dir) : work_dir_(std::move(work_dir)) {}
  ~ProcessCluster();

  // Extra dxs-router flags for the next StartRouter, e.g. {"--max-inflight", "1"}.
  void set_router_args(std::vector<std::string> args) { router_args_ = std::move(args); }
  // Flags every process gets (router and workers), e.g. the TLS flags, and the
  // credentials this object's own stubs use; set before Start.
  void set_common_args(std::vector<std::string> args) { common_args_ = std::move(args); }
  // Flags the attention and expert workers get (not the router), e.g. {"--device", "cuda"};
  // set before Start (StartExpert uses them too).
  void set_worker_args(std::vector<std::string> args) { worker_args_ = std::move(args); }
  void set_client_credentials(std::shared_ptr<grpc::ChannelCredentials> c) {
    credentials_ = std::move(c);
  }
  // StartRouter, then StartWorkers.
  absl::Status Start(const ClusterSpec& spec, absl::Duration timeout = absl::Seconds(60));
  // The router alone (until it prints its address); then the experts and attention ranks,
  // waiting until every attention rank is READY.
  absl::Status StartRouter(const ClusterSpec& spec, absl::Duration timeout = absl::Seconds(60));
  absl::Status StartWorkers(const ClusterSpec& spec, absl::Duration timeout = absl::Seconds(60));
  // Starts (or restarts, on its old address) expert `rank`. With another `ready_text`, the
  // worker is expected to print it and exit (a refusal), and nothing is replaced.
  absl::Status StartExpert(int rank, const std::string& model_dir, const std::string& claim,
                           const std::string& ready_text = "listening on");
  void KillExpert(int rank);  // SIGKILL
  // Waits for expert `rank` to exit by itself (a drained rank); its exit status, or
  // DEADLINE_EXCEEDED.
  absl::StatusOr<int> WaitExpertExit(int rank, absl::Duration timeout);
  // Waits until the router's view shows no live incarnation of expert `rank` (its lease ran
  // out, or it was never there); DEADLINE_EXCEEDED after `timeout`.
  absl::Status WaitExpertDead(int rank, absl::Duration timeout = absl::Seconds(60)) const;
  void KillAttention(int rank);  // SIGKILL
  // Waits until every attention rank answers GetLoad with state READY.
  absl::Status WaitReady(absl::Duration timeout);

  // A greedy request straight to DP rank `rank`; `on_tokens`, when set, is called with the
  // number of tokens received so far after each streamed chunk.
  GenerateResult Generate(int rank, const std::string& request_id,
                          const std::vector<int32_t>& prompt, int max_new_tokens,
                          absl::Duration deadline = absl::Seconds(60),
                          const std::function<void(size_t)>& on_tokens = nullptr);
  v1::AttentionWorker::Stub* attention(int rank) { return stubs_[rank].get(); }
  // Logits of a finished request's first generated position, as its attention worker
  // dumped them (--dump-first-logits); empty if none.
  std::vector<float> FirstLogits(const std::string& request_id) const;
  std::string logits_dir() const;
  const std::string& router_address() const { return router_address_; }
  // Prometheus endpoints (HOST:PORT), from the "metrics on HOST:PORT" each process prints
  // at start-up; empty for a process not started.
  const std::string& router_metrics_address() const { return router_metrics_address_; }
  std::string attention_metrics_address(int rank) const;
  std::string expert_metrics_address(int rank) const;
  // All of the above for the processes running: router, attention ranks, expert ranks.
  std::vector<std::string> metrics_addresses() const;
  // The router's current ClusterView: the first message of a ControlPlane.WatchCluster
  // stream (5 s deadline).
  absl::StatusOr<v1::ClusterView> WatchClusterOnce() const;
  // dxs.v1.Frontend on router_address(); valid after StartRouter.
  v1::Frontend::Stub* frontend() { return frontend_.get(); }
  // Runs `dxs ARGS` to its end; its stdout and stderr, prefixed with "exit status != 0: "
  // when it fails.
  std::string RunDxs(const std::string& args) const;
  std::string DumpLogs() const;
  std::string bin(const std::string& name) const;

 private:
  std::string work_dir_;
  std::string router_address_;
  std::string router_metrics_address_;
  ChildProcess router_;
  std::vector<ChildProcess> attention_;
  std::map<int, ChildProcess> experts_;
  std::map<int, std::string> expert_addresses_;  // rank -> gRPC address it listened on
  std::vector<ChildProcess> refused_;            // workers started to be refused
  std::vector<std::unique_ptr<v1::AttentionWorker::Stub>> stubs_;
  std::unique_ptr<v1::Frontend::Stub> frontend_;
  std::vector<std::string> router_args_;
  std::vector<std::string> common_args_;
  std::vector<std::string> worker_args_;
  std::shared_ptr<grpc::ChannelCredentials> credentials_ = grpc::InsecureChannelCredentials();
};

}  // namespace dxs::testing
