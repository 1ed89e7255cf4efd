// The CUTLASS 3 SM90 grouped GEMM behind LaunchGroupedGemmBf16 (grouped_gemm.cuh), as a
// template that each grouped_gemm_sm90_*.cu instantiates exactly once (CUTLASS TUs are slow
// and memory-hungry to compile; one kernel per TU keeps them parallel and cached apart).
// Compiled for sm_90a only (wgmma, TMA and on-device TMA descriptor updates need it).
//
// Per expert e (a "group"): D_e[M_e, n] = A_e[M_e, k] * B_e[n, k]^T, M_e = off[e+1] - off[e],
// where A_e and D_e are row blocks of A and C. In CUTLASS terms: A RowMajor (M x K, K
// contiguous), B ColumnMajor (K x N with K contiguous: exactly B_e [n, k] row-major), D
// RowMajor, no C operand (void: beta is 0 and nothing is loaded), alpha 1.
//
// The kernel takes per-group device arrays: problem shapes (M, N, K), A/B/D pointers and
// A/B/D strides. BuildGroupsKernel writes them from expert_offsets into the front of the
// workspace; CUTLASS's own workspace (TMA descriptors, per SM) follows. The host passes no
// problem shapes (problem_shapes_host = nullptr): CUTLASS then launches one persistent CTA
// per SM and the group scheduler reads the shapes on the device. It skips groups with
// M = 0 (zero tiles), so empty experts need no compaction and their null B is never read.
// Its host-side alignment checks need host shapes too; grouped_gemm.cc does them instead.
//
// Workspace layout, each array rounded up to kWorkspaceAlignment:
//   shapes[E] | ptr_a[E] | ptr_d[E] | stride_a[E] | stride_b[E] | stride_d[E] | CUTLASS
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/epilogue/fusion/operations.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/dispatch_policy.hpp"
#include "cutlass/gemm/group_array_problem_shape.hpp"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "kernels/cuda/grouped_gemm_sm90.h"

#if defined(CUTLASS_ARCH_MMA_SM90_SUPPORTED) && \
    defined(CUTLASS_ARCH_MMA_MODIFIABLE_TMA_SM90_SUPPORTED)
#define DXS_GROUPED_GEMM_SM90 1
#endif

namespace dxs::cuda::grouped_gemm {

#if defined(DXS_GROUPED_GEMM_SM90)

// A CUTLASS kernel configuration: ElementD is the C dtype (cutlass::bfloat16_t or float).
// Tile and cluster shapes and schedules: see the two configurations below.
template <class ElementD_, class TileShape_, class ClusterShape_, class KernelSchedule_,
          class EpilogueSchedule_>
struct Sm90GroupedGemm {
  using ElementA = cutlass::bfloat16_t;
  using ElementB = cutlass::bfloat16_t;
  using ElementD = ElementD_;
  using ElementAccumulator = float;
  using LayoutA = cutlass::layout::RowMajor;
  using LayoutB = cutlass::layout::ColumnMajor;
  using LayoutD = cutlass::layout::RowMajor;
  // TMA moves 16-byte rows.
  static constexpr int kAlignmentA = 16 / sizeof(ElementA);
  static constexpr int kAlignmentB = 16 / sizeof(ElementB);
  static constexpr int kAlignmentD = 16 / sizeof(ElementD);
  using ProblemShape = cutlass::gemm::GroupProblemShape<cute::Shape<int, int, int>>;

  using CollectiveEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape_, ClusterShape_,
      cutlass::epilogue::collective::EpilogueTileAuto, ElementAccumulator, ElementAccumulator, void,
      LayoutD*, kAlignmentD,  // no C operand
      ElementD, LayoutD*, kAlignmentD, EpilogueSchedule_,
      cutlass::epilogue::fusion::LinearCombination<ElementD, ElementAccumulator>>::CollectiveOp;

  using CollectiveMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, ElementA, LayoutA*, kAlignmentA,
      ElementB, LayoutB*, kAlignmentB, ElementAccumulator, TileShape_, ClusterShape_,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(
          sizeof(typename CollectiveEpilogue::SharedStorage))>,
      KernelSchedule_>::CollectiveOp;

  using GemmKernel =
      cutlass::gemm::kernel::GemmUniversal<ProblemShape, CollectiveMainloop, CollectiveEpilogue>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<GemmKernel>;

  using Shape = typename ProblemShape::UnderlyingProblemShape;
  using StrideA = typename GemmKernel::InternalStrideA;
  using StrideB = typename GemmKernel::InternalStrideB;
  using StrideD = typename GemmKernel::InternalStrideD;
};

// Large-M configuration: 128x128x64 tiles, cooperative (both consumer warpgroups on one
// tile, 64 rows each), cluster 1x1; chosen when the batch averages 65 to 128 rows an
// expert (short prefill; the wide configuration below takes over past that). Why:
// - Even then an expert's rows are few (Qwen3-30B-A3B: 128 experts, top-8: 16k routed rows
//   are ~128 an expert), and the group scheduler pads every group to whole clusters: a 2x1
//   cluster (B multicast) would add an empty M tile, a full K loop of zeros, to many
//   experts. 1x1 also needs no cluster launch.
// - 128x128 with two warpgroups is the cooperative kernel's smallest full-rate tile; at
//   M rows an expert the GEMM does ~M flop per weight byte against H200's ~200 (989 TFLOP/s
//   over 4.8 TB/s), so it turns compute-bound only where M tiles of 128 fill up.
// - BLK_N 128 gives n/128 = 12 (gate_up, n 1536) or 16 (down, n 2048) tiles an expert,
//   enough to fill 132 SMs from ~11 active experts; BLK_K 64 (128 bytes of bf16, the TMA
//   swizzle width) leaves room for 6 stages of 32 KiB in shared memory.
template <class ElementD>
using ConfigSm90Large = Sm90GroupedGemm<ElementD, cute::Shape<cute::_128, cute::_128, cute::_64>,
                                        cute::Shape<cute::_1, cute::_1, cute::_1>,
                                        cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperative,
                                        cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative>;

// Wide configuration, clustered: 128x256x64 tiles, cooperative, cluster 2x1x1 (the two M
// tiles of a cluster share each weight tile through TMA multicast), the shape
// torch._grouped_mm uses for large batches. Kept for measurements only
// (DXS_GROUPED_GEMM_TILES=wide): the group scheduler rounds each expert's M tiles up to the
// cluster's 2, and on an H200 it measured slower than ConfigSm90Wide1 (4096 tokens of the
// Qwen3-30B-A3B FFN: 796 against 727 us; 16384: 2463 against 2397 us).
template <class ElementD>
using ConfigSm90Wide = Sm90GroupedGemm<ElementD, cute::Shape<cute::_128, cute::_256, cute::_64>,
                                       cute::Shape<cute::_2, cute::_1, cute::_1>,
                                       cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperative,
                                       cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative>;

// Wide configuration: the same tiles without the cluster (no M-tile padding); chosen where
// the batch averages more than 128 rows an expert (large prefill). A 128x256 tile does
// twice the MMA work per A and B byte of 128x128 and halves the epilogue count.
template <class ElementD>
using ConfigSm90Wide1 = Sm90GroupedGemm<ElementD, cute::Shape<cute::_128, cute::_256, cute::_64>,
                                        cute::Shape<cute::_1, cute::_1, cute::_1>,
                                        cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperative,
                                        cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative>;

// Small-M (decode) configuration: 64x128x64 tiles, ping-pong (each consumer warpgroup owns
// a 64-row tile, and one's epilogue overlaps the other's mainloop), cluster 1x1; chosen up
// to 64 rows an expert on average. With a few rows an expert the GEMM only streams weights:
// 64-row tiles halve the padded MMA work and the A stage, which leaves room for more
// stages of weight loads in flight. (Swapping A and B, so that weights fill the 64-row
// side of wgmma and tokens a narrow N tile, would waste less still; not done yet.)
template <class ElementD>
using ConfigSm90Small = Sm90GroupedGemm<ElementD, cute::Shape<cute::_64, cute::_128, cute::_64>,
                                        cute::Shape<cute::_1, cute::_1, cute::_1>,
                                        cutlass::gemm::KernelPtrArrayTmaWarpSpecializedPingpong,
                                        cutlass::epilogue::PtrArrayTmaWarpSpecializedPingpong>;

inline size_t AlignUp(size_t bytes) {
  return (bytes + kWorkspaceAlignment - 1) / kWorkspaceAlignment * kWorkspaceAlignment;
}

// Where each per-group array lives in the workspace.
template <class Config>
struct GroupArrays {
  using ElementA = typename Config::ElementA;
  using ElementD = typename Config::ElementD;
  typename Config::Shape* shapes;
  const ElementA** ptr_a;
  ElementD** ptr_d;
  typename Config::StrideA* stride_a;
  typename Config::StrideB* stride_b;
  typename Config::StrideD* stride_d;
  size_t bytes;  // all of the above, aligned; CUTLASS's workspace starts here

  GroupArrays(void* workspace, int32_t num_experts) {
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
    stride_a = reinterpret_cast<typename Config::StrideA*>(take(sizeof(*stride_a)));
    stride_b = reinterpret_cast<typename Config::StrideB*>(take(sizeof(*stride_b)));
    stride_d = reinterpret_cast<typename Config::StrideD*>(take(sizeof(*stride_d)));
    bytes = offset;
  }
};

// One thread per expert: its problem shape, A and D row-block pointers and the (shared)
// strides. Offsets that make no sense, or rows without a weight, give M = 0: skipped.
template <class Config>
__global__ void BuildGroupsKernel(const typename Config::ElementA* a, const int32_t* offsets,
                                  const __nv_bfloat16* const* b_ptrs, int32_t num_experts,
                                  int32_t total_rows, int32_t n, int32_t k,
                                  typename Config::ElementD* d, GroupArrays<Config> groups) {
  const int32_t e = static_cast<int32_t>(blockIdx.x * blockDim.x + threadIdx.x);
  if (e >= num_experts) return;
  int32_t begin = offsets[e];
  const int32_t end = offsets[e + 1];
  const bool valid = 0 <= begin && begin <= end && end <= total_rows && b_ptrs[e] != nullptr;
  const int32_t rows = valid ? end - begin : 0;
  if (!valid) begin = 0;  // keeps the (unused) pointers inside the tensors
  groups.shapes[e] = cute::make_shape(rows, n, k);
  groups.ptr_a[e] = a + static_cast<int64_t>(begin) * k;
  groups.ptr_d[e] = d + static_cast<int64_t>(begin) * n;
  groups.stride_a[e] = cute::make_stride(static_cast<int64_t>(k), cute::Int<1>{}, cute::Int<0>{});
  groups.stride_b[e] = cute::make_stride(static_cast<int64_t>(k), cute::Int<1>{}, cute::Int<0>{});
  groups.stride_d[e] = cute::make_stride(static_cast<int64_t>(n), cute::Int<1>{}, cute::Int<0>{});
}

template <class Config>
typename Config::Gemm::Arguments MakeArguments(const GroupArrays<Config>& groups,
                                               const __nv_bfloat16* const* b_ptrs,
                                               int32_t num_experts, int device, int sm_count) {
  using ElementB = typename Config::ElementB;
  cutlass::KernelHardwareInfo hw_info;
  hw_info.device_id = device;
  hw_info.sm_count = sm_count;
  // Default fusion arguments: alpha 1, beta 0, no per-group scalars.
  typename Config::CollectiveEpilogue::FusionCallbacks::Arguments fusion{};
  // B_e pointers straight from the caller: __nv_bfloat16 and cutlass::bfloat16_t are both a
  // bare 16-bit pattern, and CUTLASS only reads the array (its type lacks the const).
  auto** ptr_b = reinterpret_cast<const ElementB**>(const_cast<const __nv_bfloat16**>(b_ptrs));
  return typename Config::Gemm::Arguments{
      cutlass::gemm::GemmUniversalMode::kGrouped,
      {num_experts, groups.shapes, /*host_problem_shapes=*/nullptr},
      {groups.ptr_a, groups.stride_a, ptr_b, groups.stride_b},
      {fusion, /*ptr_C=*/nullptr, /*dC=*/nullptr, groups.ptr_d, groups.stride_d},
      hw_info};
}

template <class Config>
size_t WorkspaceBytes(int32_t num_experts, int sm_count) {
  const GroupArrays<Config> groups(nullptr, num_experts);
  const auto args = MakeArguments<Config>(groups, nullptr, num_experts, 0, sm_count);
  return groups.bytes + AlignUp(Config::Gemm::get_workspace_size(args));
}

inline cudaError_t ToCudaError(cutlass::Status status) {
  const cudaError_t last = cudaGetLastError();
  if (status == cutlass::Status::kSuccess) return last;
  if (last != cudaSuccess) return last;
  return status == cutlass::Status::kErrorInvalidProblem ||
                 status == cutlass::Status::kErrorMisalignedOperand ||
                 status == cutlass::Status::kErrorWorkspaceNull
             ? cudaErrorInvalidValue
             : cudaErrorNotSupported;
}

template <class Config>
cudaError_t Run(const Problem& p) {
  const GroupArrays<Config> groups(p.workspace, p.num_experts);
  if (p.workspace_bytes < WorkspaceBytes<Config>(p.num_experts, p.sm_count)) {
    return cudaErrorInvalidValue;
  }
  constexpr int kThreads = 128;
  const int blocks = (p.num_experts + kThreads - 1) / kThreads;
  BuildGroupsKernel<Config><<<blocks, kThreads, 0, p.stream>>>(
      reinterpret_cast<const typename Config::ElementA*>(p.a), p.expert_offsets, p.b_ptrs,
      p.num_experts, p.total_rows, p.n, p.k, static_cast<typename Config::ElementD*>(p.c), groups);
  if (cudaError_t err = cudaGetLastError(); err != cudaSuccess) return err;

  const auto args = MakeArguments<Config>(groups, p.b_ptrs, p.num_experts, p.device, p.sm_count);
  typename Config::Gemm gemm;
  cutlass::Status status = gemm.can_implement(args);
  if (status != cutlass::Status::kSuccess) return ToCudaError(status);
  // Builds the kernel parameters (TMA descriptors on the host, no CUDA work) and sets the
  // kernel's dynamic shared memory limit; then the launch.
  status = gemm.initialize(args, static_cast<char*>(p.workspace) + groups.bytes, p.stream);
  if (status != cutlass::Status::kSuccess) return ToCudaError(status);
  return ToCudaError(gemm.run(p.stream));
}

template <class Config>
constexpr Sm90Kernel MakeSm90Kernel() {
  return {&WorkspaceBytes<Config>, &Run<Config>};
}

#else  // no SM90 CUTLASS kernels with this toolkit

inline size_t NoWorkspace(int32_t, int) { return 0; }
inline cudaError_t NotSupported(const Problem&) { return cudaErrorNotSupported; }
template <class Config>
constexpr Sm90Kernel MakeSm90Kernel() {
  return {&NoWorkspace, &NotSupported};
}
template <class ElementD>
struct ConfigSm90Large {};
template <class ElementD>
struct ConfigSm90Small {};
template <class ElementD>
struct ConfigSm90Wide {};
template <class ElementD>
struct ConfigSm90Wide1 {};

#endif  // DXS_GROUPED_GEMM_SM90

}  // namespace dxs::cuda::grouped_gemm
