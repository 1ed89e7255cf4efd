// CPU backend: paged attention. The caches are [num_blocks, block_size, kv_heads, d]; a
// sequence's position p lives in block block_tables[s, p / block_size], row p % block_size.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "kernels/cpu_backend.h"

namespace dxs {

absl::Status CpuBackend::WriteKvCache(const Tensor& k, const Tensor& v,
                                      const PagedAttentionMeta& meta, Tensor* k_cache,
                                      Tensor* v_cache) {
  const int64_t tokens = k.rows();
  DXS_RETURN_IF_ERROR(CheckPagedAttentionMeta("write KV cache", meta, tokens));
  if (tokens == 0) return absl::OkStatus();  // an empty step may come before any page exists
  const int64_t row = k.row_size();          // kv_heads * d
  const int64_t num_slots = k_cache->dim(0) * k_cache->dim(1);
  if (k_cache->num_elements() != num_slots * row || v.row_size() != row) {
    return absl::InvalidArgumentError(
        absl::StrCat("write KV cache: rows of ", row, " into a cache ", k_cache->ShapeString()));
  }
  const int64_t* slots = meta.slot_mapping.i64();
  for (int64_t t = 0; t < tokens; ++t) {
    if (slots[t] < 0) continue;  // a padding row of a padded decode step: nothing to cache
    if (slots[t] >= num_slots) {
      return absl::InvalidArgumentError(
          absl::StrCat("write KV cache: slot ", slots[t], " outside [0, ", num_slots, ")"));
    }
    std::memcpy(k_cache->f32() + slots[t] * row, k.f32() + t * row, row * sizeof(float));
    std::memcpy(v_cache->f32() + slots[t] * row, v.f32() + t * row, row * sizeof(float));
  }
  return absl::OkStatus();
}

absl::Status CpuBackend::PagedAttention(const Tensor& q, const Tensor& k_cache,
                                        const Tensor& v_cache, const PagedAttentionMeta& meta,
                                        float scale, Tensor* out) {
  const int64_t tokens = q.dim(0), heads = q.dim(1), d = q.dim(2);
  DXS_RETURN_IF_ERROR(CheckPagedAttentionMeta("paged attention", meta, tokens));
  if (tokens == 0) return absl::OkStatus();
  const int64_t bs = meta.block_size, kv_heads = k_cache.dim(2);
  if (heads % kv_heads != 0 || k_cache.dim(3) != d || k_cache.dim(1) != bs) {
    return absl::InvalidArgumentError(
        absl::StrCat("paged attention: q ", q.ShapeString(), ", cache ", k_cache.ShapeString()));
  }
  const int64_t group = heads / kv_heads;
  const float* const k_base = k_cache.f32();
  const float* const v_base = v_cache.f32();
  const int32_t* query_start = meta.query_start.i32();
  const int32_t* context_lens = meta.context_lens.i32();
  std::vector<float> scores(std::max<int64_t>(meta.max_context_len, 1));
  for (int64_t s = 0; s < meta.num_seqs; ++s) {
    const int64_t q_begin = query_start[s], q_len = query_start[s + 1] - q_begin;
    const int64_t context = context_lens[s], past = context - q_len;
    const int32_t* table = meta.block_tables.i32() + s * meta.max_blocks_per_seq;
    if (q_len < 0 || past < 0 || q_begin + q_len > tokens ||
        context > meta.max_blocks_per_seq * bs) {
      return absl::InvalidArgumentError(absl::StrCat("paged attention: sequence ", s, " has ",
                                                     q_len, " queries over ", context,
                                                     " positions"));
    }
    if (static_cast<int64_t>(scores.size()) < context) scores.resize(context);
    // Each position's cache row (in units of d), looked up once per sequence rather than
    // per (query, head, position): the division by the block size stays out of the loops.
    thread_local std::vector<int64_t> row_of;
    row_of.resize(static_cast<size_t>(context));
    for (int64_t p = 0; p < context; ++p) {
      row_of[p] = (static_cast<int64_t>(table[p / bs]) * bs + p % bs) * kv_heads;
    }
    for (int64_t i = 0; i < q_len; ++i) {
      const int64_t visible = past + i + 1;
      for (int64_t h = 0; h < heads; ++h) {
        const float* qv = q.f32() + ((q_begin + i) * heads + h) * d;
        const int64_t kvh = h / group;
        float max_score = -INFINITY;
        for (int64_t p = 0; p < visible; ++p) {
          const float* kv = k_base + (row_of[p] + kvh) * d;
          float dot = 0.f;
          for (int64_t j = 0; j < d; ++j) dot += qv[j] * kv[j];
          dot *= scale;
          scores[p] = dot;
          max_score = std::max(max_score, dot);
        }
        float sum = 0.f;
        for (int64_t p = 0; p < visible; ++p) {
          scores[p] = std::exp(scores[p] - max_score);
          sum += scores[p];
        }
        float* o = out->f32() + ((q_begin + i) * heads + h) * d;
        std::fill(o, o + d, 0.f);
        for (int64_t p = 0; p < visible; ++p) {
          const float w = scores[p] / sum;
          const float* vv = v_base + (row_of[p] + kvh) * d;
          for (int64_t j = 0; j < d; ++j) o[j] += w * vv[j];
        }
      }
    }
  }
  return absl::OkStatus();
}

}  // namespace dxs
