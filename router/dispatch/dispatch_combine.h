// The dispatch/combine engine, attention side, as a MoeExecutor.
//
// For each MoE layer of a step: compute the layout (which EP rank needs which token),
// pack each token once per EP rank that owns any of its top-k experts together with its
// (expert, weight) pairs, send one message to every EP rank (empty ones included), then
// receive one combine message from every EP rank and sum them: out[t] = sum over ranks,
// in ascending rank order, of the rank's pre-summed rows. That sum is the single
// reduction stage; nothing reduces the MoE output again.
//
// Activations may be float32 or already in the wire dtype: x and out may be bf16 host
// tensors (AllocateHostTensor) on a bf16 wire, and the exchange then converts nothing;
// float32 ones are narrowed on the way out and widened in the sum.
//
// Zero copy: rows in the wire dtype are sent straight from x (consecutive rows as one
// segment, the routing pairs as three more), and the executor is its transport's
// ReceiveTargetProvider:
// before a micro-batch's dispatch goes out it names where each EP rank's combine lands, a
// reused buffer per (micro-batch, rank), or `out` itself when the rank's rows are all the
// tokens in order and it is the first rank summed (the expert's pre-sum starts from +0,
// so it never holds -0 and 0 + a == a bit for bit; a bf16 `out` only when that rank is
// the only one with rows). The sum then reads each row once:
// the first rank holding a token writes it, later ranks add, tokens no rank holds are
// zeroed; no separate zero-fill pass. A failed step waits until nothing is still being
// received into its targets (WaitTargetWrites) before it returns.
//
// Thread safety: used by one step thread.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <string_view>
#include <vector>

#include "absl/time/time.h"
#include "common/dtype.h"
#include "model/moe_executor.h"
#include "router/dispatch/placement.h"
#include "router/dispatch/wire.h"
#include "router/transport/transport.h"

namespace dxs {

// Which rows go to each EP rank, and the routed pairs each rank receives.
struct DispatchLayout {
  // token_rows[r]: tokens (rows of x) sent to rank r, ascending.
  std::vector<std::vector<int32_t>> token_rows;
  // pairs[r]: rows index into token_rows[r].
  std::vector<RoutedPairs> pairs;
  std::vector<int64_t> num_tokens_per_rank() const;
};

DispatchLayout ComputeLayout(const Placement& placement, const std::vector<int32_t>& ids,
                             const std::vector<float>& weights, int top_k);
// The same into *layout, reusing its vectors' storage (the executor's per-call layout).
void ComputeLayout(const Placement& placement, const std::vector<int32_t>& ids,
                   const std::vector<float>& weights, int top_k, DispatchLayout* layout);

// Row (de)serialisation in the wire dtype.
void PackRows(const float* rows, int64_t num_rows, int64_t hidden, DType dtype, PayloadBytes* out);
void UnpackRows(const uint8_t* data, int64_t num_rows, int64_t hidden, DType dtype, float* out);

// Per-rank-pair traffic counters, cumulative; read from other threads.
struct DispatchCounters {
  explicit DispatchCounters(int num_ep_ranks)
      : tokens_dispatched(num_ep_ranks), tokens_combined(num_ep_ranks) {}
  std::vector<std::atomic<int64_t>> tokens_dispatched;  // per destination EP rank
  std::vector<std::atomic<int64_t>> tokens_combined;    // per source EP rank
  // Combine messages that arrived straight in a target (a reused buffer or the output)
  // rather than a transport buffer, and those of them that landed in the output itself.
  std::atomic<int64_t> combines_in_target{0};
  std::atomic<int64_t> combines_into_out{0};
};

// Sees each MoE layer's exchange inside RemoteMoeExecutor::Run, for metrics. Called on the
// step thread; must be cheap and must not call back into the executor.
class DispatchObserver {
 public:
  virtual ~DispatchObserver() = default;
  // The dispatch phase ended: layout, packing and one send to every EP rank (sends that
  // failed included). layout.token_rows[r] are the tokens sent to EP rank r.
  virtual void OnDispatch(const DispatchLayout& layout, double seconds) = 0;
  // The combine phase succeeded: every EP rank's rows received (this includes waiting
  // for the experts to compute) and summed into the output.
  virtual void OnCombine(const DispatchLayout& layout, double seconds) = 0;
};

struct DispatchOptions {
  DType wire_dtype = DType::kF32;
  absl::Duration timeout = absl::Seconds(5);  // a step fails with UNAVAILABLE after this
  // Combine waits expected to end within this are spun through (polling, yielding the
  // core each turn) rather than slept through: waking from the transport's event fd
  // costs ~25 us on a VM, a third of a 0.5 MB exchange. Longer expected waits sleep after
  // the transport's short spin, as idle ones do. 0: never spin longer than the transport.
  absl::Duration max_combine_spin = absl::Microseconds(500);
};

class RemoteMoeExecutor final : public MoeExecutor, public ReceiveTargetProvider {
 public:
  // `ep_peers[r]` is EP rank r's transport peer id.
  RemoteMoeExecutor(Transport* transport, std::vector<int> ep_peers, Placement placement,
                    int64_t hidden, DispatchOptions options);
  ~RemoteMoeExecutor() override;

  // The step id stamped on messages; the step loop sets it before each forward pass.
  void set_step(uint64_t step) { step_ = step; }
  void set_placement(Placement p) { placement_ = std::move(p); }
  void set_ep_peers(std::vector<int> peers) { ep_peers_ = std::move(peers); }
  const DispatchCounters& counters() const { return *counters_; }
  // Not owned; null (the default) observes nothing. Set before the first Run.
  void set_observer(DispatchObserver* observer) { observer_ = observer; }

  // Dispatch + Combine of one micro-batch covering the whole step.
  absl::Status Run(int layer, const Tensor& x, const std::vector<int32_t>& ids,
                   const std::vector<float>& weights, int top_k, Tensor* out) override;

  // Two-batch overlap: Dispatch sends and returns; the expert ranks compute while the
  // caller works on the other micro-batch; Combine receives and sums.
  bool overlaps() const override { return true; }
  absl::Status Dispatch(int layer, int micro, int num_micro, const Tensor& x,
                        const std::vector<int32_t>& ids, const std::vector<float>& weights,
                        int top_k, Tensor* out) override;
  absl::Status Combine(int layer, int micro, Tensor* out) override;

  // ReceiveTargetProvider: where a combine of a dispatched micro-batch lands.
  bool TargetFor(int peer, std::string_view header, size_t payload_bytes,
                 std::vector<ReceiveSegment>* segments) override;
  void TargetDropped(int peer, std::string_view header) override;

 private:
  // Where one EP rank's combine for a micro-batch is to land.
  struct CombineTarget {
    enum class State { kNone, kExpected, kAccepted };
    State state = State::kNone;
    WireHeader::Key key;
    size_t bytes = 0;
    uint8_t* dest = nullptr;
    bool into_out = false;  // dest is the caller's out
  };
  // A dispatched micro-batch waiting for its combine.
  struct InFlight {
    bool active = false;
    int layer = -1;
    DispatchLayout layout;
    std::vector<CombineTarget> targets;       // per EP rank
    std::vector<PayloadBytes> combine_bytes;  // per EP rank, reused
  };

  // Ends the micro-batch's targets: none is offered again, and receives still moving into
  // one finish first (the caller's `out` may be one).
  void AbandonTargets(InFlight& flight);
  int RankOfPeer(int peer) const;

  absl::StatusOr<TransportMessage> RecvCombine(int rank, int layer, int micro, absl::Time deadline);

  Transport* transport_;
  std::vector<int> ep_peers_;
  Placement placement_;
  int64_t hidden_;
  DispatchOptions options_;
  uint64_t step_ = 0;
  std::unique_ptr<DispatchCounters> counters_;
  DispatchObserver* observer_ = nullptr;
  InFlight in_flight_[kMaxMicroBatches];
  PayloadBytes scratch_;  // narrowed or packed dispatch rows, reused across calls
  std::vector<PayloadSegment> segments_;
  std::vector<float> row_;  // one combine row, widened
  std::vector<float> sum_;  // float32 sums for a narrower output
  // Recent combine waits (Combine's start to its last answer), smoothed: how long the
  // next is expected to take. Zero until the first.
  absl::Duration expected_combine_wait_ = absl::ZeroDuration();
  std::vector<uint8_t> touched_;  // per token: some rank's row was written there
};

}  // namespace dxs
