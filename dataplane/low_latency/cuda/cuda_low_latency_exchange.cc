// The low-latency exchange on the CUDA backend (dataplane/low_latency/low_latency_exchange.h):
// one rank's receive region (Backend::AllocateShared: CUDA IPC between processes, the block
// itself in one process), its LlSync, the peers' regions mapped here, and the rounds as the
// launches of ll_exchange.cuh on the backend's stream. Nothing here synchronises with the
// host except CheckStatus, so a decode step that runs the rounds can be captured.
#include "dataplane/low_latency/cuda/cuda_low_latency_exchange.h"

#include <cuda_runtime_api.h>

#include <cstring>
#include <memory>
#include <numeric>
#include <string>
#include <type_traits>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "dataplane/low_latency/cuda/ll_exchange.cuh"
#include "kernels/cuda/cuda_backend_impl.h"

namespace dxs {
namespace {

class CudaLowLatencyExchange final : public LowLatencyExchange {
 public:
  CudaLowLatencyExchange(CudaBackend* backend, const LowLatencyShape& shape, LowLatencySide side,
                         int rank)
      : backend_(backend), shape_(shape), side_(side), rank_(rank) {}

  absl::Status Init() {
    const LowLatencyShape& s = shape_;
    const int own_side =
        side_ == LowLatencySide::kAttention ? s.num_attention_ranks : s.num_expert_ranks;
    if (s.num_attention_ranks < 1 || s.num_expert_ranks < 1 || s.capacity < 1 || s.hidden < 1 ||
        s.top_k < 1 || s.num_experts < 1 || s.timeout_ns <= 0 || rank_ < 0 || rank_ >= own_side) {
      return absl::InvalidArgumentError(absl::StrCat(
          "low-latency exchange: ", s.num_attention_ranks, " attention and ", s.num_expert_ranks,
          " expert ranks, capacity ", s.capacity, ", hidden ", s.hidden, ", top-", s.top_k, " of ",
          s.num_experts, ", rank ", rank_, ", timeout ", s.timeout_ns, " ns"));
    }
    const int64_t record_bytes = Fp8RecordBytes(s.hidden);
    if (s.fp8_rows && record_bytes % 16 != 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("low-latency exchange: FP8 rows are records of ", record_bytes,
                       " bytes at hidden ", s.hidden,
                       "; they go as 16-byte vectors, so hidden must be a "
                       "multiple of 512 (the host-driven exchange takes any)"));
    }
    dispatch_ = s.fp8_rows ? cuda::MakeLlRecordRegionLayout(s.num_attention_ranks, s.capacity,
                                                            static_cast<int>(record_bytes), s.top_k)
                           : cuda::MakeLlRegionLayout(s.num_attention_ranks, s.capacity, s.hidden,
                                                      s.top_k, cuda::ElemType::kBF16);
    combine_ = cuda::MakeLlRegionLayout(s.num_expert_ranks, s.capacity, s.hidden, 0,
                                        cuda::ElemType::kBF16);
    if (dispatch_.bytes == 0 || combine_.bytes == 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "low-latency exchange: at most ", cuda::kLlMaxRanks, " ranks a side, top_k <= ",
          cuda::kLlMaxTopK, ", bf16 rows of a multiple of 16 bytes (hidden ", s.hidden, ")"));
    }
    const cuda::LlRegionLayout& own = receive_layout();
    DXS_ASSIGN_OR_RETURN(region_, backend_->AllocateShared(own.bytes));
    DXS_RETURN_IF_ERROR(backend_->Enter("low-latency exchange"));
    // Zeroed once: flags at epoch 0, no counts (the rounds never reset anything).
    DXS_RETURN_IF_ERROR(CudaStatus(cudaMemset(region_.buffer->data(), 0, own.bytes),
                                   "low-latency exchange: zero the region"));
    // Two snapshots the host reads without a copy: CheckStatus's and Progress's, the
    // latter on a stream of its own (it reads while the rank's queue is busy).
    void* mapped = nullptr;
    DXS_RETURN_IF_ERROR(
        CudaStatus(cudaHostAlloc(&mapped, 2 * sizeof(cuda::LlSnapshot), cudaHostAllocMapped),
                   "low-latency exchange: status memory"));
    snapshots_.reset(static_cast<cuda::LlSnapshot*>(mapped));
    DXS_RETURN_IF_ERROR(CudaStatus(cudaHostGetDevicePointer(&mapped, mapped, 0),
                                   "low-latency exchange: status memory"));
    snapshots_device_ = static_cast<cuda::LlSnapshot*>(mapped);
    cudaStream_t stream = nullptr;
    DXS_RETURN_IF_ERROR(CudaStatus(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking),
                                   "low-latency exchange: progress stream"));
    progress_stream_.reset(stream);
    static_assert(sizeof(cuda::LlSync) % sizeof(int64_t) == 0);
    DXS_ASSIGN_OR_RETURN(
        sync_, backend_->Zeros({static_cast<int64_t>(sizeof(cuda::LlSync) / sizeof(int64_t))},
                               DType::kI64));
    if (side_ == LowLatencySide::kExpert) {
      const int64_t slots = static_cast<int64_t>(s.num_attention_ranks) * s.capacity;
      const int64_t entries = slots * s.top_k;
      DXS_ASSIGN_OR_RETURN(bad_, backend_->Zeros({1}, DType::kI32));
      DXS_ASSIGN_OR_RETURN(pairs_.rows, backend_->Allocate({entries}, DType::kI32));
      DXS_ASSIGN_OR_RETURN(pairs_.experts, backend_->Allocate({entries}, DType::kI32));
      DXS_ASSIGN_OR_RETURN(pairs_.weights, backend_->Allocate({entries}, DType::kF32));
      DXS_ASSIGN_OR_RETURN(pairs_.out_rows, backend_->Allocate({entries}, DType::kI32));
      if (s.fp8_rows) {
        // The records in place, and the rows the experts read: dequantized by Receive.
        records_ = Tensor(region_.buffer, DType::kF8E4M3, {slots, record_bytes}, dispatch_.rows);
        DXS_ASSIGN_OR_RETURN(pairs_.x, backend_->Allocate({slots, s.hidden}, DType::kBF16));
      } else {
        pairs_.x = Tensor(region_.buffer, DType::kBF16, {slots, s.hidden},
                          dispatch_.rows / DTypeSize(DType::kBF16));
      }
    } else if (s.fp8_rows) {
      // A round's records before they go, and the rows they are of (0..capacity): made
      // here, so that a recorded step allocates nothing.
      DXS_ASSIGN_OR_RETURN(records_,
                           backend_->Allocate({s.capacity, record_bytes}, DType::kF8E4M3));
      std::vector<int32_t> rows(static_cast<size_t>(s.capacity));
      std::iota(rows.begin(), rows.end(), 0);
      DXS_ASSIGN_OR_RETURN(record_rows_, backend_->UploadIndices(rows));
    }
    return backend_->Synchronize();
  }

  const LowLatencyShape& shape() const override { return shape_; }
  LowLatencySide side() const override { return side_; }
  int rank() const override { return rank_; }
  const std::string& region_key() const override { return region_.key; }

  absl::Status Connect(const std::vector<std::string>& peer_keys) override {
    const size_t want = static_cast<size_t>(
        side_ == LowLatencySide::kAttention ? shape_.num_expert_ranks : shape_.num_attention_ranks);
    if (peer_keys.size() != want) {
      return absl::InvalidArgumentError(absl::StrCat("low-latency exchange: ", peer_keys.size(),
                                                     " peer regions, the other side has ", want,
                                                     " ranks"));
    }
    if (!peers_.empty()) return absl::FailedPreconditionError("low-latency exchange: connected");
    const size_t bytes = send_layout().bytes;
    std::vector<int64_t> bases;
    std::vector<std::shared_ptr<Buffer>> peers;
    for (size_t r = 0; r < peer_keys.size(); ++r) {
      absl::StatusOr<std::shared_ptr<Buffer>> peer = backend_->OpenShared(peer_keys[r]);
      if (!peer.ok()) {
        return absl::Status(peer.status().code(),
                            absl::StrCat("low-latency exchange: the region of peer rank ", r, ": ",
                                         peer.status().message()));
      }
      if ((*peer)->num_bytes() < bytes) {
        return absl::InvalidArgumentError(absl::StrCat("low-latency exchange: peer rank ", r,
                                                       "'s region has ", (*peer)->num_bytes(),
                                                       " bytes, this shape needs ", bytes));
      }
      bases.push_back(reinterpret_cast<int64_t>((*peer)->data()));
      peers.push_back(*std::move(peer));
    }
    DXS_ASSIGN_OR_RETURN(peer_table_,
                         backend_->Allocate({static_cast<int64_t>(bases.size())}, DType::kI64));
    DXS_RETURN_IF_ERROR(backend_->CopyFromHost(bases.data(), DType::kI64, &peer_table_));
    peers_ = std::move(peers);
    return absl::OkStatus();
  }

  absl::Status Dispatch(const Tensor& x, const Tensor& ids, const Tensor& weights,
                        const Tensor& expert_owner) override {
    DXS_RETURN_IF_ERROR(Ready(LowLatencySide::kAttention, "dispatch"));
    const int64_t tokens = x.rows();
    DXS_RETURN_IF_ERROR(CheckRouting("dispatch", tokens, ids, expert_owner));
    if (x.dtype() != DType::kBF16 || x.row_size() != shape_.hidden ||
        weights.dtype() != DType::kF32 || weights.num_elements() != ids.num_elements()) {
      return absl::InvalidArgumentError(
          absl::StrCat("low-latency dispatch: x ", x.ShapeString(), " (bf16, hidden ",
                       shape_.hidden, ") with weights ", weights.ShapeString(), " (f32)"));
    }
    const void* rows = x.raw();
    if (shape_.fp8_rows && tokens > 0) {
      // Quantized per token and per 128 channels before they leave (DeepEP's and Step-3's
      // FP8 dispatch); the records go as the rows.
      Tensor records = records_.Rows(0, tokens);
      DXS_RETURN_IF_ERROR(backend_->QuantizeRowsFp8(x, record_rows_.Rows(0, tokens), &records));
      rows = records.raw();
    }
    cuda::LlDispatchSendArgs a;
    a.x = tokens > 0 ? rows : nullptr;
    a.topk_ids = tokens > 0 ? ids.i32() : nullptr;
    a.topk_weights = tokens > 0 ? weights.f32() : nullptr;
    a.num_tokens = tokens;
    a.expert_owner = expert_owner.i32();
    a.num_experts = shape_.num_experts;
    a.regions = reinterpret_cast<void* const*>(peer_table_.raw());
    a.num_ranks = shape_.num_expert_ranks;
    a.source = rank_;
    a.layout = dispatch_;
    a.sync = sync();
    std::string error;
    return Launched(cuda::LaunchLlDispatchSend(a, backend_->num_sms(), backend_->stream(), &error),
                    error);
  }

  absl::Status Combine(const Tensor& ids, const Tensor& expert_owner, Tensor* out) override {
    DXS_RETURN_IF_ERROR(Ready(LowLatencySide::kAttention, "combine"));
    const int64_t tokens = out->rows();
    DXS_RETURN_IF_ERROR(CheckRouting("combine", tokens, ids, expert_owner));
    if (out->row_size() != shape_.hidden ||
        (out->dtype() != DType::kBF16 && out->dtype() != DType::kF32)) {
      return absl::InvalidArgumentError(absl::StrCat("low-latency combine: out ",
                                                     out->ShapeString(), " (f32 or bf16, hidden ",
                                                     shape_.hidden, ")"));
    }
    DXS_RETURN_IF_ERROR(WaitForSources());
    std::string error;
    cuda::LlCombineReduceArgs a;
    a.region = region_.buffer->data();
    a.layout = combine_;
    a.row_type = cuda::ElemType::kBF16;
    a.topk_ids = tokens > 0 ? ids.i32() : nullptr;
    a.top_k = shape_.top_k;
    a.expert_owner = expert_owner.i32();
    a.num_experts = shape_.num_experts;
    a.num_tokens = tokens;
    a.out = tokens > 0 ? out->raw() : nullptr;
    a.out_type = ToElemType(out->dtype());
    return Launched(cuda::LaunchLlCombineReduce(a, backend_->num_sms(), backend_->stream(), &error),
                    error);
  }

  absl::Status Receive(const Tensor& held, LowLatencyPairs* pairs) override {
    DXS_RETURN_IF_ERROR(Ready(LowLatencySide::kExpert, "receive"));
    if (held.dtype() != DType::kI32 || held.num_elements() != shape_.num_experts) {
      return absl::InvalidArgumentError(absl::StrCat(
          "low-latency receive: held ", held.ShapeString(), " (i32 [", shape_.num_experts, "])"));
    }
    DXS_RETURN_IF_ERROR(WaitForSources());
    std::string error;
    cuda::LlRegionPairsArgs a;
    a.region = region_.buffer->data();
    a.layout = dispatch_;
    a.held = held.i32();
    a.num_experts = shape_.num_experts;
    a.rows = pairs_.rows.i32();
    a.experts = pairs_.experts.i32();
    a.weights = pairs_.weights.f32();
    a.out_rows = pairs_.out_rows.i32();
    a.bad = bad_.i32();
    DXS_RETURN_IF_ERROR(Launched(
        cuda::LaunchLlRegionPairs(a, backend_->num_sms(), backend_->stream(), &error), error));
    if (shape_.fp8_rows) {
      // Every slot's record: the unused ones hold an earlier round's (or zeros), rows no
      // pair points at.
      DXS_RETURN_IF_ERROR(backend_->DequantizeRowsFp8(records_, &pairs_.x));
    }
    *pairs = pairs_;
    return absl::OkStatus();
  }

  absl::Status Send(const Tensor& y) override {
    DXS_RETURN_IF_ERROR(Ready(LowLatencySide::kExpert, "send"));
    const int64_t slots = static_cast<int64_t>(shape_.num_attention_ranks) * shape_.capacity;
    if (y.dtype() != DType::kBF16 || y.rows() != slots + 1 || y.row_size() != shape_.hidden) {
      return absl::InvalidArgumentError(absl::StrCat("low-latency send: y ", y.ShapeString(),
                                                     " (bf16 [", slots + 1, ", ", shape_.hidden,
                                                     "])"));
    }
    cuda::LlCombineSendArgs a;
    a.y = y.raw();
    a.dispatch_region = region_.buffer->data();
    a.dispatch = dispatch_;
    a.regions = reinterpret_cast<void* const*>(peer_table_.raw());
    a.combine = combine_;
    a.source = rank_;
    a.sync = sync();
    std::string error;
    return Launched(cuda::LaunchLlCombineSend(a, backend_->num_sms(), backend_->stream(), &error),
                    error);
  }

  absl::Status CheckStatus() override {
    if (backend_->recording()) {
      return absl::FailedPreconditionError(
          "low-latency status: not while a graph is being recorded");
    }
    // Behind the queued work: its synchronisation is the step's too.
    DXS_ASSIGN_OR_RETURN(const cuda::LlSnapshot st,
                         Snapshot(/*reset_bad=*/true, backend_->stream(), 0));
    if (st.sync.error != 0) {
      const bool attention = side_ == LowLatencySide::kAttention;
      return absl::UnavailableError(absl::StrCat(
          "low-latency exchange: ", attention ? "attention" : "expert", " rank ", rank_,
          " waited more than ", shape_.timeout_ns / 1'000'000, " ms for ",
          attention ? "expert" : "attention", " rank ", st.sync.error_source, "'s round ",
          st.sync.error_round, " (its last round here: ", st.sync.error_arrived,
          "); the exchange is down until it is made again"));
    }
    if (st.bad != 0) {
      return absl::FailedPreconditionError(
          absl::StrCat("low-latency exchange: expert rank ", rank_, " was sent ", st.bad,
                       " pairs for experts it does not hold (the placements disagree)"));
    }
    return absl::OkStatus();
  }

  absl::StatusOr<LowLatencyProgress> Progress() const override {
    DXS_ASSIGN_OR_RETURN(const cuda::LlSnapshot st,
                         Snapshot(/*reset_bad=*/false, progress_stream_.get(), 1));
    LowLatencyProgress p;
    p.sent = static_cast<int64_t>(st.sync.send_epoch);
    p.received = static_cast<int64_t>(st.sync.recv_epoch);
    const int sources = receive_layout().num_sources;
    p.arrived.assign(st.arrived, st.arrived + sources);
    return p;
  }

 private:
  const cuda::LlRegionLayout& receive_layout() const {
    return side_ == LowLatencySide::kAttention ? combine_ : dispatch_;
  }
  const cuda::LlRegionLayout& send_layout() const {
    return side_ == LowLatencySide::kAttention ? dispatch_ : combine_;
  }
  cuda::LlSync* sync() const { return reinterpret_cast<cuda::LlSync*>(sync_.raw()); }

  // Snapshot `slot` of the rank's state, taken on `stream` behind its queued work, read on
  // the host once the stream has passed it: a kernel that writes mapped host memory, or
  // (DXS_CUDA_LL_STATUS=copy) copies into that pinned memory, never a copy into pageable
  // memory (LlSnapshot says why).
  absl::StatusOr<cuda::LlSnapshot> Snapshot(bool reset_bad, cudaStream_t stream, int slot) const {
    DXS_RETURN_IF_ERROR(backend_->Enter("low-latency status"));
    if (backend_->ll_status_by_copy()) {
      DXS_RETURN_IF_ERROR(SnapshotByCopy(reset_bad, stream, snapshots_.get() + slot));
    } else {
      std::string error;
      DXS_RETURN_IF_ERROR(
          Launched(cuda::LaunchLlSnapshot(sync(), region_.buffer->data(), receive_layout(),
                                          bad_.defined() ? bad_.i32() : nullptr, reset_bad,
                                          snapshots_device_ + slot, stream, &error),
                   error));
    }
    DXS_RETURN_IF_ERROR(CudaStatus(cudaStreamSynchronize(stream), "low-latency exchange: status"));
    cuda::LlSnapshot st;
    std::memcpy(&st, snapshots_.get() + slot, sizeof(st));
    return st;
  }

  // The snapshot by the copy engines: the LlSync, the region's flags and the bad-pair count
  // into pinned memory (then the count reset), the values the snapshot kernel writes.
  absl::Status SnapshotByCopy(bool reset_bad, cudaStream_t stream, cuda::LlSnapshot* out) const {
    const cuda::LlRegionLayout& layout = receive_layout();
    const char* region = static_cast<const char*>(region_.buffer->data());
    const auto copy = [&](void* dst, const void* src, size_t bytes) {
      return CudaStatus(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, stream),
                        "low-latency exchange: status copy");
    };
    DXS_RETURN_IF_ERROR(copy(&out->sync, sync(), sizeof(cuda::LlSync)));
    DXS_RETURN_IF_ERROR(copy(out->arrived, region + layout.flags,
                             sizeof(out->arrived[0]) * static_cast<size_t>(layout.num_sources)));
    if (!bad_.defined()) {
      out->bad = 0;
      return absl::OkStatus();
    }
    DXS_RETURN_IF_ERROR(copy(&out->bad, bad_.i32(), sizeof(int32_t)));
    if (!reset_bad) return absl::OkStatus();
    return CudaStatus(cudaMemsetAsync(bad_.i32(), 0, sizeof(int32_t), stream),
                      "low-latency exchange: status reset");
  }

  // Enqueues the wait for every source's next round in this rank's receive region.
  absl::Status WaitForSources() {
    std::string error;
    return Launched(cuda::LaunchLlWait(region_.buffer->data(), receive_layout(), sync(),
                                       shape_.timeout_ns, backend_->stream(), &error),
                    error);
  }

  absl::Status Ready(LowLatencySide side, const char* op) const {
    if (side != side_) {
      return absl::FailedPreconditionError(
          absl::StrCat("low-latency ", op, ": not an op of the ",
                       side_ == LowLatencySide::kAttention ? "attention" : "expert", " side"));
    }
    if (peers_.empty()) {
      return absl::FailedPreconditionError(
          absl::StrCat("low-latency ", op, ": Connect has not run"));
    }
    return backend_->Enter("low-latency exchange");
  }

  absl::Status CheckRouting(const char* op, int64_t tokens, const Tensor& ids,
                            const Tensor& expert_owner) const {
    if (tokens > shape_.capacity) {
      return absl::FailedPreconditionError(
          absl::StrCat("low-latency ", op, ": ", tokens, " tokens, the capacity is ",
                       shape_.capacity, " (larger batches go by the host-driven exchange)"));
    }
    if (ids.dtype() != DType::kI32 || ids.num_elements() != tokens * shape_.top_k ||
        expert_owner.dtype() != DType::kI32 || expert_owner.num_elements() != shape_.num_experts) {
      return absl::InvalidArgumentError(
          absl::StrCat("low-latency ", op, ": ids ", ids.ShapeString(), " (i32 [", tokens, ", ",
                       shape_.top_k, "]) and expert owners ", expert_owner.ShapeString(), " (i32 [",
                       shape_.num_experts, "])"));
    }
    return absl::OkStatus();
  }

  static absl::Status Launched(cudaError_t e, const std::string& error) {
    if (e == cudaSuccess) return absl::OkStatus();
    if (!error.empty()) return absl::InvalidArgumentError(error);
    return CudaStatus(e, "low-latency exchange");
  }

  CudaBackend* backend_;
  LowLatencyShape shape_;
  LowLatencySide side_;
  int rank_;
  cuda::LlRegionLayout dispatch_, combine_;
  SharedMemory region_;    // this rank's receive region
  Tensor sync_;            // its LlSync
  Tensor bad_;             // expert side: pairs for experts not held
  LowLatencyPairs pairs_;  // expert side: a round's pair list
  // FP8 rows: the attention side's records before they go and record_rows_ (i32, 0..capacity
  // - 1); the expert side's, in the region (dequantized into pairs_.x).
  Tensor records_;
  Tensor record_rows_;
  std::vector<std::shared_ptr<Buffer>> peers_;  // the other side's regions, mapped here
  Tensor peer_table_;                           // their bases, on the device
  struct FreeHost {
    void operator()(cuda::LlSnapshot* p) const { cudaFreeHost(p); }
  };
  struct DestroyStream {
    void operator()(cudaStream_t s) const { cudaStreamDestroy(s); }
  };
  // [2] in pinned host memory mapped into the device (CheckStatus's, Progress's), and the
  // device's address of it.
  std::unique_ptr<cuda::LlSnapshot, FreeHost> snapshots_;
  cuda::LlSnapshot* snapshots_device_ = nullptr;
  std::unique_ptr<std::remove_pointer_t<cudaStream_t>, DestroyStream> progress_stream_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<LowLatencyExchange>> MakeCudaLowLatencyExchange(
    Backend* backend, const LowLatencyShape& shape, LowLatencySide side, int rank) {
  // typeid's object is this copy's: a backend made by another copy of the CUDA backend's
  // code (the plugin's, or a binary's that links it in) has another, and its stream and
  // memory belong to that copy's CUDA runtime.
  auto* cuda = dynamic_cast<CudaBackend*>(backend);
  if (cuda == nullptr || &typeid(*backend) != &typeid(CudaBackend)) {
    return absl::FailedPreconditionError(absl::StrCat(
        "low-latency exchange: the ", backend->name(),
        " backend was not made by this copy of the CUDA backend (a binary that links it in "
        "calls UseInProcessLowLatencyExchange(MakeCudaLowLatencyExchange))"));
  }
  auto exchange = std::make_unique<CudaLowLatencyExchange>(cuda, shape, side, rank);
  DXS_RETURN_IF_ERROR(exchange->Init());
  return std::unique_ptr<LowLatencyExchange>(std::move(exchange));
}

}  // namespace dxs
