#include "kernels/op_checks.h"

#include <string>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/status_macros.h"

namespace dxs {

absl::Status CheckDType(const char* op, const Tensor& t, DType want, const char* what) {
  if (!t.defined()) return absl::InvalidArgumentError(absl::StrCat(op, ": ", what, " is unset"));
  if (t.dtype() != want) {
    return absl::InvalidArgumentError(absl::StrCat(op, ": ", what, " is ",
                                                   std::string(DTypeName(t.dtype())), ", not ",
                                                   std::string(DTypeName(want))));
  }
  return absl::OkStatus();
}

absl::Status CheckSameElements(const char* op, const Tensor& a, const Tensor& b) {
  if (a.num_elements() != b.num_elements()) {
    return absl::InvalidArgumentError(
        absl::StrCat(op, ": ", a.ShapeString(), " and ", b.ShapeString(), " differ in size"));
  }
  return absl::OkStatus();
}

absl::StatusOr<int64_t> CountElements(const char* op, const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t d : shape) {
    if (d < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat(op, ": negative dimension in [", absl::StrJoin(shape, ", "), "]"));
    }
    n *= d;
  }
  return n;
}

absl::Status CheckFloat(const char* op, const Tensor& t, const char* what) {
  if (!t.defined()) return absl::InvalidArgumentError(absl::StrCat(op, ": ", what, " is unset"));
  if (!IsFloatDType(t.dtype())) {
    return absl::InvalidArgumentError(absl::StrCat(
        op, ": ", what, " is ", std::string(DTypeName(t.dtype())), ", not a floating type"));
  }
  return absl::OkStatus();
}

absl::Status CheckPagedAttentionMeta(const char* op, const PagedAttentionMeta& meta,
                                     int64_t num_tokens) {
  DXS_RETURN_IF_ERROR(CheckDType(op, meta.query_start, DType::kI32, "query_start"));
  DXS_RETURN_IF_ERROR(CheckDType(op, meta.context_lens, DType::kI32, "context_lens"));
  DXS_RETURN_IF_ERROR(CheckDType(op, meta.block_tables, DType::kI32, "block_tables"));
  DXS_RETURN_IF_ERROR(CheckDType(op, meta.slot_mapping, DType::kI64, "slot_mapping"));
  if (meta.block_size <= 0 || meta.query_start.num_elements() != meta.num_seqs + 1 ||
      meta.context_lens.num_elements() != meta.num_seqs ||
      meta.block_tables.num_elements() != meta.num_seqs * meta.max_blocks_per_seq ||
      meta.slot_mapping.num_elements() != num_tokens) {
    return absl::InvalidArgumentError(absl::StrCat(
        op, ": metadata for ", meta.num_seqs, " sequences does not fit ", num_tokens, " tokens"));
  }
  return absl::OkStatus();
}

}  // namespace dxs
