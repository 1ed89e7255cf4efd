#include "expert_service/expert_step_server.h"

#include <chrono>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "kernels/backend.h"
#include "router/dispatch/dispatch_combine.h"
#include "router/dispatch/wire.h"

namespace dxs {

ExpertStepServer::ExpertStepServer(Transport* transport, std::vector<int> dp_peers,
                                   ExpertCompute* shard, const ModelConfig& config)
    : transport_(transport), shard_(shard), config_(config) {
  for (int l = 0; l < config.num_hidden_layers; ++l) {
    if (config.IsMoeLayer(l)) last_moe_layer_ = l;
  }
  set_dp_peers(std::move(dp_peers));
}

void ExpertStepServer::set_dp_peers(std::vector<int> peers) {
  dp_peers_ = std::move(peers);
  pending_.assign(dp_peers_.size(), std::nullopt);
}

absl::Status ExpertStepServer::Fill(size_t i, absl::Time deadline) {
  absl::StatusOr<TransportMessage> m = transport_->Recv(dp_peers_[i], deadline);
  if (!m.ok()) return m.status();
  absl::StatusOr<WireHeader> h = WireHeader::Decode(m->header);
  if (!h.ok() || h->kind != MessageKind::kDispatch) {
    return absl::InternalError(absl::StrCat("DP peer ", dp_peers_[i], " sent a bad message: ",
                                            h.ok() ? "not a dispatch" : h.status().message()));
  }
  pending_[i] = std::move(*m);
  return absl::OkStatus();
}

absl::Status ExpertStepServer::ServeRound(absl::Time deadline) {
  const size_t num_dp = dp_peers_.size();
  auto key_of = [&](size_t i) { return WireHeader::Decode(pending_[i]->header)->key(); };
  // Gather one message per DP rank, all for the newest (step, layer) seen.
  while (true) {
    for (size_t i = 0; i < num_dp; ++i) {
      if (!pending_[i]) DXS_RETURN_IF_ERROR(Fill(i, deadline));
    }
    auto newest = key_of(0);
    for (size_t i = 1; i < num_dp; ++i) newest = std::max(newest, key_of(i));
    bool aligned = true;
    for (size_t i = 0; i < num_dp; ++i) {
      if (key_of(i) < newest) {
        pending_[i].reset();  // stale: from a step that failed elsewhere
        aligned = false;
      }
    }
    if (aligned) break;
  }
  const WireHeader first = *WireHeader::Decode(pending_[0]->header);
  const int64_t hidden = config_.hidden_size;
  // Concatenate all DP ranks' rows; pair rows are offset into the concatenation.
  std::vector<int64_t> row_offset(num_dp + 1, 0);
  std::vector<WireHeader> headers;
  for (size_t i = 0; i < num_dp; ++i) {
    WireHeader h = *WireHeader::Decode(pending_[i]->header);
    const size_t expect = static_cast<size_t>(h.num_rows) * hidden * DTypeSize(h.wire_dtype) +
                          static_cast<size_t>(h.num_pairs) * 12;
    if (h.hidden != hidden || pending_[i]->payload.size() != expect) {
      const size_t got = pending_[i]->payload.size();
      pending_[i].reset();
      return absl::InternalError(absl::StrCat("DP peer ", dp_peers_[i],
                                              ": malformed dispatch (hidden ", h.hidden,
                                              ", payload ", got, " bytes, expected ", expect, ")"));
    }
    headers.push_back(h);
    row_offset[i + 1] = row_offset[i] + h.num_rows;
  }
  const int64_t total_rows = row_offset[num_dp];
  // Reused across rounds: fresh megabyte buffers per round cost page faults and fills.
  if (total_rows > buffer_rows_) {
    buffer_rows_ = std::max(total_rows, 2 * buffer_rows_);
    x_buffer_ = shard_->backend()->Allocate({buffer_rows_, hidden});
    out_buffer_ = shard_->backend()->Allocate({buffer_rows_, hidden});
  }
  Tensor x = x_buffer_.defined() ? x_buffer_.Rows(0, total_rows)
                                 : shard_->backend()->Allocate({0, hidden});
  RoutedPairs pairs;
  for (size_t i = 0; i < num_dp; ++i) {
    const WireHeader& h = headers[i];
    const uint8_t* p = pending_[i]->payload.data();
    UnpackRows(p, h.num_rows, hidden, h.wire_dtype, x.f32() + row_offset[i] * hidden);
    p += static_cast<size_t>(h.num_rows) * hidden * DTypeSize(h.wire_dtype);
    std::vector<int32_t> rows(h.num_pairs), experts(h.num_pairs);
    std::vector<float> weights(h.num_pairs);
    std::memcpy(rows.data(), p, h.num_pairs * 4);
    std::memcpy(experts.data(), p + h.num_pairs * 4, h.num_pairs * 4);
    std::memcpy(weights.data(), p + h.num_pairs * 8, h.num_pairs * 4);
    for (int32_t k = 0; k < h.num_pairs; ++k) {
      if (rows[k] < 0 || rows[k] >= h.num_rows || !shard_->Holds(h.layer, experts[k])) {
        pending_.assign(num_dp, std::nullopt);
        return absl::InternalError(absl::StrCat("DP peer ", dp_peers_[i], " routed row ", rows[k],
                                                " to expert ", experts[k],
                                                ", which this rank does not hold"));
      }
      pairs.Add(static_cast<int32_t>(row_offset[i] + rows[k]), experts[k], weights[k]);
    }
  }
  Tensor out = out_buffer_.defined() ? out_buffer_.Rows(0, total_rows)
                                     : shard_->backend()->Allocate({0, hidden});
  const auto compute_start = std::chrono::steady_clock::now();
  absl::Status compute = shard_->Forward(first.layer, x, pairs, &out);
  const double compute_seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - compute_start).count();
  pending_.assign(num_dp, std::nullopt);
  DXS_RETURN_IF_ERROR(compute);
  if (metrics_ != nullptr) metrics_->OnRound(total_rows, pairs, compute_seconds);

  ++counters_.rounds;
  counters_.rows_received += total_rows;
  rows_this_step_ += total_rows;
  if (total_rows == 0) ++counters_.empty_rounds;
  if (first.layer == last_moe_layer_) {
    ++counters_.steps;
    if (rows_this_step_ == 0) ++counters_.empty_steps;
    if (metrics_ != nullptr) metrics_->OnStep(rows_this_step_ == 0);
    rows_this_step_ = 0;
  }
  // Combine: each DP rank gets its rows back, pre-summed over this rank's experts.
  absl::Status send_status;
  for (size_t i = 0; i < num_dp; ++i) {
    WireHeader h = headers[i];
    h.kind = MessageKind::kCombine;
    h.num_pairs = 0;
    send_buffer_.clear();
    PackRows(out.f32() + row_offset[i] * hidden, h.num_rows, hidden, h.wire_dtype, &send_buffer_);
    absl::Status s =
        transport_->Send(dp_peers_[i], h.Encode(), send_buffer_.data(), send_buffer_.size());
    if (!s.ok() && send_status.ok()) send_status = s;
  }
  return send_status;
}

}  // namespace dxs
