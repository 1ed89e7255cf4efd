// ExpertStepServer: the expert worker's data path.
//
// One round = one MoE layer of one step (or of one micro-batch of a step, with two-batch
// overlap): a dispatch message from every DP rank (empty ones included) carrying the same
// (step, layer, micro). The server runs this rank's experts over all received rows
// (SwiGLU, grouped by expert), pre-sums each row's weighted outputs over its own experts,
// and answers every DP rank with one combine message, in dispatch order. Messages older
// than the newest (step, layer, micro) seen are stale (a step that failed elsewhere) and
// are dropped.
//
// Zero copy: the server is its transport's ReceiveTargetProvider. A float32 dispatch lands
// straight in the input tensor: each DP rank has kSlotsPerRank slots (regions of one
// reused x buffer, rows only; the routing pairs go to a buffer of the slot), so a rank's
// next message (the other micro-batch, with two-batch overlap) can arrive while one is
// still in use. Forward reads x through the pairs' row indices and writes a dense `out`
// (RoutedPairs::out_rows), so the gaps between slots cost nothing; each DP rank's combine
// rows go out straight from `out`. Slots hold rows in the wire's dtype: on a bf16 wire x and out
// are bf16 host tensors and the experts (CPU backend) widen rows as they gather them and round
// their sums once, so the exchange itself converts nothing. A slot is handed out only
// while free (from acceptance until its round's Forward returned, or the message is
// dropped as stale); a message that does not fit (a bigger batch than seen before,
// another wire dtype, no free slot) arrives in a transport buffer and the round is
// assembled by copying into float32, as before. Slots grow or change dtype only when
// none is held: a message that did not fit makes the server decline new ones until then.
//
// Thread safety: ServeRound is called by one thread; counters may be read from any.
#pragma once

#include <atomic>
#include <cstdint>
#include <deque>
#include <map>
#include <optional>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "common/model_config.h"
#include "expert_service/expert_metrics.h"
#include "kernels/tensor.h"
#include "model/expert_shard.h"
#include "router/dispatch/wire.h"
#include "router/transport/transport.h"

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
  std::atomic<int64_t> rounds_in_place{0};  // rounds whose rows all arrived in their slots
};

class ExpertStepServer final : public ReceiveTargetProvider {
 public:
  // Slots per DP rank: one per micro-batch that may be in flight.
  static constexpr int kSlotsPerRank = 2;

  ExpertStepServer(Transport* transport, std::vector<int> dp_peers, ExpertCompute* shard,
                   const ModelConfig& config);
  ~ExpertStepServer() override;

  void set_dp_peers(std::vector<int> peers);
  const ExpertCounters& counters() const { return counters_; }
  // Where each round and step is reported for Prometheus; not owned, null (the default)
  // for none. Set before the first ServeRound.
  void set_metrics(ExpertMetrics* metrics) { metrics_ = metrics; }

  // Serves one round. DEADLINE_EXCEEDED if it is incomplete by `deadline` (what arrived is
  // kept for the next call); UNAVAILABLE if a DP peer failed (its pending message dropped).
  // Makes this server the transport's receive target provider first (servers sharing a
  // transport take turns).
  absl::Status ServeRound(absl::Time deadline);

  // ReceiveTargetProvider (called by the transport on the serving thread).
  bool TargetFor(int peer, std::string_view header, size_t payload_bytes,
                 std::vector<ReceiveSegment>* segments) override;
  void TargetDropped(int peer, std::string_view header) override;

 private:
  // A region of x_buffer_ for one DP rank's rows, and its routing pairs.
  struct Slot {
    int64_t base_row = 0;
    PayloadBytes pairs;
    bool busy = false;
  };

  absl::Status Fill(size_t i, absl::Time deadline);
  // Drops pending_[i], freeing its slot.
  void DropPending(size_t i);
  bool AnySlotHeld() const;
  // Re-lays the slots out for slot_rows_ rows each, if none is held.
  absl::Status MaybeRelayout();

  Transport* transport_;
  std::vector<int> dp_peers_;
  ExpertCompute* shard_;
  ModelConfig config_;
  int last_moe_layer_ = -1;
  ExpertCounters counters_;
  ExpertMetrics* metrics_ = nullptr;
  int64_t rows_this_step_ = 0;
  std::vector<std::optional<TransportMessage>> pending_;
  std::vector<int> pending_slot_;  // slot holding pending_[i]'s rows, or -1
  // Slots: kSlotsPerRank per DP rank, each slot_rows_ rows of x_buffer_ / out_buffer_.
  std::vector<Slot> slots_;
  int64_t slot_rows_ = 0;
  int64_t wanted_slot_rows_ = 0;    // > slot_rows_: grow when no slot is held
  DType slot_dtype_ = DType::kF32;  // the dtype rows land in: the last wire dtype seen
  DType wanted_slot_dtype_ = DType::kF32;
  bool relayout_ = false;  // decline new messages until the slots are re-laid out
  // Per DP peer: slots of accepted messages not yet received, in arrival order.
  std::map<int, std::deque<int>> arriving_;
  // [slots * slot_rows_, hidden] in slot_dtype_, reused across rounds.
  Tensor x_buffer_, out_buffer_;
  // Rounds assembled by copying: all rows concatenated.
  int64_t copy_rows_ = 0;
  Tensor copy_x_, copy_out_;
  PayloadBytes send_buffer_;  // narrowed combine rows (non-f32 wire)
  // Per round, reused: each DP rank's header and first row in x, the round's routing
  // pairs, and which of the round's layer's experts this rank holds.
  std::vector<WireHeader> headers_;
  std::vector<int64_t> row_offset_;
  std::vector<int64_t> out_offset_;  // each DP rank's first row in out
  RoutedPairs pairs_;
  std::vector<uint8_t> held_;
};

}  // namespace dxs
