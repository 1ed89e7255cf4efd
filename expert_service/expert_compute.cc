#include "expert_service/expert_compute.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"

namespace dxs {

absl::Status ShardCompute::Forward(int layer, const Tensor& x, const RoutedPairs& pairs,
                                   Tensor* out) {
  Backend* backend = shard_->backend();
  // Host pairs (an expert worker's receive slots) onto the backend.
  const int64_t n = static_cast<int64_t>(pairs.size());
  for (int64_t p = 0; p < n; ++p) {
    const int32_t out_row = pairs.out_row(p);
    if (pairs.rows[p] < 0 || pairs.rows[p] >= x.rows() || out_row < 0 || out_row >= out->rows()) {
      return absl::InvalidArgumentError(absl::StrCat("routed row ", pairs.rows[p], " -> ", out_row,
                                                     " outside [0, ", x.rows(), ") -> [0, ",
                                                     out->rows(), ")"));
    }
  }
  // Into tensors reused across rounds, grown for the largest round seen.
  if (!rows_.defined() || rows_.rows() < n) {
    const int64_t capacity = std::max<int64_t>(n, 2 * (rows_.defined() ? rows_.rows() : 0));
    DXS_ASSIGN_OR_RETURN(rows_, backend->Allocate({capacity}, DType::kI32));
    DXS_ASSIGN_OR_RETURN(experts_, backend->Allocate({capacity}, DType::kI32));
    DXS_ASSIGN_OR_RETURN(weights_, backend->Allocate({capacity}, DType::kF32));
    DXS_ASSIGN_OR_RETURN(out_rows_, backend->Allocate({capacity}, DType::kI32));
  }
  Tensor rows = rows_.Rows(0, n), experts = experts_.Rows(0, n), weights = weights_.Rows(0, n);
  DXS_RETURN_IF_ERROR(backend->CopyFromHost(pairs.rows.data(), DType::kI32, &rows));
  DXS_RETURN_IF_ERROR(backend->CopyFromHost(pairs.experts.data(), DType::kI32, &experts));
  DXS_RETURN_IF_ERROR(backend->CopyFromHost(pairs.weights.data(), DType::kF32, &weights));
  Tensor out_rows = rows;
  if (!pairs.out_rows.empty()) {
    out_rows = out_rows_.Rows(0, n);
    DXS_RETURN_IF_ERROR(backend->CopyFromHost(pairs.out_rows.data(), DType::kI32, &out_rows));
  }
  return shard_->ForwardPairs(layer, x, rows, experts, weights, out_rows, out);
}

}  // namespace dxs
