#include "kernels/opaque_backend.h"

#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "common/status_macros.h"
#include "kernels/caching_allocator.h"
#include "kernels/cpu_backend.h"

namespace dxs {
namespace {

// Two mappings of one memfd: `hidden` (PROT_NONE, handed out) and `open` (read-write, used
// by the ops). The same offset in both is the same byte.
class Arena {
 public:
  static absl::StatusOr<std::shared_ptr<Arena>> Create(size_t bytes) {
    const int fd = memfd_create("dxs-opaque-backend", MFD_CLOEXEC);
    if (fd < 0) return absl::InternalError(absl::StrCat("memfd_create: ", std::strerror(errno)));
    if (ftruncate(fd, static_cast<off_t>(bytes)) != 0) {
      close(fd);
      return absl::ResourceExhaustedError(absl::StrCat("ftruncate: ", std::strerror(errno)));
    }
    void* hidden = mmap(nullptr, bytes, PROT_NONE, MAP_SHARED | MAP_NORESERVE, fd, 0);
    void* open = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_NORESERVE, fd, 0);
    close(fd);  // the mappings keep the memory
    if (hidden == MAP_FAILED || open == MAP_FAILED) {
      if (hidden != MAP_FAILED) munmap(hidden, bytes);
      if (open != MAP_FAILED) munmap(open, bytes);
      return absl::ResourceExhaustedError(absl::StrCat("mmap: ", std::strerror(errno)));
    }
    return std::shared_ptr<Arena>(
        new Arena(static_cast<uint8_t*>(hidden), static_cast<uint8_t*>(open), bytes));
  }
  ~Arena() {
    munmap(hidden_, bytes_);
    munmap(open_, bytes_);
  }

  // Read-write memory from the arena (bump allocation; the caching allocator above reuses
  // freed blocks, so nothing is given back). Null when the arena is full.
  void* Take(size_t bytes) ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock lock(&mu_);
    const size_t aligned = (bytes + 255) / 256 * 256;
    if (used_ + aligned > bytes_) return nullptr;
    void* p = open_ + used_;
    used_ += aligned;
    return p;
  }
  bool IsHidden(const void* p) const { return p >= hidden_ && p < hidden_ + bytes_; }
  bool IsOpen(const void* p) const { return p >= open_ && p < open_ + bytes_; }
  uint8_t* Open(const void* hidden) const {
    return open_ + (static_cast<const uint8_t*>(hidden) - hidden_);
  }
  uint8_t* Hide(const void* open) const {
    return hidden_ + (static_cast<const uint8_t*>(open) - open_);
  }

 private:
  Arena(uint8_t* hidden, uint8_t* open, size_t bytes)
      : hidden_(hidden), open_(open), bytes_(bytes) {}
  uint8_t* const hidden_;
  uint8_t* const open_;
  const size_t bytes_;
  absl::Mutex mu_;
  size_t used_ ABSL_GUARDED_BY(mu_) = 0;
};

// The CPU backend over the arena's read-write view.
class ArenaCpuBackend final : public CpuBackend {
 public:
  explicit ArenaCpuBackend(std::shared_ptr<CachingAllocator> allocator)
      : CpuBackend(std::move(allocator)) {}
};

class OpaqueBackend final : public Backend {
 public:
  explicit OpaqueBackend(std::shared_ptr<Arena> arena)
      : arena_(arena),
        inner_(CachingAllocator::Create(
            Device::kCpu, [arena](size_t bytes) { return arena->Take(bytes); },
            [](void*, size_t) {}, SIZE_MAX)) {}
  using Backend::Allocate;

  std::string name() const override { return "opaque"; }
  Device device() const override { return Device::kOpaque; }
  DType WeightDType(DType stored) const override { return inner_.WeightDType(stored); }
  DType ActivationDType() const override { return inner_.ActivationDType(); }
  // Host memory the host cannot read: nothing maps it for a peer; its expert ops take
  // float32 rows only.
  BackendCapabilities capabilities() const override {
    return {.device_memory = false,
            .maps_regions = false,
            .narrow_expert_rows = false,
            .fp8_dispatch_rows = true};
  }

  absl::StatusOr<Tensor> Allocate(std::vector<int64_t> shape, DType dtype) override {
    DXS_ASSIGN_OR_RETURN(Tensor t, inner_.Allocate(std::move(shape), dtype));
    return Hide(t);
  }
  absl::Status CopyFromHost(const void* src, DType src_dtype, Tensor* dst) override {
    Tensor d = Open(*dst);
    return inner_.CopyFromHost(src, src_dtype, &d);
  }
  absl::Status CopyToHost(const Tensor& src, DType dst_dtype, void* dst) override {
    return inner_.CopyToHost(Open(src), dst_dtype, dst);
  }
  absl::Status Copy(const Tensor& src, Tensor* dst) override {
    Tensor d = Open(*dst);
    return inner_.Copy(Open(src), &d);
  }
  absl::Status Fill(Tensor* t, float value) override {
    Tensor d = Open(*t);
    return inner_.Fill(&d, value);
  }
  absl::Status ArgmaxRows(const Tensor& logits, Tensor* ids) override {
    Tensor d = Open(*ids);
    return inner_.ArgmaxRows(Open(logits), &d);
  }
  absl::Status SampleRows(const Tensor& logits, const Tensor& params, const Tensor* adjustments,
                          Tensor* ids) override {
    Tensor d = Open(*ids);
    if (adjustments == nullptr) return inner_.SampleRows(Open(logits), Open(params), nullptr, &d);
    const Tensor a = Open(*adjustments);
    return inner_.SampleRows(Open(logits), Open(params), &a, &d);
  }
  absl::Status CountPendingTokens(const Tensor& tokens, const Tensor& params,
                                  Tensor* adjustments) override {
    Tensor a = Open(*adjustments);
    return inner_.CountPendingTokens(Open(tokens), Open(params), &a);
  }
  absl::Status LogprobRows(const Tensor& logits, const Tensor& sampled, const Tensor& named,
                           Tensor* sampled_logprobs, Tensor* named_logprobs, Tensor* top_ids,
                           Tensor* top_logprobs) override {
    Tensor s = Open(*sampled_logprobs), n = Open(*named_logprobs), ti = Open(*top_ids),
           tl = Open(*top_logprobs);
    return inner_.LogprobRows(Open(logits), Open(sampled), Open(named), &s, &n, &ti, &tl);
  }
  absl::Status QuantizeRowsFp8(const Tensor& src, const Tensor& rows, Tensor* records) override {
    Tensor r = Open(*records);
    return inner_.QuantizeRowsFp8(Open(src), Open(rows), &r);
  }
  absl::Status DequantizeRowsFp8(const Tensor& records, Tensor* dst) override {
    Tensor d = Open(*dst);
    return inner_.DequantizeRowsFp8(Open(records), &d);
  }
  absl::Status AccumulateCounts(const Tensor& offsets, Tensor* counts) override {
    Tensor c = Open(*counts);
    return inner_.AccumulateCounts(Open(offsets), &c);
  }
  absl::Status UnpackRoutedPairs(const Tensor& blocks, const std::vector<PairSegment>& segments,
                                 const Tensor& held, Tensor* rows, Tensor* experts, Tensor* weights,
                                 Tensor* bad) override {
    Tensor r = Open(*rows), e = Open(*experts), w = Open(*weights), b = Open(*bad);
    return inner_.UnpackRoutedPairs(Open(blocks), segments, Open(held), &r, &e, &w, &b);
  }
  absl::Status FillUniform(Tensor* t, uint64_t seed, double mean, double half_width,
                           DType values_dtype) override {
    Tensor open = Open(*t);
    return inner_.FillUniform(&open, seed, mean, half_width, values_dtype);
  }
  void* TransportAddress(const Tensor& t) override { return Open(t).raw(); }

  absl::StatusOr<std::unique_ptr<Event>> CreateEvent() override { return inner_.CreateEvent(); }
  absl::Status RecordEvent(Event* e) override { return inner_.RecordEvent(e); }
  absl::Status WaitEvent(Event* e) override { return inner_.WaitEvent(e); }
  absl::Status SynchronizeEvent(Event* e) override { return inner_.SynchronizeEvent(e); }
  absl::Status Synchronize() override { return inner_.Synchronize(); }

  absl::Status Linear(const Tensor& x, const Tensor& w, const Tensor* bias, Tensor* y) override {
    Tensor b = bias != nullptr ? Open(*bias) : Tensor(), out = Open(*y);
    return inner_.Linear(Open(x), Open(w), bias != nullptr ? &b : nullptr, &out);
  }
  absl::Status RmsNorm(const Tensor& x, const Tensor& weight, float eps, Tensor* y) override {
    Tensor out = Open(*y);
    return inner_.RmsNorm(Open(x), Open(weight), eps, &out);
  }
  absl::Status Embedding(const Tensor& table, const Tensor& ids, Tensor* y) override {
    Tensor out = Open(*y);
    return inner_.Embedding(Open(table), Open(ids), &out);
  }
  absl::Status Rope(Tensor* x, const Tensor& positions, double theta) override {
    Tensor io = Open(*x);
    return inner_.Rope(&io, Open(positions), theta);
  }
  absl::Status SiluMul(const Tensor& gate, const Tensor& up, Tensor* out) override {
    Tensor o = Open(*out);
    return inner_.SiluMul(Open(gate), Open(up), &o);
  }
  absl::Status Add(const Tensor& x, Tensor* inout) override {
    Tensor io = Open(*inout);
    return inner_.Add(Open(x), &io);
  }
  absl::Status AddRmsNorm(const Tensor& x, const Tensor& weight, float eps, Tensor* residual,
                          Tensor* y) override {
    Tensor r = Open(*residual), out = Open(*y);
    return inner_.AddRmsNorm(Open(x), Open(weight), eps, &r, &out);
  }
  absl::Status QkNormRope(Tensor* q, Tensor* k, const Tensor& q_weight, const Tensor& k_weight,
                          float eps, const Tensor& positions, double theta) override {
    Tensor qo = Open(*q), ko = Open(*k);
    return inner_.QkNormRope(&qo, &ko, Open(q_weight), Open(k_weight), eps, Open(positions), theta);
  }
  absl::Status GatherRows(const Tensor& src, const Tensor& rows, Tensor* dst) override {
    Tensor d = Open(*dst);
    return inner_.GatherRows(Open(src), Open(rows), &d);
  }
  absl::Status WriteKvCache(const Tensor& k, const Tensor& v, const PagedAttentionMeta& meta,
                            Tensor* k_cache, Tensor* v_cache) override {
    Tensor kc = Open(*k_cache), vc = Open(*v_cache);
    return inner_.WriteKvCache(Open(k), Open(v), Open(meta), &kc, &vc);
  }
  absl::Status PagedAttention(const Tensor& q, const Tensor& k_cache, const Tensor& v_cache,
                              const PagedAttentionMeta& meta, float scale, Tensor* out) override {
    Tensor o = Open(*out);
    return inner_.PagedAttention(Open(q), Open(k_cache), Open(v_cache), Open(meta), scale, &o);
  }
  absl::Status TopKSoftmax(const Tensor& logits, int top_k, bool normalize, Tensor* ids,
                           Tensor* weights) override {
    Tensor i = Open(*ids), w = Open(*weights);
    return inner_.TopKSoftmax(Open(logits), top_k, normalize, &i, &w);
  }
  absl::Status ComputeDispatchLayout(const Tensor& ids, const Tensor& weights,
                                     const Tensor& expert_owner, int num_ranks,
                                     DispatchLayoutTensors* layout) override {
    DispatchLayoutTensors open;
    DXS_RETURN_IF_ERROR(inner_.ComputeDispatchLayout(Open(ids), Open(weights), Open(expert_owner),
                                                     num_ranks, &open));
    layout->num_tokens_per_rank = Hide(open.num_tokens_per_rank);
    layout->num_pairs_per_rank = Hide(open.num_pairs_per_rank);
    layout->num_tokens_per_expert = Hide(open.num_tokens_per_expert);
    layout->token_rows = Hide(open.token_rows);
    layout->pairs = Hide(open.pairs);
    return absl::OkStatus();
  }
  absl::Status CombineRows(const Tensor& recv, const Tensor& token_rows,
                           const std::vector<int64_t>& rank_offsets, Tensor* out) override {
    Tensor o = Open(*out);
    return inner_.CombineRows(Open(recv), Open(token_rows), rank_offsets, &o);
  }
  absl::Status SortPairsByExpert(const Tensor& experts, int num_experts, Tensor* order,
                                 Tensor* expert_offsets,
                                 const std::vector<PairPayload>& payloads) override {
    Tensor o = Open(*order), off = Open(*expert_offsets);
    // The payloads, opened (held here for the call).
    std::vector<Tensor> values, sorted;
    values.reserve(payloads.size());
    sorted.reserve(payloads.size());
    std::vector<PairPayload> open(payloads.size());
    for (size_t j = 0; j < payloads.size(); ++j) {
      if (payloads[j].values != nullptr) {
        values.push_back(Open(*payloads[j].values));
        open[j].values = &values.back();
      }
      if (payloads[j].sorted != nullptr) {
        sorted.push_back(Open(*payloads[j].sorted));
        open[j].sorted = &sorted.back();
      }
    }
    return inner_.SortPairsByExpert(Open(experts), num_experts, &o, &off, open);
  }
  absl::Status GroupedSwiGlu(const Tensor& xs, const Tensor* rows, const Tensor& expert_offsets,
                             const std::vector<const Tensor*>& gate_up,
                             const std::vector<const Tensor*>& down, Tensor* y) override {
    // The weight tables, opened (held here for the call).
    std::vector<Tensor> held;
    held.reserve(2 * gate_up.size());
    auto open_all = [&](const std::vector<const Tensor*>& table) {
      std::vector<const Tensor*> out(table.size(), nullptr);
      for (size_t e = 0; e < table.size(); ++e) {
        if (table[e] == nullptr) continue;
        held.push_back(Open(*table[e]));
        out[e] = &held.back();
      }
      return out;
    };
    const std::vector<const Tensor*> gu = open_all(gate_up), d = open_all(down);
    Tensor r = rows != nullptr ? Open(*rows) : Tensor(), o = Open(*y);
    return inner_.GroupedSwiGlu(Open(xs), rows != nullptr ? &r : nullptr, Open(expert_offsets), gu,
                                d, &o);
  }
  absl::Status ScaleAddRows(const Tensor& src, const Tensor& scales, const Tensor& rows,
                            Tensor* dst) override {
    Tensor d = Open(*dst);
    return inner_.ScaleAddRows(Open(src), Open(scales), Open(rows), &d);
  }

 private:
  // The same tensor seen through the read-write mapping (tensors from elsewhere as they are).
  Tensor Open(const Tensor& t) const {
    if (!t.defined() || !arena_->IsHidden(t.buffer()->data())) return t;
    auto alias = std::make_shared<Buffer>(Device::kCpu, arena_->Open(t.buffer()->data()),
                                          t.buffer()->num_bytes(), nullptr);
    return Tensor(std::move(alias), t.dtype(), t.shape(), t.offset_bytes() / DTypeSize(t.dtype()));
  }
  PagedAttentionMeta Open(const PagedAttentionMeta& m) const {
    PagedAttentionMeta o = m;
    o.query_start = Open(m.query_start);
    o.context_lens = Open(m.context_lens);
    o.block_tables = Open(m.block_tables);
    o.slot_mapping = Open(m.slot_mapping);
    return o;
  }
  // A tensor the inner backend allocated, handed out through the PROT_NONE mapping; the
  // hidden buffer keeps the read-write block alive.
  Tensor Hide(const Tensor& open) const {
    if (!open.defined() || !arena_->IsOpen(open.buffer()->data())) return open;
    std::shared_ptr<Buffer> block = open.buffer();
    auto hidden = std::make_shared<Buffer>(Device::kOpaque, arena_->Hide(block->data()),
                                           block->num_bytes(), [block](void*) {});
    return Tensor(std::move(hidden), open.dtype(), open.shape(),
                  open.offset_bytes() / DTypeSize(open.dtype()));
  }

  std::shared_ptr<Arena> arena_;
  ArenaCpuBackend inner_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<Backend>> MakeOpaqueBackend(size_t arena_bytes) {
  DXS_ASSIGN_OR_RETURN(std::shared_ptr<Arena> arena, Arena::Create(arena_bytes));
  return std::unique_ptr<Backend>(new OpaqueBackend(std::move(arena)));
}

}  // namespace dxs
