// CUDA backend: memory, the stream and its events, the dense ops (cuBLAS GEMMs and the
// kernels of dense_ops.cu) and paged attention (attention.cu). Routing and the MoE
// exchange ops are in cuda_moe_backend.cc.
#include "kernels/cuda/cuda_backend.h"

#include <cublas_v2.h>
#include <cuda_runtime_api.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <map>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "common/status_macros.h"
#include "common/tunables.h"
#include "kernels/cuda/cuda_backend_impl.h"
#if DXS_HAVE_FLASHINFER
#include "kernels/cuda/flashinfer_attention.cuh"
#endif
#include "kernels/op_checks.h"

namespace dxs {

static_assert(static_cast<int>(DType::kF32) == static_cast<int>(cuda::ElemType::kF32) &&
                  static_cast<int>(DType::kF16) == static_cast<int>(cuda::ElemType::kF16) &&
                  static_cast<int>(DType::kBF16) == static_cast<int>(cuda::ElemType::kBF16) &&
                  static_cast<int>(DType::kI32) == static_cast<int>(cuda::ElemType::kI32) &&
                  static_cast<int>(DType::kI64) == static_cast<int>(cuda::ElemType::kI64),
              "cuda::ElemType mirrors DType");

namespace {

// Freed device blocks kept for reuse; beyond this they go back to cudaFree.
constexpr size_t kMaxCachedDeviceBytes = size_t{8} << 30;
// cuBLAS's own workspace, fixed so that its GEMMs can later be captured in CUDA graphs.
constexpr size_t kCublasWorkspaceBytes = size_t{32} << 20;
// Decode steps of at most this many (sequence, kv head) pairs may take decode_attention.cu's
// kernel (batch 8 at 4 kv heads; CudaBackend::UseDecodeAttention).
constexpr int64_t kDecodeAttentionMaxPairs = 32;
// ... and, by default, contexts of at most this many positions (measured on the H200 at
// batch 1 and 8: ahead of attention.cu's kernel at 1k, behind it at 4k; docs/gpu.md).
constexpr int64_t kDecodeAttentionMaxContext = 2048;

class CudaEvent final : public Event {
 public:
  explicit CudaEvent(cudaEvent_t event) : event_(event) {}
  ~CudaEvent() override { cudaEventDestroy(event_); }
  cudaEvent_t get() const { return event_; }

 private:
  cudaEvent_t event_;
};

cudaDataType_t CublasType(DType dtype) {
  switch (dtype) {
    case DType::kBF16:
      return CUDA_R_16BF;
    case DType::kF16:
      return CUDA_R_16F;
    default:
      return CUDA_R_32F;
  }
}

// An auto|off tunable: whether the path it names is on.
absl::StatusOr<bool> AutoOrOff(const tunables::Tunable& t) {
  DXS_ASSIGN_OR_RETURN(const std::string value, tunables::Read(t));
  return value != "off";
}

}  // namespace

absl::Status CudaStatus(cudaError_t error, const char* op) {
  if (error == cudaSuccess) return absl::OkStatus();
  return absl::InternalError(absl::StrCat(op, ": CUDA error ", cudaGetErrorName(error), " (",
                                          cudaGetErrorString(error), ")"));
}

absl::Status CublasStatus(const CublasApi& blas, cublasStatus_t status, const char* op) {
  if (status == CUBLAS_STATUS_SUCCESS) return absl::OkStatus();
  return absl::InternalError(absl::StrCat(op, ": cuBLAS error ", blas.status_name(status), " (",
                                          blas.status_string(status), ")"));
}

cuda::ElemType ToElemType(DType dtype) { return static_cast<cuda::ElemType>(dtype); }

int CudaDeviceCount() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    cudaGetLastError();  // clear the sticky "no driver" error for later callers
    return 0;
  }
  return count;
}

absl::StatusOr<std::unique_ptr<Backend>> MakeCudaBackend(int device_ordinal) {
  int count = 0;
  const cudaError_t error = cudaGetDeviceCount(&count);
  if (error != cudaSuccess) {
    cudaGetLastError();
    return absl::FailedPreconditionError(absl::StrCat("--device cuda: no usable GPU (",
                                                      cudaGetErrorName(error), ": ",
                                                      cudaGetErrorString(error), ")"));
  }
  if (device_ordinal < 0 || device_ordinal >= count) {
    return absl::FailedPreconditionError(
        absl::StrCat("--device cuda:", device_ordinal, ": ", count, " GPU(s) visible"));
  }
  auto backend = std::make_unique<CudaBackend>(device_ordinal);
  DXS_RETURN_IF_ERROR(backend->Init());
  return std::unique_ptr<Backend>(std::move(backend));
}

cudaStream_t CudaStreamOf(Backend* backend) {
  auto* cuda = dynamic_cast<CudaBackend*>(backend);
  return cuda != nullptr ? cuda->stream() : nullptr;
}

int64_t CudaSystemAllocations(Backend* backend) {
  auto* cuda = dynamic_cast<CudaBackend*>(backend);
  return cuda != nullptr ? cuda->allocator_stats().system_allocations : -1;
}

CudaBackend::CudaBackend(int device_ordinal) : device_(device_ordinal) {}

absl::Status CudaBackend::Init() {
  DXS_RETURN_IF_ERROR(CudaStatus(cudaSetDevice(device_), "cuda backend: set device"));
  DXS_RETURN_IF_ERROR(CudaStatus(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking),
                                 "cuda backend: create stream"));
  const int device = device_;
  auto make_pool = [device] {
    return CachingAllocator::Create(
        Device::kCuda,
        [device](size_t bytes) -> void* {
          void* p = nullptr;
          cudaSetDevice(device);
          if (cudaMalloc(&p, bytes) != cudaSuccess) {
            cudaGetLastError();  // out of memory is reported by the allocator, not sticky
            return nullptr;
          }
          return p;
        },
        [device](void* p, size_t) {
          cudaSetDevice(device);
          cudaFree(p);
        },
        kMaxCachedDeviceBytes);
  };
  graph_allocator_ = make_pool();
  allocator_ = make_pool();
  graph_allocator_->AddPeer(allocator_);
  allocator_->AddPeer(graph_allocator_);
  // Every tunable, the switches read where they act included (FlashInfer's attention when
  // first used, launch.cuh, gemv.cu and grouped_gemm.cc, read once): a bad value fails the
  // backend's creation, not a later step. The programs' mains have checked already; this is
  // for the backend made without one of them (tests, benchmarks).
  DXS_RETURN_IF_ERROR(tunables::Validate());
  DXS_ASSIGN_OR_RETURN(const std::string attention_choice,
                       tunables::Read(tunables::kCudaAttention));
  if (attention_choice == "dxs") {
    attention_choice_ = AttentionChoice::kDxs;
  } else if (attention_choice == "flashinfer") {
    if (!DXS_HAVE_FLASHINFER) {
      return absl::FailedPreconditionError(
          "DXS_CUDA_ATTENTION=flashinfer: this build has no FlashInfer (run scripts/setup.sh)");
    }
    attention_choice_ = AttentionChoice::kFlashInfer;
  }
  DXS_ASSIGN_OR_RETURN(fused_kv_write_, AutoOrOff(tunables::kCudaFusedKvWrite));
  DXS_ASSIGN_OR_RETURN(const std::string decode_choice,
                       tunables::Read(tunables::kCudaDecodeAttention));
  decode_choice_ = decode_choice == "on"    ? DecodeChoice::kOn
                   : decode_choice == "off" ? DecodeChoice::kOff
                                            : DecodeChoice::kAuto;
  DXS_ASSIGN_OR_RETURN(use_gemv_, AutoOrOff(tunables::kCudaGemv));
  DXS_ASSIGN_OR_RETURN(const std::string gemv_fp8_features,
                       tunables::Read(tunables::kCudaGemvFp8Features));
  gemv_fp8_features_ = gemv_fp8_features == "auto" ? 0 : std::stoi(gemv_fp8_features);
  DXS_ASSIGN_OR_RETURN(const std::string ll_status, tunables::Read(tunables::kCudaLlStatus));
  ll_status_by_copy_ = ll_status == "copy";
  DXS_ASSIGN_OR_RETURN(const bool routed_swiglu, AutoOrOff(tunables::kCudaRoutedSwiGlu));
  use_routed_swiglu_ = use_gemv_ && routed_swiglu;
  DXS_ASSIGN_OR_RETURN(const bool scale_sum_scan, AutoOrOff(tunables::kCudaScaleSumScan));
  use_scale_sum_scan_ = use_gemv_ && scale_sum_scan;
  DXS_ASSIGN_OR_RETURN(const bool fused_route, AutoOrOff(tunables::kCudaFusedRoute));
  use_fused_route_ = use_gemv_ && fused_route;
  DXS_ASSIGN_OR_RETURN(const std::string choice, tunables::Read(tunables::kCudaGroupedGemm));
  cudaDeviceProp prop;
  DXS_RETURN_IF_ERROR(CudaStatus(cudaGetDeviceProperties(&prop, device_), "cuda backend"));
  num_sms_ = prop.multiProcessorCount;
  const bool cutlass_runs = DXS_HAVE_CUTLASS && prop.major == 9;  // the SM90 kernels
  if (choice == "cutlass" && !cutlass_runs) {
    return absl::FailedPreconditionError(
        "DXS_CUDA_GROUPED_GEMM=cutlass: this build has no CUTLASS or the GPU is not sm_90");
  }
  use_cutlass_ = cutlass_runs && choice != "cublas";
  DXS_ASSIGN_OR_RETURN(blas_, LoadCublas());
  DXS_RETURN_IF_ERROR(CublasStatus(*blas_, blas_->create(&cublas_), "cuda backend: cuBLAS handle"));
  DXS_RETURN_IF_ERROR(
      CublasStatus(*blas_, blas_->set_stream(cublas_, stream_), "cuda backend: cuBLAS"));
  DXS_ASSIGN_OR_RETURN(cublas_workspace_, Workspace(kCublasWorkspaceBytes));
  // The fused router's last-block counter (route_decode.cu), zero from here on.
  DXS_ASSIGN_OR_RETURN(route_counter_, Allocate({1}, DType::kI32));
  DXS_RETURN_IF_ERROR(
      CudaStatus(cudaMemsetAsync(route_counter_.raw(), 0, route_counter_.num_bytes(), stream_),
                 "cuda backend: router counter"));
  // FP8 weights where cuBLASLt has the block-scaled FP8 matmul (Hopper and later) and loads;
  // elsewhere FP8 checkpoints are dequantized when loaded, as before.
  DXS_ASSIGN_OR_RETURN(const bool fp8_weights, AutoOrOff(tunables::kCudaFp8Weights));
  if (fp8_weights && prop.major >= 9) {
    absl::StatusOr<const CublasLtApi*> lt = LoadCublasLt();
    if (lt.ok() && (*lt)->create(&lt_handle_) == CUBLAS_STATUS_SUCCESS) {
      lt_ = *lt;
      fp8_weights_ = true;
      fp8_grouped_gemm_ = cutlass_runs;
    }
  }
  DXS_ASSIGN_OR_RETURN(const bool side_streams, AutoOrOff(tunables::kCudaFp8SideStreams));
  if (fp8_weights_ && side_streams) {
    DXS_RETURN_IF_ERROR(CudaStatus(cudaEventCreateWithFlags(&fp8_fork_, cudaEventDisableTiming),
                                   "cuda backend: fp8 side streams"));
    for (SideStream& side : fp8_side_) {
      DXS_RETURN_IF_ERROR(CudaStatus(cudaStreamCreateWithFlags(&side.stream, cudaStreamNonBlocking),
                                     "cuda backend: fp8 side streams"));
      DXS_RETURN_IF_ERROR(CudaStatus(cudaEventCreateWithFlags(&side.done, cudaEventDisableTiming),
                                     "cuda backend: fp8 side streams"));
      DXS_ASSIGN_OR_RETURN(side.workspace, Workspace(kCublasWorkspaceBytes));
    }
  }
  DXS_ASSIGN_OR_RETURN(const std::string l2_prefetch, tunables::Read(tunables::kCudaL2Prefetch));
  // Each setting takes the hints of the one before it too.
  l2_prefetch_ = l2_prefetch == "all"         ? L2Prefetch::kAll
                 : l2_prefetch == "attention" ? L2Prefetch::kAttention
                                              : L2Prefetch::kOff;
  if (l2_prefetch_ != L2Prefetch::kOff) {
    DXS_RETURN_IF_ERROR(
        CudaStatus(cudaStreamCreateWithFlags(&l2_prefetch_stream_, cudaStreamNonBlocking),
                   "cuda backend: l2 prefetch stream"));
    for (cudaEvent_t* e : {&l2_prefetch_fork_, &l2_prefetch_done_}) {
      DXS_RETURN_IF_ERROR(CudaStatus(cudaEventCreateWithFlags(e, cudaEventDisableTiming),
                                     "cuda backend: l2 prefetch stream"));
    }
  }
  DXS_ASSIGN_OR_RETURN(const std::string fp8_gemm, tunables::Read(tunables::kCudaFp8Gemm));
  if (fp8_gemm == "cutlass" && !cutlass_runs) {
    return absl::FailedPreconditionError(
        "DXS_CUDA_FP8_GEMM=cutlass: this build has no CUTLASS or the GPU is not sm_90");
  }
  fp8_gemm_cutlass_ = fp8_gemm == "cutlass";
  return CublasStatus(
      *blas_, blas_->set_workspace(cublas_, cublas_workspace_.raw(), cublas_workspace_.num_bytes()),
      "cuda backend: cuBLAS workspace");
}

CudaBackend::~CudaBackend() {
  cudaSetDevice(device_);
  if (stream_ != nullptr) cudaStreamSynchronize(stream_);
  if (cublas_ != nullptr) blas_->destroy(cublas_);
  {
    absl::MutexLock lock(&fp8_mu_);
    fp8_plans_.clear();
    fp8_dense_weights_.clear();
  }
  if (lt_handle_ != nullptr) lt_->destroy(lt_handle_);
  if (l2_prefetch_stream_ != nullptr) {
    cudaStreamSynchronize(l2_prefetch_stream_);
    cudaStreamDestroy(l2_prefetch_stream_);
  }
  for (cudaEvent_t e : {l2_prefetch_fork_, l2_prefetch_done_}) {
    if (e != nullptr) cudaEventDestroy(e);
  }
  for (SideStream& side : fp8_side_) {
    if (side.stream != nullptr) cudaStreamSynchronize(side.stream);
    if (side.stream != nullptr) cudaStreamDestroy(side.stream);
    if (side.done != nullptr) cudaEventDestroy(side.done);
    side.workspace = Tensor();
  }
  if (fp8_fork_ != nullptr) cudaEventDestroy(fp8_fork_);
  cublas_workspace_ = Tensor();
  route_counter_ = Tensor();
  {
    absl::MutexLock lock(&flashinfer_mu_);
    flashinfer_.reset();
  }
  // The allocator outlives us while tensors remain; its blocks are stream-ordered on a
  // stream that is about to go, so everything queued has finished (synchronised above).
  if (stream_ != nullptr) cudaStreamDestroy(stream_);
}

absl::Status CudaBackend::Enter(const char* op) const {
  return CudaStatus(cudaSetDevice(device_), op);
}

absl::StatusOr<Tensor> CudaBackend::Allocate(std::vector<int64_t> shape, DType dtype) {
  DXS_ASSIGN_OR_RETURN(const int64_t n, CountElements("allocate", shape));
  CachingAllocator* pool = graph_mode_.load() ? graph_allocator_.get() : allocator_.get();
  DXS_ASSIGN_OR_RETURN(std::shared_ptr<Buffer> buffer,
                       pool->Allocate(static_cast<size_t>(n) * DTypeSize(dtype)));
  return Tensor(std::move(buffer), dtype, std::move(shape));
}

absl::StatusOr<Tensor> CudaBackend::Workspace(size_t bytes) {
  // i32 elements: there is no byte dtype; the size rounds up to whole words.
  return Allocate({static_cast<int64_t>((bytes + 3) / 4)}, DType::kI32);
}

// ---- Copies ----

static absl::Status CheckConvertible(const char* op, DType from, DType to) {
  if (from == to || (IsFloatDType(from) && IsFloatDType(to))) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(
      op, ": cannot convert ", std::string(DTypeName(from)), " to ", std::string(DTypeName(to))));
}

absl::Status CudaBackend::CopyFromHost(const void* src, DType src_dtype, Tensor* dst) {
  if (recording_.load()) {
    return absl::FailedPreconditionError(
        "copy from host: not while a graph is being recorded (stage it: CopyFromStaging)");
  }
  DXS_RETURN_IF_ERROR(CheckConvertible("copy from host", src_dtype, dst->dtype()));
  const size_t n = static_cast<size_t>(dst->num_elements());
  if (n == 0) return absl::OkStatus();
  DXS_RETURN_IF_ERROR(Enter("copy from host"));
  std::vector<uint8_t> converted;
  if (src_dtype != dst->dtype()) {
    // Converted on the host: weights arrive once, and host memory is plentiful.
    converted.resize(n * DTypeSize(dst->dtype()));
    std::vector<float> wide;
    const float* f32 = static_cast<const float*>(src);
    if (src_dtype != DType::kF32) {
      wide.resize(n);
      WidenToFloat32(src_dtype, src, n, wide.data());
      f32 = wide.data();
    }
    if (dst->dtype() == DType::kF32) {
      std::memcpy(converted.data(), f32, n * sizeof(float));
    } else {
      NarrowFromFloat32(dst->dtype(), f32, n, converted.data());
    }
    src = converted.data();
  }
  // From pageable memory, cudaMemcpyAsync returns once the source is staged, so `src` (and
  // `converted`) may go as soon as this returns.
  return CudaStatus(
      cudaMemcpyAsync(dst->raw(), src, dst->num_bytes(), cudaMemcpyHostToDevice, stream_),
      "copy from host");
}

absl::Status CudaBackend::CopyToHost(const Tensor& src, DType dst_dtype, void* dst) {
  if (recording_.load()) {
    return absl::FailedPreconditionError("copy to host: not while a graph is being recorded");
  }
  DXS_RETURN_IF_ERROR(CheckConvertible("copy to host", src.dtype(), dst_dtype));
  const int64_t n = src.num_elements();
  if (n == 0) return absl::OkStatus();
  DXS_RETURN_IF_ERROR(Enter("copy to host"));
  Tensor from = src;
  if (src.dtype() != dst_dtype) {
    DXS_ASSIGN_OR_RETURN(from, Allocate({n}, dst_dtype));
    DXS_RETURN_IF_ERROR(
        CudaStatus(cuda::LaunchConvert(src.raw(), ToElemType(src.dtype()), from.raw(),
                                       ToElemType(dst_dtype), n, stream_),
                   "copy to host: convert"));
  }
  DXS_RETURN_IF_ERROR(CudaStatus(
      cudaMemcpyAsync(dst, from.raw(), from.num_bytes(), cudaMemcpyDeviceToHost, stream_),
      "copy to host"));
  return CudaStatus(cudaStreamSynchronize(stream_), "copy to host: synchronize");
}

absl::Status CudaBackend::Copy(const Tensor& src, Tensor* dst) {
  DXS_RETURN_IF_ERROR(CheckSameElements("copy", src, *dst));
  DXS_RETURN_IF_ERROR(CheckConvertible("copy", src.dtype(), dst->dtype()));
  if (src.num_elements() == 0) return absl::OkStatus();
  DXS_RETURN_IF_ERROR(Enter("copy"));
  if (src.dtype() == dst->dtype()) {
    return CudaStatus(
        cudaMemcpyAsync(dst->raw(), src.raw(), src.num_bytes(), cudaMemcpyDeviceToDevice, stream_),
        "copy");
  }
  return CudaStatus(cuda::LaunchConvert(src.raw(), ToElemType(src.dtype()), dst->raw(),
                                        ToElemType(dst->dtype()), src.num_elements(), stream_),
                    "copy");
}

absl::Status CudaBackend::Fill(Tensor* t, float value) {
  if (t->num_elements() == 0) return absl::OkStatus();
  DXS_RETURN_IF_ERROR(Enter("fill"));
  if (value == 0.f) {
    return CudaStatus(cudaMemsetAsync(t->raw(), 0, t->num_bytes(), stream_), "fill");
  }
  return CudaStatus(
      cuda::LaunchFill(t->raw(), ToElemType(t->dtype()), t->num_elements(), value, stream_),
      "fill");
}

absl::Status CudaBackend::FillUniform(Tensor* t, uint64_t seed, double mean, double half_width,
                                      DType values_dtype) {
  if (!IsFloatDType(t->dtype()) || !IsFloatDType(values_dtype)) {
    return absl::InvalidArgumentError("fill uniform: floating tensors only");
  }
  if (t->num_elements() == 0) return absl::OkStatus();
  DXS_RETURN_IF_ERROR(Enter("fill uniform"));
  return CudaStatus(
      cuda::LaunchFillUniform(t->raw(), ToElemType(t->dtype()), t->num_elements(), seed, mean,
                              half_width, ToElemType(values_dtype), stream_),
      "fill uniform");
}

// ---- Graphs ----

namespace {

class CudaGraph final : public Graph {
 public:
  CudaGraph(cudaGraph_t graph, cudaGraphExec_t exec,
            std::vector<std::function<absl::Status(cudaEvent_t)>> before_replay)
      : graph_(graph), exec_(exec), before_replay_(std::move(before_replay)) {}
  ~CudaGraph() override {
    if (done_ != nullptr) {
      cudaEventSynchronize(done_);
      cudaEventDestroy(done_);
    }
    before_replay_.clear();  // what they own may be read by the graph: it is done now
    cudaGraphExecDestroy(exec_);
    cudaGraphDestroy(graph_);
  }
  // Host work before a launch (FlashInfer's plan from the staged lengths), given the event
  // after the previous launch (null before the first), then the launch and that event.
  absl::Status Launch(cudaStream_t stream) {
    for (const auto& hook : before_replay_) DXS_RETURN_IF_ERROR(hook(done_));
    DXS_RETURN_IF_ERROR(CudaStatus(cudaGraphLaunch(exec_, stream), "replay graph"));
    if (before_replay_.empty()) return absl::OkStatus();
    if (done_ == nullptr) {
      DXS_RETURN_IF_ERROR(CudaStatus(cudaEventCreateWithFlags(&done_, cudaEventDisableTiming),
                                     "replay graph: event"));
    }
    return CudaStatus(cudaEventRecord(done_, stream), "replay graph: event");
  }

 private:
  cudaGraph_t graph_;
  cudaGraphExec_t exec_;
  std::vector<std::function<absl::Status(cudaEvent_t)>> before_replay_;
  cudaEvent_t done_ = nullptr;
};

}  // namespace

absl::StatusOr<std::shared_ptr<Buffer>> CudaBackend::AllocateStaging(size_t bytes) {
  DXS_RETURN_IF_ERROR(Enter("staging memory"));
  void* p = nullptr;
  DXS_RETURN_IF_ERROR(CudaStatus(
      cudaHostAlloc(&p, std::max<size_t>(bytes, 1), cudaHostAllocDefault), "staging memory"));
  return std::make_shared<Buffer>(Device::kCpu, p, bytes, [](void* q) { cudaFreeHost(q); });
}

namespace {

// AllocateShared's key: the IPC handle, then the block's size, the exporting process and
// the block's address there (a key of this process is opened as the block itself: CUDA
// refuses to open its own handles).
struct SharedKey {
  cudaIpcMemHandle_t handle;
  uint64_t bytes;
  uint64_t pid;
  uint64_t address;
};

// This process's shared blocks, by address (OpenShared of its own keys).
absl::Mutex shared_mu;
std::map<uint64_t, std::weak_ptr<Buffer>>& OwnSharedBlocks()
    ABSL_EXCLUSIVE_LOCKS_REQUIRED(shared_mu) {
  static auto* blocks = new std::map<uint64_t, std::weak_ptr<Buffer>>();
  return *blocks;
}

}  // namespace

absl::StatusOr<SharedMemory> CudaBackend::AllocateShared(size_t bytes) {
  DXS_RETURN_IF_ERROR(Enter("shared memory"));
  void* p = nullptr;
  DXS_RETURN_IF_ERROR(CudaStatus(cudaMalloc(&p, std::max<size_t>(bytes, 1)), "shared memory"));
  SharedKey key = {};
  if (absl::Status s = CudaStatus(cudaIpcGetMemHandle(&key.handle, p), "shared memory handle");
      !s.ok()) {
    cudaFree(p);
    return s;
  }
  key.bytes = bytes;
  key.pid = static_cast<uint64_t>(getpid());
  key.address = reinterpret_cast<uint64_t>(p);
  auto buffer = std::make_shared<Buffer>(Device::kCuda, p, bytes, [](void* q) {
    {
      absl::MutexLock lock(&shared_mu);
      OwnSharedBlocks().erase(reinterpret_cast<uint64_t>(q));
    }
    cudaFree(q);
  });
  {
    absl::MutexLock lock(&shared_mu);
    OwnSharedBlocks()[key.address] = buffer;
  }
  return SharedMemory{buffer, std::string(reinterpret_cast<const char*>(&key), sizeof(key))};
}

absl::StatusOr<std::shared_ptr<Buffer>> CudaBackend::OpenShared(std::string_view key_bytes) {
  SharedKey key;
  if (key_bytes.size() != sizeof(key)) {
    return absl::InvalidArgumentError(
        absl::StrCat("a shared memory key of ", key_bytes.size(), " bytes, not ", sizeof(key)));
  }
  std::memcpy(&key, key_bytes.data(), sizeof(key));
  if (key.pid == static_cast<uint64_t>(getpid())) {
    absl::MutexLock lock(&shared_mu);
    auto it = OwnSharedBlocks().find(key.address);
    std::shared_ptr<Buffer> own = it == OwnSharedBlocks().end() ? nullptr : it->second.lock();
    if (own == nullptr || own->num_bytes() != key.bytes) {
      return absl::InvalidArgumentError("no shared memory block of this process has that key");
    }
    return own;
  }
  DXS_RETURN_IF_ERROR(Enter("open shared memory"));
  void* p = nullptr;
  DXS_RETURN_IF_ERROR(CudaStatus(
      cudaIpcOpenMemHandle(&p, key.handle, cudaIpcMemLazyEnablePeerAccess), "open shared memory"));
  return std::make_shared<Buffer>(Device::kCuda, p, key.bytes,
                                  [](void* q) { cudaIpcCloseMemHandle(q); });
}

absl::Status CudaBackend::CopyFromStaging(const Buffer& staging, size_t offset, Tensor* dst) {
  if (offset + dst->num_bytes() > staging.num_bytes()) {
    return absl::InvalidArgumentError("copy from staging: past the staging buffer");
  }
  if (dst->num_bytes() == 0) return absl::OkStatus();
  DXS_RETURN_IF_ERROR(Enter("copy from staging"));
  return CudaStatus(
      cudaMemcpyAsync(dst->raw(), static_cast<const uint8_t*>(staging.data()) + offset,
                      dst->num_bytes(), cudaMemcpyHostToDevice, stream_),
      "copy from staging");
}

absl::Status CudaBackend::CopyToStaging(const Tensor& src, const Buffer& staging, size_t offset) {
  if (offset + src.num_bytes() > staging.num_bytes()) {
    return absl::InvalidArgumentError("copy to staging: past the staging buffer");
  }
  if (src.num_bytes() == 0) return absl::OkStatus();
  DXS_RETURN_IF_ERROR(Enter("copy to staging"));
  // Pinned memory (AllocateStaging): the copy is queued behind the work writing src and the
  // host goes on.
  return CudaStatus(cudaMemcpyAsync(static_cast<uint8_t*>(staging.data()) + offset, src.raw(),
                                    src.num_bytes(), cudaMemcpyDeviceToHost, stream_),
                    "copy to staging");
}

absl::StatusOr<CapturedGraph> CudaBackend::CaptureGraph(
    const std::function<absl::StatusOr<Tensor>()>& body, Tensor* eager_output) {
  DXS_RETURN_IF_ERROR(Enter("capture graph"));
  if (graph_mode_.exchange(true)) {
    return absl::FailedPreconditionError("capture graph: a capture is already under way");
  }
  struct Leave {
    std::atomic<bool>* mode;
    ~Leave() { mode->store(false); }
  } leave{&graph_mode_};
  // Warm-up: the body once, for real, so that the pool holds every block it needs and
  // lazily made tables exist before recording (unless the caller says they do).
  if (eager_output != nullptr) {
    absl::StatusOr<Tensor> eager = body();
    if (!eager.ok()) return eager.status();
    *eager_output = *eager;
    DXS_RETURN_IF_ERROR(CudaStatus(cudaStreamSynchronize(stream_), "capture graph: warm-up"));
  }
  DXS_RETURN_IF_ERROR(CudaStatus(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeRelaxed),
                                 "capture graph: begin"));
  {
    absl::MutexLock lock(&flashinfer_mu_);
    capture_hooks_.clear();
    capture_plan_ = nullptr;
  }
  recording_.store(true);
  absl::StatusOr<Tensor> recorded = body();
  recording_.store(false);
  // A capture must not end with a branch left open, whatever the body returned.
  const absl::Status joined = JoinL2Prefetch();
  if (recorded.ok() && !joined.ok()) recorded = joined;
  std::vector<std::function<absl::Status(cudaEvent_t)>> hooks;
  {
    absl::MutexLock lock(&flashinfer_mu_);
    hooks = std::move(capture_hooks_);
    capture_hooks_.clear();
    capture_plan_ = nullptr;
  }
  cudaGraph_t graph = nullptr;
  const cudaError_t end = cudaStreamEndCapture(stream_, &graph);
  if (!recorded.ok()) {
    if (graph != nullptr) cudaGraphDestroy(graph);
    return recorded.status();
  }
  DXS_RETURN_IF_ERROR(CudaStatus(end, "capture graph: end"));
  cudaGraphExec_t exec = nullptr;
  const cudaError_t made = cudaGraphInstantiate(&exec, graph, 0);
  if (made != cudaSuccess) {
    cudaGraphDestroy(graph);
    return CudaStatus(made, "capture graph: instantiate");
  }
  // Uploaded now, not at the first launch: an upload then can wait for work that spins
  // on this very graph's answers (the low-latency exchange's ranks sharing one GPU).
  cudaError_t up = cudaGraphUpload(exec, stream_);
  if (up == cudaSuccess) up = cudaStreamSynchronize(stream_);
  if (up != cudaSuccess) {
    cudaGraphExecDestroy(exec);
    cudaGraphDestroy(graph);
    return CudaStatus(up, "capture graph: upload");
  }
  CapturedGraph out;
  out.graph = std::make_unique<CudaGraph>(graph, exec, std::move(hooks));
  out.output = *recorded;
  return out;
}

// The hinted weights' bytes up to this much a hint: what a hint brings in must still be in L2
// (50 MB on an H100 or H200) when its op reads it.
constexpr size_t kL2PrefetchMaxBytes = size_t{24} << 20;
// And for ops of up to this many rows: at batch 1 a layer's attention reads 2 MB of KV (1024
// positions) and the o-projection from L2 made the 48-layer step 2-4% faster; at batch 32 the
// KV read (67 MB a layer) competes with the prefetch and evicts it, 0.5-1.6% slower; batch 8
// neutral (H100, results/fp8.md).
constexpr int64_t kL2PrefetchMaxRows = 4;

absl::Status CudaBackend::PrefetchWeights(const std::vector<const Tensor*>& weights,
                                          PrefetchWhile during, int64_t rows) {
  // Only while a decode graph records: there the branch is joined before the capture ends
  // (CaptureGraph), and each replay runs it beside the step. Eager steps take no hints, so no
  // prefetch can outlive the weights it reads.
  const bool wanted = l2_prefetch_ >= (during == PrefetchWhile::kAttention ? L2Prefetch::kAttention
                                                                           : L2Prefetch::kAll);
  if (!wanted || !recording() || rows > kL2PrefetchMaxRows) return absl::OkStatus();
  size_t bytes = 0;
  for (const Tensor* w : weights) {
    // A hint: anything the bulk prefetch cannot take (not on this device, not 16-byte aligned)
    // leaves the step without it.
    if (w == nullptr || !w->defined() || w->device() != Device::kCuda || !Aligned16(w->raw())) {
      return absl::OkStatus();
    }
    bytes += w->num_bytes();
  }
  if (bytes == 0 || bytes > kL2PrefetchMaxBytes) return absl::OkStatus();
  DXS_RETURN_IF_ERROR(Enter("prefetch weights"));
  // The branch: the prefetch stream waits for what stream_ has queued, then prefetches.
  DXS_RETURN_IF_ERROR(
      CudaStatus(cudaEventRecord(l2_prefetch_fork_, stream_), "prefetch weights: fork"));
  DXS_RETURN_IF_ERROR(CudaStatus(cudaStreamWaitEvent(l2_prefetch_stream_, l2_prefetch_fork_, 0),
                                 "prefetch weights: fork"));
  l2_prefetch_open_ = true;
  for (const Tensor* w : weights) {
    DXS_RETURN_IF_ERROR(CudaStatus(
        cuda::LaunchPrefetchL2(w->raw(), w->num_bytes(), l2_prefetch_stream_), "prefetch weights"));
  }
  return absl::OkStatus();
}

absl::Status CudaBackend::JoinL2Prefetch() {
  if (!l2_prefetch_open_) return absl::OkStatus();
  l2_prefetch_open_ = false;
  DXS_RETURN_IF_ERROR(CudaStatus(cudaEventRecord(l2_prefetch_done_, l2_prefetch_stream_),
                                 "prefetch weights: join"));
  return CudaStatus(cudaStreamWaitEvent(stream_, l2_prefetch_done_, 0), "prefetch weights: join");
}

absl::Status CudaBackend::Replay(Graph* graph) {
  DXS_RETURN_IF_ERROR(Enter("replay graph"));
  return static_cast<CudaGraph*>(graph)->Launch(stream_);
}

// ---- Queue and events ----

absl::StatusOr<std::unique_ptr<Event>> CudaBackend::CreateEvent() {
  DXS_RETURN_IF_ERROR(Enter("create event"));
  cudaEvent_t event = nullptr;
  DXS_RETURN_IF_ERROR(
      CudaStatus(cudaEventCreateWithFlags(&event, cudaEventDisableTiming), "create event"));
  return std::unique_ptr<Event>(new CudaEvent(event));
}

absl::Status CudaBackend::RecordEvent(Event* event) {
  DXS_RETURN_IF_ERROR(Enter("record event"));
  return CudaStatus(cudaEventRecord(static_cast<CudaEvent*>(event)->get(), stream_),
                    "record event");
}

absl::Status CudaBackend::WaitEvent(Event* event) {
  DXS_RETURN_IF_ERROR(Enter("wait event"));
  return CudaStatus(cudaStreamWaitEvent(stream_, static_cast<CudaEvent*>(event)->get(), 0),
                    "wait event");
}

absl::Status CudaBackend::SynchronizeEvent(Event* event) {
  return CudaStatus(cudaEventSynchronize(static_cast<CudaEvent*>(event)->get()),
                    "synchronize event");
}

absl::Status CudaBackend::Synchronize() {
  if (recording_.load()) {
    return absl::FailedPreconditionError("synchronize: not while a graph is being recorded");
  }
  DXS_RETURN_IF_ERROR(Enter("synchronize"));
  return CudaStatus(cudaStreamSynchronize(stream_), "synchronize");
}

// ---- Dense ops ----

absl::Status CudaBackend::Gemm(const void* x, const void* w, DType in_dtype, int64_t m, int64_t n,
                               int64_t k, void* y, DType out_dtype, float beta, const char* op) {
  // Row-major y[m, n] = x[m, k] w[n, k]^T is column-major y^T = w^T(op T) x^T: cuBLAS's
  // A = w (k x n column-major, transposed), B = x (k x m column-major).
  const float alpha = 1.f;
  return CublasStatus(
      *blas_,
      blas_->gemm_ex(cublas_, CUBLAS_OP_T, CUBLAS_OP_N, static_cast<int>(n), static_cast<int>(m),
                     static_cast<int>(k), &alpha, w, CublasType(in_dtype), static_cast<int>(k), x,
                     CublasType(in_dtype), static_cast<int>(k), &beta, y, CublasType(out_dtype),
                     static_cast<int>(n), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
      op);
}

absl::Status CudaBackend::Linear(const Tensor& x, const Tensor& w, const Tensor* bias, Tensor* y) {
  if (w.dtype() == DType::kF8E4M3) return LinearFp8(x, w, bias, y);
  DXS_RETURN_IF_ERROR(CheckFloat("linear", x, "x"));
  DXS_RETURN_IF_ERROR(CheckFloat("linear", w, "w"));
  DXS_RETURN_IF_ERROR(CheckFloat("linear", *y, "y"));
  const int64_t m = x.rows(), k = x.row_size(), n = w.rows();
  if (w.row_size() != k || y->num_elements() != m * n ||
      (bias != nullptr && bias->num_elements() != n)) {
    return absl::InvalidArgumentError(absl::StrCat("linear: x ", x.ShapeString(), ", w ",
                                                   w.ShapeString(), ", y ", y->ShapeString()));
  }
  if (x.dtype() != w.dtype()) {
    return absl::InvalidArgumentError(absl::StrCat("linear: x is ",
                                                   std::string(DTypeName(x.dtype())), ", w is ",
                                                   std::string(DTypeName(w.dtype()))));
  }
  if (y->dtype() != x.dtype() && y->dtype() != DType::kF32) {
    return absl::InvalidArgumentError(absl::StrCat("linear: y is ",
                                                   std::string(DTypeName(y->dtype())), " for ",
                                                   std::string(DTypeName(x.dtype()))));
  }
  if (m == 0) return absl::OkStatus();
  DXS_RETURN_IF_ERROR(Enter("linear"));
  // A decode step's few rows: one pass over the weights (gemv.cu) beats a GEMM's tiles.
  if (bias == nullptr && TakesGemv(x, w, *y)) {
    return CudaStatus(cuda::LaunchGemvBf16(x.raw(), ToElemType(x.dtype()), m, w.raw(), n, k,
                                           y->raw(), ToElemType(y->dtype()), stream_),
                      "linear (gemv)");
  }
  float beta = 0.f;
  if (bias != nullptr) {
    // The bias broadcast into y first (a gather of row 0 of the bias m times), then the
    // GEMM accumulates onto it.
    DXS_ASSIGN_OR_RETURN(Tensor zeros, Allocate({m}, DType::kI32));
    DXS_RETURN_IF_ERROR(
        CudaStatus(cudaMemsetAsync(zeros.raw(), 0, zeros.num_bytes(), stream_), "linear: bias"));
    DXS_RETURN_IF_ERROR(
        CudaStatus(cuda::LaunchGatherRows(bias->raw(), ToElemType(bias->dtype()), 1, zeros.i32(), m,
                                          n, y->raw(), ToElemType(y->dtype()), stream_),
                   "linear: bias"));
    beta = 1.f;
  }
  return Gemm(x.raw(), w.raw(), x.dtype(), m, n, k, y->raw(), y->dtype(), beta, "linear");
}

bool CudaBackend::TakesGemv(const Tensor& x, const Tensor& w, const Tensor& y) const {
  return use_gemv_ && x.dtype() == DType::kBF16 && w.dtype() == DType::kBF16 &&
         (y.dtype() == DType::kBF16 || y.dtype() == DType::kF32) &&
         x.rows() <= cuda::kGemvMaxRows && x.row_size() % 8 == 0 && w.row_size() == x.row_size() &&
         Aligned16(x.raw()) && Aligned16(w.raw());
}

absl::Status CudaBackend::Linears(const Tensor& x, const std::vector<const Tensor*>& ws,
                                  const std::vector<Tensor*>& ys) {
  // One gemv.cu launch for all of them where each Linear alone would take the GEMV path.
  bool one_launch = !ws.empty() && ws.size() == ys.size() &&
                    ws.size() <= static_cast<size_t>(cuda::kGemvMaxOutputs);
  for (size_t i = 0; one_launch && i < ws.size(); ++i) {
    one_launch = ws[i] != nullptr && ys[i] != nullptr && TakesGemv(x, *ws[i], *ys[i]) &&
                 ys[i]->dtype() == ys[0]->dtype() &&
                 ys[i]->num_elements() == x.rows() * ws[i]->rows();
  }
  // Otherwise the FP8 GEMV's one launch, or one Linear each (LinearsFp8).
  if (!one_launch) return LinearsFp8(x, ws, ys);
  if (x.rows() == 0) return absl::OkStatus();
  DXS_RETURN_IF_ERROR(Enter("linears"));
  std::vector<const void*> w_ptrs;
  std::vector<int64_t> ns;
  std::vector<void*> y_ptrs;
  for (size_t i = 0; i < ws.size(); ++i) {
    w_ptrs.push_back(ws[i]->raw());
    ns.push_back(ws[i]->rows());
    y_ptrs.push_back(ys[i]->raw());
  }
  return CudaStatus(cuda::LaunchGemvsBf16(x.raw(), ToElemType(x.dtype()), x.rows(), x.row_size(),
                                          static_cast<int>(ws.size()), w_ptrs.data(), ns.data(),
                                          y_ptrs.data(), ToElemType(ys[0]->dtype()), stream_),
                    "linears (gemv)");
}

// Block-scaled FP8 weights sharing a decode-sized x (q, k and v): one fp8_linear.cu GEMV
// launch where each LinearFp8 alone would take the GEMV; otherwise LinearsFp8Gemm.
absl::Status CudaBackend::LinearsFp8(const Tensor& x, const std::vector<const Tensor*>& ws,
                                     const std::vector<Tensor*>& ys) {
  bool one_launch = use_gemv_ && fp8_weights_ && !ws.empty() && ws.size() == ys.size() &&
                    ws.size() <= static_cast<size_t>(cuda::kGemvMaxOutputs) &&
                    x.dtype() == DType::kBF16 && x.rows() <= cuda::kGemvMaxRows &&
                    x.row_size() % Tensor::kWeightBlock == 0 && Aligned16(x.raw());
  for (size_t i = 0; one_launch && i < ws.size(); ++i) {
    const Tensor* w = ws[i];
    one_launch = w != nullptr && ys[i] != nullptr && w->dtype() == DType::kF8E4M3 &&
                 w->block_scales() != nullptr && w->shape().size() == 2 &&
                 w->row_size() == x.row_size() && w->rows() % Tensor::kWeightBlock == 0 &&
                 w->block_scales()->row_size() == BlockScaleStride(x.row_size()) &&
                 Aligned16(w->raw()) && ys[i]->dtype() == ys[0]->dtype() &&
                 (ys[i]->dtype() == DType::kBF16 || ys[i]->dtype() == DType::kF32) &&
                 ys[i]->num_elements() == x.rows() * w->rows();
  }
  if (!one_launch) return LinearsFp8Gemm(x, ws, ys);
  if (x.rows() == 0) return absl::OkStatus();
  DXS_RETURN_IF_ERROR(Enter("linears"));
  std::vector<const uint8_t*> w_ptrs;
  std::vector<const float*> scale_ptrs;
  std::vector<int64_t> strides, ns;
  std::vector<void*> y_ptrs;
  for (size_t i = 0; i < ws.size(); ++i) {
    w_ptrs.push_back(static_cast<const uint8_t*>(ws[i]->raw()));
    scale_ptrs.push_back(ws[i]->block_scales()->f32());
    strides.push_back(ws[i]->block_scales()->row_size());
    ns.push_back(ws[i]->rows());
    y_ptrs.push_back(ys[i]->raw());
  }
  return CudaStatus(
      cuda::LaunchGemvsFp8(x.raw(), x.rows(), x.row_size(), static_cast<int>(ws.size()),
                           w_ptrs.data(), scale_ptrs.data(), strides.data(), ns.data(),
                           y_ptrs.data(), ToElemType(ys[0]->dtype()), gemv_fp8_features_, stream_),
      "linears (fp8 gemv)");
}

absl::Status CudaBackend::RmsNorm(const Tensor& x, const Tensor& weight, float eps, Tensor* y) {
  DXS_RETURN_IF_ERROR(CheckSameElements("rms norm", x, *y));
  DXS_RETURN_IF_ERROR(CheckFloat("rms norm", x, "x"));
  DXS_RETURN_IF_ERROR(CheckFloat("rms norm", weight, "weight"));
  DXS_RETURN_IF_ERROR(CheckFloat("rms norm", *y, "y"));
  const int64_t d = weight.num_elements();
  if (d == 0 || x.num_elements() % d != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("rms norm: rows of ", d, " do not tile ", x.ShapeString()));
  }
  if (x.num_elements() == 0) return absl::OkStatus();
  DXS_RETURN_IF_ERROR(Enter("rms norm"));
  return CudaStatus(
      cuda::LaunchRmsNorm(x.raw(), ToElemType(x.dtype()), weight.raw(), ToElemType(weight.dtype()),
                          eps, x.num_elements() / d, d, y->raw(), ToElemType(y->dtype()), stream_),
      "rms norm");
}

absl::Status CudaBackend::Embedding(const Tensor& table, const Tensor& ids, Tensor* y) {
  DXS_RETURN_IF_ERROR(CheckDType("embedding", ids, DType::kI32, "ids"));
  DXS_RETURN_IF_ERROR(CheckFloat("embedding", table, "table"));
  DXS_RETURN_IF_ERROR(CheckFloat("embedding", *y, "y"));
  const int64_t d = table.row_size(), n = ids.num_elements();
  if (y->num_elements() != n * d) {
    return absl::InvalidArgumentError(
        absl::StrCat("embedding: ", n, " ids into ", y->ShapeString()));
  }
  if (n == 0) return absl::OkStatus();
  DXS_RETURN_IF_ERROR(Enter("embedding"));
  return CudaStatus(
      cuda::LaunchEmbedding(table.raw(), ToElemType(table.dtype()), table.rows(), ids.i32(), n, d,
                            y->raw(), ToElemType(y->dtype()), stream_),
      "embedding");
}

absl::Status CudaBackend::Rope(Tensor* x, const Tensor& positions, double theta) {
  DXS_RETURN_IF_ERROR(CheckDType("rope", positions, DType::kI32, "positions"));
  DXS_RETURN_IF_ERROR(CheckFloat("rope", *x, "x"));
  if (x->shape().size() != 3 || x->dim(2) % 2 != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("rope: x ", x->ShapeString(), " is not [tokens, heads, even head_dim]"));
  }
  const int64_t tokens = x->dim(0), heads = x->dim(1), d = x->dim(2);
  if (positions.num_elements() != tokens) {
    return absl::InvalidArgumentError(
        absl::StrCat("rope: ", positions.num_elements(), " positions for ", tokens, " tokens"));
  }
  if (x->num_elements() == 0) return absl::OkStatus();
  DXS_RETURN_IF_ERROR(Enter("rope"));
  return CudaStatus(cuda::LaunchRope(x->raw(), ToElemType(x->dtype()), positions.i32(), tokens,
                                     heads, d, static_cast<float>(theta), stream_),
                    "rope");
}

absl::Status CudaBackend::SiluMul(const Tensor& gate, const Tensor& up, Tensor* out) {
  DXS_RETURN_IF_ERROR(CheckSameElements("silu mul", gate, up));
  DXS_RETURN_IF_ERROR(CheckSameElements("silu mul", gate, *out));
  DXS_RETURN_IF_ERROR(CheckFloat("silu mul", gate, "gate"));
  DXS_RETURN_IF_ERROR(CheckFloat("silu mul", up, "up"));
  DXS_RETURN_IF_ERROR(CheckFloat("silu mul", *out, "out"));
  if (gate.num_elements() == 0) return absl::OkStatus();
  DXS_RETURN_IF_ERROR(Enter("silu mul"));
  return CudaStatus(
      cuda::LaunchSiluMul(gate.raw(), ToElemType(gate.dtype()), up.raw(), ToElemType(up.dtype()),
                          out->raw(), ToElemType(out->dtype()), gate.num_elements(), stream_),
      "silu mul");
}

absl::Status CudaBackend::Add(const Tensor& x, Tensor* inout) {
  DXS_RETURN_IF_ERROR(CheckSameElements("add", x, *inout));
  DXS_RETURN_IF_ERROR(CheckFloat("add", x, "x"));
  DXS_RETURN_IF_ERROR(CheckFloat("add", *inout, "inout"));
  if (x.num_elements() == 0) return absl::OkStatus();
  DXS_RETURN_IF_ERROR(Enter("add"));
  return CudaStatus(cuda::LaunchAdd(x.raw(), ToElemType(x.dtype()), inout->raw(),
                                    ToElemType(inout->dtype()), x.num_elements(), stream_),
                    "add");
}

absl::Status CudaBackend::AddRmsNorm(const Tensor& x, const Tensor& weight, float eps,
                                     Tensor* residual, Tensor* y) {
  DXS_RETURN_IF_ERROR(CheckAddRmsNormArgs(x, weight, *residual, *y));
  if (x.num_elements() == 0) return absl::OkStatus();
  DXS_RETURN_IF_ERROR(Enter("add rms norm"));
  const int64_t d = weight.num_elements();
  return CudaStatus(
      cuda::LaunchAddRmsNorm(x.raw(), ToElemType(x.dtype()), residual->f32(), weight.raw(),
                             ToElemType(weight.dtype()), eps, x.num_elements() / d, d, y->raw(),
                             ToElemType(y->dtype()), stream_),
      "add rms norm");
}

// QkNormRope's arguments, and the CUDA kernel's one more demand: weights of one dtype.
static absl::Status CheckCudaQkNormRopeArgs(const Tensor& q, const Tensor& k,
                                            const Tensor& q_weight, const Tensor& k_weight,
                                            const Tensor& positions) {
  DXS_RETURN_IF_ERROR(CheckQkNormRopeArgs(q, k, q_weight, k_weight, positions));
  if (q_weight.dtype() != k_weight.dtype()) {
    return absl::InvalidArgumentError("qk norm rope: q_weight and k_weight differ in dtype");
  }
  return absl::OkStatus();
}

absl::Status CudaBackend::QkNormRope(Tensor* q, Tensor* k, const Tensor& q_weight,
                                     const Tensor& k_weight, float eps, const Tensor& positions,
                                     double theta) {
  DXS_RETURN_IF_ERROR(CheckCudaQkNormRopeArgs(*q, *k, q_weight, k_weight, positions));
  if (q->num_elements() + k->num_elements() == 0) return absl::OkStatus();
  DXS_RETURN_IF_ERROR(Enter("qk norm rope"));
  return CudaStatus(cuda::LaunchQkNormRope(
                        q->raw(), k->raw(), ToElemType(q->dtype()), q_weight.raw(), k_weight.raw(),
                        ToElemType(q_weight.dtype()), positions.i32(), q->dim(0), q->dim(1),
                        k->dim(1), q->dim(2), eps, static_cast<float>(theta), stream_),
                    "qk norm rope");
}

absl::Status CudaBackend::GatherRows(const Tensor& src, const Tensor& rows, Tensor* dst) {
  DXS_RETURN_IF_ERROR(CheckDType("gather rows", rows, DType::kI32, "rows"));
  DXS_RETURN_IF_ERROR(CheckConvertible("gather rows", src.dtype(), dst->dtype()));
  const int64_t n = rows.num_elements(), d = src.row_size();
  if (dst->rows() < n || dst->row_size() != d) {
    return absl::InvalidArgumentError(absl::StrCat(
        "gather rows: ", n, " rows of ", src.ShapeString(), " into ", dst->ShapeString()));
  }
  if (n == 0 || d == 0) return absl::OkStatus();
  DXS_RETURN_IF_ERROR(Enter("gather rows"));
  return CudaStatus(
      cuda::LaunchGatherRows(src.raw(), ToElemType(src.dtype()), src.rows(), rows.i32(), n, d,
                             dst->raw(), ToElemType(dst->dtype()), stream_),
      "gather rows");
}

// ---- Paged attention ----

absl::Status CudaBackend::WriteKvCache(const Tensor& k, const Tensor& v,
                                       const PagedAttentionMeta& meta, Tensor* k_cache,
                                       Tensor* v_cache) {
  const int64_t tokens = k.rows();
  DXS_RETURN_IF_ERROR(CheckPagedAttentionMeta("write KV cache", meta, tokens));
  if (tokens == 0) return absl::OkStatus();
  const int64_t row = k.row_size();
  const int64_t num_slots = k_cache->dim(0) * k_cache->dim(1);
  if (k_cache->num_elements() != num_slots * row || v.row_size() != row ||
      v_cache->num_elements() != k_cache->num_elements() || k.dtype() != v.dtype() ||
      k_cache->dtype() != v_cache->dtype()) {
    return absl::InvalidArgumentError(
        absl::StrCat("write KV cache: rows of ", row, " into a cache ", k_cache->ShapeString()));
  }
  DXS_RETURN_IF_ERROR(CheckConvertible("write KV cache", k.dtype(), k_cache->dtype()));
  DXS_RETURN_IF_ERROR(Enter("write KV cache"));
  return CudaStatus(cuda::LaunchWriteKvCache(k.raw(), v.raw(), ToElemType(k.dtype()),
                                             meta.slot_mapping.i64(), tokens, row, k_cache->raw(),
                                             v_cache->raw(), ToElemType(k_cache->dtype()), stream_),
                    "write KV cache");
}

absl::Status CudaBackend::QkNormRopeWriteKv(Tensor* q, Tensor* k, const Tensor& v,
                                            const Tensor& q_weight, const Tensor& k_weight,
                                            float eps, const Tensor& positions, double theta,
                                            const PagedAttentionMeta& meta, Tensor* k_cache,
                                            Tensor* v_cache) {
  // One kernel where every tensor of the pass shares a dtype and the cache rows are k's heads;
  // otherwise (and with DXS_CUDA_FUSED_KV_WRITE=off) the two ops, which check the rest.
  const bool fusable = fused_kv_write_ && q->shape().size() == 3 && k->shape().size() == 3 &&
                       v.shape() == k->shape() && k_cache->shape().size() == 4 &&
                       k_cache->dim(2) == k->dim(1) && k_cache->dim(3) == k->dim(2) &&
                       v_cache->shape() == k_cache->shape() && q->dtype() == k->dtype() &&
                       v.dtype() == k->dtype() && k_cache->dtype() == k->dtype() &&
                       v_cache->dtype() == k->dtype();
  if (!fusable) {
    return Backend::QkNormRopeWriteKv(q, k, v, q_weight, k_weight, eps, positions, theta, meta,
                                      k_cache, v_cache);
  }
  DXS_RETURN_IF_ERROR(CheckCudaQkNormRopeArgs(*q, *k, q_weight, k_weight, positions));
  const int64_t tokens = k->dim(0);
  DXS_RETURN_IF_ERROR(CheckPagedAttentionMeta("write KV cache", meta, tokens));
  if (q->num_elements() + k->num_elements() == 0) return absl::OkStatus();
  DXS_RETURN_IF_ERROR(Enter("qk norm rope + KV write"));
  return CudaStatus(cuda::LaunchQkNormRopeWriteKv(
                        q->raw(), k->raw(), v.raw(), ToElemType(q->dtype()), q_weight.raw(),
                        k_weight.raw(), ToElemType(q_weight.dtype()), positions.i32(), q->dim(0),
                        q->dim(1), k->dim(1), q->dim(2), eps, static_cast<float>(theta),
                        meta.slot_mapping.i64(), k_cache->raw(), v_cache->raw(), stream_),
                    "qk norm rope + KV write");
}

absl::Status CudaBackend::PagedAttention(const Tensor& q, const Tensor& k_cache,
                                         const Tensor& v_cache, const PagedAttentionMeta& meta,
                                         float scale, Tensor* out) {
  if (q.shape().size() != 3) {
    return absl::InvalidArgumentError(
        absl::StrCat("paged attention: q ", q.ShapeString(), ", cache ", k_cache.ShapeString()));
  }
  const int64_t tokens = q.dim(0), heads = q.dim(1), d = q.dim(2);
  DXS_RETURN_IF_ERROR(CheckPagedAttentionMeta("paged attention", meta, tokens));
  // An empty step (a DP rank with no requests) may come before any page exists: the
  // cache is checked, and anything launched, only when there are tokens (as on the CPU).
  if (tokens == 0) return absl::OkStatus();
  if (k_cache.shape().size() != 4) {
    return absl::InvalidArgumentError(
        absl::StrCat("paged attention: q ", q.ShapeString(), ", cache ", k_cache.ShapeString()));
  }
  const int64_t kv_heads = k_cache.dim(2);
  if (k_cache.dim(3) != d || kv_heads <= 0 || heads % kv_heads != 0 ||
      k_cache.dim(1) != meta.block_size || v_cache.shape() != k_cache.shape() ||
      out->num_elements() != tokens * heads * d || k_cache.dtype() != v_cache.dtype()) {
    return absl::InvalidArgumentError(absl::StrCat("paged attention: q ", q.ShapeString(),
                                                   ", cache ", k_cache.ShapeString(), ", out ",
                                                   out->ShapeString()));
  }
  DXS_RETURN_IF_ERROR(CheckFloat("paged attention", q, "q"));
  DXS_RETURN_IF_ERROR(CheckFloat("paged attention", k_cache, "k_cache"));
  DXS_RETURN_IF_ERROR(CheckFloat("paged attention", *out, "out"));
  DXS_RETURN_IF_ERROR(Enter("paged attention"));
  cuda::PagedAttentionArgs args;
  args.num_seqs = meta.num_seqs;
  args.num_tokens = tokens;
  args.num_heads = heads;
  args.num_kv_heads = kv_heads;
  args.head_dim = d;
  args.block_size = meta.block_size;
  args.max_blocks_per_seq = meta.max_blocks_per_seq;
  args.max_query_len = meta.max_query_len;
  args.max_context_len = meta.max_context_len;
  args.query_start = meta.query_start.i32();
  args.context_lens = meta.context_lens.i32();
  args.block_tables = meta.block_tables.i32();
  args.num_blocks = k_cache.dim(0);
  if (UseDecodeAttention(q, k_cache, meta, *out)) {
    const int splits = cuda::DecodeAttentionSplits(meta.num_seqs, kv_heads, num_sms_);
    const size_t bytes = cuda::DecodeAttentionWorkspaceBytes(args, splits);
    DXS_ASSIGN_OR_RETURN(Tensor workspace, Workspace(bytes));
    DXS_ASSIGN_OR_RETURN(int32_t * counters, DecodeCounters(tokens * kv_heads));
    return CudaStatus(
        cuda::LaunchDecodeAttention(q.raw(), ToElemType(q.dtype()), k_cache.raw(), v_cache.raw(),
                                    ToElemType(k_cache.dtype()), args, scale, out->raw(),
                                    ToElemType(out->dtype()), splits, workspace.raw(), bytes,
                                    counters, stream_),
        "paged attention (decode)");
  }
#if DXS_HAVE_FLASHINFER
  if (UseFlashInfer(q, k_cache, meta, *out)) {
    absl::MutexLock lock(&flashinfer_mu_);
    if (flashinfer_ == nullptr) flashinfer_.reset(cuda::CreateFlashInferAttention());
    cudaError_t e;
    if (recording_.load()) {
      // One plan per recording, remade before each replay from the staged lengths.
      const bool first = capture_plan_ == nullptr;
      e = cuda::RecordFlashInferAttention(flashinfer_.get(), &capture_plan_, q.raw(), k_cache.raw(),
                                          v_cache.raw(), args, meta.host_query_start,
                                          meta.host_context_lens, scale, out->raw(), stream_);
      if (first && capture_plan_ != nullptr) {
        std::shared_ptr<cuda::FlashInferGraphPlan> plan(capture_plan_,
                                                        cuda::DestroyFlashInferGraphPlan);
        cudaStream_t stream = stream_;
        capture_hooks_.push_back([plan, stream](cudaEvent_t last_replay_done) -> absl::Status {
          const cudaError_t r =
              cuda::RefreshFlashInferGraphPlan(plan.get(), last_replay_done, stream);
          if (r == cudaSuccess) return absl::OkStatus();
          return absl::InternalError(
              absl::StrCat("replay graph: ", cuda::FlashInferGraphPlanError(plan.get()), ": ",
                           cudaGetErrorString(r)));
        });
      }
    } else {
      // A padded decode step run eagerly plans as its graph would: the same bits.
      e = cuda::LaunchFlashInferAttention(flashinfer_.get(), q.raw(), k_cache.raw(), v_cache.raw(),
                                          args, meta.host_query_start, meta.host_context_lens,
                                          scale, out->raw(), stream_,
                                          /*graph_plan=*/meta.padded_decode);
    }
    if (e == cudaSuccess) return absl::OkStatus();
    return absl::InternalError(absl::StrCat(
        "paged attention (FlashInfer): ", cuda::FlashInferAttentionError(flashinfer_.get()), ": ",
        cudaGetErrorString(e)));
  }
#endif
  const size_t workspace_bytes = cuda::PagedAttentionWorkspaceBytes(args);
  void* workspace = nullptr;
  Tensor workspace_t;
  if (workspace_bytes > 0) {
    DXS_ASSIGN_OR_RETURN(workspace_t, Workspace(workspace_bytes));
    workspace = workspace_t.raw();
  }
  return CudaStatus(
      cuda::LaunchPagedAttention(q.raw(), ToElemType(q.dtype()), k_cache.raw(), v_cache.raw(),
                                 ToElemType(k_cache.dtype()), args, scale, out->raw(),
                                 ToElemType(out->dtype()), workspace, workspace_bytes, stream_),
      "paged attention");
}

bool CudaBackend::UseDecodeAttention(const Tensor& q, const Tensor& k_cache,
                                     const PagedAttentionMeta& meta, const Tensor& out) const {
  if (decode_choice_ == DecodeChoice::kOff || attention_choice_ == AttentionChoice::kFlashInfer ||
      meta.max_query_len > 1) {
    return false;
  }
  const int64_t kv_heads = k_cache.dim(2);
  if (meta.num_seqs * kv_heads > kDecodeAttentionMaxPairs) return false;
  // auto: where FlashInfer's kernel would not run (eager decode steps without host lengths, bound
  // by the host's launches: one launch instead of attention.cu's kernel and split merge),
  // over short contexts (its CUDA-core dot products fall behind attention.cu's tensor cores
  // from 4k positions). In ForwardDecode's graphs it measured at parity with FlashInfer's
  // (docs/gpu.md), which stays there; on takes every small decode step.
  if (decode_choice_ == DecodeChoice::kAuto &&
      (meta.max_context_len > kDecodeAttentionMaxContext || UseFlashInfer(q, k_cache, meta, out))) {
    return false;
  }
  return cuda::DecodeAttentionSupports(ToElemType(q.dtype()), ToElemType(k_cache.dtype()),
                                       ToElemType(out.dtype()), q.dim(1), kv_heads, q.dim(2));
}

absl::StatusOr<int32_t*> CudaBackend::DecodeCounters(int64_t count) {
  absl::MutexLock lock(&decode_mu_);
  if (!decode_counters_.defined() || decode_counters_.num_elements() < count) {
    if (recording_.load()) {
      return absl::FailedPreconditionError(
          "paged attention (decode): its counters grow only outside a graph recording");
    }
    // Zeros from here on: each launch leaves them as it found them.
    DXS_ASSIGN_OR_RETURN(decode_counters_, Allocate({std::max<int64_t>(count, 1024)}, DType::kI32));
    DXS_RETURN_IF_ERROR(CudaStatus(
        cudaMemsetAsync(decode_counters_.raw(), 0, decode_counters_.num_bytes(), stream_),
        "paged attention (decode): counters"));
  }
  return static_cast<int32_t*>(decode_counters_.raw());
}

bool CudaBackend::UseFlashInfer(const Tensor& q, const Tensor& k_cache,
                                const PagedAttentionMeta& meta, const Tensor& out) const {
#if DXS_HAVE_FLASHINFER
  if (attention_choice_ == AttentionChoice::kDxs) return false;
  // auto: an eager decode step (one query per sequence) outside ForwardDecode is bound by
  // the host's launches, and ours launches fewer kernels (no page-list compaction): ours
  // there. ForwardDecode's padded steps take FlashInfer's graph plan, recorded or not.
  if (attention_choice_ == AttentionChoice::kAuto && !recording_.load() &&
      meta.max_query_len <= 1 && !meta.padded_decode) {
    return false;
  }
  return meta.host_query_start != nullptr && meta.host_context_lens != nullptr &&
         cuda::FlashInferAttentionSupports(ToElemType(q.dtype()), ToElemType(k_cache.dtype()),
                                           ToElemType(out.dtype()), q.dim(1), k_cache.dim(2),
                                           q.dim(2));
#else
  (void)q, (void)k_cache, (void)meta, (void)out;
  return false;
#endif
}

void CudaBackend::FlashInferDeleter::operator()(cuda::FlashInferAttention* fi) const {
#if DXS_HAVE_FLASHINFER
  cuda::DestroyFlashInferAttention(fi);
#else
  (void)fi;
#endif
}

}  // namespace dxs
