#include "expert_service/expert_step_server.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <numeric>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "common/step_trace.h"
#include "common/timeouts.h"
#include "dataplane/dispatch/dispatch_combine.h"
#include "dataplane/dispatch/wire.h"
#include "kernels/backend.h"

namespace dxs {
namespace {

// How long a round's combine may take to be delivered: the attention side's default step
// timeout (DispatchOptions::timeout), after which that side has failed the step itself. A DP rank
// takes it as soon as it makes progress (its receive is posted with its dispatch).
constexpr absl::Duration kCombineSendWait = kDefaultStepTimeout;

// Copies between a region's view and a round tensor of the backend: on the backend when
// the region lies where it keeps tensors, else through its host copies (a CPU DP rank's
// host region, a GPU expert rank).
absl::Status CopyIn(Backend* backend, const Tensor& region, Tensor* dst) {
  if (region.device() == backend->device()) return backend->Copy(region, dst);
  return backend->CopyFromHost(region.raw(), region.dtype(), dst);
}
absl::Status CopyOut(Backend* backend, const Tensor& src, Tensor* region) {
  if (region->device() == backend->device()) return backend->Copy(src, region);
  return backend->CopyToHost(src, region->dtype(), region->raw());
}

std::string KeyText(const WireHeader& h) {
  return absl::StrCat("(step ", h.step, ", layer ", h.layer, ", micro ", h.micro, ")");
}

}  // namespace

ExpertStepServer::ExpertStepServer(Transport* transport, std::vector<int> dp_peers,
                                   ExpertCompute* shard, const ModelConfig& config)
    : transport_(transport), shard_(shard), config_(config) {
  for (int l = 0; l < config.num_hidden_layers; ++l) {
    if (config.IsMoeLayer(l)) last_moe_layer_ = l;
  }
  set_dp_peers(std::move(dp_peers));
}

ExpertStepServer::~ExpertStepServer() {
  // The output buffers must outlive sends still reading them.
  WaitCombineSends(0);
  WaitCombineSends(1);
}

void ExpertStepServer::set_dp_peers(std::vector<int> peers) {
  dp_peers_ = std::move(peers);
  pending_.assign(dp_peers_.size(), std::nullopt);
  abandoned_.assign(dp_peers_.size(), std::nullopt);
  pending_keys_.assign(dp_peers_.size(), std::string());
}

void ExpertStepServer::WaitCombineSends(int k) {
  if (!combine_group_[k]) return;
  // A failed or abandoned send is the DP rank's step failing; that rank sees it.
  (void)transport_->WaitExchange(*combine_group_[k], absl::Now() + kCombineSendWait);
  combine_group_[k].reset();
}

absl::Status ExpertStepServer::EnsureRows(int64_t rows, DType dtype) {
  const int64_t hidden = config_.hidden_size;
  Backend* backend = shard_->backend();
  auto fits = [&](const Tensor& t) {
    return t.defined() && t.dtype() == dtype && t.rows() >= rows;
  };
  // Grown geometrically: fresh megabyte buffers per round cost page faults and fills.
  const int64_t capacity = std::max<int64_t>({rows, 2 * (x_.defined() ? x_.rows() : 0), 1});
  if (!fits(x_)) {
    DXS_ASSIGN_OR_RETURN(x_, backend->Allocate({capacity, hidden}, dtype));
  }
  const int k = next_out_;
  if (!fits(out_[k])) {
    WaitCombineSends(k);
    DXS_ASSIGN_OR_RETURN(out_[k], backend->Allocate({capacity, hidden}, dtype));
  }
  return absl::OkStatus();
}

absl::Status ExpertStepServer::EnsurePairs(int64_t pairs) {
  if (pair_rows_.defined() && pair_rows_.rows() >= pairs) return absl::OkStatus();
  Backend* backend = shard_->backend();
  const int64_t capacity =
      std::max<int64_t>({pairs, 2 * (pair_rows_.defined() ? pair_rows_.rows() : 0), 1});
  DXS_ASSIGN_OR_RETURN(pair_blocks_, backend->Allocate({3 * capacity}, DType::kI32));
  DXS_ASSIGN_OR_RETURN(pair_rows_, backend->Allocate({capacity}, DType::kI32));
  DXS_ASSIGN_OR_RETURN(pair_experts_, backend->Allocate({capacity}, DType::kI32));
  DXS_ASSIGN_OR_RETURN(pair_weights_, backend->Allocate({capacity}, DType::kF32));
  if (!bad_.defined()) {
    DXS_ASSIGN_OR_RETURN(bad_, backend->Allocate({2}, DType::kI32));
  }
  return absl::OkStatus();
}

absl::StatusOr<const Tensor*> ExpertStepServer::HeldTable(int layer) {
  // The experts of `layer` this rank holds, asked of the compute every round (a placement
  // may change between rounds) and uploaded only when the answer changed.
  held_host_.resize(static_cast<size_t>(std::max<int64_t>(config_.num_experts, 1)));
  for (int64_t e = 0; e < config_.num_experts; ++e) {
    held_host_[e] = shard_->Holds(layer, static_cast<int>(e)) ? 1 : 0;
  }
  HeldTableOnBackend& table = held_[layer];
  if (!table.tensor.defined() || table.host != held_host_) {
    Backend* backend = shard_->backend();
    DXS_ASSIGN_OR_RETURN(table.tensor,
                         backend->Allocate({static_cast<int64_t>(held_host_.size())}, DType::kI32));
    DXS_RETURN_IF_ERROR(backend->CopyFromHost(held_host_.data(), DType::kI32, &table.tensor));
    table.host = held_host_;
  }
  return &table.tensor;
}

absl::Status ExpertStepServer::UnpackPairs(int layer, const std::vector<WireHeader>& headers,
                                           int64_t total_pairs, RoutedPairTensors* pairs) {
  pairs->rows = pair_rows_.Rows(0, total_pairs);
  pairs->experts = pair_experts_.Rows(0, total_pairs);
  pairs->weights = pair_weights_.Rows(0, total_pairs);
  if (total_pairs == 0) return absl::OkStatus();  // an empty round: nothing launched
  segments_.clear();
  for (size_t i = 0; i < headers.size(); ++i) {
    segments_.push_back({static_cast<int32_t>(pair_offset_[i]), headers[i].num_pairs,
                         static_cast<int32_t>(row_offset_[i]), headers[i].num_rows});
  }
  Backend* backend = shard_->backend();
  DXS_ASSIGN_OR_RETURN(const Tensor* held, HeldTable(layer));
  return backend->UnpackRoutedPairs(pair_blocks_.Rows(0, 3 * total_pairs), segments_, *held,
                                    &pairs->rows, &pairs->experts, &pairs->weights, &bad_);
}

absl::Status ExpertStepServer::CheckPairs(const std::vector<WireHeader>& headers,
                                          int64_t total_pairs) {
  if (total_pairs == 0) return absl::OkStatus();
  // The check's answer (8 bytes), after the round's compute has synchronised: bad pairs
  // were computed as harmless ones, and nothing has left yet.
  Backend* backend = shard_->backend();
  int32_t bad[2] = {0, 0};
  DXS_RETURN_IF_ERROR(backend->CopyToHost(bad_, DType::kI32, bad));
  if (bad[0] == 0) return absl::OkStatus();
  // A bad pair: name the first, as it arrived (the blocks come to the host only here).
  std::vector<int32_t> blocks(static_cast<size_t>(3 * total_pairs));
  DXS_RETURN_IF_ERROR(
      backend->CopyToHost(pair_blocks_.Rows(0, 3 * total_pairs), DType::kI32, blocks.data()));
  size_t i = 0;
  while (i + 1 < headers.size() && bad[1] >= pair_offset_[i] + headers[i].num_pairs) ++i;
  const int64_t first = pair_offset_[i], n = headers[i].num_pairs, k = bad[1] - first;
  const int32_t row = blocks[3 * first + k], expert = blocks[3 * first + n + k];
  return absl::InternalError(absl::StrCat("DP peer ", round_peers_[i], " routed row ", row,
                                          " to expert ", expert,
                                          ", which this rank does not hold"));
}

absl::Status ExpertStepServer::Fill(size_t i, absl::Time deadline) {
  DXS_ASSIGN_OR_RETURN(TransportMessage m, transport_->Recv(dp_peers_[i], deadline));
  absl::StatusOr<WireHeader> h = WireHeader::Decode(m.header);
  if (h.ok() && h->kind == MessageKind::kStepAbandoned && m.payload_size() == 0) {
    TraceStep("expert: DP peer ", dp_peers_[i], " abandoned step ", h->step);
    if (!abandoned_[i] || *abandoned_[i] < h->step) abandoned_[i] = h->step;
    return absl::OkStatus();  // nothing pending: the caller gathers on
  }
  // A mapped dispatch and a low-latency step that connects carry a region's key (UCX's:
  // about 100 bytes, CUDA IPC's 64); others nothing.
  constexpr size_t kMaxRegionKey = 4096;
  const bool known = h.ok() && (h->kind == MessageKind::kDispatch ||
                                (h->kind == MessageKind::kLowLatencyStep && h->layer == -1));
  const bool keyed =
      known &&
      (h->kind == MessageKind::kDispatch ? h->mapped() : (h->flags & WireHeader::kConnect) != 0);
  const bool payload_ok =
      keyed ? m.payload_size() > 0 && m.payload_size() <= kMaxRegionKey : m.payload_size() == 0;
  if (!known || !payload_ok) {
    return absl::InternalError(absl::StrCat("DP peer ", dp_peers_[i], " sent a bad message: ",
                                            !h.ok()  ? h.status().message()
                                            : !known ? "not a dispatch header"
                                                     : "a bad payload"));
  }
  pending_[i] = *h;
  pending_keys_[i].assign(m.payload.begin(), m.payload.end());
  return absl::OkStatus();
}

absl::Status ExpertStepServer::Gather(absl::Time deadline) {
  const size_t num_dp = dp_peers_.size();
  const auto live = [&](size_t i) {
    return live_dp_.empty() || (i < live_dp_.size() && live_dp_[i]);
  };
  const auto dead = [&](size_t i) { return i < dead_dp_.size() && dead_dp_[i]; };
  while (true) {
    // Headers already here, from every DP rank this rank's view does not have dead (a dead
    // one's wait for it to come back: they are older rounds then, and dropped).
    for (size_t i = 0; i < num_dp; ++i) {
      if (!pending_[i] && !dead(i) && transport_->HasMessage(dp_peers_[i])) {
        DXS_RETURN_IF_ERROR(Fill(i, deadline));
      }
    }
    std::optional<WireHeader::Key> newest;
    for (size_t i = 0; i < num_dp; ++i) {
      if (pending_[i] && (!newest || pending_[i]->key() > *newest)) newest = pending_[i]->key();
    }
    if (!newest) {
      // Nothing yet: wait on the first live DP rank (every step has it, unless the DP ranks
      // just left it out, and then the wait ends at the deadline and the next call takes
      // the headers that came meanwhile).
      std::optional<size_t> first;
      for (size_t i = 0; i < num_dp && !first; ++i) {
        if (live(i)) first = i;
      }
      if (!first) {
        (void)transport_->WaitForActivity(deadline);
        return absl::DeadlineExceededError("no live DP rank");
      }
      DXS_RETURN_IF_ERROR(Fill(*first, deadline));
      continue;
    }
    // The round's DP ranks: those its headers name (WireHeader::dp_mask) that this rank's
    // view does not have DEAD (one absent from it, as after the router restarted, takes
    // part: the DP ranks agreed on the step with it). A step read from a newer view than
    // this rank's waits for it (a DP rank back from the dead takes part again once this rank
    // knows it is live).
    uint64_t mask = 0, view = 0;
    bool all = false, low_latency = false;
    for (size_t i = 0; i < num_dp; ++i) {
      if (!pending_[i]) continue;
      if (pending_[i]->key() < *newest) {
        if (StepTraceOn()) {
          TraceStep("expert: DP peer ", dp_peers_[i], "'s header ", KeyText(*pending_[i]),
                    " dropped: older than the newest (step ", std::get<0>(*newest), ", layer ",
                    std::get<1>(*newest), ")");
        }
        pending_[i].reset();  // stale: from a step that failed elsewhere
        continue;
      }
      if (pending_[i]->kind == MessageKind::kLowLatencyStep) low_latency = true;
      if (pending_[i]->dp_mask == 0) all = true;
      mask |= pending_[i]->dp_mask;
      view = std::max(view, pending_[i]->dp_view);
    }
    if (view > dp_view_) {
      // Pending headers are kept; the caller applies the next view and calls again.
      (void)transport_->WaitForActivity(std::min(deadline, absl::Now() + absl::Milliseconds(10)));
      return absl::DeadlineExceededError(
          absl::StrCat("a step of view ", view, ", this rank at ", dp_view_));
    }
    round_peers_.clear();
    round_keys_.clear();
    headers_.clear();
    std::optional<size_t> missing;
    for (size_t i = 0; i < num_dp; ++i) {
      // A low-latency step's exchange is made for all its DP ranks: it is not served short.
      const bool abandoned =
          !low_latency && abandoned_[i] && *abandoned_[i] >= std::get<0>(*newest);
      const bool takes_part = !dead(i) && !abandoned && (all || (i < 64 && ((mask >> i) & 1) != 0));
      if (!takes_part) {
        if (StepTraceOn() && pending_[i]) {
          TraceStep("expert: DP peer ", dp_peers_[i], "'s header ", KeyText(*pending_[i]),
                    " dropped: ",
                    dead(i)     ? "DEAD in view "
                    : abandoned ? "its step abandoned; view "
                                : "not of the step in view ",
                    dp_view_);
        }
        pending_[i].reset();  // a dead rank's, or not of this step
        continue;
      }
      if (!pending_[i]) {
        if (!missing) missing = i;
        continue;
      }
      round_peers_.push_back(dp_peers_[i]);
      round_keys_.push_back(pending_keys_[i]);
      headers_.push_back(*pending_[i]);
    }
    if (!missing) {
      if (headers_.empty()) continue;  // every header was a dead rank's
      if (StepTraceOn()) {
        std::string peers;
        for (int p : round_peers_) absl::StrAppend(&peers, peers.empty() ? "" : ",", p);
        TraceStep("expert: round ", KeyText(headers_[0]), " of DP peers ", peers,
                  " gathered (DP ranks 0x", absl::Hex(mask), ", view ", view, "; this rank at ",
                  dp_view_, ")");
      }
      for (auto& p : pending_) p.reset();
      return absl::OkStatus();
    }
    DXS_RETURN_IF_ERROR(Fill(*missing, deadline));
  }
}

absl::Status ExpertStepServer::MapRegions(std::vector<WireHeader>* headers,
                                          std::vector<int32_t>* statuses) {
  const size_t num_dp = headers->size();
  regions_.assign(num_dp, nullptr);
  statuses->assign(num_dp, 0);
  Backend* backend = shard_->backend();
  for (size_t i = 0; i < num_dp; ++i) {
    WireHeader& h = (*headers)[i];
    if (!h.mapped()) continue;
    std::shared_ptr<Buffer> region;
    if (h.device_region()) {
      const std::pair<int, std::string> key(round_peers_[i], round_keys_[i]);
      for (const auto& [known, buffer] : opened_) {
        if (known == key) region = buffer;
      }
      if (region == nullptr) {
        absl::StatusOr<std::shared_ptr<Buffer>> opened = backend->OpenShared(round_keys_[i]);
        if (opened.ok()) {
          constexpr size_t kMaxOpened = 8;
          if (opened_.size() >= kMaxOpened) opened_.erase(opened_.begin());
          opened_.emplace_back(key, *opened);
          region = *opened;
        }
      }
    } else {
      absl::StatusOr<PeerRegion> mapped =
          transport_->AttachPeerRegion(round_peers_[i], round_keys_[i]);
      if (mapped.ok()) {
        region = std::make_shared<Buffer>(Device::kCpu, mapped->data, mapped->bytes, nullptr);
      }
    }
    if (region == nullptr) {
      // Nothing of this rank is computed; its status says why (its step fails once).
      (*statuses)[i] = kRegionUnmappable;
      h.num_rows = h.num_pairs = 0;
      continue;
    }
    const size_t row_bytes = static_cast<size_t>(h.hidden) * DTypeSize(h.wire_dtype);
    const size_t bytes = region->num_bytes();
    const auto fits = [&](int64_t at, size_t n, size_t alignment) {
      return at % static_cast<int64_t>(alignment) == 0 && static_cast<uint64_t>(at) <= bytes &&
             n <= bytes - at;
    };
    const size_t rows_bytes = static_cast<size_t>(h.num_rows) * row_bytes;
    if (!fits(h.rows_at, rows_bytes, DTypeSize(h.wire_dtype)) ||
        !fits(h.answers_at, rows_bytes, DTypeSize(h.wire_dtype)) ||
        !fits(h.pairs_at, 12 * static_cast<size_t>(h.num_pairs), sizeof(int32_t))) {
      return absl::InternalError(absl::StrCat("DP peer ", round_peers_[i],
                                              ": mapped dispatch outside its ", bytes,
                                              "-byte region (rows at ", h.rows_at, ", answers at ",
                                              h.answers_at, ", pairs at ", h.pairs_at, ")"));
    }
    regions_[i] = std::move(region);
  }
  return absl::OkStatus();
}

absl::Status ExpertStepServer::ServeRound(absl::Time deadline) {
  DXS_RETURN_IF_ERROR(Gather(deadline));
  std::vector<WireHeader>& headers = headers_;
  const size_t num_dp = headers.size();
  if (headers[0].kind == MessageKind::kLowLatencyStep) return ServeLowLatencyStep(headers);
  const int k = next_out_;
  std::vector<int32_t>& statuses = statuses_[k];
  DXS_RETURN_IF_ERROR(MapRegions(&headers, &statuses));
  const WireHeader& first = headers[0];
  const int64_t hidden = config_.hidden_size;
  const DType dtype = first.wire_dtype;
  // FP8 dispatch rows: records arrive (or are read from a mapped region) and are dequantized
  // into x in the wire dtype, which the answers go back in.
  const bool fp8 = first.fp8_rows();
  int64_t total_rows = 0, total_pairs = 0;
  row_offset_.assign(num_dp, 0);
  pair_offset_.assign(num_dp, 0);
  for (size_t i = 0; i < num_dp; ++i) {
    const WireHeader& h = headers[i];
    if (h.hidden != hidden || h.wire_dtype != dtype || h.num_rows < 0 || h.num_pairs < 0 ||
        (h.num_pairs > 0 && h.num_rows == 0) || h.fp8_rows() != fp8) {
      return absl::InternalError(absl::StrCat("DP peer ", round_peers_[i],
                                              ": malformed dispatch (hidden ", h.hidden, ", ",
                                              h.num_rows, " rows, ", h.num_pairs, " pairs)"));
    }
    row_offset_[i] = total_rows;
    pair_offset_[i] = total_pairs;
    total_rows += h.num_rows;
    total_pairs += h.num_pairs;
  }
  if (dtype != DType::kF32 && !shard_->backend()->capabilities().narrow_expert_rows) {
    return absl::FailedPreconditionError(absl::StrCat("the ", shard_->backend()->name(),
                                                      " backend's experts take float32 rows only"));
  }
  Backend* backend = shard_->backend();
  if (fp8 && !backend->capabilities().fp8_dispatch_rows) {
    return absl::FailedPreconditionError(absl::StrCat(
        "the ", backend->name(), " backend has no FP8 dispatch rows (--wire-dtype fp8)"));
  }
  // A view of DP rank i's region from byte `at`, as a tensor of `type`.
  const auto view = [&](size_t i, int64_t at, DType type, std::vector<int64_t> shape) {
    return Tensor(regions_[i], type, std::move(shape), static_cast<size_t>(at) / DTypeSize(type));
  };
  // One DP rank whose region lies where the backend keeps tensors: computed in place (not
  // from FP8 records, which are dequantized into x first).
  const bool in_region =
      num_dp == 1 && regions_[0] != nullptr && regions_[0]->device() == backend->device() && !fp8;
  Tensor x, out;
  if (in_region) {
    x = view(0, headers[0].rows_at, dtype, {total_rows, hidden});
    out = view(0, headers[0].answers_at, dtype, {total_rows, hidden});
  } else {
    DXS_RETURN_IF_ERROR(EnsureRows(total_rows, dtype));
    x = x_.Rows(0, total_rows);
    out = out_[k].Rows(0, total_rows);
  }
  // Receive: rows into x, each DP rank's pairs as one block (rows | experts | weights) into
  // the pair buffer, each DP rank at its offsets; both where the backend keeps tensors
  // (device memory on a GPU: nothing crosses the host).
  const MemoryType memory = TransportMemoryOf(*backend);
  const size_t row_bytes = static_cast<size_t>(hidden) * DTypeSize(dtype);
  const size_t recv_row_bytes = fp8 ? static_cast<size_t>(Fp8RecordBytes(hidden)) : row_bytes;
  DXS_RETURN_IF_ERROR(EnsurePairs(total_pairs));
  if (fp8 && (!records_.defined() || records_.rows() < total_rows)) {
    DXS_ASSIGN_OR_RETURN(
        records_, backend->Allocate({std::max<int64_t>(x_.rows(), 1), Fp8RecordBytes(hidden)},
                                    DType::kF8E4M3));
  }
  uint8_t* x_bytes = in_region ? nullptr
                     : fp8     ? static_cast<uint8_t*>(backend->TransportAddress(records_))
                               : static_cast<uint8_t*>(backend->TransportAddress(x_));
  uint8_t* pair_bytes = static_cast<uint8_t*>(backend->TransportAddress(pair_blocks_));
  transfers_.clear();
  records_to_dequantize_.clear();
  size_t mapped_received = 0, mapped_sent = 0;
  for (size_t i = 0; i < num_dp; ++i) {
    const int peer = round_peers_[i];
    const WireHeader& h = headers[i];
    const size_t rows_bytes = static_cast<size_t>(h.num_rows) * row_bytes;
    if (h.mapped()) {
      // Rows and pairs in place: the pairs (and, unless the experts read the region
      // itself, the rows) copied once into the round's tensors.
      if (regions_[i] == nullptr) continue;
      if (fp8 && h.num_rows > 0) {
        const Tensor in_place =
            view(i, h.rows_at, DType::kF8E4M3, {h.num_rows, Fp8RecordBytes(hidden)});
        if (regions_[i]->device() == backend->device()) {
          // Dequantized from the region itself into this rank's rows of x.
          Tensor rows = x.Rows(row_offset_[i], h.num_rows);
          DXS_RETURN_IF_ERROR(backend->DequantizeRowsFp8(in_place, &rows));
        } else {
          // Beside the records of the ranks that sent theirs, dequantized with them below.
          Tensor records = records_.Rows(row_offset_[i], h.num_rows);
          DXS_RETURN_IF_ERROR(CopyIn(backend, in_place, &records));
          records_to_dequantize_.push_back({row_offset_[i], h.num_rows});
        }
      } else if (!in_region && h.num_rows > 0) {
        Tensor rows = x_.Rows(row_offset_[i], h.num_rows);
        DXS_RETURN_IF_ERROR(
            CopyIn(backend, view(i, h.rows_at, dtype, {h.num_rows, hidden}), &rows));
      }
      if (h.num_pairs > 0) {
        Tensor block = pair_blocks_.Rows(3 * pair_offset_[i], 3 * h.num_pairs);
        DXS_RETURN_IF_ERROR(
            CopyIn(backend, view(i, h.pairs_at, DType::kI32, {3 * h.num_pairs}), &block));
      }
      mapped_received +=
          static_cast<size_t>(h.num_rows) * recv_row_bytes + 12 * static_cast<size_t>(h.num_pairs);
      mapped_sent += rows_bytes;
      counters_.rows_mapped += h.num_rows;
      continue;
    }
    transfers_.push_back({Transfer::Kind::kRecv, peer, x_bytes + row_offset_[i] * recv_row_bytes,
                          static_cast<size_t>(h.num_rows) * recv_row_bytes, memory});
    if (fp8 && h.num_rows > 0) records_to_dequantize_.push_back({row_offset_[i], h.num_rows});
    transfers_.push_back({Transfer::Kind::kRecv, peer,
                          pair_bytes + 3 * pair_offset_[i] * sizeof(int32_t),
                          static_cast<size_t>(h.num_pairs) * 12, memory});
  }
  const uint64_t tag = ExchangeTag(first.key());
  if (metrics_ != nullptr) {
    metrics_->OnExchange(transfers_.data(), transfers_.size());
    metrics_->OnMappedBytes(mapped_sent, mapped_received);
  }
  DXS_ASSIGN_OR_RETURN(ExchangeId received,
                       transport_->PostExchange(tag, transfers_.data(), transfers_.size()));
  // The DP ranks post their rows with their headers; one whose rows have not come within the
  // step timeout has failed the step itself.
  DXS_RETURN_IF_ERROR(transport_->WaitExchange(received, deadline + kDefaultStepTimeout));
  ++counters_.rounds_in_place;
  // The records in records_, in runs of consecutive ranks' rows: one op where every rank's
  // came by the transport.
  for (size_t r = 0; r < records_to_dequantize_.size();) {
    const int64_t begin = records_to_dequantize_[r].first;
    int64_t end = begin + records_to_dequantize_[r].second;
    for (++r; r < records_to_dequantize_.size() && records_to_dequantize_[r].first == end; ++r) {
      end += records_to_dequantize_[r].second;
    }
    Tensor rows = x.Rows(begin, end - begin);
    DXS_RETURN_IF_ERROR(backend->DequantizeRowsFp8(records_.Rows(begin, end - begin), &rows));
  }
  RoutedPairTensors pairs;
  DXS_RETURN_IF_ERROR(UnpackPairs(first.layer, headers, total_pairs, &pairs));
  // The output buffer's last sends (two rounds ago) are done before it is overwritten.
  WaitCombineSends(k);
  const auto compute_start = std::chrono::steady_clock::now();
  absl::Status compute = shard_->Forward(first.layer, x, pairs, &out);
  const auto compute_time = std::chrono::steady_clock::now() - compute_start;
  const double compute_seconds = std::chrono::duration<double>(compute_time).count();
  counters_.compute_ns +=
      std::chrono::duration_cast<std::chrono::nanoseconds>(compute_time).count();
  DXS_RETURN_IF_ERROR(compute);
  // Answers of mapped ranks into their regions (unless computed there).
  for (size_t i = 0; i < num_dp && !in_region; ++i) {
    if (regions_[i] == nullptr || headers[i].num_rows == 0) continue;
    Tensor answers = view(i, headers[i].answers_at, dtype, {headers[i].num_rows, hidden});
    DXS_RETURN_IF_ERROR(CopyOut(backend, out.Rows(row_offset_[i], headers[i].num_rows), &answers));
  }
  // The experts' output must be written before the transport reads it (or the DP ranks,
  // once their statuses arrive).
  if (!out_written_) {
    DXS_ASSIGN_OR_RETURN(out_written_, backend->CreateEvent());
  }
  DXS_RETURN_IF_ERROR(backend->RecordEvent(out_written_.get()));
  DXS_RETURN_IF_ERROR(backend->SynchronizeEvent(out_written_.get()));
  // Pairs that failed the check were computed as harmless ones; the round fails here,
  // before it is counted and before its combine leaves.
  DXS_RETURN_IF_ERROR(CheckPairs(headers, total_pairs));
  if (metrics_ != nullptr) metrics_->OnRound(total_rows, compute_seconds);

  ++counters_.rounds;
  counters_.rows_received += total_rows;
  rows_this_step_ += total_rows;
  if (total_rows == 0) ++counters_.empty_rounds;
  if (first.layer == last_moe_layer_ && first.micro + 1 == first.num_micro) {
    ++counters_.steps;
    if (rows_this_step_ == 0) ++counters_.empty_steps;
    if (metrics_ != nullptr) {
      metrics_->OnStep(rows_this_step_ == 0);
      metrics_->SyncExpertTokens(shard_->TokensPerExpert());
    }
    rows_this_step_ = 0;
  }
  // Combine: each DP rank gets its rows back, pre-summed over this rank's experts,
  // straight from out. Completed before out_[k] is written again.
  const uint8_t* out_bytes =
      in_region ? nullptr : static_cast<const uint8_t*>(backend->TransportAddress(out_[k]));
  transfers_.clear();
  for (size_t i = 0; i < num_dp; ++i) {
    if (headers[i].mapped()) {
      transfers_.push_back({Transfer::Kind::kSend, round_peers_[i], &statuses[i], sizeof(int32_t),
                            MemoryType::kHost});
      continue;
    }
    transfers_.push_back({Transfer::Kind::kSend, round_peers_[i],
                          const_cast<uint8_t*>(out_bytes) + row_offset_[i] * row_bytes,
                          static_cast<size_t>(headers[i].num_rows) * row_bytes, memory});
  }
  if (metrics_ != nullptr) metrics_->OnExchange(transfers_.data(), transfers_.size());
  DXS_ASSIGN_OR_RETURN(ExchangeId sent,
                       transport_->PostExchange(tag, transfers_.data(), transfers_.size()));
  // The DP ranks posted their receives with their dispatch, so the sends complete at once
  // unless a rank abandoned the step; waiting here also keeps the transport progressing
  // them when no next round follows soon.
  absl::Status delivered = transport_->WaitExchange(sent, absl::Now() + kCombineSendWait);
  if (!delivered.ok()) {
    // A send UCX cannot withdraw may still read out_[k]: the next round computes into the
    // other buffer, and the one after waits (briefly) before reusing this one.
    combine_group_[k] = sent;
    next_out_ ^= 1;  // rounds compute into the other buffer until this one is released
    return absl::UnavailableError(absl::StrCat("combine of step ", first.step, " layer ",
                                               first.layer, ": ", delivered.message()));
  }
  return absl::OkStatus();
}

absl::Status ExpertStepServer::ServeLowLatencyStep(const std::vector<WireHeader>& headers) {
  // Aligned keys are (step, -1, 0) for every DP rank: all of them sent a low-latency step.
  if (ll_ == nullptr) {
    return absl::FailedPreconditionError(
        absl::StrCat("step ", headers[0].step, ": a low-latency step, and this rank serves none"));
  }
  const auto sum = [](const std::vector<int64_t>& v) {
    return std::accumulate(v.begin(), v.end(), int64_t{0});
  };
  // The experts' pairs are counted on the device; what the step added says whether this
  // rank received any row (an empty-batch step).
  const int64_t pairs_before = sum(shard_->TokensPerExpert());
  DXS_RETURN_IF_ERROR(ll_->Serve(round_peers_, headers, round_keys_));
  const std::vector<int64_t> cumulative = shard_->TokensPerExpert();
  const bool empty = sum(cumulative) == pairs_before;
  const int rounds = ll_->num_rounds();
  counters_.rounds += rounds;
  ++counters_.steps;
  ++counters_.low_latency_steps;
  if (empty) {
    ++counters_.empty_steps;
    counters_.empty_rounds += rounds;
  }
  if (metrics_ != nullptr) {
    metrics_->OnLowLatencyStep(rounds, empty);
    metrics_->OnStep(empty);
    metrics_->SyncExpertTokens(cumulative);
  }
  return absl::OkStatus();
}

}  // namespace dxs
