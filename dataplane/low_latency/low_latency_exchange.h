// LowLatencyExchange: one rank's side of the low-latency (LL) exchange of decode steps:
// dispatch and combine with no host synchronisation, so that a whole step can be captured
// in a CUDA graph. The host-driven exchange (dataplane/dispatch) stays the path of prefill and
// of every backend without one (BackendCapabilities::low_latency_exchange false):
// MakeLowLatencyExchange is UNIMPLEMENTED there.
//
// Why a second exchange: a decode step's rounds carry few rows, so the host-driven
// exchange's cost is its host round trips (counts to the host, then exact-size transfers),
// not its bytes. Here nothing goes through the host:
// - Fixed slots instead of counts. A receiver's region has a slot per (source rank, token),
//   sized by the capacity; slot t of a source is that source's token t, so no count has to
//   travel before the rows, and a token goes to an expert rank once whatever its top-k.
// - Rows written straight into the receiver's memory, then a flag per source: the sender's
//   kernel stores the round's epoch (an ever-growing device counter) after its rows, and
//   the receiver's wait kernel spins until every source's flag reaches its next epoch.
//   Nothing is reset between rounds, so a recorded graph replays as it is.
// - One reduction stage: the expert rank sends each slot's weighted pre-sum, and the
//   combine adds a token's rows in ascending rank order (deterministic).
// - A wait past timeout_ns records the missing source and returns instead of hanging.
// dataplane/low_latency/cuda/ll_exchange.cuh has the kernels, the region layout and the
// ordering rules; cuda_low_latency_exchange.cc the rank's side on the CUDA backend.
//
// Each rank owns a receive region of fixed capacity (an expert rank the dispatch region,
// an attention rank the combine region), made by the backend as memory another process
// maps (Backend::AllocateShared); region_key() names it to the peers, whose Connect opens
// it. A round, per MoE layer, every rank taking part (zero tokens too):
//   attention rank: Dispatch(x, ids, weights)       expert rank: Receive(held, &pairs)
//                                                                 experts over pairs -> y
//                                                                 Send(y)
//                   Combine(ids, out)
// Every call only enqueues on the backend's queue. CheckStatus, after the queued work,
// turns a wait that timed out (a peer that died mid-round) into UNAVAILABLE; a timed-out
// exchange returns at once from then on, and recovery is a new exchange.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "kernels/backend.h"
#include "kernels/tensor.h"

namespace dxs {

struct LowLatencyShape {
  int num_attention_ranks = 0;  // the sources of a dispatch region
  int num_expert_ranks = 0;     // the sources of a combine region
  int capacity = 0;             // tokens an attention rank sends in one round, at most
  int hidden = 0;
  int top_k = 0;
  int num_experts = 0;
  // How long a wait spins before it says its source is gone (the services' 5 s).
  int64_t timeout_ns = 5'000'000'000;
  // Dispatch rows as FP8 records (--wire-dtype fp8; kernels/moe_compute.h: a float32 scale
  // per kFp8GroupSize channels, then the e4m3 values), quantized by Dispatch and dequantized
  // by Receive into x in bf16: the experts and the combine are as on the bf16 wire. The
  // records are copied as 16-byte vectors, so Fp8RecordBytes(hidden) must be a multiple of
  // 16 (hidden a multiple of 512, as Qwen3-MoE's 2048 and 4096 are).
  bool fp8_rows = false;
};

enum class LowLatencySide { kAttention, kExpert };

// Where a rank's rounds stand, read while they run (LowLatencyExchange::Progress).
struct LowLatencyProgress {
  int64_t sent = 0;      // rounds this rank has sent
  int64_t received = 0;  // rounds it has received (its waits that ended)
  // Per source rank, its last round that has arrived in this rank's receive region.
  std::vector<int64_t> arrived;
  std::string ToString() const {  // "sent 12, received 11, arrived [12 11]"
    return absl::StrCat("sent ", sent, ", received ", received, ", arrived [",
                        absl::StrJoin(arrived, " "), "]");
  }
};

// What an expert rank received in a round (ExpertShard::ForwardCountedPairs takes it),
// sized by the capacity: the region's rows in place as x (the wire dtype, bf16) and one
// entry per (source, slot, k). Entries that are no pair have expert num_experts and out row
// num_attention_ranks * capacity, a spare row of y that is neither summed into nor sent
// (dataplane/low_latency/cuda/ll_exchange.cuh, LaunchLlRegionPairs).
using LowLatencyPairs = CountedPairs;

class LowLatencyExchange {
 public:
  virtual ~LowLatencyExchange() = default;
  virtual const LowLatencyShape& shape() const = 0;
  virtual LowLatencySide side() const = 0;
  virtual int rank() const = 0;  // among its side's ranks
  // This rank's receive region, for the other side's Connect.
  virtual const std::string& region_key() const = 0;
  // The other side's receive regions, by rank (num_expert_ranks keys on the attention
  // side, num_attention_ranks on the expert side). Once, before the first round.
  virtual absl::Status Connect(const std::vector<std::string>& peer_keys) = 0;

  // ---- The attention side ----
  // Sends rows x[T, hidden] (bf16; T <= capacity; as FP8 records with shape.fp8_rows) with
  // their routing (ids i32 / weights f32
  // [T, top_k]) to the ranks of expert_owner (i32 [num_experts]: one expert rank each).
  virtual absl::Status Dispatch(const Tensor& x, const Tensor& ids, const Tensor& weights,
                                const Tensor& expert_owner) = 0;
  // Waits for the expert ranks' answers to the last Dispatch and writes out[T, hidden]: per
  // token, the pre-sums of the ranks it went to, added in ascending rank order (the one
  // reduction). ids and expert_owner as dispatched.
  virtual absl::Status Combine(const Tensor& ids, const Tensor& expert_owner, Tensor* out) = 0;

  // ---- The expert side ----
  // Waits for every attention rank's round and lists its pairs (held: i32 [num_experts],
  // non-zero for the experts this rank holds).
  virtual absl::Status Receive(const Tensor& held, LowLatencyPairs* pairs) = 0;
  // Sends y[num_attention_ranks * capacity + 1, hidden] (row s * capacity + t: the
  // pre-sum of source s's token t here) back to the attention ranks.
  virtual absl::Status Send(const Tensor& y) = 0;

  // Waits for the queued work; OK, or UNAVAILABLE naming the rank a wait gave up on, or
  // FAILED_PRECONDITION for pairs routed to experts this rank does not hold.
  virtual absl::Status CheckStatus() = 0;
  // Where the rounds stand now, without waiting for the queued work: what a stalled step
  // is doing (a rank that never received a round, or received it and never answered). One
  // caller at a time; any thread.
  virtual absl::StatusOr<LowLatencyProgress> Progress() const = 0;
};

// One rank's side of the exchange on `backend`: its receive region made there, the rounds
// enqueued on the backend's queue. UNIMPLEMENTED where the backend has none (the CPU's: the
// host-driven exchange serves it). The CUDA backend's comes from the binary itself when it
// links the backend in (UseInProcessLowLatencyExchange), else from libdxs_cuda.so, the
// plugin the backend was loaded from (dataplane/low_latency/cuda/).
absl::StatusOr<std::unique_ptr<LowLatencyExchange>> MakeLowLatencyExchange(
    Backend* backend, const LowLatencyShape& shape, LowLatencySide side, int rank);

using LowLatencyExchangeMaker = absl::StatusOr<std::unique_ptr<LowLatencyExchange>> (*)(
    Backend* backend, const LowLatencyShape& shape, LowLatencySide side, int rank);
// From now on MakeLowLatencyExchange calls `maker` instead of looking in the plugin: for
// binaries that link the CUDA backend in (tests, gpu_bench), whose backends the plugin's
// code must not run on (it has its own copy of the CUDA runtime).
void UseInProcessLowLatencyExchange(LowLatencyExchangeMaker maker);

}  // namespace dxs
