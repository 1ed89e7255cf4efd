// The FP8 grouped expert GEMM with block scales behind LaunchGroupedGemmFp8 (grouped_gemm.cuh):
// CUTLASS 3's SM90 pointer-array grouped GEMM with its FP8 blockwise-scaling mainloop
// (KernelPtrArrayTmaWarpSpecializedCooperativeFP8Blockwise: each 128-deep K block's wgmma
// sums are scaled and promoted into float32 accumulators, DeepSeek-V3's recipe). As
// grouped_gemm_sm90.cuh, a template that each grouped_gemm_fp8_sm90_*.cu instantiates once,
// built for sm_90a only.
//
// Per expert e: D_e[M_e, n] = sum over K blocks b of sfa_e[m, b] * sfb_e[b, j / 128] *
// (A_e[m, b] . B_e[j, b]), A_e the rows [off[e], off[e + 1]) of A, e4m3, K-major; B_e expert e's
// weight [n, k] e4m3 (ColumnMajor K x N, as the bf16 kernel's). Scales: A's one per row and
// 128 columns (ScaleGranularityM 1), each expert's block M-major (scale (m, b) at
// sfa + off[e] * k / 128 + b * M_e + m); B's one per 128x128 block, N-major
// ((b, j / 128) at sfb_e + b * n / 128 + j / 128). The per-group shapes, pointers, strides and
// scale layouts are built on the device from expert_offsets (BuildFp8GroupsKernel), so the
// host passes no problem shapes and nothing synchronises; experts without rows are groups of
// M = 0, never visited.
//
// Workspace layout, each array rounded up to kWorkspaceAlignment:
//   shapes | ptr_a | ptr_d | ptr_sfa | layout_sfa | layout_sfb | stride_a | stride_b |
//   stride_d | CUTLASS
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/detail/blockwise_scale_layout.hpp"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/epilogue/fusion/operations.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/dispatch_policy.hpp"
#include "cutlass/gemm/group_array_problem_shape.hpp"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "kernels/cuda/grouped_gemm_fp8_sm90.h"
#include "kernels/cuda/grouped_gemm_sm90.cuh"  // AlignUp, ToCudaError

namespace dxs::cuda::grouped_gemm {

#if defined(DXS_GROUPED_GEMM_SM90)

// The tile configurations (K is always 128: 128 e4m3 are the 128-byte TMA swizzle and one
// scale block). The bf16 kernels' wide 128x256 tiles do not build here: this CUTLASS's
// blockwise mainloop wants one B scale per N tile (fp8_accumulation.hpp: "Accumulator and
// scaleB must have same shape").
// - Fp8Coop: 128x128 cooperative (the two consumer warpgroups split a tile's rows), 1x1
//   clusters (no M-tile padding of small experts, as the bf16 kernels): the default.
// - Fp8CoopPairN: the same in 1x2 clusters, two CTAs on neighbouring N tiles of one expert
//   sharing its A tile by TMA multicast (n is a whole number of 256-column pairs for the
//   gate_up and down shapes of Qwen3-MoE).
// - Fp8Pingpong: 64x128 ping-pong: each consumer warpgroup owns a whole tile and the two take
//   turns on the tensor cores, so one's per-K-block promotion (the scaled add into the f32
//   accumulators) overlaps the other's MMAs.
struct Fp8Coop {
  using TileShape = cute::Shape<cute::_128, cute::_128, cute::_128>;
  using ClusterShape = cute::Shape<cute::_1, cute::_1, cute::_1>;
  using Mainloop = cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperativeFP8Blockwise;
  using Epilogue = cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative;
};
struct Fp8CoopPairN : Fp8Coop {
  using ClusterShape = cute::Shape<cute::_1, cute::_2, cute::_1>;
};
struct Fp8Pingpong {
  using TileShape = cute::Shape<cute::_64, cute::_128, cute::_128>;
  using ClusterShape = cute::Shape<cute::_1, cute::_1, cute::_1>;
  using Mainloop = cutlass::gemm::KernelPtrArrayTmaWarpSpecializedPingpongFP8Blockwise;
  using Epilogue = cutlass::epilogue::PtrArrayTmaWarpSpecializedPingpong;
};

template <class ElementD_, class Tiles = Fp8Coop>
struct Sm90Fp8GroupedGemm {
  using ElementA = cutlass::float_e4m3_t;
  using ElementB = cutlass::float_e4m3_t;
  using ElementD = ElementD_;
  using ElementAccumulator = float;
  using LayoutA = cutlass::layout::RowMajor;
  using LayoutB = cutlass::layout::ColumnMajor;
  using LayoutD = cutlass::layout::RowMajor;
  static constexpr int kAlignmentA = 16;
  static constexpr int kAlignmentB = 16;
  static constexpr int kAlignmentD = 16 / sizeof(ElementD);
  using TileShape = typename Tiles::TileShape;
  using ClusterShape = typename Tiles::ClusterShape;
  using ScaleConfig = cutlass::detail::Sm90BlockwiseScaleConfig<1, 128, 128>;
  using LayoutSFA = decltype(ScaleConfig::deduce_layoutSFA());
  using LayoutSFB = decltype(ScaleConfig::deduce_layoutSFB());
  using ProblemShape = cutlass::gemm::GroupProblemShape<cute::Shape<int, int, int>>;

  using CollectiveEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
      cutlass::epilogue::collective::EpilogueTileAuto, ElementAccumulator, ElementAccumulator, void,
      LayoutD*, kAlignmentD,  // no C operand
      ElementD, LayoutD*, kAlignmentD, typename Tiles::Epilogue,
      cutlass::epilogue::fusion::LinearCombination<ElementD, ElementAccumulator>>::CollectiveOp;

  using CollectiveMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, ElementA,
      cute::tuple<LayoutA*, LayoutSFA*>, kAlignmentA, ElementB, cute::tuple<LayoutB*, LayoutSFB*>,
      kAlignmentB, ElementAccumulator, TileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(
          sizeof(typename CollectiveEpilogue::SharedStorage))>,
      typename Tiles::Mainloop>::CollectiveOp;

  using GemmKernel =
      cutlass::gemm::kernel::GemmUniversal<ProblemShape, CollectiveMainloop, CollectiveEpilogue>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<GemmKernel>;

  using Shape = typename ProblemShape::UnderlyingProblemShape;
  using StrideA = typename GemmKernel::InternalStrideA;
  using StrideB = typename GemmKernel::InternalStrideB;
  using StrideD = typename GemmKernel::InternalStrideD;
};

template <class Config>
struct Fp8GroupArrays {
  using ElementA = typename Config::ElementA;
  using ElementD = typename Config::ElementD;
  typename Config::Shape* shapes;
  const ElementA** ptr_a;
  ElementD** ptr_d;
  const float** ptr_sfa;
  typename Config::LayoutSFA* layout_sfa;
  typename Config::LayoutSFB* layout_sfb;
  typename Config::StrideA* stride_a;
  typename Config::StrideB* stride_b;
  typename Config::StrideD* stride_d;
  size_t bytes;

  Fp8GroupArrays(void* workspace, int32_t num_experts) {
    const size_t e = static_cast<size_t>(num_experts);
    char* base = static_cast<char*>(workspace);
    size_t offset = 0;
    auto take = [&](size_t each) {
      char* p = base == nullptr ? nullptr : base + offset;
      offset += AlignUp(each * e);
      return p;
    };
    shapes = reinterpret_cast<typename Config::Shape*>(take(sizeof(*shapes)));
    ptr_a = reinterpret_cast<const ElementA**>(take(sizeof(*ptr_a)));
    ptr_d = reinterpret_cast<ElementD**>(take(sizeof(*ptr_d)));
    ptr_sfa = reinterpret_cast<const float**>(take(sizeof(*ptr_sfa)));
    layout_sfa = reinterpret_cast<typename Config::LayoutSFA*>(take(sizeof(*layout_sfa)));
    layout_sfb = reinterpret_cast<typename Config::LayoutSFB*>(take(sizeof(*layout_sfb)));
    stride_a = reinterpret_cast<typename Config::StrideA*>(take(sizeof(*stride_a)));
    stride_b = reinterpret_cast<typename Config::StrideB*>(take(sizeof(*stride_b)));
    stride_d = reinterpret_cast<typename Config::StrideD*>(take(sizeof(*stride_d)));
    bytes = offset;
  }
};

// One thread per expert, as BuildGroupsKernel (grouped_gemm_sm90.cuh), plus the expert's
// block of A's scales and both scale layouts.
template <class Config>
__global__ void BuildFp8GroupsKernel(const typename Config::ElementA* a, const float* sfa,
                                     const int32_t* offsets, const void* const* b_ptrs,
                                     int32_t num_experts, int32_t total_rows, int32_t n, int32_t k,
                                     typename Config::ElementD* d, Fp8GroupArrays<Config> groups) {
  const int32_t e = static_cast<int32_t>(blockIdx.x * blockDim.x + threadIdx.x);
  if (e >= num_experts) return;
  int32_t begin = offsets[e];
  const int32_t end = offsets[e + 1];
  const bool valid = 0 <= begin && begin <= end && end <= total_rows && b_ptrs[e] != nullptr;
  const int32_t rows = valid ? end - begin : 0;
  if (!valid) begin = 0;
  groups.shapes[e] = cute::make_shape(rows, n, k);
  groups.ptr_a[e] = a + static_cast<int64_t>(begin) * k;
  groups.ptr_d[e] = d + static_cast<int64_t>(begin) * n;
  groups.ptr_sfa[e] = sfa + static_cast<int64_t>(begin) * (k / 128);
  groups.layout_sfa[e] =
      Config::ScaleConfig::tile_atom_to_shape_SFA(cute::make_shape(rows, n, k, 1));
  groups.layout_sfb[e] =
      Config::ScaleConfig::tile_atom_to_shape_SFB(cute::make_shape(rows, n, k, 1));
  groups.stride_a[e] = cute::make_stride(static_cast<int64_t>(k), cute::Int<1>{}, cute::Int<0>{});
  groups.stride_b[e] = cute::make_stride(static_cast<int64_t>(k), cute::Int<1>{}, cute::Int<0>{});
  groups.stride_d[e] = cute::make_stride(static_cast<int64_t>(n), cute::Int<1>{}, cute::Int<0>{});
}

template <class Config>
typename Config::Gemm::Arguments MakeFp8Arguments(const Fp8GroupArrays<Config>& groups,
                                                  const void* const* b_ptrs,
                                                  const float* const* sfb_ptrs, int32_t num_experts,
                                                  int device, int sm_count) {
  using ElementB = typename Config::ElementB;
  cutlass::KernelHardwareInfo hw_info;
  hw_info.device_id = device;
  hw_info.sm_count = sm_count;
  typename Config::CollectiveEpilogue::FusionCallbacks::Arguments fusion{};
  // The weight and scale tables straight from the caller (CUTLASS only reads them).
  auto** ptr_b = reinterpret_cast<const ElementB**>(const_cast<const void**>(b_ptrs));
  auto** ptr_sfb = const_cast<const float**>(sfb_ptrs);
  return typename Config::Gemm::Arguments{
      cutlass::gemm::GemmUniversalMode::kGrouped,
      {num_experts, groups.shapes, /*host_problem_shapes=*/nullptr},
      {groups.ptr_a, groups.stride_a, ptr_b, groups.stride_b, groups.ptr_sfa, groups.layout_sfa,
       ptr_sfb, groups.layout_sfb},
      {fusion, /*ptr_C=*/nullptr, /*dC=*/nullptr, groups.ptr_d, groups.stride_d},
      hw_info};
}

template <class Config>
size_t Fp8WorkspaceBytes(int32_t num_experts, int sm_count) {
  const Fp8GroupArrays<Config> groups(nullptr, num_experts);
  const auto args = MakeFp8Arguments<Config>(groups, nullptr, nullptr, num_experts, 0, sm_count);
  return groups.bytes + AlignUp(Config::Gemm::get_workspace_size(args));
}

template <class Config>
cudaError_t RunFp8(const Fp8Problem& p) {
  const Fp8GroupArrays<Config> groups(p.workspace, p.num_experts);
  if (p.workspace_bytes < Fp8WorkspaceBytes<Config>(p.num_experts, p.sm_count)) {
    return cudaErrorInvalidValue;
  }
  constexpr int kThreads = 128;
  const int blocks = (p.num_experts + kThreads - 1) / kThreads;
  BuildFp8GroupsKernel<Config><<<blocks, kThreads, 0, p.stream>>>(
      reinterpret_cast<const typename Config::ElementA*>(p.a), p.sfa, p.expert_offsets, p.b_ptrs,
      p.num_experts, p.total_rows, p.n, p.k, static_cast<typename Config::ElementD*>(p.c), groups);
  if (cudaError_t err = cudaGetLastError(); err != cudaSuccess) return err;
  const auto args =
      MakeFp8Arguments<Config>(groups, p.b_ptrs, p.sfb_ptrs, p.num_experts, p.device, p.sm_count);
  typename Config::Gemm gemm;
  cutlass::Status status = gemm.can_implement(args);
  if (status != cutlass::Status::kSuccess) return ToCudaError(status);
  status = gemm.initialize(args, static_cast<char*>(p.workspace) + groups.bytes, p.stream);
  if (status != cutlass::Status::kSuccess) return ToCudaError(status);
  return ToCudaError(gemm.run(p.stream));
}

template <class Config>
constexpr Sm90Fp8Kernel MakeSm90Fp8Kernel() {
  return {&Fp8WorkspaceBytes<Config>, &RunFp8<Config>};
}

#else  // no SM90 CUTLASS kernels with this toolkit

inline size_t NoFp8Workspace(int32_t, int) { return 0; }
inline cudaError_t Fp8NotSupported(const Fp8Problem&) { return cudaErrorNotSupported; }
struct Fp8Coop {};
struct Fp8CoopPairN {};
struct Fp8Pingpong {};
template <class ElementD, class Tiles = Fp8Coop>
struct Sm90Fp8GroupedGemm {};
template <class Config>
constexpr Sm90Fp8Kernel MakeSm90Fp8Kernel() {
  return {&NoFp8Workspace, &Fp8NotSupported};
}

#endif  // DXS_GROUPED_GEMM_SM90

}  // namespace dxs::cuda::grouped_gemm
