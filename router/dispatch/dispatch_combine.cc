#include "router/dispatch/dispatch_combine.h"

#include <cstring>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"

namespace dxs {

std::vector<int64_t> DispatchLayout::num_tokens_per_rank() const {
  std::vector<int64_t> n;
  for (const auto& rows : token_rows) n.push_back(static_cast<int64_t>(rows.size()));
  return n;
}

DispatchLayout ComputeLayout(const Placement& placement, const std::vector<int32_t>& ids,
                             const std::vector<float>& weights, int top_k) {
  const int num_ranks = placement.num_ranks();
  DispatchLayout layout;
  layout.token_rows.resize(num_ranks);
  layout.pairs.resize(num_ranks);
  const int64_t num_tokens = top_k > 0 ? static_cast<int64_t>(ids.size()) / top_k : 0;
  std::vector<int32_t> local_row(num_ranks);
  for (int64_t t = 0; t < num_tokens; ++t) {
    std::fill(local_row.begin(), local_row.end(), -1);
    for (int k = 0; k < top_k; ++k) {
      const int32_t expert = ids[t * top_k + k];
      const int r = placement.owner(expert);
      if (local_row[r] < 0) {
        local_row[r] = static_cast<int32_t>(layout.token_rows[r].size());
        layout.token_rows[r].push_back(static_cast<int32_t>(t));
      }
      layout.pairs[r].Add(local_row[r], expert, weights[t * top_k + k]);
    }
  }
  return layout;
}

void PackRows(const float* rows, int64_t num_rows, int64_t hidden, DType dtype,
              std::vector<uint8_t>* out) {
  const size_t offset = out->size();
  out->resize(offset + num_rows * hidden * DTypeSize(dtype));
  NarrowFromFloat32(dtype, rows, num_rows * hidden, out->data() + offset);
}

void UnpackRows(const uint8_t* data, int64_t num_rows, int64_t hidden, DType dtype, float* out) {
  WidenToFloat32(dtype, data, num_rows * hidden, out);
}

RemoteMoeExecutor::RemoteMoeExecutor(Transport* transport, std::vector<int> ep_peers,
                                     Placement placement, int64_t hidden, DispatchOptions options)
    : transport_(transport),
      ep_peers_(std::move(ep_peers)),
      placement_(std::move(placement)),
      hidden_(hidden),
      options_(options),
      counters_(std::make_unique<DispatchCounters>(static_cast<int>(ep_peers_.size()))) {}

absl::StatusOr<TransportMessage> RemoteMoeExecutor::RecvCombine(int rank, int layer,
                                                                absl::Time deadline) {
  while (true) {
    DXS_ASSIGN_OR_RETURN(TransportMessage m, transport_->Recv(ep_peers_[rank], deadline));
    DXS_ASSIGN_OR_RETURN(WireHeader h, WireHeader::Decode(m.header));
    if (h.kind != MessageKind::kCombine) {
      return absl::InternalError(absl::StrCat("EP rank ", rank, " sent a non-combine message"));
    }
    // A combine from an earlier, failed step can still arrive; skip it.
    if (h.key() < std::make_pair(step_, static_cast<int32_t>(layer))) continue;
    if (h.key() != std::make_pair(step_, static_cast<int32_t>(layer))) {
      return absl::InternalError(absl::StrCat("EP rank ", rank, " answered step ", h.step,
                                              " layer ", h.layer, ", expected step ", step_,
                                              " layer ", layer));
    }
    return m;
  }
}

absl::Status RemoteMoeExecutor::Run(int layer, const Tensor& x, const std::vector<int32_t>& ids,
                                    const std::vector<float>& weights, int top_k, Tensor* out) {
  const int num_ranks = static_cast<int>(ep_peers_.size());
  const DispatchLayout layout = ComputeLayout(placement_, ids, weights, top_k);
  const DType dtype = options_.wire_dtype;
  // Dispatch: one message to every EP rank, empty ones included. Keep sending after a
  // failure so the healthy ranks see this layer from us and stay in step.
  absl::Status send_status;
  std::vector<float> gathered;
  for (int r = 0; r < num_ranks; ++r) {
    const std::vector<int32_t>& rows = layout.token_rows[r];
    const RoutedPairs& pairs = layout.pairs[r];
    const int64_t n = static_cast<int64_t>(rows.size());
    gathered.resize(n * hidden_);
    for (int64_t i = 0; i < n; ++i) {
      std::memcpy(gathered.data() + i * hidden_, x.f32() + rows[i] * hidden_,
                  hidden_ * sizeof(float));
    }
    scratch_.clear();
    PackRows(gathered.data(), n, hidden_, dtype, &scratch_);
    auto append = [this](const void* p, size_t bytes) {
      const auto* b = static_cast<const uint8_t*>(p);
      scratch_.insert(scratch_.end(), b, b + bytes);
    };
    append(pairs.rows.data(), pairs.size() * sizeof(int32_t));
    append(pairs.experts.data(), pairs.size() * sizeof(int32_t));
    append(pairs.weights.data(), pairs.size() * sizeof(float));
    WireHeader h;
    h.kind = MessageKind::kDispatch;
    h.wire_dtype = dtype;
    h.step = step_;
    h.layer = layer;
    h.num_rows = static_cast<int32_t>(n);
    h.num_pairs = static_cast<int32_t>(pairs.size());
    h.hidden = static_cast<int32_t>(hidden_);
    absl::Status s = transport_->Send(ep_peers_[r], h.Encode(), scratch_.data(), scratch_.size());
    if (!s.ok() && send_status.ok()) {
      send_status =
          absl::UnavailableError(absl::StrCat("dispatch to EP rank ", r, ": ", s.message()));
    }
    counters_->tokens_dispatched[r] += n;
  }
  DXS_RETURN_IF_ERROR(send_status);
  // Combine: receive every rank's rows, then sum in ascending rank order.
  const absl::Time deadline = absl::Now() + options_.timeout;
  std::vector<TransportMessage> replies(num_ranks);
  for (int r = 0; r < num_ranks; ++r) {
    absl::StatusOr<TransportMessage> m = RecvCombine(r, layer, deadline);
    if (!m.ok()) {
      return absl::UnavailableError(absl::StrCat("combine from EP rank ", r, " (step ", step_,
                                                 ", layer ", layer, "): ", m.status().message()));
    }
    replies[r] = std::move(*m);
  }
  std::fill(out->f32(), out->f32() + out->num_elements(), 0.f);
  std::vector<float> partial;
  for (int r = 0; r < num_ranks; ++r) {
    const std::vector<int32_t>& rows = layout.token_rows[r];
    const int64_t n = static_cast<int64_t>(rows.size());
    DXS_ASSIGN_OR_RETURN(WireHeader h, WireHeader::Decode(replies[r].header));
    if (h.num_rows != n ||
        replies[r].payload.size() != static_cast<size_t>(n * hidden_) * DTypeSize(h.wire_dtype)) {
      return absl::InternalError(
          absl::StrCat("combine from EP rank ", r, ": ", h.num_rows, " rows, expected ", n));
    }
    partial.resize(n * hidden_);
    UnpackRows(replies[r].payload.data(), n, hidden_, h.wire_dtype, partial.data());
    for (int64_t i = 0; i < n; ++i) {
      float* dst = out->f32() + rows[i] * hidden_;
      const float* src = partial.data() + i * hidden_;
      for (int64_t j = 0; j < hidden_; ++j) dst[j] += src[j];
    }
    counters_->tokens_combined[r] += n;
  }
  return absl::OkStatus();
}

}  // namespace dxs
