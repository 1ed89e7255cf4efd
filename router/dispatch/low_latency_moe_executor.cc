#include "router/dispatch/low_latency_moe_executor.h"

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"

namespace dxs {

absl::Status LowLatencyMoeExecutor::Run(int layer, const Tensor& x, const Tensor& ids,
                                        const Tensor& weights, Tensor* out) {
  (void)layer;  // every MoE layer is one round; the expert ranks count them the same way
  Tensor rows = x;
  if (x.dtype() != DType::kBF16) {  // the wire's rows are bf16
    const bool capturing = backend_->InGraphCapture();
    if (capturing || !narrow_.defined() || narrow_.rows() < x.rows() ||
        narrow_.row_size() != x.row_size()) {
      DXS_ASSIGN_OR_RETURN(Tensor t, backend_->Allocate({x.rows(), x.row_size()}, DType::kBF16));
      if (!capturing) narrow_ = t;
      rows = t;
    } else {
      rows = narrow_.Rows(0, x.rows());
    }
    DXS_RETURN_IF_ERROR(backend_->Copy(x, &rows));
  }
  DXS_RETURN_IF_ERROR(exchange_->Dispatch(rows, ids, weights, expert_owner_));
  ++rounds_;
  return exchange_->Combine(ids, expert_owner_, out);
}

}  // namespace dxs
