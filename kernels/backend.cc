#include "kernels/backend.h"

#include "common/status_macros.h"

namespace dxs {

absl::StatusOr<Tensor> Backend::Zeros(std::vector<int64_t> shape, DType dtype) {
  DXS_ASSIGN_OR_RETURN(Tensor t, Allocate(std::move(shape), dtype));
  DXS_RETURN_IF_ERROR(Fill(&t, 0.f));
  return t;
}

absl::StatusOr<Tensor> Backend::Upload(const std::vector<float>& host, std::vector<int64_t> shape) {
  DXS_ASSIGN_OR_RETURN(Tensor t, Allocate(std::move(shape), DType::kF32));
  if (static_cast<int64_t>(host.size()) != t.num_elements()) {
    return absl::InvalidArgumentError("upload: the host data does not match the shape");
  }
  DXS_RETURN_IF_ERROR(CopyFromHost(host.data(), DType::kF32, &t));
  return t;
}

absl::StatusOr<Tensor> Backend::UploadIndices(const std::vector<int32_t>& host) {
  DXS_ASSIGN_OR_RETURN(Tensor t, Allocate({static_cast<int64_t>(host.size())}, DType::kI32));
  DXS_RETURN_IF_ERROR(CopyFromHost(host.data(), DType::kI32, &t));
  return t;
}

absl::StatusOr<std::vector<float>> Backend::Download(const Tensor& t) {
  std::vector<float> host(static_cast<size_t>(t.num_elements()));
  DXS_RETURN_IF_ERROR(CopyToHost(t, DType::kF32, host.data()));
  return host;
}

absl::StatusOr<std::vector<int32_t>> Backend::DownloadIndices(const Tensor& t) {
  std::vector<int32_t> host(static_cast<size_t>(t.num_elements()));
  DXS_RETURN_IF_ERROR(CopyToHost(t, DType::kI32, host.data()));
  return host;
}

}  // namespace dxs
