// SglangSchedulerService: sglang.grpc.scheduler.SglangScheduler, the gRPC protocol the SMG
// gateway (and SGLang's, vLLM's and TensorRT-LLM's engines) speak, served by dxs-router
// beside dxs.v1.Frontend on the same port. The gateway holds the tokenizer and the chat
// template and serves OpenAI's API; the router takes token ids.
//
// Generate goes through the router's one request path: the request is translated
// (router/frontend/sglang_translation.h: what dxs cannot honour is refused by name), then
// FrontendService::ServeGenerate validates, admits and relays it as a dxs.v1 request, and
// the dxs.v1 messages are translated back. Abort, GetLoads and the model's facts come from
// the same FrontendService.
//
// RPCs:
//   Generate       streaming and not; n samples; logprobs; penalties (see the translation)
//   Abort          stops the request; an id not in flight answers success=false
//   HealthCheck    healthy while the cluster is complete (every rank live)
//   GetModelInfo   the router's config.json: EOS ids, context length, vocabulary,
//                  architectures, served model name, and model_path/tokenizer_path (the
//                  router's model directory: a gateway on the same host reads the
//                  tokenizer from it; one elsewhere falls back to GetTokenizer)
//   GetServerInfo  server_args (dp_size = attention ranks, ep_size = expert ranks, ...)
//   GetLoads       per DP rank: running, waiting, KV tokens used and held, token usage,
//                  tokens/s
//   GetTokenizer   the model directory's tokenizer files as a zip with its SHA-256
//   FlushCache     success: dxs keeps no prefix cache, so there is nothing to flush
//   the rest       UNIMPLEMENTED, saying what is not supported (embeddings, LoRA, KV
//                  events, profiling)
#pragma once

#include <memory>
#include <optional>
#include <string>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/model_config.h"
#include "router/frontend/frontend_service.h"
#include "router/frontend/sglang_translation.h"
#include "router/frontend/tokenizer_bundle.h"
#include "sglang_scheduler.grpc.pb.h"

namespace dxs {

struct SglangSchedulerOptions {
  // The router's checkpoint directory (config.json, tokenizer files).
  std::string model_dir;
  // The name OpenAI clients put in `model`; GetModelInfo and GetServerInfo report it.
  std::string served_model_name;
  // Reported as the version (GetServerInfo.sglang_version, GetLoads.version).
  std::string version;
};

class SglangSchedulerService final : public sglang::SglangScheduler::Service {
 public:
  // The name health checks use for this service.
  static constexpr char kServiceName[] = "sglang.grpc.scheduler.SglangScheduler";
  // GetTokenizer's chunk size: well under gRPC's 4 MiB message limit.
  static constexpr size_t kTokenizerChunkBytes = 64 * 1024;

  // `frontend` is not owned and must outlive the service.
  SglangSchedulerService(FrontendService* frontend, const ModelConfig& config,
                         SglangSchedulerOptions options);

  grpc::Status Generate(grpc::ServerContext* context, const sglang::GenerateRequest* request,
                        grpc::ServerWriter<sglang::GenerateResponse>* writer) override;
  grpc::Status Abort(grpc::ServerContext* context, const sglang::AbortRequest* request,
                     sglang::AbortResponse* response) override;
  grpc::Status HealthCheck(grpc::ServerContext* context, const sglang::HealthCheckRequest* request,
                           sglang::HealthCheckResponse* response) override;
  grpc::Status GetModelInfo(grpc::ServerContext* context,
                            const sglang::GetModelInfoRequest* request,
                            sglang::GetModelInfoResponse* response) override;
  grpc::Status GetServerInfo(grpc::ServerContext* context,
                             const sglang::GetServerInfoRequest* request,
                             sglang::GetServerInfoResponse* response) override;
  grpc::Status GetLoads(grpc::ServerContext* context, const sglang::GetLoadsRequest* request,
                        sglang::GetLoadsResponse* response) override;
  grpc::Status GetTokenizer(
      grpc::ServerContext* context, const smg::grpc::common::GetTokenizerRequest* request,
      grpc::ServerWriter<smg::grpc::common::GetTokenizerChunk>* writer) override;
  grpc::Status FlushCache(grpc::ServerContext* context,
                          const smg::grpc::common::FlushCacheRequest* request,
                          smg::grpc::common::FlushCacheResponse* response) override;
  grpc::Status Embed(grpc::ServerContext* context, const sglang::EmbedRequest* request,
                     sglang::EmbedResponse* response) override;
  grpc::Status SubscribeKvEvents(
      grpc::ServerContext* context, const smg::grpc::common::SubscribeKvEventsRequest* request,
      grpc::ServerWriter<smg::grpc::common::KvEventBatch>* writer) override;
  grpc::Status StartProfile(grpc::ServerContext* context,
                            const smg::grpc::common::StartProfileRequest* request,
                            smg::grpc::common::ProfileResponse* response) override;
  grpc::Status StopProfile(grpc::ServerContext* context,
                           const smg::grpc::common::StopProfileRequest* request,
                           smg::grpc::common::ProfileResponse* response) override;
  grpc::Status LoadLoRAAdapter(grpc::ServerContext* context,
                               const sglang::LoadLoRAAdapterRequest* request,
                               sglang::LoadLoRAAdapterResponse* response) override;
  grpc::Status UnloadLoRAAdapter(grpc::ServerContext* context,
                                 const sglang::UnloadLoRAAdapterRequest* request,
                                 sglang::UnloadLoRAAdapterResponse* response) override;
  grpc::Status ListLoadedLoRAAdapters(grpc::ServerContext* context,
                                      const sglang::ListLoadedLoRAAdaptersRequest* request,
                                      sglang::ListLoadedLoRAAdaptersResponse* response) override;

 private:
  // Built on first use and kept: the files do not change while the router runs.
  absl::StatusOr<std::shared_ptr<const TokenizerBundle>> Bundle();

  FrontendService* const frontend_;
  const ModelConfig config_;
  const SglangSchedulerOptions options_;
  const SglangModelFacts facts_;
  const absl::Time start_time_;
  absl::Mutex bundle_mu_;
  std::shared_ptr<const TokenizerBundle> bundle_ ABSL_GUARDED_BY(bundle_mu_);
};

// The ids of "<think>" and "</think>" in the tokenizer.json of `model_dir`, where it has
// them (SglangModelFacts).
void ReadThinkTokenIds(const std::string& model_dir, SglangModelFacts& facts);

}  // namespace dxs
