#include "expert_service/expert_compute.h"

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"

namespace dxs {

absl::Status ShardCompute::Forward(int layer, const Tensor& x, const RoutedPairs& pairs,
                                   Tensor* out) {
  Backend* backend_ = shard_->backend();
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
  DXS_ASSIGN_OR_RETURN(Tensor rows, backend_->UploadIndices(pairs.rows));
  DXS_ASSIGN_OR_RETURN(Tensor experts, backend_->UploadIndices(pairs.experts));
  DXS_ASSIGN_OR_RETURN(Tensor weights, backend_->Upload(pairs.weights, {n}));
  Tensor out_rows = rows;
  if (!pairs.out_rows.empty()) {
    DXS_ASSIGN_OR_RETURN(out_rows, backend_->UploadIndices(pairs.out_rows));
  }
  return shard_->ForwardPairs(layer, x, rows, experts, weights, out_rows, out);
}

}  // namespace dxs
