// The dispatch/combine wire format: a fixed little-endian header per message, then rows.
//
//   dispatch (attention -> expert): rows[num_rows, hidden] in wire dtype, then the routed
//       pairs: row index int32[num_pairs], expert id int32[num_pairs], weight f32[num_pairs]
//   combine  (expert -> attention): rows[num_rows, hidden] in wire dtype, the expert rank's
//       pre-summed output for each dispatched row, in dispatch order
//   step     (attention -> attention): no payload; `aux` is the sender's token count and
//       `num_rows` its two-batch-overlap threshold (AttentionStepLoop)
//
// A step split into micro-batches (two-batch overlap) sends one dispatch and one combine
// per (layer, micro-batch); `micro` and `num_micro` say which.
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

enum class MessageKind : uint8_t { kStep = 1, kDispatch = 2, kCombine = 3 };

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

  std::string Encode() const;
  static absl::StatusOr<WireHeader> Decode(std::string_view bytes);
  // (step, layer, micro) ordering key, the order in which a DP rank sends: later steps,
  // then later layers, then later micro-batches compare greater.
  using Key = std::tuple<uint64_t, int32_t, uint8_t>;
  Key key() const { return {step, layer, micro}; }
};

}  // namespace dxs
