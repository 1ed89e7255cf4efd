#include "router/frontend/sglang_scheduler_service.h"

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/grpc/status_conversion.h"
#include "google/protobuf/util/time_util.h"
#include "nlohmann/json.hpp"

namespace dxs {
namespace {

grpc::Status Unimplemented(const std::string& what) {
  return grpc::Status(grpc::StatusCode::UNIMPLEMENTED, what);
}

void SetNumber(google::protobuf::Struct& s, const std::string& key, double value) {
  (*s.mutable_fields())[key].set_number_value(value);
}
void SetString(google::protobuf::Struct& s, const std::string& key, const std::string& value) {
  (*s.mutable_fields())[key].set_string_value(value);
}
void SetBool(google::protobuf::Struct& s, const std::string& key, bool value) {
  (*s.mutable_fields())[key].set_bool_value(value);
}

bool Wants(const sglang::GetLoadsRequest& request, const std::string& section) {
  for (const std::string& s : request.include()) {
    if (s == section || s == "all") return true;
  }
  return false;
}

}  // namespace

void ReadThinkTokenIds(const std::string& model_dir, SglangModelFacts& facts) {
  std::ifstream in(std::filesystem::path(model_dir) / "tokenizer.json");
  if (!in) return;
  const nlohmann::json tokenizer = nlohmann::json::parse(in, nullptr, /*allow_exceptions=*/false);
  if (!tokenizer.is_object() || !tokenizer.contains("added_tokens") ||
      !tokenizer["added_tokens"].is_array()) {
    return;
  }
  for (const nlohmann::json& token : tokenizer["added_tokens"]) {
    if (!token.is_object() || !token.contains("id") || !token["id"].is_number_unsigned()) continue;
    const std::string content = token.value("content", "");
    if (content == "<think>") facts.think_start_token_id = token["id"].get<uint32_t>();
    if (content == "</think>") facts.think_end_token_id = token["id"].get<uint32_t>();
  }
}

namespace {

SglangModelFacts ModelFacts(const ModelConfig& config, const std::string& model_dir) {
  SglangModelFacts facts;
  facts.max_context_length = config.max_position_embeddings;
  ReadThinkTokenIds(model_dir, facts);
  return facts;
}

}  // namespace

SglangSchedulerService::SglangSchedulerService(FrontendService* frontend, const ModelConfig& config,
                                               SglangSchedulerOptions options)
    : frontend_(frontend),
      config_(config),
      options_(std::move(options)),
      facts_(ModelFacts(config, options_.model_dir)),
      start_time_(absl::Now()) {}

grpc::Status SglangSchedulerService::Generate(
    grpc::ServerContext* context, const sglang::GenerateRequest* request,
    grpc::ServerWriter<sglang::GenerateResponse>* writer) {
  absl::StatusOr<v1::GenerateRequest> translated = ToDxsGenerateRequest(*request, facts_);
  if (!translated.ok()) return ToGrpcStatus(translated.status());
  // The gateway times the first token from the response headers: they go out now, not with
  // the first token, or its time to first token would read zero.
  writer->SendInitialMetadata();
  const int num_samples = std::max<int>(static_cast<int>(translated->sampling_params().n()), 1);
  SglangResponseTranslator translator(*request, num_samples, facts_,
                                      [writer](const sglang::GenerateResponse& message, bool last) {
                                        if (last) {
                                          writer->WriteLast(message, grpc::WriteOptions());
                                          return true;
                                        }
                                        return writer->Write(message);
                                      });
  return ToGrpcStatus(
      ToSglangStatus(frontend_->ServeGenerate(context, *std::move(translated), translator)));
}

grpc::Status SglangSchedulerService::Abort(grpc::ServerContext*,
                                           const sglang::AbortRequest* request,
                                           sglang::AbortResponse* response) {
  const absl::Status status = frontend_->AbortRequest(request->request_id());
  if (status.ok()) {
    response->set_success(true);
    return grpc::Status::OK;
  }
  if (absl::IsNotFound(status)) {
    // Already finished (the gateway aborts a request whose client went away, which may have
    // ended meanwhile): nothing to stop.
    response->set_success(false);
    response->set_message(std::string(status.message()));
    return grpc::Status::OK;
  }
  return ToGrpcStatus(status);
}

grpc::Status SglangSchedulerService::HealthCheck(grpc::ServerContext*,
                                                 const sglang::HealthCheckRequest*,
                                                 sglang::HealthCheckResponse* response) {
  const bool serving = frontend_->Serving();
  response->set_healthy(serving);
  response->set_message(serving ? "serving"
                                : "not serving: the cluster is incomplete or shutting down");
  return grpc::Status::OK;
}

grpc::Status SglangSchedulerService::GetModelInfo(grpc::ServerContext*,
                                                  const sglang::GetModelInfoRequest*,
                                                  sglang::GetModelInfoResponse* response) {
  absl::StatusOr<v1::ModelInfo> model = frontend_->ServedModel();
  if (!model.ok()) return ToGrpcStatus(model.status());
  response->set_model_path(options_.model_dir);
  response->set_tokenizer_path(options_.model_dir);
  response->set_is_generation(true);
  response->set_weight_version(model->fingerprint().checkpoint_fingerprint());
  response->set_served_model_name(options_.served_model_name);
  response->set_max_context_length(static_cast<int32_t>(config_.max_position_embeddings));
  response->set_vocab_size(static_cast<int32_t>(config_.vocab_size));
  response->set_supports_vision(false);
  response->set_model_type(config_.model_type);
  for (int64_t id : config_.eos_token_ids) response->add_eos_token_ids(static_cast<int32_t>(id));
  response->set_bos_token_id(static_cast<int32_t>(config_.bos_token_id));
  response->set_pad_token_id(config_.bos_token_id >= 0 ? static_cast<int32_t>(config_.bos_token_id)
                                                       : 0);
  response->set_max_req_input_len(static_cast<int32_t>(config_.max_position_embeddings - 1));
  response->add_architectures("Qwen3MoeForCausalLM");
  return grpc::Status::OK;
}

grpc::Status SglangSchedulerService::GetServerInfo(grpc::ServerContext*,
                                                   const sglang::GetServerInfoRequest*,
                                                   sglang::GetServerInfoResponse* response) {
  const v1::GetLoadsResponse loads = frontend_->Loads();
  uint64_t kv_total = 0;
  int active = 0;
  for (const v1::RankLoad& load : loads.loads()) {
    kv_total += load.kv_cache_total_tokens();
    active += static_cast<int>(load.num_running_requests() + load.num_queued_requests());
  }
  google::protobuf::Struct& args = *response->mutable_server_args();
  SetString(args, "model_path", options_.model_dir);
  SetString(args, "tokenizer_path", options_.model_dir);
  SetString(args, "served_model_name", options_.served_model_name);
  SetNumber(args, "tp_size", 1);
  SetNumber(args, "pp_size", 1);
  SetNumber(args, "dp_size", frontend_->num_attention_ranks());
  SetNumber(args, "context_length", static_cast<double>(config_.max_position_embeddings));
  SetNumber(args, "max_total_tokens", static_cast<double>(kv_total));
  SetNumber(args, "max_running_requests", static_cast<double>(frontend_->max_inflight()));
  SetString(args, "load_balance_method", "least_outstanding_tokens");
  SetString(args, "disaggregation_mode", "null");
  SetBool(args, "is_embedding", false);
  SetNumber(args, "vocab_size", static_cast<double>(config_.vocab_size));
  if (absl::StatusOr<v1::ModelInfo> model = frontend_->ServedModel(); model.ok()) {
    SetString(args, "weight_version", model->fingerprint().checkpoint_fingerprint());
  }
  SetString(*response->mutable_scheduler_info(), "engine", "dxs");
  response->set_active_requests(active);
  response->set_is_paused(false);
  response->set_uptime_seconds(absl::ToDoubleSeconds(absl::Now() - start_time_));
  response->set_sglang_version(options_.version);
  response->set_server_type("grpc");
  *response->mutable_start_time() =
      google::protobuf::util::TimeUtil::NanosecondsToTimestamp(absl::ToUnixNanos(start_time_));
  response->set_max_total_num_tokens(static_cast<int32_t>(std::min<uint64_t>(kv_total, INT32_MAX)));
  return grpc::Status::OK;
}

grpc::Status SglangSchedulerService::GetLoads(grpc::ServerContext*,
                                              const sglang::GetLoadsRequest* request,
                                              sglang::GetLoadsResponse* response) {
  if (request->has_dp_rank() &&
      (request->dp_rank() < 0 || request->dp_rank() >= frontend_->num_attention_ranks())) {
    return ToGrpcStatus(absl::InvalidArgumentError(
        absl::StrCat("dp_rank: ", request->dp_rank(), " is not a rank of this cluster (0..",
                     frontend_->num_attention_ranks() - 1, ")")));
  }
  const v1::GetLoadsResponse loads = frontend_->Loads();
  response->set_timestamp(absl::FormatTime(absl::RFC3339_full, absl::Now(), absl::UTCTimeZone()));
  response->set_version(options_.version);
  response->set_dp_rank_count(frontend_->num_attention_ranks());
  sglang::AggregateMetrics& aggregate = *response->mutable_aggregate();
  double usage_sum = 0, throughput_sum = 0;
  int counted = 0;
  for (const v1::RankLoad& load : loads.loads()) {
    if (request->has_dp_rank() && static_cast<int>(load.rank()) != request->dp_rank()) continue;
    sglang::SchedulerLoad& out = *response->add_loads();
    out.set_dp_rank(static_cast<int32_t>(load.rank()));
    out.set_num_running_reqs(static_cast<int32_t>(load.num_running_requests()));
    out.set_num_waiting_reqs(static_cast<int32_t>(load.num_queued_requests()));
    out.set_num_total_reqs(
        static_cast<int32_t>(load.num_running_requests() + load.num_queued_requests()));
    out.set_num_used_tokens(static_cast<int32_t>(load.kv_cache_used_tokens()));
    out.set_max_total_num_tokens(static_cast<int32_t>(load.kv_cache_total_tokens()));
    const double usage =
        load.kv_cache_total_tokens() == 0
            ? 0.0
            : static_cast<double>(load.kv_cache_used_tokens()) / load.kv_cache_total_tokens();
    out.set_token_usage(usage);
    out.set_utilization(usage);
    out.set_gen_throughput(load.tokens_per_second());
    // No prefix cache: nothing is ever served from one.
    out.set_cache_hit_rate(0);
    if (Wants(*request, "memory")) {
      out.mutable_memory()->set_token_capacity(static_cast<int32_t>(load.kv_cache_total_tokens()));
    }
    if (Wants(*request, "queues")) {
      out.mutable_queues()->set_waiting(static_cast<int32_t>(load.num_queued_requests()));
    }
    aggregate.set_total_running_reqs(aggregate.total_running_reqs() + out.num_running_reqs());
    aggregate.set_total_waiting_reqs(aggregate.total_waiting_reqs() + out.num_waiting_reqs());
    aggregate.set_total_reqs(aggregate.total_reqs() + out.num_total_reqs());
    usage_sum += usage;
    throughput_sum += load.tokens_per_second();
    ++counted;
  }
  if (counted > 0) {
    aggregate.set_avg_token_usage(usage_sum / counted);
    aggregate.set_avg_throughput(throughput_sum / counted);
    aggregate.set_avg_utilization(usage_sum / counted);
  }
  return grpc::Status::OK;
}

absl::StatusOr<std::shared_ptr<const TokenizerBundle>> SglangSchedulerService::Bundle() {
  absl::MutexLock lock(&bundle_mu_);
  if (bundle_ != nullptr) return bundle_;
  absl::StatusOr<TokenizerBundle> bundle = MakeTokenizerBundle(options_.model_dir);
  if (!bundle.ok()) return bundle.status();
  bundle_ = std::make_shared<const TokenizerBundle>(*std::move(bundle));
  return bundle_;
}

grpc::Status SglangSchedulerService::GetTokenizer(
    grpc::ServerContext*, const smg::grpc::common::GetTokenizerRequest*,
    grpc::ServerWriter<smg::grpc::common::GetTokenizerChunk>* writer) {
  absl::StatusOr<std::shared_ptr<const TokenizerBundle>> bundle = Bundle();
  if (!bundle.ok()) return ToGrpcStatus(bundle.status());
  const std::string& zip = (*bundle)->zip;
  for (size_t offset = 0; offset < zip.size(); offset += kTokenizerChunkBytes) {
    smg::grpc::common::GetTokenizerChunk chunk;
    const size_t length = std::min(kTokenizerChunkBytes, zip.size() - offset);
    chunk.set_data(zip.substr(offset, length));
    // The digest goes on the final chunk only.
    if (offset + length == zip.size()) chunk.set_sha256((*bundle)->sha256);
    if (!writer->Write(chunk)) {
      return grpc::Status(grpc::StatusCode::CANCELLED, "the caller went away");
    }
  }
  return grpc::Status::OK;
}

grpc::Status SglangSchedulerService::FlushCache(grpc::ServerContext*,
                                                const smg::grpc::common::FlushCacheRequest*,
                                                smg::grpc::common::FlushCacheResponse* response) {
  response->set_success(true);
  response->set_message("dxs keeps no prefix cache: nothing to flush");
  return grpc::Status::OK;
}

grpc::Status SglangSchedulerService::Embed(grpc::ServerContext*, const sglang::EmbedRequest*,
                                           sglang::EmbedResponse*) {
  return Unimplemented("Embed: dxs serves generation models; embeddings are not supported");
}

grpc::Status SglangSchedulerService::SubscribeKvEvents(
    grpc::ServerContext*, const smg::grpc::common::SubscribeKvEventsRequest*,
    grpc::ServerWriter<smg::grpc::common::KvEventBatch>*) {
  return Unimplemented(
      "SubscribeKvEvents: dxs keeps no prefix cache, so it has no KV events; use a load-based "
      "policy (least_load, power_of_two), which polls GetLoads");
}

grpc::Status SglangSchedulerService::StartProfile(grpc::ServerContext*,
                                                  const smg::grpc::common::StartProfileRequest*,
                                                  smg::grpc::common::ProfileResponse*) {
  return Unimplemented("StartProfile: profiling through the gateway is not supported");
}

grpc::Status SglangSchedulerService::StopProfile(grpc::ServerContext*,
                                                 const smg::grpc::common::StopProfileRequest*,
                                                 smg::grpc::common::ProfileResponse*) {
  return Unimplemented("StopProfile: profiling through the gateway is not supported");
}

grpc::Status SglangSchedulerService::LoadLoRAAdapter(grpc::ServerContext*,
                                                     const sglang::LoadLoRAAdapterRequest*,
                                                     sglang::LoadLoRAAdapterResponse*) {
  return Unimplemented("LoadLoRAAdapter: LoRA adapters are not supported");
}

grpc::Status SglangSchedulerService::UnloadLoRAAdapter(grpc::ServerContext*,
                                                       const sglang::UnloadLoRAAdapterRequest*,
                                                       sglang::UnloadLoRAAdapterResponse*) {
  return Unimplemented("UnloadLoRAAdapter: LoRA adapters are not supported");
}

grpc::Status SglangSchedulerService::ListLoadedLoRAAdapters(
    grpc::ServerContext*, const sglang::ListLoadedLoRAAdaptersRequest*,
    sglang::ListLoadedLoRAAdaptersResponse*) {
  // None is ever loaded.
  return grpc::Status::OK;
}

}  // namespace dxs
