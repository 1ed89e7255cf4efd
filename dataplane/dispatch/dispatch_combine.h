// The dispatch/combine engine, attention side, as a MoeExecutor.
//
// For each MoE layer of a step (DeepEP's three verbs): the layout (which EP rank needs
// which token, and the routed pairs each rank receives) is a backend op on the router's
// device-resident top-k; only the per-rank counts come to the host, because they size the
// transfers. Dispatch packs each token once per EP rank that owns any of its top-k experts
// (a backend gather into the wire dtype, or straight from x when a rank takes every token
// in order and x is in the wire dtype), sends every EP rank a dispatch header with its
// counts on the control channel (empty ones included), and posts one data-exchange group:
// to each rank its rows and (row, expert, weight) pairs, from each rank its combine rows,
// received straight into their region of the handle's receive tensor (or into `out`
// itself when one rank holds every token in order and no other rank has rows: the
// expert's pre-sum starts from +0, so 0 + a == a and the answer is bit for bit the sum).
// Combine waits for that group and sums with the backend's CombineRows: out[t] = sum over
// ranks, in ascending rank order, of the rank's pre-summed rows. That sum is the single
// reduction stage; nothing reduces the MoE output again.
//
// Only the EP ranks that hold experts in the step's placement take part in it (headers
// and transfers): a rank that died, drained or has just joined holds none, so no step
// waits for it. Every DP rank of a step uses the same placement version, agreed in the
// step exchange, so every EP rank of the step hears from every DP rank.
//
// A dispatch whose header to some EP rank fails still posts the group for the others
// (their rows arrive and their rounds complete) before it fails the step: the healthy
// ranks move on to the step's retry at once instead of waiting out a timeout.
//
// The one-copy exchange (mapped regions): where the backend keeps tensors in host memory
// and the transport maps memory between this rank and an EP rank (one host; UCX shared
// memory, inproc), or keeps them on a GPU and shares its blocks with other processes of the
// host (Backend::AllocateShared: CUDA IPC, over NVLink between two GPUs), the handle's buffers
// (packed rows, pairs, answers) live in a region of this rank's memory that those EP ranks map
// (DataExchange::MapRegion, one region per micro-batch slot, grown as batches grow). The pack
// writes the rows there once; the header, sent once they are written, carries the region's key and
// the offsets; the expert rank reads its rows and pairs in place and stores its answers in place,
// and the group carries only its 4-byte status back (wire.h). Rows cross memory once each way
// instead of three times (pack, into the transport's FIFO, out of it). A caller that builds its
// MoE input and takes its output where StageBuffers says (the region's first bytes, as the model
// does) has them cross no memory outside the experts' own reads and writes: an EP rank that
// takes every token reads x in place, nothing is packed for it, and the one rank that holds
// every token stores its answers into out itself. An EP rank that cannot map
// the region answers kRegionUnmappable: the step fails once with UNAVAILABLE and that
// rank's rounds go by copy from then on. A region replaced while an EP rank that gave up on
// a step may still store into it is kept mapped by that rank (transport.h): the stores land
// nowhere this rank reads.
//
// The DispatchHandle holds everything Combine needs (layout, counts, offsets, buffers, the
// group); Combine recomputes nothing. A failed step cancels its group before it returns,
// so nothing writes into the caller's memory afterwards. The transport reads and writes
// tensor memory at Backend::TransportAddress.
//
// Thread safety: used by one step thread.
#pragma once

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string_view>
#include <vector>

#include "absl/time/time.h"
#include "common/dtype.h"
#include "common/timeouts.h"
#include "dataplane/dispatch/placement.h"
#include "dataplane/dispatch/wire.h"
#include "dataplane/transport/transport.h"
#include "kernels/backend.h"
#include "kernels/moe_executor.h"

namespace dxs {

// How the data exchange is to treat a backend's tensor memory (both ends of the exchange).
inline MemoryType TransportMemoryOf(const Backend& backend) {
  return backend.capabilities().device_memory ? MemoryType::kDevice : MemoryType::kHost;
}

// Everything Combine needs about one dispatched micro-batch (DeepEP's handle): the layout
// on the backend, its per-rank counts and offsets on the host, and where the answers are
// once its exchange is done. How the rows went out (packed or not, through a region or the
// transport) is the dispatch's business (RemoteMoeExecutor::DispatchPlan), not the handle's.
struct DispatchHandle final : MoeHandle {
  // Abandons an exchange still in flight (a handle dropped without its combine).
  ~DispatchHandle() override;
  Transport* transport = nullptr;  // whose exchange `group` is
  const void* executor = nullptr;  // the executor that made it
  uint64_t step = 0;
  int64_t num_tokens = 0;
  DispatchLayoutTensors layout;
  std::vector<int64_t> num_tokens_per_rank, num_pairs_per_rank;
  std::vector<int64_t> token_offsets, pair_offsets;  // R + 1 each
  // What Combine does with the answers.
  enum class Answers : uint8_t {
    kSum,    // in recv_rows, each rank's at its token offset: summed into out (CombineRows)
    kCopy,   // in recv_rows, one rank's, every token in order: copied into out (rounded once)
    kInOut,  // in out already: the one rank with rows answered straight into it
  };
  Answers answers = Answers::kSum;
  // Per EP rank: it read its rows and answered in this rank's mapped region (the one-copy
  // exchange); its status lands in statuses[r].
  std::vector<bool> mapped;
  std::vector<int32_t> statuses;
  // For DispatchObserver::OnInPlace: EP ranks read x where the model staged it, and the
  // answers landed in the model's staged out (RemoteMoeExecutor::StageBuffers).
  bool read_staged_x = false;
  bool answered_staged_out = false;
  // Storage kept for the next dispatch: packed rows [sum tokens, send row] (the wire dtype,
  // or FP8 records), answers [sum tokens, hidden], and in a region the pairs' blocks [3 *
  // sum pairs] i32. region_views: they are views of a mapped region, never reused outside
  // one.
  Tensor send_rows, recv_rows, pairs;
  bool region_views = false;
  std::optional<ExchangeId> group;  // the posted exchange, until Combine waits for it
  // When the dispatch began (steady clock, ns), the group's size, and per EP rank the index
  // in the group of the receive of its answer (-1: not in the step): each EP rank's answer
  // time (DispatchObserver::OnEpAnswers).
  int64_t dispatch_start_ns = 0;
  size_t num_transfers = 0;
  std::vector<int> answer_index;
};

// Per-rank-pair traffic counters, cumulative; read from other threads.
struct DispatchCounters {
  explicit DispatchCounters(int num_ep_ranks)
      : tokens_dispatched(num_ep_ranks), tokens_combined(num_ep_ranks) {}
  std::vector<std::atomic<int64_t>> tokens_dispatched;  // per destination EP rank
  std::vector<std::atomic<int64_t>> tokens_combined;    // per source EP rank
  // Combine answers that arrived straight in place (all of them since the data exchange),
  // and those of them that landed in the output itself.
  std::atomic<int64_t> combines_in_target{0};
  std::atomic<int64_t> combines_into_out{0};
  // Combine answers an EP rank stored in place in this rank's mapped region (the one-copy
  // exchange), counted like combines_in_target.
  std::atomic<int64_t> combines_mapped{0};
  // Of those, dispatches whose rows an EP rank read straight from the caller's staged x
  // (nothing packed), and combines it stored straight into the staged out (nothing copied).
  std::atomic<int64_t> dispatches_from_staged_x{0};
  std::atomic<int64_t> combines_into_staged_out{0};
};

// Sees each MoE layer's exchange inside RemoteMoeExecutor::Run, for metrics. Called on the
// step thread; must be cheap and must not call back into the executor.
class DispatchObserver {
 public:
  virtual ~DispatchObserver() = default;
  // The dispatch phase ended: layout, packing and one send to every EP rank of the step
  // (sends that failed included). num_tokens_per_rank[r] tokens went to EP rank r;
  // in_step[r]: rank r took part (it holds experts of the step's placement and its header
  // was sent); the others were sent nothing.
  virtual void OnDispatch(const std::vector<int64_t>& num_tokens_per_rank,
                          const std::vector<bool>& in_step, double seconds) = 0;
  // The combine phase succeeded: every EP rank's rows received (this includes waiting
  // for the experts to compute) and summed into the output.
  virtual void OnCombine(const std::vector<int64_t>& num_tokens_per_rank, double seconds) = 0;
  // One layer's group (its sends and receives, zero sizes included) is about to be posted.
  virtual void OnExchange(const Transfer* transfers, size_t num_transfers) {}
  // Bytes EP ranks read from (sent) and stored into (received) this rank's mapped region
  // in one layer's exchange (the one-copy exchange; OnExchange counts only its statuses).
  virtual void OnMappedBytes(size_t sent, size_t received) {}
  // A micro-batch's combine succeeded with its input read in place by the EP ranks that
  // take every token (the caller's staged x: nothing packed for them) and its output stored
  // in place by the one EP rank that holds every token (the staged out: nothing copied).
  virtual void OnInPlace(bool input, bool output) {}
  // The combine succeeded: seconds[r] is EP rank r's answer time in it, from the start of
  // the dispatch to the arrival of the last of its combine rows as this rank's progress saw
  // it (where the transport records completions: WaitExchangeTimed); in_step[r] as in
  // OnDispatch (the others' entries are 0). The slowest of the ranks in the step is the
  // round's straggler.
  virtual void OnEpAnswers(const std::vector<double>& seconds, const std::vector<bool>& in_step) {}
};

struct DispatchOptions {
  // The combine's rows (the expert ranks' answers), and the dispatch's unless fp8_dispatch.
  DType wire_dtype = DType::kF32;
  absl::Duration timeout = kDefaultStepTimeout;  // a step fails with UNAVAILABLE after this
  // Combine waits expected to end within this are spun through (polling, yielding the
  // core each turn) rather than slept through: waking from the transport's event fd
  // costs ~25 us on a VM, a third of a 0.5 MB exchange. Longer expected waits sleep after
  // the transport's short spin, as idle ones do. 0: never spin longer than the transport.
  absl::Duration max_combine_spin = absl::Microseconds(500);
  // The one-copy exchange through mapped regions, with every EP rank that can map this
  // rank's memory (see above); false: every row goes through the transport's transfers.
  bool mapped_regions = true;
  // Dispatch rows leave as FP8 records (Backend::QuantizeRowsFp8: float8_e4m3fn with a scale
  // per token and 128 channels, DeepEP's and Step-3's format) and the answers come back in
  // wire_dtype: about half a bf16 dispatch's bytes. The records are packed, into the mapped
  // region where the EP rank reads them in place or into the transfers (x is never read in
  // place as bf16 rows can be).
  bool fp8_dispatch = false;
};

// The options of a cluster whose wire dtype (the router's --wire-dtype) is `wire`: float8_e4m3
// means FP8 dispatch rows and bf16 answers, as DeepEP and Step-3 send them; any other dtype
// goes both ways.
inline DispatchOptions DispatchOptionsForWire(DType wire, absl::Duration timeout) {
  DispatchOptions options;
  options.fp8_dispatch = wire == DType::kF8E4M3;
  options.wire_dtype = options.fp8_dispatch ? DType::kBF16 : wire;
  options.timeout = timeout;
  return options;
}

class RemoteMoeExecutor final : public MoeExecutor {
 public:
  // `ep_peers[r]` is EP rank r's transport peer id. Tensors are the backend's.
  RemoteMoeExecutor(Backend* backend, Transport* transport, std::vector<int> ep_peers,
                    Placement placement, int64_t hidden, DispatchOptions options);
  ~RemoteMoeExecutor() override;

  // The step id stamped on messages; the step loop sets it before each forward pass.
  void set_step(uint64_t step) { step_ = step; }
  // The step's DP ranks and the view they were read from, stamped on dispatch headers
  // (WireHeader::dp_mask, dp_view); the step loop sets them with the step.
  void set_dp_ranks(uint64_t mask, uint64_t view) {
    dp_mask_ = mask;
    dp_view_ = view;
  }
  // Adds `p` to the placements this executor can dispatch with and dispatches with it.
  void set_placement(Placement p) {
    const uint64_t version = p.version();
    AddPlacement(std::move(p));
    (void)UsePlacement(version);
  }
  // Adds `p` (a newer version from the ClusterView) without switching to it: the DP ranks
  // agree on the version of each step (AttentionStepLoop), so a rank keeps the last
  // kPlacementHistory versions it has seen.
  void AddPlacement(Placement p);
  // Dispatches with `version` from now on; false (and no change) if it is not kept.
  bool UsePlacement(uint64_t version);
  uint64_t newest_placement_version() const {
    return history_.empty() ? placement_.version() : history_.rbegin()->first;
  }
  const Placement& placement() const { return placement_; }
  static constexpr size_t kPlacementHistory = 8;
  // EP rank r's transport peer is peers[r]; grows when an EP rank joins (never shrinks:
  // a rank that left holds no experts and takes no part in steps).
  void set_ep_peers(std::vector<int> peers);
  int num_ep_ranks() const { return static_cast<int>(ep_peers_.size()); }
  const std::vector<int>& ep_peers() const { return ep_peers_; }
  const DispatchCounters& counters() const { return *counters_; }
  // EP ranks whose transport connection has failed (UNAVAILABLE), after a failed step.
  std::vector<int> FailedEpRanks() const;
  // Not owned; null (the default) observes nothing. Set before the first Run.
  void set_observer(DispatchObserver* observer) { observer_ = observer; }

  // Dispatch + Combine of one micro-batch covering the whole step.
  absl::Status Run(int layer, const Tensor& x, const Tensor& ids, const Tensor& weights,
                   Tensor* out) override;

  // Two-batch overlap: Dispatch sends and returns; the expert ranks compute while the
  // caller works on the other micro-batch; Combine receives and sums.
  bool overlaps() const override { return true; }
  absl::StatusOr<std::unique_ptr<MoeHandle>> Dispatch(int layer, int micro, int num_micro,
                                                      const Tensor& x, const Tensor& ids,
                                                      const Tensor& weights, Tensor* out) override;
  absl::Status Combine(std::unique_ptr<MoeHandle> handle, Tensor* out) override;
  // The staged x and out of micro-batch `micro`: the first part of its region, when an EP
  // rank of the placement can map this rank's memory and `dtype` is the wire's.
  bool StageBuffers(int micro, int64_t rows, DType dtype, Tensor* x, Tensor* out) override;

 private:
  // The layout and counts of a micro-batch into *h.
  absl::Status Layout(const Tensor& ids, const Tensor& weights, DispatchHandle* h);
  // Waits until the work queued so far (the pack) has written its rows.
  absl::Status RowsWritten();
  // How one dispatch moves its rows, decided by Dispatch (and PlaceInRegion) and read by
  // SendHeader.
  struct DispatchPlan {
    // One rank holds every token, in order, and no other rank has rows: its answers are the
    // output (rounded once if out is narrower).
    bool single_rank_in_order = false;
    // The one-copy exchange: the handle's send_rows, recv_rows and pairs are views of a
    // mapped region, which the ranks of h.mapped read and answer in.
    bool in_region = false;
    bool device_region = false;  // in_region: a GPU block the backend shares (CUDA IPC)
    // Per EP rank: its rows are x as it is (every token, in order, in the wire dtype), sent
    // or read without a pack. In a region only when x is the region's staged buffer
    // (StageBuffers), at byte x_at.
    std::vector<bool> takes_x;
    int64_t x_at = 0;
    // in_region: out is the staged buffer too, and the one rank of single_rank_in_order
    // answers straight into it (recv_rows is out).
    bool out_in_region = false;
  };
  // EP rank r's dispatch header on the control channel.
  absl::Status SendHeader(int r, int micro, int num_micro, const DispatchHandle& h,
                          const DispatchPlan& plan);
  // Which in-step EP ranks take this micro-batch's rows in place; when any does, points
  // the handle's buffers into micro-batch slot `micro`'s region (mapped, or grown, here),
  // after its staged x and out when the caller built x there (and answers into out there).
  absl::Status PlaceInRegion(int micro, const Tensor& x, const Tensor* out, int64_t total_rows,
                             int64_t total_pairs, DispatchPlan* plan, DispatchHandle* h);
  // Into *mapped (per EP rank): the ranks of the placement that can map this rank's
  // memory; false if none can (or regions are off, or the backend's memory cannot be).
  bool MappableRanks(std::vector<bool>* mapped) const;
  // Bytes at the start of a region that staged x and out of `rows` rows take (x, then out
  // at half of it).
  size_t StagedBytes(int64_t rows) const;
  // Micro-batch slot `micro`'s region holds at least `bytes`: kept, or replaced by a new
  // one (geometric growth, nothing staged in it). False if no region could be made.
  bool EnsureRegion(int micro, size_t bytes);
  // A new region of `bytes`: GPU memory the backend shares, or host memory the transport
  // maps.
  absl::StatusOr<SharedMemory> MapRegion(size_t bytes, bool device);

  Backend* backend_;
  Transport* transport_;
  std::vector<int> ep_peers_;
  Placement placement_;
  std::map<uint64_t, Placement> history_;  // by version, the newest kPlacementHistory
  Tensor expert_owner_;  // i32 on the backend: placement_'s rank table (Placement::RankTable)
  int64_t hidden_;
  DispatchOptions options_;
  // Elements (bytes for FP8 records) of a packed dispatch row, and its bytes.
  int64_t send_row_size_ = 0;
  size_t DispatchRowBytes() const {
    return static_cast<size_t>(send_row_size_) *
           (options_.fp8_dispatch ? 1 : DTypeSize(options_.wire_dtype));
  }
  uint64_t step_ = 0;
  uint64_t dp_mask_ = 0, dp_view_ = 0;
  // Combine's per-EP-rank answer times, reused.
  std::vector<int64_t> done_ns_;
  std::vector<double> answer_seconds_;
  std::vector<bool> answered_;
  std::unique_ptr<DispatchCounters> counters_;
  DispatchObserver* observer_ = nullptr;
  // Handles back from Combine, kept for their buffers (reused by later dispatches).
  std::vector<std::unique_ptr<DispatchHandle>> spare_handles_;
  std::vector<Transfer> transfers_;
  std::vector<bool> in_step_;            // per EP rank: sent this micro-batch's header
  std::vector<bool> mappable_;           // StageBuffers' MappableRanks, kept for its storage
  std::unique_ptr<Event> rows_written_;  // recorded after the pack, before the exchange
  // The one-copy exchange: a mapped region per micro-batch slot (its Buffer unmaps it when
  // the last view goes) and its key; EP ranks that could not map one (by rank, with the
  // transport peer they had then).
  struct Region {
    std::shared_ptr<Buffer> buffer;
    std::string key;
    // The first bytes hold the staged x and out of this many rows each (StageBuffers;
    // RemoteMoeExecutor::StagedBytes); dispatches place their buffers after them.
    int64_t staged_rows = 0;
  };
  Region regions_[kMaxMicroBatches];
  std::vector<std::shared_ptr<Buffer>> retired_regions_;  // GPU regions outgrown (see MapRegion)
  std::map<int, int> unmappable_;  // EP rank -> its peer when it answered kRegionUnmappable
  // Recent combine waits (Combine's start to its last answer), smoothed: how long the
  // next is expected to take. Zero until the first.
  absl::Duration expected_combine_wait_ = absl::ZeroDuration();
};

}  // namespace dxs
