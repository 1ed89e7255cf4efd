#include "router/dispatch/dispatch_combine.h"

#include <chrono>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"

namespace dxs {
namespace {

using Clock = std::chrono::steady_clock;

double SecondsSince(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

}  // namespace

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

void PackRows(const float* rows, int64_t num_rows, int64_t hidden, DType dtype, PayloadBytes* out) {
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

absl::StatusOr<TransportMessage> RemoteMoeExecutor::RecvCombine(int rank, int layer, int micro,
                                                                absl::Time deadline) {
  const WireHeader::Key want(step_, layer, static_cast<uint8_t>(micro));
  while (true) {
    DXS_ASSIGN_OR_RETURN(TransportMessage m, transport_->Recv(ep_peers_[rank], deadline));
    DXS_ASSIGN_OR_RETURN(WireHeader h, WireHeader::Decode(m.header));
    if (h.kind != MessageKind::kCombine) {
      return absl::InternalError(absl::StrCat("EP rank ", rank, " sent a non-combine message"));
    }
    // A combine from an earlier, failed step can still arrive; skip it.
    if (h.key() < want) continue;
    if (h.key() != want) {
      return absl::InternalError(absl::StrCat(
          "EP rank ", rank, " answered step ", h.step, " layer ", h.layer, " micro-batch ", h.micro,
          ", expected step ", step_, " layer ", layer, " micro-batch ", micro));
    }
    return m;
  }
}

absl::Status RemoteMoeExecutor::Run(int layer, const Tensor& x, const std::vector<int32_t>& ids,
                                    const std::vector<float>& weights, int top_k, Tensor* out) {
  DXS_RETURN_IF_ERROR(Dispatch(layer, 0, 1, x, ids, weights, top_k, out));
  return Combine(layer, 0, out);
}

absl::Status RemoteMoeExecutor::Dispatch(int layer, int micro, int num_micro, const Tensor& x,
                                         const std::vector<int32_t>& ids,
                                         const std::vector<float>& weights, int top_k,
                                         Tensor* out) {
  if (micro < 0 || micro >= num_micro || num_micro > kMaxMicroBatches) {
    return absl::InvalidArgumentError(
        absl::StrCat("micro-batch ", micro, " of ", num_micro, " is out of range"));
  }
  const Clock::time_point dispatch_start = Clock::now();
  const int num_ranks = static_cast<int>(ep_peers_.size());
  InFlight& flight = in_flight_[micro];
  flight.active = false;
  flight.layer = layer;
  flight.layout = ComputeLayout(placement_, ids, weights, top_k);
  const DispatchLayout& layout = flight.layout;
  const DType dtype = options_.wire_dtype;
  // Dispatch: one message to every EP rank, empty ones included. Keep sending after a
  // failure so the healthy ranks see this layer from us and stay in step.
  absl::Status send_status;
  const size_t row_bytes = static_cast<size_t>(hidden_) * DTypeSize(dtype);
  for (int r = 0; r < num_ranks; ++r) {
    const std::vector<int32_t>& rows = layout.token_rows[r];
    const RoutedPairs& pairs = layout.pairs[r];
    const int64_t n = static_cast<int64_t>(rows.size());
    // Pack straight from x's rows into the reused send buffer (no gather copy).
    const size_t pair_bytes = pairs.size() * sizeof(int32_t);
    scratch_.resize(n * row_bytes + 3 * pair_bytes);
    uint8_t* p = scratch_.data();
    for (int64_t i = 0; i < n; ++i) {
      NarrowFromFloat32(dtype, x.f32() + rows[i] * hidden_, hidden_, p + i * row_bytes);
    }
    p += n * row_bytes;
    std::memcpy(p, pairs.rows.data(), pair_bytes);
    std::memcpy(p + pair_bytes, pairs.experts.data(), pair_bytes);
    std::memcpy(p + 2 * pair_bytes, pairs.weights.data(), pair_bytes);
    WireHeader h;
    h.kind = MessageKind::kDispatch;
    h.wire_dtype = dtype;
    h.micro = static_cast<uint8_t>(micro);
    h.num_micro = static_cast<uint8_t>(num_micro);
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
  if (observer_ != nullptr) observer_->OnDispatch(layout, SecondsSince(dispatch_start));
  DXS_RETURN_IF_ERROR(send_status);
  flight.active = true;
  return absl::OkStatus();
}

absl::Status RemoteMoeExecutor::Combine(int layer, int micro, Tensor* out) {
  if (micro < 0 || micro >= kMaxMicroBatches || !in_flight_[micro].active ||
      in_flight_[micro].layer != layer) {
    return absl::FailedPreconditionError(
        absl::StrCat("combine of layer ", layer, " micro-batch ", micro, " without its dispatch"));
  }
  InFlight& flight = in_flight_[micro];
  flight.active = false;
  const DispatchLayout& layout = flight.layout;
  const Clock::time_point combine_start = Clock::now();
  const int num_ranks = static_cast<int>(ep_peers_.size());
  // Combine: receive every rank's rows, then sum in ascending rank order.
  const absl::Time deadline = absl::Now() + options_.timeout;
  std::vector<TransportMessage> replies(num_ranks);
  for (int r = 0; r < num_ranks; ++r) {
    absl::StatusOr<TransportMessage> m = RecvCombine(r, layer, micro, deadline);
    if (!m.ok()) {
      return absl::UnavailableError(absl::StrCat("combine from EP rank ", r, " (step ", step_,
                                                 ", layer ", layer, ", micro-batch ", micro,
                                                 "): ", m.status().message()));
    }
    replies[r] = std::move(*m);
  }
  std::fill(out->f32(), out->f32() + out->num_elements(), 0.f);
  row_.resize(hidden_);
  for (int r = 0; r < num_ranks; ++r) {
    const std::vector<int32_t>& rows = layout.token_rows[r];
    const int64_t n = static_cast<int64_t>(rows.size());
    DXS_ASSIGN_OR_RETURN(WireHeader h, WireHeader::Decode(replies[r].header));
    const size_t reply_row_bytes = static_cast<size_t>(hidden_) * DTypeSize(h.wire_dtype);
    if (h.num_rows != n || replies[r].payload.size() != n * reply_row_bytes) {
      return absl::InternalError(
          absl::StrCat("combine from EP rank ", r, ": ", h.num_rows, " rows, expected ", n));
    }
    // Each row is widened into a cache-resident buffer and added where its token lives.
    for (int64_t i = 0; i < n; ++i) {
      UnpackRows(replies[r].payload.data() + i * reply_row_bytes, 1, hidden_, h.wire_dtype,
                 row_.data());
      float* dst = out->f32() + rows[i] * hidden_;
      for (int64_t j = 0; j < hidden_; ++j) dst[j] += row_[j];
    }
    counters_->tokens_combined[r] += n;
  }
  if (observer_ != nullptr) observer_->OnCombine(layout, SecondsSince(combine_start));
  return absl::OkStatus();
}

}  // namespace dxs
