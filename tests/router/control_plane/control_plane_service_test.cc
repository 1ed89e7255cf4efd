// ControlPlaneService over real gRPC on loopback: the service runs in-process on port 0
// (StartGrpcServer), two workers register through a generated stub, a watcher sees the
// views in version order, refusals arrive with their code and message, a cancelled watch
// ends promptly, Shutdown ends open watches with UNAVAILABLE, and health checking answers.
#include "router/control_plane/control_plane_service.h"

#include <chrono>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "common/grpc/server.h"
#include "dxs/v1/control_plane.grpc.pb.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "grpcpp/create_channel.h"
#include "gtest/gtest.h"

namespace dxs {
namespace {

using grpc::health::v1::HealthCheckRequest;
using grpc::health::v1::HealthCheckResponse;

std::chrono::system_clock::time_point Deadline(int seconds = 10) {
  return std::chrono::system_clock::now() + std::chrono::seconds(seconds);
}

v1::RegisterRequest Worker(v1::Role role, uint32_t rank, const std::string& address) {
  v1::RegisterRequest r;
  r.set_role(role);
  r.set_rank(rank);
  r.set_grpc_address(address);
  r.mutable_transport()->set_ucx_worker_address("ucx-blob-" + address);
  r.mutable_fingerprint()->set_checkpoint_fingerprint("00000000000000aa");
  r.mutable_fingerprint()->set_config_fingerprint("00000000000000bb");
  return r;
}

class ControlPlaneServiceTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ClusterRegistryOptions options;
    options.num_attention_ranks = 1;
    options.num_expert_ranks = 1;
    options.num_experts = 4;
    options.fingerprint.set_checkpoint_fingerprint("00000000000000aa");
    options.fingerprint.set_config_fingerprint("00000000000000bb");
    options.heartbeat_interval = absl::Milliseconds(100);
    options.lease_timeout = lease_timeout_;
    registry_ = std::make_unique<ClusterRegistry>(options);
    service_ = std::make_unique<ControlPlaneService>(registry_.get(), /*log=*/nullptr);
    GrpcServerOptions server_options;
    server_options.address = "127.0.0.1:0";
    absl::StatusOr<GrpcServer> server = StartGrpcServer(server_options, {service_.get()});
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = std::move(*server);
    channel_ = grpc::CreateChannel("127.0.0.1:" + std::to_string(server_.port),
                                   grpc::InsecureChannelCredentials());
    stub_ = v1::ControlPlane::NewStub(channel_);
  }

  void TearDown() override {
    service_->Shutdown();
    if (server_.server) {
      server_.server->Shutdown(Deadline(2));
      server_.server->Wait();
    }
  }

  absl::Duration lease_timeout_ = absl::Seconds(3);
  std::unique_ptr<ClusterRegistry> registry_;
  std::unique_ptr<ControlPlaneService> service_;
  GrpcServer server_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::ControlPlane::Stub> stub_;
};

TEST_F(ControlPlaneServiceTest, RegisterAndWatchInVersionOrder) {
  // An observer watching from the start.
  grpc::ClientContext watch_context;
  watch_context.set_deadline(Deadline());
  v1::WatchClusterRequest watch;
  std::unique_ptr<grpc::ClientReader<v1::ClusterView>> reader =
      stub_->WatchCluster(&watch_context, watch);
  v1::ClusterView view;
  ASSERT_TRUE(reader->Read(&view));
  EXPECT_EQ(view.version(), 1u);
  EXPECT_EQ(view.workers_size(), 0);

  v1::RegisterResponse attention;
  {
    grpc::ClientContext context;
    context.set_deadline(Deadline());
    grpc::Status s =
        stub_->Register(&context, Worker(v1::ROLE_ATTENTION, 0, "127.0.0.1:7001"), &attention);
    ASSERT_TRUE(s.ok()) << s.error_message();
  }
  ASSERT_TRUE(reader->Read(&view));
  EXPECT_EQ(view.version(), attention.cluster_view_version());
  EXPECT_EQ(view.workers_size(), 1);

  v1::RegisterResponse expert;
  {
    grpc::ClientContext context;
    context.set_deadline(Deadline());
    grpc::Status s =
        stub_->Register(&context, Worker(v1::ROLE_EXPERT, 0, "127.0.0.1:7002"), &expert);
    ASSERT_TRUE(s.ok()) << s.error_message();
  }
  EXPECT_EQ(expert.rank(), 0u);
  EXPECT_EQ(expert.placement().expert_to_rank_size(), 4);
  ASSERT_TRUE(reader->Read(&view));
  EXPECT_EQ(view.version(), expert.cluster_view_version());
  EXPECT_GT(expert.cluster_view_version(), attention.cluster_view_version());
  ASSERT_EQ(view.workers_size(), 2);
  EXPECT_EQ(view.workers(0).role(), v1::ROLE_ATTENTION);
  EXPECT_EQ(view.workers(1).role(), v1::ROLE_EXPERT);
  EXPECT_EQ(view.workers(1).transport_rank(), 1u);
  EXPECT_EQ(view.workers(1).transport().ucx_worker_address(), "ucx-blob-127.0.0.1:7002");
  EXPECT_TRUE(registry_->IsComplete());

  // Heartbeat READY: a new version arrives on the stream.
  v1::HeartbeatRequest hb;
  hb.mutable_worker()->set_role(v1::ROLE_EXPERT);
  hb.mutable_worker()->set_rank(0);
  hb.mutable_worker()->set_incarnation(expert.incarnation());
  hb.set_state(v1::WORKER_STATE_READY);
  v1::HeartbeatResponse hb_response;
  {
    grpc::ClientContext context;
    context.set_deadline(Deadline());
    ASSERT_TRUE(stub_->Heartbeat(&context, hb, &hb_response).ok());
  }
  ASSERT_TRUE(reader->Read(&view));
  EXPECT_EQ(view.version(), hb_response.cluster_view_version());
  EXPECT_EQ(view.workers(1).state(), v1::WORKER_STATE_READY);

  // A watcher that knows the current version gets nothing until the next change.
  grpc::ClientContext late_context;
  late_context.set_deadline(Deadline());
  v1::WatchClusterRequest late;
  late.set_known_version(view.version());
  late.mutable_worker()->set_role(v1::ROLE_ATTENTION);
  late.mutable_worker()->set_incarnation(attention.incarnation());
  std::unique_ptr<grpc::ClientReader<v1::ClusterView>> late_reader =
      stub_->WatchCluster(&late_context, late);
  v1::DeregisterRequest dereg;
  *dereg.mutable_worker() = hb.worker();
  dereg.set_reason("test");
  v1::DeregisterResponse dereg_response;
  {
    grpc::ClientContext context;
    context.set_deadline(Deadline());
    ASSERT_TRUE(stub_->Deregister(&context, dereg, &dereg_response).ok());
  }
  v1::ClusterView late_view;
  ASSERT_TRUE(late_reader->Read(&late_view));
  EXPECT_EQ(late_view.version(), dereg_response.cluster_view_version());
  EXPECT_EQ(late_view.workers_size(), 1);
  ASSERT_TRUE(reader->Read(&view));
  EXPECT_EQ(view.version(), dereg_response.cluster_view_version());

  // Shutdown ends the open streams with UNAVAILABLE, promptly.
  const auto start = std::chrono::steady_clock::now();
  service_->Shutdown();
  EXPECT_FALSE(reader->Read(&view));
  EXPECT_EQ(reader->Finish().error_code(), grpc::StatusCode::UNAVAILABLE);
  EXPECT_FALSE(late_reader->Read(&late_view));
  EXPECT_EQ(late_reader->Finish().error_code(), grpc::StatusCode::UNAVAILABLE);
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(2));
}

TEST_F(ControlPlaneServiceTest, RefusalsCarryCodeAndMessage) {
  v1::RegisterResponse response;
  grpc::ClientContext first_context;
  ASSERT_TRUE(
      stub_->Register(&first_context, Worker(v1::ROLE_ATTENTION, 0, "h:1"), &response).ok());

  grpc::ClientContext dup_context;
  grpc::Status dup = stub_->Register(&dup_context, Worker(v1::ROLE_ATTENTION, 0, "h:2"), &response);
  EXPECT_EQ(dup.error_code(), grpc::StatusCode::ALREADY_EXISTS);
  EXPECT_NE(dup.error_message().find("rank 0 is held by a live worker at h:1"), std::string::npos)
      << dup.error_message();

  v1::RegisterRequest other_model = Worker(v1::ROLE_EXPERT, 0, "h:3");
  other_model.mutable_fingerprint()->set_checkpoint_fingerprint("ffffffffffffffff");
  grpc::ClientContext model_context;
  grpc::Status model = stub_->Register(&model_context, other_model, &response);
  EXPECT_EQ(model.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_NE(model.error_message().find("different checkpoint"), std::string::npos);

  // A watch naming an unknown worker is refused with NOT_FOUND.
  grpc::ClientContext watch_context;
  watch_context.set_deadline(Deadline());
  v1::WatchClusterRequest watch;
  watch.mutable_worker()->set_role(v1::ROLE_EXPERT);
  std::unique_ptr<grpc::ClientReader<v1::ClusterView>> reader =
      stub_->WatchCluster(&watch_context, watch);
  v1::ClusterView view;
  EXPECT_FALSE(reader->Read(&view));
  EXPECT_EQ(reader->Finish().error_code(), grpc::StatusCode::NOT_FOUND);
}

TEST_F(ControlPlaneServiceTest, CancelledWatchEndsPromptly) {
  grpc::ClientContext context;
  v1::WatchClusterRequest watch;
  std::unique_ptr<grpc::ClientReader<v1::ClusterView>> reader =
      stub_->WatchCluster(&context, watch);
  v1::ClusterView view;
  ASSERT_TRUE(reader->Read(&view));  // the current view
  std::thread canceller([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    context.TryCancel();
  });
  const auto start = std::chrono::steady_clock::now();
  EXPECT_FALSE(reader->Read(&view));
  EXPECT_EQ(reader->Finish().error_code(), grpc::StatusCode::CANCELLED);
  canceller.join();
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(1));

  // The server side let go of the stream too: server shutdown does not wait for it.
  // (TearDown shuts the service down first; here shut the server down alone.)
  const auto shutdown_start = std::chrono::steady_clock::now();
  server_.server->Shutdown(Deadline(5));
  server_.server->Wait();
  EXPECT_LT(std::chrono::steady_clock::now() - shutdown_start, std::chrono::seconds(1));
  server_.server.reset();
}

// A short lease, so that the expiry timer fires within the test.
class ShortLeaseTest : public ControlPlaneServiceTest {
 protected:
  void SetUp() override {
    lease_timeout_ = absl::Milliseconds(400);
    ControlPlaneServiceTest::SetUp();
  }
};

TEST_F(ShortLeaseTest, SilentWorkerExpiresAndComesBack) {
  v1::RegisterResponse first;
  {
    grpc::ClientContext context;
    context.set_deadline(Deadline());
    ASSERT_TRUE(stub_->Register(&context, Worker(v1::ROLE_EXPERT, 0, "h:1"), &first).ok());
  }
  // The worker's own watch ends with NOT_FOUND once the timer marks it DEAD.
  grpc::ClientContext watch_context;
  watch_context.set_deadline(Deadline());
  v1::WatchClusterRequest watch;
  watch.mutable_worker()->set_role(v1::ROLE_EXPERT);
  watch.mutable_worker()->set_incarnation(first.incarnation());
  std::unique_ptr<grpc::ClientReader<v1::ClusterView>> reader =
      stub_->WatchCluster(&watch_context, watch);
  const auto start = std::chrono::steady_clock::now();
  v1::ClusterView view;
  while (reader->Read(&view)) {
  }
  EXPECT_EQ(reader->Finish().error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(3));
  ASSERT_EQ(view.workers_size(), 1);
  EXPECT_EQ(view.workers(0).state(), v1::WORKER_STATE_DEAD);
  EXPECT_EQ(view.placement().expert_to_rank(0).ep_ranks_size(), 0);

  // Registering again restores it with a new incarnation.
  v1::RegisterResponse again;
  {
    grpc::ClientContext context;
    context.set_deadline(Deadline());
    ASSERT_TRUE(stub_->Register(&context, Worker(v1::ROLE_EXPERT, 0, "h:1"), &again).ok());
  }
  EXPECT_GT(again.incarnation(), first.incarnation());
  EXPECT_EQ(again.placement().expert_to_rank(0).ep_ranks_size(), 1);
  EXPECT_EQ(registry_->Workers()[0].state(), v1::WORKER_STATE_JOINING);
}

TEST_F(ControlPlaneServiceTest, HealthCheckAnswers) {
  std::unique_ptr<grpc::health::v1::Health::Stub> health =
      grpc::health::v1::Health::NewStub(channel_);
  grpc::ClientContext context;
  context.set_deadline(Deadline());
  HealthCheckRequest request;
  HealthCheckResponse response;
  grpc::Status s = health->Check(&context, request, &response);
  ASSERT_TRUE(s.ok()) << s.error_message();
  EXPECT_EQ(response.status(), HealthCheckResponse::SERVING);
}

}  // namespace
}  // namespace dxs
