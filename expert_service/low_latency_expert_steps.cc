#include "expert_service/low_latency_expert_steps.h"

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "dataplane/low_latency/low_latency_moe_executor.h"

namespace dxs {

void LowLatencyExpertSteps::Drop() {
  rounds_.reset();
  exchange_.reset();
}

absl::Status LowLatencyExpertSteps::Make(const WireHeader& first,
                                         const std::vector<std::string>& keys) {
  if (first.num_experts != config_.num_experts || first.ll_ranks < 1 ||
      first.ll_rank >= first.ll_ranks || first.ll_capacity < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("low-latency exchange of ", first.num_experts, " experts, capacity ",
                     first.ll_capacity, ", expert rank ", first.ll_rank, " of ", first.ll_ranks,
                     ", for a model of ", config_.num_experts, " experts"));
  }
  const LowLatencyShape shape = LowLatencyShapeOf(
      config_, static_cast<int>(keys.size()), first.ll_ranks, first.ll_capacity, first.fp8_rows());
  DXS_ASSIGN_OR_RETURN(exchange_, MakeLowLatencyExchange(shard_->backend(), shape,
                                                         LowLatencySide::kExpert, first.ll_rank));
  DXS_RETURN_IF_ERROR(exchange_->Connect(keys));
  // Warms every layer's experts up (LowLatencyExpertRounds::Make) before the answer: the
  // DP ranks' waits count from their first dispatch, which follows it.
  DXS_ASSIGN_OR_RETURN(rounds_, LowLatencyExpertRounds::Make(config_, shard_, exchange_.get()));
  generation_ = first.ll_generation;
  return absl::OkStatus();
}

absl::Status LowLatencyExpertSteps::Answer(const std::vector<int>& dp_peers,
                                           const WireHeader& first, const std::string& key) {
  WireHeader answer;
  answer.kind = MessageKind::kLowLatencyRegion;
  answer.step = first.step;
  answer.ll_generation = first.ll_generation;
  const std::string encoded = answer.Encode();
  absl::Status sent;
  for (int peer : dp_peers) {
    absl::Status s = transport_->Send(peer, encoded, key.data(), key.size());
    if (sent.ok()) sent = s;  // the other DP ranks are answered all the same
  }
  return sent;
}

absl::Status LowLatencyExpertSteps::Serve(const std::vector<int>& dp_peers,
                                          const std::vector<WireHeader>& headers,
                                          const std::vector<std::string>& keys) {
  if (headers.empty() || headers.size() != dp_peers.size() || keys.size() != headers.size()) {
    return absl::InvalidArgumentError("low-latency step: one message per DP rank expected");
  }
  const WireHeader& first = headers[0];
  const bool connect = (first.flags & WireHeader::kConnect) != 0;
  for (size_t i = 0; i < headers.size(); ++i) {
    const WireHeader& h = headers[i];
    if (h.kind != MessageKind::kLowLatencyStep ||
        ((h.flags & WireHeader::kConnect) != 0) != connect ||
        h.ll_generation != first.ll_generation || h.ll_capacity != first.ll_capacity ||
        h.ll_ranks != first.ll_ranks || h.ll_rank != first.ll_rank ||
        h.num_experts != first.num_experts || h.fp8_rows() != first.fp8_rows() ||
        (connect && keys[i].empty())) {
      Drop();
      return absl::InternalError(absl::StrCat("step ", first.step, ": DP peer ", dp_peers[i],
                                              "'s low-latency message disagrees with DP peer ",
                                              dp_peers[0], "'s (generation ", h.ll_generation,
                                              " vs ", first.ll_generation, ")"));
    }
  }
  if (connect) {
    Drop();
    const absl::Status made = Make(first, keys);
    if (!made.ok()) Drop();
    DXS_RETURN_IF_ERROR(Answer(dp_peers, first, made.ok() ? exchange_->region_key() : ""));
    if (!made.ok()) {
      return absl::Status(made.code(),
                          absl::StrCat("step ", first.step,
                                       ": no low-latency exchange on this rank: ", made.message()));
    }
  } else if (exchange_ == nullptr || first.ll_generation != generation_ ||
             exchange_->shape().fp8_rows != first.fp8_rows()) {
    // The DP ranks' waits time out and they make a new generation.
    return absl::FailedPreconditionError(
        absl::StrCat("step ", first.step, ": low-latency generation ", first.ll_generation,
                     ", this rank holds ", generation()));
  }
  absl::Status ran = rounds_->Step();
  if (!ran.ok()) {
    Drop();
    return absl::Status(ran.code(), absl::StrCat("low-latency step ", first.step, " (generation ",
                                                 first.ll_generation, "): ", ran.message()));
  }
  return absl::OkStatus();
}

}  // namespace dxs
