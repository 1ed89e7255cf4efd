#include "dataplane/dispatch/dispatch_combine.h"

#include <sched.h>

#include <algorithm>
#include <chrono>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"

namespace dxs {
namespace {

using Clock = std::chrono::steady_clock;

double SecondsSince(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

}  // namespace

RemoteMoeExecutor::RemoteMoeExecutor(Backend* backend, Transport* transport,
                                     std::vector<int> ep_peers, Placement placement, int64_t hidden,
                                     DispatchOptions options)
    : backend_(backend),
      transport_(transport),
      ep_peers_(std::move(ep_peers)),
      placement_(std::move(placement)),
      hidden_(hidden),
      options_(options),
      send_row_size_(options.fp8_dispatch ? Fp8RecordBytes(hidden) : hidden),
      counters_(std::make_unique<DispatchCounters>(static_cast<int>(ep_peers_.size()))) {
  if (placement_.num_ranks() > 0) history_[placement_.version()] = placement_;
}

void RemoteMoeExecutor::AddPlacement(Placement p) {
  const uint64_t version = p.version();
  history_[version] = std::move(p);
  while (history_.size() > kPlacementHistory) history_.erase(history_.begin());
  if (placement_.num_ranks() == 0) (void)UsePlacement(version);
}

bool RemoteMoeExecutor::UsePlacement(uint64_t version) {
  auto it = history_.find(version);
  if (it == history_.end()) return false;
  if (placement_.num_ranks() == 0 || placement_.version() != version) {
    placement_ = it->second;
    expert_owner_ = Tensor();  // uploaded again at the next dispatch
  }
  return true;
}

void RemoteMoeExecutor::set_ep_peers(std::vector<int> peers) {
  if (peers.size() > ep_peers_.size()) {
    auto grown = std::make_unique<DispatchCounters>(static_cast<int>(peers.size()));
    for (size_t r = 0; r < ep_peers_.size(); ++r) {
      grown->tokens_dispatched[r] = counters_->tokens_dispatched[r].load();
      grown->tokens_combined[r] = counters_->tokens_combined[r].load();
    }
    grown->combines_in_target = counters_->combines_in_target.load();
    grown->combines_into_out = counters_->combines_into_out.load();
    grown->combines_mapped = counters_->combines_mapped.load();
    grown->dispatches_from_staged_x = counters_->dispatches_from_staged_x.load();
    grown->combines_into_staged_out = counters_->combines_into_staged_out.load();
    counters_ = std::move(grown);
  }
  if (peers.size() >= ep_peers_.size()) ep_peers_ = std::move(peers);
}

std::vector<int> RemoteMoeExecutor::FailedEpRanks() const {
  std::vector<int> failed;
  for (size_t r = 0; r < ep_peers_.size(); ++r) {
    if (absl::IsUnavailable(transport_->PeerStatus(ep_peers_[r]))) {
      failed.push_back(static_cast<int>(r));
    }
  }
  return failed;
}

DispatchHandle::~DispatchHandle() {
  // A group still in flight is cancelled by a wait that ends at once; its receives stop
  // writing into the handle's buffers (and the caller's out) when it returns.
  if (group && transport != nullptr) (void)transport->WaitExchange(*group, absl::InfinitePast());
}

RemoteMoeExecutor::~RemoteMoeExecutor() = default;

absl::Status RemoteMoeExecutor::Run(int layer, const Tensor& x, const Tensor& ids,
                                    const Tensor& weights, Tensor* out) {
  DXS_ASSIGN_OR_RETURN(std::unique_ptr<MoeHandle> handle,
                       Dispatch(layer, 0, 1, x, ids, weights, out));
  return Combine(std::move(handle), out);
}

absl::Status RemoteMoeExecutor::Layout(const Tensor& ids, const Tensor& weights,
                                       DispatchHandle* handle) {
  const int num_ranks = static_cast<int>(ep_peers_.size());
  if (placement_.num_ranks() == 0 || placement_.num_ranks() > num_ranks) {
    return absl::FailedPreconditionError(absl::StrCat("the placement has ", placement_.num_ranks(),
                                                      " EP ranks, the executor ", num_ranks));
  }
  if (!expert_owner_.defined()) {
    // [E] owners, or [E, replicas] with redundant experts (Placement::RankTable).
    DXS_ASSIGN_OR_RETURN(expert_owner_, backend_->UploadIndices(placement_.RankTable()));
    if (placement_.max_replicas() > 1) {
      expert_owner_ = expert_owner_.Reshape({placement_.num_experts(), placement_.max_replicas()});
    }
  }
  DispatchHandle& h = *handle;
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

absl::StatusOr<std::unique_ptr<MoeHandle>> RemoteMoeExecutor::Dispatch(
    int layer, int micro, int num_micro, const Tensor& x, const Tensor& ids, const Tensor& weights,
    Tensor* out) {
  if (micro < 0 || micro >= num_micro || num_micro > kMaxMicroBatches) {
    return absl::InvalidArgumentError(
        absl::StrCat("micro-batch ", micro, " of ", num_micro, " is out of range"));
  }
  const Clock::time_point dispatch_start = Clock::now();
  const int num_ranks = static_cast<int>(ep_peers_.size());
  std::unique_ptr<DispatchHandle> handle;
  if (!spare_handles_.empty()) {
    handle = std::move(spare_handles_.back());  // its buffers are reused
    spare_handles_.pop_back();
  } else {
    handle = std::make_unique<DispatchHandle>();
  }
  DispatchHandle& h = *handle;
  h.transport = transport_;
  h.executor = this;
  h.step = step_;
  h.dispatch_start_ns =
      std::chrono::duration_cast<std::chrono::nanoseconds>(dispatch_start.time_since_epoch())
          .count();
  h.layer = layer;
  h.micro = micro;
  const DType dtype = options_.wire_dtype;
  if (!IsFloatDType(x.dtype()) ||
      (out != nullptr && out->defined() && !IsFloatDType(out->dtype()))) {
    return absl::InvalidArgumentError("activations must be floating point");
  }
  if (ids.rows() != x.rows()) {
    return absl::InvalidArgumentError(
        absl::StrCat(ids.rows(), " routed tokens for ", x.rows(), " rows"));
  }
  DXS_RETURN_IF_ERROR(Layout(ids, weights, &h));
  const int64_t total_rows = h.token_offsets[num_ranks];
  const int64_t total_pairs = h.pair_offsets[num_ranks];
  // A rank of this placement already known to have failed: nothing is sent to anyone, so
  // the healthy ranks get no round that nobody will combine (the step is run again once
  // a placement without that rank arrives).
  for (int r = 0; r < num_ranks && r < placement_.num_ranks(); ++r) {
    if (placement_.experts_of(r).empty()) continue;
    if (absl::Status s = transport_->PeerStatus(ep_peers_[r]); absl::IsUnavailable(s)) {
      return absl::UnavailableError(absl::StrCat("dispatch to EP rank ", r, ": ", s.message()));
    }
  }
  int ranks_with_rows = 0;
  for (int r = 0; r < num_ranks; ++r) ranks_with_rows += h.num_tokens_per_rank[r] > 0 ? 1 : 0;
  // Combines land in the handle's receive tensor (reused while big enough), or straight in
  // out when one rank holds every token in order and is the only rank with rows.
  DispatchPlan plan;
  const int64_t n0 = ranks_with_rows == 1 ? total_rows : -1;
  plan.single_rank_in_order = n0 > 0 && n0 == h.num_tokens && out != nullptr && out->defined() &&
                              out->num_elements() == n0 * hidden_;
  plan.takes_x.assign(num_ranks, false);
  for (int r = 0; r < num_ranks; ++r) {
    const int64_t n = h.num_tokens_per_rank[r];
    plan.takes_x[r] = n > 0 && n == h.num_tokens && x.dtype() == dtype && !options_.fp8_dispatch;
  }
  DXS_RETURN_IF_ERROR(PlaceInRegion(micro, x, out, total_rows, total_pairs, &plan, &h));
  const bool into_out = !plan.in_region && plan.single_rank_in_order && out->dtype() == dtype;
  // Where the answers will be: in out already (straight from the transport, or from the
  // rank that answered into the staged out), one rank's in order (copied), or summed.
  h.read_staged_x = plan.in_region &&
                    std::find(plan.takes_x.begin(), plan.takes_x.end(), true) != plan.takes_x.end();
  h.answered_staged_out = plan.out_in_region && out->buffer() == h.recv_rows.buffer() &&
                          out->offset_bytes() == h.recv_rows.offset_bytes();
  h.answers = into_out || h.answered_staged_out             ? DispatchHandle::Answers::kInOut
              : plan.in_region && plan.single_rank_in_order ? DispatchHandle::Answers::kCopy
                                                            : DispatchHandle::Answers::kSum;
  if (!plan.in_region && !into_out &&
      (!h.recv_rows.defined() || h.recv_rows.rows() < total_rows || h.recv_rows.dtype() != dtype)) {
    DXS_ASSIGN_OR_RETURN(h.recv_rows,
                         backend_->Allocate({std::max<int64_t>(total_rows, 1), hidden_}, dtype));
  }
  // Pack: rows of ranks that do not take x as it is, gathered into the wire dtype (in a
  // region, every rank's but those reading the staged x: the EP ranks read them there).
  bool packed = false;
  for (int r = 0; r < num_ranks; ++r) {
    const int64_t n = h.num_tokens_per_rank[r];
    if (n == 0 || plan.takes_x[r]) continue;
    const DType send_dtype = options_.fp8_dispatch ? DType::kF8E4M3 : dtype;
    if (!packed && !plan.in_region &&
        (!h.send_rows.defined() || h.send_rows.rows() < total_rows ||
         h.send_rows.dtype() != send_dtype || h.send_rows.row_size() != send_row_size_)) {
      DXS_ASSIGN_OR_RETURN(h.send_rows,
                           backend_->Allocate({total_rows, send_row_size_}, send_dtype));
    }
    packed = true;
    Tensor region = h.send_rows.Rows(h.token_offsets[r], n);
    if (options_.fp8_dispatch) {
      DXS_RETURN_IF_ERROR(
          backend_->QuantizeRowsFp8(x, h.layout.token_rows.Rows(h.token_offsets[r], n), &region));
      continue;
    }
    if (n == h.num_tokens && x.dtype() == dtype) {
      DXS_RETURN_IF_ERROR(backend_->Copy(x, &region));  // every token, in order, as it is
      continue;
    }
    Tensor rows = h.layout.token_rows.Rows(h.token_offsets[r], n);
    DXS_RETURN_IF_ERROR(backend_->GatherRows(x, rows, &region));
  }
  if (plan.in_region && total_pairs > 0) {
    DXS_RETURN_IF_ERROR(backend_->Copy(h.layout.pairs.Rows(0, 3 * total_pairs), &h.pairs));
  }
  // An EP rank reads its rows in place as soon as its header arrives: in a region, the
  // pack (and whatever wrote x) must have finished before the headers go.
  absl::Status written = plan.in_region ? RowsWritten() : absl::OkStatus();
  // Headers (the counts size the receives), then the one group: to every EP rank its rows
  // and pairs, from every EP rank its combine rows, zero sizes included; with a rank that
  // maps the region, only its status back. Keep announcing after a failure so the healthy
  // ranks see this layer from us and stay in step.
  absl::Status send_status = written;
  std::vector<bool>& in_step = in_step_;
  in_step.assign(num_ranks, false);
  for (int r = 0; r < num_ranks && written.ok(); ++r) {
    // Ranks holding no expert of this placement take no part (and have no rows).
    if (r >= placement_.num_ranks() || placement_.experts_of(r).empty()) continue;
    absl::Status s = SendHeader(r, micro, num_micro, h, plan);
    if (!s.ok()) {
      if (send_status.ok()) {
        send_status =
            absl::UnavailableError(absl::StrCat("dispatch to EP rank ", r, ": ", s.message()));
      }
      continue;
    }
    in_step[r] = true;
    counters_->tokens_dispatched[r] += h.num_tokens_per_rank[r];
  }
  const MemoryType memory = TransportMemoryOf(*backend_);
  // Rows out (the dispatch: FP8 records or wire-dtype rows) and answers back (wire dtype).
  const size_t row_bytes = static_cast<size_t>(hidden_) * DTypeSize(dtype);
  const size_t send_row_bytes = DispatchRowBytes();
  transfers_.clear();
  h.answer_index.assign(num_ranks, -1);
  size_t mapped_sent = 0, mapped_received = 0;
  for (int r = 0; r < num_ranks; ++r) {
    if (!in_step[r]) continue;
    const int peer = ep_peers_[r];
    const int64_t n = h.num_tokens_per_rank[r];
    const size_t rows_bytes = static_cast<size_t>(n) * row_bytes;
    const size_t send_bytes = static_cast<size_t>(n) * send_row_bytes;
    const size_t pair_bytes = static_cast<size_t>(h.num_pairs_per_rank[r]) * sizeof(int32_t);
    if (h.mapped[r]) {
      h.statuses[r] = -1;
      h.answer_index[r] = static_cast<int>(transfers_.size());
      transfers_.push_back(
          {Transfer::Kind::kRecv, peer, &h.statuses[r], sizeof(int32_t), MemoryType::kHost});
      mapped_sent += send_bytes + 3 * pair_bytes;
      mapped_received += rows_bytes;
      continue;
    }
    const bool straight = plan.takes_x[r];
    uint8_t* rows = nullptr;
    uint8_t* answer = nullptr;
    if (n > 0) {
      rows = straight ? static_cast<uint8_t*>(backend_->TransportAddress(x))
                      : static_cast<uint8_t*>(backend_->TransportAddress(h.send_rows)) +
                            h.token_offsets[r] * send_row_bytes;
      answer = into_out ? static_cast<uint8_t*>(backend_->TransportAddress(*out))
                        : static_cast<uint8_t*>(backend_->TransportAddress(h.recv_rows)) +
                              h.token_offsets[r] * row_bytes;
    }
    transfers_.push_back({Transfer::Kind::kSend, peer, rows, send_bytes, memory});
    // The rank's pairs, one block straight from the layout: rows | experts | weights.
    uint8_t* pairs = static_cast<uint8_t*>(
        backend_->TransportAddress(plan.in_region ? h.pairs : h.layout.pairs));
    transfers_.push_back(
        {Transfer::Kind::kSend, peer,
         pair_bytes > 0 ? pairs + 3 * h.pair_offsets[r] * sizeof(int32_t) : nullptr, 3 * pair_bytes,
         memory});
    h.answer_index[r] = static_cast<int>(transfers_.size());
    transfers_.push_back({Transfer::Kind::kRecv, peer, answer, rows_bytes, memory});
  }
  h.num_transfers = transfers_.size();
  // The transport reads the rows as soon as the group is posted: the pack (and whatever
  // wrote x) must have finished on the backend's queue.
  if (written.ok() && !plan.in_region) {
    written = RowsWritten();
    if (!written.ok() && send_status.ok()) send_status = written;
  }
  if (written.ok()) {
    if (observer_ != nullptr) {
      observer_->OnExchange(transfers_.data(), transfers_.size());
      if (plan.in_region) observer_->OnMappedBytes(mapped_sent, mapped_received);
    }
    absl::StatusOr<ExchangeId> group = transport_->PostExchange(
        ExchangeTag(WireHeader::Key(step_, layer, micro)), transfers_.data(), transfers_.size());
    if (group.ok()) {
      h.group = *group;
    } else if (send_status.ok()) {
      send_status = absl::UnavailableError(
          absl::StrCat("dispatch of layer ", layer, ": ", group.status().message()));
    }
  }
  if (observer_ != nullptr) {
    observer_->OnDispatch(h.num_tokens_per_rank, in_step, SecondsSince(dispatch_start));
  }
  if (!send_status.ok()) return send_status;  // the handle goes, and its group with it
  return std::unique_ptr<MoeHandle>(std::move(handle));
}

absl::StatusOr<SharedMemory> RemoteMoeExecutor::MapRegion(size_t bytes, bool device) {
  if (device) return backend_->AllocateShared(bytes);
  DXS_ASSIGN_OR_RETURN(MappedRegion mapped, transport_->MapRegion(bytes));
  Transport* transport = transport_;
  return SharedMemory{
      std::make_shared<Buffer>(Device::kCpu, mapped.data, mapped.bytes,
                               [transport](void* data) { transport->UnmapRegion(data); }),
      std::move(mapped.key)};
}

namespace {

constexpr size_t kRegionAlignment = 64;
size_t AlignUp(size_t bytes) {
  return (bytes + kRegionAlignment - 1) / kRegionAlignment * kRegionAlignment;
}

}  // namespace

bool RemoteMoeExecutor::MappableRanks(std::vector<bool>* mapped) const {
  const int num_ranks = static_cast<int>(ep_peers_.size());
  mapped->assign(num_ranks, false);
  // Host tensors: a region the transport maps; GPU tensors: a block the backend shares.
  // With FP8 dispatch rows the region holds the records (PlaceInRegion).
  if (!options_.mapped_regions || !backend_->capabilities().maps_regions) return false;
  bool any = false;
  for (int r = 0; r < num_ranks && r < placement_.num_ranks(); ++r) {
    if (placement_.experts_of(r).empty()) continue;
    auto it = unmappable_.find(r);
    if (it != unmappable_.end() && it->second == ep_peers_[r]) continue;
    (*mapped)[r] = transport_->CanAttachPeerRegions(ep_peers_[r]);
    any = any || (*mapped)[r];
  }
  return any;
}

bool RemoteMoeExecutor::EnsureRegion(int micro, size_t bytes) {
  Region& region = regions_[micro];
  if (region.buffer != nullptr && region.buffer->num_bytes() >= bytes) return true;
  // Grown geometrically; the old region goes with its last view.
  const bool device = backend_->capabilities().device_memory;
  const size_t size =
      std::max(bytes, region.buffer == nullptr ? 0 : 2 * region.buffer->num_bytes());
  absl::StatusOr<SharedMemory> shared = MapRegion(size, device);
  if (!shared.ok()) return false;
  // A GPU block stays allocated while the executor lives: an EP rank that gave up on a
  // step may still store into it, and unlike shared host memory nothing else keeps it.
  if (device && region.buffer != nullptr) retired_regions_.push_back(region.buffer);
  region.buffer = std::move(shared->buffer);
  region.key = std::move(shared->key);
  region.staged_rows = 0;
  return true;
}

size_t RemoteMoeExecutor::StagedBytes(int64_t rows) const {
  return 2 * AlignUp(static_cast<size_t>(rows * hidden_) * DTypeSize(options_.wire_dtype));
}

bool RemoteMoeExecutor::StageBuffers(int micro, int64_t rows, DType dtype, Tensor* x, Tensor* out) {
  if (micro < 0 || micro >= kMaxMicroBatches || rows <= 0 || dtype != options_.wire_dtype) {
    return false;
  }
  if (!MappableRanks(&mappable_)) return false;
  Region& region = regions_[micro];
  if (region.buffer == nullptr || region.staged_rows < rows) {
    // x and out first, then room for a dispatch of as many rows (its packed rows, answers
    // and top-8 pairs) so that the dispatch need not grow the region away from them.
    if (!EnsureRegion(micro, 2 * StagedBytes(rows) + AlignUp(96 * static_cast<size_t>(rows)))) {
      return false;
    }
    region.staged_rows = rows;
  }
  const size_t out_at = StagedBytes(region.staged_rows) / 2;
  *x = Tensor(region.buffer, dtype, {rows, hidden_});
  *out = Tensor(region.buffer, dtype, {rows, hidden_}, out_at / DTypeSize(dtype));
  return true;
}

absl::Status RemoteMoeExecutor::PlaceInRegion(int micro, const Tensor& x, const Tensor* out,
                                              int64_t total_rows, int64_t total_pairs,
                                              DispatchPlan* dispatch, DispatchHandle* handle) {
  DispatchHandle& h = *handle;
  DispatchPlan& plan = *dispatch;
  const int num_ranks = static_cast<int>(ep_peers_.size());
  if (h.region_views) {
    // Views of a region: never reused by a dispatch that does not place in one.
    h.send_rows = h.recv_rows = h.pairs = Tensor();
    h.region_views = false;
  }
  plan.in_region = plan.device_region = plan.out_in_region = false;
  h.statuses.assign(num_ranks, 0);
  if (!MappableRanks(&h.mapped)) return absl::OkStatus();
  const DType dtype = options_.wire_dtype;
  const size_t elem = DTypeSize(dtype);
  Region& region = regions_[micro];
  size_t base = StagedBytes(region.staged_rows);
  // The caller's x and out where StageBuffers put them (the region's first bytes).
  const auto staged = [&](const Tensor& t) {
    return region.buffer != nullptr && t.defined() && t.buffer() == region.buffer &&
           t.dtype() == dtype && t.num_elements() == h.num_tokens * hidden_ &&
           t.offset_bytes() + t.num_bytes() <= base;
  };
  bool x_staged = staged(x);
  bool out_staged = plan.single_rank_in_order && staged(*out);
  // Packed rows unless every rank with rows reads x itself; answers unless they go to out.
  bool pack = false;
  for (int r = 0; r < num_ranks; ++r) {
    pack = pack || (h.num_tokens_per_rank[r] > 0 && !(x_staged && plan.takes_x[r]));
  }
  // The region: the staged buffers, then packed rows (FP8 records with fp8_dispatch),
  // answers and the pairs' blocks.
  const size_t rows_bytes = AlignUp(static_cast<size_t>(total_rows * hidden_) * elem);
  const size_t packed_bytes = AlignUp(static_cast<size_t>(total_rows) * DispatchRowBytes());
  size_t send_bytes = pack ? packed_bytes : 0, recv_bytes = out_staged ? 0 : rows_bytes;
  const size_t pair_bytes = AlignUp(12 * static_cast<size_t>(total_pairs));
  if (region.buffer == nullptr ||
      region.buffer->num_bytes() < base + send_bytes + recv_bytes + pair_bytes) {
    // A new region (never this one reused from its start: the caller's staged x and out
    // are there); they stay in the old one, so rows go by the pack.
    if (!EnsureRegion(micro,
                      std::max<size_t>(base + packed_bytes + rows_bytes + pair_bytes, 4096))) {
      // No region (none can be mapped, or no memory): every rank by copy this time.
      h.mapped.assign(num_ranks, false);
      return absl::OkStatus();
    }
    x_staged = out_staged = false;
    base = 0;
    send_bytes = packed_bytes;
    recv_bytes = rows_bytes;
  }
  plan.in_region = h.region_views = true;
  plan.device_region = backend_->capabilities().device_memory;
  // In a region, x is read as it is only where it was staged.
  if (!x_staged) plan.takes_x.assign(num_ranks, false);
  plan.x_at = x_staged ? static_cast<int64_t>(x.offset_bytes()) : 0;
  plan.out_in_region = out_staged;
  if (send_bytes == 0) {
    h.send_rows = Tensor();
  } else if (options_.fp8_dispatch) {
    h.send_rows = Tensor(region.buffer, DType::kF8E4M3, {total_rows, send_row_size_}, base);
  } else {
    h.send_rows = Tensor(region.buffer, dtype, {total_rows, hidden_}, base / elem);
  }
  h.recv_rows =
      out_staged ? *out
                 : Tensor(region.buffer, dtype, {total_rows, hidden_}, (base + send_bytes) / elem);
  h.pairs = Tensor(region.buffer, DType::kI32, {3 * total_pairs},
                   (base + send_bytes + recv_bytes) / sizeof(int32_t));
  return absl::OkStatus();
}

absl::Status RemoteMoeExecutor::RowsWritten() {
  if (!rows_written_) {
    DXS_ASSIGN_OR_RETURN(rows_written_, backend_->CreateEvent());
  }
  DXS_RETURN_IF_ERROR(backend_->RecordEvent(rows_written_.get()));
  return backend_->SynchronizeEvent(rows_written_.get());
}

absl::Status RemoteMoeExecutor::SendHeader(int r, int micro, int num_micro, const DispatchHandle& h,
                                           const DispatchPlan& plan) {
  WireHeader header;
  header.kind = MessageKind::kDispatch;
  header.wire_dtype = options_.wire_dtype;
  if (options_.fp8_dispatch) header.flags = WireHeader::kFp8Rows;
  header.micro = static_cast<uint8_t>(micro);
  header.num_micro = static_cast<uint8_t>(num_micro);
  header.step = step_;
  header.dp_mask = dp_mask_;
  header.dp_view = dp_view_;
  header.layer = h.layer;
  header.placement_version = placement_.version();
  header.num_rows = static_cast<int32_t>(h.num_tokens_per_rank[r]);
  header.num_pairs = static_cast<int32_t>(h.num_pairs_per_rank[r]);
  header.hidden = static_cast<int32_t>(hidden_);
  if (!h.mapped[r]) return transport_->Send(ep_peers_[r], header.Encode(), nullptr, 0);
  // The rows, pairs and answers of this rank in the region (offsets from its start).
  const size_t row_bytes = static_cast<size_t>(hidden_) * DTypeSize(options_.wire_dtype);
  header.flags |= WireHeader::kMapped | (plan.device_region ? WireHeader::kDeviceRegion : 0);
  header.rows_at = plan.takes_x[r] ? plan.x_at
                                   : static_cast<int64_t>(h.send_rows.offset_bytes() +
                                                          h.token_offsets[r] * DispatchRowBytes());
  header.answers_at =
      static_cast<int64_t>(h.recv_rows.offset_bytes() + h.token_offsets[r] * row_bytes);
  header.pairs_at =
      static_cast<int64_t>(h.pairs.offset_bytes() + 3 * h.pair_offsets[r] * sizeof(int32_t));
  const std::string& key = regions_[h.micro].key;
  return transport_->Send(ep_peers_[r], header.Encode(), key.data(), key.size());
}

absl::Status RemoteMoeExecutor::Combine(std::unique_ptr<MoeHandle> handle, Tensor* out) {
  auto* dispatched = dynamic_cast<DispatchHandle*>(handle.get());
  if (dispatched == nullptr || dispatched->executor != this || !dispatched->group) {
    return absl::FailedPreconditionError("combine without a dispatch of this executor");
  }
  DispatchHandle& h = *dispatched;
  const int layer = h.layer, micro = h.micro;
  const Clock::time_point combine_start = Clock::now();
  const int num_ranks = static_cast<int>(ep_peers_.size());
  const absl::Time wait_start = absl::Now();
  const absl::Time deadline = wait_start + options_.timeout;
  // A wait expected to be short is spun through (see DispatchOptions::max_combine_spin),
  // up to half again its expected length.
  const bool spin = expected_combine_wait_ > absl::ZeroDuration() &&
                    expected_combine_wait_ <= options_.max_combine_spin;
  const absl::Time spin_end = wait_start + expected_combine_wait_ * 1.5;
  while (spin && !transport_->ExchangeDone(*h.group) && absl::Now() < spin_end) sched_yield();
  absl::Status waited_status =
      observer_ != nullptr
          ? transport_->WaitExchangeTimed(*h.group, deadline, &done_ns_, h.num_transfers)
          : transport_->WaitExchange(*h.group, deadline);
  h.group.reset();  // waited for: done, or cancelled by the failed wait
  if (!waited_status.ok()) {
    return absl::UnavailableError(absl::StrCat("combine (step ", h.step, ", layer ", layer,
                                               ", micro-batch ", micro,
                                               "): ", waited_status.message()));
  }
  const absl::Duration waited = absl::Now() - wait_start;
  expected_combine_wait_ = expected_combine_wait_ == absl::ZeroDuration()
                               ? waited
                               : (expected_combine_wait_ * 3 + waited) / 4;
  for (int r = 0; r < num_ranks; ++r) {
    if (!h.mapped[r] || h.statuses[r] == 0) continue;
    if (h.statuses[r] == kRegionUnmappable) unmappable_[r] = ep_peers_[r];
    return absl::UnavailableError(absl::StrCat(
        "combine (step ", h.step, ", layer ", layer, ", micro-batch ", micro, "): EP rank ", r,
        h.statuses[r] == kRegionUnmappable
            ? " could not map this rank's region; its rounds go by copy from now on"
            : absl::StrCat(" answered status ", h.statuses[r])));
  }
  // Straight into out from the transport (not through a region's staged out).
  const bool into_out = h.answers == DispatchHandle::Answers::kInOut && !h.answered_staged_out;
  for (int r = 0; r < num_ranks; ++r) {
    ++counters_->combines_in_target;
    if (h.mapped[r]) ++counters_->combines_mapped;
    if (into_out && h.num_tokens_per_rank[r] > 0) ++counters_->combines_into_out;
    counters_->tokens_combined[r] += h.num_tokens_per_rank[r];
  }
  if (h.read_staged_x) ++counters_->dispatches_from_staged_x;
  if (h.answered_staged_out) ++counters_->combines_into_staged_out;
  switch (h.answers) {
    case DispatchHandle::Answers::kInOut:
      break;
    case DispatchHandle::Answers::kCopy:  // one rank answered every token, in order
      DXS_RETURN_IF_ERROR(backend_->Copy(h.recv_rows, out));
      break;
    case DispatchHandle::Answers::kSum:
      DXS_RETURN_IF_ERROR(
          backend_->CombineRows(h.recv_rows, h.layout.token_rows, h.token_offsets, out));
      break;
  }
  if (observer_ != nullptr) {
    if (h.read_staged_x || h.answered_staged_out) {
      observer_->OnInPlace(h.read_staged_x, h.answered_staged_out);
    }
    observer_->OnCombine(h.num_tokens_per_rank, SecondsSince(combine_start));
    answer_seconds_.assign(num_ranks, 0.0);
    answered_.assign(num_ranks, false);
    for (int r = 0; r < num_ranks && r < static_cast<int>(h.answer_index.size()); ++r) {
      const int i = h.answer_index[r];
      if (i < 0 || static_cast<size_t>(i) >= done_ns_.size()) continue;
      answered_[r] = true;
      answer_seconds_[r] = std::max<int64_t>(done_ns_[i] - h.dispatch_start_ns, 0) * 1e-9;
    }
    observer_->OnEpAnswers(answer_seconds_, answered_);
  }
  handle.release();
  spare_handles_.emplace_back(dispatched);  // for its buffers
  return absl::OkStatus();
}

}  // namespace dxs
