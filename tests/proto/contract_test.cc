// Contract tests for the dxs.v1 protos: every service and method exists with the
// documented types and streaming shape, key field numbers are the documented ones, the
// whole API matches tests/proto/testdata/dxs_v1_api.golden (renumbering or removing a
// field without `reserved` fails), and every element carries a comment.
//
// After a deliberate, compatible API change (a new field, message, RPC), regenerate the
// golden with: DXS_UPDATE_GOLDEN=1 build/bin/proto_contract_test
// Renumbered fields and removals without `reserved` fail even then.
#include <algorithm>
#include <cstdlib>
#include <fstream>
#include <map>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "dxs/v1/attention_worker.grpc.pb.h"
#include "dxs/v1/common.pb.h"
#include "dxs/v1/control_plane.grpc.pb.h"
#include "dxs/v1/expert_worker.grpc.pb.h"
#include "dxs/v1/frontend.grpc.pb.h"
#include "google/protobuf/descriptor.h"
#include "google/protobuf/descriptor.pb.h"
#include "gtest/gtest.h"

#ifndef DXS_PROTO_DESCRIPTOR_SET
#error "DXS_PROTO_DESCRIPTOR_SET must name the dxs.v1 FileDescriptorSet"
#endif

namespace dxs {
namespace {

using google::protobuf::Descriptor;
using google::protobuf::DescriptorPool;
using google::protobuf::EnumDescriptor;
using google::protobuf::FieldDescriptor;
using google::protobuf::FileDescriptor;
using google::protobuf::MethodDescriptor;
using google::protobuf::ServiceDescriptor;
using google::protobuf::SourceLocation;

// The generated files, reached through their symbols so the linker keeps every one and
// their descriptors are registered in the generated pool.
std::vector<const FileDescriptor*> DxsFiles() {
  return {v1::ModelInfo::descriptor()->file(), v1::GenerateRequest::descriptor()->file(),
          v1::RegisterRequest::descriptor()->file(), v1::WakeRequest::descriptor()->file(),
          v1::LoadPlacementRequest::descriptor()->file()};
}

const DescriptorPool& Pool() {
  DxsFiles();
  return *DescriptorPool::generated_pool();
}

TEST(ProtoContractTest, FilesArePackageDxsV1Proto3) {
  std::set<std::string> names;
  for (const FileDescriptor* file : DxsFiles()) {
    names.insert(file->name());
    EXPECT_EQ(file->package(), "dxs.v1") << file->name();
    EXPECT_EQ(file->syntax(), FileDescriptor::SYNTAX_PROTO3) << file->name();
  }
  EXPECT_EQ(names, (std::set<std::string>{
                       "dxs/v1/common.proto", "dxs/v1/frontend.proto", "dxs/v1/control_plane.proto",
                       "dxs/v1/attention_worker.proto", "dxs/v1/expert_worker.proto"}));
}

struct MethodSpec {
  const char* service;
  const char* method;
  const char* input;
  const char* output;
  bool server_streaming;
  bool client_streaming = false;
};

// Every RPC of dxs.v1. Only AttentionWorker.Serve is client-streaming (bidi).
const MethodSpec kMethods[] = {
    {"dxs.v1.Frontend", "Generate", "dxs.v1.GenerateRequest", "dxs.v1.GenerateResponse", true},
    {"dxs.v1.Frontend", "Abort", "dxs.v1.AbortRequest", "dxs.v1.AbortResponse", false},
    {"dxs.v1.Frontend", "GetModelInfo", "dxs.v1.GetModelInfoRequest", "dxs.v1.GetModelInfoResponse",
     false},
    {"dxs.v1.Frontend", "GetLoads", "dxs.v1.GetLoadsRequest", "dxs.v1.GetLoadsResponse", false},
    {"dxs.v1.ControlPlane", "Register", "dxs.v1.RegisterRequest", "dxs.v1.RegisterResponse", false},
    {"dxs.v1.ControlPlane", "WatchCluster", "dxs.v1.WatchClusterRequest", "dxs.v1.ClusterView",
     true},
    {"dxs.v1.ControlPlane", "Heartbeat", "dxs.v1.HeartbeatRequest", "dxs.v1.HeartbeatResponse",
     false},
    {"dxs.v1.ControlPlane", "Drain", "dxs.v1.DrainRequest", "dxs.v1.DrainResponse", false},
    {"dxs.v1.ControlPlane", "Deregister", "dxs.v1.DeregisterRequest", "dxs.v1.DeregisterResponse",
     false},
    {"dxs.v1.ControlPlane", "Rebalance", "dxs.v1.RebalanceRequest", "dxs.v1.RebalanceResponse",
     false},
    {"dxs.v1.ControlPlane", "ReportUnreachable", "dxs.v1.ReportUnreachableRequest",
     "dxs.v1.ReportUnreachableResponse", false},
    {"dxs.v1.AttentionWorker", "Generate", "dxs.v1.GenerateRequest", "dxs.v1.GenerateResponse",
     true},
    {"dxs.v1.AttentionWorker", "Serve", "dxs.v1.ServeRequest", "dxs.v1.ServeEvents", true, true},
    {"dxs.v1.AttentionWorker", "Abort", "dxs.v1.AbortRequest", "dxs.v1.AbortResponse", false},
    {"dxs.v1.AttentionWorker", "GetLoad", "dxs.v1.GetLoadRequest", "dxs.v1.GetLoadResponse", false},
    {"dxs.v1.AttentionWorker", "Wake", "dxs.v1.WakeRequest", "dxs.v1.WakeResponse", false},
    {"dxs.v1.ExpertWorker", "GetStatus", "dxs.v1.GetExpertStatusRequest",
     "dxs.v1.GetExpertStatusResponse", false},
    {"dxs.v1.ExpertWorker", "LoadPlacement", "dxs.v1.LoadPlacementRequest",
     "dxs.v1.LoadPlacementResponse", false},
};

TEST(ProtoContractTest, EveryServiceAndMethodExists) {
  std::map<std::string, int> methods_per_service;
  for (const MethodSpec& spec : kMethods) {
    SCOPED_TRACE(std::string(spec.service) + "." + spec.method);
    const ServiceDescriptor* service = Pool().FindServiceByName(spec.service);
    ASSERT_NE(service, nullptr);
    const MethodDescriptor* method = service->FindMethodByName(spec.method);
    ASSERT_NE(method, nullptr);
    EXPECT_EQ(method->input_type()->full_name(), spec.input);
    EXPECT_EQ(method->output_type()->full_name(), spec.output);
    EXPECT_EQ(method->client_streaming(), spec.client_streaming);
    EXPECT_EQ(method->server_streaming(), spec.server_streaming);
    ++methods_per_service[spec.service];
  }
  // No service has methods this table does not know about.
  for (const auto& [name, count] : methods_per_service) {
    EXPECT_EQ(Pool().FindServiceByName(name)->method_count(), count) << name;
  }
  EXPECT_EQ(methods_per_service.size(), 4u);
}

TEST(ProtoContractTest, GeneratedStubsHaveTheServiceNames) {
  EXPECT_STREQ(v1::Frontend::service_full_name(), "dxs.v1.Frontend");
  EXPECT_STREQ(v1::ControlPlane::service_full_name(), "dxs.v1.ControlPlane");
  EXPECT_STREQ(v1::AttentionWorker::service_full_name(), "dxs.v1.AttentionWorker");
  EXPECT_STREQ(v1::ExpertWorker::service_full_name(), "dxs.v1.ExpertWorker");
}

struct FieldSpec {
  const char* message;
  const char* field;
  int number;
};

// Fields that clients and the data path depend on. Changing any number here is a wire
// break; the golden below covers the rest.
const FieldSpec kKeyFields[] = {
    {"dxs.v1.GenerateRequest", "request_id", 1},
    {"dxs.v1.GenerateRequest", "prompt_token_ids", 2},
    {"dxs.v1.GenerateRequest", "sampling_params", 3},
    {"dxs.v1.GenerateRequest", "data_parallel_rank", 4},
    {"dxs.v1.SamplingParams", "max_new_tokens", 1},
    {"dxs.v1.SamplingParams", "temperature", 2},
    {"dxs.v1.SamplingParams", "top_p", 3},
    {"dxs.v1.SamplingParams", "top_k", 4},
    {"dxs.v1.SamplingParams", "seed", 5},
    {"dxs.v1.SamplingParams", "stop_token_ids", 6},
    {"dxs.v1.SamplingParams", "ignore_eos", 7},
    {"dxs.v1.SamplingParams", "min_p", 8},
    {"dxs.v1.SamplingParams", "frequency_penalty", 9},
    {"dxs.v1.SamplingParams", "presence_penalty", 10},
    {"dxs.v1.SamplingParams", "repetition_penalty", 11},
    {"dxs.v1.SamplingParams", "logit_bias", 12},
    {"dxs.v1.SamplingParams", "min_new_tokens", 13},
    {"dxs.v1.SamplingParams", "logprobs", 14},
    {"dxs.v1.SamplingParams", "top_logprobs", 15},
    {"dxs.v1.SamplingParams", "logprob_token_ids", 16},
    {"dxs.v1.SamplingParams", "prompt_logprobs_start", 17},
    {"dxs.v1.SamplingParams", "n", 18},
    {"dxs.v1.GenerateResponse", "request_id", 1},
    {"dxs.v1.GenerateResponse", "chunk", 2},
    {"dxs.v1.GenerateResponse", "complete", 3},
    {"dxs.v1.TokenChunk", "token_ids", 1},
    {"dxs.v1.TokenChunk", "index", 2},
    {"dxs.v1.TokenChunk", "logprobs", 3},
    {"dxs.v1.TokenChunk", "prompt_logprobs", 4},
    {"dxs.v1.TokenChunk", "sample_index", 5},
    {"dxs.v1.TokenLogprobs", "logprob", 1},
    {"dxs.v1.TokenLogprobs", "top_logprobs", 2},
    {"dxs.v1.TokenLogprobs", "token_ids_logprobs", 3},
    {"dxs.v1.TopLogprob", "token_id", 1},
    {"dxs.v1.TopLogprob", "logprob", 2},
    {"dxs.v1.PromptLogprobs", "first_position", 1},
    {"dxs.v1.PromptLogprobs", "token_ids", 2},
    {"dxs.v1.PromptLogprobs", "positions", 3},
    {"dxs.v1.PromptLogprobs", "next", 4},
    {"dxs.v1.GenerateComplete", "finish_reason", 1},
    {"dxs.v1.GenerateComplete", "prompt_tokens", 2},
    {"dxs.v1.GenerateComplete", "completion_tokens", 3},
    {"dxs.v1.GenerateComplete", "samples", 7},
    {"dxs.v1.SampleComplete", "sample_index", 1},
    {"dxs.v1.SampleComplete", "finish_reason", 2},
    {"dxs.v1.SampleComplete", "completion_tokens", 3},
    {"dxs.v1.SampleComplete", "matched_stop_token_id", 4},
    {"dxs.v1.AbortRequest", "request_id", 1},
    {"dxs.v1.ModelInfo", "vocab_size", 3},
    {"dxs.v1.ModelInfo", "max_context_length", 4},
    {"dxs.v1.ModelInfo", "eos_token_ids", 9},
    {"dxs.v1.RankLoad", "rank", 1},
    {"dxs.v1.RankLoad", "num_running_requests", 2},
    {"dxs.v1.RankLoad", "num_queued_requests", 3},
    {"dxs.v1.RankLoad", "kv_cache_used_tokens", 4},
    {"dxs.v1.RankLoad", "kv_cache_total_tokens", 5},
    {"dxs.v1.RankLoad", "tokens_per_second", 6},
    {"dxs.v1.RankLoad", "num_outstanding_tokens", 7},
    {"dxs.v1.RegisterRequest", "role", 1},
    {"dxs.v1.RegisterRequest", "rank", 2},
    {"dxs.v1.RegisterRequest", "grpc_address", 3},
    {"dxs.v1.RegisterRequest", "transport", 5},
    {"dxs.v1.RegisterRequest", "fingerprint", 6},
    {"dxs.v1.ClusterView", "version", 1},
    {"dxs.v1.ClusterView", "workers", 2},
    {"dxs.v1.ClusterView", "placement", 3},
    {"dxs.v1.ClusterView", "transport", 4},
    {"dxs.v1.ExpertPlacement", "version", 1},
    {"dxs.v1.ExpertPlacement", "num_experts", 3},
    {"dxs.v1.ExpertPlacement", "expert_to_rank", 5},
    {"dxs.v1.ExpertReplicas", "ep_ranks", 1},
    {"dxs.v1.TransportConfig", "backend", 1},
    {"dxs.v1.TransportConfig", "wire_dtype", 2},
    {"dxs.v1.TransportConfig", "nccl_unique_id", 3},
    {"dxs.v1.TransportAddress", "ucx_worker_address", 1},
    {"dxs.v1.StepCounters", "steps_total", 1},
    {"dxs.v1.StepCounters", "empty_steps_total", 2},
    {"dxs.v1.HeartbeatRequest", "counters", 3},
};

TEST(ProtoContractTest, KeyFieldNumbersAreAsDocumented) {
  for (const FieldSpec& spec : kKeyFields) {
    const Descriptor* message = Pool().FindMessageTypeByName(spec.message);
    ASSERT_NE(message, nullptr) << spec.message;
    const FieldDescriptor* field = message->FindFieldByName(spec.field);
    ASSERT_NE(field, nullptr) << spec.message << "." << spec.field;
    EXPECT_EQ(field->number(), spec.number) << spec.message << "." << spec.field;
  }
}

TEST(ProtoContractTest, GenerateShapes) {
  const Descriptor* request = v1::GenerateRequest::descriptor();
  const FieldDescriptor* prompt = request->FindFieldByName("prompt_token_ids");
  EXPECT_TRUE(prompt->is_repeated());
  EXPECT_TRUE(prompt->is_packed());
  EXPECT_EQ(prompt->type(), FieldDescriptor::TYPE_UINT32);
  EXPECT_TRUE(request->FindFieldByName("data_parallel_rank")->has_optional_keyword());

  const Descriptor* sampling = v1::SamplingParams::descriptor();
  EXPECT_TRUE(sampling->FindFieldByName("seed")->has_optional_keyword());
  EXPECT_EQ(sampling->FindFieldByName("seed")->type(), FieldDescriptor::TYPE_UINT64);
  EXPECT_TRUE(sampling->FindFieldByName("temperature")->has_optional_keyword());
  // Unset differs from the zero value: min_p and repetition_penalty default to off (0, 1),
  // and position 0 is a valid prompt_logprobs_start.
  for (const char* name : {"min_p", "repetition_penalty", "prompt_logprobs_start"}) {
    EXPECT_TRUE(sampling->FindFieldByName(name)->has_optional_keyword()) << name;
  }
  EXPECT_TRUE(sampling->FindFieldByName("logit_bias")->is_map());
  // Log-probabilities travel with their tokens.
  const Descriptor* chunk = v1::TokenChunk::descriptor();
  EXPECT_TRUE(chunk->FindFieldByName("logprobs")->is_repeated());
  EXPECT_EQ(chunk->FindFieldByName("logprobs")->message_type(), v1::TokenLogprobs::descriptor());
  EXPECT_EQ(chunk->FindFieldByName("prompt_logprobs")->message_type(),
            v1::PromptLogprobs::descriptor());
  // n samples: 0 (unset) is one; each chunk names its sample, the end lists the others'.
  EXPECT_EQ(sampling->FindFieldByName("n")->type(), FieldDescriptor::TYPE_UINT32);
  EXPECT_FALSE(sampling->FindFieldByName("n")->has_optional_keyword());
  EXPECT_EQ(chunk->FindFieldByName("sample_index")->type(), FieldDescriptor::TYPE_UINT32);
  const FieldDescriptor* samples = v1::GenerateComplete::descriptor()->FindFieldByName("samples");
  EXPECT_TRUE(samples->is_repeated());
  EXPECT_EQ(samples->message_type(), v1::SampleComplete::descriptor());
  EXPECT_TRUE(v1::SampleComplete::descriptor()
                  ->FindFieldByName("matched_stop_token_id")
                  ->has_optional_keyword());

  // A stream message is either tokens or the end, never both.
  const Descriptor* response = v1::GenerateResponse::descriptor();
  const auto* oneof = response->FindOneofByName("response");
  ASSERT_NE(oneof, nullptr);
  ASSERT_EQ(oneof->field_count(), 2);
  EXPECT_EQ(oneof->field(0)->message_type(), v1::TokenChunk::descriptor());
  EXPECT_EQ(oneof->field(1)->message_type(), v1::GenerateComplete::descriptor());
}

TEST(ProtoContractTest, EnumValuesAreAsDocumented) {
  EXPECT_EQ(v1::FINISH_REASON_UNSPECIFIED, 0);
  EXPECT_EQ(v1::FINISH_REASON_STOP_EOS, 1);
  EXPECT_EQ(v1::FINISH_REASON_STOP_TOKEN, 2);
  EXPECT_EQ(v1::FINISH_REASON_LENGTH, 3);
  EXPECT_EQ(v1::FINISH_REASON_CONTEXT_LENGTH, 4);
  EXPECT_EQ(v1::FINISH_REASON_ABORTED, 5);
  EXPECT_EQ(v1::ROLE_UNSPECIFIED, 0);
  EXPECT_EQ(v1::ROLE_ATTENTION, 1);
  EXPECT_EQ(v1::ROLE_EXPERT, 2);
  EXPECT_EQ(v1::DTYPE_FLOAT32, 1);
  EXPECT_EQ(v1::DTYPE_BFLOAT16, 2);
  EXPECT_EQ(v1::DTYPE_FLOAT16, 3);
  EXPECT_EQ(v1::WORKER_STATE_READY, 2);
  EXPECT_EQ(v1::WORKER_STATE_DEAD, 4);
}

// ---- Golden snapshot of the whole API -------------------------------------------------

std::string FieldTypeName(const FieldDescriptor* field) {
  if (field->message_type() != nullptr) return field->message_type()->full_name();
  if (field->enum_type() != nullptr) return field->enum_type()->full_name();
  return field->type_name();
}

void AppendEnum(const EnumDescriptor* e, std::vector<std::string>* lines) {
  for (int i = 0; i < e->value_count(); ++i) {
    lines->push_back("value " + e->full_name() + "." + e->value(i)->name() + " = " +
                     std::to_string(e->value(i)->number()));
  }
}

void AppendMessage(const Descriptor* m, std::vector<std::string>* lines) {
  lines->push_back("message " + m->full_name());
  for (int i = 0; i < m->field_count(); ++i) {
    const FieldDescriptor* f = m->field(i);
    std::string line =
        "field " + m->full_name() + "." + f->name() + " = " + std::to_string(f->number()) + " ";
    if (f->is_map()) {
      line += "map<" + FieldTypeName(f->message_type()->map_key()) + ", " +
              FieldTypeName(f->message_type()->map_value()) + ">";
    } else {
      if (f->is_repeated()) line += "repeated ";
      if (f->has_optional_keyword()) line += "optional ";
      line += FieldTypeName(f);
    }
    if (f->real_containing_oneof() != nullptr) {
      line += " oneof " + f->real_containing_oneof()->name();
    }
    lines->push_back(line);
  }
  for (int i = 0; i < m->enum_type_count(); ++i) AppendEnum(m->enum_type(i), lines);
  for (int i = 0; i < m->nested_type_count(); ++i) {
    // A map's entry type is implied by the map field's line.
    if (!m->nested_type(i)->options().map_entry()) AppendMessage(m->nested_type(i), lines);
  }
}

// One line per message, field, enum value and RPC, in declaration order.
std::vector<std::string> ApiSnapshot() {
  std::vector<std::string> lines;
  for (const FileDescriptor* file : DxsFiles()) {
    lines.push_back("file " + file->name());
    for (int i = 0; i < file->enum_type_count(); ++i) AppendEnum(file->enum_type(i), &lines);
    for (int i = 0; i < file->message_type_count(); ++i) {
      AppendMessage(file->message_type(i), &lines);
    }
    for (int i = 0; i < file->service_count(); ++i) {
      const ServiceDescriptor* s = file->service(i);
      for (int j = 0; j < s->method_count(); ++j) {
        const MethodDescriptor* m = s->method(j);
        lines.push_back("rpc " + s->full_name() + "." + m->name() + "(" +
                        (m->client_streaming() ? "stream " : "") + m->input_type()->full_name() +
                        ") returns (" + (m->server_streaming() ? "stream " : "") +
                        m->output_type()->full_name() + ")");
      }
    }
  }
  return lines;
}

std::string GoldenPath() {
  const char* dir = std::getenv("DXS_SOURCE_DIR");
  return std::string(dir != nullptr ? dir : DXS_SOURCE_DIR_DEFAULT) +
         "/tests/proto/testdata/dxs_v1_api.golden";
}

// "field <message>.<name> = <n> ..." or "value <enum>.<name> = <n>".
struct NumberedEntry {
  std::string kind, parent, name;
  int number = 0;
};

bool ParseNumbered(const std::string& line, NumberedEntry* entry) {
  std::istringstream in(line);
  std::string full_name, eq;
  if (!(in >> entry->kind >> full_name >> eq >> entry->number) || eq != "=") return false;
  if (entry->kind != "field" && entry->kind != "value") return false;
  const size_t dot = full_name.rfind('.');
  entry->parent = full_name.substr(0, dot);
  entry->name = full_name.substr(dot + 1);
  return true;
}

TEST(ProtoContractTest, ApiMatchesGoldenAndNumbersNeverChange) {
  std::vector<std::string> golden;
  {
    std::ifstream in(GoldenPath());
    ASSERT_TRUE(in.good()) << "cannot read " << GoldenPath();
    for (std::string line; std::getline(in, line);) {
      if (!line.empty() && line[0] != '#') golden.push_back(line);
    }
  }

  // Identity checks hold even when regenerating the golden: a field or enum value keeps
  // its number forever, and one that disappears leaves its number and name reserved.
  for (const std::string& line : golden) {
    NumberedEntry e;
    if (!ParseNumbered(line, &e)) continue;
    if (e.kind == "field") {
      const Descriptor* message = Pool().FindMessageTypeByName(e.parent);
      if (message == nullptr) continue;  // whole message gone: the snapshot diff reports it
      const FieldDescriptor* field = message->FindFieldByName(e.name);
      if (field != nullptr) {
        EXPECT_EQ(field->number(), e.number) << "renumbered: " << line;
      } else {
        EXPECT_TRUE(message->IsReservedNumber(e.number) && message->IsReservedName(e.name))
            << "removed without `reserved " << e.number << "; reserved \"" << e.name
            << "\";`: " << line;
      }
    } else {
      const EnumDescriptor* enum_type = Pool().FindEnumTypeByName(e.parent);
      if (enum_type == nullptr) continue;
      const auto* value = enum_type->FindValueByName(e.name);
      if (value != nullptr) {
        EXPECT_EQ(value->number(), e.number) << "renumbered: " << line;
      } else {
        EXPECT_TRUE(enum_type->IsReservedNumber(e.number) && enum_type->IsReservedName(e.name))
            << "removed without reserved: " << line;
      }
    }
  }

  const std::vector<std::string> current = ApiSnapshot();
  if (std::getenv("DXS_UPDATE_GOLDEN") != nullptr) {
    if (HasFailure()) return;
    std::ofstream out(GoldenPath());
    out << "# dxs.v1 API snapshot, checked by tests/proto/contract_test.cc.\n"
        << "# Regenerate after a compatible change: DXS_UPDATE_GOLDEN=1 proto_contract_test\n";
    for (const std::string& line : current) out << line << "\n";
    ASSERT_TRUE(out.good()) << "cannot write " << GoldenPath();
    return;
  }
  const std::set<std::string> golden_set(golden.begin(), golden.end());
  const std::set<std::string> current_set(current.begin(), current.end());
  for (const std::string& line : golden) {
    EXPECT_TRUE(current_set.count(line)) << "changed or removed since the golden: " << line;
  }
  for (const std::string& line : current) {
    EXPECT_TRUE(golden_set.count(line))
        << "not in the golden (DXS_UPDATE_GOLDEN=1 to accept a compatible addition): " << line;
  }
}

// ---- Comments, read from the descriptor set protoc wrote with --include_source_info ----

class CommentChecker {
 public:
  template <typename D>
  void Require(const D* d) {
    SourceLocation loc;
    if (!d->GetSourceLocation(&loc) ||
        (Trimmed(loc.leading_comments).empty() && Trimmed(loc.trailing_comments).empty())) {
      missing_.push_back(d->full_name());
    }
  }
  void RequireStatusCodes(const MethodDescriptor* m) {
    SourceLocation loc;
    if (!m->GetSourceLocation(&loc) ||
        loc.leading_comments.find("Status codes") == std::string::npos) {
      missing_status_codes_.push_back(m->full_name());
    }
  }
  void Message(const Descriptor* m) {
    // A map's entry type is generated, with no source of its own: the map field's comment
    // is its documentation.
    if (m->options().map_entry()) return;
    Require(m);
    for (int i = 0; i < m->field_count(); ++i) Require(m->field(i));
    for (int i = 0; i < m->real_oneof_decl_count(); ++i) Require(m->oneof_decl(i));
    for (int i = 0; i < m->enum_type_count(); ++i) Enum(m->enum_type(i));
    for (int i = 0; i < m->nested_type_count(); ++i) Message(m->nested_type(i));
  }
  void Enum(const EnumDescriptor* e) {
    Require(e);
    for (int i = 0; i < e->value_count(); ++i) Require(e->value(i));
  }
  const std::vector<std::string>& missing() const { return missing_; }
  const std::vector<std::string>& missing_status_codes() const { return missing_status_codes_; }

 private:
  static std::string Trimmed(const std::string& s) {
    const size_t begin = s.find_first_not_of(" \n\t");
    return begin == std::string::npos ? "" : s.substr(begin);
  }
  std::vector<std::string> missing_;
  std::vector<std::string> missing_status_codes_;
};

std::string Join(const std::vector<std::string>& items) {
  std::string out;
  for (const std::string& item : items) out += "\n  " + item;
  return out;
}

TEST(ProtoContractTest, EveryElementIsCommentedAndEveryRpcListsStatusCodes) {
  google::protobuf::FileDescriptorSet set;
  {
    std::ifstream in(DXS_PROTO_DESCRIPTOR_SET, std::ios::binary);
    ASSERT_TRUE(in.good()) << "cannot read " << DXS_PROTO_DESCRIPTOR_SET;
    ASSERT_TRUE(set.ParseFromIstream(&in));
  }
  DescriptorPool pool;
  CommentChecker checker;
  int num_dxs_files = 0;
  for (const google::protobuf::FileDescriptorProto& proto : set.file()) {
    const FileDescriptor* file = pool.BuildFile(proto);  // imports come first in the set
    ASSERT_NE(file, nullptr) << proto.name();
    if (file->package() != "dxs.v1") continue;
    ++num_dxs_files;

    // File header: a comment block above `syntax` (path {12} in FileDescriptorProto).
    bool has_header = false;
    for (const auto& loc : proto.source_code_info().location()) {
      if (loc.path_size() == 1 && loc.path(0) == 12) {
        has_header = loc.leading_detached_comments_size() > 0 || loc.has_leading_comments();
      }
    }
    EXPECT_TRUE(has_header) << proto.name() << " has no header comment";

    for (int i = 0; i < file->enum_type_count(); ++i) checker.Enum(file->enum_type(i));
    for (int i = 0; i < file->message_type_count(); ++i) checker.Message(file->message_type(i));
    for (int i = 0; i < file->service_count(); ++i) {
      checker.Require(file->service(i));
      for (int j = 0; j < file->service(i)->method_count(); ++j) {
        checker.Require(file->service(i)->method(j));
        checker.RequireStatusCodes(file->service(i)->method(j));
      }
    }
  }
  EXPECT_EQ(num_dxs_files, 5);
  EXPECT_TRUE(checker.missing().empty()) << "no comment on:" << Join(checker.missing());
  EXPECT_TRUE(checker.missing_status_codes().empty())
      << "RPC comment does not list its \"Status codes\":" << Join(checker.missing_status_codes());
}

}  // namespace
}  // namespace dxs
