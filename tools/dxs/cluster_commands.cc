// dxs up / generate / status: the local cluster and a client for it.
#include <fcntl.h>
#include <grpcpp/grpcpp.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <csignal>
#include <filesystem>
#include <iostream>
#include <optional>
#include <thread>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "common/flags/tls_flags.h"
#include "common/plugin_loader.h"
#include "dxs/v1/control_plane.grpc.pb.h"
#include "dxs/v1/frontend.grpc.pb.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "kernels/make_backend.h"
#include "nlohmann/json.hpp"
#include "tools/dxs/cli_args.h"
#include "tools/dxs/commands.h"
#include "tools/dxs/gateway.h"
#include "tools/dxs/sampling_flags.h"
#include "tools/dxs/tls_flags.h"
#include "worker/worker_transport.h"

namespace dxs::cli {
namespace {

std::atomic<bool> g_stop{false};
void OnStopSignal(int) { g_stop = true; }

int Fail(const std::string& cmd, const absl::Status& s) {
  std::cerr << "dxs " << cmd << ": " << s.message() << "\n";
  return s.code() == absl::StatusCode::kInvalidArgument ? 2 : 1;
}

int FailRpc(const std::string& cmd, const grpc::Status& s) {
  static const char* kNames[] = {"OK",
                                 "CANCELLED",
                                 "UNKNOWN",
                                 "INVALID_ARGUMENT",
                                 "DEADLINE_EXCEEDED",
                                 "NOT_FOUND",
                                 "ALREADY_EXISTS",
                                 "PERMISSION_DENIED",
                                 "RESOURCE_EXHAUSTED",
                                 "FAILED_PRECONDITION",
                                 "ABORTED",
                                 "OUT_OF_RANGE",
                                 "UNIMPLEMENTED",
                                 "INTERNAL",
                                 "UNAVAILABLE",
                                 "DATA_LOSS",
                                 "UNAUTHENTICATED"};
  const int code = static_cast<int>(s.error_code());
  std::cerr << "dxs " << cmd << ": " << (code >= 0 && code <= 16 ? kNames[code] : "UNKNOWN") << ": "
            << s.error_message() << "\n";
  return 1;
}

// A channel with the command's TLS settings (already validated by TlsFromArgs).
std::shared_ptr<grpc::Channel> Channel(const std::string& address, const TlsConfig& tls) {
  absl::StatusOr<std::shared_ptr<grpc::Channel>> c = MakeChannel(address, tls);
  return c.ok() ? *c : grpc::CreateChannel(address, grpc::InsecureChannelCredentials());
}

struct Child {
  pid_t pid = -1;
  std::string name;
  // What started it, so that `dxs up --elastic-ep` can start it again.
  std::vector<std::string> argv;
  std::string log_path;
  // An expert rank under --elastic-ep: started again when it dies (not when it drained).
  bool restart_on_failure = false;
  std::chrono::steady_clock::time_point restart_at{};
};

// Starts `argv` with output to `log_path` (appended to with `append`, else truncated); the
// child dies with this process (PDEATHSIG).
absl::StatusOr<Child> Spawn(const std::vector<std::string>& argv, const std::string& name,
                            const std::string& log_path, bool append = false) {
  const pid_t parent = getpid();
  const pid_t pid = fork();
  if (pid < 0) return absl::InternalError("fork failed");
  if (pid == 0) {
    prctl(PR_SET_PDEATHSIG, SIGTERM);
    if (getppid() != parent) _exit(1);  // the parent died before prctl
    const int fd = open(log_path.c_str(), O_WRONLY | O_CREAT | (append ? O_APPEND : O_TRUNC), 0644);
    dup2(fd, 1);
    dup2(fd, 2);
    signal(SIGINT, SIG_IGN);  // Ctrl-C reaches the whole group; `dxs up` stops children
    // All the cluster's processes share this machine's cores: one BLAS thread each, or
    // OpenBLAS's spinning threads fight each other (measured: 0.38x -> 0.51x of the
    // single-process throughput at concurrency 64 on 2 cores). An explicit setting wins.
    setenv("OPENBLAS_NUM_THREADS", "1", /*overwrite=*/0);
    std::vector<char*> args;
    for (const std::string& a : argv) args.push_back(const_cast<char*>(a.c_str()));
    args.push_back(nullptr);
    execv(args[0], args.data());
    _exit(127);
  }
  Child c;
  c.pid = pid;
  c.name = name;
  c.argv = argv;
  c.log_path = log_path;
  return c;
}

// How a child ended, for `dxs up`'s log: "exit status N" or "signal N".
std::string DescribeExit(int status) {
  if (WIFSIGNALED(status)) return absl::StrCat("signal ", WTERMSIG(status));
  return absl::StrCat("exit status ", WEXITSTATUS(status));
}

void StopAll(std::vector<Child>* children) {
  for (Child& c : *children) {
    if (c.pid > 0) kill(c.pid, SIGTERM);
  }
  for (int i = 0; i < 150; ++i) {  // up to 3 s for a clean exit
    bool all = true;
    for (Child& c : *children) {
      if (c.pid > 0 && waitpid(c.pid, nullptr, WNOHANG) == c.pid) c.pid = -1;
      all = all && c.pid <= 0;
    }
    if (all) return;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  for (Child& c : *children) {
    if (c.pid > 0) {
      kill(c.pid, SIGKILL);
      waitpid(c.pid, nullptr, 0);
      c.pid = -1;
    }
  }
}

bool Serving(const std::string& address, const TlsConfig& tls) {
  auto stub = grpc::health::v1::Health::NewStub(Channel(address, tls));
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::milliseconds(500));
  grpc::health::v1::HealthCheckRequest req;
  req.set_service("dxs.v1.Frontend");
  grpc::health::v1::HealthCheckResponse resp;
  return stub->Check(&ctx, req, &resp).ok() &&
         resp.status() == grpc::health::v1::HealthCheckResponse::SERVING;
}

// Every attention rank reports READY: the data path is up, not only registration.
bool AllRanksReady(const std::string& address, int num_attention, const TlsConfig& tls) {
  auto stub = v1::Frontend::NewStub(Channel(address, tls));
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(1));
  v1::GetLoadsResponse resp;
  if (!stub->GetLoads(&ctx, v1::GetLoadsRequest(), &resp).ok()) return false;
  int ready = 0;
  for (const v1::RankLoad& l : resp.loads()) ready += l.state() == v1::WORKER_STATE_READY;
  return ready == num_attention;
}

// `dxs up`'s device per worker: attention ranks 0..M-1, then expert ranks 0..N-1. Without
// `gpus` every worker gets `device`; with it (a list like "0,1", and device cuda) the
// workers go round the list in that order, so several may share a GPU.
absl::StatusOr<std::vector<std::string>> WorkerDevices(const std::string& device,
                                                       const std::string& gpus, int num_attention,
                                                       int num_experts) {
  if (absl::Status s = ValidateDeviceName(device); !s.ok()) return s;
  const int num_workers = num_attention + num_experts;
  if (gpus.empty()) return std::vector<std::string>(num_workers, device);
  if (device != "cuda") {
    return absl::InvalidArgumentError(absl::StrCat(
        "--gpus places workers on GPUs: it goes with --device cuda, not --device ", device));
  }
  std::vector<std::string> ids;
  for (absl::string_view id : absl::StrSplit(gpus, ',')) {
    int n = -1;
    if (!absl::SimpleAtoi(id, &n) || n < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("--gpus: '", id, "' is not a GPU number (expected a list like 0,1,2)"));
    }
    ids.push_back(absl::StrCat("cuda:", n));
  }
  std::vector<std::string> out;
  for (int w = 0; w < num_workers; ++w) out.push_back(ids[w % ids.size()]);
  return out;
}

// Log-probabilities in the engine's form; `token` comes from the token_ids beside them.
TokenLogprobs FromProto(const v1::TokenLogprobs& in, int32_t token) {
  TokenLogprobs out;
  out.token = token;
  out.logprob = in.logprob();
  for (const v1::TopLogprob& top : in.top_logprobs()) {
    out.top.push_back({static_cast<int32_t>(top.token_id()), top.logprob()});
  }
  out.named.assign(in.token_ids_logprobs().begin(), in.token_ids_logprobs().end());
  return out;
}

}  // namespace

int UpCommand(const std::vector<std::string>& argv) {
  absl::StatusOr<Args> args = Args::Parse(argv,
                                          WithTlsValueFlags({"model",
                                                             "attention",
                                                             "experts",
                                                             "port",
                                                             "log-dir",
                                                             "wire-dtype",
                                                             "overlap-min-tokens",
                                                             "stream-interval",
                                                             "device",
                                                             "gpus",
                                                             "num-redundant-experts",
                                                             "eplb-interval",
                                                             "piecewise-graphs",
                                                             "mapped-exchange",
                                                             "overlap-schedule",
                                                             "transport",
                                                             "low-latency-capacity",
                                                             "gateway-port",
                                                             "gateway-metrics-port",
                                                             "smg",
                                                             "served-model-name"}),
                                          WithTlsBoolFlags({"elastic-ep"}));
  if (!args.ok()) return Fail("up", args.status());
  const bool elastic_ep = args->Has("elastic-ep");
  // With TLS, every process of the cluster uses the same files (one certificate that is
  // both server and cluster client).
  absl::StatusOr<TlsConfig> tls = TlsFromArgs(*args, /*for_server=*/true);
  if (!tls.ok()) return Fail("up", tls.status());
  const std::vector<std::string> tls_argv = dxs::flags::TlsArgv(*tls);
  auto m = args->GetInt("attention", 1);
  auto n = args->GetInt("experts", 2);
  auto port = args->GetInt("port", 50051);
  auto gateway_port = args->GetInt("gateway-port", 0);
  auto gateway_metrics_port = args->GetInt("gateway-metrics-port", 0);
  for (const absl::Status& s : {m.status(), n.status(), port.status(), gateway_port.status(),
                                gateway_metrics_port.status()}) {
    if (!s.ok()) return Fail("up", s);
  }
  if (*m < 1 || *n < 1) {
    return Fail("up", absl::InvalidArgumentError("--attention and --experts must be >= 1"));
  }
  std::string model = args->GetString("model");
  if (model.empty()) {
    absl::StatusOr<std::string> dir = EnsureDefaultModel();
    if (!dir.ok()) return Fail("up", dir.status());
    model = *dir;
  }
  // The router reports the directory to the gateway, which reads the tokenizer from it.
  model = std::filesystem::absolute(model).lexically_normal().string();
  const bool with_gateway = args->Has("gateway-port");
  std::string smg;
  if (with_gateway) {
    if (*gateway_port < 1 || *gateway_port > 65535) {
      return Fail("up", absl::InvalidArgumentError("--gateway-port must be in 1..65535"));
    }
    if (*gateway_metrics_port < 0 || *gateway_metrics_port > 65535) {
      return Fail("up", absl::InvalidArgumentError("--gateway-metrics-port must be in 0..65535"));
    }
    if (tls->enabled()) {
      // smg 1.13 dials its workers in plaintext whatever its TLS flags say (docs/gateway.md).
      return Fail("up", absl::InvalidArgumentError(
                            "--gateway-port: the SMG gateway cannot reach a TLS router; start "
                            "the cluster without --tls-* to front it with the gateway"));
    }
    absl::StatusOr<std::string> found = FindSmg(args->GetString("smg"), ExecutableDir());
    if (!found.ok()) return Fail("up", found.status());
    smg = *found;
  }
  std::filesystem::path model_path(model);
  if (!model_path.has_filename()) model_path = model_path.parent_path();
  const std::string served_model_name =
      args->GetString("served-model-name", model_path.filename().string());
  // Where each worker computes: attention ranks 0..M-1, then expert ranks 0..N-1, one
  // device string each. --gpus 0,1 places them on those GPUs in turn (several may share
  // one: on one GPU they time-slice it).
  absl::StatusOr<std::vector<std::string>> devices =
      WorkerDevices(args->GetString("device", args->Has("gpus") ? "cuda" : "cpu"),
                    args->GetString("gpus"), static_cast<int>(*m), static_cast<int>(*n));
  if (!devices.ok()) return Fail("up", devices.status());
  // The data path's transport, the router's and every worker's (worker/worker_transport.h):
  // nccl needs every worker on a GPU.
  const std::string transport = args->GetString("transport", "ucx");
  for (const std::string& device : *devices) {
    if (absl::Status s = ValidateWorkerTransport(transport, device); !s.ok()) return Fail("up", s);
  }
  const std::string log_dir = args->GetString("log-dir", "dxs-logs");
  std::filesystem::create_directories(log_dir);
  const std::string bin = ExecutableDir();  // the service binaries sit beside dxs
  const std::string router = absl::StrCat("127.0.0.1:", *port);
  std::signal(SIGINT, OnStopSignal);
  std::signal(SIGTERM, OnStopSignal);

  std::vector<Child> children;
  auto spawn = [&](std::vector<std::string> a, const std::string& name,
                   bool restart_on_failure = false) -> bool {
    a.insert(a.end(), tls_argv.begin(), tls_argv.end());
    absl::StatusOr<Child> c = Spawn(a, name, log_dir + "/" + name + ".log");
    if (!c.ok()) {
      Fail("up", c.status());
      return false;
    }
    c->restart_on_failure = restart_on_failure;
    children.push_back(*c);
    return true;
  };
  std::vector<std::string> router_argv = {bin + "/dxs-router",
                                          "--listen",
                                          router,
                                          "--model",
                                          model,
                                          "--attention",
                                          std::to_string(*m),
                                          "--experts",
                                          std::to_string(*n),
                                          "--wire-dtype",
                                          args->GetString("wire-dtype", "f32"),
                                          "--transport",
                                          transport,
                                          "--served-model-name",
                                          served_model_name};
  if (args->Has("num-redundant-experts")) {
    router_argv.insert(router_argv.end(),
                       {"--num-redundant-experts", args->GetString("num-redundant-experts")});
  }
  if (args->Has("eplb-interval")) {
    router_argv.insert(router_argv.end(),
                       {"--enable-eplb", "--eplb-interval", args->GetString("eplb-interval")});
  }
  if (elastic_ep) router_argv.push_back("--elastic-ep");
  bool ok = spawn(router_argv, "router");
  for (int r = 0; ok && r < *n; ++r) {
    ok = spawn({bin + "/dxs-expert", "--model", model, "--rank", std::to_string(r), "--router",
                router, "--device", (*devices)[*m + r], "--transport", transport},
               absl::StrCat("expert", r), /*restart_on_failure=*/elastic_ep);
  }
  for (int r = 0; ok && r < *m; ++r) {
    std::vector<std::string> a = {bin + "/dxs-attention", "--model",     model,    "--rank",
                                  std::to_string(r),      "--router",    router,   "--device",
                                  (*devices)[r],          "--transport", transport};
    for (const char* flag : {"overlap-min-tokens", "stream-interval", "low-latency-capacity"}) {
      if (args->Has(flag)) a.insert(a.end(), {absl::StrCat("--", flag), args->GetString(flag)});
    }
    // Booleans: the value in the same argument.
    for (const char* flag : {"piecewise-graphs", "mapped-exchange", "overlap-schedule"}) {
      if (args->Has(flag)) a.push_back(absl::StrCat("--", flag, "=", args->GetString(flag)));
    }
    ok = spawn(a, absl::StrCat("attention", r));
  }
  // Healthy: the router serves (every rank registered, every expert placed) and every DP
  // rank's data path is up.
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(120);
  bool healthy = false;
  while (ok && !g_stop && std::chrono::steady_clock::now() < deadline) {
    for (Child& c : children) {
      if (c.pid > 0 && waitpid(c.pid, nullptr, WNOHANG) == c.pid) {
        std::cerr << "dxs up: " << c.name << " exited; see " << log_dir << "/" << c.name
                  << ".log\n";
        c.pid = -1;
        ok = false;
      }
    }
    if (ok && Serving(router, *tls) && AllRanksReady(router, static_cast<int>(*m), *tls)) {
      healthy = true;
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  if (!healthy) {
    StopAll(&children);
    if (g_stop) return 0;
    std::cerr << "dxs up: the cluster did not become healthy; logs in " << log_dir << "\n";
    return 1;
  }
  std::cout << "dxs up: listening on " << router << " (" << *m << " attention, " << *n
            << " expert ranks; model " << model << "; logs in " << log_dir << ")" << std::endl;
  if (with_gateway) {
    // The gateway fronts the router once it serves, so it registers it at once. Tokenizer
    // files come from the model directory, never from the Hugging Face hub.
    setenv("HF_HUB_OFFLINE", "1", /*overwrite=*/0);
    const int metrics_port = *gateway_metrics_port != 0 ? static_cast<int>(*gateway_metrics_port)
                                                        : static_cast<int>(*gateway_port) + 1;
    if (!spawn(GatewayArgv(smg, router, "127.0.0.1", static_cast<int>(*gateway_port), metrics_port),
               "gateway")) {
      StopAll(&children);
      return 1;
    }
    const pid_t gateway_pid = children.back().pid;
    const absl::Status up =
        WaitForGateway(static_cast<int>(*gateway_port), served_model_name, absl::Seconds(120),
                       [&] { return !g_stop && waitpid(gateway_pid, nullptr, WNOHANG) == 0; });
    if (!up.ok()) {
      StopAll(&children);
      if (g_stop) return 0;
      std::cerr << "dxs up: " << up.message() << "; see " << log_dir << "/gateway.log\n";
      return 1;
    }
    std::cout << "dxs up: gateway (OpenAI API) on http://127.0.0.1:" << *gateway_port
              << "/v1, model \"" << served_model_name << "\", metrics on 127.0.0.1:" << metrics_port
              << std::endl;
  }
  // With --elastic-ep an expert worker that dies (a signal or a failing exit) is started
  // again, as a Kubernetes Deployment would: meanwhile the router serves from the replicas
  // or reloads its experts elsewhere, and the new process rejoins as the same rank once the
  // router has marked the old one dead (until then its registration is refused and it
  // exits, so it is retried every second). One that exits 0 drained (`dxs drain`) and stays
  // gone.
  constexpr auto kRestartDelay = std::chrono::seconds(1);
  while (!g_stop) {
    const auto now = std::chrono::steady_clock::now();
    for (Child& c : children) {
      int status = 0;
      if (c.pid > 0 && waitpid(c.pid, &status, WNOHANG) == c.pid) {
        c.pid = -1;
        const bool failed = WIFSIGNALED(status) || WEXITSTATUS(status) != 0;
        if (c.restart_on_failure && failed) {
          std::cerr << "dxs up: " << c.name << " exited (" << DescribeExit(status)
                    << "); starting it again (elastic EP)\n";
          c.restart_at = now + kRestartDelay;
        } else {
          std::cerr << "dxs up: " << c.name << " exited (" << DescribeExit(status) << ")"
                    << (c.restart_on_failure ? ": drained, not restarted" : "") << "\n";
          c.restart_on_failure = false;
        }
      }
      if (c.pid < 0 && c.restart_on_failure && now >= c.restart_at) {
        absl::StatusOr<Child> again = Spawn(c.argv, c.name, c.log_path, /*append=*/true);
        if (again.ok()) {
          c.pid = again->pid;
        } else {
          std::cerr << "dxs up: starting " << c.name << " again: " << again.status() << "\n";
          c.restart_at = now + kRestartDelay;
        }
      }
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  StopAll(&children);
  std::cout << "dxs up: stopped" << std::endl;
  return 0;
}

int GenerateCommand(const std::vector<std::string>& argv) {
  absl::StatusOr<Args> args = Args::Parse(
      argv,
      WithTlsValueFlags(
          SamplingValueFlags({"router", "prompt-ids", "max-new-tokens", "temperature", "top-p",
                              "top-k", "seed", "stop-ids", "dp-rank", "format", "request-id"})),
      WithTlsBoolFlags(SamplingBoolFlags({"ignore-eos"})));
  if (!args.ok()) return Fail("generate", args.status());
  absl::StatusOr<TlsConfig> tls = TlsFromArgs(*args, /*for_server=*/false);
  if (!tls.ok()) return Fail("generate", tls.status());
  if (absl::Status s = args->Require({"router", "prompt-ids"}); !s.ok()) return Fail("generate", s);
  auto prompt = args->GetIntList("prompt-ids");
  auto max_new = args->GetInt("max-new-tokens", 16);
  auto temperature = args->GetDouble("temperature", 0.0);
  auto top_p = args->GetDouble("top-p", 1.0);
  auto top_k = args->GetInt("top-k", 0);
  auto seed = args->GetUint("seed", 0);
  auto stop = args->GetIntList("stop-ids");
  auto dp = args->GetInt("dp-rank", -1);
  for (const absl::Status& s :
       {prompt.status(), max_new.status(), temperature.status(), top_p.status(), top_k.status(),
        seed.status(), stop.status(), dp.status()}) {
    if (!s.ok()) return Fail("generate", s);
  }
  const std::string format = args->GetString("format", "text");
  if (format != "text" && format != "json") {
    return Fail("generate", absl::InvalidArgumentError("--format must be json or text"));
  }
  // The sampling features, read as `dxs run` reads them; the router checks their ranges.
  GenerationRequest features;
  features.prompt = *prompt;
  if (absl::Status s = ReadSamplingFlags(*args, format, &features); !s.ok()) {
    return Fail("generate", s);
  }
  v1::GenerateRequest req;
  req.set_request_id(args->GetString("request-id"));
  for (int32_t t : *prompt) req.add_prompt_token_ids(static_cast<uint32_t>(t));
  v1::SamplingParams* p = req.mutable_sampling_params();
  p->set_max_new_tokens(static_cast<int32_t>(*max_new));
  p->set_temperature(static_cast<float>(*temperature));
  p->set_top_p(static_cast<float>(*top_p));
  p->set_top_k(static_cast<int32_t>(*top_k));
  if (args->Has("seed")) p->set_seed(*seed);
  for (int32_t t : *stop) p->add_stop_token_ids(static_cast<uint32_t>(t));
  p->set_ignore_eos(args->Has("ignore-eos"));
  const SamplingParams& fs = features.sampling;
  if (args->Has("min-p")) p->set_min_p(fs.min_p);
  p->set_frequency_penalty(fs.frequency_penalty);
  p->set_presence_penalty(fs.presence_penalty);
  if (args->Has("repetition-penalty")) p->set_repetition_penalty(fs.repetition_penalty);
  for (const auto& [id, bias] : fs.logit_bias) {
    (*p->mutable_logit_bias())[static_cast<uint32_t>(id)] = bias;
  }
  p->set_min_new_tokens(static_cast<uint32_t>(features.min_new_tokens));
  p->set_logprobs(features.logprobs);
  p->set_top_logprobs(static_cast<uint32_t>(features.top_logprobs));
  for (int32_t id : features.logprob_token_ids) {
    p->add_logprob_token_ids(static_cast<uint32_t>(id));
  }
  if (features.prompt_logprobs_start >= 0) {
    p->set_prompt_logprobs_start(static_cast<uint32_t>(features.prompt_logprobs_start));
  }
  if (args->Has("n")) p->set_n(static_cast<uint32_t>(features.n));
  if (*dp >= 0) req.set_data_parallel_rank(static_cast<uint32_t>(*dp));

  auto stub = v1::Frontend::NewStub(Channel(args->GetString("router"), *tls));
  grpc::ClientContext ctx;
  auto reader = stub->Generate(&ctx, req);
  v1::GenerateResponse resp;
  // Per sample (TokenChunk.sample_index; one with --n 1): its tokens and, in the engine's
  // form so that the JSON is `dxs run`'s, its log-probabilities.
  // (More than kMaxSamples the router refuses.)
  const size_t num_samples = static_cast<size_t>(std::clamp(features.n, 1, kMaxSamples));
  std::vector<std::vector<int32_t>> tokens(num_samples);
  std::vector<std::vector<TokenLogprobs>> logprobs(num_samples);
  std::optional<PromptLogprobs> prompt_logprobs;
  v1::GenerateComplete complete;
  std::string request_id;
  // With one sample, text output streams the tokens as they come; with more it prints a
  // line per sample at the end.
  const bool stream_text = format == "text" && num_samples == 1;
  while (reader->Read(&resp)) {
    request_id = resp.request_id();
    if (resp.has_chunk()) {
      const v1::TokenChunk& chunk = resp.chunk();
      if (chunk.sample_index() >= num_samples) continue;  // not asked for
      std::vector<int32_t>& sample_tokens = tokens[chunk.sample_index()];
      for (uint32_t t : chunk.token_ids()) {
        sample_tokens.push_back(static_cast<int32_t>(t));
        if (stream_text) std::cout << (sample_tokens.size() > 1 ? " " : "") << t << std::flush;
      }
      for (int i = 0; i < chunk.logprobs_size(); ++i) {
        const int32_t token =
            i < chunk.token_ids_size() ? static_cast<int32_t>(chunk.token_ids(i)) : -1;
        logprobs[chunk.sample_index()].push_back(FromProto(chunk.logprobs(i), token));
      }
      if (chunk.has_prompt_logprobs()) {
        const v1::PromptLogprobs& in = chunk.prompt_logprobs();
        PromptLogprobs& out = prompt_logprobs.emplace();
        out.first_position = in.first_position();
        for (int i = 0; i < in.positions_size(); ++i) {
          const int32_t token =
              i < in.token_ids_size() ? static_cast<int32_t>(in.token_ids(i)) : -1;
          out.positions.push_back(FromProto(in.positions(i), token));
        }
        out.next = FromProto(in.next(), -1);
      }
    } else if (resp.has_complete()) {
      complete = resp.complete();
    }
  }
  grpc::Status s = reader->Finish();
  if (stream_text && !tokens[0].empty()) std::cout << "\n";
  if (!s.ok()) return FailRpc("generate", s);
  auto reason_name = [](v1::FinishReason r) {
    std::string reason = v1::FinishReason_Name(r);
    if (reason.rfind("FINISH_REASON_", 0) == 0) reason = reason.substr(14);
    for (char& c : reason) c = static_cast<char>(std::tolower(c));
    return reason;
  };
  const std::string reason = reason_name(complete.finish_reason());
  // Sample i's end: the top level for sample 0, GenerateComplete.samples for the others.
  std::vector<std::string> reasons(num_samples, reason);
  std::vector<uint32_t> completion_tokens(num_samples, complete.completion_tokens());
  for (const v1::SampleComplete& sample : complete.samples()) {
    if (sample.sample_index() == 0 || sample.sample_index() >= num_samples) continue;
    reasons[sample.sample_index()] = reason_name(sample.finish_reason());
    completion_tokens[sample.sample_index()] = sample.completion_tokens();
  }
  if (format == "json") {
    nlohmann::json out;
    out["tokens"] = tokens[0];
    out["finish_reason"] = reason;
    out["request_id"] = request_id;
    out["prompt_tokens"] = complete.prompt_tokens();
    out["completion_tokens"] = complete.completion_tokens();
    out["data_parallel_rank"] = complete.data_parallel_rank();
    AddLogprobsJson(features, logprobs[0], prompt_logprobs, &out);
    if (num_samples > 1) {
      nlohmann::json list = nlohmann::json::array();
      for (size_t i = 0; i < num_samples; ++i) {
        nlohmann::json sample = SampleJson(features, tokens[i], reasons[i], logprobs[i]);
        sample["completion_tokens"] = completion_tokens[i];
        list.push_back(std::move(sample));
      }
      out["samples"] = list;
    }
    std::cout << out.dump() << "\n";
  } else if (stream_text) {
    std::cerr << "finish_reason: " << reason << "\n";
  } else {
    for (const std::vector<int32_t>& sample_tokens : tokens) {
      std::cout << absl::StrJoin(sample_tokens, " ") << "\n";
    }
    std::cerr << "finish_reason: " << absl::StrJoin(reasons, " ") << "\n";
  }
  return 0;
}

namespace {

// A dtype as config.json spells it.
std::string DTypeName(v1::DType d) {
  switch (d) {
    case v1::DTYPE_FLOAT32:
      return "float32";
    case v1::DTYPE_BFLOAT16:
      return "bfloat16";
    case v1::DTYPE_FLOAT16:
      return "float16";
    case v1::DTYPE_FLOAT8_E4M3:
      return "float8_e4m3";
    default:
      return "unspecified";
  }
}

}  // namespace

int StatusCommand(const std::vector<std::string>& argv) {
  absl::StatusOr<Args> args =
      Args::Parse(argv, WithTlsValueFlags({"router", "format"}), WithTlsBoolFlags({}));
  if (!args.ok()) return Fail("status", args.status());
  absl::StatusOr<TlsConfig> tls = TlsFromArgs(*args, /*for_server=*/false);
  if (!tls.ok()) return Fail("status", tls.status());
  if (absl::Status s = args->Require({"router"}); !s.ok()) return Fail("status", s);
  const std::string router = args->GetString("router");
  // The cluster view: one read of the control plane's watch stream, as an observer.
  auto cp = v1::ControlPlane::NewStub(Channel(router, *tls));
  grpc::ClientContext watch_ctx;
  watch_ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
  auto reader = cp->WatchCluster(&watch_ctx, v1::WatchClusterRequest());
  v1::ClusterView view;
  if (!reader->Read(&view)) return FailRpc("status", reader->Finish());
  watch_ctx.TryCancel();
  (void)reader->Finish();
  auto fe = v1::Frontend::NewStub(Channel(router, *tls));
  grpc::ClientContext loads_ctx;
  loads_ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
  v1::GetLoadsResponse loads;
  grpc::Status ls = fe->GetLoads(&loads_ctx, v1::GetLoadsRequest(), &loads);
  grpc::ClientContext model_ctx;
  model_ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
  v1::GetModelInfoResponse model;
  grpc::Status ms = fe->GetModelInfo(&model_ctx, v1::GetModelInfoRequest(), &model);
  const v1::ModelInfo& info = model.model_info();

  auto role = [](v1::Role r) { return r == v1::ROLE_ATTENTION ? "attention" : "expert"; };
  auto state = [](v1::WorkerState s) {
    std::string n = v1::WorkerState_Name(s);
    return n.rfind("WORKER_STATE_", 0) == 0 ? n.substr(13) : n;
  };
  if (args->GetString("format", "text") == "json") {
    nlohmann::json out;
    out["cluster_view_version"] = view.version();
    out["workers"] = nlohmann::json::array();
    for (const v1::WorkerInfo& w : view.workers()) {
      out["workers"].push_back({{"role", role(w.role())},
                                {"rank", w.rank()},
                                {"state", state(w.state())},
                                {"incarnation", w.incarnation()},
                                {"grpc_address", w.grpc_address()},
                                {"metrics_address", w.metrics_address()}});
    }
    out["loads"] = nlohmann::json::array();
    for (const v1::RankLoad& l : loads.loads()) {
      out["loads"].push_back({{"rank", l.rank()},
                              {"running", l.num_running_requests()},
                              {"queued", l.num_queued_requests()},
                              {"kv_cache_used_tokens", l.kv_cache_used_tokens()},
                              {"kv_cache_total_tokens", l.kv_cache_total_tokens()},
                              {"tokens_per_second", l.tokens_per_second()},
                              {"outstanding_tokens", l.num_outstanding_tokens()}});
    }
    if (!ls.ok()) out["loads_error"] = ls.error_message();
    if (ms.ok()) {
      out["model"] = {{"name", info.model_name()},
                      {"path", info.model_path()},
                      {"dtype", DTypeName(info.dtype())},
                      {"checkpoint_dtype", DTypeName(info.checkpoint_dtype())},
                      {"wire_dtype", DTypeName(info.wire_dtype())}};
    } else {
      out["model_error"] = ms.error_message();
    }
    out["placement_version"] = view.placement().version();
    out["elastic_ep"] = view.elastic_ep();
    nlohmann::json per_rank = nlohmann::json::array();
    for (uint32_t r = 0; r < view.num_expert_ranks(); ++r) {
      nlohmann::json experts = nlohmann::json::array();
      for (int e = 0; e < view.placement().expert_to_rank_size(); ++e) {
        for (uint32_t holder : view.placement().expert_to_rank(e).ep_ranks()) {
          if (holder == r) experts.push_back(e);
        }
      }
      per_rank.push_back({{"rank", r}, {"experts", experts}});
    }
    out["placement"] = per_rank;
    std::cout << out.dump() << "\n";
    return 0;
  }
  std::cout << "cluster view v" << view.version() << ": " << view.num_attention_ranks()
            << " attention, " << view.num_expert_ranks() << " expert ranks\n";
  for (const v1::WorkerInfo& w : view.workers()) {
    std::cout << "  " << role(w.role()) << " " << w.rank() << "  " << state(w.state()) << "  grpc "
              << w.grpc_address() << "  metrics "
              << (w.metrics_address().empty() ? "-" : w.metrics_address()) << "\n";
  }
  for (const v1::RankLoad& l : loads.loads()) {
    std::cout << "  dp " << l.rank() << ": running " << l.num_running_requests() << ", queued "
              << l.num_queued_requests() << ", kv " << l.kv_cache_used_tokens() << "/"
              << l.kv_cache_total_tokens() << " tokens\n";
  }
  if (!ls.ok()) std::cout << "  (loads unavailable: " << ls.error_message() << ")\n";
  if (ms.ok()) {
    std::cout << "model " << info.model_name() << ": served in " << DTypeName(info.dtype())
              << " (checkpoint " << DTypeName(info.checkpoint_dtype()) << "), wire "
              << DTypeName(info.wire_dtype()) << "\n";
  } else {
    std::cout << "  (model unavailable: " << ms.error_message() << ")\n";
  }
  // The placement: per EP rank the experts it holds, replicas (experts held elsewhere too)
  // marked with '*'.
  const v1::ExpertPlacement& p = view.placement();
  std::cout << "placement v" << p.version() << "\n";
  for (uint32_t r = 0; r < view.num_expert_ranks(); ++r) {
    std::vector<std::string> held;
    for (int e = 0; e < p.expert_to_rank_size(); ++e) {
      for (uint32_t holder : p.expert_to_rank(e).ep_ranks()) {
        if (holder != r) continue;
        held.push_back(absl::StrCat(e, p.expert_to_rank(e).ep_ranks_size() > 1 ? "*" : ""));
      }
    }
    std::cout << "  ep " << r << ": " << held.size() << " experts [" << absl::StrJoin(held, ",")
              << "]\n";
  }
  return 0;
}

int RebalanceCommand(const std::vector<std::string>& argv) {
  absl::StatusOr<Args> args =
      Args::Parse(argv, WithTlsValueFlags({"router"}), WithTlsBoolFlags({}));
  if (!args.ok()) return Fail("rebalance", args.status());
  absl::StatusOr<TlsConfig> tls = TlsFromArgs(*args, /*for_server=*/false);
  if (!tls.ok()) return Fail("rebalance", tls.status());
  if (absl::Status s = args->Require({"router"}); !s.ok()) return Fail("rebalance", s);
  auto cp = v1::ControlPlane::NewStub(Channel(args->GetString("router"), *tls));
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(300));
  v1::RebalanceResponse response;
  grpc::Status s = cp->Rebalance(&ctx, v1::RebalanceRequest(), &response);
  if (!s.ok()) return FailRpc("rebalance", s);
  std::cout << "placement v" << response.placement_version() << ": " << response.experts_moved()
            << " expert copies moved, balance ratio "
            << absl::StrFormat("%.3f -> %.3f", response.balance_ratio_before(),
                               response.balance_ratio_after())
            << "\n";
  return 0;
}

int DrainCommand(const std::vector<std::string>& argv) {
  absl::StatusOr<Args> args =
      Args::Parse(argv, WithTlsValueFlags({"router", "rank", "role"}), WithTlsBoolFlags({}));
  if (!args.ok()) return Fail("drain", args.status());
  absl::StatusOr<TlsConfig> tls = TlsFromArgs(*args, /*for_server=*/false);
  if (!tls.ok()) return Fail("drain", tls.status());
  if (absl::Status s = args->Require({"router", "rank"}); !s.ok()) return Fail("drain", s);
  int rank = -1;
  if (!absl::SimpleAtoi(args->GetString("rank"), &rank) || rank < 0) {
    return Fail("drain", absl::InvalidArgumentError(absl::StrCat(
                             "--rank must be a rank number, got '", args->GetString("rank"), "'")));
  }
  const std::string role = args->Has("role") ? args->GetString("role") : "expert";
  if (role != "expert" && role != "attention") {
    return Fail("drain", absl::InvalidArgumentError(
                             absl::StrCat("--role must be expert or attention, got '", role, "'")));
  }
  auto cp = v1::ControlPlane::NewStub(Channel(args->GetString("router"), *tls));
  v1::DrainRequest request;
  request.mutable_worker()->set_role(role == "expert" ? v1::ROLE_EXPERT : v1::ROLE_ATTENTION);
  request.mutable_worker()->set_rank(static_cast<uint32_t>(rank));
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
  v1::DrainResponse response;
  grpc::Status s = cp->Drain(&ctx, request, &response);
  if (!s.ok()) return FailRpc("drain", s);
  std::cout << role << " rank " << rank << " draining (view v" << response.cluster_view_version()
            << ")\n";
  return 0;
}

}  // namespace dxs::cli
