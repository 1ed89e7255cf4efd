// The default operations of DeviceRuntime, DenseCompute and MoeCompute, and Backend's
// defaults of the MoE ops built on the runtime.
#include "kernels/backend.h"

#include <algorithm>
#include <cstdlib>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"

namespace dxs {

absl::StatusOr<std::shared_ptr<Buffer>> DeviceRuntime::AllocateStaging(size_t bytes) {
  void* p = std::aligned_alloc(64, std::max<size_t>((bytes + 63) / 64 * 64, 64));
  if (p == nullptr) return absl::ResourceExhaustedError("staging memory");
  return std::make_shared<Buffer>(Device::kCpu, p, bytes, [](void* q) { std::free(q); });
}

absl::Status DeviceRuntime::CopyFromStaging(const Buffer& staging, size_t offset, Tensor* dst) {
  if (offset + dst->num_bytes() > staging.num_bytes()) {
    return absl::InvalidArgumentError("copy from staging: past the staging buffer");
  }
  return CopyFromHost(static_cast<const uint8_t*>(staging.data()) + offset, dst->dtype(), dst);
}

absl::Status DeviceRuntime::CopyToStaging(const Tensor& src, const Buffer& staging, size_t offset) {
  if (offset + src.num_bytes() > staging.num_bytes()) {
    return absl::InvalidArgumentError("copy to staging: past the staging buffer");
  }
  return CopyToHost(src, src.dtype(), static_cast<uint8_t*>(staging.data()) + offset);
}

absl::StatusOr<SharedMemory> DeviceRuntime::AllocateShared(size_t bytes) {
  return absl::UnimplementedError(
      absl::StrCat("the ", name(), " backend shares no memory with other processes"));
}

absl::StatusOr<std::shared_ptr<Buffer>> DeviceRuntime::OpenShared(std::string_view key) {
  return absl::UnimplementedError(
      absl::StrCat("the ", name(), " backend shares no memory with other processes"));
}

absl::StatusOr<CapturedGraph> DeviceRuntime::CaptureGraph(
    const std::function<absl::StatusOr<Tensor>()>& body, Tensor* eager_output) {
  return absl::UnimplementedError(absl::StrCat("the ", name(), " backend has no graphs"));
}

absl::Status DeviceRuntime::Replay(Graph* graph) {
  return absl::UnimplementedError(absl::StrCat("the ", name(), " backend has no graphs"));
}

absl::Status DenseCompute::PrefetchWeights(const std::vector<const Tensor*>& weights,
                                           PrefetchWhile during, int64_t rows) {
  return absl::OkStatus();
}

absl::Status DenseCompute::Linears(const Tensor& x, const std::vector<const Tensor*>& ws,
                                   const std::vector<Tensor*>& ys) {
  if (ws.size() != ys.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("linears: ", ws.size(), " weights for ", ys.size(), " outputs"));
  }
  for (size_t i = 0; i < ws.size(); ++i) {
    if (ws[i] == nullptr || ys[i] == nullptr) {
      return absl::InvalidArgumentError("linears: a null weight or output");
    }
    DXS_RETURN_IF_ERROR(Linear(x, *ws[i], nullptr, ys[i]));
  }
  return absl::OkStatus();
}

absl::Status Backend::AddRmsNormRoute(const Tensor& x, const Tensor& norm_weight, float eps,
                                      Tensor* residual, Tensor* normed, const Tensor& router,
                                      int top_k, bool normalize, Tensor* ids, Tensor* weights) {
  DXS_RETURN_IF_ERROR(AddRmsNorm(x, norm_weight, eps, residual, normed));
  DXS_ASSIGN_OR_RETURN(Tensor logits, Allocate({normed->rows(), router.rows()}, DType::kF32));
  DXS_RETURN_IF_ERROR(Linear(*normed, router, nullptr, &logits));
  return TopKSoftmax(logits, top_k, normalize, ids, weights);
}

absl::Status Backend::ScaleSumRows(const Tensor& src, const Tensor& scales, const Tensor& rows,
                                   Tensor* out) {
  Tensor sum = *out;
  if (out->dtype() != DType::kF32) {
    DXS_ASSIGN_OR_RETURN(sum, Allocate({out->rows(), out->row_size()}, DType::kF32));
  }
  DXS_RETURN_IF_ERROR(Fill(&sum, 0.f));
  if (rows.num_elements() > 0) DXS_RETURN_IF_ERROR(ScaleAddRows(src, scales, rows, &sum));
  if (out->dtype() != DType::kF32) return Copy(sum, out);
  return absl::OkStatus();
}

absl::Status Backend::GroupedSwiGluCounted(const Tensor& xs, const Tensor& rows,
                                           const Tensor& expert_offsets,
                                           const std::vector<const Tensor*>& gate_up,
                                           const std::vector<const Tensor*>& down, Tensor* y) {
  const int64_t num_experts = expert_offsets.num_elements() - 1;
  if (num_experts < 0 || expert_offsets.dtype() != DType::kI32 ||
      y->rows() != rows.num_elements()) {
    return absl::InvalidArgumentError(
        absl::StrCat("grouped SwiGLU (counted): offsets ", expert_offsets.ShapeString(), ", ",
                     rows.num_elements(), " rows into ", y->ShapeString()));
  }
  int32_t count = 0;
  DXS_RETURN_IF_ERROR(CopyToHost(expert_offsets.Rows(num_experts, 1), DType::kI32, &count));
  if (count < 0 || count > rows.num_elements()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "grouped SwiGLU (counted): ", count, " pairs in a capacity of ", rows.num_elements()));
  }
  const Tensor counted_rows = rows.Rows(0, count);
  Tensor counted_y = y->Rows(0, count);
  return GroupedSwiGlu(xs, &counted_rows, expert_offsets, gate_up, down, &counted_y);
}

absl::Status DenseCompute::QkNormRopeWriteKv(Tensor* q, Tensor* k, const Tensor& v,
                                             const Tensor& q_weight, const Tensor& k_weight,
                                             float eps, const Tensor& positions, double theta,
                                             const PagedAttentionMeta& meta, Tensor* k_cache,
                                             Tensor* v_cache) {
  DXS_RETURN_IF_ERROR(QkNormRope(q, k, q_weight, k_weight, eps, positions, theta));
  return WriteKvCache(*k, v, meta, k_cache, v_cache);
}

bool MoeCompute::TakesRoutedSwiGlu(int64_t tokens, int64_t top_k) const { return false; }

absl::Status Backend::QuantizeRowsFp8(const Tensor&, const Tensor&, Tensor*) {
  return absl::UnimplementedError(
      absl::StrCat("FP8 dispatch rows: the ", name(), " backend has none (--wire-dtype fp8)"));
}

absl::Status Backend::DequantizeRowsFp8(const Tensor&, Tensor*) {
  return absl::UnimplementedError(
      absl::StrCat("FP8 dispatch rows: the ", name(), " backend has none (--wire-dtype fp8)"));
}

absl::Status Backend::RoutedSwiGlu(const Tensor& x, const Tensor& ids, const Tensor& weights,
                                   const std::vector<const Tensor*>& gate_up,
                                   const std::vector<const Tensor*>& down, Tensor* counts,
                                   Tensor* out) {
  return absl::FailedPreconditionError(absl::StrCat(
      "routed SwiGLU: the ", name(), " backend has no fused path (TakesRoutedSwiGlu)"));
}

absl::StatusOr<Tensor> DeviceRuntime::Zeros(std::vector<int64_t> shape, DType dtype) {
  DXS_ASSIGN_OR_RETURN(Tensor t, Allocate(std::move(shape), dtype));
  DXS_RETURN_IF_ERROR(Fill(&t, 0.f));
  return t;
}

absl::StatusOr<Tensor> DeviceRuntime::Upload(const std::vector<float>& host,
                                             std::vector<int64_t> shape) {
  DXS_ASSIGN_OR_RETURN(Tensor t, Allocate(std::move(shape), DType::kF32));
  if (static_cast<int64_t>(host.size()) != t.num_elements()) {
    return absl::InvalidArgumentError("upload: the host data does not match the shape");
  }
  DXS_RETURN_IF_ERROR(CopyFromHost(host.data(), DType::kF32, &t));
  return t;
}

absl::StatusOr<Tensor> DeviceRuntime::UploadIndices(const std::vector<int32_t>& host) {
  DXS_ASSIGN_OR_RETURN(Tensor t, Allocate({static_cast<int64_t>(host.size())}, DType::kI32));
  DXS_RETURN_IF_ERROR(CopyFromHost(host.data(), DType::kI32, &t));
  return t;
}

absl::StatusOr<std::vector<float>> DeviceRuntime::Download(const Tensor& t) {
  std::vector<float> host(static_cast<size_t>(t.num_elements()));
  DXS_RETURN_IF_ERROR(CopyToHost(t, DType::kF32, host.data()));
  return host;
}

absl::StatusOr<std::vector<int32_t>> DeviceRuntime::DownloadIndices(const Tensor& t) {
  std::vector<int32_t> host(static_cast<size_t>(t.num_elements()));
  DXS_RETURN_IF_ERROR(CopyToHost(t, DType::kI32, host.data()));
  return host;
}

}  // namespace dxs
