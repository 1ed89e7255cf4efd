// The server helper in common/grpc, exercised in-process over loopback TCP: a server built
// with it answers grpc.health.v1 Check, lists and describes the dxs.v1 services through
// reflection (what grpcurl does), serves the generated dxs.v1 stubs with errors converted
// by ToGrpcStatus, and refuses to share its port.
#include <chrono>
#include <cstdint>
#include <memory>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "common/grpc/server.h"
#include "common/grpc/status_conversion.h"
#include "dxs/v1/attention_worker.grpc.pb.h"
#include "dxs/v1/control_plane.grpc.pb.h"
#include "dxs/v1/expert_worker.grpc.pb.h"
#include "dxs/v1/frontend.grpc.pb.h"
#include "google/protobuf/descriptor.h"
#include "google/protobuf/descriptor.pb.h"
#include "google/protobuf/message.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/generic/generic_stub.h"
#include "grpcpp/health_check_service_interface.h"
#include "gtest/gtest.h"

namespace dxs {
namespace {

using google::protobuf::Descriptor;
using google::protobuf::DescriptorPool;
using google::protobuf::FieldDescriptor;
using google::protobuf::Message;
using grpc::health::v1::HealthCheckRequest;
using grpc::health::v1::HealthCheckResponse;

std::chrono::system_clock::time_point Deadline() {
  return std::chrono::system_clock::now() + std::chrono::seconds(10);
}

// Streams two chunks and a final message; Abort knows no request.
class FakeFrontend final : public v1::Frontend::Service {
 public:
  grpc::Status Generate(grpc::ServerContext* context, const v1::GenerateRequest* request,
                        grpc::ServerWriter<v1::GenerateResponse>* writer) override {
    v1::GenerateResponse response;
    response.set_request_id(request->request_id());
    response.mutable_chunk()->add_token_ids(7);
    response.mutable_chunk()->add_token_ids(8);
    response.mutable_chunk()->set_index(0);
    writer->Write(response);
    response.mutable_chunk()->Clear();
    response.mutable_chunk()->add_token_ids(9);
    response.mutable_chunk()->set_index(2);
    writer->Write(response);
    v1::GenerateComplete* complete = response.mutable_complete();
    complete->set_finish_reason(v1::FINISH_REASON_LENGTH);
    complete->set_prompt_tokens(request->prompt_token_ids_size());
    complete->set_completion_tokens(3);
    writer->Write(response);
    return grpc::Status::OK;
  }

  grpc::Status Abort(grpc::ServerContext* context, const v1::AbortRequest* request,
                     v1::AbortResponse* response) override {
    return ToGrpcStatus(absl::NotFoundError("no in-flight request " + request->request_id()));
  }
};

// grpc.reflection.v1alpha messages, built from the descriptors that libgrpc++_reflection
// registers in the generated pool: Debian ships neither reflection.proto nor its generated
// headers, but the library carries the compiled messages.
std::unique_ptr<Message> NewReflectionMessage(const std::string& name) {
  const Descriptor* descriptor =
      DescriptorPool::generated_pool()->FindMessageTypeByName("grpc.reflection.v1alpha." + name);
  if (descriptor == nullptr) return nullptr;
  return std::unique_ptr<Message>(
      google::protobuf::MessageFactory::generated_factory()->GetPrototype(descriptor)->New());
}

void* Tag(intptr_t step) { return reinterpret_cast<void*>(step); }

// One request and one response on the bidi ServerReflectionInfo stream, through the generic
// stub since there is no generated reflection client.
absl::StatusOr<std::unique_ptr<Message>> AskReflection(
    const std::shared_ptr<grpc::Channel>& channel, const Message& request) {
  std::unique_ptr<Message> response = NewReflectionMessage("ServerReflectionResponse");
  if (response == nullptr) return absl::InternalError("reflection messages not registered");
  grpc::TemplatedGenericStub<Message, Message> stub(channel);
  grpc::ClientContext context;
  context.set_deadline(Deadline());
  grpc::CompletionQueue cq;
  auto call = stub.PrepareCall(
      &context, "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo", &cq);
  // Operations are issued one at a time, so each completes before the next starts.
  auto await = [&cq](intptr_t step) {
    void* got = nullptr;
    bool ok = false;
    return cq.Next(&got, &ok) && ok && got == Tag(step);
  };
  bool ok = true;
  call->StartCall(Tag(1));
  ok = ok && await(1);
  if (ok) call->Write(request, Tag(2));
  ok = ok && await(2);
  if (ok) call->WritesDone(Tag(3));
  ok = ok && await(3);
  if (ok) call->Read(response.get(), Tag(4));
  ok = ok && await(4);
  if (!ok) context.TryCancel();
  grpc::Status status;
  call->Finish(&status, Tag(5));
  cq.Shutdown();
  void* got;
  bool event_ok;
  while (cq.Next(&got, &event_ok)) {
  }
  if (!status.ok()) return FromGrpcStatus(status);
  if (!ok) return absl::InternalError("reflection stream failed");
  return response;
}

const Message& SubMessage(const Message& message, const std::string& field) {
  const FieldDescriptor* f = message.GetDescriptor()->FindFieldByName(field);
  return message.GetReflection()->GetMessage(message, f);
}

class GrpcServerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    GrpcServerOptions options;
    options.address = "127.0.0.1:0";
    options.configure = [this](grpc::ServerBuilder&) { configure_called_ = true; };
    absl::StatusOr<GrpcServer> started =
        StartGrpcServer(options, {&frontend_, &control_plane_, &attention_worker_, &expert_});
    ASSERT_TRUE(started.ok()) << started.status();
    server_ = std::move(*started);
    channel_ = grpc::CreateChannel("127.0.0.1:" + std::to_string(server_.port),
                                   grpc::InsecureChannelCredentials());
  }

  void TearDown() override {
    if (server_.server != nullptr) server_.server->Shutdown(Deadline());
  }

  grpc::Status Check(const std::string& service, HealthCheckResponse* response) {
    auto stub = grpc::health::v1::Health::NewStub(channel_);
    grpc::ClientContext context;
    context.set_deadline(Deadline());
    HealthCheckRequest request;
    request.set_service(service);
    return stub->Check(&context, request, response);
  }

  FakeFrontend frontend_;
  v1::ControlPlane::Service control_plane_;
  v1::AttentionWorker::Service attention_worker_;
  v1::ExpertWorker::Service expert_;
  bool configure_called_ = false;
  GrpcServer server_;
  std::shared_ptr<grpc::Channel> channel_;
};

TEST_F(GrpcServerTest, BindsAChosenPortAndRunsTheConfigureHook) {
  EXPECT_GT(server_.port, 0);
  EXPECT_TRUE(configure_called_);
}

TEST_F(GrpcServerTest, HealthCheckAnswersServingAndFollowsTheServer) {
  HealthCheckResponse response;
  grpc::Status status = Check("", &response);
  ASSERT_TRUE(status.ok()) << status.error_message();
  EXPECT_EQ(response.status(), HealthCheckResponse::SERVING);

  // What a draining service does so that Kubernetes stops routing to it.
  server_.server->GetHealthCheckService()->SetServingStatus(false);
  status = Check("", &response);
  ASSERT_TRUE(status.ok()) << status.error_message();
  EXPECT_EQ(response.status(), HealthCheckResponse::NOT_SERVING);
}

TEST_F(GrpcServerTest, ReflectionListsTheDxsServices) {
  std::unique_ptr<Message> request = NewReflectionMessage("ServerReflectionRequest");
  ASSERT_NE(request, nullptr);
  request->GetReflection()->SetString(
      request.get(), request->GetDescriptor()->FindFieldByName("list_services"), "*");
  absl::StatusOr<std::unique_ptr<Message>> response = AskReflection(channel_, *request);
  ASSERT_TRUE(response.ok()) << response.status();

  const Message& list = SubMessage(**response, "list_services_response");
  const FieldDescriptor* service_field = list.GetDescriptor()->FindFieldByName("service");
  std::set<std::string> names;
  for (int i = 0; i < list.GetReflection()->FieldSize(list, service_field); ++i) {
    const Message& service = list.GetReflection()->GetRepeatedMessage(list, service_field, i);
    names.insert(service.GetReflection()->GetString(
        service, service.GetDescriptor()->FindFieldByName("name")));
  }
  for (const char* expected :
       {"dxs.v1.Frontend", "dxs.v1.ControlPlane", "dxs.v1.AttentionWorker", "dxs.v1.ExpertWorker",
        "grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection"}) {
    EXPECT_TRUE(names.count(expected)) << expected << " not listed";
  }
}

TEST_F(GrpcServerTest, ReflectionDescribesGenerateAsServerStreaming) {
  std::unique_ptr<Message> request = NewReflectionMessage("ServerReflectionRequest");
  ASSERT_NE(request, nullptr);
  request->GetReflection()->SetString(
      request.get(), request->GetDescriptor()->FindFieldByName("file_containing_symbol"),
      "dxs.v1.Frontend");
  absl::StatusOr<std::unique_ptr<Message>> response = AskReflection(channel_, *request);
  ASSERT_TRUE(response.ok()) << response.status();

  // The server sends the file and its imports; rebuild them as a client tool would.
  const Message& files = SubMessage(**response, "file_descriptor_response");
  const FieldDescriptor* bytes_field =
      files.GetDescriptor()->FindFieldByName("file_descriptor_proto");
  std::vector<google::protobuf::FileDescriptorProto> protos;
  for (int i = 0; i < files.GetReflection()->FieldSize(files, bytes_field); ++i) {
    protos.emplace_back();
    ASSERT_TRUE(protos.back().ParseFromString(
        files.GetReflection()->GetRepeatedString(files, bytes_field, i)));
  }
  DescriptorPool pool;
  // Build dependencies first: retry until every file is in (the set is tiny).
  for (size_t round = 0; round < protos.size(); ++round) {
    for (const auto& proto : protos) {
      if (pool.FindFileByName(proto.name()) != nullptr) continue;
      bool deps_ready = true;
      for (const std::string& dep : proto.dependency()) {
        deps_ready = deps_ready && pool.FindFileByName(dep) != nullptr;
      }
      if (deps_ready) {
        ASSERT_NE(pool.BuildFile(proto), nullptr) << proto.name();
      }
    }
  }
  ASSERT_NE(pool.FindFileByName("dxs/v1/frontend.proto"), nullptr);
  const auto* generate = pool.FindMethodByName("dxs.v1.Frontend.Generate");
  ASSERT_NE(generate, nullptr);
  EXPECT_TRUE(generate->server_streaming());
  EXPECT_FALSE(generate->client_streaming());
  EXPECT_EQ(generate->output_type()->full_name(), "dxs.v1.GenerateResponse");
}

TEST_F(GrpcServerTest, GenerateStreamsChunksThenOneFinalMessage) {
  auto stub = v1::Frontend::NewStub(channel_);
  grpc::ClientContext context;
  context.set_deadline(Deadline());
  v1::GenerateRequest request;
  request.set_request_id("req-1");
  for (uint32_t token : {1u, 2u, 3u}) request.add_prompt_token_ids(token);
  request.mutable_sampling_params()->set_max_new_tokens(3);
  auto reader = stub->Generate(&context, request);

  std::vector<uint32_t> tokens;
  v1::GenerateResponse response;
  int num_complete = 0;
  while (reader->Read(&response)) {
    EXPECT_EQ(response.request_id(), "req-1");
    EXPECT_EQ(num_complete, 0) << "message after the final one";
    if (response.has_chunk()) {
      EXPECT_EQ(response.chunk().index(), tokens.size());
      tokens.insert(tokens.end(), response.chunk().token_ids().begin(),
                    response.chunk().token_ids().end());
    } else {
      ASSERT_TRUE(response.has_complete());
      ++num_complete;
      EXPECT_EQ(response.complete().finish_reason(), v1::FINISH_REASON_LENGTH);
      EXPECT_EQ(response.complete().prompt_tokens(), 3u);
      EXPECT_EQ(response.complete().completion_tokens(), tokens.size());
    }
  }
  grpc::Status status = reader->Finish();
  EXPECT_TRUE(status.ok()) << status.error_message();
  EXPECT_EQ(tokens, (std::vector<uint32_t>{7, 8, 9}));
  EXPECT_EQ(num_complete, 1);
}

TEST_F(GrpcServerTest, HandlerErrorsArriveAsTheirGrpcCode) {
  auto stub = v1::Frontend::NewStub(channel_);
  grpc::ClientContext context;
  context.set_deadline(Deadline());
  v1::AbortRequest request;
  request.set_request_id("nope");
  v1::AbortResponse response;
  grpc::Status status = stub->Abort(&context, request, &response);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_EQ(status.error_message(), "no in-flight request nope");
  EXPECT_EQ(FromGrpcStatus(status), absl::NotFoundError("no in-flight request nope"));
}

TEST_F(GrpcServerTest, ASecondServerCannotTakeThePort) {
  v1::Frontend::Service other;
  GrpcServerOptions options;
  options.address = "127.0.0.1:" + std::to_string(server_.port);
  absl::StatusOr<GrpcServer> second = StartGrpcServer(options, {&other});
  EXPECT_EQ(second.status().code(), absl::StatusCode::kUnavailable) << second.status();
}

TEST(GrpcServerOptionsTest, RejectsEmptyAddressAndNullService) {
  GrpcServerOptions options;
  EXPECT_EQ(StartGrpcServer(options, {}).status().code(), absl::StatusCode::kInvalidArgument);
  options.address = "127.0.0.1:0";
  EXPECT_EQ(StartGrpcServer(options, {nullptr}).status().code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace dxs
