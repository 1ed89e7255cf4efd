#include "tests/disagg/process_cluster.h"

#include <fcntl.h>
#include <grpcpp/grpcpp.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <regex>
#include <sstream>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"

namespace dxs::testing {

std::string ReadFile(const std::string& path) {
  std::ifstream f(path);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

std::string AddressAfter(const std::string& path, const std::string& marker) {
  const std::string text = ReadFile(path);
  const size_t at = text.find(marker);
  if (at == std::string::npos) return "";
  std::smatch m;
  const std::string rest = text.substr(at + marker.size());
  if (std::regex_search(rest, m, std::regex(R"(([0-9.]+|\[[0-9a-f:]+\]|localhost):[0-9]+)"))) {
    return m.str(0);
  }
  return "";
}

absl::StatusOr<ChildProcess> SpawnAndWait(const std::vector<std::string>& argv,
                                          const std::string& name, const std::string& log_path,
                                          const std::string& ready_text, absl::Duration timeout) {
  ChildProcess p;
  p.name = name;
  p.log_path = log_path;
  p.pid = fork();
  if (p.pid < 0) return absl::InternalError("fork failed");
  if (p.pid == 0) {
    const int fd = open(log_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    dup2(fd, 1);
    dup2(fd, 2);
    std::vector<char*> args;
    for (const std::string& a : argv) args.push_back(const_cast<char*>(a.c_str()));
    args.push_back(nullptr);
    execv(args[0], args.data());
    _exit(127);
  }
  const absl::Time deadline = absl::Now() + timeout;
  while (absl::Now() < deadline) {
    if (ReadFile(log_path).find(ready_text) != std::string::npos) return p;
    int status;
    if (waitpid(p.pid, &status, WNOHANG) == p.pid) {
      p.pid = -1;
      // It may have printed what we wait for and exited (a refused worker).
      if (ReadFile(log_path).find(ready_text) != std::string::npos) return p;
      return absl::FailedPreconditionError(
          absl::StrCat(name, " exited (status ", status, "): ", ReadFile(log_path)));
    }
    absl::SleepFor(absl::Milliseconds(20));
  }
  Terminate(&p);
  return absl::DeadlineExceededError(
      absl::StrCat(name, " did not print '", ready_text, "': ", ReadFile(log_path)));
}

void Terminate(ChildProcess* p) {
  if (p->pid <= 0) return;
  kill(p->pid, SIGTERM);
  for (int i = 0; i < 100; ++i) {
    if (waitpid(p->pid, nullptr, WNOHANG) == p->pid) {
      p->pid = -1;
      return;
    }
    absl::SleepFor(absl::Milliseconds(20));
  }
  kill(p->pid, SIGKILL);
  waitpid(p->pid, nullptr, 0);
  p->pid = -1;
}

std::string ProcessCluster::logits_dir() const { return work_dir_; }

std::vector<float> ProcessCluster::FirstLogits(const std::string& request_id) const {
  const std::string bytes = ReadFile(logits_dir() + "/" + request_id + ".f32");
  std::vector<float> out(bytes.size() / sizeof(float));
  std::memcpy(out.data(), bytes.data(), out.size() * sizeof(float));
  return out;
}

std::string ProcessCluster::bin(const std::string& name) const {
  const char* dir = std::getenv("DXS_BIN_DIR");
  return absl::StrCat(dir ? dir : DXS_TEST_BIN_DIR, "/", name);
}

ProcessCluster::~ProcessCluster() {
  for (auto& a : attention_) Terminate(&a);
  for (auto& [r, e] : experts_) Terminate(&e);
  for (auto& e : refused_) Terminate(&e);
  Terminate(&router_);
}

absl::Status ProcessCluster::Start(const ClusterSpec& spec, absl::Duration timeout) {
  if (absl::Status s = StartRouter(spec, timeout); !s.ok()) return s;
  return StartWorkers(spec, timeout);
}

absl::Status ProcessCluster::StartRouter(const ClusterSpec& spec, absl::Duration timeout) {
  std::vector<std::string> argv = {bin("dxs-router"),
                                   "--listen",
                                   "127.0.0.1:0",
                                   "--attention",
                                   std::to_string(spec.num_attention),
                                   "--experts",
                                   std::to_string(spec.num_expert),
                                   "--model",
                                   spec.model_dir,
                                   "--wire-dtype",
                                   spec.wire_dtype,
                                   "--lease-ms",
                                   "2000",
                                   "--heartbeat-ms",
                                   "200"};
  argv.insert(argv.end(), router_args_.begin(), router_args_.end());
  argv.insert(argv.end(), common_args_.begin(), common_args_.end());
  absl::StatusOr<ChildProcess> router =
      SpawnAndWait(argv, "router", work_dir_ + "/router.log", "listening on", timeout);
  if (!router.ok()) return router.status();
  router_ = *router;
  router_address_ = AddressAfter(router_.log_path, "listening on");
  router_metrics_address_ = AddressAfter(router_.log_path, "metrics on");
  frontend_ = v1::Frontend::NewStub(grpc::CreateChannel(router_address_, credentials_));
  return absl::OkStatus();
}

absl::Status ProcessCluster::StartWorkers(const ClusterSpec& spec, absl::Duration timeout) {
  for (int r = 0; r < spec.num_expert; ++r) {
    const std::string claim =
        r < static_cast<int>(spec.expert_claims.size()) ? spec.expert_claims[r] : "";
    if (absl::Status s = StartExpert(r, spec.model_dir, claim); !s.ok()) return s;
  }
  for (int r = 0; r < spec.num_attention; ++r) {
    std::vector<std::string> argv = {
        bin("dxs-attention"), "--model",       spec.model_dir, "--rank",      std::to_string(r),
        "--router",           router_address_, "--listen",     "127.0.0.1:0", "--dump-first-logits",
        logits_dir()};
    argv.insert(argv.end(), spec.attention_args.begin(), spec.attention_args.end());
    argv.insert(argv.end(), worker_args_.begin(), worker_args_.end());
    argv.insert(argv.end(), common_args_.begin(), common_args_.end());
    absl::StatusOr<ChildProcess> a =
        SpawnAndWait(argv, absl::StrCat("attention ", r),
                     absl::StrCat(work_dir_, "/attention", r, ".log"), "listening on", timeout);
    if (!a.ok()) return a.status();
    attention_.push_back(*a);
    stubs_.push_back(v1::AttentionWorker::NewStub(
        grpc::CreateChannel(AddressAfter(a->log_path, "listening on"), credentials_)));
  }
  return WaitReady(timeout);
}

absl::Status ProcessCluster::StartExpert(int rank, const std::string& model_dir,
                                         const std::string& claim, const std::string& ready_text) {
  // A restarted expert comes back on its old address, as a StatefulSet pod would.
  auto old = expert_addresses_.find(rank);
  const bool replacing = ready_text == "listening on";
  const bool same_address = replacing && old != expert_addresses_.end();
  const auto spawn = [&](const std::string& listen, int attempt) {
    std::vector<std::string> argv = {
        bin("dxs-expert"), "--model",       model_dir,  "--rank", std::to_string(rank),
        "--router",        router_address_, "--listen", listen};
    if (!claim.empty()) {
      argv.push_back("--experts");
      argv.push_back(claim);
    }
    argv.insert(argv.end(), worker_args_.begin(), worker_args_.end());
    argv.insert(argv.end(), common_args_.begin(), common_args_.end());
    return SpawnAndWait(
        argv, absl::StrCat("expert ", rank),
        absl::StrCat(work_dir_, "/expert", rank, "_", experts_.count(rank), "_", attempt, ".log"),
        ready_text, absl::Seconds(60));
  };
  absl::StatusOr<ChildProcess> e = spawn(same_address ? old->second : "127.0.0.1:0", 0);
  if (!e.ok() && same_address &&
      absl::StrContains(e.status().message(), "cannot listen on " + old->second)) {
    // Another process of this host took the old port while the expert was down (a pod's
    // address is its own; a test's ports are shared by everything on the machine). Only a
    // worker at the old address may replace a rank before its lease ends, so the
    // replacement takes a new port once the router has marked the old incarnation dead.
    if (absl::Status dead = WaitExpertDead(rank); !dead.ok()) return dead;
    e = spawn("127.0.0.1:0", 1);
  }
  if (!e.ok()) return e.status();
  if (!replacing) {  // an expected refusal: it has exited; keep its log for DumpLogs
    refused_.push_back(*e);
    return absl::OkStatus();
  }
  Terminate(&experts_[rank]);
  experts_[rank] = *e;
  expert_addresses_[rank] = AddressAfter(e->log_path, "listening on");
  return absl::OkStatus();
}

absl::Status ProcessCluster::WaitExpertDead(int rank, absl::Duration timeout) const {
  for (const absl::Time deadline = absl::Now() + timeout; absl::Now() < deadline;) {
    absl::StatusOr<v1::ClusterView> view = WatchClusterOnce();
    if (view.ok() && std::none_of(view->workers().begin(), view->workers().end(),
                                  [rank](const v1::WorkerInfo& w) {
                                    return w.role() == v1::ROLE_EXPERT &&
                                           static_cast<int>(w.rank()) == rank &&
                                           w.state() != v1::WORKER_STATE_DEAD;
                                  })) {
      return absl::OkStatus();
    }
    absl::SleepFor(absl::Milliseconds(20));
  }
  return absl::DeadlineExceededError(absl::StrCat("expert rank ", rank,
                                                  " still live in the router's view after ",
                                                  absl::FormatDuration(timeout)));
}

std::string ProcessCluster::attention_metrics_address(int rank) const {
  if (rank < 0 || rank >= static_cast<int>(attention_.size())) return "";
  return AddressAfter(attention_[rank].log_path, "metrics on");
}

std::string ProcessCluster::expert_metrics_address(int rank) const {
  auto it = experts_.find(rank);
  if (it == experts_.end() || it->second.pid <= 0) return "";
  return AddressAfter(it->second.log_path, "metrics on");
}

std::vector<std::string> ProcessCluster::metrics_addresses() const {
  std::vector<std::string> out;
  if (!router_metrics_address_.empty()) out.push_back(router_metrics_address_);
  for (int r = 0; r < static_cast<int>(attention_.size()); ++r) {
    out.push_back(attention_metrics_address(r));
  }
  for (const auto& [rank, e] : experts_) {
    if (e.pid > 0) out.push_back(expert_metrics_address(rank));
  }
  return out;
}

namespace {

void KillChild(ChildProcess& p) {
  if (p.pid > 0) {
    kill(p.pid, SIGKILL);
    waitpid(p.pid, nullptr, 0);
    p.pid = -1;
  }
}

}  // namespace

void ProcessCluster::KillAttention(int rank) { KillChild(attention_[rank]); }

void ProcessCluster::KillExpert(int rank) { KillChild(experts_[rank]); }

absl::StatusOr<int> ProcessCluster::WaitExpertExit(int rank, absl::Duration timeout) {
  ChildProcess& p = experts_[rank];
  const absl::Time deadline = absl::Now() + timeout;
  while (p.pid > 0) {
    int status = 0;
    if (waitpid(p.pid, &status, WNOHANG) == p.pid) {
      p.pid = -1;
      return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
    }
    if (absl::Now() > deadline) {
      return absl::DeadlineExceededError(absl::StrCat("expert rank ", rank, " still runs"));
    }
    absl::SleepFor(absl::Milliseconds(20));
  }
  return absl::FailedPreconditionError(absl::StrCat("expert rank ", rank, " is not running"));
}

absl::Status ProcessCluster::WaitReady(absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  for (size_t r = 0; r < stubs_.size(); ++r) {
    while (true) {
      grpc::ClientContext ctx;
      ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(2));
      v1::GetLoadResponse resp;
      grpc::Status s = stubs_[r]->GetLoad(&ctx, v1::GetLoadRequest(), &resp);
      if (s.ok() && resp.load().state() == v1::WORKER_STATE_READY) break;
      if (absl::Now() > deadline) {
        return absl::DeadlineExceededError(
            absl::StrCat("attention rank ", r, " not ready: ", DumpLogs()));
      }
      absl::SleepFor(absl::Milliseconds(50));
    }
  }
  return absl::OkStatus();
}

GenerateResult ProcessCluster::Generate(int rank, const std::string& request_id,
                                        const std::vector<int32_t>& prompt, int max_new_tokens,
                                        absl::Duration deadline,
                                        const std::function<void(size_t)>& on_tokens) {
  v1::GenerateRequest req;
  req.set_request_id(request_id);
  for (int32_t t : prompt) req.add_prompt_token_ids(static_cast<uint32_t>(t));
  req.mutable_sampling_params()->set_max_new_tokens(max_new_tokens);
  req.mutable_sampling_params()->set_temperature(0.f);
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() +
                   std::chrono::milliseconds(absl::ToInt64Milliseconds(deadline)));
  auto reader = stubs_[rank]->Generate(&ctx, req);
  GenerateResult out;
  v1::GenerateResponse resp;
  while (reader->Read(&resp)) {
    if (resp.has_chunk()) {
      for (uint32_t t : resp.chunk().token_ids()) out.tokens.push_back(static_cast<int32_t>(t));
      if (on_tokens) on_tokens(out.tokens.size());
    } else if (resp.has_complete()) {
      out.finish_reason = resp.complete().finish_reason();
    }
  }
  out.status = reader->Finish();
  return out;
}

std::string ProcessCluster::RunDxs(const std::string& args) const {
  std::string out;
  if (FILE* pipe = popen(absl::StrCat(bin("dxs"), " ", args, " 2>&1").c_str(), "r")) {
    char buf[4096];
    for (size_t n; (n = std::fread(buf, 1, sizeof(buf), pipe)) > 0;) out.append(buf, n);
    if (pclose(pipe) != 0) out = "exit status != 0: " + out;
  }
  return out;
}

std::string ProcessCluster::DumpLogs() const {
  std::string out = "\n--- router ---\n" + ReadFile(router_.log_path);
  for (const auto& a : attention_) out += "\n--- " + a.name + " ---\n" + ReadFile(a.log_path);
  for (const auto& [r, e] : experts_) out += "\n--- " + e.name + " ---\n" + ReadFile(e.log_path);
  for (const auto& e : refused_) out += "\n--- refused " + e.name + " ---\n" + ReadFile(e.log_path);
  return out;
}

absl::StatusOr<v1::ClusterView> ProcessCluster::WatchClusterOnce() const {
  auto cp = v1::ControlPlane::NewStub(grpc::CreateChannel(router_address_, credentials_));
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
  auto reader = cp->WatchCluster(&ctx, v1::WatchClusterRequest());
  v1::ClusterView view;
  const bool read = reader->Read(&view);
  ctx.TryCancel();
  (void)reader->Finish();
  if (!read) return absl::UnavailableError("WatchCluster sent no view");
  return view;
}

}  // namespace dxs::testing
