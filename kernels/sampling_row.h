// SamplingRow: one row of Backend::SampleRows' parameter tensor (i64 [rows, 4], a row's
// 32 bytes read as this struct), the same bytes on every backend. Free of other headers so
// that .cu files can include it.
#pragma once

#include <cstdint>

namespace dxs {

struct SamplingRow {
  float temperature;  // 0 = greedy; else finite and > 0
  float top_p;        // in (0, 1]
  int32_t top_k;      // 0 = off; else >= 1
  int32_t reserved;   // 0
  uint64_t seed;      // the request's stream
  uint64_t draw;      // which output of the stream: tokens the request sampled before this one
};

inline constexpr int64_t kSamplingRowWords = 4;  // i64 elements per SamplingRow
static_assert(sizeof(SamplingRow) == kSamplingRowWords * sizeof(int64_t),
              "a SamplingRow is one row of an i64 [rows, 4] tensor");

}  // namespace dxs
