// AttentionStubs: the router's gRPC channels to the attention workers, one per DP rank,
// cached by address. A rank whose worker comes back on another address gets a new
// channel; calls still running on the old one keep it alive (stubs are shared).
//
// Channels send keepalive pings during calls, so a worker that vanishes without closing
// its connections fails its streams with UNAVAILABLE within seconds.
//
// Thread safety: Get may be called from any thread.
#pragma once

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "dxs/v1/attention_worker.grpc.pb.h"
#include "grpcpp/security/credentials.h"

namespace dxs {

class AttentionStubs {
 public:
  // `credentials` secure the channels; null means plaintext.
  AttentionStubs(int num_ranks, std::shared_ptr<grpc::ChannelCredentials> credentials = nullptr);

  // The stub for `rank`'s worker at `address` (host:port), creating the channel the first
  // time and whenever the address differs from the cached one.
  std::shared_ptr<v1::AttentionWorker::Stub> Get(int rank, const std::string& address);

 private:
  std::shared_ptr<grpc::ChannelCredentials> credentials_;
  absl::Mutex mu_;
  // Per rank: (address, stub) last used.
  std::vector<std::pair<std::string, std::shared_ptr<v1::AttentionWorker::Stub>>> stubs_
      ABSL_GUARDED_BY(mu_);
};

}  // namespace dxs
