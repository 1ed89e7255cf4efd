// dxs-router as a process: prints its one "listening" line with the real port, accepts a
// worker whose fingerprint comes from the same ModelIdentity, refuses another checkpoint,
// says SERVING only once every worker reports READY, exits 0 on SIGTERM, and exits 2 with
// one line on stderr for bad flags.
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include "common/model_config.h"
#include "dxs/v1/control_plane.grpc.pb.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "grpcpp/create_channel.h"
#include "gtest/gtest.h"
#include "router/control_plane/model_identity.h"

namespace dxs {
namespace {

// How long the test waits for the router to do what it expects (a generous bound: every
// wait ends as soon as it has).
constexpr std::chrono::seconds kTimeout(30);

struct Child {
  pid_t pid = -1;
  int stdout_fd = -1;
  int stderr_fd = -1;
};

Child Spawn(const std::vector<std::string>& args) {
  int out[2], err[2];
  EXPECT_EQ(pipe(out), 0);
  EXPECT_EQ(pipe(err), 0);
  Child child;
  child.pid = fork();
  if (child.pid == 0) {
    dup2(out[1], STDOUT_FILENO);
    dup2(err[1], STDERR_FILENO);
    close(out[0]);
    close(err[0]);
    std::vector<char*> argv;
    for (const std::string& a : args) argv.push_back(const_cast<char*>(a.c_str()));
    argv.push_back(nullptr);
    execv(argv[0], argv.data());
    _exit(127);
  }
  close(out[1]);
  close(err[1]);
  child.stdout_fd = out[0];
  child.stderr_fd = err[0];
  return child;
}

// Reads up to the first newline (or EOF), for at most kTimeout: what it has by then.
std::string ReadLine(int fd) {
  const auto deadline = std::chrono::steady_clock::now() + kTimeout;
  std::string line;
  while (true) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
        deadline - std::chrono::steady_clock::now());
    if (left.count() <= 0) break;
    pollfd p{fd, POLLIN, 0};
    const int ready = poll(&p, 1, static_cast<int>(left.count()));
    if (ready < 0 && errno == EINTR) continue;
    if (ready <= 0) break;
    char c;
    if (read(fd, &c, 1) != 1 || c == '\n') break;
    line.push_back(c);
  }
  return line;
}

std::string ReadAll(int fd) {
  std::string all;
  char buf[4096];
  ssize_t n;
  while ((n = read(fd, buf, sizeof(buf))) > 0) all.append(buf, static_cast<size_t>(n));
  return all;
}

// Exit status after waiting at most `timeout`; -1 if it did not exit (then it is killed).
int WaitExit(pid_t pid, std::chrono::seconds timeout) {
  const auto end = std::chrono::steady_clock::now() + timeout;
  int status = 0;
  while (std::chrono::steady_clock::now() < end) {
    if (waitpid(pid, &status, WNOHANG) == pid) {
      return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  kill(pid, SIGKILL);
  waitpid(pid, &status, 0);
  return -1;
}

class RouterMainTest : public ::testing::Test {
 protected:
  void SetUp() override {
    model_dir_ =
        std::filesystem::path(::testing::TempDir()) / ("router_main_" + std::to_string(::getpid()));
    std::filesystem::create_directories(model_dir_);
    ModelConfig config;
    config.vocab_size = 64;
    config.hidden_size = 32;
    config.intermediate_size = 64;
    config.moe_intermediate_size = 16;
    config.num_hidden_layers = 2;
    config.num_attention_heads = 4;
    config.num_key_value_heads = 2;
    config.head_dim = 8;
    config.num_experts = 12;
    config.num_experts_per_tok = 2;
    config.max_position_embeddings = 128;
    ASSERT_TRUE(config.Validate().ok()) << config.Validate();
    num_experts_ = static_cast<int>(config.num_experts);
    std::ofstream(model_dir_ / "config.json") << config.ToJson() << "\n";
  }
  void TearDown() override { std::filesystem::remove_all(model_dir_); }

  std::filesystem::path model_dir_;
  int num_experts_ = 0;
};

TEST_F(RouterMainTest, ServesRegistersAndStopsOnSigterm) {
  Child router = Spawn({DXS_ROUTER_BIN, "--model", model_dir_.string(), "--attention", "1",
                        "--experts", "2", "--listen", "127.0.0.1:0", "--lease-ms", "2000"});
  const std::string line = ReadLine(router.stdout_fd);
  const std::string prefix = "dxs-router listening on 127.0.0.1:";
  ASSERT_EQ(line.rfind(prefix, 0), 0u) << "got: " << line;
  const int port = std::stoi(line.substr(prefix.size()));
  ASSERT_GT(port, 0);

  auto stub = v1::ControlPlane::NewStub(
      grpc::CreateChannel("127.0.0.1:" + std::to_string(port), grpc::InsecureChannelCredentials()));
  absl::StatusOr<v1::ModelFingerprint> fingerprint = ModelIdentity(model_dir_.string());
  ASSERT_TRUE(fingerprint.ok()) << fingerprint.status();
  v1::RegisterRequest request;
  request.set_role(v1::ROLE_EXPERT);
  request.set_grpc_address("127.0.0.1:9");
  request.mutable_transport()->set_ucx_worker_address("blob");
  *request.mutable_fingerprint() = *fingerprint;
  v1::RegisterResponse response;
  {
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
    grpc::Status s = stub->Register(&context, request, &response);
    ASSERT_TRUE(s.ok()) << s.error_message();
  }
  EXPECT_EQ(response.rank(), 0u);
  EXPECT_EQ(response.lease_timeout_ms(), 2000u);
  EXPECT_EQ(response.placement().num_experts(), static_cast<uint32_t>(num_experts_));
  EXPECT_EQ(response.placement().expert_to_rank(0).ep_ranks_size(), 1);
  EXPECT_EQ(response.placement().expert_to_rank(num_experts_ - 1).ep_ranks_size(), 0);

  request.set_grpc_address("127.0.0.1:10");
  request.mutable_fingerprint()->set_checkpoint_fingerprint("0000000000000000");
  {
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
    grpc::Status s = stub->Register(&context, request, &response);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
    EXPECT_NE(s.error_message().find("different checkpoint"), std::string::npos);
  }

  ASSERT_EQ(kill(router.pid, SIGTERM), 0);
  EXPECT_EQ(WaitExit(router.pid, kTimeout), 0);
  EXPECT_EQ(ReadAll(router.stdout_fd), "");  // exactly one line on stdout
  const std::string log = ReadAll(router.stderr_fd);
  EXPECT_NE(log.find("registered expert rank 0"), std::string::npos) << log;
  EXPECT_NE(log.find("refused expert worker at 127.0.0.1:10"), std::string::npos) << log;
  close(router.stdout_fd);
  close(router.stderr_fd);
}

// The router's health and its view agree: a cluster whose ranks have all registered is
// still NOT_SERVING while the view lists a worker JOINING (its step loop is not running
// yet), SERVING once every worker heartbeats READY, and NOT_SERVING again when one goes
// back to JOINING.
TEST_F(RouterMainTest, HealthIsServingOnlyWhenEveryWorkerIsReady) {
  Child router = Spawn({DXS_ROUTER_BIN, "--model", model_dir_.string(), "--attention", "1",
                        "--experts", "1", "--listen", "127.0.0.1:0", "--lease-ms", "20000"});
  const std::string line = ReadLine(router.stdout_fd);
  const std::string prefix = "dxs-router listening on 127.0.0.1:";
  ASSERT_EQ(line.rfind(prefix, 0), 0u) << "got: " << line;
  const std::string address = "127.0.0.1:" + std::to_string(std::stoi(line.substr(prefix.size())));
  auto channel = grpc::CreateChannel(address, grpc::InsecureChannelCredentials());
  auto control = v1::ControlPlane::NewStub(channel);
  auto health = grpc::health::v1::Health::NewStub(channel);
  auto serving = [&] {
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
    grpc::health::v1::HealthCheckRequest request;
    request.set_service("dxs.v1.Frontend");
    grpc::health::v1::HealthCheckResponse response;
    EXPECT_TRUE(health->Check(&context, request, &response).ok());
    return response.status() == grpc::health::v1::HealthCheckResponse::SERVING;
  };
  // The health watcher follows the view within its poll interval.
  auto becomes = [&](bool want) {
    const auto deadline = std::chrono::steady_clock::now() + kTimeout;
    while (serving() != want) {
      if (std::chrono::steady_clock::now() > deadline) return false;
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    return true;
  };
  // Follows the router's view (WatchCluster) until it shows the expert and the attention
  // worker in these states; false if it does not within kTimeout. The router's health
  // watcher is woken by the same change of the view and has less to do before it sets the
  // health than this stream before the view reaches the test: a wrong flip on that view
  // shows in the health check that follows.
  auto view_shows = [&](v1::WorkerState expert, v1::WorkerState attention) {
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + kTimeout);
    auto reader = control->WatchCluster(&context, v1::WatchClusterRequest());
    v1::ClusterView view;
    bool shown = false;
    while (!shown && reader->Read(&view)) {
      int matching = 0;
      for (const v1::WorkerInfo& w : view.workers()) {
        matching += w.state() == (w.role() == v1::ROLE_EXPERT ? expert : attention);
      }
      shown = view.workers_size() == 2 && matching == 2;
    }
    context.TryCancel();
    reader->Finish();
    return shown;
  };
  absl::StatusOr<v1::ModelFingerprint> fingerprint = ModelIdentity(model_dir_.string());
  ASSERT_TRUE(fingerprint.ok()) << fingerprint.status();
  std::vector<v1::WorkerId> workers;
  for (v1::Role role : {v1::ROLE_EXPERT, v1::ROLE_ATTENTION}) {
    v1::RegisterRequest request;
    request.set_role(role);
    request.set_grpc_address(role == v1::ROLE_EXPERT ? "127.0.0.1:9" : "127.0.0.1:11");
    request.mutable_transport()->set_ucx_worker_address("blob");
    *request.mutable_fingerprint() = *fingerprint;
    v1::RegisterResponse response;
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
    ASSERT_TRUE(control->Register(&context, request, &response).ok());
    v1::WorkerId id;
    id.set_role(role);
    id.set_rank(response.rank());
    id.set_incarnation(response.incarnation());
    workers.push_back(id);
  }
  auto beat = [&](const v1::WorkerId& id, v1::WorkerState state) {
    v1::HeartbeatRequest request;
    *request.mutable_worker() = id;
    request.set_state(state);
    v1::HeartbeatResponse response;
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
    EXPECT_TRUE(control->Heartbeat(&context, request, &response).ok());
  };
  // Complete (every rank registered, every expert placed), but both JOINING.
  EXPECT_TRUE(view_shows(v1::WORKER_STATE_JOINING, v1::WORKER_STATE_JOINING));
  EXPECT_FALSE(serving());
  beat(workers[0], v1::WORKER_STATE_READY);
  EXPECT_TRUE(view_shows(v1::WORKER_STATE_READY, v1::WORKER_STATE_JOINING));
  EXPECT_FALSE(serving()) << "SERVING while the attention worker is JOINING";
  beat(workers[1], v1::WORKER_STATE_READY);
  EXPECT_TRUE(becomes(true));
  beat(workers[1], v1::WORKER_STATE_JOINING);
  EXPECT_TRUE(becomes(false));

  ASSERT_EQ(kill(router.pid, SIGTERM), 0);
  EXPECT_EQ(WaitExit(router.pid, kTimeout), 0);
  close(router.stdout_fd);
  close(router.stderr_fd);
}

TEST_F(RouterMainTest, BadFlagsExitTwoWithOneLine) {
  for (const std::vector<std::string>& args :
       std::vector<std::vector<std::string>>{{DXS_ROUTER_BIN, "--bogus"},
                                             {DXS_ROUTER_BIN, "--model", "x", "--attention", "1"},
                                             {DXS_ROUTER_BIN, "--model", "x", "--attention", "1",
                                              "--experts", "1", "--wire-dtype", "f64"}}) {
    Child router = Spawn(args);
    EXPECT_EQ(WaitExit(router.pid, kTimeout), 2) << args.back();
    const std::string err = ReadAll(router.stderr_fd);
    EXPECT_EQ(std::count(err.begin(), err.end(), '\n'), 1) << err;
    EXPECT_EQ(err.rfind("dxs-router: ", 0), 0u) << err;
    close(router.stdout_fd);
    close(router.stderr_fd);
  }
}

}  // namespace
}  // namespace dxs
