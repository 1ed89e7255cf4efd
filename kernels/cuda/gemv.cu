// Weight-streaming kernels for decode-sized batches, where a GEMM library's tiles sit mostly
// idle: a matrix-vector product reads each bf16 weight once, 16 bytes a lane, and the few
// activation rows ride along in registers.
//
// - LaunchGemvBf16: y[m, n] = x[m, :] . w[n, :] for up to kGemvMaxRows rows of x (the dense
//   projections of a decode step: q, k, v, o, the router, lm_head). A warp owns kFeatures
//   output features; each lane walks k in 8-element (16-byte) chunks, 256 elements a warp
//   per turn, so the loads of a row are coalesced; the lane sums are reduced by a fixed
//   xor-shuffle tree, so results are deterministic. A short, wide launch splits k over up
//   to kWarps warps a feature group (GemvKSplit), their sums meeting in shared memory in
//   warp order; each warp requests its first weight slices before PdlWait (launch.cuh).
// - LaunchMoeSwiGluGemv: the grouped SwiGLU FFN of few routed pairs (decode), in two
//   kernels instead of a gather, two grouped GEMMs and the SiLU pass:
//     act[p, i] = silu(gate_e[i] . x[rows[p]]) * (up_e[i] . x[rows[p]])   (bf16, as the GEMM
//                 path rounds gate and up to bf16, then silu(g) * u to bf16),
//     y[p, n]   = down_e[n] . act[p]
//   for the pairs sorted by expert (expert_offsets). A block is a (pair, feature tile); the
//   block of a run's first pair computes the whole run (kRunPairs pairs per pass over the
//   weights), the others exit, so each held expert's weights are read once per pass. Pairs
//   of an expert without weights (a null pointer) get zeros.
// - LaunchRoutedSwiGluGemv: the same FFN for one or two tokens straight from the top-k ids
//   (Backend::RoutedSwiGlu): gate_up reads each pair's expert itself (no sort), and the
//   down kernel adds a token's pairs, weighted, in ascending expert order into the output
//   (the sorted path's ScaleSumRows, bit for bit).
//
// Both take bf16 experts, or block-scaled FP8 ones (e4m3 weights and their 128 x 128 block
// scales, N-major as CudaBackend::ExpertWeights keeps them): a lane's 16 bytes are then 16
// values, widened and scaled in registers (ExpertChunk). The activations stay bf16
// (no quantization on that side, as in the dense FP8 GEMV: a decode step is bound by the
// weights' bytes), and the roundings are the bf16 kernels'. A decode step's experts then
// stream half the bytes, with no quantization pass and no GEMM tiles sitting mostly idle.
//
// Both need k % 8 == 0 (FP8: hidden and inter whole 128-blocks) and 16-byte aligned rows;
// the backend checks and otherwise uses the GEMM path.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <type_traits>

#include "kernels/cuda/elem_type.cuh"
#include "kernels/cuda/gemv_lanes.cuh"
#include "kernels/cuda/launch.cuh"
#include "kernels/cuda/ops.cuh"
#include "kernels/routed_sum_order.h"

namespace dxs::cuda {
namespace {

constexpr int kWarps = 4;                             // warps a block
constexpr int kFeatures = gemv_lanes::kGemvFeatures;  // output features a warp
using gemv_lanes::Dot8;
using gemv_lanes::kChunk;
using gemv_lanes::LoadRow8;
using gemv_lanes::LoadWeights8;
using gemv_lanes::LoadWeightsRaw;
using gemv_lanes::WarpSum;
// Pairs of one expert computed per pass over its weights: 4, or 1 for the smallest batches
// (a token's top-k experts are distinct, so runs are single pairs there, and the kernels'
// registers then fit a whole grid in one wave).
constexpr int kRunPairs = 4;
constexpr int64_t kSinglePairRunsUpTo = 16;  // pairs

// A routed expert's weights as the MoE kernels read them: bf16 [n, k], or (kFp8) e4m3 [n, k]
// with one float32 scale per 128 x 128 block, N-major ([k / 128, n / 128]: the table
// CudaBackend::ExpertWeights builds for the FP8 grouped GEMM, read here too).
constexpr int kFp8WeightBlock = 128;

// kN (8 or 16) activations as float.
template <int kN, typename T>
__device__ __forceinline__ void LoadRow(const T* p, float out[kN]) {
#pragma unroll
  for (int h = 0; h < kN / kChunk; ++h) LoadRow8(p + h * kChunk, out + h * kChunk);
}

// The elements a lane loads at once from an expert's weights: 16 bytes, 8 bf16 or 16 e4m3.
template <bool kFp8>
inline constexpr int kExpertChunk = kFp8 ? 16 : kChunk;

// A lane's chunk of an expert weight row: row `row`, elements [c, c + kExpertChunk). bf16
// chunks are widened when loaded (LoadWeights8) and dotted as Dot8; FP8 chunks stay as their
// 16 bytes and block scale until the dot, which widens them (two at a time) and scales the
// sum once, so a lane holds 5 registers a chunk rather than 16 and the kernels keep the
// bf16 kernels' occupancy. The bytes stream as the bf16 ones do (LoadWeightsRaw).
template <bool kFp8>
struct ExpertChunk;

template <>
struct ExpertChunk<false> {
  float v[kChunk];
  __device__ __forceinline__ void Load(const void* w, const float*, int, int row, int k, int c) {
    LoadWeights8(static_cast<const __nv_bfloat16*>(w) + static_cast<int64_t>(row) * k + c, v);
  }
  __device__ __forceinline__ float Dot(const float x[kChunk]) const { return Dot8(v, x); }
};

template <>
struct ExpertChunk<true> {
  uint4 raw;
  float scale;
  __device__ __forceinline__ void Load(const void* w, const float* scales, int n_blocks, int row,
                                       int k, int c) {
    // Reinterpreted as bf16 only to reuse LoadWeightsRaw's 16-byte streaming load.
    raw = LoadWeightsRaw(reinterpret_cast<const __nv_bfloat16*>(static_cast<const uint8_t*>(w) +
                                                                static_cast<int64_t>(row) * k + c));
    scale = __ldg(scales + (c / kFp8WeightBlock) * n_blocks + row / kFp8WeightBlock);
  }
  __device__ __forceinline__ float Dot(const float x[16]) const {
    const __nv_fp8x2_storage_t* pairs = reinterpret_cast<const __nv_fp8x2_storage_t*>(&raw);
    float s = 0.f;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const float2 f = __half22float2(__half2(__nv_cvt_fp8x2_to_halfraw2(pairs[i], __NV_E4M3)));
      s = fmaf(f.x, x[2 * i], s);
      s = fmaf(f.y, x[2 * i + 1], s);
    }
    return s * scale;
  }
};

// ---- dense ----

// The weights of one launch (LaunchGemvBf16's one, or LaunchGemvsBf16's several sharing x):
// blocks [first_block[o], first_block[o + 1]) compute output o.
struct GemvOutputs {
  const __nv_bfloat16* w[kGemvMaxOutputs];
  void* y[kGemvMaxOutputs];
  int n[kGemvMaxOutputs];
  int first_block[kGemvMaxOutputs + 1];
  int count;
};

template <typename TX, typename TY, int M, int kEarly>
__global__ void __launch_bounds__(kWarps * 32)
    GemvKernel(const TX* __restrict__ x, int m, const GemvOutputs outs, int k, int ksplit) {
  static_assert(kGemvMaxOutputs == 3, "the selection below names each output");
  // Selected with constant indices: a runtime index would copy the parameters to the stack.
  const int block = static_cast<int>(blockIdx.x);
  const int o = block >= outs.first_block[2] && outs.count > 2   ? 2
                : block >= outs.first_block[1] && outs.count > 1 ? 1
                                                                 : 0;
  const __nv_bfloat16* __restrict__ w = o == 0 ? outs.w[0] : o == 1 ? outs.w[1] : outs.w[2];
  TY* __restrict__ y = static_cast<TY*>(o == 0 ? outs.y[0] : o == 1 ? outs.y[1] : outs.y[2]);
  const int n = o == 0 ? outs.n[0] : o == 1 ? outs.n[1] : outs.n[2];
  const int first = o == 0   ? outs.first_block[0]
                    : o == 1 ? outs.first_block[1]
                             : outs.first_block[2];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  // ksplit warps share a feature group, each taking every ksplit-th 256-element slice of k;
  // their sums meet in shared memory in warp order (deterministic).
  const int sub = warp % ksplit;
  const int feature0 = ((block - first) * (kWarps / ksplit) + warp / ksplit) * kFeatures;
  const bool active = feature0 < n;
  const int c0 = (sub * 32 + lane) * kChunk, stride = ksplit * 32 * kChunk;
  int64_t row[kFeatures];
#pragma unroll
  for (int f = 0; f < kFeatures; ++f) {
    row[f] = static_cast<int64_t>(min(feature0 + f, n - 1)) * k;  // a tail repeats its last row
  }
  // pdl-early: the weights are the model's, never written by a kernel, so the first kEarly
  // slices are requested before waiting for the previous kernel (PdlWait) and stream while
  // it finishes. Nothing else is read or written before the wait.
  uint4 early[kEarly][kFeatures];
#pragma unroll
  for (int i = 0; i < kEarly; ++i) {
#pragma unroll
    for (int f = 0; f < kFeatures; ++f) {
      if (active && c0 + i * stride < k) early[i][f] = LoadWeightsRaw(w + row[f] + c0 + i * stride);
    }
  }
  PdlWait();
  float acc[kFeatures][M];
#pragma unroll
  for (int f = 0; f < kFeatures; ++f) {
#pragma unroll
    for (int r = 0; r < M; ++r) acc[f][r] = 0.f;
  }
  if (active) {
    gemv_lanes::StreamFeaturePair<M, kEarly>(
        w, row, early, c0, stride, k, m,
        [&](int r, int c, float(&xv)[kChunk]) {
          LoadRow8(x + static_cast<int64_t>(r) * k + c, xv);
        },
        acc);
  }
  __shared__ float partial[kWarps][kFeatures][M];
#pragma unroll
  for (int f = 0; f < kFeatures; ++f) {
#pragma unroll
    for (int r = 0; r < M; ++r) {
      const float s = WarpSum(acc[f][r]);
      if (lane == 0) partial[warp][f][r] = s;
    }
  }
  if (ksplit > 1) __syncthreads();
  if (!active || sub != 0 || lane >= kFeatures * M) return;
  const int f = lane / M, r = lane % M;
  if (r >= m || feature0 + f >= n) return;
  float s = partial[warp][f][r];
  for (int j = 1; j < ksplit; ++j) s += partial[warp + j][f][r];
  y[static_cast<int64_t>(r) * n + feature0 + f] = FromFloat<TY>(s);
}

// ---- the grouped SwiGLU of few pairs ----

// The expert of sorted pair p: the largest e with offsets[e] <= p, i.e. the number of
// e in [0, E) with offsets[e] <= p, less one (offsets ascend). Each lane counts a slice of
// the offsets with independent loads and the warp adds the counts, so a block waits for
// one round of loads, not for a binary search's chain of them.
__device__ __forceinline__ int ExpertOfPair(const int32_t* offsets, int num_experts, int p) {
  const int lane = threadIdx.x % 32;
  int count = 0;
  for (int e = lane; e < num_experts; e += 32) count += __ldg(offsets + e) <= p ? 1 : 0;
  return max(__reduce_add_sync(0xffffffffu, count) - 1, 0);
}

__device__ __forceinline__ float RoundBf16(float v) {
  return __bfloat162float(__float2bfloat16_rn(v));
}

// An MoE layer's expert weight tables (a pointer per expert, and its FP8 scales' pointer) in
// shared memory, copied before the kernel's PdlWait: the tables are immutable (CudaBackend
// builds them by a copy when the weights load), and once a block knows its expert the pointer
// is then a shared load, not a global one that the step's weight stream has evicted from L2
// since the previous step (an HBM round trip before the weights' own). With the norms' early
// weights (row_norm.cuh, dense_ops.cu's rope): batch 1 +2.1% bf16, +3.2% FP8 (H100,
// docs/results/fp8.md). Up to kStagedExperts experts; larger tables are read from global memory.
constexpr int kStagedExperts = 256;

template <bool kFp8>
struct StagedExperts {
  const void* w[kStagedExperts];
  const float* scales[kFp8 ? kStagedExperts : 1];

  static __device__ __forceinline__ bool Fits(int num_experts) {
    return num_experts <= kStagedExperts;
  }
  // The whole block calls it before PdlWait(), then __syncthreads() after the wait.
  __device__ __forceinline__ void Stage(const void* const* table, const float* const* scale_table,
                                        int num_experts) {
    if (!Fits(num_experts)) return;
    for (int i = threadIdx.x; i < num_experts; i += blockDim.x) {
      w[i] = table[i];
      if constexpr (kFp8) scales[i] = scale_table[i];
    }
  }
  __device__ __forceinline__ const void* Weights(const void* const* table, int num_experts,
                                                 int e) const {
    return Fits(num_experts) ? w[e] : table[e];
  }
  __device__ __forceinline__ const float* Scales(const float* const* scale_table, int num_experts,
                                                 int e) const {
    if constexpr (kFp8) return Fits(num_experts) ? scales[e] : scale_table[e];
    return nullptr;
  }
};

// act[p, i] for the run of pair blockIdx.y, features of this block's warps. Pair p's row of
// xs is rows[p], or p / pairs_per_row without rows. Sorted pairs come with offsets; unsorted
// ones (experts given) are each their own run, and counts (if given) gets +1 per pair.
// Six blocks an SM at one pair a run (80 registers: batch 1's 768 blocks in one wave on 132
// SMs, each lane's four weight loads of an iteration issued together), five at four. With
// the first pair's dots outside the `valid` branch (below) and LoadRow8's one 16-byte load:
// batch 1 FP8 +13%, bf16 +7% (H200, 2026-12-07, docs/results/fp8.md).
template <typename TX, int kRunPairs, bool kFp8>
__global__ void __launch_bounds__(kWarps * 32, kRunPairs == 1 ? 6 : 5)
    MoeGateUpKernel(const TX* __restrict__ xs, int x_rows, const int32_t* __restrict__ rows,
                    int pairs_per_row, const int32_t* __restrict__ offsets,
                    const int32_t* __restrict__ experts, int num_experts,
                    const void* const* __restrict__ gate_up,
                    const float* const* __restrict__ gate_up_scales, int hidden, int inter,
                    __nv_bfloat16* __restrict__ act, unsigned long long* __restrict__ counts) {
  // pdl-early: the immutable expert tables into shared memory (StagedExperts).
  __shared__ StagedExperts<kFp8> table;
  table.Stage(gate_up, gate_up_scales, num_experts);
  PdlWait();
  __syncthreads();  // the staged table
  const int p = blockIdx.y;
  int e, run = 1;
  const void* w = nullptr;
  if (experts != nullptr) {
    // Unsorted pairs (LaunchRoutedSwiGluGemv): each its own run; an expert outside [0, E)
    // computes zeros and is not counted.
    e = __ldg(experts + p);
    if (e >= 0 && e < num_experts) {
      w = table.Weights(gate_up, num_experts, e);
      if (counts != nullptr && blockIdx.x == 0 && threadIdx.x == 0) atomicAdd(counts + e, 1ull);
    }
  } else {
    e = ExpertOfPair(offsets, num_experts, p);
    if (__ldg(offsets + e) != p) return;  // the run's first pair's block does the run
    run = __ldg(offsets + e + 1) - p;
    w = table.Weights(gate_up, num_experts, e);
  }
  const float* ws = kFp8 && w != nullptr ? table.Scales(gate_up_scales, num_experts, e) : nullptr;
  const int n_blocks = 2 * inter / kFp8WeightBlock;
  const int lane = threadIdx.x % 32;
  const int feature0 = (blockIdx.x * kWarps + threadIdx.x / 32) * kFeatures;
  if (feature0 >= inter) return;
  for (int done = 0; done < run; done += kRunPairs) {
    const int pairs = min(kRunPairs, run - done);
    // A row outside xs (a bad index: kernels skip those) computes as a zero row.
    const TX* x[kRunPairs];
    bool valid[kRunPairs];
#pragma unroll
    for (int j = 0; j < kRunPairs; ++j) {
      const int q = p + done + min(j, pairs - 1);
      const int row = rows != nullptr ? __ldg(rows + q) : q / pairs_per_row;
      valid[j] = j < pairs && row >= 0 && row < x_rows;
      x[j] = xs + static_cast<int64_t>(valid[j] ? row : 0) * hidden;
    }
    float g[kFeatures][kRunPairs], u[kFeatures][kRunPairs];
#pragma unroll
    for (int f = 0; f < kFeatures; ++f) {
#pragma unroll
      for (int j = 0; j < kRunPairs; ++j) g[f][j] = u[f][j] = 0.f;
    }
    if (w != nullptr && x_rows > 0) {
      constexpr int kC = kExpertChunk<kFp8>;
#pragma unroll 2
      for (int c = lane * kC; c < hidden; c += 32 * kC) {
        ExpertChunk<kFp8> gw[kFeatures], uw[kFeatures];
#pragma unroll
        for (int f = 0; f < kFeatures; ++f) {
          const int feature = min(feature0 + f, inter - 1);
          gw[f].Load(w, ws, n_blocks, feature, hidden, c);
          uw[f].Load(w, ws, n_blocks, inter + feature, hidden, c);
        }
#pragma unroll
        for (int j = 0; j < kRunPairs; ++j) {
          // One pair a run computes its dots whatever its row (a row outside xs reads row 0
          // and adds nothing), so the chunks above are used outside any branch: FP8 chunks
          // stay raw until the dot, and with every use behind `valid` the compiler sank their
          // loads into the branch and issued them one at a time, between the dots.
          if (kRunPairs == 1 || valid[j]) {
            float xv[kC];
            LoadRow<kC>(x[j] + c, xv);
#pragma unroll
            for (int f = 0; f < kFeatures; ++f) {
              const float gd = gw[f].Dot(xv), ud = uw[f].Dot(xv);
              if (valid[j]) {
                g[f][j] += gd;
                u[f][j] += ud;
              }
            }
          }
        }
      }
    }
#pragma unroll
    for (int f = 0; f < kFeatures; ++f) {
#pragma unroll
      for (int j = 0; j < kRunPairs; ++j) {
        const float gs = RoundBf16(WarpSum(g[f][j])), us = RoundBf16(WarpSum(u[f][j]));
        if (lane == 0 && j < pairs && feature0 + f < inter) {
          act[static_cast<int64_t>(p + done + j) * inter + feature0 + f] =
              __float2bfloat16_rn(gs / (1.f + expf(-gs)) * us);
        }
      }
    }
  }
}

// y[p, n] for the run of pair blockIdx.y, output rows of this block's warps.
template <typename TY, int kRunPairs, bool kFp8>
__global__ void __launch_bounds__(kWarps * 32)
    MoeDownKernel(const __nv_bfloat16* __restrict__ act, const int32_t* __restrict__ offsets,
                  int num_experts, const void* const* __restrict__ down,
                  const float* const* __restrict__ down_scales, int hidden, int inter,
                  TY* __restrict__ y) {
  // pdl-early: the immutable expert tables into shared memory (StagedExperts).
  __shared__ StagedExperts<kFp8> table;
  table.Stage(down, down_scales, num_experts);
  PdlWait();
  __syncthreads();  // the staged table
  const int p = blockIdx.y;
  const int e = ExpertOfPair(offsets, num_experts, p);
  if (__ldg(offsets + e) != p) return;
  const int run = __ldg(offsets + e + 1) - p;
  const int lane = threadIdx.x % 32;
  const int feature0 = (blockIdx.x * kWarps + threadIdx.x / 32) * kFeatures;
  if (feature0 >= hidden) return;
  const void* w = table.Weights(down, num_experts, e);
  const float* ws = kFp8 && w != nullptr ? table.Scales(down_scales, num_experts, e) : nullptr;
  const int n_blocks = hidden / kFp8WeightBlock;
  for (int done = 0; done < run; done += kRunPairs) {
    const int pairs = min(kRunPairs, run - done);
    float acc[kFeatures][kRunPairs];
#pragma unroll
    for (int f = 0; f < kFeatures; ++f) {
#pragma unroll
      for (int j = 0; j < kRunPairs; ++j) acc[f][j] = 0.f;
    }
    if (w != nullptr) {
      constexpr int kC = kExpertChunk<kFp8>;
#pragma unroll 2
      for (int c = lane * kC; c < inter; c += 32 * kC) {
        ExpertChunk<kFp8> wv[kFeatures];
#pragma unroll
        for (int f = 0; f < kFeatures; ++f) {
          wv[f].Load(w, ws, n_blocks, min(feature0 + f, hidden - 1), inter, c);
        }
#pragma unroll
        for (int j = 0; j < kRunPairs; ++j) {
          if (j == 0 || j < pairs) {  // a run has a first pair: its use is outside a branch
            float av[kC];
            LoadRow<kC>(act + static_cast<int64_t>(p + done + j) * inter + c, av);
#pragma unroll
            for (int f = 0; f < kFeatures; ++f) acc[f][j] += wv[f].Dot(av);
          }
        }
      }
    }
#pragma unroll
    for (int f = 0; f < kFeatures; ++f) {
#pragma unroll
      for (int j = 0; j < kRunPairs; ++j) {
        const float s = WarpSum(acc[f][j]);
        if (lane == 0 && j < pairs && feature0 + f < hidden) {
          y[static_cast<int64_t>(p + done + j) * hidden + feature0 + f] = FromFloat<TY>(s);
        }
      }
    }
  }
}

// ---- the MoE FFN of a few tokens from their routing, without the sort ----

constexpr int kDownSumWarps = 8;     // a warp per pair (two for top_k > 8)
constexpr int kDownSumFeatures = 4;  // output features a block
constexpr int kDownSumMaxTopK = 2 * kDownSumWarps;

// out[t, n] for token t = blockIdx.y and features n of this block: each warp computes its
// pairs' down rows (MoeDownKernel's dot, lane order and tree, bit for bit), rounded to TY
// as the experts' outputs are; then the weighted sum over the token's pairs in ascending
// expert order (ties by pair), from zero in float32, rounded once into TO: the sorted
// path's ScaleSumRows. Pairs of an expert outside [0, E) add nothing.
//
// The sum's order (kernels/routed_sum_order.h): this is a decode step's last kernel of the
// MoE, so its tail is on the step's critical path. Lane j of warp 0 places pair j's weighted
// row at its rank, its routing weight read at the start, then each feature's lane adds them
// in rank order. Picking the next pair by a scan of all of them (top_k dependent steps, each
// reading its weight then) gave the same bits 4% slower at batch 1 (H100, 2026-12-06,
// docs/results/fp8.md).
//
// Four blocks an SM (64 registers): batch 1's 512 blocks in one wave on 132 SMs.
template <typename TY, typename TO, bool kFp8>
__global__ void __launch_bounds__(kDownSumWarps * 32, 4)
    MoeDownSumKernel(const __nv_bfloat16* __restrict__ act, const int32_t* __restrict__ experts,
                     const float* __restrict__ scales, int top_k, int num_experts,
                     const void* const* __restrict__ down,
                     const float* const* __restrict__ down_scales, int hidden, int inter,
                     TO* __restrict__ out) {
  // pdl-early: the immutable expert tables into shared memory (StagedExperts).
  __shared__ StagedExperts<kFp8> table;
  table.Stage(down, down_scales, num_experts);
  PdlWait();
  __syncthreads();  // the staged table
  __shared__ float part[kDownSumMaxTopK][kDownSumFeatures];
  __shared__ int expert_of[kDownSumMaxTopK];
  const int t = blockIdx.y;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int feature0 = blockIdx.x * kDownSumFeatures;
  // Pair `lane`'s routing weight, in flight while the weights stream.
  const float lane_scale = warp == 0 && lane < top_k ? __ldg(scales + t * top_k + lane) : 0.f;
  for (int j = warp; j < top_k; j += kDownSumWarps) {
    const int p = t * top_k + j;
    const int e = __ldg(experts + p);
    const void* w = e >= 0 && e < num_experts ? table.Weights(down, num_experts, e) : nullptr;
    const float* ws = kFp8 && w != nullptr ? table.Scales(down_scales, num_experts, e) : nullptr;
    const int n_blocks = hidden / kFp8WeightBlock;
    float acc[kDownSumFeatures];
#pragma unroll
    for (int f = 0; f < kDownSumFeatures; ++f) acc[f] = 0.f;
    if (w != nullptr) {
      constexpr int kC = kExpertChunk<kFp8>;
#pragma unroll 2
      for (int c = lane * kC; c < inter; c += 32 * kC) {
        // Every chunk's load before any dot, so that they are in flight together.
        ExpertChunk<kFp8> wv[kDownSumFeatures];
#pragma unroll
        for (int f = 0; f < kDownSumFeatures; ++f) {
          wv[f].Load(w, ws, n_blocks, min(feature0 + f, hidden - 1), inter, c);
        }
        float av[kC];
        LoadRow<kC>(act + static_cast<int64_t>(p) * inter + c, av);
#pragma unroll
        for (int f = 0; f < kDownSumFeatures; ++f) acc[f] += wv[f].Dot(av);
      }
    }
#pragma unroll
    for (int f = 0; f < kDownSumFeatures; ++f) {
      const float v = WarpSum(acc[f]);
      if (lane == 0) part[j][f] = ToFloat(FromFloat<TY>(v));
    }
    if (lane == 0) expert_of[j] = e >= 0 && e < num_experts ? e : -1;
  }
  __syncthreads();
  if (warp != 0) return;
  __shared__ float ordered[kDownSumMaxTopK][kDownSumFeatures];
  const bool counted = lane < top_k && expert_of[lane] >= 0;
  const int pairs = __popc(__ballot_sync(0xffffffffu, counted));
  if (counted) {
    const int rank = RoutedSumRank(expert_of, top_k, lane);
#pragma unroll
    for (int f = 0; f < kDownSumFeatures; ++f) {
      ordered[rank][f] = __fmul_rn(lane_scale, part[lane][f]);
    }
  }
  __syncwarp();
  const int f = lane;
  if (f >= kDownSumFeatures || feature0 + f >= hidden) return;
  float sum = 0.f;
#pragma unroll
  for (int r = 0; r < kDownSumMaxTopK; ++r) {
    if (r < pairs) sum = __fadd_rn(sum, ordered[r][f]);
  }
  out[static_cast<int64_t>(t) * hidden + feature0 + f] = FromFloat<TO>(sum);
}

// The weight slices (256 elements a lane's warp) a dense GEMV warp requests before PdlWait:
// 2, or 4 with DXS_CUDA_GEMV_EARLY=4 (with ksplit, 4 is the whole of a q/k/v or o-projection
// warp's share at Qwen3-30B-A3B's shapes, so the whole stream is requested while the previous
// kernel finishes; 0.95x at batch 1 on an H200 with bf16 weights, docs/results/gpu-bench.md,
// 2026-12-02: not adopted). Read once.
int GemvEarlySlices() {
  static const int slices = tunables::Get(tunables::kCudaGemvEarly) == "4" ? 4 : 2;
  return slices;
}

// Blocks for `features` outputs when ksplit warps share each feature group.
int FeatureBlocks(int64_t features, int ksplit = 1) {
  const int64_t per_block = kWarps / ksplit * kFeatures;
  return static_cast<int>((features + per_block - 1) / per_block);
}

// Warps sharing a feature group in LaunchGemvsBf16: split k (up to kWarps ways, each warp
// keeping at least two 256-element slices) until the launch has about 4096 warps, 31 a
// streaming multiprocessor on an H200: a short, wide stream (o-proj: 2048 features of 4096)
// otherwise has too few loads in flight to reach the copy rate. DXS_CUDA_GEMV_SPLITK=off
// keeps one warp a group (for A/B runs).
int GemvKSplit(int64_t groups, int64_t k) {
  static const bool enabled = tunables::On(tunables::kCudaGemvSplitK);
  int ksplit = 1;
  if (!enabled) return ksplit;
  while (ksplit < kWarps && groups * ksplit < 4096 && k / (2 * ksplit) >= 2 * 32 * kChunk) {
    ksplit *= 2;
  }
  return ksplit;
}

// out[t, :] = sum over pairs i ascending with rows[i] == t of scales[i] * src[i, :], from
// zero, then rounded once into TO: ScaleAddRows into a zeroed float32 row and the copy, in
// one pass. The n rows are scanned in windows of 256 (a ballot a warp): each window's
// matches are listed in ascending order (warp by warp, lane by lane), then each thread adds
// them to its columns' sums, so a row's pairs are added in ascending i however many there
// are. Multiply and add are rounded separately, as on the CPU. Columns: a thread has up to
// kSumColsPerThread of them (the launch makes the grid wide enough).
constexpr int kSumThreads = 256;
constexpr int kSumColsPerThread = 4;
template <typename TS, typename TO>
__global__ void __launch_bounds__(kSumThreads)
    ScaleSumRowsKernel(const TS* __restrict__ src, const float* __restrict__ scales,
                       const int32_t* __restrict__ rows, int n, int cols, TO* __restrict__ out) {
  PdlWait();
  constexpr int kWarpsHere = kSumThreads / 32;
  __shared__ int32_t list[kSumThreads];
  __shared__ int warp_hits[kWarpsHere];
  const int t = blockIdx.x;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int stride = static_cast<int>(gridDim.y * blockDim.x);
  const int col0 = static_cast<int>(blockIdx.y * blockDim.x + threadIdx.x);
  float sum[kSumColsPerThread];
#pragma unroll
  for (int c = 0; c < kSumColsPerThread; ++c) sum[c] = 0.f;
  for (int base = 0; base < n; base += kSumThreads) {
    const int i = base + static_cast<int>(threadIdx.x);
    const bool hit = i < n && __ldg(rows + i) == t;
    const unsigned mask = __ballot_sync(0xffffffffu, hit);
    if (lane == 0) warp_hits[warp] = __popc(mask);
    __syncthreads();
    int before = 0, found = 0;
#pragma unroll
    for (int w = 0; w < kWarpsHere; ++w) {
      before += w < warp ? warp_hits[w] : 0;
      found += warp_hits[w];
    }
    if (hit) list[before + __popc(mask & ((1u << lane) - 1u))] = i;
    __syncthreads();
    for (int j = 0; j < found; ++j) {
      const int p = list[j];
      const float w = __ldg(scales + p);
      const TS* x = src + static_cast<int64_t>(p) * cols;
#pragma unroll
      for (int c = 0; c < kSumColsPerThread; ++c) {
        const int col = col0 + c * stride;
        if (col < cols) sum[c] = __fadd_rn(sum[c], __fmul_rn(w, ToFloat(x[col])));
      }
    }
    __syncthreads();  // the list and counts are rewritten by the next window
  }
#pragma unroll
  for (int c = 0; c < kSumColsPerThread; ++c) {
    const int col = col0 + c * stride;
    if (col < cols) out[static_cast<int64_t>(t) * cols + col] = FromFloat<TO>(sum[c]);
  }
}

}  // namespace

int GemvKSplitOf(int64_t groups, int64_t k) { return GemvKSplit(groups, k); }

cudaError_t LaunchScaleSumRows(const void* src, ElemType src_type, const float* scales,
                               const int32_t* rows, int64_t n, int64_t cols, void* out,
                               ElemType out_type, int64_t out_rows, cudaStream_t stream) {
  constexpr int64_t kColsPerBlockRow = int64_t{kSumThreads} * kSumColsPerThread;
  if (n < 0 || n > kScaleSumMaxPairs || cols < 0 || cols > INT32_MAX || out_rows < 0 ||
      out_rows > INT32_MAX || (cols + kColsPerBlockRow - 1) / kColsPerBlockRow > 65535 ||
      (src_type != ElemType::kF32 && src_type != ElemType::kBF16) ||
      (out_type != ElemType::kF32 && out_type != ElemType::kBF16)) {
    return cudaErrorInvalidValue;
  }
  if (out_rows == 0 || cols == 0) return cudaSuccess;
  if (out == nullptr || (n > 0 && (src == nullptr || scales == nullptr || rows == nullptr))) {
    return cudaErrorInvalidValue;
  }
  const dim3 grid(static_cast<unsigned>(out_rows),
                  static_cast<unsigned>((cols + kColsPerBlockRow - 1) / kColsPerBlockRow));
  auto launch = [&](auto st, auto ot) {
    using TS = typename decltype(st)::type;
    using TO = typename decltype(ot)::type;
    LaunchKernel(ScaleSumRowsKernel<TS, TO>, grid, kSumThreads, 0, stream,
                 static_cast<const TS*>(src), scales, rows, static_cast<int>(n),
                 static_cast<int>(cols), static_cast<TO*>(out));
    return cudaGetLastError();
  };
  auto by_out = [&](auto st) {
    return out_type == ElemType::kF32 ? launch(st, TypeTag<float>{})
                                      : launch(st, TypeTag<__nv_bfloat16>{});
  };
  return src_type == ElemType::kF32 ? by_out(TypeTag<float>{}) : by_out(TypeTag<__nv_bfloat16>{});
}

cudaError_t LaunchGemvsBf16(const void* x, ElemType x_type, int64_t m, int64_t k, int count,
                            const void* const* ws, const int64_t* ns, void* const* ys,
                            ElemType y_type, cudaStream_t stream) {
  if (m < 0 || k < 0 || m > kGemvMaxRows || k % kChunk != 0 || k > INT32_MAX || count < 1 ||
      count > kGemvMaxOutputs || ws == nullptr || ns == nullptr || ys == nullptr ||
      (x_type != ElemType::kBF16 && x_type != ElemType::kF32) ||
      (y_type != ElemType::kBF16 && y_type != ElemType::kF32)) {
    return cudaErrorInvalidValue;
  }
  GemvOutputs outs{};
  int64_t groups = 0;
  for (int o = 0; o < count; ++o) {
    if (ns[o] < 0 || ns[o] > INT32_MAX) return cudaErrorInvalidValue;
    groups += (ns[o] + kFeatures - 1) / kFeatures;
  }
  const int ksplit = GemvKSplit(groups, k);
  int64_t blocks = 0;
  for (int o = 0; o < count; ++o) {
    outs.w[o] = static_cast<const __nv_bfloat16*>(ws[o]);
    outs.y[o] = ys[o];
    outs.n[o] = static_cast<int>(ns[o]);
    outs.first_block[o] = static_cast<int>(blocks);
    blocks += FeatureBlocks(ns[o], ksplit);
    if (m > 0 && ns[o] > 0 && (ws[o] == nullptr || ys[o] == nullptr || !Aligned16(ws[o]))) {
      return cudaErrorInvalidValue;
    }
  }
  outs.first_block[count] = static_cast<int>(blocks);
  outs.count = count;
  if (m == 0 || blocks == 0) return cudaSuccess;
  if (x == nullptr || !Aligned16(x) || blocks > INT32_MAX) return cudaErrorInvalidValue;
  const dim3 grid(static_cast<unsigned>(blocks));
  auto launch = [&](auto xt, auto yt, auto rows) {
    using TX = typename decltype(xt)::type;
    using TY = typename decltype(yt)::type;
    constexpr int kRows = decltype(rows)::value;
    if (GemvEarlySlices() == 4) {
      LaunchKernel(GemvKernel<TX, TY, kRows, 4>, grid, kWarps * 32, 0, stream,
                   static_cast<const TX*>(x), static_cast<int>(m), outs, static_cast<int>(k),
                   ksplit);
    } else {
      LaunchKernel(GemvKernel<TX, TY, kRows, 2>, grid, kWarps * 32, 0, stream,
                   static_cast<const TX*>(x), static_cast<int>(m), outs, static_cast<int>(k),
                   ksplit);
    }
    return cudaGetLastError();
  };
  auto by_rows = [&](auto xt, auto yt) {
    if (m == 1) return launch(xt, yt, std::integral_constant<int, 1>{});
    if (m == 2) return launch(xt, yt, std::integral_constant<int, 2>{});
    if (m <= 4) return launch(xt, yt, std::integral_constant<int, 4>{});
    return launch(xt, yt, std::integral_constant<int, kGemvMaxRows>{});
  };
  auto by_out = [&](auto xt) {
    return y_type == ElemType::kF32 ? by_rows(xt, TypeTag<float>{})
                                    : by_rows(xt, TypeTag<__nv_bfloat16>{});
  };
  return x_type == ElemType::kF32 ? by_out(TypeTag<float>{}) : by_out(TypeTag<__nv_bfloat16>{});
}

cudaError_t LaunchGemvBf16(const void* x, ElemType x_type, int64_t m, const void* w, int64_t n,
                           int64_t k, void* y, ElemType y_type, cudaStream_t stream) {
  return LaunchGemvsBf16(x, x_type, m, k, 1, &w, &n, &y, y_type, stream);
}

cudaError_t LaunchMoeSwiGluGemv(const void* xs, ElemType x_type, int64_t x_rows,
                                const int32_t* rows, int64_t num_pairs,
                                const int32_t* expert_offsets, int64_t num_experts,
                                const void* const* weights, const float* const* weight_scales,
                                int64_t hidden, int64_t inter, void* act, void* y, ElemType y_type,
                                cudaStream_t stream) {
  if (num_pairs < 0 || num_pairs > kGemvMaxPairs || num_experts < 1 || hidden <= 0 || inter <= 0 ||
      hidden % kChunk != 0 || inter % kChunk != 0 || hidden > INT32_MAX || inter > INT32_MAX ||
      num_experts > INT32_MAX || x_rows < 0 ||
      (weight_scales != nullptr &&
       (hidden % kFp8WeightBlock != 0 || inter % kFp8WeightBlock != 0)) ||
      (x_type != ElemType::kBF16 && x_type != ElemType::kF32) ||
      (y_type != ElemType::kBF16 && y_type != ElemType::kF32)) {
    return cudaErrorInvalidValue;
  }
  if (num_pairs == 0) return cudaSuccess;
  if (xs == nullptr || expert_offsets == nullptr || weights == nullptr || act == nullptr ||
      y == nullptr || !Aligned16(xs) || !Aligned16(act) ||
      (rows == nullptr && x_rows < num_pairs)) {
    return cudaErrorInvalidValue;
  }
  const void* const* gate_up = weights;
  const void* const* down = weights + num_experts;
  const float* const* gate_up_scales = weight_scales;
  const float* const* down_scales =
      weight_scales != nullptr ? weight_scales + num_experts : nullptr;
  auto* a = static_cast<__nv_bfloat16*>(act);
  const int e = static_cast<int>(num_experts), h = static_cast<int>(hidden),
            i = static_cast<int>(inter);
  const int xr = static_cast<int>(std::min<int64_t>(x_rows, INT32_MAX));
  const dim3 gate_grid(FeatureBlocks(inter), static_cast<unsigned>(num_pairs));
  const dim3 down_grid(FeatureBlocks(hidden), static_cast<unsigned>(num_pairs));
  auto launch = [&](auto run_pairs, auto fp8, auto xt, auto yt) {
    constexpr int kRun = decltype(run_pairs)::value;
    constexpr bool kFp8 = decltype(fp8)::value;
    using TX = typename decltype(xt)::type;
    using TY = typename decltype(yt)::type;
    LaunchKernel(MoeGateUpKernel<TX, kRun, kFp8>, gate_grid, kWarps * 32, 0, stream,
                 static_cast<const TX*>(xs), xr, rows, 1, expert_offsets, nullptr, e, gate_up,
                 gate_up_scales, h, i, a, nullptr);
    if (cudaError_t err = cudaGetLastError(); err != cudaSuccess) return err;
    LaunchKernel(MoeDownKernel<TY, kRun, kFp8>, down_grid, kWarps * 32, 0, stream, a,
                 expert_offsets, e, down, down_scales, h, i, static_cast<TY*>(y));
    return cudaGetLastError();
  };
  auto by_y = [&](auto run_pairs, auto fp8, auto xt) {
    return y_type == ElemType::kF32 ? launch(run_pairs, fp8, xt, TypeTag<float>{})
                                    : launch(run_pairs, fp8, xt, TypeTag<__nv_bfloat16>{});
  };
  auto by_x = [&](auto run_pairs, auto fp8) {
    return x_type == ElemType::kF32 ? by_y(run_pairs, fp8, TypeTag<float>{})
                                    : by_y(run_pairs, fp8, TypeTag<__nv_bfloat16>{});
  };
  auto by_weights = [&](auto run_pairs) {
    return weight_scales != nullptr ? by_x(run_pairs, std::true_type{})
                                    : by_x(run_pairs, std::false_type{});
  };
  if (num_pairs <= kSinglePairRunsUpTo) return by_weights(std::integral_constant<int, 1>{});
  return by_weights(std::integral_constant<int, kRunPairs>{});
}

cudaError_t LaunchRoutedSwiGluGemv(const void* xs, ElemType x_type, int64_t tokens,
                                   const int32_t* ids, const float* scales, int64_t top_k,
                                   int64_t num_experts, const void* const* weights,
                                   const float* const* weight_scales, int64_t hidden, int64_t inter,
                                   void* act, ElemType y_type, int64_t* counts, void* out,
                                   ElemType out_type, cudaStream_t stream) {
  if (tokens < 0 || top_k < 1 || top_k > kDownSumMaxTopK || tokens * top_k > kGemvMaxPairs ||
      num_experts < 1 || num_experts > INT32_MAX || hidden <= 0 || inter <= 0 ||
      hidden % kChunk != 0 || inter % kChunk != 0 || hidden > INT32_MAX || inter > INT32_MAX ||
      (weight_scales != nullptr &&
       (hidden % kFp8WeightBlock != 0 || inter % kFp8WeightBlock != 0)) ||
      (x_type != ElemType::kBF16 && x_type != ElemType::kF32) ||
      (y_type != ElemType::kBF16 && y_type != ElemType::kF32) ||
      (out_type != ElemType::kBF16 && out_type != ElemType::kF32)) {
    return cudaErrorInvalidValue;
  }
  if (tokens == 0) return cudaSuccess;
  if (xs == nullptr || ids == nullptr || scales == nullptr || weights == nullptr ||
      act == nullptr || out == nullptr || !Aligned16(xs) || !Aligned16(act)) {
    return cudaErrorInvalidValue;
  }
  const void* const* gate_up = weights;
  const void* const* down = weights + num_experts;
  const float* const* gate_up_scales = weight_scales;
  const float* const* down_scales =
      weight_scales != nullptr ? weight_scales + num_experts : nullptr;
  auto* a = static_cast<__nv_bfloat16*>(act);
  auto* c = reinterpret_cast<unsigned long long*>(counts);
  const int e = static_cast<int>(num_experts), h = static_cast<int>(hidden),
            i = static_cast<int>(inter), k = static_cast<int>(top_k);
  const int xr = static_cast<int>(tokens);
  const dim3 gate_grid(FeatureBlocks(inter), static_cast<unsigned>(tokens * top_k));
  const dim3 sum_grid(static_cast<unsigned>((hidden + kDownSumFeatures - 1) / kDownSumFeatures),
                      static_cast<unsigned>(tokens));
  auto launch = [&](auto fp8, auto xt, auto yt, auto ot) {
    constexpr bool kFp8 = decltype(fp8)::value;
    using TX = typename decltype(xt)::type;
    using TY = typename decltype(yt)::type;
    using TO = typename decltype(ot)::type;
    LaunchKernel(MoeGateUpKernel<TX, 1, kFp8>, gate_grid, kWarps * 32, 0, stream,
                 static_cast<const TX*>(xs), xr, nullptr, k, nullptr, ids, e, gate_up,
                 gate_up_scales, h, i, a, c);
    if (cudaError_t err = cudaGetLastError(); err != cudaSuccess) return err;
    LaunchKernel(MoeDownSumKernel<TY, TO, kFp8>, sum_grid, kDownSumWarps * 32, 0, stream, a, ids,
                 scales, k, e, down, down_scales, h, i, static_cast<TO*>(out));
    return cudaGetLastError();
  };
  auto by_out = [&](auto fp8, auto xt, auto yt) {
    return out_type == ElemType::kF32 ? launch(fp8, xt, yt, TypeTag<float>{})
                                      : launch(fp8, xt, yt, TypeTag<__nv_bfloat16>{});
  };
  auto by_y = [&](auto fp8, auto xt) {
    return y_type == ElemType::kF32 ? by_out(fp8, xt, TypeTag<float>{})
                                    : by_out(fp8, xt, TypeTag<__nv_bfloat16>{});
  };
  auto by_x = [&](auto fp8) {
    return x_type == ElemType::kF32 ? by_y(fp8, TypeTag<float>{})
                                    : by_y(fp8, TypeTag<__nv_bfloat16>{});
  };
  return weight_scales != nullptr ? by_x(std::true_type{}) : by_x(std::false_type{});
}

}  // namespace dxs::cuda
