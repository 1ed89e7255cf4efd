// SamplingRow: one row of Backend::SampleRows' parameter tensor (i64 [rows, 8], a row's
// 64 bytes read as this struct), the same bytes on every backend; and LogitAdjustment, one
// token of a row whose logit a request's penalties, bias or minimum length change. Free of
// other headers so that .cu files can include it.
#pragma once

#include <cstdint>

namespace dxs {

struct SamplingRow {
  float temperature;         // 0 = greedy; else finite and > 0
  float top_p;               // in (0, 1]
  int32_t top_k;             // 0 = off; else >= 1
  float min_p;               // in [0, 1]; 0 = off
  float repetition_penalty;  // > 0; 1 = off
  float frequency_penalty;   // in [-2, 2]
  float presence_penalty;    // in [-2, 2]
  // The row's LogitAdjustments: entries [adjust_begin, adjust_begin + adjust_count) of the
  // step's adjustment list.
  int32_t adjust_begin;
  int32_t adjust_count;
  int32_t reserved[3];  // 0
  uint64_t seed;        // the request's stream
  uint64_t draw;        // which output of the stream: tokens the request sampled before this one
};

inline constexpr int64_t kSamplingRowWords = 8;  // i64 elements per SamplingRow
static_assert(sizeof(SamplingRow) == kSamplingRowWords * sizeof(int64_t),
              "a SamplingRow is one row of an i64 [rows, 4] tensor");

// One token whose logit changes before sampling (kernels/sampling.h, ApplyLogitAdjustments).
// A row's adjustments name distinct tokens, so they can be applied in any order.
struct LogitAdjustment {
  int32_t token;
  int32_t output_count;  // times the request has generated it (frequency, presence)
  float bias;            // logit_bias
  uint32_t flags;        // kAdjustSeen | kAdjustBanned | kAdjustPending
};
// In the prompt or the output: the repetition penalty applies.
inline constexpr uint32_t kAdjustSeen = 1u;
// Masked (-inf): an EOS or stop id before min_new_tokens.
inline constexpr uint32_t kAdjustBanned = 2u;
// The last of a row's entries, in a step built ahead of its step before's token (overlap
// scheduling): a token no other entry names, changing nothing, until
// Backend::CountPendingTokens makes it the entry of that token where none is (output count
// 1, seen), or counts the token in its entry and leaves this one as it is.
inline constexpr uint32_t kAdjustPending = 4u;
inline constexpr int64_t kLogitAdjustmentWords = 4;  // i32 elements per LogitAdjustment
static_assert(sizeof(LogitAdjustment) == kLogitAdjustmentWords * sizeof(int32_t),
              "a LogitAdjustment is one row of an i32 [n, 4] tensor");

}  // namespace dxs
