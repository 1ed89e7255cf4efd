// DeviceRuntime: the part of a backend (kernels/backend.h) that owns memory, the ordered
// work queue, events and graphs, the memory other processes map, and the low-latency
// exchange's endpoints. Nothing here computes on tensor values; DenseCompute
// (kernels/dense_compute.h) and MoeCompute (kernels/moe_compute.h) do.
//
// Memory comes from the backend's caching allocator, uninitialised. Code outside a backend
// never dereferences a tensor's memory; it moves bytes in and out with CopyFromHost and
// CopyToHost (or staging memory) only. All tensors are row-major.
//
// Work queue: operations are enqueued in call order on the backend's one ordered queue (a
// CUDA stream; the CPU backend runs each at once). A returned Status reports argument
// errors and launch errors; errors of asynchronous work surface at the next
// Synchronize/SynchronizeEvent. Events mark points in the queue: a transport waits on one
// before it sends rows (they are written), compute waits on one before it reads rows that
// arrived.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kernels/tensor.h"

namespace dxs {

// A point in a backend's work queue. Made by Backend::CreateEvent, used with that backend.
class Event {
 public:
  virtual ~Event() = default;
};

// Recorded queue work that can be run again (a CUDA graph). Made by Backend::CaptureGraph.
class Graph {
 public:
  virtual ~Graph() = default;
};

// CaptureGraph's result: the graph, and the tensor its body returned while being recorded
// (what each Replay writes).
struct CapturedGraph {
  std::unique_ptr<Graph> graph;
  Tensor output;
};

// Device memory another process of this host maps (Backend::AllocateShared): the block and
// the key that names it to the other process (Backend::OpenShared).
struct SharedMemory {
  std::shared_ptr<Buffer> buffer;
  std::string key;
};

// What a backend is, in the terms the code outside kernels/ chooses a path by (the model,
// the dispatch/combine engine, the expert workers): a new backend states these rather than
// each caller comparing Device values.
struct BackendCapabilities {
  // Tensors live in device memory: a transport moves them as device memory, per-expert
  // loads are accumulated on the queue (a host counter would wait for it), and memory a
  // peer process maps is a block of the backend's own (AllocateShared). False: host memory,
  // which the transport reads in place and maps for peers itself.
  bool device_memory = false;
  // Its tensors may sit in regions another process of this host maps (the one-copy
  // exchange): host memory the transport maps, or device blocks AllocateShared shares.
  bool maps_regions = false;
  // The expert ops take rows narrower than float32 (the wire's bf16 or f16).
  bool narrow_expert_rows = true;
  // QuantizeRowsFp8 and DequantizeRowsFp8 (the FP8 dispatch of --wire-dtype fp8).
  bool fp8_dispatch_rows = false;
  // Linear takes a block-scaled FP8 weight (Tensor::block_scales), so a checkpoint's FP8
  // projections stay FP8 in its memory. False: they are dequantized when loaded.
  bool fp8_block_weights = false;
  // GroupedSwiGlu (and the ops built on it) take block-scaled FP8 expert weights, so an FP8
  // checkpoint's experts stay FP8 too. False: they are dequantized when loaded.
  bool fp8_expert_weights = false;
  // The data plane's low-latency exchange runs on it (dataplane/low_latency/: rounds
  // enqueued on this backend's queue, rows written into regions peers map, nothing
  // synchronising with the host). False: the host-driven exchange serves every step.
  bool low_latency_exchange = false;
};

class DeviceRuntime {
 public:
  virtual ~DeviceRuntime() = default;
  virtual std::string name() const = 0;
  virtual Device device() const = 0;
  // The dtype a weight stored as `stored` is kept in (the CPU widens to float32).
  virtual DType WeightDType(DType stored) const = 0;
  // The dtype activations are computed in.
  virtual DType ActivationDType() const = 0;
  // What the backend's memory is and what its ops take: code outside kernels/ asks this,
  // never which device a backend is.
  virtual BackendCapabilities capabilities() const = 0;

  // ---- Memory (the caching allocator; uninitialised) ----
  virtual absl::StatusOr<Tensor> Allocate(std::vector<int64_t> shape, DType dtype) = 0;
  // dst's elements from host memory holding them in `src_dtype` (converted when both are
  // floating types; index dtypes must match).
  virtual absl::Status CopyFromHost(const void* src, DType src_dtype, Tensor* dst) = 0;
  // src's elements to host memory, in `dst_dtype`. Waits for queued work writing src.
  virtual absl::Status CopyToHost(const Tensor& src, DType dst_dtype, void* dst) = 0;
  // dst = src elementwise (equal element counts), converting floating dtypes.
  virtual absl::Status Copy(const Tensor& src, Tensor* dst) = 0;
  virtual absl::Status Fill(Tensor* t, float value) = 0;
  // Seeded uniform values, the same on every backend (random checkpoints made in place,
  // model/random_checkpoint.h): element i is mean + (2u - 1) * half_width computed in
  // double, with u = (SplitMix64 output i of `seed`) >> 11 scaled to [0, 1); rounded to
  // `values_dtype` (the dtype a checkpoint would store), then converted to t's dtype.
  virtual absl::Status FillUniform(Tensor* t, uint64_t seed, double mean, double half_width,
                                   DType values_dtype) = 0;
  // Where a transport reads and writes t's memory: the memory itself for host memory and
  // for device memory a device-capable transport takes (UCX with CUDA, NCCL); the opaque
  // test backend's read-write view of its memory. Only transports dereference it, after
  // the events that order it with the queue.
  virtual void* TransportAddress(const Tensor& t) { return t.raw(); }

  // ---- Queue and events ----
  virtual absl::StatusOr<std::unique_ptr<Event>> CreateEvent() = 0;
  // Marks the point after all work enqueued so far.
  virtual absl::Status RecordEvent(Event* event) = 0;
  // Work enqueued from now on starts after `event` (another backend's queue may record it
  // on the same device).
  virtual absl::Status WaitEvent(Event* event) = 0;
  // The calling thread waits for `event`.
  virtual absl::Status SynchronizeEvent(Event* event) = 0;
  // The calling thread waits for all enqueued work.
  virtual absl::Status Synchronize() = 0;

  // ---- Graphs (CUDA graphs; unsupported on the CPU) ----
  // Host memory the queue reads asynchronously (pinned on CUDA): inputs staged for a graph
  // replay. The caller must not rewrite it while queued work may still read it.
  virtual absl::StatusOr<std::shared_ptr<Buffer>> AllocateStaging(size_t bytes);
  // dst's bytes from staging memory at `offset`; enqueued (and recorded by a capture).
  virtual absl::Status CopyFromStaging(const Buffer& staging, size_t offset, Tensor* dst);
  // src's bytes into staging memory at `offset`, enqueued: they are there once an event
  // recorded after it has passed (overlap scheduling reads a step's tokens so while the
  // next step runs). Where the queue is the caller's (the CPU), the copy is done on return.
  virtual absl::Status CopyToStaging(const Tensor& src, const Buffer& staging, size_t offset);

  // ---- Memory another process maps (the one-copy exchange on a device) ----
  // At least `bytes` of this backend's memory that another process of this host maps with
  // OpenShared(key) and reads and writes in place: on CUDA a block of its own cudaMalloc and
  // its IPC handle. UNIMPLEMENTED where the backend's memory is the host's (the transport
  // maps that: DataExchange::MapRegion) or cannot be shared.
  virtual absl::StatusOr<SharedMemory> AllocateShared(size_t bytes);
  // The block `key` names (AllocateShared's, this process's or another's), mapped here
  // until the Buffer goes. INVALID_ARGUMENT for a key that names none; UNIMPLEMENTED where
  // nothing is shared.
  virtual absl::StatusOr<std::shared_ptr<Buffer>> OpenShared(std::string_view key);
  virtual bool SupportsGraphs() const { return false; }
  // Runs `body` once eagerly (its result goes to *eager_output), then records it into a
  // graph. During both, the backend allocates from a pool of its own that eager work never
  // uses, so the memory a graph writes between replays is the graph's alone (PyTorch's
  // private graph pool). `body` must not synchronise with the host while recorded. Tensors
  // it reads that were made outside must outlive the graph unchanged in place.
  // eager_output null: no eager run, the body is only recorded; whatever it makes lazily
  // (tables, workspaces, kernels' first loads) must exist already. For work that waits on
  // other ranks (the low-latency exchange): recorded before any of them runs, so no
  // allocation or instantiation happens while a peer's kernels spin on the same GPU.
  virtual absl::StatusOr<CapturedGraph> CaptureGraph(
      const std::function<absl::StatusOr<Tensor>()>& body, Tensor* eager_output);
  // Whether CaptureGraph is running a body (persistent scratch must not be used then).
  virtual bool InGraphCapture() const { return false; }
  // Enqueues the recorded work again; it writes the CapturedGraph's output.
  virtual absl::Status Replay(Graph* graph);

  // ---- Conveniences over memory and copies ----
  absl::StatusOr<Tensor> Allocate(std::vector<int64_t> shape) {
    return Allocate(std::move(shape), ActivationDType());
  }
  absl::StatusOr<Tensor> Zeros(std::vector<int64_t> shape, DType dtype);
  // A float32 tensor from host floats.
  absl::StatusOr<Tensor> Upload(const std::vector<float>& host, std::vector<int64_t> shape);
  // An i32 tensor [n] from host values.
  absl::StatusOr<Tensor> UploadIndices(const std::vector<int32_t>& host);
  // The whole tensor as host floats.
  absl::StatusOr<std::vector<float>> Download(const Tensor& t);
  absl::StatusOr<std::vector<int32_t>> DownloadIndices(const Tensor& t);
};

}  // namespace dxs
