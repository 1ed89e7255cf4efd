// cuBLAS, loaded when the first CUDA backend starts rather than linked.
//
// Why: libcublasLt carries about 92 KiB of static thread-local storage. Linked at load
// time, that much comes out of every thread's stack, and threads created with small
// stacks fail to start: civetweb's (the metrics server's) 100 KiB worker threads did, in
// every binary with the CUDA backend, even with --device cpu. Loaded with dlopen, its TLS
// is allocated per thread on first use instead, and binaries that never ask for a GPU
// never load cuBLAS at all.
#pragma once

#include <cublasLt.h>
#include <cublas_v2.h>

#include "absl/status/statusor.h"

namespace dxs {

struct CublasApi {
  decltype(&cublasCreate) create = nullptr;
  decltype(&cublasDestroy) destroy = nullptr;
  decltype(&cublasSetStream) set_stream = nullptr;
  decltype(&cublasSetWorkspace) set_workspace = nullptr;
  decltype(&cublasSetMathMode) set_math_mode = nullptr;
  // cublasGemmEx (C++ overloads it, so its type is spelled out).
  cublasStatus_t (*gemm_ex)(cublasHandle_t, cublasOperation_t, cublasOperation_t, int, int, int,
                            const void*, const void*, cudaDataType, int, const void*, cudaDataType,
                            int, const void*, void*, cudaDataType, int, cublasComputeType_t,
                            cublasGemmAlgo_t) = nullptr;
  decltype(&cublasGetStatusName) status_name = nullptr;
  decltype(&cublasGetStatusString) status_string = nullptr;
  // cublasGemmGroupedBatchedEx (cuBLAS 12.5 and later; spelled out so that older headers
  // compile too). Optional: null when the loaded library lacks it, and LoadCublas does not
  // fail for that. Only the grouped GEMM's cross-check test
  // (tests/kernels/cuda/grouped_gemm_cuda_test.cc) calls it: the problem sizes are host
  // arrays, which the serving path does not have without a synchronisation.
  cublasStatus_t (*gemm_grouped_batched_ex)(cublasHandle_t, const cublasOperation_t[],
                                            const cublasOperation_t[], const int[], const int[],
                                            const int[], const void*, const void* const[],
                                            cudaDataType_t, const int[], const void* const[],
                                            cudaDataType_t, const int[], const void*, void* const[],
                                            cudaDataType_t, const int[], int, const int[],
                                            cublasComputeType_t) = nullptr;
};

// cuBLASLt, for the FP8 GEMMs with block scales (kernels/cuda/fp8_linear.cc): cuBLAS's
// own GemmEx has no per-block scales.
struct CublasLtApi {
  decltype(&cublasLtCreate) create = nullptr;
  decltype(&cublasLtDestroy) destroy = nullptr;
  decltype(&cublasLtMatmulDescCreate) desc_create = nullptr;
  decltype(&cublasLtMatmulDescDestroy) desc_destroy = nullptr;
  decltype(&cublasLtMatmulDescSetAttribute) desc_set = nullptr;
  decltype(&cublasLtMatrixLayoutCreate) layout_create = nullptr;
  decltype(&cublasLtMatrixLayoutDestroy) layout_destroy = nullptr;
  decltype(&cublasLtMatrixLayoutSetAttribute) layout_set = nullptr;
  decltype(&cublasLtMatmulPreferenceCreate) pref_create = nullptr;
  decltype(&cublasLtMatmulPreferenceDestroy) pref_destroy = nullptr;
  decltype(&cublasLtMatmulPreferenceSetAttribute) pref_set = nullptr;
  decltype(&cublasLtMatmulAlgoGetHeuristic) heuristic = nullptr;
  decltype(&cublasLtMatmul) matmul = nullptr;
  decltype(&cublasLtGetVersion) version = nullptr;
};

// The process's cuBLAS (libcublas.so.<major of the toolkit built against>), loaded once;
// FAILED_PRECONDITION naming the library when it cannot be loaded or lacks a required
// symbol (every member but gemm_grouped_batched_ex, which may be null).
absl::StatusOr<const CublasApi*> LoadCublas();
// The same for cuBLASLt (libcublasLt.so.<major>), every member required.
absl::StatusOr<const CublasLtApi*> LoadCublasLt();

}  // namespace dxs
