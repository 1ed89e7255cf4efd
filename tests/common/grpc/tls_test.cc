// TLS and mutual TLS on a real gRPC server (certificates made at test time with openssl):
// verified TLS works, plaintext and wrong-CA clients are refused, and with mTLS the
// cluster-only check admits a CA-signed client certificate and refuses callers without one.
#include "common/grpc/tls.h"

#include <grpcpp/grpcpp.h>

#include "common/grpc/server.h"
#include "common/grpc/status_conversion.h"
#include "dxs/v1/attention_worker.grpc.pb.h"
#include "gtest/gtest.h"
#include "tests/common/grpc/test_certs.h"
#include "tests/model/test_util.h"

namespace dxs {
namespace {

// A service whose RPC requires a cluster peer: the shape of every control-plane RPC under
// mTLS.
class ClusterOnlyService final : public v1::AttentionWorker::Service {
 public:
  explicit ClusterOnlyService(TlsConfig tls) : tls_(std::move(tls)) {}
  grpc::Status GetLoad(grpc::ServerContext* ctx, const v1::GetLoadRequest*,
                       v1::GetLoadResponse*) override {
    if (absl::Status s = RequireClusterPeer(*ctx, tls_); !s.ok()) return ToGrpcStatus(s);
    return grpc::Status::OK;
  }

 private:
  TlsConfig tls_;
};

class TlsTest : public ::testing::Test {
 protected:
  void SetUp() override { ASSERT_TRUE(MakeTestCerts(tmp_.path(), &certs_)) << "openssl failed"; }

  // Starts a server with `server_tls` and returns its address.
  std::string Start(const TlsConfig& server_tls) {
    service_ = std::make_unique<ClusterOnlyService>(server_tls);
    auto creds = MakeServerCredentials(server_tls);
    EXPECT_TRUE(creds.ok()) << creds.status();
    GrpcServerOptions options;
    options.address = "127.0.0.1:0";
    options.credentials = *creds;
    auto server = StartGrpcServer(options, {service_.get()});
    EXPECT_TRUE(server.ok()) << server.status();
    server_ = std::move(server->server);
    return "127.0.0.1:" + std::to_string(server->port);
  }

  grpc::Status Call(const std::string& address, const TlsConfig& client_tls) {
    auto channel = MakeChannel(address, client_tls);
    EXPECT_TRUE(channel.ok()) << channel.status();
    auto stub = v1::AttentionWorker::NewStub(*channel);
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
    v1::GetLoadResponse resp;
    return stub->GetLoad(&ctx, v1::GetLoadRequest(), &resp);
  }

  void TearDown() override {
    if (server_) server_->Shutdown();
  }

  testing::TempDir tmp_;
  testing::TestCerts certs_;
  std::unique_ptr<ClusterOnlyService> service_;
  std::unique_ptr<grpc::Server> server_;
};

TEST_F(TlsTest, VerifiedTlsWorksAndPlaintextOrWrongCaIsRefused) {
  const std::string addr = Start({certs_.server_cert(), certs_.server_key(), certs_.ca(), false});
  EXPECT_TRUE(Call(addr, {"", "", certs_.ca(), false}).ok());
  EXPECT_FALSE(Call(addr, TlsConfig{}).ok()) << "a plaintext client must not get through";
  // A client that trusts another CA refuses the server's certificate.
  EXPECT_FALSE(Call(addr, {"", "", certs_.dir + "/otherca.pem", false}).ok());
}

TEST_F(TlsTest, MutualTlsAdmitsClusterCertificatesOnly) {
  const std::string addr = Start({certs_.server_cert(), certs_.server_key(), certs_.ca(), true});
  // A cluster member with a CA-signed certificate.
  EXPECT_TRUE(Call(addr, {certs_.client_cert(), certs_.client_key(), certs_.ca(), true}).ok());
  // No client certificate: the connection works, the cluster-only RPC does not.
  grpc::Status anonymous = Call(addr, {"", "", certs_.ca(), false});
  EXPECT_EQ(anonymous.error_code(), grpc::StatusCode::UNAUTHENTICATED) << anonymous.error_message();
  EXPECT_NE(anonymous.error_message().find("cluster CA"), std::string::npos);
  // A certificate from another CA fails the handshake.
  EXPECT_FALSE(
      Call(addr, {certs_.stranger_cert(), certs_.stranger_key(), certs_.ca(), false}).ok());
}

TEST(TlsConfig, ValidationNamesTheFlag) {
  EXPECT_TRUE(TlsConfig{}.Validate(true).ok());
  EXPECT_NE(TlsConfig({"a.pem", "", "", false}).Validate(true).message().find("--tls-key"),
            std::string::npos);
  EXPECT_NE(TlsConfig({"", "", "", true}).Validate(true).message().find("--mtls"),
            std::string::npos);
  EXPECT_NE(TlsConfig({"/nope.pem", "/nope.key", "/nope-ca.pem", false})
                .Validate(true)
                .message()
                .find("cannot read"),
            std::string::npos);
}

}  // namespace
}  // namespace dxs
