// Shared by the CUDA kernel tests: skipping cleanly without a GPU, and checking CUDA calls.
#pragma once

#include <cuda_runtime_api.h>

#include <string>

#include "gtest/gtest.h"

namespace dxs::testing {

// Empty when a CUDA device is usable; otherwise why not.
inline std::string NoDeviceReason() {
  int count = 0;
  const cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess) {
    return std::string("no usable CUDA device (cudaGetDeviceCount: ") + cudaGetErrorName(err) +
           ": " + cudaGetErrorString(err) + ")";
  }
  if (count == 0) return "no CUDA device (cudaGetDeviceCount returned 0)";
  return "";
}

}  // namespace dxs::testing

#define SKIP_WITHOUT_GPU()                                                        \
  do {                                                                            \
    if (std::string reason = ::dxs::testing::NoDeviceReason(); !reason.empty()) { \
      GTEST_SKIP() << "GPU case skipped: " << reason;                             \
    }                                                                             \
  } while (0)

#define ASSERT_CUDA_OK(expr)                                                           \
  do {                                                                                 \
    const cudaError_t dxs_err_ = (expr);                                               \
    ASSERT_EQ(dxs_err_, cudaSuccess) << #expr << ": " << cudaGetErrorString(dxs_err_); \
  } while (0)
