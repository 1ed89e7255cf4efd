// Dispatch + combine over D DP ranks x E EP ranks, one process each (a benchmark, not a
// test): the 2 DP x 2 EP exchange, on GPUs over nccl or ucx, or on the CPU over ucx.
//
// Transport ranks 0..D-1 are DP ranks (RemoteMoeExecutor::Run, the attention side), D..D+E-1
// EP ranks (ExpertStepServer::ServeRound), each its own process, forked by a coordinator
// that touches neither UCX nor a GPU (neither survives a fork) and drives them over pipes.
// Each process makes its backend (MakeBackend: "cpu" or "cuda:N") and its transport as the
// services do (MakeWorkerTransport: ucx, or nccl over a ucx control channel with the
// communicator over all D+E ranks; the coordinator makes its unique id). 128 experts, top-8,
// split evenly over the EP ranks (Placement::Contiguous); bf16 activations and wire. The
// experts are bench/exchange_bench_util.h's stand-in, out[r] = (sum of r's weights over the
// experts held) * x[r], whose time each EP rank reports per round (ExpertCounters::
// compute_ns); the combine's sum over the EP ranks gives (sum of the top-8 weights) * x[t],
// checked on every DP rank after each block of rounds (a wrong answer aborts).
//
// Baseline, in the same run, between the same processes: xfer, the transport's grouped
// exchange alone (DataExchange::PostExchange, sizes known in advance: no counts, no
// headers, no layout, no experts) moving the same row bytes each way, DP rank d's rows for
// EP rank e = its tokens with any of their top-8 experts on e. It is what the transport
// costs the engine at best; PyTorch's all_to_all_single over the same GPUs runs in the same
// device call (bench/gpu/torch_all_to_all.py, run_device.sh gpus).
//
// Timing: each DP rank times every round trip on the host (steady clock; on the GPU a
// round ends when its output is on the device and synchronised); a round's time is that of
// the slowest DP rank, its compute that of the slowest EP rank; xchg_us = median over the
// rounds of (round - compute). Warm-up first; then dxs and xfer run interleaved in blocks,
// so a burst of load hits both; medians and p99.
//
// Usage: exchange_ranks_bench [--ranks DxE] [--device cpu|cuda] [--gpus A,B,...]
//            [--transport ucx|nccl] [--hidden H,...] [--tokens N,...] [--reps N]
//            [--idle-dp-rank] [--json FILE]
//   --ranks: D DP and E EP ranks (default 2x2); --gpus: rank r on GPU list[r % size]
//   (default 0: every rank on GPU 0, time-sliced; nccl needs one GPU per rank);
//   --tokens: tokens per DP rank (default 1,128,1024,4096; on the CPU 1,128,1024);
//   --hidden: default 2048,7168 (on the CPU 2048); --reps: measured rounds per method
//   and row (default 200, at least 20); --idle-dp-rank: the last DP rank has no tokens
//   (it still takes part in every round, as an empty-batch rank must).
// Exit status 1, with one line on stderr, if a rank cannot start (no GPU, NCCL or UCX
// cannot move device memory) or the bench itself fails.
#include <ucp/api/ucp.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <csignal>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <limits>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "absl/debugging/failure_signal_handler.h"
#include "absl/debugging/symbolize.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "bench/exchange_bench_util.h"
#include "bench/raw_ucx_pingpong.h"
#include "common/model_config.h"
#include "dataplane/dispatch/dispatch_combine.h"
#include "dataplane/dispatch/placement.h"
#include "dataplane/transport/transport_table.h"
#include "expert_service/expert_step_server.h"
#include "kernels/make_backend.h"
#include "nlohmann/json.hpp"
#include "router/control_plane/nccl_unique_id.h"
#include "worker/worker_transport.h"

namespace dxs {
namespace {

using bench::Check;
using bench::Die;
using bench::ExchangeInputs;
using bench::Must;
using bench::ReadAll;
using bench::ReadString;
using bench::Stats;
using bench::StatsOf;
using bench::WriteAll;
using bench::WriteString;

constexpr int kNumExperts = 128;
constexpr int kTopK = 8;
constexpr DType kWire = DType::kBF16;
constexpr uint64_t kSeed = 20261203;
constexpr int64_t kMinReps = 20;
constexpr int64_t kWarmupReps = 10;
constexpr int kBlocks = 4;  // per row, each method runs this many interleaved blocks
constexpr unsigned kWatchdogSeconds = 560;
constexpr double kMaxRelativeError = 1e-2;  // bf16 rounding of x and of the answer
// The baseline's tags: above any the engine uses in a run this short.
constexpr uint64_t kXferDispatchTag = kMaxExchangeTag - 1;
constexpr uint64_t kXferCombineTag = kMaxExchangeTag - 2;
const absl::Duration kTimeout = absl::Seconds(60);

struct Options {
  int dp = 2, ep = 2;
  std::string device = "cpu";
  std::vector<int> gpus = {0};
  std::string transport = "ucx";
  std::vector<int64_t> hidden, tokens;
  int64_t reps = 200;
  bool idle_dp_rank = false;
  std::string json;

  int world() const { return dp + ep; }
  bool is_dp(int rank) const { return rank < dp; }
  std::string device_of(int rank) const {
    if (device == "cpu") return "cpu";
    return absl::StrCat("cuda:", gpus[static_cast<size_t>(rank) % gpus.size()]);
  }
  // DP rank `rank`'s tokens in a row of `tokens` per DP rank.
  int64_t tokens_of(int rank, int64_t tokens) const {
    return idle_dp_rank && rank == dp - 1 ? 0 : tokens;
  }
  int64_t max_tokens() const { return *std::max_element(tokens.begin(), tokens.end()); }
};

// ---- Coordinator <-> rank messages (pipes) ----------------------------------------------

enum class Method : int32_t { kDxs = 1, kXfer = 2, kQuit = 3 };

struct Command {
  Method method = Method::kQuit;
  int32_t shape = 0;   // index into Options::hidden
  int64_t tokens = 0;  // per DP rank
  int64_t count = 0;   // rounds
};

// What a rank answers a command with: per round its wall time (DP) or compute time (EP),
// in us, and on a DP rank after dxs rounds the output's max relative error.
struct Reply {
  std::vector<double> us;
  double error = 0;
};

void WriteReply(int fd, const Reply& r) {
  const int64_t n = static_cast<int64_t>(r.us.size());
  WriteAll(fd, &n, sizeof(n));
  if (n > 0) WriteAll(fd, r.us.data(), n * sizeof(double));
  WriteAll(fd, &r.error, sizeof(r.error));
}

Reply ReadReply(int fd) {
  Reply r;
  int64_t n = 0;
  ReadAll(fd, &n, sizeof(n));
  r.us.resize(static_cast<size_t>(n));
  if (n > 0) ReadAll(fd, r.us.data(), n * sizeof(double));
  ReadAll(fd, &r.error, sizeof(r.error));
  return r;
}

double NowUs() {
  return std::chrono::duration<double, std::micro>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// The experts EP rank `e` holds (of kNumExperts, contiguous).
int FirstExpert(int e, int ep) { return e * (kNumExperts / ep); }

// How many of the first `tokens` tokens of `in` have any top-k expert on each EP rank.
std::vector<int64_t> RowsPerEpRank(const ExchangeInputs& in, int64_t tokens, int ep) {
  std::vector<int64_t> rows(static_cast<size_t>(ep), 0);
  for (int64_t t = 0; t < tokens; ++t) {
    std::vector<bool> goes(static_cast<size_t>(ep), false);
    for (int k = 0; k < kTopK; ++k) goes[in.ids[t * kTopK + k] / (kNumExperts / ep)] = true;
    for (int e = 0; e < ep; ++e) rows[static_cast<size_t>(e)] += goes[static_cast<size_t>(e)];
  }
  return rows;
}

// ---- A rank -----------------------------------------------------------------------------

class Rank {
 public:
  Rank(const Options& opts, int rank, int read_fd, int write_fd)
      : opts_(opts), rank_(rank), read_fd_(read_fd), write_fd_(write_fd) {}

  int Run() {
    // Start-up: backend and transport, or the reason there are none.
    std::string error;
    absl::StatusOr<std::unique_ptr<Backend>> backend = MakeBackend(opts_.device_of(rank_));
    absl::StatusOr<WorkerTransport> transport =
        absl::FailedPreconditionError("no backend, so no transport");
    if (backend.ok()) transport = MakeWorkerTransport(opts_.transport, opts_.device_of(rank_));
    if (!backend.ok()) {
      error = std::string(backend.status().message());
    } else if (!transport.ok()) {
      error = std::string(transport.status().message());
    } else if (!transport->transport->SupportsMemory(TransportMemoryOf(**backend))) {
      error = absl::StrCat("the ", opts_.transport, " transport cannot move ",
                           (*backend)->device() == Device::kCpu ? "host" : "device",
                           " memory here (UCX without its CUDA transports?)");
    }
    if (!error.empty()) {
      WriteString(write_fd_,
                  absl::StrCat("rank ", rank_, " (", opts_.device_of(rank_), "): ", error));
      return 1;
    }
    backend_ = std::move(*backend);
    wt_ = std::move(*transport);
    Transport* t = wt_.transport.get();
    Check(t->SetSelf(rank_), "SetSelf");
    WriteString(write_fd_, "");
    WriteString(write_fd_, t->LocalAddress());
    // Every rank's address, then the NCCL id ("" for ucx).
    std::vector<std::string> addresses;
    for (int r = 0; r < opts_.world(); ++r) addresses.push_back(ReadString(read_fd_));
    const std::string nccl_id = ReadString(read_fd_);
    for (int r = 0; r < opts_.world(); ++r) {
      if (opts_.is_dp(r) != opts_.is_dp(rank_)) Check(t->Connect(r, addresses[r]), "Connect");
    }
    if (wt_.nccl != nullptr) Check(wt_.nccl->Init(opts_.world(), rank_, nccl_id), "NCCL Init");
    Setup();
    WriteString(write_fd_, "ready");
    if (opts_.is_dp(rank_)) {
      // The rows this rank sends each EP rank in each row of the table: the coordinator
      // hands them to both ends of each baseline round.
      for (const ExchangeInputs& in : inputs_) {
        for (int64_t tokens : opts_.tokens) {
          const std::vector<int64_t> rows =
              RowsPerEpRank(in, opts_.tokens_of(rank_, tokens), opts_.ep);
          WriteAll(write_fd_, rows.data(), rows.size() * sizeof(int64_t));
        }
      }
    }
    for (;;) {
      Command c;
      ReadAll(read_fd_, &c, sizeof(c));
      if (c.method == Method::kQuit) break;
      WriteReply(write_fd_, opts_.is_dp(rank_) ? Dp(c) : Ep(c));
    }
    servers_.clear();
    experts_.clear();
    executors_.clear();
    inputs_.clear();
    scratch_ = Tensor();
    wt_.transport.reset();
    return 0;
  }

 private:
  MemoryType memory() const { return TransportMemoryOf(*backend_); }
  std::vector<int64_t> ReadCounts(int n) {
    std::vector<int64_t> counts(static_cast<size_t>(n));
    ReadAll(read_fd_, counts.data(), counts.size() * sizeof(int64_t));
    return counts;
  }
  std::vector<int> Peers(bool dp) const {
    std::vector<int> peers;
    for (int r = 0; r < opts_.world(); ++r) {
      if (opts_.is_dp(r) == dp) peers.push_back(r);
    }
    return peers;
  }

  void Setup() {
    const int64_t max_tokens = opts_.max_tokens();
    const int64_t max_hidden = *std::max_element(opts_.hidden.begin(), opts_.hidden.end());
    const int ep_index = rank_ - opts_.dp;
    for (size_t si = 0; si < opts_.hidden.size(); ++si) {
      const int64_t hidden = opts_.hidden[si];
      if (opts_.is_dp(rank_)) {
        inputs_.push_back(bench::MakeExchangeInputs(backend_.get(), hidden, max_tokens, kNumExperts,
                                                    kTopK, kWire, kSeed + 1000 * si + rank_));
        DispatchOptions options;
        options.wire_dtype = kWire;
        options.timeout = kTimeout;
        executors_.push_back(std::make_unique<RemoteMoeExecutor>(
            backend_.get(), wt_.transport.get(), Peers(false),
            Placement::Contiguous(kNumExperts, opts_.ep), hidden, options));
      } else {
        ModelConfig config;
        config.hidden_size = hidden;
        config.num_hidden_layers = 1;
        config.num_experts = kNumExperts;
        config.num_experts_per_tok = kTopK;
        experts_.push_back(std::make_unique<bench::WeightedSumExperts>(
            backend_.get(), hidden, opts_.dp * max_tokens, FirstExpert(ep_index, opts_.ep),
            kNumExperts / opts_.ep));
        servers_.push_back(std::make_unique<ExpertStepServer>(wt_.transport.get(), Peers(true),
                                                              experts_.back().get(), config));
      }
    }
    // The baseline's buffers: a DP rank receives each EP rank's rows into its own slice,
    // an EP rank each DP rank's.
    const int64_t slices = opts_.is_dp(rank_) ? opts_.ep : opts_.dp;
    scratch_ = Must(backend_->Allocate({slices * max_tokens, max_hidden}, kWire), "scratch");
    Check(backend_->Fill(&scratch_, 1.f), "fill scratch");
    Check(backend_->Synchronize(), "fill scratch");
  }

  Reply Dp(const Command& c) {
    Reply reply;
    ExchangeInputs& in = inputs_[static_cast<size_t>(c.shape)];
    const int64_t tokens = opts_.tokens_of(rank_, c.tokens);
    const Tensor x = in.x.Rows(0, tokens);
    if (c.method == Method::kDxs) {
      RemoteMoeExecutor& executor = *executors_[static_cast<size_t>(c.shape)];
      const Tensor ids = in.ids_dev.Rows(0, tokens);
      const Tensor weights = in.weights_dev.Rows(0, tokens);
      Tensor out = in.out.Rows(0, tokens);
      // NaN until a combine writes it: a row the exchange missed fails the check.
      Check(backend_->Fill(&out, std::numeric_limits<float>::quiet_NaN()), "fill out");
      Check(backend_->Synchronize(), "fill out");
      for (int64_t i = 0; i < c.count; ++i) {
        const double t0 = NowUs();
        executor.set_step(++step_);
        Check(executor.Run(/*layer=*/0, x, ids, weights, &out), "RemoteMoeExecutor::Run");
        Check(backend_->Synchronize(), "synchronize");
        reply.us.push_back(NowUs() - t0);
      }
      reply.error = tokens > 0 ? bench::MaxRelativeError(backend_.get(), in, tokens) : 0;
      return reply;
    }
    // xfer: this rank's rows for each EP rank out of x, each EP rank's back into a slice;
    // the counts (RowsPerEpRank's, from setup) come after the command.
    const std::vector<int64_t> rows = ReadCounts(opts_.ep);
    const size_t row_bytes = static_cast<size_t>(in.hidden) * DTypeSize(kWire);
    std::vector<Transfer> sends, recvs;
    for (int e = 0; e < opts_.ep; ++e) {
      const size_t bytes = static_cast<size_t>(rows[e]) * row_bytes;
      sends.push_back({Transfer::Kind::kSend, opts_.dp + e, x.raw(), bytes, memory()});
      recvs.push_back({Transfer::Kind::kRecv, opts_.dp + e,
                       scratch_.Rows(e * opts_.max_tokens(), 1).raw(), bytes, memory()});
    }
    Transport* t = wt_.transport.get();
    for (int64_t i = 0; i < c.count; ++i) {
      const double t0 = NowUs();
      const ExchangeId a = Must(t->PostExchange(kXferDispatchTag, sends.data(), sends.size()),
                                "post the baseline's sends");
      const ExchangeId b = Must(t->PostExchange(kXferCombineTag, recvs.data(), recvs.size()),
                                "post the baseline's receives");
      Check(t->WaitExchange(a, absl::Now() + kTimeout), "the baseline's sends");
      Check(t->WaitExchange(b, absl::Now() + kTimeout), "the baseline's receives");
      reply.us.push_back(NowUs() - t0);
    }
    return reply;
  }

  Reply Ep(const Command& c) {
    Reply reply;
    if (c.method == Method::kDxs) {
      ExpertStepServer& server = *servers_[static_cast<size_t>(c.shape)];
      for (int64_t i = 0; i < c.count; ++i) {
        const int64_t before_ns = server.counters().compute_ns.load();
        Check(server.ServeRound(absl::Now() + kTimeout), "ServeRound");
        reply.us.push_back((server.counters().compute_ns.load() - before_ns) * 1e-3);
      }
      return reply;
    }
    // xfer: the DP ranks' row counts for this rank come after the command.
    const std::vector<int64_t> rows = ReadCounts(opts_.dp);
    const size_t row_bytes =
        static_cast<size_t>(opts_.hidden[static_cast<size_t>(c.shape)]) * DTypeSize(kWire);
    std::vector<Transfer> recvs, sends;
    for (int d = 0; d < opts_.dp; ++d) {
      void* slice = scratch_.Rows(d * opts_.max_tokens(), 1).raw();
      const size_t bytes = static_cast<size_t>(rows[d]) * row_bytes;
      recvs.push_back({Transfer::Kind::kRecv, d, slice, bytes, memory()});
      sends.push_back({Transfer::Kind::kSend, d, slice, bytes, memory()});
    }
    Transport* t = wt_.transport.get();
    for (int64_t i = 0; i < c.count; ++i) {
      const ExchangeId a = Must(t->PostExchange(kXferDispatchTag, recvs.data(), recvs.size()),
                                "post the baseline's receives");
      Check(t->WaitExchange(a, absl::Now() + kTimeout), "the baseline's receives");
      const ExchangeId b = Must(t->PostExchange(kXferCombineTag, sends.data(), sends.size()),
                                "post the baseline's sends");
      Check(t->WaitExchange(b, absl::Now() + kTimeout), "the baseline's sends");
      reply.us.push_back(0);
    }
    return reply;
  }

  const Options& opts_;
  const int rank_;
  const int read_fd_, write_fd_;
  std::unique_ptr<Backend> backend_;
  WorkerTransport wt_;
  uint64_t step_ = 0;
  std::vector<ExchangeInputs> inputs_;                               // DP: per shape
  std::vector<std::unique_ptr<RemoteMoeExecutor>> executors_;        // DP: per shape
  std::vector<std::unique_ptr<bench::WeightedSumExperts>> experts_;  // EP: per shape
  std::vector<std::unique_ptr<ExpertStepServer>> servers_;           // EP: per shape
  Tensor scratch_;                                                   // the baseline's slices
};

// ---- The coordinator --------------------------------------------------------------------

struct Pipes {
  int to_rank = -1, from_rank = -1;
};

struct Row {
  int64_t hidden = 0, tokens = 0;
  int64_t row_bytes = 0;  // rows each way, all DP ranks, one direction
  int64_t reps = 0;
  Stats dxs, xfer;
  double compute_us = 0, exchange_us = 0;
  double max_error = 0;
};

std::string HardwareLine(const Options& opts) {
  std::string line = absl::StrCat(bench::CpuModel(), ", ", sysconf(_SC_NPROCESSORS_ONLN),
                                  " cores; UCX ", ucp_get_version_string());
  if (opts.device == "cpu") return line;
  return absl::StrCat(line, "; ", bench::GpuModel());
}

void PrintTable(const std::vector<Row>& rows, const Options& opts, const std::string& hardware) {
  std::printf(
      "exchange_ranks_bench: dxs dispatch+combine over %d DP x %d EP ranks (one process each), "
      "against the transport's grouped exchange of the same rows, same run\n",
      opts.dp, opts.ep);
  std::printf("hardware: %s\n", hardware.c_str());
  const std::string where =
      opts.device == "cpu" ? "the CPU" : absl::StrCat("GPUs ", absl::StrJoin(opts.gpus, ","));
  std::printf(
      "transport: %s; memory: %s; ranks on %s; %d experts split evenly over the EP ranks, "
      "top-%d, bf16 wire%s\n",
      opts.transport.c_str(), opts.device == "cpu" ? "host" : "device", where.c_str(), kNumExperts,
      kTopK, opts.idle_dp_rank ? "; the last DP rank idle (no tokens)" : "");
  std::printf(
      "times: us per round trip of the slowest DP rank, median and p99 of %lld rounds; "
      "cmp_us = the slowest EP rank's stand-in experts; xchg_us = median(round - cmp); "
      "xfer = the same rows through DataExchange alone (sizes known, no headers, layout or "
      "experts); rows_B = row bytes one way, all DP ranks\n\n",
      static_cast<long long>(rows.empty() ? 0 : rows[0].reps));
  std::printf("%6s %7s %11s %9s %9s %8s %9s %9s %9s %9s %9s\n", "hidden", "tok/DP", "rows_B",
              "dxs_med", "dxs_p99", "cmp_us", "xchg_us", "xfer_med", "xfer_p99", "xchg/xfer",
              "dxs/xfer");
  for (const Row& r : rows) {
    std::printf("%6lld %7lld %11lld %9.1f %9.1f %8.1f %9.1f %9.1f %9.1f %9.2f %9.2f\n",
                static_cast<long long>(r.hidden), static_cast<long long>(r.tokens),
                static_cast<long long>(r.row_bytes), r.dxs.median, r.dxs.p99, r.compute_us,
                r.exchange_us, r.xfer.median, r.xfer.p99, r.exchange_us / r.xfer.median,
                r.dxs.median / r.xfer.median);
  }
}

// Starts the ranks, runs the table, prints it. 1 if a rank could not start.
int Coordinate(const Options& opts, const std::vector<Pipes>& pipes) {
  const int world = opts.world();
  std::vector<std::string> addresses;
  std::string failed;
  for (int r = 0; r < world && failed.empty(); ++r) {
    failed = ReadString(pipes[r].from_rank);
    if (failed.empty()) addresses.push_back(ReadString(pipes[r].from_rank));
  }
  std::string nccl_id;
  if (failed.empty() && FindTransport(opts.transport)->Has(kCommunicatorPerView)) {
    absl::StatusOr<std::string> id = NewNcclUniqueId();
    if (id.ok()) {
      nccl_id = *id;
    } else {
      failed = absl::StrCat("NCCL unique id: ", id.status().message());
    }
  }
  if (!failed.empty()) {
    std::replace(failed.begin(), failed.end(), '\n', ' ');
    std::fprintf(stderr, "exchange_ranks_bench: %s\n", failed.c_str());
    return 1;  // the ranks die with their pipes (PR_SET_PDEATHSIG)
  }
  for (int r = 0; r < world; ++r) {
    for (const std::string& a : addresses) WriteString(pipes[r].to_rank, a);
    WriteString(pipes[r].to_rank, nccl_id);
  }
  // xfer_rows[shape][tokens index][DP rank][EP rank]: the rows the baseline moves.
  const size_t num_shapes = opts.hidden.size(), num_tokens = opts.tokens.size();
  std::vector<std::vector<std::vector<std::vector<int64_t>>>> xfer_rows(
      num_shapes, std::vector<std::vector<std::vector<int64_t>>>(
                      num_tokens, std::vector<std::vector<int64_t>>(
                                      opts.dp, std::vector<int64_t>(opts.ep, 0))));
  for (int r = 0; r < world; ++r) {
    if (ReadString(pipes[r].from_rank) != "ready") Die("a rank did not start");
    if (!opts.is_dp(r)) continue;
    for (size_t si = 0; si < num_shapes; ++si) {
      for (size_t ti = 0; ti < num_tokens; ++ti) {
        std::vector<int64_t>& rows = xfer_rows[si][ti][r];
        ReadAll(pipes[r].from_rank, rows.data(), rows.size() * sizeof(int64_t));
      }
    }
  }
  const std::string hardware = HardwareLine(opts);
  std::ofstream json;
  if (!opts.json.empty()) {
    json.open(opts.json);
    if (!json) Die("cannot write " + opts.json);
  }
  std::vector<Row> table;
  for (size_t si = 0; si < num_shapes; ++si) {
    for (size_t ti = 0; ti < num_tokens; ++ti) {
      const int64_t tokens = opts.tokens[ti];
      std::vector<double> round_us, compute_us, exchange_us, xfer_us;
      double max_error = 0;
      // Runs `n` rounds of `method` on every rank; keeps the times if `keep`.
      auto block = [&](Method method, int64_t n, bool keep) {
        const Command c = {method, static_cast<int32_t>(si), tokens, n};
        for (int r = 0; r < world; ++r) {
          WriteAll(pipes[r].to_rank, &c, sizeof(c));
          if (method != Method::kXfer) continue;
          // A DP rank's counts to each EP rank, or each DP rank's to an EP rank.
          const auto& counts = xfer_rows[si][ti];
          std::vector<int64_t> mine;
          if (opts.is_dp(r)) {
            mine = counts[r];
          } else {
            for (int d = 0; d < opts.dp; ++d) mine.push_back(counts[d][r - opts.dp]);
          }
          WriteAll(pipes[r].to_rank, mine.data(), mine.size() * sizeof(int64_t));
        }
        std::vector<Reply> replies;
        for (int r = 0; r < world; ++r) replies.push_back(ReadReply(pipes[r].from_rank));
        for (int r = 0; r < opts.dp; ++r) max_error = std::max(max_error, replies[r].error);
        if (!keep) return;
        for (int64_t i = 0; i < n; ++i) {
          double dp_max = 0, ep_max = 0;
          for (int r = 0; r < world; ++r) {
            double& m = opts.is_dp(r) ? dp_max : ep_max;
            m = std::max(m, replies[r].us.at(static_cast<size_t>(i)));
          }
          if (method == Method::kXfer) {
            xfer_us.push_back(dp_max);
          } else {
            round_us.push_back(dp_max);
            compute_us.push_back(ep_max);
            exchange_us.push_back(dp_max - ep_max);
          }
        }
      };
      block(Method::kDxs, kWarmupReps, false);
      block(Method::kXfer, kWarmupReps, false);
      const int64_t n = (opts.reps + kBlocks - 1) / kBlocks;
      for (int b = 0; b < kBlocks; ++b) {
        block(Method::kDxs, n, true);
        block(Method::kXfer, n, true);
      }
      if (!(max_error <= kMaxRelativeError)) {
        Die(absl::StrCat("dxs: the combined output is wrong at ", tokens, " tokens, hidden ",
                         opts.hidden[si], " (max relative error ", max_error, ")"));
      }
      Row row;
      row.hidden = opts.hidden[si];
      row.tokens = tokens;
      for (const auto& per_dp : xfer_rows[si][ti]) {
        for (int64_t rows : per_dp) row.row_bytes += rows * row.hidden * DTypeSize(kWire);
      }
      row.reps = static_cast<int64_t>(round_us.size());
      row.dxs = StatsOf(round_us);
      row.xfer = StatsOf(xfer_us);
      row.compute_us = StatsOf(compute_us).median;
      row.exchange_us = StatsOf(exchange_us).median;
      row.max_error = max_error;
      table.push_back(row);
      if (json.is_open()) {
        nlohmann::json j = {{"section", "exchange_ranks"},
                            {"dp", opts.dp},
                            {"ep", opts.ep},
                            {"transport", opts.transport},
                            {"memory", opts.device == "cpu" ? "host" : "device"},
                            {"gpus", opts.gpus},
                            {"idle_dp_rank", opts.idle_dp_rank},
                            {"hidden", row.hidden},
                            {"tokens_per_dp_rank", tokens},
                            {"row_bytes", row.row_bytes},
                            {"reps", row.reps},
                            {"dxs_median_us", row.dxs.median},
                            {"dxs_p99_us", row.dxs.p99},
                            {"compute_us", row.compute_us},
                            {"exchange_us", row.exchange_us},
                            {"xfer_median_us", row.xfer.median},
                            {"xfer_p99_us", row.xfer.p99},
                            {"max_rel_error", max_error},
                            {"hardware", hardware}};
        json << j.dump() << "\n" << std::flush;
      }
    }
  }
  const Command quit;
  for (int r = 0; r < world; ++r) WriteAll(pipes[r].to_rank, &quit, sizeof(quit));
  PrintTable(table, opts, hardware);
  return 0;
}

std::vector<int64_t> ParseList(const std::string& flag, const std::string& value) {
  std::vector<int64_t> list;
  for (absl::string_view part : absl::StrSplit(value, ',')) {
    int64_t v = 0;
    if (!absl::SimpleAtoi(part, &v) || v < 0)
      Die(flag + " takes a list of numbers, not '" + value + "'");
    list.push_back(v);
  }
  return list;
}

Options ParseOptions(int argc, char** argv) {
  Options opts;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    const bool has_value = i + 1 < argc;
    if (arg == "--ranks" && has_value) {
      if (std::sscanf(argv[++i], "%dx%d", &opts.dp, &opts.ep) != 2 || opts.dp < 1 || opts.ep < 1 ||
          kNumExperts % opts.ep != 0) {
        Die("--ranks takes DxE, E dividing " + std::to_string(kNumExperts));
      }
    } else if (arg == "--device" && has_value) {
      opts.device = argv[++i];
      if (opts.device != "cpu" && opts.device != "cuda") Die("--device takes cpu or cuda");
    } else if (arg == "--gpus" && has_value) {
      opts.gpus.clear();
      for (int64_t g : ParseList(arg, argv[++i])) opts.gpus.push_back(static_cast<int>(g));
    } else if (arg == "--transport" && has_value) {
      opts.transport = argv[++i];
      const TransportSpec* spec = FindTransport(opts.transport);
      if (spec == nullptr || !spec->Has(kWorkers)) {
        Die("--transport takes " + TransportNames(kWorkers));
      }
    } else if (arg == "--hidden" && has_value) {
      opts.hidden = ParseList(arg, argv[++i]);
    } else if (arg == "--tokens" && has_value) {
      opts.tokens = ParseList(arg, argv[++i]);
    } else if (arg == "--reps" && has_value) {
      opts.reps = std::atoll(argv[++i]);
    } else if (arg == "--idle-dp-rank") {
      opts.idle_dp_rank = true;
    } else if (arg == "--json" && has_value) {
      opts.json = argv[++i];
    } else {
      Die("unknown argument '" + arg +
          "'; usage: exchange_ranks_bench [--ranks DxE] [--device cpu|cuda] [--gpus A,B,...] "
          "[--transport ucx|nccl] [--hidden H,...] [--tokens N,...] [--reps N] "
          "[--idle-dp-rank] [--json FILE]");
    }
  }
  const bool cpu = opts.device == "cpu";
  if (opts.hidden.empty())
    opts.hidden = cpu ? std::vector<int64_t>{2048} : std::vector<int64_t>{2048, 7168};
  if (opts.tokens.empty()) {
    opts.tokens =
        cpu ? std::vector<int64_t>{1, 128, 1024} : std::vector<int64_t>{1, 128, 1024, 4096};
  }
  for (int64_t h : opts.hidden) {
    if (h < 1) Die("--hidden: sizes must be positive");
  }
  if (opts.reps < kMinReps) Die("--reps must be at least " + std::to_string(kMinReps));
  if (opts.gpus.empty()) Die("--gpus: an empty list");
  const TransportSpec& transport = *FindTransport(opts.transport);
  if (transport.Has(kGpuMemoryOnly) && cpu) {
    Die("--transport " + opts.transport + " moves device memory: it needs --device cuda");
  }
  if (transport.Has(kCommunicatorPerView)) {
    std::set<std::string> devices;
    for (int r = 0; r < opts.world(); ++r) devices.insert(opts.device_of(r));
    if (static_cast<int>(devices.size()) != opts.world()) {
      Die("--transport nccl needs a GPU per rank (NCCL refuses two ranks on one GPU): give "
          "--gpus " +
          std::to_string(opts.world()) + " distinct GPUs");
    }
  }
  return opts;
}

}  // namespace
}  // namespace dxs

int main(int argc, char** argv) {
  absl::InitializeSymbolizer(argv[0]);
  absl::InstallFailureSignalHandler(absl::FailureSignalHandlerOptions());
  const dxs::Options options = dxs::ParseOptions(argc, argv);
  // Nothing has touched a GPU or UCX yet.
  std::vector<dxs::Pipes> pipes(static_cast<size_t>(options.world()));
  std::vector<pid_t> pids;
  for (int r = 0; r < options.world(); ++r) {
    const dxs::bench::ForkedRank forked =
        dxs::bench::ForkRank(dxs::kWatchdogSeconds, [&options, r](int read_fd, int write_fd) {
          dxs::Rank rank(options, r, read_fd, write_fd);
          return rank.Run();
        });
    pipes[r] = {forked.to_rank, forked.from_rank};
    pids.push_back(forked.pid);
  }
  alarm(dxs::kWatchdogSeconds);
  const int rc = dxs::Coordinate(options, pipes);
  for (const dxs::Pipes& p : pipes) close(p.to_rank);
  bool ranks_ok = true;
  for (pid_t pid : pids) ranks_ok = dxs::bench::RankSucceeded(pid, /*kill=*/rc != 0) && ranks_ok;
  if (rc == 0 && !ranks_ok) dxs::bench::Die("a rank process failed");
  return rc;
}
