// ExpertStepServer: the expert worker's data path.
//
// One round = one MoE layer of one step (or of one micro-batch of a step, with two-batch
// overlap): a dispatch header from every DP rank of the step (empty ones included; a DP
// rank the router has DEAD is left out, WireHeader::dp_mask) carrying the same
// (step, layer, micro) on the control channel. Headers older than the newest key seen are
// stale (a step that failed elsewhere) and are dropped. A DP rank that abandoned a step
// (kStepAbandoned: it failed the step, in the step exchange or after it) is left out of the step's
// remaining rounds, so the others finish it (not of a low-latency step, whose exchange is
// made for all of them). With every rank's counts known, the server posts one
// data-exchange group that receives each rank's rows straight into its region of the input tensor
// (in the wire's dtype, through Backend::TransportAddress) and its routing pairs into its region of
// a pair tensor, both where the backend keeps tensors (GPU memory on a GPU: no byte of the round
// crosses the host); checks and unpacks the pairs on the backend (Backend::UnpackRoutedPairs: rows
// in range, experts held; only the 8-byte answer comes to the host); runs this rank's experts over
// all rows (SwiGLU, grouped by expert), pre-summing each row's weighted outputs over its own
// experts; and posts the combine: each rank's rows of the output tensor back to it, in dispatch
// order, under the same tag. Nothing is copied through a transport buffer.
//
// A round returns once its combine is delivered (the DP ranks posted their receives with
// their dispatch, so that is at once). Sends to a rank that abandoned the step are never
// matched: the wait gives up after the attention side's default step timeout
// (kDefaultStepTimeout) and the round fails with UNAVAILABLE. Such a send may still hold the
// output buffer, so later rounds compute into a second one, and a buffer with a send still
// pending is waited for before it is written again. Normally one output buffer serves every round:
// a second one alternating with it doubled the working set and cost ~200 us a round trip at 8 MiB
// (dispatch_bench).
//
// A DP rank that dispatches through a mapped region (the one-copy exchange,
// dataplane/dispatch/dispatch_combine.h) sends its header after its rows, with the region's
// key: the server maps the region (DataExchange::AttachPeerRegion; a GPU region with
// Backend::OpenShared), reads the rows and
// pairs there and stores its answers there, and answers with a 4-byte status in the group
// instead of rows. With one DP rank and a region where the backend keeps tensors (host
// memory on the CPU, GPU memory on a GPU) the experts read their input and write their
// output in that region itself; otherwise the rows are copied into and out of
// the round's tensors once. A region that does not map is answered kRegionUnmappable and
// that rank's rows are not computed (its step fails once, then it dispatches by copy).
// Offsets outside the region fail the round like any malformed dispatch.
//
// A step the DP ranks run over the low-latency exchange arrives instead as one
// kLowLatencyStep message from every DP rank, gathered like dispatch headers (it orders
// before its step's first dispatch) and served by LowLatencyExpertSteps (set_low_latency).
//
// Thread safety: ServeRound is called by one thread; counters may be read from any.
#pragma once

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "common/model_config.h"
#include "dataplane/dispatch/wire.h"
#include "dataplane/transport/transport.h"
#include "expert_service/expert_compute.h"
#include "expert_service/expert_metrics.h"
#include "expert_service/low_latency_expert_steps.h"
#include "kernels/backend.h"
#include "kernels/tensor.h"

namespace dxs {

struct ExpertCounters {
  std::atomic<int64_t> rounds{0};         // layer rounds served
  std::atomic<int64_t> empty_rounds{0};   // rounds in which this rank received no rows
  std::atomic<int64_t> steps{0};          // steps completed (last MoE layer served)
  std::atomic<int64_t> empty_steps{0};    // steps in which this rank received no rows at all
  std::atomic<int64_t> rows_received{0};  // token rows received, all layers
  // Time spent in ExpertCompute::Forward, all rounds: the part of a round trip that is
  // neither dispatch nor combine.
  std::atomic<int64_t> compute_ns{0};
  // Rounds whose rows all arrived in place (every round since the data exchange: rows land
  // in the input tensor itself).
  std::atomic<int64_t> rounds_in_place{0};
  // Rows read in place from a DP rank's mapped region (the one-copy exchange), all rounds.
  std::atomic<int64_t> rows_mapped{0};
  // Steps served over the low-latency exchange (counted in steps too; their rounds in
  // rounds; their rows are not counted: they stay on the device).
  std::atomic<int64_t> low_latency_steps{0};
};

class ExpertStepServer final {
 public:
  ExpertStepServer(Transport* transport, std::vector<int> dp_peers, ExpertCompute* shard,
                   const ModelConfig& config);
  ~ExpertStepServer();

  void set_dp_peers(std::vector<int> peers);
  // The router's view (version `view`) of the DP ranks, one entry per DP peer: `live`
  // (registered and not DEAD) and `dead` (DEAD). A round waits for the headers of the DP
  // ranks its step names (WireHeader::dp_mask) that are not dead here, so a dead DP rank
  // holds up no round. A rank absent from the view is not left out: after the router
  // restarted, the DP ranks may still run a step planned under the old router's view with
  // it, and its header comes. Empty vectors (the default): all live. Step thread, between
  // rounds.
  void set_dp_view(std::vector<bool> live, std::vector<bool> dead, uint64_t view) {
    live_dp_ = std::move(live);
    dead_dp_ = std::move(dead);
    dp_view_ = view;
  }
  const ExpertCounters& counters() const { return counters_; }
  // Where each round and step is reported for Prometheus; not owned, null (the default)
  // for none. Set before the first ServeRound.
  void set_metrics(ExpertMetrics* metrics) { metrics_ = metrics; }
  // Where low-latency steps are served; not owned. Null (the default): such a step fails
  // with FAILED_PRECONDITION unanswered (the DP ranks' waits time out).
  void set_low_latency(LowLatencyExpertSteps* ll) { ll_ = ll; }

  // Serves one round. DEADLINE_EXCEEDED if its headers are incomplete by `deadline` (what
  // arrived is kept for the next call); UNAVAILABLE if a DP peer failed (its pending
  // header dropped).
  absl::Status ServeRound(absl::Time deadline);

 private:
  // Maps the round's mapped regions into regions_ and checks the headers' offsets in them;
  // a region that does not map gets kRegionUnmappable in statuses and its counts zeroed.
  absl::Status MapRegions(std::vector<WireHeader>* headers, std::vector<int32_t>* statuses);
  // Serves a step whose aligned headers are kLowLatencyStep messages.
  absl::Status ServeLowLatencyStep(const std::vector<WireHeader>& headers);
  // Gathers the round's headers into headers_ (round_peers_, round_keys_ beside them): one
  // from each DP rank of the newest (step, layer, micro) seen that takes part in its step.
  absl::Status Gather(absl::Time deadline);
  // Receives DP rank i's next dispatch header into pending_[i].
  absl::Status Fill(size_t i, absl::Time deadline);
  // Waits for the combine sends that last read out_[k].
  void WaitCombineSends(int k);
  absl::Status EnsureRows(int64_t rows, DType dtype);
  // Grows the pair buffers (the blocks as they arrive, the unpacked pairs) to `pairs`.
  absl::Status EnsurePairs(int64_t pairs);
  // The experts of `layer` this rank holds, as Backend::UnpackRoutedPairs's table.
  absl::StatusOr<const Tensor*> HeldTable(int layer);
  // The round's pair blocks, checked and unpacked on the backend into *pairs (queued: bad
  // pairs become harmless ones, counted in bad_).
  absl::Status UnpackPairs(int layer, const std::vector<WireHeader>& headers, int64_t total_pairs,
                           RoutedPairTensors* pairs);
  // After the round's compute has synchronised: INTERNAL naming the first bad pair (a row
  // outside its DP rank's rows, an expert not held), if the check found one.
  absl::Status CheckPairs(const std::vector<WireHeader>& headers, int64_t total_pairs);

  Transport* transport_;
  std::vector<int> dp_peers_;
  ExpertCompute* shard_;
  ModelConfig config_;
  int last_moe_layer_ = -1;
  ExpertCounters counters_;
  ExpertMetrics* metrics_ = nullptr;
  LowLatencyExpertSteps* ll_ = nullptr;
  int64_t rows_this_step_ = 0;
  std::vector<std::optional<WireHeader>> pending_;
  std::vector<std::string> pending_keys_;  // with a mapped header: its region's key
  std::vector<bool> live_dp_;
  std::vector<bool> dead_dp_;
  // Per DP rank, the newest step it abandoned (kStepAbandoned): it takes no part in that
  // step's rounds, nor in any older one's.
  std::vector<std::optional<uint64_t>> abandoned_;
  uint64_t dp_view_ = 0;
  // The round's DP ranks (transport peers) and their region keys, beside headers_.
  std::vector<int> round_peers_;
  std::vector<std::string> round_keys_;
  // Per round, the DP ranks' mapped regions (null: the rank sends by copy): host memory the
  // transport mapped (a Buffer that owns nothing), or GPU memory the backend opened.
  std::vector<std::shared_ptr<Buffer>> regions_;
  // GPU regions opened, by (DP peer, key), the last few (a DP rank replaces a region only
  // when it outgrows it).
  std::vector<std::pair<std::pair<int, std::string>, std::shared_ptr<Buffer>>> opened_;
  // The statuses answered to mapped DP ranks, per output buffer (a send not delivered may
  // still read them, like the buffer's rows).
  std::vector<int32_t> statuses_[2];
  // The round's input and output rows, [capacity, hidden] in the wire dtype, grown as
  // batches grow; the second output only after a combine was not delivered (with the
  // group that may still read the first).
  Tensor x_;
  Tensor out_[2];
  // FP8 dispatch rows as they arrive (kF8E4M3 records, WireHeader::kFp8Rows), before x_,
  // and the (first row, rows) of the ranks whose records are there: those that came by the
  // transport (the mapped ones are dequantized from their regions).
  Tensor records_;
  std::vector<std::pair<int64_t, int64_t>> records_to_dequantize_;
  std::optional<ExchangeId> combine_group_[2];
  int next_out_ = 0;
  // Per round, reused: headers, each DP rank's first row and pair, the group.
  std::vector<WireHeader> headers_;
  std::vector<int64_t> row_offset_, pair_offset_;
  std::vector<Transfer> transfers_;
  std::unique_ptr<Event> out_written_;  // recorded after the experts, before the combine
  // The pairs on the backend, [capacity] (blocks [3 * capacity]): as they arrive, one
  // block per DP rank, and unpacked; the check's answer.
  Tensor pair_blocks_, pair_rows_, pair_experts_, pair_weights_, bad_;
  std::vector<PairSegment> segments_;
  struct HeldTableOnBackend {
    std::vector<int32_t> host;  // what `tensor` holds
    Tensor tensor;              // i32 [E]
  };
  std::map<int, HeldTableOnBackend> held_;  // by layer
  std::vector<int32_t> held_host_;
};

}  // namespace dxs
