// The dispatch/combine wire format. Control messages (the transport's message API) are a
// fixed little-endian header with no payload; the rows and pairs they announce travel as
// one data-exchange group (dataplane/transport/data_exchange.h) under ExchangeTag(key):
//
//   dispatch header (attention -> expert): num_rows, num_pairs, hidden, wire dtype. Then,
//       in the group, attention -> expert: rows[num_rows, hidden] in wire dtype, row index
//       int32[num_pairs], expert id int32[num_pairs], weight f32[num_pairs]; and
//       expert -> attention (the combine): rows[num_rows, hidden] in wire dtype, the expert
//       rank's pre-summed output for each dispatched row, in dispatch order. Every transfer
//       is posted, zero sizes included.
//   A dispatch header with kMapped set says instead that the rows, the pairs (the same
//       block) and room for the answers are in a region of the sender's memory that the
//       expert rank maps (DataExchange mapped regions): the payload is the region's key,
//       and rows_at / pairs_at / answers_at are byte offsets into it; with kDeviceRegion
//       the region is GPU memory the expert's backend opens (CUDA IPC). The expert reads the
//       rows and pairs there, stores its answers there, and then sends, in the group, one
//       int32 status instead of the rows (0: answers stored; kRegionUnmappable: the region
//       would not map, nothing was computed).
//   step     (attention -> attention): `aux` is the sender's token count, `num_rows` its
//       two-batch-overlap threshold and `placement_version` the newest expert placement it
//       has; the step dispatches with the oldest of those (AttentionStepLoop). With
//       kLowLatencyFits the sender's step can go over the low-latency exchange (decode
//       tokens, padded, within its `ll_capacity`) and `ll_generation` is the exchange it
//       wants; the step goes that way when every rank's fits (AttentionStepLoop).
//   low-latency step (attention -> expert, kLowLatencyStep): step `step`'s MoE layers go
//       over the low-latency exchange (dataplane/low_latency/low_latency_exchange.h) of
//       `ll_generation`: `ll_capacity` tokens a DP rank, `ll_ranks` expert ranks of which the
//       receiver is `ll_rank`, `num_experts` experts (an expert rank's own placement says which it
//       holds). With kConnect the exchange is new: the payload is the sender's combine region's
//       key, and the expert rank answers with a low-latency region message before the
//       step's rounds. `layer` is -1: the message comes before any dispatch of its step.
//   low-latency region (expert -> attention, kLowLatencyRegion): `ll_generation`'s
//       dispatch region key as the payload; empty: this rank has no low-latency exchange
//       (its backend has none, or making it failed), and the step fails.
//   step abandoned (attention -> expert, kStepAbandoned): the sender failed step `step` (in
//       the step exchange, which a DP peer may have finished with the sender's step message,
//       or after it: its own fence, a failed wait, a device error) and dispatches nothing
//       more of it; the expert rank serves that step's remaining rounds without the sender (a
//       host-driven step's: a low-latency step's exchange is made for all its DP ranks),
//       so the step's other DP ranks finish it instead of waiting out the step timeout for
//       headers that never come.
//
// A step split into micro-batches (two-batch overlap) sends one dispatch header and one
// group per (layer, micro-batch); `micro` and `num_micro` say which.
//
// Routing weights always travel as float32; activations as float32 or bfloat16.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <tuple>

#include "absl/status/statusor.h"
#include "common/dtype.h"

namespace dxs {

enum class MessageKind : uint8_t {
  kStep = 1,
  kDispatch = 2,
  kCombine = 3,
  kLowLatencyStep = 4,
  kLowLatencyRegion = 5,
  kStepAbandoned = 6,
};

// The status an expert rank answers a mapped dispatch with when the sender's region would
// not map (ExpertStepServer); 0 is success.
inline constexpr int32_t kRegionUnmappable = 1;

struct WireHeader {
  static constexpr uint32_t kMagic = 0x31535844;  // "DXS1"
  MessageKind kind = MessageKind::kStep;
  DType wire_dtype = DType::kF32;
  uint8_t micro = 0;      // micro-batch of the step, < num_micro
  uint8_t num_micro = 1;  // micro-batches the step is split into
  uint64_t step = 0;
  int32_t layer = -1;
  int32_t num_rows = 0;
  int32_t num_pairs = 0;
  int32_t hidden = 0;
  int64_t aux = 0;
  // The expert placement version the sender dispatches with (dispatch) or has (step).
  uint64_t placement_version = 0;
  static constexpr uint8_t kMapped = 1;  // flags: the rows are in a mapped region
  // With kMapped: the region is device memory (Backend::OpenShared's key), not host memory
  // the transport maps (DataExchange::AttachPeerRegion's).
  static constexpr uint8_t kDeviceRegion = 2;
  // kStep: the sender's step fits the low-latency exchange.
  static constexpr uint8_t kLowLatencyFits = 4;
  // kLowLatencyStep: a new exchange; the payload is the sender's region key.
  static constexpr uint8_t kConnect = 8;
  // kDispatch: the rows are FP8 records (Backend::QuantizeRowsFp8, Fp8RecordBytes(hidden)
  // bytes a row); the answers are in wire_dtype.
  static constexpr uint8_t kFp8Rows = 16;
  uint8_t flags = 0;
  // The low-latency exchange (kStep, kLowLatencyStep, kLowLatencyRegion; see above).
  uint32_t ll_generation = 0;
  int32_t ll_capacity = 0;
  int32_t ll_ranks = 0;
  int32_t ll_rank = 0;
  int32_t num_experts = 0;
  int64_t rows_at = 0, pairs_at = 0, answers_at = 0;  // with kMapped: byte offsets
  // kStep, kDispatch, kLowLatencyStep: the DP ranks taking part in the step (bit r: DP rank
  // r; 0: all of them, as with more than 64), and the router's view version that set was
  // read from (kStep: the sender's; otherwise the newest of the step's DP ranks). A DP rank
  // the router has DEAD (a frozen or partitioned attention worker) is left out of the steps
  // of the others, and an expert rank gathers a round's headers from the DP ranks named
  // here that its own view does not have DEAD (ExpertStepServer), waiting for that view
  // first when the step's is newer.
  uint64_t dp_mask = 0;
  uint64_t dp_view = 0;
  bool TakesPart(int dp_rank) const {
    return dp_mask == 0 || (dp_rank < 64 && ((dp_mask >> dp_rank) & 1) != 0);
  }
  bool mapped() const { return (flags & kMapped) != 0; }
  bool device_region() const { return (flags & kDeviceRegion) != 0; }
  bool fp8_rows() const { return (flags & kFp8Rows) != 0; }

  std::string Encode() const;
  static absl::StatusOr<WireHeader> Decode(std::string_view bytes);
  // (step, layer, micro) ordering key, the order in which a DP rank sends: later steps,
  // then later layers, then later micro-batches compare greater.
  using Key = std::tuple<uint64_t, int32_t, uint8_t>;
  Key key() const { return {step, layer, micro}; }
};

// The data-exchange tag of one (step, layer, micro-batch): unique among the groups that
// can be in flight at once (the low 32 bits of the step, 12 of the layer, 4 of the micro).
inline uint64_t ExchangeTag(const WireHeader::Key& key) {
  const auto [step, layer, micro] = key;
  return ((step & 0xffffffffu) << 16) | ((static_cast<uint64_t>(layer) & 0xfffu) << 4) |
         (micro & 0xfu);
}

}  // namespace dxs
