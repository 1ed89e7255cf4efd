// The kernels of a block-scaled FP8 projection (Tensor::block_scales: fp8 weight [n, k] and one
// float32 scale per 128 x 128 block; kernels/cuda/fp8_linear.cc chooses between them):
//
// - LaunchQuantizeActivationsFp8: the activations of a GEMM (cuBLASLt's FP8 matmul or CUTLASS's,
//   which take FP8 on both sides) quantized per token and per 128 channels, a warp a group
//   (fp8_quantize.cuh: the FP8 dispatch records' arithmetic), DeepSeek-V3's and the official
//   Qwen3 FP8 checkpoints' "dynamic" activation scheme. Values go out row-major [m_pad, k]; scales
//   [k / 128, m_pad], token-major within a group (cuBLASLt's VEC128_32F layout for its B operand);
//   rows m..m_pad get zeros and scale 1 (cuBLASLt wants the token count a multiple of 4).
// - LaunchGemvFp8: the decode-sized product y[m, n] = x[m, :] . dequant(w)[n, :] for m <=
//   kGemvMaxRows bf16 rows: a warp per output feature, or per 2 (or 4) features past one row
//   (GemvFp8Features: one read of x for them all), or up to four warps a feature, each a share
//   of the row, summed in warp order (GemvFp8KSplit), streams the weights, 16 bytes (16 values)
//   a lane at a time, widens them in registers (the e4m3 -> f16 conversion the
//   hardware does two at a time), and multiplies each 16-value dot by its block's scale. The
//   activations stay bf16 (no quantization error on that side: a decode step is bound by the
//   weights' bytes, not by the multiply). The lane sums meet through a fixed xor-shuffle tree,
//   so results are deterministic. LaunchGemvsFp8 runs up to kGemvMaxOutputs weights sharing x
//   (a decode step's q, k and v) in one launch, as LaunchGemvsBf16 does.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <climits>
#include <cstdint>

#include "kernels/cuda/elem_type.cuh"
#include "kernels/cuda/fp8_quantize.cuh"
#include "kernels/cuda/launch.cuh"
#include "kernels/cuda/ops.cuh"

namespace dxs::cuda {
namespace {

constexpr int kGroup = kFp8GroupValues;  // the weights' block size and the activations' group

// A warp per (row, 128-channel group), kQuantizeWarps warps a block.
constexpr int kQuantizeWarps = 8;

template <typename T>
__global__ void QuantizeActivationsFp8Kernel(const T* x, int64_t m, int k, int64_t m_pad,
                                             uint8_t* values, float* scales) {
  PdlWait();
  const int groups = k / kGroup;
  const int64_t unit = static_cast<int64_t>(blockIdx.x) * kQuantizeWarps + threadIdx.x / 32;
  if (unit >= m_pad * groups) return;
  const int64_t row = unit / groups;
  const int g = static_cast<int>(unit % groups), lane = static_cast<int>(threadIdx.x % 32);
  const int64_t j = static_cast<int64_t>(g) * kGroup + lane * kFp8ValuesPerLane;
  uint32_t* out = reinterpret_cast<uint32_t*>(values + row * k + j);
  if (row >= m) {
    // Padding rows: zeros with scale 1, so the GEMM's extra columns are zeros.
    *out = 0;
    if (lane == 0) scales[g * m_pad + row] = 1.f;
    return;
  }
  float v[kFp8ValuesPerLane];
#pragma unroll
  for (int i = 0; i < kFp8ValuesPerLane; ++i) v[i] = ToFloat(x[row * k + j + i]);
  const float scale = QuantizeGroupOfWarp(v, out);
  if (lane == 0) scales[g * m_pad + row] = scale;
}

constexpr int kGemvFp8Warps = 8;  // warps a block, one output feature each
constexpr int kFp8Chunk = 16;     // weights a lane loads at once (16 bytes)

// The 16 fp8 of 16 bytes, widened.
__device__ __forceinline__ void WidenFp8x16(const uint4& raw, float out[kFp8Chunk]) {
  const __nv_fp8x2_storage_t* pairs = reinterpret_cast<const __nv_fp8x2_storage_t*>(&raw);
#pragma unroll
  for (int i = 0; i < kFp8Chunk / 2; ++i) {
    const __half2 h(__nv_cvt_fp8x2_to_halfraw2(pairs[i], __NV_E4M3));
    const float2 f = __half22float2(h);
    out[2 * i] = f.x;
    out[2 * i + 1] = f.y;
  }
}

// The weights of one launch (several sharing x: q, k and v): blocks [first_block[o],
// first_block[o + 1]) compute output o.
struct Fp8GemvOutputs {
  const uint8_t* w[kGemvMaxOutputs];
  const float* scales[kGemvMaxOutputs];
  int64_t scale_stride[kGemvMaxOutputs];
  void* y[kGemvMaxOutputs];
  int64_t n[kGemvMaxOutputs];
  int first_block[kGemvMaxOutputs + 1];
  int count;
};

// At one row and one feature a warp, at least five blocks an SM: with that bound ptxas issues
// each lane's next weight load before the dot that waits for the activations' load (without
// it, after: the weights' round trip then followed the activations' own). 40 registers, and a
// decode step's q, k and v (640 blocks) are one wave on 132 SMs. FP8 decode +1.6% at batch 1
// and +1.5% at 8 in a build whose gate_up also compiled differently (H100, 2026-12-07,
// docs/results/fp8.md).
template <int kRows, int kFeatures, typename Y>
__global__ void __launch_bounds__(kGemvFp8Warps * 32, kRows == 1 && kFeatures == 1 ? 5 : 1)
    GemvFp8Kernel(const __nv_bfloat16* x, const Fp8GemvOutputs outs, int64_t k, int ksplit) {
  static_assert(kGemvMaxOutputs == 3, "the selection below names each output");
  static_assert(kGroup % kFeatures == 0, "a warp's features share one block of scales");
  // Selected with constant indices: a runtime index would copy the parameters to the stack.
  const int block = static_cast<int>(blockIdx.x);
  const int o = block >= outs.first_block[2] && outs.count > 2   ? 2
                : block >= outs.first_block[1] && outs.count > 1 ? 1
                                                                 : 0;
  const uint8_t* w = o == 0 ? outs.w[0] : o == 1 ? outs.w[1] : outs.w[2];
  const int64_t n = o == 0 ? outs.n[0] : o == 1 ? outs.n[1] : outs.n[2];
  const int first = o == 0   ? outs.first_block[0]
                    : o == 1 ? outs.first_block[1]
                             : outs.first_block[2];
  const int lane = static_cast<int>(threadIdx.x % 32), warp = static_cast<int>(threadIdx.x / 32);
  // ksplit warps share kFeatures consecutive features, each taking every ksplit-th 32-chunk
  // slice of their rows; their sums meet in shared memory in warp order (deterministic). n is a
  // multiple of 128, which kFeatures divides: a warp's features are all below n or none is.
  const int sub = warp % ksplit;
  const int64_t feature =
      (static_cast<int64_t>(block - first) * (kGemvFp8Warps / ksplit) + warp / ksplit) * kFeatures;
  // pdl-early: the weights are the model's, never written by a kernel, so each lane requests
  // its first chunk of each row before waiting for the previous kernel (PdlWait). Nothing else
  // is read or written before the wait. Measured on an H100 at batch 1 and not kept: four
  // chunks ahead a lane (the whole of a 2048-wide row; 37.7 against 31.6 us for a layer's four
  // projections), and the first scale before the wait too (no change; docs/results/fp8.md).
  const int64_t chunks = k / kFp8Chunk;
  const int64_t c0 = static_cast<int64_t>(sub) * 32 + lane, stride = 32 * ksplit;
  const uint4* w_rows = reinterpret_cast<const uint4*>(w + (feature < n ? feature : 0) * k);
  uint4 next[kFeatures];
#pragma unroll
  for (int f = 0; f < kFeatures; ++f) next[f] = c0 < chunks ? w_rows[f * chunks + c0] : uint4{};
  // The scales of this warp's features (one 128-row block), one per 128 columns.
  const float* scale_row =
      (o == 0   ? outs.scales[0]
       : o == 1 ? outs.scales[1]
                : outs.scales[2]) +
      ((feature < n ? feature : 0) / kGroup) * (o == 0   ? outs.scale_stride[0]
                                                : o == 1 ? outs.scale_stride[1]
                                                         : outs.scale_stride[2]);
  PdlWait();
  float next_scale = c0 < chunks ? scale_row[(c0 * kFp8Chunk) / kGroup] : 0.f;
  Y* y = static_cast<Y*>(o == 0 ? outs.y[0] : o == 1 ? outs.y[1] : outs.y[2]);
  // acc[r][f]: row r's sum for feature f, each summed in the same order whatever kFeatures is
  // (one warp a feature gives the same bits).
  float acc[kRows][kFeatures];
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
#pragma unroll
    for (int f = 0; f < kFeatures; ++f) acc[r][f] = 0.f;
  }
  if (feature < n) {
    for (int64_t c = c0; c < chunks; c += stride) {
      float wv[kFeatures][kFp8Chunk];
#pragma unroll
      for (int f = 0; f < kFeatures; ++f) {
        const uint4 raw = next[f];
        if (c + stride < chunks) next[f] = w_rows[f * chunks + c + stride];
        WidenFp8x16(raw, wv[f]);
      }
      const float s = next_scale;  // scale_row[(c * kFp8Chunk) / kGroup], one chunk ahead
      if (c + stride < chunks) {
        next_scale = scale_row[((c + stride) * kFp8Chunk) / kGroup];
      }
      // Each row's 16 activations are read once for the warp's kFeatures rows of weights: at
      // several rows the activations' reads, not the weights', are most of a lane's loads.
#pragma unroll
      for (int r = 0; r < kRows; ++r) {
        const uint4* xr = reinterpret_cast<const uint4*>(x + r * k + c * kFp8Chunk);
        float dot[kFeatures];
#pragma unroll
        for (int f = 0; f < kFeatures; ++f) dot[f] = 0.f;
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          const uint4 xraw = xr[half];
          const __nv_bfloat162* xh = reinterpret_cast<const __nv_bfloat162*>(&xraw);
#pragma unroll
          for (int i = 0; i < 4; ++i) {
            const float2 xf = __bfloat1622float2(xh[i]);
#pragma unroll
            for (int f = 0; f < kFeatures; ++f) {
              dot[f] = fmaf(wv[f][half * 8 + 2 * i], xf.x, dot[f]);
              dot[f] = fmaf(wv[f][half * 8 + 2 * i + 1], xf.y, dot[f]);
            }
          }
        }
#pragma unroll
        for (int f = 0; f < kFeatures; ++f) acc[r][f] = fmaf(s, dot[f], acc[r][f]);
      }
    }
  }
  __shared__ float partial[kGemvFp8Warps][kRows * kFeatures];
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
#pragma unroll
    for (int f = 0; f < kFeatures; ++f) {
      float v = acc[r][f];
      for (int offset = 16; offset > 0; offset /= 2) v += __shfl_xor_sync(0xffffffffu, v, offset);
      if (ksplit == 1) {
        if (lane == 0 && feature < n) y[r * n + feature + f] = FromFloat<Y>(v);
      } else if (lane == 0) {
        partial[warp][r * kFeatures + f] = v;
      }
    }
  }
  if (ksplit == 1) return;
  __syncthreads();
  if (sub != 0 || feature >= n || lane >= kRows * kFeatures) return;
  float v = partial[warp][lane];
  for (int j = 1; j < ksplit; ++j) v += partial[warp + j][lane];
  y[(lane / kFeatures) * n + feature + lane % kFeatures] = FromFloat<Y>(v);
}

// Warps sharing a feature group (GemvFp8Features' features) in LaunchGemvsFp8: split the
// rows (up to 4 ways, each warp keeping at least two 32-chunk slices) until the launch has
// about 8192 warps, so that a short, wide stream (o-proj: 2048 features of 4096 e4m3) has
// more loads in flight, with DXS_CUDA_GEMV_FP8_SPLITK=auto; off (the default: no change
// measured on an H200) keeps one warp a group.
int GemvFp8KSplit(int64_t feature_groups, int64_t chunks) {
  static const bool enabled = tunables::On(tunables::kCudaGemvFp8SplitK);
  int ksplit = 1;
  if (!enabled) return ksplit;
  while (ksplit < 4 && feature_groups * ksplit < 8192 && chunks / (32 * 2 * ksplit) >= 2) {
    ksplit *= 2;
  }
  return ksplit;
}

// Features a warp computes in LaunchGemvsFp8 (`forced` when not 0, else by the shape). One
// read of the activations serves kFeatures rows of weights: at m rows a lane loads 32 * m
// activation bytes for every 16 weight bytes, so past one row those loads, not the weights'
// stream, set the time. Fewer warps a launch also means fewer weight loads in flight: one row
// keeps a warp a feature, as do 3-4 rows of 4096-wide ones (o_proj: 6.05 and 7.48 us against
// 6.59 and 9.67 with two, H100), and 4 features a warp lost to 2 on a decode step's q, k and
// v (docs/results/fp8.md, "Features a warp in the FP8 GEMV").
int GemvFp8Features(int64_t m, int64_t k, int forced) {
  if (forced != 0) return forced;
  if (m <= 1 || (k >= 4096 && m >= 3 && m <= 4)) return 1;
  return 2;
}

template <int kRows, int kFeatures>
cudaError_t LaunchGemvFp8Rows(const __nv_bfloat16* x, const Fp8GemvOutputs& outs, int64_t k,
                              int ksplit, ElemType y_type, cudaStream_t stream) {
  const unsigned blocks = static_cast<unsigned>(outs.first_block[outs.count]);
  if (y_type == ElemType::kF32) {
    return LaunchKernel(GemvFp8Kernel<kRows, kFeatures, float>, blocks, kGemvFp8Warps * 32, 0,
                        stream, x, outs, k, ksplit);
  }
  return LaunchKernel(GemvFp8Kernel<kRows, kFeatures, __nv_bfloat16>, blocks, kGemvFp8Warps * 32, 0,
                      stream, x, outs, k, ksplit);
}

template <int kRows>
cudaError_t LaunchGemvFp8Features(const __nv_bfloat16* x, const Fp8GemvOutputs& outs, int64_t k,
                                  int ksplit, int features, ElemType y_type, cudaStream_t stream) {
  switch (features) {
    case 1:
      return LaunchGemvFp8Rows<kRows, 1>(x, outs, k, ksplit, y_type, stream);
    case 2:
      return LaunchGemvFp8Rows<kRows, 2>(x, outs, k, ksplit, y_type, stream);
    case 4:
      return LaunchGemvFp8Rows<kRows, 4>(x, outs, k, ksplit, y_type, stream);
    default:
      return cudaErrorInvalidValue;
  }
}

}  // namespace

cudaError_t LaunchQuantizeActivationsFp8(const void* x, ElemType x_type, int64_t m, int64_t k,
                                         int64_t m_pad, uint8_t* values, float* scales,
                                         cudaStream_t stream) {
  if (m < 0 || m_pad < m || m_pad > INT32_MAX || k <= 0 || k % kGroup != 0 || k > INT32_MAX ||
      m_pad * (k / kGroup) / kQuantizeWarps >= INT32_MAX) {
    return cudaErrorInvalidValue;
  }
  if (m_pad == 0) return cudaSuccess;
  if ((m > 0 && x == nullptr) || values == nullptr || scales == nullptr) {
    return cudaErrorInvalidValue;
  }
  const int64_t units = m_pad * (k / kGroup);
  const unsigned blocks = static_cast<unsigned>((units + kQuantizeWarps - 1) / kQuantizeWarps);
  return DispatchFloat(x_type, [&](auto tag) {
    using T = typename decltype(tag)::type;
    return LaunchKernel(QuantizeActivationsFp8Kernel<T>, blocks, kQuantizeWarps * 32, 0, stream,
                        static_cast<const T*>(x), m, static_cast<int>(k), m_pad, values, scales);
  });
}

cudaError_t LaunchGemvsFp8(const void* x, int64_t m, int64_t k, int count, const uint8_t* const* ws,
                           const float* const* w_scales, const int64_t* scale_strides,
                           const int64_t* ns, void* const* ys, ElemType y_type, int features,
                           cudaStream_t stream) {
  features = GemvFp8Features(m, k, features);
  if (features != 1 && features != 2 && features != 4) return cudaErrorInvalidValue;
  if (m < 0 || m > kGemvMaxRows || k <= 0 || k % kGroup != 0 || count < 1 ||
      count > kGemvMaxOutputs || ws == nullptr || w_scales == nullptr || scale_strides == nullptr ||
      ns == nullptr || ys == nullptr || (y_type != ElemType::kF32 && y_type != ElemType::kBF16)) {
    return cudaErrorInvalidValue;
  }
  Fp8GemvOutputs outs{};
  int64_t all_features = 0;
  for (int o = 0; o < count; ++o) all_features += ns[o] > 0 ? ns[o] : 0;
  const int ksplit = GemvFp8KSplit(all_features / features, k / kFp8Chunk);
  const int64_t per_block = kGemvFp8Warps / ksplit * features;
  int64_t blocks = 0;
  for (int o = 0; o < count; ++o) {
    if (ns[o] < 0 || ns[o] % kGroup != 0 || scale_strides[o] < k / kGroup) {
      return cudaErrorInvalidValue;
    }
    if (m > 0 && ns[o] > 0 && (ws[o] == nullptr || w_scales[o] == nullptr || ys[o] == nullptr)) {
      return cudaErrorInvalidValue;
    }
    outs.w[o] = ws[o];
    outs.scales[o] = w_scales[o];
    outs.scale_stride[o] = scale_strides[o];
    outs.y[o] = ys[o];
    outs.n[o] = ns[o];
    outs.first_block[o] = static_cast<int>(blocks);
    blocks += (ns[o] + per_block - 1) / per_block;
    if (blocks > INT32_MAX) return cudaErrorInvalidValue;
  }
  outs.first_block[count] = static_cast<int>(blocks);
  outs.count = count;
  if (m == 0 || blocks == 0) return cudaSuccess;
  if (x == nullptr) return cudaErrorInvalidValue;
  const auto* xb = static_cast<const __nv_bfloat16*>(x);
  switch (m) {
#define DXS_GEMV_FP8_CASE(R) \
  case R:                    \
    return LaunchGemvFp8Features<R>(xb, outs, k, ksplit, features, y_type, stream);
    DXS_GEMV_FP8_CASE(1)
    DXS_GEMV_FP8_CASE(2)
    DXS_GEMV_FP8_CASE(3)
    DXS_GEMV_FP8_CASE(4)
    DXS_GEMV_FP8_CASE(5)
    DXS_GEMV_FP8_CASE(6)
    DXS_GEMV_FP8_CASE(7)
    DXS_GEMV_FP8_CASE(8)
#undef DXS_GEMV_FP8_CASE
    default:
      return cudaErrorInvalidValue;
  }
}

cudaError_t LaunchGemvFp8(const void* x, int64_t m, const uint8_t* w, const float* w_scales,
                          int64_t scale_stride, int64_t n, int64_t k, void* y, ElemType y_type,
                          int features, cudaStream_t stream) {
  return LaunchGemvsFp8(x, m, k, 1, &w, &w_scales, &scale_stride, &n, &y, y_type, features, stream);
}

}  // namespace dxs::cuda
