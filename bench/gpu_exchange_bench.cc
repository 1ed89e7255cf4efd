// Dispatch + combine round trip between two processes on one GPU (a benchmark, not a test).
//
// One DP rank (this process: RemoteMoeExecutor::Run) and one EP rank (a forked child:
// ExpertStepServer::ServeRound), each with the CUDA backend (MakeBackend("cuda"), made after
// the fork), over the dxs UCX transport: x, the routing, the output and the EP rank's rows
// are all device tensors, so the rows move GPU to GPU through UCX's cuda_ipc (the bench
// aborts if the transport cannot move device memory). The EP rank holds every expert, so
// each token goes once each way. Its experts are bench/exchange_bench_util.h's stand-in on
// the device, out[r] = (sum of row r's pair weights) * x[r], from backend ops (Fill,
// GatherRows, ScaleAddRows, Copy); it synchronises the backend before it returns, so
// ExpertCounters::compute_ns covers its kernels and the bench reports the exchange alone
// too: xchg_us = median over the round trips of (round trip - that round's compute).
// exchange_ranks_bench runs the same exchange over D DP x E EP processes (e.g. 2 x 2).
//
// Baseline, in the same run, between the same two processes: the interprocess-event
// ping-pong. A launches a one-thread kernel and records an event made with
// cudaEventInterprocess | cudaEventDisableTiming, tells B over a pipe; B's stream waits on
// that event (cudaIpcOpenEventHandle), launches its kernel, records its own interprocess
// event and tells A; A waits on B's event (cudaEventSynchronize). Without MPS the GPU
// time-slices between the two processes' contexts, so this is the floor of any round trip
// that hands work from one process to the other on the GPU and back.
//
// Timing: host wall-clock per round trip (CUDA events cannot time across processes),
// after a warm-up; per row the two methods run interleaved in blocks, so a burst of load
// hits both; median and p99 of each. Every device buffer of a shape (x, ids, weights, out,
// the stand-in's scratch) is allocated once for the largest token count before its rows
// are timed; the timed loop copies no rows through the host. The combined output is
// checked against (sum of weights) * x on the host after each row; a wrong answer aborts.
//
// Wires: each shape and token count runs twice, with bf16 rows both ways, then with FP8
// dispatch rows (--wire-dtype fp8: each row quantized per 128 channels before it leaves, its
// records dequantized on the EP rank; the answers stay bf16, as DeepEP and Step-3 send
// them). FP8 records are a pass of their own into the region the EP rank reads (bf16 rows
// can be read from the staged x in place).
//
// Bytes: dispatch = the dxs header (control channel) + the rows (bf16: rows * hidden * 2;
// fp8: rows * Fp8RecordBytes(hidden), hidden bytes and a float32 scale per 128) + 12 * pairs;
// combine = rows * hidden * 2. rows_GB/s = the row bytes of both directions / dxs median.
//
// x and out: by default where the attention model builds them, the executor's staged
// buffers (MoeExecutor::StageBuffers: the first bytes of the region the EP rank opens, so it
// reads x and answers into out in place; each row's x is copied there before it is timed);
// --in-out=own: tensors of the bench's own, which the exchange packs into its region and
// copies the answers out of.
//
// Usage: gpu_exchange_bench [--reps N] [--json FILE] [--devices A,B] [--in-out=staged|own]
//   --reps N: measured round trips per method and row (default 200, at least 50);
//   --devices A,B: the DP rank on GPU A and the EP rank on GPU B (default 0,0: both on one
//   GPU, time-sliced); on two GPUs of one host UCX's cuda_ipc moves the rows over NVLink;
//   --json FILE: one JSON object per row (section "exchange"), for bench/gpu/report.py.
// Exit status 1, with one line on stderr, when there is no usable GPU, when UCX cannot move
// device memory, or when the bench itself fails.
#include <cuda_runtime_api.h>
#include <ucp/api/ucp.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <csignal>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <limits>
#include <memory>
#include <numeric>
#include <string>
#include <vector>

#include "absl/debugging/failure_signal_handler.h"
#include "absl/debugging/symbolize.h"
#include "bench/exchange_bench_util.h"
#include "bench/raw_ucx_pingpong.h"
#include "common/dtype.h"
#include "common/model_config.h"
#include "dataplane/dispatch/dispatch_combine.h"
#include "dataplane/dispatch/placement.h"
#include "dataplane/dispatch/wire.h"
#include "dataplane/transport/transport.h"
#include "expert_service/expert_compute.h"
#include "expert_service/expert_step_server.h"
#include "kernels/backend.h"
#include "kernels/make_backend.h"
#include "kernels/moe_compute.h"
#include "model/sampler.h"
#include "nlohmann/json.hpp"

namespace dxs {
namespace bench {
// bench/gpu_exchange_tick.cu: one thread adds 1 to *counter, on `stream`.
cudaError_t LaunchTick(unsigned int* counter, cudaStream_t stream);
}  // namespace bench

namespace {

using bench::Check;
using bench::Die;
using bench::ExchangeInputs;
using bench::Must;
using bench::ReadAll;
using bench::Stats;
using bench::StatsOf;
using bench::WeightedSumExperts;
using bench::WriteAll;

struct Shape {
  const char* name;
  int64_t hidden;
};
// Qwen3-30B-A3B's hidden size and DeepSeek-V3's; both top-8 of 128 experts here.
constexpr Shape kShapes[] = {{"h2048", 2048}, {"h7168", 7168}};
constexpr int kNumExperts = 128;
constexpr int kTopK = 8;
constexpr int64_t kTokensPerDpRank[] = {1, 128, 1024, 4096};
constexpr int64_t kMaxTokens = kTokensPerDpRank[std::size(kTokensPerDpRank) - 1];
constexpr DType kActivations = DType::kBF16;  // x and out
constexpr DType kWires[] = {DType::kBF16, DType::kF8E4M3};

constexpr int kDpPeer = 0;
constexpr int kEpPeer = 1;
constexpr int kLayer = 0;
constexpr uint64_t kSeed = 20261201;
constexpr int64_t kMinReps = 50;
constexpr int64_t kWarmupReps = 20;
constexpr int kBlocks = 4;  // per row, each method runs this many interleaved blocks
constexpr unsigned kWatchdogSeconds = 500;
constexpr double kMaxRelativeError = 1e-2;  // bf16 rounding of x and of the answer
// FP8 rows: |x| in [0.05, 1] keeps every value in e4m3's normal range after its group's scale
// (amax / 448), so each is within half an e4m3 ulp, 2^-4 relative, plus the bf16 roundings.
constexpr double kMaxRelativeErrorFp8 = 0.07;

#define BENCH_CUDA(call)                                                     \
  do {                                                                       \
    if (const cudaError_t _e = (call); _e != cudaSuccess) {                  \
      ::dxs::bench::Die(std::string(#call) + ": " + cudaGetErrorString(_e)); \
    }                                                                        \
  } while (0)

// ---- Parent -> child commands -----------------------------------------------------------

enum class Method : int32_t { kDxs = 1, kPingPong = 2, kQuit = 3 };

struct Command {
  Method method;
  int32_t shape;  // kDxs: which ExpertStepServer (the hidden size differs per shape)
  int64_t count;  // round trips to serve
};

double NowUs() {
  return std::chrono::duration<double, std::micro>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// Sends this process's start-up error ("" when it has none) and returns the peer's.
std::string TradeErrors(int read_fd, int write_fd, const std::string& own) {
  return bench::TradeAddresses(read_fd, write_fd, own);
}

// The CUDA backend of this process on GPU `device`, or the reason there is none.
absl::StatusOr<std::unique_ptr<Backend>> MakeCudaBackendHere(int device) {
  absl::StatusOr<std::unique_ptr<Backend>> backend =
      MakeBackend(device == 0 ? std::string("cuda") : "cuda:" + std::to_string(device));
  if (backend.ok() && (*backend)->device() != Device::kCuda) {
    return absl::FailedPreconditionError("MakeBackend(\"cuda\") gave a backend not on a GPU");
  }
  return backend;
}

std::unique_ptr<Transport> ConnectDxs(int self, int read_fd, int write_fd) {
  std::unique_ptr<Transport> transport = Must(MakeUcxTransport(), "MakeUcxTransport");
  Check(transport->SetSelf(self), "SetSelf");
  const std::string peer = bench::TradeAddresses(read_fd, write_fd, transport->LocalAddress());
  Check(transport->Connect(self == kDpPeer ? kEpPeer : kDpPeer, peer), "Connect");
  return transport;
}

// ---- The interprocess-event ping-pong ---------------------------------------------------

// One end: a stream of this process's, its interprocess event, and the peer's, opened
// from the handle that came over the pipe. Made with the CUDA runtime linked into this
// binary; the backend's (in its plugin) shares the device's primary context with it.
class PingPongEnd {
 public:
  void Open(int read_fd, int write_fd, int device) {
    BENCH_CUDA(cudaSetDevice(device));
    BENCH_CUDA(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
    BENCH_CUDA(cudaMalloc(reinterpret_cast<void**>(&counter_), sizeof(unsigned int)));
    BENCH_CUDA(cudaMemsetAsync(counter_, 0, sizeof(unsigned int), stream_));
    BENCH_CUDA(cudaStreamSynchronize(stream_));
    BENCH_CUDA(cudaEventCreateWithFlags(&own_, cudaEventInterprocess | cudaEventDisableTiming));
    cudaIpcEventHandle_t own_handle, peer_handle;
    BENCH_CUDA(cudaIpcGetEventHandle(&own_handle, own_));
    WriteAll(write_fd, &own_handle, sizeof(own_handle));
    ReadAll(read_fd, &peer_handle, sizeof(peer_handle));
    BENCH_CUDA(cudaIpcOpenEventHandle(&peer_, peer_handle));
  }

  // The peer has closed its end (it quit) or never will use ours again.
  void Close() {
    if (stream_ != nullptr) BENCH_CUDA(cudaStreamSynchronize(stream_));
    if (peer_ != nullptr) cudaEventDestroy(peer_);
    if (own_ != nullptr) cudaEventDestroy(own_);
    if (counter_ != nullptr) cudaFree(counter_);
    if (stream_ != nullptr) cudaStreamDestroy(stream_);
    peer_ = own_ = nullptr;
    counter_ = nullptr;
    stream_ = nullptr;
  }

  // A: one round trip (kernel, record, tell B; hear from B, wait on B's event).
  void Initiate(int read_fd, int write_fd) {
    BENCH_CUDA(bench::LaunchTick(counter_, stream_));
    BENCH_CUDA(cudaEventRecord(own_, stream_));
    char token = 1;
    WriteAll(write_fd, &token, 1);
    ReadAll(read_fd, &token, 1);
    BENCH_CUDA(cudaEventSynchronize(peer_));
  }

  // B: one answer (hear from A; wait on A's event, kernel, record, tell A).
  void Answer(int read_fd, int write_fd) {
    char token = 0;
    ReadAll(read_fd, &token, 1);
    BENCH_CUDA(cudaStreamWaitEvent(stream_, peer_, 0));
    BENCH_CUDA(bench::LaunchTick(counter_, stream_));
    BENCH_CUDA(cudaEventRecord(own_, stream_));
    WriteAll(write_fd, &token, 1);
  }

 private:
  cudaStream_t stream_ = nullptr;
  cudaEvent_t own_ = nullptr;
  cudaEvent_t peer_ = nullptr;
  unsigned int* counter_ = nullptr;
};

// ---- EP rank (child) --------------------------------------------------------------------

struct Options {
  int64_t reps = 200;
  std::string json;
  int dp_device = 0, ep_device = 0;  // --devices A,B: the DP rank on GPU A, the EP rank on B
  bool staged = true;                // --in-out=staged (MoeExecutor::StageBuffers) or own
};

int RunExpertRank(int read_fd, int write_fd, const Options& opts) {
  absl::StatusOr<std::unique_ptr<Backend>> made = MakeCudaBackendHere(opts.ep_device);
  const std::string peer_error =
      TradeErrors(read_fd, write_fd, made.ok() ? "" : std::string(made.status().message()));
  if (!made.ok() || !peer_error.empty()) return 1;  // the parent says why
  std::unique_ptr<Backend> backend = std::move(*made);
  PingPongEnd ping_pong;
  ping_pong.Open(read_fd, write_fd, opts.ep_device);
  std::unique_ptr<Transport> transport = ConnectDxs(kEpPeer, read_fd, write_fd);
  const char device_memory = transport->SupportsMemory(MemoryType::kDevice) ? 1 : 0;
  WriteAll(write_fd, &device_memory, 1);

  std::vector<std::unique_ptr<WeightedSumExperts>> experts;
  std::vector<std::unique_ptr<ExpertStepServer>> servers;
  for (const Shape& s : kShapes) {
    ModelConfig config;
    config.hidden_size = s.hidden;
    config.num_hidden_layers = 1;
    config.num_experts = kNumExperts;
    config.num_experts_per_tok = kTopK;
    experts.push_back(std::make_unique<WeightedSumExperts>(backend.get(), s.hidden, kMaxTokens,
                                                           /*first_expert=*/0, kNumExperts));
    servers.push_back(std::make_unique<ExpertStepServer>(transport.get(), std::vector<int>{kDpPeer},
                                                         experts.back().get(), config));
  }
  std::vector<double> compute_us;
  for (;;) {
    Command command;
    ReadAll(read_fd, &command, sizeof(command));
    if (command.method == Method::kQuit) break;
    compute_us.clear();
    for (int64_t i = 0; i < command.count; ++i) {
      if (command.method == Method::kPingPong) {
        ping_pong.Answer(read_fd, write_fd);
        continue;
      }
      ExpertStepServer& server = *servers.at(command.shape);
      const int64_t before_ns = server.counters().compute_ns.load();
      Check(server.ServeRound(absl::Now() + absl::Seconds(60)), "ServeRound");
      compute_us.push_back((server.counters().compute_ns.load() - before_ns) * 1e-3);
    }
    const int64_t n = static_cast<int64_t>(compute_us.size());
    WriteAll(write_fd, &n, sizeof(n));
    WriteAll(write_fd, compute_us.data(), n * sizeof(double));
  }
  servers.clear();
  experts.clear();
  transport.reset();
  ping_pong.Close();
  return 0;
}

// ---- DP rank (parent) -------------------------------------------------------------------

const char* WireName(DType wire) { return wire == DType::kF8E4M3 ? "fp8" : "bf16"; }

struct Row {
  const Shape* shape = nullptr;
  DType wire = DType::kBF16;
  int64_t tokens = 0;
  int64_t dispatch_bytes = 0;
  int64_t combine_bytes = 0;
  int64_t reps = 0;
  Stats dxs, ping_pong;
  double compute_us = 0;   // median of the EP rank's stand-in compute per round
  double exchange_us = 0;  // median of (round trip - that round's compute)
  double rows_gbps = 0;
};

std::string HardwareLine(int device) {
  cudaDeviceProp prop;
  BENCH_CUDA(cudaGetDeviceProperties(&prop, device));
  char line[512];
  std::snprintf(line, sizeof(line), "%s, %d SMs, %.0f GiB; UCX %s", prop.name,
                prop.multiProcessorCount, prop.totalGlobalMem / 1073741824.0,
                ucp_get_version_string());
  return line;
}

void PrintTable(const std::vector<Row>& rows, const std::string& hardware, const Options& opts) {
  std::printf(
      "gpu_exchange_bench: dxs dispatch+combine round trip between two processes, against the "
      "interprocess-event ping-pong, same run\n");
  std::printf("hardware: %s\n", hardware.c_str());
  std::printf(
      "layout: 1 DP rank (parent) x 1 EP rank (forked child) holding all %d experts, top-%d, "
      "%s\n"
      "memory: device; x, routing, out and the EP rank's rows are CUDA backend tensors and the "
      "UCX transport moves them as UCS_MEMORY_TYPE_CUDA (bf16 activations; wire bf16, or fp8 "
      "dispatch rows with bf16 answers)\n"
      "x and out: %s\n"
      "experts: stand-in on the EP rank's GPU, out[r] = (sum of r's weights) * x[r] (Fill, "
      "GatherRows, ScaleAddRows, Copy); cmp_us = its time per round, waited for\n"
      "bytes: disp_B = dxs header + rows*hidden*2 (fp8: rows*(hidden + 4*hidden/128)) + "
      "12*pairs, comb_B = rows*hidden*2; "
      "rows_GB/s = row bytes of both directions / dxs_med\n"
      "times: host wall-clock per round trip (us), median and p99 of %lld runs after warm-up, "
      "the two methods interleaved; xchg_us = median of (round trip - that round's cmp_us); "
      "pp = interprocess-event ping-pong (kernel + event each way); dxs/pp = dxs_med / pp_med\n\n",
      kNumExperts, kTopK,
      opts.dp_device == opts.ep_device
          ? absl::StrCat("both on GPU ", opts.dp_device, ", time-sliced (no MPS)").c_str()
          : absl::StrCat("DP rank on GPU ", opts.dp_device, ", EP rank on GPU ", opts.ep_device)
                .c_str(),
      opts.staged ? "the executor's staged buffers (as the model; read and answered in place)"
                  : "the bench's own tensors",
      static_cast<long long>(rows.empty() ? 0 : rows[0].reps));
  std::printf("%-6s %-5s %6s %10s %10s %9s %9s %8s %9s %8s %8s %7s %9s\n", "shape", "wire",
              "tokens", "disp_B", "comb_B", "dxs_med", "dxs_p99", "cmp_us", "xchg_us", "pp_med",
              "pp_p99", "dxs/pp", "rows_GB/s");
  for (const Row& r : rows) {
    std::printf("%-6s %-5s %6lld %10lld %10lld %9.1f %9.1f %8.1f %9.1f %8.1f %8.1f %7.2f %9.2f\n",
                r.shape->name, WireName(r.wire), static_cast<long long>(r.tokens),
                static_cast<long long>(r.dispatch_bytes), static_cast<long long>(r.combine_bytes),
                r.dxs.median, r.dxs.p99, r.compute_us, r.exchange_us, r.ping_pong.median,
                r.ping_pong.p99, r.dxs.median / r.ping_pong.median, r.rows_gbps);
  }
  // FP8 against bf16 rows, each pair of rows from the same run.
  std::printf("\nfp8 / bf16 dispatch rows: round trip (dxs_med) and dispatch bytes\n");
  std::printf("%-6s %6s %9s %9s %8s %8s\n", "shape", "tokens", "bf16_us", "fp8_us", "bf16/fp8",
              "bytes");
  for (const Row& f : rows) {
    if (f.wire != DType::kF8E4M3) continue;
    for (const Row& b : rows) {
      if (b.wire != DType::kBF16 || b.shape != f.shape || b.tokens != f.tokens) continue;
      std::printf("%-6s %6lld %9.1f %9.1f %8.2f %8.3f\n", f.shape->name,
                  static_cast<long long>(f.tokens), b.dxs.median, f.dxs.median,
                  b.dxs.median / f.dxs.median,
                  static_cast<double>(f.dispatch_bytes) / static_cast<double>(b.dispatch_bytes));
    }
  }
}

int RunAttentionRank(int read_fd, int write_fd, const Options& opts) {
  absl::StatusOr<std::unique_ptr<Backend>> made = MakeCudaBackendHere(opts.dp_device);
  const std::string child_error =
      TradeErrors(read_fd, write_fd, made.ok() ? "" : std::string(made.status().message()));
  if (!made.ok() || !child_error.empty()) {
    std::string why = made.ok() ? child_error : std::string(made.status().message());
    std::replace(why.begin(), why.end(), '\n', ' ');
    std::fprintf(stderr, "gpu_exchange_bench: needs a usable GPU; MakeBackend(\"cuda\") says: %s\n",
                 why.c_str());
    return 1;
  }
  std::unique_ptr<Backend> backend = std::move(*made);
  PingPongEnd ping_pong;
  ping_pong.Open(read_fd, write_fd, opts.dp_device);
  std::unique_ptr<Transport> transport = ConnectDxs(kDpPeer, read_fd, write_fd);
  char child_device_memory = 0;
  ReadAll(read_fd, &child_device_memory, 1);
  if (!transport->SupportsMemory(MemoryType::kDevice) || child_device_memory == 0) {
    const Command quit = {Method::kQuit, 0, 0};
    WriteAll(write_fd, &quit, sizeof(quit));
    Die(std::string("UCX ") + ucp_get_version_string() +
        " cannot move device memory here (no UCS_MEMORY_TYPE_CUDA: its CUDA transports did "
        "not load; check UCX_MODULE_DIR and that libucx is the CUDA build)");
  }
  const std::string hardware = HardwareLine(opts.dp_device);
  const std::string ucx_version = ucp_get_version_string();

  // Tells the EP rank to serve n round trips of `method`, and collects its per-round
  // compute times once they are done.
  auto serve = [&](Method method, int shape, int64_t n) {
    const Command c = {method, shape, n};
    WriteAll(write_fd, &c, sizeof(c));
  };
  auto served = [&] {
    int64_t n = 0;
    ReadAll(read_fd, &n, sizeof(n));
    std::vector<double> compute_us(n);
    ReadAll(read_fd, compute_us.data(), n * sizeof(double));
    return compute_us;
  };

  // Every shape's device buffers first, sized for the largest row.
  std::vector<ExchangeInputs> inputs;
  for (size_t si = 0; si < std::size(kShapes); ++si) {
    inputs.push_back(bench::MakeExchangeInputs(backend.get(), kShapes[si].hidden, kMaxTokens,
                                               kNumExperts, kTopK, kActivations, kSeed + si));
  }
  std::ofstream json;
  if (!opts.json.empty()) {
    json.open(opts.json);
    if (!json) Die("cannot write " + opts.json);
  }
  const int64_t header_bytes = static_cast<int64_t>(WireHeader().Encode().size());
  uint64_t step = 0;
  std::vector<Row> rows;
  for (size_t si = 0; si < std::size(kShapes); ++si) {
    const Shape& s = kShapes[si];
    ExchangeInputs& in = inputs[si];
    for (const DType wire : kWires) {
      const DispatchOptions options = DispatchOptionsForWire(wire, absl::Seconds(60));
      RemoteMoeExecutor executor(backend.get(), transport.get(), {kEpPeer},
                                 Placement::Contiguous(kNumExperts, 1), s.hidden, options);
      for (int64_t tokens : kTokensPerDpRank) {
        Tensor x = in.x.Rows(0, tokens);
        const Tensor ids = in.ids_dev.Rows(0, tokens);
        const Tensor weights = in.weights_dev.Rows(0, tokens);
        Tensor out = in.out.Rows(0, tokens);
        // NaN until a combine writes it: a row the exchange missed fails the check.
        Check(backend->Fill(&out, std::numeric_limits<float>::quiet_NaN()), "fill out");
        Tensor staged_x, staged_out;
        const bool staged =
            opts.staged && executor.StageBuffers(0, tokens, kActivations, &staged_x, &staged_out);
        if (staged) {
          Check(backend->Copy(x, &staged_x), "stage x");
          Check(backend->Fill(&staged_out, std::numeric_limits<float>::quiet_NaN()), "fill out");
          x = staged_x;
          std::swap(out, staged_out);  // staged_out: the checked output, copied after the row
        }
        std::vector<double> dxs_us, compute_us, exchange_us, ping_pong_us;
        auto dxs_block = [&](int64_t n, bool keep) {
          serve(Method::kDxs, static_cast<int>(si), n);
          const size_t first = dxs_us.size();
          for (int64_t i = 0; i < n; ++i) {
            const double t0 = NowUs();
            executor.set_step(++step);
            Check(executor.Run(kLayer, x, ids, weights, &out), "RemoteMoeExecutor::Run");
            dxs_us.push_back(NowUs() - t0);
          }
          const std::vector<double> cmp = served();
          if (cmp.size() != static_cast<size_t>(n)) Die("EP rank: wrong number of rounds");
          if (!keep) {
            dxs_us.resize(first);
            return;
          }
          for (int64_t i = 0; i < n; ++i) {
            compute_us.push_back(cmp[i]);
            exchange_us.push_back(dxs_us[first + i] - cmp[i]);
          }
        };
        auto ping_pong_block = [&](int64_t n, bool keep) {
          serve(Method::kPingPong, 0, n);
          for (int64_t i = 0; i < n; ++i) {
            const double t0 = NowUs();
            ping_pong.Initiate(read_fd, write_fd);
            if (keep) ping_pong_us.push_back(NowUs() - t0);
          }
          if (!served().empty()) Die("EP rank: compute times for a ping-pong");
        };
        dxs_block(kWarmupReps, false);
        ping_pong_block(kWarmupReps, false);
        const int64_t block = (opts.reps + kBlocks - 1) / kBlocks;
        for (int b = 0; b < kBlocks; ++b) {
          dxs_block(block, true);
          ping_pong_block(block, true);
        }
        if (staged) Check(backend->Copy(out, &staged_out), "the staged output, to check");
        const double error = bench::MaxRelativeError(backend.get(), in, tokens);
        if (!(error <= (options.fp8_dispatch ? kMaxRelativeErrorFp8 : kMaxRelativeError))) {
          Die("dxs: combined output is wrong at " + std::to_string(tokens) + " tokens, hidden " +
              std::to_string(s.hidden) + ", " + WireName(wire) + " rows (max relative error " +
              std::to_string(error) + ")");
        }
        Row row;
        row.shape = &s;
        row.wire = wire;
        row.tokens = tokens;
        const int64_t row_bytes = tokens * s.hidden * static_cast<int64_t>(DTypeSize(kActivations));
        const int64_t dispatch_row_bytes =
            options.fp8_dispatch ? tokens * Fp8RecordBytes(s.hidden) : row_bytes;
        row.dispatch_bytes = header_bytes + dispatch_row_bytes + 12 * tokens * kTopK;
        row.combine_bytes = row_bytes;
        row.reps = static_cast<int64_t>(dxs_us.size());
        row.dxs = StatsOf(dxs_us);
        row.ping_pong = StatsOf(ping_pong_us);
        row.compute_us = StatsOf(compute_us).median;
        row.exchange_us = StatsOf(exchange_us).median;
        row.rows_gbps =
            static_cast<double>(dispatch_row_bytes + row_bytes) / (row.dxs.median * 1e-6) / 1e9;
        rows.push_back(row);
        if (json.is_open()) {
          nlohmann::json j = {{"section", "exchange"},
                              {"shape", s.name},
                              {"hidden", s.hidden},
                              {"experts", kNumExperts},
                              {"top_k", kTopK},
                              {"wire", WireName(wire)},
                              {"memory", "device"},
                              {"tokens", tokens},
                              {"dispatch_bytes", row.dispatch_bytes},
                              {"combine_bytes", row.combine_bytes},
                              {"reps", row.reps},
                              {"dxs_median_us", row.dxs.median},
                              {"dxs_p99_us", row.dxs.p99},
                              {"compute_us", row.compute_us},
                              {"exchange_us", row.exchange_us},
                              {"pingpong_median_us", row.ping_pong.median},
                              {"pingpong_p99_us", row.ping_pong.p99},
                              {"ratio", row.dxs.median / row.ping_pong.median},
                              {"rows_gbps", row.rows_gbps},
                              {"max_rel_error", error},
                              {"hardware", hardware},
                              {"ucx", ucx_version}};
          json << j.dump() << "\n" << std::flush;
        }
      }
    }
  }
  const Command quit = {Method::kQuit, 0, 0};
  WriteAll(write_fd, &quit, sizeof(quit));
  PrintTable(rows, hardware, opts);
  inputs.clear();
  transport.reset();
  ping_pong.Close();
  return 0;
}

Options ParseOptions(int argc, char** argv) {
  Options opts;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--reps" && i + 1 < argc) {
      opts.reps = std::atoll(argv[++i]);
    } else if (arg == "--json" && i + 1 < argc) {
      opts.json = argv[++i];
    } else if (arg == "--devices" && i + 1 < argc) {
      if (std::sscanf(argv[++i], "%d,%d", &opts.dp_device, &opts.ep_device) != 2 ||
          opts.dp_device < 0 || opts.ep_device < 0) {
        Die("--devices takes A,B (GPU ordinals)");
      }
    } else if (arg.rfind("--in-out=", 0) == 0) {
      const std::string v = arg.substr(9);
      if (v != "staged" && v != "own") Die("--in-out=staged|own");
      opts.staged = v == "staged";
    } else {
      Die("unknown argument '" + arg +
          "'; usage: gpu_exchange_bench [--reps N] [--json FILE] [--devices A,B] "
          "[--in-out=staged|own]");
    }
  }
  if (opts.reps < kMinReps) Die("--reps must be at least " + std::to_string(kMinReps));
  return opts;
}

}  // namespace
}  // namespace dxs

int main(int argc, char** argv) {
  absl::InitializeSymbolizer(argv[0]);
  absl::InstallFailureSignalHandler(absl::FailureSignalHandlerOptions());
  const dxs::Options options = dxs::ParseOptions(argc, argv);
  // Nothing has touched CUDA or UCX yet.
  const dxs::bench::ForkedRank ep = dxs::bench::ForkRank(
      dxs::kWatchdogSeconds,
      [&](int read_fd, int write_fd) { return dxs::RunExpertRank(read_fd, write_fd, options); });
  alarm(dxs::kWatchdogSeconds);
  const int rc = dxs::RunAttentionRank(ep.from_rank, ep.to_rank, options);
  if (!dxs::bench::RankSucceeded(ep.pid, /*kill=*/false) && rc == 0) {
    dxs::bench::Die("EP rank process failed");
  }
  return rc;
}
