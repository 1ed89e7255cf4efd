#include "router/dispatch/dispatch_combine.h"

#include <sched.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <numeric>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"

namespace dxs {
namespace {

using Clock = std::chrono::steady_clock;

double SecondsSince(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

}  // namespace

void PackRows(const float* rows, int64_t num_rows, int64_t hidden, DType dtype, PayloadBytes* out) {
  const size_t offset = out->size();
  out->resize(offset + num_rows * hidden * DTypeSize(dtype));
  NarrowFromFloat32(dtype, rows, num_rows * hidden, out->data() + offset);
}

void UnpackRows(const uint8_t* data, int64_t num_rows, int64_t hidden, DType dtype, float* out) {
  WidenToFloat32(dtype, data, num_rows * hidden, out);
}

RemoteMoeExecutor::RemoteMoeExecutor(Backend* backend, Transport* transport,
                                     std::vector<int> ep_peers, Placement placement, int64_t hidden,
                                     DispatchOptions options)
    : backend_(backend),
      transport_(transport),
      ep_peers_(std::move(ep_peers)),
      placement_(std::move(placement)),
      hidden_(hidden),
      options_(options),
      counters_(std::make_unique<DispatchCounters>(static_cast<int>(ep_peers_.size()))) {}

RemoteMoeExecutor::~RemoteMoeExecutor() {
  if (transport_->receive_target_provider() == this) transport_->SetReceiveTargetProvider(nullptr);
  for (InFlight& flight : in_flight_) AbandonTargets(flight);
}

int RemoteMoeExecutor::RankOfPeer(int peer) const {
  for (size_t r = 0; r < ep_peers_.size(); ++r) {
    if (ep_peers_[r] == peer) return static_cast<int>(r);
  }
  return -1;
}

bool RemoteMoeExecutor::TargetFor(int peer, std::string_view header, size_t payload_bytes,
                                  std::vector<ReceiveSegment>* segments) {
  absl::StatusOr<WireHeader> h = WireHeader::Decode(header);
  if (!h.ok() || h->kind != MessageKind::kCombine || h->micro >= kMaxMicroBatches ||
      h->wire_dtype != options_.wire_dtype) {
    return false;
  }
  const int rank = RankOfPeer(peer);
  InFlight& flight = in_flight_[h->micro];
  if (rank < 0 || static_cast<size_t>(rank) >= flight.targets.size()) return false;
  CombineTarget& target = flight.targets[rank];
  // Anything unexpected (a late answer to a failed step, a wrong size) is left in a
  // transport buffer for Combine to skip or reject.
  if (target.state != CombineTarget::State::kExpected || target.key != h->key() ||
      target.bytes != payload_bytes) {
    return false;
  }
  segments->push_back({target.dest, payload_bytes});
  target.state = CombineTarget::State::kAccepted;
  return true;
}

void RemoteMoeExecutor::TargetDropped(int peer, std::string_view header) {
  absl::StatusOr<WireHeader> h = WireHeader::Decode(header);
  const int rank = RankOfPeer(peer);
  if (!h.ok() || rank < 0 || h->micro >= kMaxMicroBatches) return;
  InFlight& flight = in_flight_[h->micro];
  if (static_cast<size_t>(rank) >= flight.targets.size()) return;
  CombineTarget& target = flight.targets[rank];
  if (target.state == CombineTarget::State::kAccepted && target.key == h->key()) {
    target.state = CombineTarget::State::kNone;
  }
}

void RemoteMoeExecutor::AbandonTargets(InFlight& flight) {
  for (size_t r = 0; r < flight.targets.size(); ++r) {
    CombineTarget& target = flight.targets[r];
    if (target.state == CombineTarget::State::kAccepted && r < ep_peers_.size()) {
      // A receive in progress completes or fails within the transport's fault detection;
      // returning earlier would let it write into memory the caller may free.
      absl::Status s = transport_->WaitTargetWrites(
          ep_peers_[r], absl::Now() + options_.timeout + absl::Seconds(30));
      if (!s.ok() && target.into_out) {
        std::fprintf(stderr, "dxs: a combine is still being received into a freed output: %s\n",
                     std::string(s.message()).c_str());
        std::abort();
      }
    }
    target.state = CombineTarget::State::kNone;
  }
}

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

absl::Status RemoteMoeExecutor::Run(int layer, const Tensor& x, const Tensor& ids,
                                    const Tensor& weights, Tensor* out) {
  DXS_RETURN_IF_ERROR(Dispatch(layer, 0, 1, x, ids, weights, out));
  return Combine(layer, 0, out);
}

absl::Status RemoteMoeExecutor::Layout(const Tensor& ids, const Tensor& weights, InFlight& flight) {
  const int num_ranks = static_cast<int>(ep_peers_.size());
  if (placement_.num_ranks() != num_ranks) {
    return absl::FailedPreconditionError(absl::StrCat("the placement has ", placement_.num_ranks(),
                                                      " EP ranks, the executor ", num_ranks));
  }
  if (!expert_owner_.defined()) {
    std::vector<int32_t> owner(placement_.num_experts());
    for (size_t e = 0; e < owner.size(); ++e) owner[e] = placement_.owner(static_cast<int>(e));
    DXS_ASSIGN_OR_RETURN(expert_owner_, backend_->UploadIndices(owner));
  }
  DispatchHandle& h = flight.handle;
  h.num_tokens = ids.rows();
  DXS_RETURN_IF_ERROR(
      backend_->ComputeDispatchLayout(ids, weights, expert_owner_, num_ranks, &h.layout));
  // The counts are all the host needs: message sizes for the transport.
  std::vector<int32_t> counts(2 * static_cast<size_t>(num_ranks));
  DXS_RETURN_IF_ERROR(
      backend_->CopyToHost(h.layout.num_tokens_per_rank, DType::kI32, counts.data()));
  DXS_RETURN_IF_ERROR(
      backend_->CopyToHost(h.layout.num_pairs_per_rank, DType::kI32, counts.data() + num_ranks));
  h.num_tokens_per_rank.assign(counts.begin(), counts.begin() + num_ranks);
  h.num_pairs_per_rank.assign(counts.begin() + num_ranks, counts.end());
  h.token_offsets.assign(num_ranks + 1, 0);
  h.pair_offsets.assign(num_ranks + 1, 0);
  for (int r = 0; r < num_ranks; ++r) {
    h.token_offsets[r + 1] = h.token_offsets[r] + h.num_tokens_per_rank[r];
    h.pair_offsets[r + 1] = h.pair_offsets[r] + h.num_pairs_per_rank[r];
  }
  return absl::OkStatus();
}

absl::Status RemoteMoeExecutor::Dispatch(int layer, int micro, int num_micro, const Tensor& x,
                                         const Tensor& ids, const Tensor& weights, Tensor* out) {
  if (micro < 0 || micro >= num_micro || num_micro > kMaxMicroBatches) {
    return absl::InvalidArgumentError(
        absl::StrCat("micro-batch ", micro, " of ", num_micro, " is out of range"));
  }
  const Clock::time_point dispatch_start = Clock::now();
  const int num_ranks = static_cast<int>(ep_peers_.size());
  InFlight& flight = in_flight_[micro];
  flight.active = false;
  DispatchHandle& h = flight.handle;
  h.layer = layer;
  const DType dtype = options_.wire_dtype;
  if (!IsFloatDType(x.dtype()) ||
      (out != nullptr && out->defined() && !IsFloatDType(out->dtype()))) {
    return absl::InvalidArgumentError("activations must be floating point");
  }
  if (ids.rows() != x.rows()) {
    return absl::InvalidArgumentError(
        absl::StrCat(ids.rows(), " routed tokens for ", x.rows(), " rows"));
  }
  DXS_RETURN_IF_ERROR(Layout(ids, weights, flight));
  const int64_t total_rows = h.token_offsets[num_ranks];
  int ranks_with_rows = 0;
  for (int r = 0; r < num_ranks; ++r) ranks_with_rows += h.num_tokens_per_rank[r] > 0 ? 1 : 0;
  // Combines land in the handle's receive tensor (reused while big enough), or straight in
  // out when one rank holds every token in order and is the only rank with rows.
  const int64_t n0 = ranks_with_rows == 1 ? total_rows : -1;
  h.into_out = n0 > 0 && n0 == h.num_tokens && out != nullptr && out->defined() &&
               out->dtype() == dtype && out->num_elements() == n0 * hidden_;
  if (!h.into_out &&
      (!h.recv_rows.defined() || h.recv_rows.rows() < total_rows || h.recv_rows.dtype() != dtype)) {
    DXS_ASSIGN_OR_RETURN(h.recv_rows,
                         backend_->Allocate({std::max<int64_t>(total_rows, 1), hidden_}, dtype));
  }
  // Name every rank's combine target before the first dispatch leaves: a fast rank's
  // answer can arrive while the next rank's dispatch is being sent.
  if (transport_->receive_target_provider() != this) transport_->SetReceiveTargetProvider(this);
  flight.targets.resize(num_ranks);
  const size_t row_bytes = static_cast<size_t>(hidden_) * DTypeSize(dtype);
  for (int r = 0; r < num_ranks; ++r) {
    CombineTarget& target = flight.targets[r];
    target.state = CombineTarget::State::kExpected;
    target.key = WireHeader::Key(step_, layer, static_cast<uint8_t>(micro));
    target.bytes = static_cast<size_t>(h.num_tokens_per_rank[r]) * row_bytes;
    target.into_out = h.into_out && h.num_tokens_per_rank[r] > 0;
    if (target.bytes == 0) {
      target.dest = nullptr;  // an empty answer lands nowhere
    } else if (target.into_out) {
      target.dest = static_cast<uint8_t*>(backend_->TransportAddress(*out));
    } else {
      target.dest = static_cast<uint8_t*>(backend_->TransportAddress(h.recv_rows)) +
                    h.token_offsets[r] * row_bytes;
    }
  }
  // Pack: rows of ranks that do not take x as it is, gathered into the wire dtype.
  bool packed = false;
  for (int r = 0; r < num_ranks; ++r) {
    const int64_t n = h.num_tokens_per_rank[r];
    if (n == 0 || (n == h.num_tokens && x.dtype() == dtype)) continue;
    if (!packed && (!h.send_rows.defined() || h.send_rows.rows() < total_rows ||
                    h.send_rows.dtype() != dtype)) {
      DXS_ASSIGN_OR_RETURN(h.send_rows, backend_->Allocate({total_rows, hidden_}, dtype));
    }
    packed = true;
    Tensor rows = h.layout.token_rows.Rows(h.token_offsets[r], n);
    Tensor region = h.send_rows.Rows(h.token_offsets[r], n);
    DXS_RETURN_IF_ERROR(backend_->GatherRows(x, rows, &region));
  }
  // Dispatch: one message to every EP rank, empty ones included. Keep sending after a
  // failure so the healthy ranks see this layer from us and stay in step.
  absl::Status send_status;
  for (int r = 0; r < num_ranks; ++r) {
    absl::Status s = SendDispatch(r, micro, num_micro, x, flight);
    if (!s.ok() && send_status.ok()) {
      send_status =
          absl::UnavailableError(absl::StrCat("dispatch to EP rank ", r, ": ", s.message()));
    }
    counters_->tokens_dispatched[r] += h.num_tokens_per_rank[r];
  }
  if (observer_ != nullptr) {
    observer_->OnDispatch(h.num_tokens_per_rank, SecondsSince(dispatch_start));
  }
  if (!send_status.ok()) {
    AbandonTargets(flight);
    return send_status;
  }
  flight.active = true;
  return absl::OkStatus();
}

absl::Status RemoteMoeExecutor::SendDispatch(int r, int micro, int num_micro, const Tensor& x,
                                             InFlight& flight) {
  const DispatchHandle& h = flight.handle;
  const DType dtype = options_.wire_dtype;
  const int64_t n = h.num_tokens_per_rank[r], num_pairs = h.num_pairs_per_rank[r];
  const size_t row_bytes = static_cast<size_t>(hidden_) * DTypeSize(dtype);
  segments_.clear();
  if (n > 0) {
    const bool straight = n == h.num_tokens && x.dtype() == dtype;
    const Tensor& rows = straight ? x : h.send_rows;
    const int64_t first = straight ? 0 : h.token_offsets[r];
    segments_.push_back(
        {static_cast<const uint8_t*>(backend_->TransportAddress(rows)) + first * row_bytes,
         static_cast<size_t>(n) * row_bytes});
  }
  // The rank's pairs, straight from the layout tensors.
  const size_t pair_bytes = static_cast<size_t>(num_pairs) * sizeof(int32_t);
  for (const Tensor* t : {&h.layout.pair_rows, &h.layout.pair_experts, &h.layout.pair_weights}) {
    if (num_pairs == 0) break;
    segments_.push_back({static_cast<const uint8_t*>(backend_->TransportAddress(*t)) +
                             h.pair_offsets[r] * sizeof(int32_t),
                         pair_bytes});
  }
  WireHeader header;
  header.kind = MessageKind::kDispatch;
  header.wire_dtype = dtype;
  header.micro = static_cast<uint8_t>(micro);
  header.num_micro = static_cast<uint8_t>(num_micro);
  header.step = step_;
  header.layer = h.layer;
  header.num_rows = static_cast<int32_t>(n);
  header.num_pairs = static_cast<int32_t>(num_pairs);
  header.hidden = static_cast<int32_t>(hidden_);
  return transport_->SendV(ep_peers_[r], header.Encode(), segments_.data(), segments_.size());
}

absl::Status RemoteMoeExecutor::Combine(int layer, int micro, Tensor* out) {
  if (micro < 0 || micro >= kMaxMicroBatches || !in_flight_[micro].active ||
      in_flight_[micro].handle.layer != layer) {
    return absl::FailedPreconditionError(
        absl::StrCat("combine of layer ", layer, " micro-batch ", micro, " without its dispatch"));
  }
  InFlight& flight = in_flight_[micro];
  flight.active = false;
  const DispatchHandle& h = flight.handle;
  const Clock::time_point combine_start = Clock::now();
  const int num_ranks = static_cast<int>(ep_peers_.size());
  // Combine: receive every rank's rows, then sum in ascending rank order.
  const absl::Time wait_start = absl::Now();
  const absl::Time deadline = wait_start + options_.timeout;
  // A wait expected to be short is spun through (see DispatchOptions::max_combine_spin),
  // up to half again its expected length.
  const bool spin = expected_combine_wait_ > absl::ZeroDuration() &&
                    expected_combine_wait_ <= options_.max_combine_spin;
  const absl::Time spin_end = wait_start + expected_combine_wait_ * 1.5;
  const size_t row_bytes = static_cast<size_t>(hidden_) * DTypeSize(options_.wire_dtype);
  for (int r = 0; r < num_ranks; ++r) {
    while (spin && !transport_->HasMessage(ep_peers_[r]) && absl::Now() < spin_end) sched_yield();
    absl::StatusOr<TransportMessage> m = RecvCombine(r, layer, micro, deadline);
    if (!m.ok()) {
      AbandonTargets(flight);
      return absl::UnavailableError(absl::StrCat("combine from EP rank ", r, " (step ", step_,
                                                 ", layer ", layer, ", micro-batch ", micro,
                                                 "): ", m.status().message()));
    }
    const bool in_target = m->target == this;
    if (in_target) flight.targets[r].state = CombineTarget::State::kNone;
    DXS_ASSIGN_OR_RETURN(WireHeader reply, WireHeader::Decode(m->header));
    const int64_t n = h.num_tokens_per_rank[r];
    if (reply.num_rows != n || reply.wire_dtype != options_.wire_dtype ||
        m->payload_size() != static_cast<size_t>(n) * row_bytes) {
      AbandonTargets(flight);
      return absl::InternalError(
          absl::StrCat("combine from EP rank ", r, ": ", reply.num_rows, " rows, expected ", n));
    }
    if (in_target) {
      ++counters_->combines_in_target;
      if (flight.targets[r].into_out) ++counters_->combines_into_out;
    } else if (n > 0) {
      // It arrived in a transport buffer: onto the backend, into its region.
      Tensor dst = h.into_out ? *out : h.recv_rows.Rows(h.token_offsets[r], n);
      DXS_RETURN_IF_ERROR(backend_->CopyFromHost(m->payload.data(), options_.wire_dtype, &dst));
    }
    counters_->tokens_combined[r] += n;
  }
  AbandonTargets(flight);  // ranks answered: nothing is in flight; unexpected answers skip
  const absl::Duration waited = absl::Now() - wait_start;
  expected_combine_wait_ = expected_combine_wait_ == absl::ZeroDuration()
                               ? waited
                               : (expected_combine_wait_ * 3 + waited) / 4;
  if (!h.into_out) {
    DXS_RETURN_IF_ERROR(
        backend_->CombineRows(h.recv_rows, h.layout.token_rows, h.token_offsets, out));
  }
  if (observer_ != nullptr) {
    observer_->OnCombine(h.num_tokens_per_rank, SecondsSince(combine_start));
  }
  return absl::OkStatus();
}

}  // namespace dxs
