// The low-latency (LL) exchange of decode steps: dispatch and combine between attention
// (DP) ranks and expert (EP) ranks as kernels that write rows straight into the receiver's
// memory and signal with flags (DeepEP's intranode shape), so that a step needs no host
// synchronisation and can be captured in a CUDA graph. The high-throughput exchange (counts
// to the host, exact-size grouped transfers over UCX or NCCL: dataplane/dispatch) stays the
// path for prefill.
//
// Memory. Every receiver owns one region per direction, of fixed capacity, zeroed once
// when it is made: an expert rank a dispatch region with a slot per (source attention rank,
// token); an attention rank a combine region with a slot per (source expert rank, token).
// Senders hold the receivers' region bases as pointers they can store through: CUDA IPC
// mappings (LlExportRegion / LlOpenRegion) between processes, the pointers themselves inside
// one process. Slot t of a source is that source's token t: no counts are needed before
// the rows, and a token goes to a rank at most once whatever its top-k (its pairs there
// ride in the slot's meta).
//
// A round, for one micro-batch of one layer:
//   attention rank: LaunchLlDispatchSend          expert rank: LaunchLlWait (dispatch region)
//                                                  the experts over the region's rows
//                                                  LaunchLlCombineSend
//                   LaunchLlWait (combine region)
//                   LaunchLlCombineReduce
// Every rank takes part in every round, with zero tokens too (an empty-batch rank still
// signals), so the epochs stay in step.
//
// Signalling. A sender's kernel writes its rows and meta, then its last block (counted
// through LlSync::blocks_done) stores, per receiver, its token count, a system-scope fence
// and the round's epoch into the receiver's flag for this source (a release store). The
// receiver's LaunchLlWait spins with acquire loads until every source's flag reaches its
// own next epoch. Epochs are device counters (LlSync), one more per round on each side:
// nothing is reset between rounds, so graphs replay as they are. Regions are reused round
// after round without a second buffer because each direction's next write waits for the
// other direction's data: an attention rank dispatches layer l + 1 only after combining
// layer l, which the expert rank sends only after its experts have read layer l's rows.
//
// Failure. A wait that passes `timeout_ns` records the source it waited for in its
// LlSync (error = 1, error_source, the round it waited for and the source's last round that
// had arrived) and returns; so does every later wait on that LlSync without waiting, and the
// caller reads the LlSync after the step (LaunchLlSnapshot) and turns it into UNAVAILABLE. A peer
// that died mid-round cannot hang a rank's stream.
//
// Limits: at most kLlMaxRanks ranks a side, row bytes a multiple of 16, top_k <=
// kLlMaxTopK. Launchers check their arguments (cudaErrorInvalidValue, with a message in
// *error) before launching.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <string>

#include "kernels/cuda/ops.cuh"

namespace dxs::cuda {

inline constexpr int kLlMaxRanks = 32;
inline constexpr int kLlMaxTopK = 32;

// Where a region's parts lie, in bytes from its base (each 256-byte aligned).
struct LlRegionLayout {
  int32_t num_sources = 0;  // ranks that write into it
  int32_t capacity = 0;     // token slots a source
  int32_t hidden = 0;       // elements a row
  int32_t top_k = 0;        // meta pairs a slot (0: no meta, the combine direction)
  int32_t row_bytes = 0;    // hidden * element size
  size_t flags = 0;         // uint64 [num_sources]: the epoch of each source's last round
  size_t counts = 0;        // int32 [num_sources]: its token count in that round
  size_t meta = 0;          // LlPair [num_sources][capacity][top_k]
  size_t rows = 0;          // [num_sources][capacity] rows of row_bytes
  size_t bytes = 0;         // the whole region
};

// A routed pair in a dispatch slot: the expert (-1: this pair is not at the receiving
// rank) and its weight.
struct LlPair {
  int32_t expert;
  float weight;
};

// One rank's counters for one region pair (zeroed once, with the regions).
struct LlSync {
  unsigned long long send_epoch;  // rounds this rank has sent
  unsigned long long recv_epoch;  // rounds it has received
  unsigned int blocks_done;       // the send kernel's blocks that finished (reset by its last)
  int error;                      // 0, or 1: a wait timed out
  int error_source;               // the source it waited for
  int unused;
  unsigned long long error_round;    // the round it waited for
  unsigned long long error_arrived;  // the source's last round in the region then
};

// The layout of a region; bytes == 0 when the sizes are out of range (the launchers say
// why).
LlRegionLayout MakeLlRegionLayout(int num_sources, int capacity, int hidden, int top_k,
                                  ElemType row_type);
// The layout of a dispatch region whose rows are opaque records of `record_bytes` (FP8
// rows: their scales, then their values; kernels/moe_compute.h), copied as bytes: `hidden`
// is the record's bytes, a multiple of 16.
LlRegionLayout MakeLlRecordRegionLayout(int num_sources, int capacity, int record_bytes, int top_k);

struct LlDispatchSendArgs {
  // [num_tokens, hidden] rows in the region's row type; ids and weights [num_tokens,
  // layout.top_k] (ids outside [0, num_experts): no pair).
  const void* x = nullptr;
  const int32_t* topk_ids = nullptr;
  const float* topk_weights = nullptr;
  const int32_t* num_tokens_device = nullptr;  // the token count on the device, or null: num_tokens
  int64_t num_tokens = 0;                      // <= capacity; with a device count, its upper bound
  const int32_t* expert_owner = nullptr;       // [num_experts]: the receiving rank of each expert
  int32_t num_experts = 0;
  void* const* regions = nullptr;  // device array [num_ranks]: each receiver's dispatch region
  int32_t num_ranks = 0;
  int32_t source = 0;      // this rank's index among the region's sources
  LlRegionLayout layout;   // of every receiver's dispatch region (the same)
  LlSync* sync = nullptr;  // this rank's
};
cudaError_t LaunchLlDispatchSend(const LlDispatchSendArgs& a, int num_sms, cudaStream_t stream,
                                 std::string* error);

// Waits until every source of `region` has sent this rank's next round (see the file
// comment for the timeout).
cudaError_t LaunchLlWait(const void* region, const LlRegionLayout& layout, LlSync* sync,
                         int64_t timeout_ns, cudaStream_t stream, std::string* error);

struct LlCombineSendArgs {
  // Each slot's output row: row s * dispatch.capacity + t for source s's token t, in the
  // combine region's row type (the weighted sum of the slot's pairs at this rank).
  const void* y = nullptr;
  const void* dispatch_region = nullptr;  // this rank's: the counts and meta of the round
  LlRegionLayout dispatch;
  void* const* regions = nullptr;  // device array [dispatch.num_sources]: their combine regions
  LlRegionLayout combine;          // of every receiver's combine region
  int32_t source = 0;              // this rank's index among the combine regions' sources
  LlSync* sync = nullptr;          // this rank's
};
cudaError_t LaunchLlCombineSend(const LlCombineSendArgs& a, int num_sms, cudaStream_t stream,
                                std::string* error);

struct LlCombineReduceArgs {
  const void* region = nullptr;  // this rank's combine region, after LaunchLlWait
  LlRegionLayout layout;
  ElemType row_type = ElemType::kBF16;
  const int32_t* topk_ids = nullptr;  // the round's dispatch ids [num_tokens, top_k]
  int32_t top_k = 0;
  const int32_t* expert_owner = nullptr;  // [num_experts], as dispatched
  int32_t num_experts = 0;
  const int32_t* num_tokens_device = nullptr;  // as dispatched
  int64_t num_tokens = 0;
  void* out = nullptr;  // [num_tokens, hidden]: the sum over ranks, ascending
  ElemType out_type = ElemType::kBF16;
};
cudaError_t LaunchLlCombineReduce(const LlCombineReduceArgs& a, int num_sms, cudaStream_t stream,
                                  std::string* error);

// An expert rank's round, after LaunchLlWait on its dispatch region, as the routed pairs the
// grouped expert FFN takes (ExpertShard::ForwardLowLatency), with no count on the host: one
// entry per (source, slot, k) of the region, P = num_sources * capacity * top_k. Entry i of
// slot (s, t) is a pair when t < the source's count and its expert is in [0, num_experts)
// and held here (held: i32 [num_experts], non-zero for the experts this rank holds); then
// rows[i] = out_rows[i] = s * capacity + t, experts[i] = the expert, weights[i] = its
// weight. Every other entry is (row 0, expert num_experts, weight 0, out row num_sources *
// capacity): the sort puts it after every real pair, and its out row is a spare row of y
// outside the slots that ForwardLowLatency sums (so it is skipped) and nobody sends. A
// pair for an expert that is not held counts in bad[0] (the host reads it with the step's
// status; the attention side's placement and this rank's disagree).
struct LlRegionPairsArgs {
  const void* region = nullptr;  // this rank's dispatch region
  LlRegionLayout layout;
  const int32_t* held = nullptr;
  int32_t num_experts = 0;
  int32_t* rows = nullptr;      // [P]
  int32_t* experts = nullptr;   // [P]
  float* weights = nullptr;     // [P]
  int32_t* out_rows = nullptr;  // [P]
  int32_t* bad = nullptr;       // [1], accumulated
};
cudaError_t LaunchLlRegionPairs(const LlRegionPairsArgs& a, int num_sms, cudaStream_t stream,
                                std::string* error);

// The LlSync, copied to the host (cudaMemcpy: synchronous, and through a copy engine).
cudaError_t LlReadSync(const LlSync* sync, LlSync* host);

// A rank's state as the host reads it, written by LaunchLlSnapshot into pinned host memory
// mapped into the device: no copy. A copy to pageable host memory (cudaMemcpy into a host
// struct) waits while another thread's copy to pageable memory waits in its stream: the
// driver stages them one at a time (bench/gpu_host_call_probe.cu: 975 ms, until the spin
// ended; pinned copies and kernels ran beside it). In one process (the ranks of
// LocalLowLatencyExperts) an expert rank's status read by copy would wait behind the
// attention rank's copy of its step's logits, which waits for that expert rank's next step:
// a stall until the attention rank's wait times out.
struct LlSnapshot {
  LlSync sync;
  int bad;  // pairs for experts the rank does not hold, since the last snapshot that reset it
  int unused;
  unsigned long long arrived[kLlMaxRanks];  // the region's flags: each source's last round
};
// Enqueues the snapshot of `sync`, the region's flags and *bad (reset to 0 when reset_bad;
// bad may be null) into `mapped` (pinned host memory mapped into the device; its contents
// are the host's to read once the stream has passed the kernel).
cudaError_t LaunchLlSnapshot(const LlSync* sync, const void* region, const LlRegionLayout& layout,
                             int32_t* bad, bool reset_bad, LlSnapshot* mapped, cudaStream_t stream,
                             std::string* error);

// CUDA IPC for a region made by cudaMalloc (its base): the handle to hand to the peer
// process, and the peer's mapping of it (closed with LlCloseRegion).
struct LlRegionHandle {
  unsigned char bytes[64];
};
cudaError_t LlExportRegion(void* base, LlRegionHandle* handle);
cudaError_t LlOpenRegion(const LlRegionHandle& handle, void** base);
cudaError_t LlCloseRegion(void* base);

}  // namespace dxs::cuda
