#include "dataplane/dispatch/wire.h"

#include <cstring>

#include "absl/strings/str_cat.h"

namespace dxs {
namespace {

constexpr size_t kEncodedSize = 4 + 1 + 1 + 2 + 8 + 4 * 4 + 8 + 8 + 1 + 5 * 4 + 3 * 8 + 2 * 8;

template <typename T>
void Put(std::string* out, T v) {
  out->append(reinterpret_cast<const char*>(&v), sizeof(v));
}

template <typename T>
T Get(std::string_view bytes, size_t* offset) {
  T v;
  std::memcpy(&v, bytes.data() + *offset, sizeof(v));
  *offset += sizeof(v);
  return v;
}

}  // namespace

std::string WireHeader::Encode() const {
  std::string out;
  out.reserve(kEncodedSize);
  Put<uint32_t>(&out, kMagic);
  Put<uint8_t>(&out, static_cast<uint8_t>(kind));
  Put<uint8_t>(&out, static_cast<uint8_t>(wire_dtype));
  Put<uint8_t>(&out, micro);
  Put<uint8_t>(&out, num_micro);
  Put<uint64_t>(&out, step);
  Put<int32_t>(&out, layer);
  Put<int32_t>(&out, num_rows);
  Put<int32_t>(&out, num_pairs);
  Put<int32_t>(&out, hidden);
  Put<int64_t>(&out, aux);
  Put<uint64_t>(&out, placement_version);
  Put<uint8_t>(&out, flags);
  Put<uint32_t>(&out, ll_generation);
  Put<int32_t>(&out, ll_capacity);
  Put<int32_t>(&out, ll_ranks);
  Put<int32_t>(&out, ll_rank);
  Put<int32_t>(&out, num_experts);
  Put<int64_t>(&out, rows_at);
  Put<int64_t>(&out, pairs_at);
  Put<int64_t>(&out, answers_at);
  Put<uint64_t>(&out, dp_mask);
  Put<uint64_t>(&out, dp_view);
  return out;
}

absl::StatusOr<WireHeader> WireHeader::Decode(std::string_view bytes) {
  if (bytes.size() != kEncodedSize) {
    return absl::InvalidArgumentError(
        absl::StrCat("wire header of ", bytes.size(), " bytes, expected ", kEncodedSize));
  }
  size_t off = 0;
  if (Get<uint32_t>(bytes, &off) != kMagic) {
    return absl::InvalidArgumentError("wire header: bad magic");
  }
  WireHeader h;
  const uint8_t kind = Get<uint8_t>(bytes, &off);
  const uint8_t dtype = Get<uint8_t>(bytes, &off);
  if (kind < 1 || kind > static_cast<uint8_t>(MessageKind::kStepAbandoned))
    return absl::InvalidArgumentError("wire header: bad kind");
  if (dtype > static_cast<uint8_t>(DType::kBF16)) {
    return absl::InvalidArgumentError("wire header: bad dtype");
  }
  h.kind = static_cast<MessageKind>(kind);
  h.wire_dtype = static_cast<DType>(dtype);
  h.micro = Get<uint8_t>(bytes, &off);
  h.num_micro = Get<uint8_t>(bytes, &off);
  h.step = Get<uint64_t>(bytes, &off);
  h.layer = Get<int32_t>(bytes, &off);
  h.num_rows = Get<int32_t>(bytes, &off);
  h.num_pairs = Get<int32_t>(bytes, &off);
  h.hidden = Get<int32_t>(bytes, &off);
  h.aux = Get<int64_t>(bytes, &off);
  h.placement_version = Get<uint64_t>(bytes, &off);
  h.flags = Get<uint8_t>(bytes, &off);
  h.ll_generation = Get<uint32_t>(bytes, &off);
  h.ll_capacity = Get<int32_t>(bytes, &off);
  h.ll_ranks = Get<int32_t>(bytes, &off);
  h.ll_rank = Get<int32_t>(bytes, &off);
  h.num_experts = Get<int32_t>(bytes, &off);
  h.rows_at = Get<int64_t>(bytes, &off);
  h.pairs_at = Get<int64_t>(bytes, &off);
  h.answers_at = Get<int64_t>(bytes, &off);
  h.dp_mask = Get<uint64_t>(bytes, &off);
  h.dp_view = Get<uint64_t>(bytes, &off);
  if ((h.flags & ~(WireHeader::kMapped | WireHeader::kDeviceRegion | WireHeader::kLowLatencyFits |
                   WireHeader::kConnect | WireHeader::kFp8Rows)) != 0) {
    return absl::InvalidArgumentError("wire header: unknown flags");
  }
  if (h.num_micro < 1 || h.micro >= h.num_micro) {
    return absl::InvalidArgumentError("wire header: bad micro-batch");
  }
  if (h.num_rows < 0 || h.num_pairs < 0 || h.hidden < 0 || h.rows_at < 0 || h.pairs_at < 0 ||
      h.answers_at < 0 || h.ll_capacity < 0 || h.ll_ranks < 0 || h.ll_rank < 0 ||
      h.num_experts < 0) {
    return absl::InvalidArgumentError("wire header: negative count");
  }
  return h;
}

}  // namespace dxs
