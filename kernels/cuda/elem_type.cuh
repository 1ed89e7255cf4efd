// Element access shared by the CUDA kernels: f32/f16/bf16 widened to and rounded from f32,
// plain copies of equal types (the index types included), and the host-side dispatch from
// an ElemType to the C++ type a kernel template is instantiated with. CUDA headers only.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "kernels/cuda/aligned.h"
#include "kernels/cuda/ops.cuh"

namespace dxs::cuda {

inline bool IsFloating(ElemType t) {
  return t == ElemType::kF32 || t == ElemType::kF16 || t == ElemType::kBF16;
}

inline bool IsKnown(ElemType t) {
  return IsFloating(t) || t == ElemType::kI32 || t == ElemType::kI64;
}

// Bytes per element (0 for a value outside the enum).
inline size_t ElemSize(ElemType t) {
  switch (t) {
    case ElemType::kF32:
    case ElemType::kI32:
      return 4;
    case ElemType::kF16:
    case ElemType::kBF16:
      return 2;
    case ElemType::kI64:
      return 8;
  }
  return 0;
}

__device__ __forceinline__ float ToFloat(float v) { return v; }
__device__ __forceinline__ float ToFloat(__half v) { return __half2float(v); }
__device__ __forceinline__ float ToFloat(__nv_bfloat16 v) { return __bfloat162float(v); }

// Rounds to nearest even; index types truncate toward zero (saturating; NaN gives 0).
template <typename T>
__device__ __forceinline__ T FromFloat(float v);
template <>
__device__ __forceinline__ float FromFloat<float>(float v) {
  return v;
}
template <>
__device__ __forceinline__ __half FromFloat<__half>(float v) {
  return __float2half_rn(v);
}
template <>
__device__ __forceinline__ __nv_bfloat16 FromFloat<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);
}
template <>
__device__ __forceinline__ int32_t FromFloat<int32_t>(float v) {
  return static_cast<int32_t>(v);
}
template <>
__device__ __forceinline__ int64_t FromFloat<int64_t>(float v) {
  return static_cast<int64_t>(v);
}

// One element from Src to Dst: as is for equal types, through f32 between floating types.
template <typename Src, typename Dst>
__device__ __forceinline__ Dst ConvertElem(Src v) {
  if constexpr (std::is_same_v<Src, Dst>) {
    return v;
  } else {
    return FromFloat<Dst>(ToFloat(v));
  }
}

// Element i of a floating array whose type is known only at run time (for per-block loads
// outside inner loops; the switch is uniform across the grid).
__device__ __forceinline__ float LoadAsFloat(const void* p, ElemType t, int64_t i) {
  switch (t) {
    case ElemType::kF32:
      return static_cast<const float*>(p)[i];
    case ElemType::kF16:
      return __half2float(static_cast<const __half*>(p)[i]);
    default:
      return __bfloat162float(static_cast<const __nv_bfloat16*>(p)[i]);
  }
}

__device__ __forceinline__ void StoreFromFloat(void* p, ElemType t, int64_t i, float v) {
  switch (t) {
    case ElemType::kF32:
      static_cast<float*>(p)[i] = v;
      break;
    case ElemType::kF16:
      static_cast<__half*>(p)[i] = __float2half_rn(v);
      break;
    default:
      static_cast<__nv_bfloat16*>(p)[i] = __float2bfloat16_rn(v);
      break;
  }
}

template <typename T>
struct TypeTag {
  using type = T;
};

// Calls f(TypeTag<T>{}) with T the C++ type of floating `t`; cudaErrorInvalidValue for any
// other type.
template <typename F>
cudaError_t DispatchFloat(ElemType t, F&& f) {
  switch (t) {
    case ElemType::kF32:
      return f(TypeTag<float>{});
    case ElemType::kF16:
      return f(TypeTag<__half>{});
    case ElemType::kBF16:
      return f(TypeTag<__nv_bfloat16>{});
    default:
      return cudaErrorInvalidValue;
  }
}

// Calls f(TypeTag<Src>{}, TypeTag<Dst>{}) for the moves the API allows: between floating
// types, or between equal index types. cudaErrorInvalidValue for other mixes.
template <typename F>
cudaError_t DispatchConversion(ElemType src, ElemType dst, F&& f) {
  if (src == dst && src == ElemType::kI32) return f(TypeTag<int32_t>{}, TypeTag<int32_t>{});
  if (src == dst && src == ElemType::kI64) return f(TypeTag<int64_t>{}, TypeTag<int64_t>{});
  if (!IsFloating(src) || !IsFloating(dst)) return cudaErrorInvalidValue;
  return DispatchFloat(src,
                       [&](auto s) { return DispatchFloat(dst, [&](auto d) { return f(s, d); }); });
}

// Grid sizing for grid-stride loops: enough blocks to fill any current GPU several times
// over, few enough that each thread does some work when `work` is large.
inline constexpr int64_t kMaxGridBlocks = 65535;

inline unsigned GridBlocks(int64_t work, int64_t per_block) {
  const int64_t blocks = (work + per_block - 1) / per_block;
  return static_cast<unsigned>(blocks < kMaxGridBlocks ? blocks : kMaxGridBlocks);
}

}  // namespace dxs::cuda
