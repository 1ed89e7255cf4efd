// The grouped expert GEMM of the CUDA backend: raw launch API, free of absl (and of CUTLASS:
// only grouped_gemm_sm90_*.cu see CUTLASS), following the conventions of ops.cuh.
//
// Contract: for each expert e, rows [off[e], off[e + 1]) of A [total_rows, k] times B_e^T,
// where B_e is expert e's weight [n, k] (row-major, the layout of an nn.Linear weight), into
// the same rows of C [total_rows, n]. A and B are bf16; accumulation is fp32, rounded once
// into C (bf16 or f32). A "TN" GEMM per expert: both operands are K-major.
//
// Nothing here synchronises with the host. The host knows num_experts and total_rows only;
// the per-expert problem sizes, pointers and strides are built on the device from
// expert_offsets by a small kernel ahead of the GEMM, in the caller's workspace.
//
// NOTES:
// - The GEMM is CUTLASS 3's SM90 pointer-array grouped GEMM (TMA + wgmma, warp-specialised,
//   persistent: one CTA per SM walks the tiles of all experts). Up to 64 rows an expert on
//   average (decode) it uses 64x128 ping-pong tiles, up to 128 128x128 cooperative ones,
//   above that 128x256 cooperative ones (grouped_gemm_sm90.cuh says why). It runs on
//   sm_90 (Hopper) only; elsewhere, or in a build without CUTLASS (DXS_HAVE_CUTLASS=0),
//   the launch returns cudaErrorNotSupported after the host checks.
// - An expert with no rows is a group of M = 0: it has no tiles, so the persistent
//   scheduler never visits it and its null weight pointer is never read. It costs one
//   entry of the group scan, nothing else.
// - Data-dependent bad offsets (decreasing, or outside [0, total_rows]) and an expert with
//   rows but a null weight are skipped on the device: those rows of C are left as they were.
// - TMA needs 16-byte aligned rows and bases: k % 8 == 0, n % 8 == 0 (bf16 C) or n % 4 == 0
//   (f32 C), and a, c, the workspace and every b_ptrs[e] 16-byte aligned (cudaMalloc's 256
//   bytes are plenty). The host checks what it can see; b_ptrs live on the device.
// - Results are deterministic: every output element is one CTA's fixed-order K loop.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "kernels/cuda/ops.cuh"

namespace dxs::cuda {

// Scratch for LaunchGroupedGemmBf16 with these sizes on the current device: the per-expert
// arrays (52 bytes an expert) and CUTLASS's TMA descriptors (512 bytes an SM, so the size
// depends on the device). 0 for bad sizes, when CUTLASS is absent or no device answers.
size_t GroupedGemmWorkspaceBytes(int64_t num_experts, int64_t total_rows, int64_t n, int64_t k,
                                 ElemType c_type);

// The grouped GEMM above, enqueued on `stream` (two launches: the set-up kernel, then the
// GEMM); returns cudaGetLastError() after them. Zero total_rows returns cudaSuccess without
// touching CUDA (null pointers are fine then). Bad host arguments (negative sizes, k or n
// not a multiple of 8 (4 for f32 C), sizes past int32, c_type not bf16/f32, null or
// misaligned pointers, workspace smaller than GroupedGemmWorkspaceBytes) return
// cudaErrorInvalidValue without launching.
//   a:              device [total_rows, k] bf16, packed
//   expert_offsets: device i32 [num_experts + 1], off[0] == 0, off[num_experts] == total_rows
//   b_ptrs:         device [num_experts]: expert e's weight [n, k], null for experts with no
//                   rows
//   c:              device [total_rows, n] of c_type (kBF16 or kF32), packed
cudaError_t LaunchGroupedGemmBf16(const __nv_bfloat16* a, const int32_t* expert_offsets,
                                  const __nv_bfloat16* const* b_ptrs, int64_t num_experts,
                                  int64_t total_rows, int64_t n, int64_t k, void* c,
                                  ElemType c_type, void* workspace, size_t workspace_bytes,
                                  cudaStream_t stream);

// The FP8 grouped GEMM with block scales (grouped_gemm_fp8_sm90.cuh): the same contract with
// A e4m3 [total_rows, k] and its scales sfa (one per row and 128 columns; expert e's block
// M-major from sfa + off[e] * k / 128: scale (m, b) at b * M_e + m), and B_e e4m3 [n, k] with
// 128x128 block scales sfb_ptrs[e] (f32 [k / 128, n / 128], N-major). n and k multiples of
// 128. LaunchQuantizeGroupedFp8 and LaunchSiluMulQuantizeGroupedFp8 (ops.cuh) write A and sfa.
size_t GroupedGemmFp8WorkspaceBytes(int64_t num_experts, int64_t total_rows, int64_t n, int64_t k,
                                    ElemType c_type);
cudaError_t LaunchGroupedGemmFp8(const uint8_t* a, const float* sfa, const int32_t* expert_offsets,
                                 const void* const* b_ptrs, const float* const* sfb_ptrs,
                                 int64_t num_experts, int64_t total_rows, int64_t n, int64_t k,
                                 void* c, ElemType c_type, void* workspace, size_t workspace_bytes,
                                 cudaStream_t stream);

}  // namespace dxs::cuda
