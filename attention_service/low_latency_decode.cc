#include "attention_service/low_latency_decode.h"

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "dataplane/dispatch/wire.h"
#include "model/qwen3_moe.h"

namespace dxs {

absl::StatusOr<std::unique_ptr<LowLatencyDecode>> LowLatencyDecode::Make(
    int dp_rank, int num_dp, int capacity, const ModelConfig& config, Backend* backend,
    Transport* transport, MoeExecutor* host_driven, absl::Duration timeout, bool fp8_rows) {
  if (capacity < 1 || num_dp < 1 || dp_rank < 0 || dp_rank >= num_dp) {
    return absl::InvalidArgumentError(absl::StrCat("low-latency decode: capacity ", capacity,
                                                   ", DP rank ", dp_rank, " of ", num_dp));
  }
  auto ll = std::unique_ptr<LowLatencyDecode>(new LowLatencyDecode(
      dp_rank, num_dp, capacity, config, backend, transport, host_driven, timeout, fp8_rows));
  // Whether this backend has the exchange at all: one for a single expert rank, dropped.
  DXS_RETURN_IF_ERROR(
      MakeLowLatencyExchange(backend, ll->Shape(1), LowLatencySide::kAttention, dp_rank).status());
  const int64_t hidden = config.hidden_size, top_k = config.num_experts_per_tok;
  DXS_ASSIGN_OR_RETURN(ll->empty_x_, backend->Allocate({0, hidden}, DType::kBF16));
  DXS_ASSIGN_OR_RETURN(ll->empty_ids_, backend->Allocate({0, top_k}, DType::kI32));
  DXS_ASSIGN_OR_RETURN(ll->empty_weights_, backend->Allocate({0, top_k}, DType::kF32));
  DXS_ASSIGN_OR_RETURN(ll->empty_out_, backend->Allocate({0, hidden}, DType::kF32));
  return ll;
}

LowLatencyShape LowLatencyDecode::Shape(int num_expert_ranks) const {
  LowLatencyShape shape =
      LowLatencyShapeOf(config_, num_dp_, num_expert_ranks, capacity_, fp8_rows_);
  // A wait gives up at 4/5 of the step timeout, so a step whose peer died fails within
  // the timeout (the host-driven exchange's bound), its status read after the wait.
  shape.timeout_ns = absl::ToInt64Nanoseconds(timeout_) * 4 / 5;
  return shape;
}

bool LowLatencyDecode::Fits(bool decode_shaped, int64_t num_chunks) const {
  if (!available_) return false;
  if (num_chunks == 0) return true;  // an empty rank takes part with zero rows
  return decode_shaped && num_chunks <= Qwen3MoeModel::kMaxGraphBatch &&
         Qwen3MoeModel::PaddedDecodeBatch(num_chunks) <= capacity_;
}

uint32_t LowLatencyDecode::wanted_generation() const {
  return exchange_ != nullptr && !stale_ ? generation_ : generation_ + 1;
}

void LowLatencyDecode::Drop() {
  moe_.Use(nullptr);
  executor_.reset();
  exchange_.reset();
  expert_peers_.clear();
  stale_ = true;
}

absl::Status LowLatencyDecode::Tell(uint64_t step, bool connect) {
  WireHeader h;
  h.kind = MessageKind::kLowLatencyStep;
  h.step = step;
  h.layer = -1;
  h.ll_generation = generation_;
  h.ll_capacity = capacity_;
  h.ll_ranks = static_cast<int32_t>(expert_peers_.size());
  h.num_experts = static_cast<int32_t>(config_.num_experts);
  h.placement_version = placement_version_;
  if (connect) h.flags = WireHeader::kConnect;
  if (fp8_rows_) h.flags |= WireHeader::kFp8Rows;
  const std::string& key = connect ? exchange_->region_key() : std::string();
  for (size_t i = 0; i < expert_peers_.size(); ++i) {
    h.ll_rank = static_cast<int32_t>(i);
    absl::Status sent = transport_->Send(expert_peers_[i], h.Encode(), key.data(), key.size());
    if (!sent.ok()) {
      return absl::UnavailableError(absl::StrCat("low-latency step ", step, " to expert peer ",
                                                 expert_peers_[i], ": ", sent.message()));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<bool> LowLatencyDecode::Connect(uint64_t step, uint32_t generation,
                                               const Placement& placement,
                                               const std::vector<int>& ep_peers) {
  Drop();
  // The expert ranks of the exchange: those holding experts, in EP rank order; each
  // expert's primary replica answers for it.
  std::vector<int> index(placement.num_ranks(), -1);
  for (int r = 0; r < placement.num_ranks(); ++r) {
    if (placement.experts_of(r).empty()) continue;
    if (r >= static_cast<int>(ep_peers.size())) {
      return absl::InternalError(absl::StrCat("placement ", placement.version(), " has EP rank ", r,
                                              " and only ", ep_peers.size(),
                                              " EP peers are known"));
    }
    index[r] = static_cast<int>(expert_peers_.size());
    expert_peers_.push_back(ep_peers[r]);
  }
  if (expert_peers_.empty() || placement.num_experts() != config_.num_experts) {
    return absl::FailedPreconditionError(
        absl::StrCat("placement ", placement.version(), " places no expert of this model"));
  }
  std::vector<int32_t> owner(config_.num_experts);
  for (int e = 0; e < config_.num_experts; ++e) owner[e] = index[placement.owner(e)];
  DXS_ASSIGN_OR_RETURN(Tensor owners, backend_->Allocate({config_.num_experts}, DType::kI32));
  DXS_RETURN_IF_ERROR(backend_->CopyFromHost(owner.data(), DType::kI32, &owners));
  DXS_ASSIGN_OR_RETURN(
      exchange_, MakeLowLatencyExchange(backend_, Shape(static_cast<int>(expert_peers_.size())),
                                        LowLatencySide::kAttention, dp_rank_));
  generation_ = generation;
  placement_version_ = placement.version();
  DXS_RETURN_IF_ERROR(Tell(step, /*connect=*/true));
  // Every expert rank answers with its region's key once it has made and warmed its side.
  const absl::Time deadline = absl::Now() + timeout_;
  std::vector<std::string> keys(expert_peers_.size());
  bool refused = false;
  for (size_t i = 0; i < expert_peers_.size(); ++i) {
    while (true) {
      absl::StatusOr<TransportMessage> m = transport_->Recv(expert_peers_[i], deadline);
      if (!m.ok()) {
        Drop();
        return absl::UnavailableError(absl::StrCat("low-latency step ", step,
                                                   ": no answer from expert peer ",
                                                   expert_peers_[i], ": ", m.status().message()));
      }
      absl::StatusOr<WireHeader> h = WireHeader::Decode(m->header);
      // Answers to older generations (a step that failed before they arrived) are dropped.
      if (!h.ok() || h->kind != MessageKind::kLowLatencyRegion || h->ll_generation != generation) {
        continue;
      }
      keys[i].assign(m->payload.begin(), m->payload.end());
      refused |= keys[i].empty();
      break;
    }
  }
  if (refused) {
    Drop();
    available_ = false;
    return false;
  }
  if (absl::Status s = exchange_->Connect(keys); !s.ok()) {
    Drop();
    return s;
  }
  executor_ = std::make_unique<LowLatencyMoeExecutor>(exchange_.get(), std::move(owners));
  stale_ = false;
  return true;
}

absl::StatusOr<bool> LowLatencyDecode::BeginStep(uint64_t step, uint32_t generation,
                                                 const Placement& placement,
                                                 const std::vector<int>& ep_peers, bool* made_new) {
  *made_new = false;
  if (!available_) return false;
  if (exchange_ == nullptr || generation != generation_ ||
      placement.version() != placement_version_) {
    *made_new = true;
    DXS_ASSIGN_OR_RETURN(const bool connected, Connect(step, generation, placement, ep_peers));
    if (!connected) return false;
  } else {
    absl::Status told = Tell(step, /*connect=*/false);
    if (!told.ok()) {
      Drop();
      return told;
    }
  }
  moe_.Use(executor_.get());
  return true;
}

absl::Status LowLatencyDecode::EmptyStep() {
  for (int l = 0; l < config_.num_hidden_layers; ++l) {
    if (config_.IsMoeLayer(l)) {
      DXS_RETURN_IF_ERROR(moe_.Run(l, empty_x_, empty_ids_, empty_weights_, &empty_out_));
    }
  }
  return absl::OkStatus();
}

absl::Status LowLatencyDecode::EndStep() {
  moe_.Use(nullptr);
  if (exchange_ == nullptr) return absl::OkStatus();
  absl::Status s = exchange_->CheckStatus();
  if (!s.ok()) Drop();
  return s;
}

}  // namespace dxs
