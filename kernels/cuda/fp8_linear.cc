// Linear of a block-scaled FP8 weight on the GPU (Tensor::block_scales; the kernels are
// kernels/cuda/fp8_linear.cu).
//
// Decode-sized x (at most kGemvMaxRows bf16 rows) takes LaunchGemvFp8: a step of a few tokens
// is bound by the weights' bytes, which FP8 halves, and the activations stay bf16. Larger x is
// quantized per token and per 128 channels, then goes through cuBLASLt's FP8 matmul with
// 128x128 block scales on the weight and 1x128 scales on the activations (the DeepSeek-V3 /
// Qwen3-FP8 recipe; CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F and VEC128_32F,
// Hopper and later). In cuBLAS's column-major terms row-major y[m, n] = x[m, k] w[n, k]^T is
// y^T = op_T(A) B with A = w (k x n, ld k) and B = x (k x m, ld k): FP8 matmuls want this
// "TN" form, which is the checkpoint's layout as it is. A's scales are K-major [n / 128,
// stride] (Tensor::block_scales' layout); B's are token-major per 128-channel group, and
// cuBLASLt wants the token count a multiple of 4, so x is padded with zero rows and a short
// result is copied out of a scratch. DXS_CUDA_FP8_GEMM=cutlass takes CUTLASS's SM90 blockwise
// FP8 GEMM instead (the experts' grouped kernel with one group); cuBLASLt measured faster at
// 16 to 4096 rows (docs/results/fp8.md).
#include <algorithm>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "kernels/cuda/cuda_backend_impl.h"
#include "kernels/cuda/grouped_gemm.cuh"
#include "kernels/op_checks.h"

namespace dxs {

CudaBackend::Fp8GemmPlan::~Fp8GemmPlan() {
  if (d != nullptr) api->layout_destroy(d);
  if (b != nullptr) api->layout_destroy(b);
  if (a != nullptr) api->layout_destroy(a);
  if (desc != nullptr) api->desc_destroy(desc);
}

absl::Status CudaBackend::CheckLinearFp8(const Tensor& x, const Tensor& w, const Tensor* bias,
                                         const Tensor& y) const {
  DXS_RETURN_IF_ERROR(CheckFloat("linear", x, "x"));
  DXS_RETURN_IF_ERROR(CheckFloat("linear", y, "y"));
  const Tensor* scales = w.block_scales();
  const int64_t m = x.rows(), k = x.row_size(), n = w.rows();
  if (!fp8_weights_ || scales == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat("linear: an FP8 weight ", w.ShapeString(),
                     fp8_weights_ ? " without block scales" : " on a backend without FP8 weights"));
  }
  if (w.shape().size() != 2 || w.row_size() != k || n % Tensor::kWeightBlock != 0 ||
      k % Tensor::kWeightBlock != 0 || y.num_elements() != m * n ||
      scales->dtype() != DType::kF32 || scales->rows() != n / Tensor::kWeightBlock ||
      scales->row_size() != BlockScaleStride(k)) {
    return absl::InvalidArgumentError(absl::StrCat("linear (fp8): x ", x.ShapeString(), ", w ",
                                                   w.ShapeString(), " with scales ",
                                                   scales->ShapeString(), ", y ", y.ShapeString()));
  }
  if (y.dtype() != DType::kBF16 && y.dtype() != DType::kF32) {
    return absl::InvalidArgumentError(absl::StrCat(
        "linear (fp8): y is ", std::string(DTypeName(y.dtype())), ", not bf16 or f32"));
  }
  if (bias != nullptr) {
    // No FP8 checkpoint of the models dxs serves has a biased projection.
    return absl::UnimplementedError("linear (fp8): a bias with an FP8 weight");
  }
  return absl::OkStatus();
}

absl::Status CudaBackend::LinearFp8(const Tensor& x, const Tensor& w, const Tensor* bias,
                                    Tensor* y) {
  DXS_RETURN_IF_ERROR(CheckLinearFp8(x, w, bias, *y));
  const Tensor* scales = w.block_scales();
  const int64_t m = x.rows(), k = x.row_size(), n = w.rows();
  if (m == 0) return absl::OkStatus();
  DXS_RETURN_IF_ERROR(Enter("linear"));
  if (TakesGemvFp8(x, w)) {
    return CudaStatus(cuda::LaunchGemvFp8(x.raw(), m, static_cast<const uint8_t*>(w.raw()),
                                          scales->f32(), scales->row_size(), n, k, y->raw(),
                                          ToElemType(y->dtype()), gemv_fp8_features_, stream_),
                      "linear (fp8 gemv)");
  }
  if (fp8_gemm_cutlass_) {
    absl::Status s = GemmFp8Cutlass(x, w, y);
    // A weight first seen while a graph records has no table yet: cuBLASLt takes it.
    if (!absl::IsFailedPrecondition(s)) return s;
  }
  return GemmFp8(x, w, y);
}

bool CudaBackend::TakesGemvFp8(const Tensor& x, const Tensor& w) const {
  return use_gemv_ && x.dtype() == DType::kBF16 && x.rows() <= cuda::kGemvMaxRows &&
         Aligned16(x.raw()) && Aligned16(w.raw());
}

absl::Status CudaBackend::LinearsFp8Gemm(const Tensor& x, const std::vector<const Tensor*>& ws,
                                         const std::vector<Tensor*>& ys) {
  // Each weight as LinearFp8 would take it alone: cuBLASLt after one quantization of x for all
  // of them (one pass over x where each Linear would make its own).
  bool shared = fp8_weights_ && !fp8_gemm_cutlass_ && ws.size() > 1 && ws.size() == ys.size();
  for (size_t i = 0; shared && i < ws.size(); ++i) {
    shared = ws[i] != nullptr && ys[i] != nullptr && ws[i]->dtype() == DType::kF8E4M3 &&
             !TakesGemvFp8(x, *ws[i]) && CheckLinearFp8(x, *ws[i], nullptr, *ys[i]).ok();
  }
  if (!shared) return Backend::Linears(x, ws, ys);
  if (x.rows() == 0) return absl::OkStatus();
  DXS_RETURN_IF_ERROR(Enter("linears"));
  DXS_ASSIGN_OR_RETURN(Fp8Activations q, QuantizeForGemmFp8(x));
  // The first weight on stream_, up to fp8_side_.size() more beside it (none with
  // DXS_CUDA_FP8_SIDE_STREAMS=off: no streams were made), the rest after it.
  const size_t sides = fp8_fork_ == nullptr ? 0 : std::min(ws.size() - 1, fp8_side_.size());
  if (sides > 0) {
    DXS_RETURN_IF_ERROR(CudaStatus(cudaEventRecord(fp8_fork_, stream_), "linears (fp8): fork"));
  }
  std::vector<Tensor> scratch(ws.size());
  absl::Status status;
  size_t forked = 0;  // side streams that wait on the fork: each is joined below
  for (size_t i = 0; i < ws.size() && status.ok(); ++i) {
    cudaStream_t stream = stream_;
    const Tensor* workspace = &cublas_workspace_;
    if (i >= 1 && i <= sides) {
      const SideStream& side = fp8_side_[i - 1];
      status = CudaStatus(cudaStreamWaitEvent(side.stream, fp8_fork_, 0), "linears (fp8): fork");
      forked = i;
      stream = side.stream;
      workspace = &side.workspace;
    }
    if (status.ok()) status = MatmulFp8(q, *ws[i], ys[i], stream, *workspace, &scratch[i]);
  }
  // Joined whatever happened: a recording stream must not end with a branch left open.
  for (size_t i = 0; i < forked; ++i) {
    const SideStream& side = fp8_side_[i];
    absl::Status join = CudaStatus(cudaEventRecord(side.done, side.stream), "linears (fp8): join");
    if (join.ok()) {
      join = CudaStatus(cudaStreamWaitEvent(stream_, side.done, 0), "linears (fp8): join");
    }
    status.Update(join);
  }
  return status;
}

absl::Status CudaBackend::GemmFp8Cutlass(const Tensor& x, const Tensor& w, Tensor* y) {
  const int64_t m = x.rows(), k = x.row_size(), n = w.rows();
  Tensor table;
  {
    absl::MutexLock lock(&fp8_mu_);
    auto it = fp8_dense_weights_.find(w.raw());
    if (it == fp8_dense_weights_.end()) {
      if (recording()) {
        return absl::FailedPreconditionError("fp8 gemm: a weight's first GEMM while recording");
      }
      Fp8DenseWeight dense;
      const Tensor& src = *w.block_scales();
      const int64_t n_blocks = n / Tensor::kWeightBlock, k_blocks = k / Tensor::kWeightBlock;
      DXS_ASSIGN_OR_RETURN(dense.scales, Allocate({k_blocks, n_blocks}, DType::kF32));
      DXS_RETURN_IF_ERROR(
          CudaStatus(cuda::LaunchTransposeBlockScales(src.f32(), n_blocks, k_blocks, src.row_size(),
                                                      dense.scales.f32(), stream_),
                     "linear (fp8): weight scales"));
      const void* ptrs[2] = {w.raw(), dense.scales.raw()};
      DXS_ASSIGN_OR_RETURN(dense.table, Allocate({2}, DType::kI64));
      DXS_RETURN_IF_ERROR(CopyFromHost(ptrs, DType::kI64, &dense.table));
      it = fp8_dense_weights_.emplace(w.raw(), std::move(dense)).first;
    }
    table = it->second.table;
  }
  // Activations as one group of m rows: scales M-major [k / 128, m] (no padding here).
  DXS_ASSIGN_OR_RETURN(Tensor values, Allocate({m, k}, DType::kF8E4M3));
  DXS_ASSIGN_OR_RETURN(Tensor x_scales, Allocate({k / Tensor::kWeightBlock, m}, DType::kF32));
  DXS_RETURN_IF_ERROR(CudaStatus(cuda::LaunchQuantizeActivationsFp8(
                                     x.raw(), ToElemType(x.dtype()), m, k, m,
                                     static_cast<uint8_t*>(values.raw()), x_scales.f32(), stream_),
                                 "linear (fp8): activations"));
  DXS_ASSIGN_OR_RETURN(Tensor offsets, Allocate({2}, DType::kI32));
  DXS_RETURN_IF_ERROR(
      CudaStatus(cuda::LaunchWriteOneGroup(offsets.i32(), m, stream_), "linear (fp8): group"));
  const size_t ws_bytes = cuda::GroupedGemmFp8WorkspaceBytes(1, m, n, k, ToElemType(y->dtype()));
  if (ws_bytes == 0) return absl::InternalError("linear (fp8): no grouped GEMM workspace size");
  DXS_ASSIGN_OR_RETURN(Tensor ws, Workspace(ws_bytes));
  const auto* ptrs = reinterpret_cast<const void* const*>(table.raw());
  return CudaStatus(cuda::LaunchGroupedGemmFp8(
                        static_cast<const uint8_t*>(values.raw()), x_scales.f32(), offsets.i32(),
                        ptrs, reinterpret_cast<const float* const*>(ptrs + 1), 1, m, n, k, y->raw(),
                        ToElemType(y->dtype()), ws.raw(), ws_bytes, stream_),
                    "linear (fp8 gemm, cutlass)");
}

absl::StatusOr<CudaBackend::Fp8GemmPlan*> CudaBackend::Fp8Plan(int64_t m_pad, int64_t n, int64_t k,
                                                               DType out_dtype,
                                                               const void* a_scales,
                                                               const void* b_scales) {
  auto& slot = fp8_plans_[std::make_tuple(m_pad, n, k, out_dtype)];
  if (slot != nullptr) return slot.get();
  auto plan = std::make_unique<Fp8GemmPlan>();
  plan->api = lt_;
  const CublasLtApi& lt = *lt_;
  auto check = [this](cublasStatus_t status, const char* what) {
    return CublasStatus(*blas_, status, what);
  };
  DXS_RETURN_IF_ERROR(
      check(lt.desc_create(&plan->desc, CUBLAS_COMPUTE_32F, CUDA_R_32F), "fp8 gemm: desc"));
  const cublasOperation_t op_t = CUBLAS_OP_T, op_n = CUBLAS_OP_N;
  const cublasLtMatmulMatrixScale_t a_mode = CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F,
                                    b_mode = CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F;
  DXS_RETURN_IF_ERROR(
      check(lt.desc_set(plan->desc, CUBLASLT_MATMUL_DESC_TRANSA, &op_t, sizeof(op_t)), "fp8 gemm"));
  DXS_RETURN_IF_ERROR(
      check(lt.desc_set(plan->desc, CUBLASLT_MATMUL_DESC_TRANSB, &op_n, sizeof(op_n)), "fp8 gemm"));
  DXS_RETURN_IF_ERROR(
      check(lt.desc_set(plan->desc, CUBLASLT_MATMUL_DESC_A_SCALE_MODE, &a_mode, sizeof(a_mode)),
            "fp8 gemm: weight scale mode"));
  DXS_RETURN_IF_ERROR(
      check(lt.desc_set(plan->desc, CUBLASLT_MATMUL_DESC_B_SCALE_MODE, &b_mode, sizeof(b_mode)),
            "fp8 gemm: activation scale mode"));
  // The heuristic refuses block scaling without the scales' (16-byte aligned) addresses; each
  // call sets its own again.
  DXS_RETURN_IF_ERROR(check(
      lt.desc_set(plan->desc, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &a_scales, sizeof(a_scales)),
      "fp8 gemm: weight scales"));
  DXS_RETURN_IF_ERROR(check(
      lt.desc_set(plan->desc, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &b_scales, sizeof(b_scales)),
      "fp8 gemm: activation scales"));
  const cudaDataType d_type = out_dtype == DType::kF32 ? CUDA_R_32F : CUDA_R_16BF;
  DXS_RETURN_IF_ERROR(check(lt.layout_create(&plan->a, CUDA_R_8F_E4M3, k, n, k), "fp8 gemm: a"));
  DXS_RETURN_IF_ERROR(
      check(lt.layout_create(&plan->b, CUDA_R_8F_E4M3, k, m_pad, k), "fp8 gemm: b"));
  DXS_RETURN_IF_ERROR(check(lt.layout_create(&plan->d, d_type, n, m_pad, n), "fp8 gemm: d"));
  cublasLtMatmulPreference_t pref = nullptr;
  DXS_RETURN_IF_ERROR(check(lt.pref_create(&pref), "fp8 gemm: preference"));
  const size_t workspace = cublas_workspace_.num_bytes();
  cublasStatus_t status =
      lt.pref_set(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &workspace, sizeof(workspace));
  cublasLtMatmulHeuristicResult_t result{};
  int found = 0;
  if (status == CUBLAS_STATUS_SUCCESS) {
    status = lt.heuristic(lt_handle_, plan->desc, plan->a, plan->b, plan->d, plan->d, pref, 1,
                          &result, &found);
  }
  lt.pref_destroy(pref);
  DXS_RETURN_IF_ERROR(check(status, "fp8 gemm: heuristic"));
  if (found == 0) {
    return absl::FailedPreconditionError(
        absl::StrCat("fp8 gemm: cuBLASLt has no block-scaled FP8 algorithm for m ", m_pad, ", n ",
                     n, ", k ", k));
  }
  plan->algo = result.algo;
  slot = std::move(plan);
  return slot.get();
}

absl::StatusOr<CudaBackend::Fp8Activations> CudaBackend::QuantizeForGemmFp8(const Tensor& x) {
  Fp8Activations q;
  q.rows = x.rows();
  q.padded_rows = (q.rows + 3) / 4 * 4;
  const int64_t k = x.row_size();
  DXS_ASSIGN_OR_RETURN(q.values, Allocate({q.padded_rows, k}, DType::kF8E4M3));
  DXS_ASSIGN_OR_RETURN(q.scales, Allocate({k / Tensor::kWeightBlock, q.padded_rows}, DType::kF32));
  DXS_RETURN_IF_ERROR(CudaStatus(
      cuda::LaunchQuantizeActivationsFp8(x.raw(), ToElemType(x.dtype()), q.rows, k, q.padded_rows,
                                         static_cast<uint8_t*>(q.values.raw()), q.scales.f32(),
                                         stream_),
      "linear (fp8): activations"));
  return q;
}

absl::Status CudaBackend::GemmFp8(const Tensor& x, const Tensor& w, Tensor* y) {
  DXS_ASSIGN_OR_RETURN(Fp8Activations q, QuantizeForGemmFp8(x));
  Tensor scratch;
  return MatmulFp8(q, w, y, stream_, cublas_workspace_, &scratch);
}

absl::Status CudaBackend::MatmulFp8(const Fp8Activations& q, const Tensor& w, Tensor* y,
                                    cudaStream_t stream, const Tensor& workspace, Tensor* scratch) {
  const int64_t m = q.rows, m_pad = q.padded_rows, k = w.row_size(), n = w.rows();
  Tensor out = *y;
  if (m_pad != m) {
    DXS_ASSIGN_OR_RETURN(*scratch, Allocate({m_pad, n}, y->dtype()));
    out = *scratch;
  }
  {
    absl::MutexLock lock(&fp8_mu_);
    const void* a_scales = w.block_scales()->raw();
    const void* b_scales = q.scales.raw();
    DXS_ASSIGN_OR_RETURN(Fp8GemmPlan * plan, Fp8Plan(m_pad, n, k, y->dtype(), a_scales, b_scales));
    const CublasLtApi& lt = *lt_;
    DXS_RETURN_IF_ERROR(CublasStatus(
        *blas_,
        lt.desc_set(plan->desc, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &a_scales, sizeof(a_scales)),
        "linear (fp8): weight scales"));
    DXS_RETURN_IF_ERROR(CublasStatus(
        *blas_,
        lt.desc_set(plan->desc, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &b_scales, sizeof(b_scales)),
        "linear (fp8): activation scales"));
    const float alpha = 1.f, beta = 0.f;
    DXS_RETURN_IF_ERROR(
        CublasStatus(*blas_,
                     lt.matmul(lt_handle_, plan->desc, &alpha, w.raw(), plan->a, q.values.raw(),
                               plan->b, &beta, out.raw(), plan->d, out.raw(), plan->d, &plan->algo,
                               workspace.raw(), workspace.num_bytes(), stream),
                     "linear (fp8 gemm)"));
  }
  if (m_pad == m) return absl::OkStatus();
  return CudaStatus(
      cudaMemcpyAsync(y->raw(), out.raw(), y->num_bytes(), cudaMemcpyDeviceToDevice, stream),
      "linear (fp8): result");
}

}  // namespace dxs
