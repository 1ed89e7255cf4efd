// Host side of the grouped GEMM (grouped_gemm.cuh): argument checks, the device query and
// the choice of CUTLASS instantiation (grouped_gemm_sm90_*.cu). No CUTLASS here, so this
// builds (and rejects what it must) without it too.
#include "kernels/cuda/grouped_gemm.cuh"

#include <cstdint>
#include <limits>
#include <string>

#include "common/tunables.h"
#include "kernels/cuda/grouped_gemm_fp8_sm90.h"
#include "kernels/cuda/grouped_gemm_sm90.h"

#ifndef DXS_HAVE_CUTLASS
#define DXS_HAVE_CUTLASS 0
#endif

namespace dxs::cuda {
namespace {

constexpr int64_t kInt32Max = std::numeric_limits<int32_t>::max();

bool AlignedTo(const void* p, size_t bytes) { return reinterpret_cast<uintptr_t>(p) % bytes == 0; }

// The checks that need no pointers: they hold for empty batches too.
bool SizesOk(int64_t num_experts, int64_t total_rows, int64_t n, int64_t k, ElemType c_type) {
  if (c_type != ElemType::kBF16 && c_type != ElemType::kF32) return false;
  if (num_experts < 0 || total_rows < 0 || n <= 0 || k <= 0) return false;
  if (num_experts >= kInt32Max || total_rows > kInt32Max || n > kInt32Max || k > kInt32Max) {
    return false;
  }
  if (total_rows > 0 && num_experts == 0) return false;  // rows and no expert to own them
  // TMA: every row of A, B and C starts on 16 bytes.
  const int64_t c_row_align = c_type == ElemType::kBF16 ? 8 : 4;
  return k % 8 == 0 && n % c_row_align == 0;
}

#if DXS_HAVE_CUTLASS
struct Device {
  int id = 0;
  int sm_count = 0;
  bool is_sm90 = false;
};

cudaError_t QueryDevice(Device* device) {
  int major = 0, minor = 0;
  cudaError_t err = cudaGetDevice(&device->id);
  if (err == cudaSuccess) {
    err = cudaDeviceGetAttribute(&device->sm_count, cudaDevAttrMultiProcessorCount, device->id);
  }
  if (err == cudaSuccess) {
    err = cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device->id);
  }
  if (err == cudaSuccess) {
    err = cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device->id);
  }
  // The kernels are sm_90a cubins, which run on compute capability 9.0 only.
  device->is_sm90 = major == 9 && minor == 0;
  return err;
}

// Up to this many rows an expert on average, the 64-row ping-pong tiles (decode); up to
// kLargeTileMaxRowsPerExpert the 128x128 cooperative ones; above, 128x256 without clusters.
// DXS_GROUPED_GEMM_TILES=small|large|wide1|wide (read once) forces one, for measurements
// (wide: the 128x256 tiles in 2x1 clusters, measured slower; grouped_gemm_sm90.cuh).
constexpr int64_t kSmallTileMaxRowsPerExpert = 64;
constexpr int64_t kLargeTileMaxRowsPerExpert = 128;

enum class Tiles { kAuto, kSmall, kLarge, kWide, kWide1 };

Tiles ForcedTiles() {
  static const Tiles forced = [] {
    const std::string v = tunables::Get(tunables::kGroupedGemmTiles);
    return v == "small"   ? Tiles::kSmall
           : v == "large" ? Tiles::kLarge
           : v == "wide"  ? Tiles::kWide
           : v == "wide1" ? Tiles::kWide1
                          : Tiles::kAuto;
  }();
  return forced;
}

// The fields the bf16 and the FP8 problems share.
template <class P>
void SetCommon(P* p, const int32_t* expert_offsets, int64_t num_experts, int64_t total_rows,
               int64_t n, int64_t k, void* c, const Device& device, void* workspace,
               size_t workspace_bytes, cudaStream_t stream) {
  p->expert_offsets = expert_offsets;
  p->num_experts = static_cast<int32_t>(num_experts);
  p->total_rows = static_cast<int32_t>(total_rows);
  p->n = static_cast<int32_t>(n);
  p->k = static_cast<int32_t>(k);
  p->c = c;
  p->device = device.id;
  p->sm_count = device.sm_count;
  p->workspace = workspace;
  p->workspace_bytes = workspace_bytes;
  p->stream = stream;
}

const grouped_gemm::Sm90Kernel& PickKernel(int64_t num_experts, int64_t total_rows,
                                           ElemType c_type) {
  Tiles tiles = ForcedTiles();
  if (tiles == Tiles::kAuto) {
    tiles = total_rows <= kSmallTileMaxRowsPerExpert * num_experts   ? Tiles::kSmall
            : total_rows <= kLargeTileMaxRowsPerExpert * num_experts ? Tiles::kLarge
                                                                     : Tiles::kWide1;
  }
  const bool bf16 = c_type == ElemType::kBF16;
  switch (tiles) {
    case Tiles::kSmall:
      return bf16 ? grouped_gemm::kSm90SmallBf16Out : grouped_gemm::kSm90SmallF32Out;
    case Tiles::kLarge:
      return bf16 ? grouped_gemm::kSm90LargeBf16Out : grouped_gemm::kSm90LargeF32Out;
    case Tiles::kWide1:
      return bf16 ? grouped_gemm::kSm90Wide1Bf16Out : grouped_gemm::kSm90Wide1F32Out;
    default:
      return bf16 ? grouped_gemm::kSm90WideBf16Out : grouped_gemm::kSm90WideF32Out;
  }
}
#endif

}  // namespace

size_t GroupedGemmWorkspaceBytes(int64_t num_experts, int64_t total_rows, int64_t n, int64_t k,
                                 ElemType c_type) {
#if DXS_HAVE_CUTLASS
  if (!SizesOk(num_experts, total_rows, n, k, c_type)) return 0;
  Device device;
  if (QueryDevice(&device) != cudaSuccess) {
    cudaGetLastError();  // the query's error is not the caller's next launch's
    return 0;
  }
  return PickKernel(num_experts, total_rows, c_type)
      .workspace_bytes(static_cast<int32_t>(num_experts), device.sm_count);
#else
  return 0;
#endif
}

cudaError_t LaunchGroupedGemmBf16(const __nv_bfloat16* a, const int32_t* expert_offsets,
                                  const __nv_bfloat16* const* b_ptrs, int64_t num_experts,
                                  int64_t total_rows, int64_t n, int64_t k, void* c,
                                  ElemType c_type, void* workspace, size_t workspace_bytes,
                                  cudaStream_t stream) {
  if (!SizesOk(num_experts, total_rows, n, k, c_type)) return cudaErrorInvalidValue;
  if (total_rows == 0) return cudaSuccess;  // no rows: no launch, no CUDA call at all
  if (a == nullptr || expert_offsets == nullptr || b_ptrs == nullptr || c == nullptr ||
      workspace == nullptr) {
    return cudaErrorInvalidValue;
  }
  if (!AlignedTo(a, 16) || !AlignedTo(c, 16) || !AlignedTo(expert_offsets, sizeof(int32_t)) ||
      !AlignedTo(b_ptrs, sizeof(void*)) ||
      !AlignedTo(workspace, grouped_gemm::kWorkspaceAlignment)) {
    return cudaErrorInvalidValue;
  }
#if DXS_HAVE_CUTLASS
  Device device;
  if (cudaError_t err = QueryDevice(&device); err != cudaSuccess) return err;
  if (!device.is_sm90) return cudaErrorNotSupported;
  const grouped_gemm::Sm90Kernel& kernel = PickKernel(num_experts, total_rows, c_type);
  grouped_gemm::Problem p;
  p.a = a;
  p.b_ptrs = b_ptrs;
  SetCommon(&p, expert_offsets, num_experts, total_rows, n, k, c, device, workspace,
            workspace_bytes, stream);
  if (workspace_bytes < kernel.workspace_bytes(p.num_experts, p.sm_count)) {
    return cudaErrorInvalidValue;
  }
  return kernel.run(p);
#else
  return cudaErrorNotSupported;
#endif
}

#if DXS_HAVE_CUTLASS
// Up to this many rows an expert on average (a decode step's groups), the FP8 grouped GEMM
// takes 64x128 ping-pong tiles; above, 128x128 cooperative ones. H100, 48-layer decode in
// CUDA graphs: the step 6% faster at 2 rows an expert (batch 32) and the grouped GEMMs 10%
// at 8 (batch 128); eager FFN calls at 64 rows an expert 1.4% slower, and a 4096-token
// prefill (256 rows) 5% slower (docs/results/fp8.md, "Tile choice").
constexpr int64_t kFp8PingpongMaxRowsPerExpert = 32;

// The FP8 grouped GEMM's configuration (grouped_gemm_fp8_sm90.cuh). f32 C has the cooperative
// tiles only. DXS_CUDA_FP8_GROUPED_TILES (read once) forces one for a bf16 C, for measurements.
const grouped_gemm::Sm90Fp8Kernel& Fp8Kernel(int64_t num_experts, int64_t total_rows,
                                             ElemType c_type) {
  static const std::string tiles = tunables::Get(tunables::kCudaFp8GroupedTiles);
  if (c_type != ElemType::kBF16) return grouped_gemm::kSm90Fp8F32Out;
  if (tiles == "coop") return grouped_gemm::kSm90Fp8Bf16Out;
  if (tiles == "coop-pair-n") return grouped_gemm::kSm90Fp8PairNBf16Out;
  if (tiles == "pingpong" || total_rows <= kFp8PingpongMaxRowsPerExpert * num_experts) {
    return grouped_gemm::kSm90Fp8PingpongBf16Out;
  }
  return grouped_gemm::kSm90Fp8Bf16Out;
}
#endif

size_t GroupedGemmFp8WorkspaceBytes(int64_t num_experts, int64_t total_rows, int64_t n, int64_t k,
                                    ElemType c_type) {
#if DXS_HAVE_CUTLASS
  if (!SizesOk(num_experts, total_rows, n, k, c_type) || n % 128 != 0 || k % 128 != 0) return 0;
  Device device;
  if (QueryDevice(&device) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  const grouped_gemm::Sm90Fp8Kernel& kernel = Fp8Kernel(num_experts, total_rows, c_type);
  return kernel.workspace_bytes(static_cast<int32_t>(num_experts), device.sm_count);
#else
  return 0;
#endif
}

cudaError_t LaunchGroupedGemmFp8(const uint8_t* a, const float* sfa, const int32_t* expert_offsets,
                                 const void* const* b_ptrs, const float* const* sfb_ptrs,
                                 int64_t num_experts, int64_t total_rows, int64_t n, int64_t k,
                                 void* c, ElemType c_type, void* workspace, size_t workspace_bytes,
                                 cudaStream_t stream) {
  if (!SizesOk(num_experts, total_rows, n, k, c_type) || n % 128 != 0 || k % 128 != 0) {
    return cudaErrorInvalidValue;
  }
  if (total_rows == 0) return cudaSuccess;
  if (a == nullptr || sfa == nullptr || expert_offsets == nullptr || b_ptrs == nullptr ||
      sfb_ptrs == nullptr || c == nullptr || workspace == nullptr) {
    return cudaErrorInvalidValue;
  }
  if (!AlignedTo(a, 16) || !AlignedTo(c, 16) || !AlignedTo(sfa, sizeof(float)) ||
      !AlignedTo(expert_offsets, sizeof(int32_t)) || !AlignedTo(b_ptrs, sizeof(void*)) ||
      !AlignedTo(sfb_ptrs, sizeof(void*)) ||
      !AlignedTo(workspace, grouped_gemm::kWorkspaceAlignment)) {
    return cudaErrorInvalidValue;
  }
#if DXS_HAVE_CUTLASS
  Device device;
  if (cudaError_t err = QueryDevice(&device); err != cudaSuccess) return err;
  if (!device.is_sm90) return cudaErrorNotSupported;
  const grouped_gemm::Sm90Fp8Kernel& kernel = Fp8Kernel(num_experts, total_rows, c_type);
  grouped_gemm::Fp8Problem p;
  p.a = a;
  p.sfa = sfa;
  p.b_ptrs = b_ptrs;
  p.sfb_ptrs = sfb_ptrs;
  SetCommon(&p, expert_offsets, num_experts, total_rows, n, k, c, device, workspace,
            workspace_bytes, stream);
  if (workspace_bytes < kernel.workspace_bytes(p.num_experts, p.sm_count)) {
    return cudaErrorInvalidValue;
  }
  return kernel.run(p);
#else
  return cudaErrorNotSupported;
#endif
}

}  // namespace dxs::cuda
