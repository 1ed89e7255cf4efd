#include "expert_service/expert_step_server.h"

#include <algorithm>
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

ExpertStepServer::~ExpertStepServer() {
  if (transport_->receive_target_provider() == this) transport_->SetReceiveTargetProvider(nullptr);
  // Receives still moving into slots must finish before the buffers go.
  for (const auto& [peer, slots] : arriving_) {
    if (!slots.empty()) (void)transport_->WaitTargetWrites(peer, absl::Now() + absl::Seconds(10));
  }
}

void ExpertStepServer::set_dp_peers(std::vector<int> peers) {
  for (size_t i = 0; i < pending_.size(); ++i) DropPending(i);
  const bool resized = peers.size() != dp_peers_.size();
  dp_peers_ = std::move(peers);
  pending_.assign(dp_peers_.size(), std::nullopt);
  pending_slot_.assign(dp_peers_.size(), -1);
  // Slots are per rank; a new count needs a new layout, made once none is held.
  if (resized) relayout_ = true;
  // A failed allocation leaves relayout_ set: ServeRound tries again and reports it.
  (void)MaybeRelayout();
}

bool ExpertStepServer::AnySlotHeld() const {
  for (const Slot& slot : slots_) {
    if (slot.busy) return true;
  }
  return false;
}

absl::Status ExpertStepServer::MaybeRelayout() {
  if (!relayout_ || AnySlotHeld()) return absl::OkStatus();
  const int64_t hidden = config_.hidden_size;
  slot_rows_ = std::max(slot_rows_, wanted_slot_rows_);
  const bool new_dtype = slot_dtype_ != wanted_slot_dtype_;
  slot_dtype_ = wanted_slot_dtype_;
  const int64_t num_slots = static_cast<int64_t>(dp_peers_.size()) * kSlotsPerRank;
  slots_.assign(num_slots, Slot());
  for (int64_t k = 0; k < num_slots; ++k) slots_[k].base_row = k * slot_rows_;
  if (num_slots * slot_rows_ > 0) {
    const std::vector<int64_t> shape = {num_slots * slot_rows_, hidden};
    DXS_ASSIGN_OR_RETURN(x_buffer_, shard_->backend()->Allocate(shape, slot_dtype_));
    DXS_ASSIGN_OR_RETURN(out_buffer_, shard_->backend()->Allocate(shape, slot_dtype_));
  } else if (new_dtype) {
    x_buffer_ = out_buffer_ = Tensor();
  }
  relayout_ = false;
  return absl::OkStatus();
}

bool ExpertStepServer::TargetFor(int peer, std::string_view header, size_t payload_bytes,
                                 std::vector<ReceiveSegment>* segments) {
  if (relayout_) return false;
  auto rank = std::find(dp_peers_.begin(), dp_peers_.end(), peer);
  if (rank == dp_peers_.end()) return false;
  absl::StatusOr<WireHeader> h = WireHeader::Decode(header);
  const int64_t hidden = config_.hidden_size;
  // Anything malformed is left to ServeRound to reject.
  if (!h.ok() || h->kind != MessageKind::kDispatch || h->hidden != hidden) return false;
  const size_t row_bytes = static_cast<size_t>(h->num_rows) * hidden * DTypeSize(h->wire_dtype);
  const size_t pair_bytes = static_cast<size_t>(h->num_pairs) * 12;
  if (payload_bytes != row_bytes + pair_bytes) return false;
  // Rows land in the slots in the wire's dtype (bf16 only for experts on the CPU, which
  // convert as they compute).
  const bool slot_dtype_ok =
      h->wire_dtype == DType::kF32 ||
      (h->wire_dtype == DType::kBF16 && shard_->backend()->device() == Device::kCpu);
  if (!slot_dtype_ok) return false;
  if (h->wire_dtype != slot_dtype_ || h->num_rows > slot_rows_) {
    // Another dtype, or bigger than any slot: re-lay the slots out once none is held,
    // declining until then so that every slot drains.
    wanted_slot_dtype_ = h->wire_dtype;
    if (h->num_rows > slot_rows_) {
      wanted_slot_rows_ =
          std::max(wanted_slot_rows_, std::max<int64_t>(h->num_rows, 2 * slot_rows_));
    }
    relayout_ = true;
    return false;
  }
  const size_t first = static_cast<size_t>(rank - dp_peers_.begin()) * kSlotsPerRank;
  for (size_t k = first; k < first + kSlotsPerRank && k < slots_.size(); ++k) {
    Slot& slot = slots_[k];
    if (slot.busy) continue;
    slot.busy = true;
    slot.pairs.resize(pair_bytes);
    segments->push_back({x_buffer_.defined() ? static_cast<uint8_t*>(
                                                   shard_->backend()->TransportAddress(x_buffer_)) +
                                                   slot.base_row * hidden * DTypeSize(slot_dtype_)
                                             : nullptr,
                         row_bytes});
    segments->push_back({slot.pairs.data(), pair_bytes});
    arriving_[peer].push_back(static_cast<int>(k));
    return true;
  }
  return false;
}

void ExpertStepServer::TargetDropped(int peer, std::string_view header) {
  // The transport drops only the oldest message it still holds from a peer, and received
  // ones have left arriving_, so the dropped one is the front.
  auto it = arriving_.find(peer);
  if (it == arriving_.end() || it->second.empty()) return;
  slots_[it->second.front()].busy = false;
  it->second.pop_front();
}

void ExpertStepServer::DropPending(size_t i) {
  if (i < pending_slot_.size() && pending_slot_[i] >= 0) {
    slots_[pending_slot_[i]].busy = false;
    pending_slot_[i] = -1;
  }
  if (i < pending_.size()) pending_[i].reset();
}

absl::Status ExpertStepServer::Fill(size_t i, absl::Time deadline) {
  absl::StatusOr<TransportMessage> m = transport_->Recv(dp_peers_[i], deadline);
  if (!m.ok()) return m.status();
  int slot = -1;
  if (m->target == this) {
    std::deque<int>& arriving = arriving_[dp_peers_[i]];
    slot = arriving.front();  // accepted messages arrive in order
    arriving.pop_front();
  } else if (m->target != nullptr) {
    return absl::InternalError(absl::StrCat(
        "DP peer ", dp_peers_[i], ": a message arrived in another receiver's target memory"));
  }
  absl::StatusOr<WireHeader> h = WireHeader::Decode(m->header);
  if (!h.ok() || h->kind != MessageKind::kDispatch) {
    if (slot >= 0) slots_[slot].busy = false;
    return absl::InternalError(absl::StrCat("DP peer ", dp_peers_[i], " sent a bad message: ",
                                            h.ok() ? "not a dispatch" : h.status().message()));
  }
  pending_[i] = std::move(*m);
  pending_slot_[i] = slot;
  return absl::OkStatus();
}

absl::Status ExpertStepServer::ServeRound(absl::Time deadline) {
  if (transport_->receive_target_provider() != this) transport_->SetReceiveTargetProvider(this);
  DXS_RETURN_IF_ERROR(MaybeRelayout());
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
        DropPending(i);  // stale: from a step that failed elsewhere
        aligned = false;
      }
    }
    if (aligned) break;
  }
  const WireHeader first = *WireHeader::Decode(pending_[0]->header);
  const int64_t hidden = config_.hidden_size;
  std::vector<WireHeader>& headers = headers_;
  headers.clear();
  bool in_place = true;  // every rank's rows in its slot
  int64_t total_rows = 0;
  for (size_t i = 0; i < num_dp; ++i) {
    WireHeader h = *WireHeader::Decode(pending_[i]->header);
    const size_t expect = static_cast<size_t>(h.num_rows) * hidden * DTypeSize(h.wire_dtype) +
                          static_cast<size_t>(h.num_pairs) * 12;
    const size_t got = pending_[i]->payload_size();
    if (h.hidden != hidden || got != expect) {
      DropPending(i);
      return absl::InternalError(absl::StrCat("DP peer ", dp_peers_[i],
                                              ": malformed dispatch (hidden ", h.hidden,
                                              ", payload ", got, " bytes, expected ", expect, ")"));
    }
    headers.push_back(h);
    total_rows += h.num_rows;
    if (pending_slot_[i] < 0) in_place = false;
  }
  auto drop_all = [&] {
    for (size_t i = 0; i < num_dp; ++i) DropPending(i);
  };
  // Where each rank's rows are in x: their slots, or (assembled by copying) concatenated;
  // and in out: always concatenated, so the experts' zero-fill of out covers only the
  // round's rows, not the gaps between slots (sized for the largest batch seen).
  std::vector<int64_t>& row_offset = row_offset_;
  std::vector<int64_t>& out_offset = out_offset_;
  row_offset.assign(num_dp, 0);
  out_offset.assign(num_dp, 0);
  for (size_t i = 1; i < num_dp; ++i) out_offset[i] = out_offset[i - 1] + headers[i - 1].num_rows;
  Tensor x, out;
  if (in_place) {
    int64_t end_row = 0;
    for (size_t i = 0; i < num_dp; ++i) {
      row_offset[i] = slots_[pending_slot_[i]].base_row;
      end_row = std::max(end_row, row_offset[i] + headers[i].num_rows);
    }
    if (x_buffer_.defined()) {
      x = x_buffer_.Rows(0, end_row);
      out = out_buffer_.Rows(0, total_rows);
    } else {
      DXS_ASSIGN_OR_RETURN(x, shard_->backend()->Allocate({0, hidden}));
      out = x;
    }
    ++counters_.rounds_in_place;
  } else {
    // Reused across rounds: fresh megabyte buffers per round cost page faults and fills.
    if (total_rows > copy_rows_) {
      copy_rows_ = std::max(total_rows, 2 * copy_rows_);
      DXS_ASSIGN_OR_RETURN(copy_x_, shard_->backend()->Allocate({copy_rows_, hidden}));
      DXS_ASSIGN_OR_RETURN(copy_out_, shard_->backend()->Allocate({copy_rows_, hidden}));
    }
    if (copy_x_.defined()) {
      x = copy_x_.Rows(0, total_rows);
      out = copy_out_.Rows(0, total_rows);
    } else {
      DXS_ASSIGN_OR_RETURN(x, shard_->backend()->Allocate({0, hidden}));
      out = x;
    }
    int64_t offset = 0;
    for (size_t i = 0; i < num_dp; ++i) {
      row_offset[i] = offset;
      offset += headers[i].num_rows;
      if (headers[i].num_rows == 0) continue;
      Tensor dst = x.Rows(row_offset[i], headers[i].num_rows);
      if (pending_slot_[i] >= 0) {
        DXS_RETURN_IF_ERROR(shard_->backend()->Copy(
            x_buffer_.Rows(slots_[pending_slot_[i]].base_row, headers[i].num_rows), &dst));
      } else {
        DXS_RETURN_IF_ERROR(shard_->backend()->CopyFromHost(pending_[i]->payload.data(),
                                                            headers[i].wire_dtype, &dst));
      }
    }
  }
  // The routing pairs, rows offset to where each rank's rows are in x; reused across
  // rounds like the buffers.
  int64_t total_pairs = 0;
  for (const WireHeader& h : headers) total_pairs += h.num_pairs;
  RoutedPairs& pairs = pairs_;
  pairs.rows.resize(total_pairs);
  pairs.out_rows.resize(in_place ? total_pairs : 0);
  pairs.experts.resize(total_pairs);
  pairs.weights.resize(total_pairs);
  // Which of the round's layer's experts this rank holds, asked once per expert rather
  // than once per pair (Holds is virtual, ExpertShard's a map lookup) when the round has
  // more pairs than there are experts. Asked again every round, so the answers are those
  // of this round's Holds. held_[table_size] == 0: experts outside the table (and every
  // expert of a round too small for one) fail the quick check below and are asked one by
  // one, as before.
  const uint32_t table_size = config_.num_experts > 0 && total_pairs >= config_.num_experts
                                  ? static_cast<uint32_t>(config_.num_experts)
                                  : 0;
  held_.resize(table_size + 1);
  for (uint32_t e = 0; e < table_size; ++e) {
    held_[e] = shard_->Holds(first.layer, static_cast<int>(e)) ? 1 : 0;
  }
  held_[table_size] = 0;
  auto holds = [&](int32_t expert) {
    return static_cast<uint32_t>(expert) < table_size ? held_[expert] != 0
                                                      : shard_->Holds(first.layer, expert);
  };
  int64_t next_pair = 0;
  for (size_t i = 0; i < num_dp; ++i) {
    const WireHeader& h = headers[i];
    const uint8_t* p = pending_slot_[i] >= 0
                           ? slots_[pending_slot_[i]].pairs.data()
                           : pending_[i]->payload.data() +
                                 static_cast<size_t>(h.num_rows) * hidden * DTypeSize(h.wire_dtype);
    int32_t* rows = pairs.rows.data() + next_pair;
    int32_t* experts = pairs.experts.data() + next_pair;
    if (h.num_pairs > 0) {
      std::memcpy(rows, p, h.num_pairs * 4);
      std::memcpy(experts, p + h.num_pairs * 4, h.num_pairs * 4);
      std::memcpy(pairs.weights.data() + next_pair, p + h.num_pairs * 8, h.num_pairs * 4);
    }
    // A branch-free check of every pair against the table (negative rows and experts
    // compare as large unsigned values), then the exact check, and the error naming the
    // first bad pair, only if some pair failed it.
    const uint8_t* held = held_.data();
    const uint32_t num_rows = static_cast<uint32_t>(std::max(h.num_rows, 0));
    bool suspect = false;
    for (int32_t k = 0; k < h.num_pairs; ++k) {
      const uint32_t expert = std::min(static_cast<uint32_t>(experts[k]), table_size);
      suspect |= (static_cast<uint32_t>(rows[k]) >= num_rows) | (held[expert] == 0);
    }
    for (int32_t k = 0; suspect && k < h.num_pairs; ++k) {
      if (rows[k] < 0 || rows[k] >= h.num_rows || !holds(experts[k])) {
        const int32_t row = rows[k], expert = experts[k];
        drop_all();
        return absl::InternalError(absl::StrCat("DP peer ", dp_peers_[i], " routed row ", row,
                                                " to expert ", expert,
                                                ", which this rank does not hold"));
      }
    }
    if (in_place) {
      int32_t* out_rows = pairs.out_rows.data() + next_pair;
      const int32_t out_base = static_cast<int32_t>(out_offset[i]);
      for (int32_t k = 0; k < h.num_pairs; ++k) out_rows[k] = rows[k] + out_base;
    }
    const int32_t offset = static_cast<int32_t>(row_offset[i]);
    if (offset != 0) {
      for (int32_t k = 0; k < h.num_pairs; ++k) rows[k] += offset;
    }
    next_pair += h.num_pairs;
  }
  const auto compute_start = std::chrono::steady_clock::now();
  absl::Status compute = shard_->Forward(first.layer, x, pairs, &out);
  const auto compute_time = std::chrono::steady_clock::now() - compute_start;
  const double compute_seconds = std::chrono::duration<double>(compute_time).count();
  counters_.compute_ns +=
      std::chrono::duration_cast<std::chrono::nanoseconds>(compute_time).count();
  // x is read: its slots may take the ranks' next messages (which cannot come before
  // their combines, sent below, except the other micro-batch's, which has its own slot).
  drop_all();
  DXS_RETURN_IF_ERROR(compute);
  DXS_RETURN_IF_ERROR(MaybeRelayout());
  if (metrics_ != nullptr) metrics_->OnRound(total_rows, pairs, compute_seconds);

  ++counters_.rounds;
  counters_.rows_received += total_rows;
  rows_this_step_ += total_rows;
  if (total_rows == 0) ++counters_.empty_rounds;
  if (first.layer == last_moe_layer_ && first.micro + 1 == first.num_micro) {
    ++counters_.steps;
    if (rows_this_step_ == 0) ++counters_.empty_steps;
    if (metrics_ != nullptr) metrics_->OnStep(rows_this_step_ == 0);
    rows_this_step_ = 0;
  }
  // Combine: each DP rank gets its rows back, pre-summed over this rank's experts; rows
  // already in the wire dtype go straight from out.
  absl::Status send_status;
  for (size_t i = 0; i < num_dp; ++i) {
    WireHeader h = headers[i];
    h.kind = MessageKind::kCombine;
    h.num_pairs = 0;
    const size_t num_values = static_cast<size_t>(h.num_rows) * hidden;
    absl::Status s;
    if (h.wire_dtype == out.dtype()) {
      const uint8_t* rows = static_cast<const uint8_t*>(shard_->backend()->TransportAddress(out)) +
                            out_offset[i] * hidden * DTypeSize(out.dtype());
      s = transport_->Send(dp_peers_[i], h.Encode(), num_values > 0 ? rows : nullptr,
                           num_values * DTypeSize(out.dtype()));
    } else {
      send_buffer_.resize(num_values * DTypeSize(h.wire_dtype));
      s = shard_->backend()->CopyToHost(out.Rows(out_offset[i], h.num_rows), h.wire_dtype,
                                        send_buffer_.data());
      if (s.ok()) {
        s = transport_->Send(dp_peers_[i], h.Encode(), send_buffer_.data(), send_buffer_.size());
      }
    }
    if (!s.ok() && send_status.ok()) send_status = s;
  }
  return send_status;
}

}  // namespace dxs
