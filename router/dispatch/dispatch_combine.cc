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

// A rank's rows go out as an IOV of their runs of consecutive rows unless there are many
// short runs; then packing them into one buffer is cheaper. transport_bench, 2 cores:
// 512 pieces cost +5 us over one buffer at 1 MiB (packing 1 MiB: ~80 us) and +150 us at
// 16 MiB (packing: ~1.3 ms), but +6 us at 64 KiB in 128-byte pieces (packing: ~5 us).
constexpr size_t kMaxShortRowSegments = 64;
constexpr size_t kMinIovSegmentBytes = 1024;

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
  DispatchLayout layout;
  ComputeLayout(placement, ids, weights, top_k, &layout);
  return layout;
}

void ComputeLayout(const Placement& placement, const std::vector<int32_t>& ids,
                   const std::vector<float>& weights, int top_k, DispatchLayout* layout) {
  const int num_ranks = placement.num_ranks();
  layout->token_rows.resize(num_ranks);
  layout->pairs.resize(num_ranks);
  const int64_t num_tokens = top_k > 0 ? static_cast<int64_t>(ids.size()) / top_k : 0;
  const int64_t num_pairs = num_tokens * top_k;
  const int32_t* id = ids.data();
  const float* weight = weights.data();
  if (num_ranks == 1) {
    // One rank holds every expert: it gets every token in order, with the pairs as routed
    // (row = token). Filled directly, with no per-pair owner lookups.
    std::vector<int32_t>& token_rows = layout->token_rows[0];
    RoutedPairs& pairs = layout->pairs[0];
    token_rows.resize(num_tokens);
    std::iota(token_rows.begin(), token_rows.end(), 0);
    pairs.rows.resize(num_pairs);
    for (int64_t t = 0; t < num_tokens; ++t) {
      std::fill_n(pairs.rows.data() + t * top_k, top_k, static_cast<int32_t>(t));
    }
    pairs.experts.assign(id, id + num_pairs);
    pairs.weights.assign(weight, weight + num_pairs);
    return;
  }
  // Two passes: count each rank's tokens and pairs, then fill the exactly sized arrays
  // (reused storage) through per-rank cursors, with none of push_back's capacity checks
  // (four per pair before). A token is new to rank r when r last saw an earlier token:
  // per-rank stamps, no per-token reset of a rank -> row map.
  std::vector<int64_t> token_count(num_ranks, 0), pair_count(num_ranks, 0);
  std::vector<int64_t> last_token(num_ranks, -1);
  for (int64_t t = 0; t < num_tokens; ++t) {
    for (int k = 0; k < top_k; ++k) {
      const int r = placement.owner(id[t * top_k + k]);
      ++pair_count[r];
      if (last_token[r] != t) {
        last_token[r] = t;
        ++token_count[r];
      }
    }
  }
  struct Cursor {
    int32_t* token_rows;
    int32_t* rows;
    int32_t* experts;
    float* weights;
    int32_t next_row;  // the rank's next local row
    int64_t next_pair;
  };
  std::vector<Cursor> cursor(num_ranks);
  for (int r = 0; r < num_ranks; ++r) {
    RoutedPairs& pairs = layout->pairs[r];
    layout->token_rows[r].resize(token_count[r]);
    pairs.rows.resize(pair_count[r]);
    pairs.experts.resize(pair_count[r]);
    pairs.weights.resize(pair_count[r]);
    cursor[r] = {layout->token_rows[r].data(),
                 pairs.rows.data(),
                 pairs.experts.data(),
                 pairs.weights.data(),
                 0,
                 0};
  }
  std::fill(last_token.begin(), last_token.end(), -1);
  for (int64_t t = 0; t < num_tokens; ++t) {
    for (int k = 0; k < top_k; ++k) {
      const int32_t expert = id[t * top_k + k];
      const int r = placement.owner(expert);
      Cursor& c = cursor[r];
      if (last_token[r] != t) {
        last_token[r] = t;
        c.token_rows[c.next_row++] = static_cast<int32_t>(t);
      }
      c.rows[c.next_pair] = c.next_row - 1;
      c.experts[c.next_pair] = expert;
      c.weights[c.next_pair] = weight[t * top_k + k];
      ++c.next_pair;
    }
  }
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
  ComputeLayout(placement_, ids, weights, top_k, &flight.layout);
  const DispatchLayout& layout = flight.layout;
  const DType dtype = options_.wire_dtype;
  if (x.dtype() != DType::kF32 && x.dtype() != dtype) {
    return absl::InvalidArgumentError(
        absl::StrCat("activations are ", std::string(DTypeName(x.dtype())), ", the wire is ",
                     std::string(DTypeName(dtype))));
  }
  if (out != nullptr && out->defined() && out->dtype() != DType::kF32 && out->dtype() != dtype) {
    return absl::InvalidArgumentError(
        absl::StrCat("the MoE output is ", std::string(DTypeName(out->dtype())), ", the wire is ",
                     std::string(DTypeName(dtype))));
  }
  const size_t row_bytes = static_cast<size_t>(hidden_) * DTypeSize(dtype);
  const int64_t num_tokens = top_k > 0 ? static_cast<int64_t>(ids.size()) / top_k : 0;
  int ranks_with_rows = 0;
  for (int r = 0; r < num_ranks; ++r) ranks_with_rows += layout.token_rows[r].empty() ? 0 : 1;
  // Name every rank's combine target before the first dispatch leaves: a fast rank's
  // answer can arrive while the next rank's dispatch is being sent.
  if (transport_->receive_target_provider() != this) transport_->SetReceiveTargetProvider(this);
  flight.targets.resize(num_ranks);
  flight.combine_bytes.resize(num_ranks);
  bool first_rank = true;
  for (int r = 0; r < num_ranks; ++r) {
    const int64_t n = static_cast<int64_t>(layout.token_rows[r].size());
    CombineTarget& target = flight.targets[r];
    target.state = CombineTarget::State::kExpected;
    target.key = WireHeader::Key(step_, layer, static_cast<uint8_t>(micro));
    target.bytes = static_cast<size_t>(n) * row_bytes;
    // Rows are ascending and distinct, so n == num_tokens means every token in order. A
    // float32 output takes later ranks' sums in place; a narrower one only a single
    // rank's rows (a sum of several is rounded once, from float32).
    target.into_out = first_rank && n > 0 && n == num_tokens && out != nullptr && out->defined() &&
                      out->dtype() == dtype && out->num_elements() == n * hidden_ &&
                      (dtype == DType::kF32 || ranks_with_rows == 1);
    if (target.into_out) {
      target.dest = static_cast<uint8_t*>(out->raw());
    } else {
      flight.combine_bytes[r].resize(target.bytes);
      target.dest = flight.combine_bytes[r].data();
    }
    if (n > 0) first_rank = false;
  }
  // Dispatch: one message to every EP rank, empty ones included. Keep sending after a
  // failure so the healthy ranks see this layer from us and stay in step.
  absl::Status send_status;
  for (int r = 0; r < num_ranks; ++r) {
    const std::vector<int32_t>& rows = layout.token_rows[r];
    const RoutedPairs& pairs = layout.pairs[r];
    const int64_t n = static_cast<int64_t>(rows.size());
    // Rows already in the wire dtype go straight from x, runs of consecutive rows as one
    // segment; float32 rows on a narrower wire (and many short runs) are narrowed or
    // packed into scratch_.
    segments_.clear();
    const bool in_wire_dtype = x.dtype() == dtype;
    const uint8_t* x_bytes = static_cast<const uint8_t*>(x.raw());
    if (in_wire_dtype) {
      for (int64_t i = 0; i < n;) {
        int64_t end = i + 1;
        while (end < n && rows[end] == rows[end - 1] + 1) ++end;
        segments_.push_back({x_bytes + rows[i] * row_bytes, (end - i) * row_bytes});
        i = end;
      }
    }
    const bool many_short = segments_.size() > kMaxShortRowSegments &&
                            n * row_bytes < segments_.size() * kMinIovSegmentBytes;
    if (!in_wire_dtype || many_short) {
      segments_.clear();
      scratch_.resize(n * row_bytes);
      for (int64_t i = 0; i < n; ++i) {
        if (in_wire_dtype) {
          std::memcpy(scratch_.data() + i * row_bytes, x_bytes + rows[i] * row_bytes, row_bytes);
        } else {
          NarrowFromFloat32(dtype, x.f32() + rows[i] * hidden_, hidden_,
                            scratch_.data() + i * row_bytes);
        }
      }
      segments_.push_back({scratch_.data(), scratch_.size()});
    }
    const size_t pair_bytes = pairs.size() * sizeof(int32_t);
    segments_.push_back({pairs.rows.data(), pair_bytes});
    segments_.push_back({pairs.experts.data(), pair_bytes});
    segments_.push_back({pairs.weights.data(), pair_bytes});
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
    absl::Status s =
        transport_->SendV(ep_peers_[r], h.Encode(), segments_.data(), segments_.size());
    if (!s.ok() && send_status.ok()) {
      send_status =
          absl::UnavailableError(absl::StrCat("dispatch to EP rank ", r, ": ", s.message()));
    }
    counters_->tokens_dispatched[r] += n;
  }
  if (observer_ != nullptr) observer_->OnDispatch(layout, SecondsSince(dispatch_start));
  if (!send_status.ok()) {
    AbandonTargets(flight);
    return send_status;
  }
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
  const absl::Time wait_start = absl::Now();
  const absl::Time deadline = wait_start + options_.timeout;
  // A wait expected to be short is spun through (see DispatchOptions::max_combine_spin),
  // up to half again its expected length.
  const bool spin = expected_combine_wait_ > absl::ZeroDuration() &&
                    expected_combine_wait_ <= options_.max_combine_spin;
  const absl::Time spin_end = wait_start + expected_combine_wait_ * 1.5;
  std::vector<TransportMessage> replies(num_ranks);
  for (int r = 0; r < num_ranks; ++r) {
    while (spin && !transport_->HasMessage(ep_peers_[r]) && absl::Now() < spin_end) sched_yield();
    absl::StatusOr<TransportMessage> m = RecvCombine(r, layer, micro, deadline);
    if (!m.ok()) {
      AbandonTargets(flight);
      return absl::UnavailableError(absl::StrCat("combine from EP rank ", r, " (step ", step_,
                                                 ", layer ", layer, ", micro-batch ", micro,
                                                 "): ", m.status().message()));
    }
    replies[r] = std::move(*m);
    if (replies[r].target == this) flight.targets[r].state = CombineTarget::State::kNone;
  }
  AbandonTargets(flight);  // ranks answered: nothing is in flight; unexpected answers skip
  const absl::Duration waited = absl::Now() - wait_start;
  expected_combine_wait_ = expected_combine_wait_ == absl::ZeroDuration()
                               ? waited
                               : (expected_combine_wait_ * 3 + waited) / 4;
  const int64_t num_tokens = out->rows();
  // The first rank holding a token writes it (0 + a == a: see the file comment), later
  // ones add; out is read once per rank that holds the token. A narrower output is
  // summed in float32 (sum_) and rounded once at the end, unless one rank's rows landed
  // in it, which then are the whole answer.
  const bool sum_in_out = out->dtype() == DType::kF32;
  if (!sum_in_out) sum_.resize(static_cast<size_t>(num_tokens) * hidden_);
  float* const sum = sum_in_out ? out->f32() : sum_.data();
  bool landed_in_out = false;
  touched_.assign(num_tokens, 0);
  row_.resize(hidden_);
  for (int r = 0; r < num_ranks; ++r) {
    const std::vector<int32_t>& rows = layout.token_rows[r];
    const int64_t n = static_cast<int64_t>(rows.size());
    DXS_ASSIGN_OR_RETURN(WireHeader h, WireHeader::Decode(replies[r].header));
    const size_t reply_row_bytes = static_cast<size_t>(hidden_) * DTypeSize(h.wire_dtype);
    if (h.num_rows != n || replies[r].payload_size() != n * reply_row_bytes) {
      return absl::InternalError(
          absl::StrCat("combine from EP rank ", r, ": ", h.num_rows, " rows, expected ", n));
    }
    const bool in_target = replies[r].target == this;
    if (in_target) ++counters_->combines_in_target;
    if (in_target && flight.targets[r].into_out) {
      ++counters_->combines_into_out;
      // Already in place: every token, in order.
      std::fill(touched_.begin(), touched_.end(), 1);
      landed_in_out = true;
      counters_->tokens_combined[r] += n;
      continue;
    }
    const uint8_t* src = in_target ? flight.targets[r].dest : replies[r].payload.data();
    for (int64_t i = 0; i < n; ++i) {
      const uint8_t* row = src + i * reply_row_bytes;
      float* dst = sum + rows[i] * hidden_;
      if (!touched_[rows[i]]) {
        UnpackRows(row, 1, hidden_, h.wire_dtype, dst);
        touched_[rows[i]] = 1;
        continue;
      }
      const float* add = reinterpret_cast<const float*>(row);
      if (h.wire_dtype != DType::kF32) {
        // Widened into a cache-resident buffer first.
        UnpackRows(row, 1, hidden_, h.wire_dtype, row_.data());
        add = row_.data();
      }
      for (int64_t j = 0; j < hidden_; ++j) dst[j] += add[j];
    }
    counters_->tokens_combined[r] += n;
  }
  for (int64_t t = 0; t < num_tokens; ++t) {
    if (!touched_[t]) std::fill(sum + t * hidden_, sum + (t + 1) * hidden_, 0.f);
  }
  if (!sum_in_out && !landed_in_out) {
    NarrowFromFloat32(out->dtype(), sum, static_cast<size_t>(num_tokens) * hidden_, out->raw());
  }
  if (observer_ != nullptr) observer_->OnCombine(layout, SecondsSince(combine_start));
  return absl::OkStatus();
}

}  // namespace dxs
