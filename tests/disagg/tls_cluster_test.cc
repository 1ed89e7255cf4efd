// The cluster with mutual TLS (certificates made at test time with openssl): every process
// serves TLS and calls the router with its cluster certificate; frontends need only the
// CA; control-plane RPCs refuse callers without a cluster certificate; plaintext fails.
#include <grpcpp/grpcpp.h>

#include "common/grpc/tls.h"
#include "dxs/v1/control_plane.grpc.pb.h"
#include "gtest/gtest.h"
#include "model/engine.h"
#include "tests/common/grpc/test_certs.h"
#include "tests/disagg/process_cluster.h"
#include "tests/model/test_util.h"

namespace dxs {
namespace {

using testing::ClusterSpec;
using testing::ProcessCluster;
using testing::TempDir;

std::vector<int32_t> Generate(v1::Frontend::Stub* stub, grpc::Status* status) {
  v1::GenerateRequest req;
  for (int32_t t : {9, 41, 7}) req.add_prompt_token_ids(t);
  req.mutable_sampling_params()->set_max_new_tokens(5);
  req.mutable_sampling_params()->set_temperature(0.f);
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
  auto reader = stub->Generate(&ctx, req);
  std::vector<int32_t> tokens;
  v1::GenerateResponse resp;
  while (reader->Read(&resp)) {
    for (uint32_t t : resp.chunk().token_ids()) tokens.push_back(static_cast<int32_t>(t));
  }
  *status = reader->Finish();
  return tokens;
}

TEST(TlsCluster, MutualTlsClusterServesAndGuardsTheControlPlane) {
  TempDir tmp;
  testing::TestCerts certs;
  ASSERT_TRUE(testing::MakeTestCerts(tmp.path(), &certs));
  const std::string dir = testing::WritePreset(tmp, "default");
  const TlsConfig member{certs.client_cert(), certs.client_key(), certs.ca(), true};
  const TlsConfig frontend{"", "", certs.ca(), false};

  ProcessCluster cluster(tmp.path());
  cluster.set_common_args({"--tls-cert", certs.server_cert(), "--tls-key", certs.server_key(),
                           "--tls-ca", certs.ca(), "--mtls"});
  cluster.set_client_credentials(*MakeChannelCredentials(member));
  absl::Status started = cluster.Start(ClusterSpec{dir, 1, 1, {}});
  ASSERT_TRUE(started.ok()) << started << cluster.DumpLogs();

  auto engine = LocalEngine::Load(dir);
  ASSERT_TRUE(engine.ok());
  GenerationRequest r;
  r.prompt = {9, 41, 7};
  r.max_new_tokens = 5;
  const std::vector<int32_t> want = (*engine)->GenerateBatch({r})->front().tokens;

  // A frontend that trusts the cluster CA but has no certificate: the front door is open.
  auto fe = v1::Frontend::NewStub(*MakeChannel(cluster.router_address(), frontend));
  grpc::Status status;
  EXPECT_EQ(Generate(fe.get(), &status), want);
  EXPECT_TRUE(status.ok()) << status.error_message() << cluster.DumpLogs();

  // The control plane is for cluster members only.
  auto cp = v1::ControlPlane::NewStub(*MakeChannel(cluster.router_address(), frontend));
  grpc::ClientContext ctx;
  v1::RegisterRequest reg;
  reg.set_role(v1::ROLE_EXPERT);
  reg.set_grpc_address("127.0.0.1:1");
  v1::RegisterResponse resp;
  grpc::Status refused = cp->Register(&ctx, reg, &resp);
  EXPECT_EQ(refused.error_code(), grpc::StatusCode::UNAUTHENTICATED) << refused.error_message();

  // Plaintext does not get through at all.
  auto plain = v1::Frontend::NewStub(
      grpc::CreateChannel(cluster.router_address(), grpc::InsecureChannelCredentials()));
  Generate(plain.get(), &status);
  EXPECT_FALSE(status.ok());
}

}  // namespace
}  // namespace dxs
