// dxs bench: load generator for a running cluster (or, with --local, the single-process
// engine on the same prompts, as the baseline: requests go through its serving loop,
// LocalServer, and stream their tokens as a router's do). Prints throughput,
// time-to-first-token, inter-token and end-to-end latency percentiles, and errors by gRPC
// code.
//
// Two load shapes:
// - closed loop (the default): --concurrency lanes, each sending its next request when the
//   last one ends; fixed prompt and output lengths; after --warmup-requests (default: one
//   per lane) of the same shape, untimed, as vLLM's and SGLang's benchmarks warm up first
//   (graphs captured, allocator pools grown), with prompts of their own;
// - open loop (--request-rate R1,R2,..., as SGLang's bench_serving and vLLM's
//   benchmark_serving): requests arrive as a Poisson process at each rate in turn (inf: all
//   at once), at most --concurrency in flight when given; with --len-sigma S the prompt and
//   output lengths are drawn log-normal around --prompt-len and --output-len (a long tail,
//   clamped to 4x), seeded by --seed. Each rate reports throughput, TTFT, TPOT (time per
//   output token after the first) and ITL at p50 and p99, and goodput: the requests per
//   second that met the SLO (--slo-ttft-ms, 1000; --slo-tpot-ms, 50: Step-3's bar).
#include <grpcpp/grpcpp.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <functional>
#include <iomanip>
#include <iostream>
#include <limits>
#include <map>
#include <optional>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/mutex.h"
#include "common/status_macros.h"
#include "dxs/v1/frontend.grpc.pb.h"
#include "model/engine.h"
#include "model/local_server.h"
#include "model/sampler.h"
#include "nlohmann/json.hpp"
#include "tools/dxs/cli_args.h"
#include "tools/dxs/commands.h"
#include "tools/dxs/tls_flags.h"

namespace dxs::cli {
namespace {

using Clock = std::chrono::steady_clock;

double Ms(Clock::duration d) { return std::chrono::duration<double, std::milli>(d).count(); }

double Percentile(std::vector<double> v, double p) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const size_t i = std::min(v.size() - 1, static_cast<size_t>(p / 100.0 * v.size()));
  return v[i];
}

// Request i's prompt: `len` ids in [3, vocab), the same for every run and both modes.
std::vector<int32_t> BenchPrompt(int i, int64_t len, int64_t vocab) {
  SplitMix64 rng(0x5eed0000u + static_cast<uint64_t>(i));
  std::vector<int32_t> p(len);
  for (auto& t : p) t = static_cast<int32_t>(3 + rng.Next() % static_cast<uint64_t>(vocab - 3));
  return p;
}

struct Sample {
  double ttft_ms = 0, e2e_ms = 0;
  std::vector<double> itl_ms;
  int64_t tokens = 0;
  grpc::StatusCode code = grpc::StatusCode::OK;
  // Time per output token after the first (0 with fewer than two tokens).
  double TpotMs() const { return tokens > 1 ? (e2e_ms - ttft_ms) / (tokens - 1) : 0; }
};

// A request's figures as its tokens come: started at construction; Tokens(n) for each
// chunk of n tokens (n gaps of equal share since the last chunk), Finish(code) at its end.
class SampleRecorder {
 public:
  SampleRecorder() : start_(Clock::now()), last_(start_) {}

  void Tokens(int n) {
    const auto now = Clock::now();
    if (sample_.tokens == 0) {
      sample_.ttft_ms = Ms(now - start_);
    } else {
      for (int k = 0; k < n; ++k) sample_.itl_ms.push_back(Ms(now - last_) / n);
    }
    sample_.tokens += n;
    last_ = now;
  }

  Sample Finish(grpc::StatusCode code) {
    sample_.code = code;
    sample_.e2e_ms = Ms(Clock::now() - start_);
    return std::move(sample_);
  }

 private:
  Sample sample_;
  Clock::time_point start_, last_;
};

// One request of an open-loop run: its lengths and when it arrives (seconds from the start).
struct Arrival {
  int64_t prompt_len = 0, output_len = 0;
  double at_s = 0;
};

// `n` arrivals at `rate` requests/s (a Poisson process: exponential gaps; rate inf: all at
// 0), lengths log-normal with median `prompt_len` / `output_len` and shape `sigma` (0: the
// medians), clamped to [1, 4x the median]. The same for a given seed.
std::vector<Arrival> OpenLoopWorkload(int n, double rate, int64_t prompt_len, int64_t output_len,
                                      double sigma, uint64_t seed) {
  // Separate streams, so that a seed gives the same lengths at every rate.
  SplitMix64 gaps(seed), lengths(seed ^ 0x9e3779b97f4a7c15u);
  auto uniform = [](SplitMix64& rng) {  // in (0, 1)
    return (static_cast<double>(rng.Next() >> 11) + 0.5) / 9007199254740992.0;
  };
  auto length = [&](int64_t median) {
    if (sigma == 0) return median;
    // Box-Muller: one standard normal draw from two uniforms.
    const double z =
        std::sqrt(-2 * std::log(uniform(lengths))) * std::cos(2 * M_PI * uniform(lengths));
    const double v = std::round(static_cast<double>(median) * std::exp(sigma * z));
    return static_cast<int64_t>(std::clamp(v, 1.0, 4.0 * static_cast<double>(median)));
  };
  std::vector<Arrival> out(n);
  double t = 0;
  for (Arrival& a : out) {
    if (!std::isinf(rate)) t += -std::log(uniform(gaps)) / rate;
    a.at_s = t;
    a.prompt_len = length(prompt_len);
    a.output_len = length(output_len);
  }
  return out;
}

// The progress of a bench on stderr. On a terminal, one bar redrawn in place with carriage
// returns; anywhere else (a log file, a pipe, CI) a carriage return does not go back, and
// the redraws would pile up into one huge line, so it prints one line per 10% instead.
class Progress {
 public:
  Progress(int total, bool terminal) : total_(total), terminal_(terminal) {}
  void Tick() {
    // Counted under the lock, so lines come out in order whichever thread ticks.
    absl::MutexLock lock(&mu_);
    const int done = ++done_;
    const int tenths = 10 * done / total_;
    if (!terminal_ && tenths == last_tenths_) return;
    last_tenths_ = tenths;
    const int width = 30, filled = width * done / total_;
    std::cerr << (terminal_ ? "\r[" : "[") << std::string(filled, '#')
              << std::string(width - filled, '.') << "] " << done << "/" << total_ << " requests";
    if (!terminal_ || done == total_) std::cerr << "\n";
    std::cerr << std::flush;
  }

 private:
  const int total_;
  const bool terminal_;
  absl::Mutex mu_;
  int done_ ABSL_GUARDED_BY(mu_) = 0;
  int last_tenths_ ABSL_GUARDED_BY(mu_) = 0;
};

// One request to the router as a gRPC callback reactor: no thread of its own, so C
// requests in flight cost no C blocked threads (each waking per token) in the client.
// Deletes itself when done, after handing its Sample to `done`.
class RemoteCall final : public grpc::ClientReadReactor<v1::GenerateResponse> {
 public:
  RemoteCall(v1::Frontend::Stub* stub, const std::vector<int32_t>& prompt, int64_t output_len,
             std::function<void(Sample)> done)
      : done_(std::move(done)) {
    for (int32_t t : prompt) request_.add_prompt_token_ids(static_cast<uint32_t>(t));
    request_.mutable_sampling_params()->set_max_new_tokens(static_cast<int32_t>(output_len));
    request_.mutable_sampling_params()->set_temperature(0.f);
    request_.mutable_sampling_params()->set_ignore_eos(true);
    stub->async()->Generate(&context_, &request_, this);
    StartRead(&response_);
    StartCall();
  }

  void OnReadDone(bool ok) override {
    if (!ok) return;  // OnDone follows
    if (response_.has_chunk() && response_.chunk().token_ids_size() > 0) {
      recorder_.Tokens(response_.chunk().token_ids_size());
    }
    StartRead(&response_);
  }

  void OnDone(const grpc::Status& status) override {
    Sample sample = recorder_.Finish(status.error_code());
    std::function<void(Sample)> done = std::move(done_);
    delete this;
    done(std::move(sample));
  }

 private:
  grpc::ClientContext context_;
  v1::GenerateRequest request_;
  v1::GenerateResponse response_;
  SampleRecorder recorder_;
  std::function<void(Sample)> done_;
};

// One single-process request (LocalServer): the same figures as RemoteCall, from the sink's
// calls on the step thread.
class LocalCall {
 public:
  static void Start(LocalServer* server, uint64_t id, const std::vector<int32_t>& prompt,
                    int64_t output_len, std::function<void(Sample)> done) {
    auto* call = new LocalCall(std::move(done));
    GenerationRequest r;
    r.prompt = prompt;
    r.max_new_tokens = output_len;
    r.ignore_eos = true;  // greedy (SamplingParams' default temperature 0), as RemoteCall
    TokenSink sink;
    sink.on_token = [call](int32_t, const float*) { call->OnToken(); };
    sink.on_done = [call](const absl::Status& s, FinishReason) { call->Done(s); };
    const absl::Status submitted = server->Submit(id, std::move(r), std::move(sink));
    if (!submitted.ok()) call->Done(submitted);
  }

 private:
  explicit LocalCall(std::function<void(Sample)> done) : done_(std::move(done)) {}

  void OnToken() { recorder_.Tokens(1); }

  void Done(const absl::Status& status) {
    // absl and gRPC number their codes alike.
    Sample sample = recorder_.Finish(static_cast<grpc::StatusCode>(status.code()));
    std::function<void(Sample)> done = std::move(done_);
    delete this;
    done(std::move(sample));
  }

  std::function<void(Sample)> done_;
  SampleRecorder recorder_;
};

// Starts request i of an open-loop run (its prompt and output length); calls `done` once
// with its figures.
using Launch = std::function<void(int i, const std::vector<int32_t>& prompt, int64_t output_len,
                                  std::function<void(Sample)> done)>;

// Sends `arrivals` at their times (the first at once), at most `max_in_flight` at a time
// (a request due while the cap is reached waits for one to end), and waits for every
// answer.
// Request i's prompt is BenchPrompt(first_prompt + i): a warm-up passes prompts of its own.
// progress may be null.
void OpenLoopRun(const Launch& launch, const std::vector<Arrival>& arrivals, int64_t vocab,
                 int max_in_flight, std::vector<Sample>* samples, Progress* progress,
                 int first_prompt = 0) {
  absl::Mutex mu;
  int in_flight = 0;
  struct Room {
    const int* in_flight;
    int cap;
    bool Free() const { return *in_flight < cap; }
  } room{&in_flight, max_in_flight};
  const Clock::time_point start = Clock::now();
  for (size_t i = 0; i < arrivals.size(); ++i) {
    const Clock::time_point due = start + std::chrono::duration_cast<Clock::duration>(
                                              std::chrono::duration<double>(arrivals[i].at_s));
    std::this_thread::sleep_until(due);  // the workload's own clock, not a wait for an event
    {
      absl::MutexLock lock(&mu);
      mu.Await(absl::Condition(&room, &Room::Free));
      ++in_flight;
    }
    // Unlocked: `done` may run at once, here (a request refused by the local server).
    const int prompt = first_prompt + static_cast<int>(i);
    launch(static_cast<int>(i), BenchPrompt(prompt, arrivals[i].prompt_len, vocab),
           arrivals[i].output_len, [&, i](Sample s) {
             (*samples)[i] = std::move(s);
             if (progress != nullptr) progress->Tick();
             absl::MutexLock done(&mu);
             --in_flight;
           });
  }
  absl::MutexLock lock(&mu);
  mu.Await(absl::Condition(
      +[](int* n) { return *n == 0; }, &in_flight));
}

// The model's vocabulary, from the router (the prompts' ids are drawn below it).
absl::StatusOr<int64_t> RouterVocab(v1::Frontend::Stub* stub) {
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
  v1::GetModelInfoResponse info;
  const grpc::Status s = stub->GetModelInfo(&ctx, v1::GetModelInfoRequest(), &info);
  if (!s.ok()) {
    return absl::Status(static_cast<absl::StatusCode>(s.error_code()),
                        absl::StrCat("GetModelInfo: ", s.error_message()));
  }
  return info.model_info().vocab_size();
}

// What a bench sends to: a cluster's router, or the single-process engine in this process
// behind its serving loop (LocalServer). Either way requests stream their tokens as they
// come, so both give TTFT and ITL the same way.
struct BenchTarget {
  std::string description;
  int64_t vocab = 0;
  Launch launch;
  std::unique_ptr<v1::Frontend::Stub> stub;
  std::unique_ptr<LocalEngine> engine;
  std::unique_ptr<LocalServer> server;  // after engine: it goes first
};

absl::StatusOr<std::unique_ptr<BenchTarget>> MakeBenchTarget(const Args& args,
                                                             const TlsConfig& tls) {
  auto target = std::make_unique<BenchTarget>();
  if (args.Has("router")) {
    target->description = "cluster at " + args.GetString("router");
    DXS_ASSIGN_OR_RETURN(std::shared_ptr<grpc::Channel> channel,
                         MakeChannel(args.GetString("router"), tls));
    target->stub = v1::Frontend::NewStub(channel);
    DXS_ASSIGN_OR_RETURN(target->vocab, RouterVocab(target->stub.get()));
    v1::Frontend::Stub* stub = target->stub.get();
    target->launch = [stub](int, const std::vector<int32_t>& prompt, int64_t output_len,
                            std::function<void(Sample)> done) {
      new RemoteCall(stub, prompt, output_len, std::move(done));
    };
    return target;
  }
  target->description = "the single-process engine (" + args.GetString("local") + ")";
  EngineOptions options;
  options.device = args.GetString("device", "cpu");
  DXS_ASSIGN_OR_RETURN(options.overlap_schedule, args.GetOnOff("overlap-schedule", true));
  DXS_ASSIGN_OR_RETURN(target->engine, LocalEngine::Load(args.GetString("local"), options));
  target->vocab = target->engine->config().vocab_size;
  target->server = std::make_unique<LocalServer>(target->engine.get());
  LocalServer* server = target->server.get();
  // Ids unique over every run of this target: a request of the last run may still be ending.
  auto next_id = std::make_shared<std::atomic<uint64_t>>(0);
  target->launch = [server, next_id](int, const std::vector<int32_t>& prompt, int64_t output_len,
                                     std::function<void(Sample)> done) {
    LocalCall::Start(server, next_id->fetch_add(1), prompt, output_len, std::move(done));
  };
  return target;
}

// The figures of one run.
struct Summary {
  int64_t tokens = 0;
  int ok = 0, good = 0;
  std::vector<double> ttft, tpot, itl, e2e;
  std::map<std::string, int> errors;
};

Summary Summarize(const std::vector<Sample>& samples, double slo_ttft_ms, double slo_tpot_ms) {
  Summary m;
  for (const Sample& s : samples) {
    m.tokens += s.tokens;
    m.e2e.push_back(s.e2e_ms);
    if (s.code != grpc::StatusCode::OK) {
      m.errors[absl::StrCat("code ", static_cast<int>(s.code))]++;
      continue;
    }
    ++m.ok;
    if (s.ttft_ms > 0) m.ttft.push_back(s.ttft_ms);
    if (s.tokens > 1) m.tpot.push_back(s.TpotMs());
    m.itl.insert(m.itl.end(), s.itl_ms.begin(), s.itl_ms.end());
    if (s.ttft_ms <= slo_ttft_ms && s.TpotMs() <= slo_tpot_ms) ++m.good;
  }
  return m;
}

nlohmann::json P50P99(const std::vector<double>& v) {
  return {{"p50", Percentile(v, 50)}, {"p99", Percentile(v, 99)}};
}

// `n` requests of `shape`, at most `lanes` in flight, untimed: what a benchmark sends before
// it measures (vLLM's and SGLang's do too), so that graphs are captured and pools grown by
// then. Their prompts are BenchPrompt(first_prompt + i), none of the measured run's. Returns
// how many failed.
int WarmUp(const BenchTarget& target, int64_t n, const Arrival& shape, int lanes,
           int first_prompt) {
  std::vector<Sample> samples(static_cast<size_t>(n));
  OpenLoopRun(target.launch, std::vector<Arrival>(samples.size(), shape), target.vocab, lanes,
              &samples, nullptr, first_prompt);
  int failed = 0;
  for (const Sample& s : samples) failed += s.code != grpc::StatusCode::OK;
  return failed;
}

// --request-rate: one open-loop run per rate against --router, or the single-process engine
// serving the same arrivals (--local MODEL: LocalServer); a line per rate (text), or one
// JSON object per rate and line (--format json).
int OpenLoopBench(const Args& args, const TlsConfig& tls, int num_requests, int64_t prompt_len,
                  int64_t output_len) {
  auto fail = [](const absl::Status& s) {
    std::cerr << "dxs bench: " << s.message() << "\n";
    return 2;
  };
  std::vector<double> rates;
  for (absl::string_view r : absl::StrSplit(args.GetString("request-rate"), ',')) {
    double v = 0;
    if (r == "inf") {
      v = std::numeric_limits<double>::infinity();
    } else if (!absl::SimpleAtod(r, &v) || !(v > 0) || std::isinf(v)) {
      return fail(absl::InvalidArgumentError(
          absl::StrCat("--request-rate: \"", r, "\" is not a rate > 0 (requests/s) or inf")));
    }
    rates.push_back(v);
  }
  absl::StatusOr<double> sigma = args.GetDouble("len-sigma", 0);
  absl::StatusOr<int64_t> seed = args.GetInt("seed", 0);
  absl::StatusOr<double> slo_ttft = args.GetDouble("slo-ttft-ms", 1000);
  absl::StatusOr<double> slo_tpot = args.GetDouble("slo-tpot-ms", 50);
  absl::StatusOr<int64_t> cap = args.GetInt("concurrency", std::numeric_limits<int>::max());
  absl::StatusOr<int64_t> warmup = args.GetInt("warmup-requests", 1);
  for (const absl::Status& st : {sigma.status(), seed.status(), slo_ttft.status(),
                                 slo_tpot.status(), cap.status(), warmup.status()}) {
    if (!st.ok()) return fail(st);
  }
  if (!(*sigma >= 0 && *sigma <= 3) || !(*slo_ttft > 0) || !(*slo_tpot > 0) || *cap < 1 ||
      *seed < 0 || *warmup < 0) {
    return fail(absl::InvalidArgumentError(
        "--len-sigma must be in [0, 3], --slo-ttft-ms and --slo-tpot-ms > 0, --concurrency "
        ">= 1, --seed >= 0 and --warmup-requests >= 0"));
  }
  absl::StatusOr<std::unique_ptr<BenchTarget>> target = MakeBenchTarget(args, tls);
  if (!target.ok()) return fail(target.status());
  const Launch& launch = (*target)->launch;
  const int64_t vocab = (*target)->vocab;
  const int max_in_flight = static_cast<int>(std::min<int64_t>(*cap, 1 << 30));
  // Before the first rate, of the median lengths (the rates' prompts come after them).
  const int warmup_errors =
      WarmUp(**target, *warmup, Arrival{prompt_len, output_len, 0}, max_in_flight, num_requests);
  const bool json = args.GetString("format", "text") == "json";
  if (!json) {
    std::cout << "dxs bench: open loop against " << (*target)->description << ", " << num_requests
              << " requests a rate (after " << *warmup << " warm-up, " << warmup_errors
              << " failed), prompt ~" << prompt_len << ", output ~" << output_len << " (len-sigma "
              << *sigma << "), SLO TTFT <= " << *slo_ttft << " ms, TPOT <= " << *slo_tpot << " ms\n"
              << "  rate req/s | tok/s | req/s | TTFT p50/p99 ms | TPOT p50/p99 ms | ITL "
                 "p50/p99 ms | goodput req/s | errors\n";
  }
  bool any_error = false;
  for (double rate : rates) {
    const std::vector<Arrival> arrivals = OpenLoopWorkload(
        num_requests, rate, prompt_len, output_len, *sigma, static_cast<uint64_t>(*seed));
    std::vector<Sample> samples(num_requests);
    Progress progress(num_requests, isatty(STDERR_FILENO) == 1);
    const Clock::time_point start = Clock::now();
    OpenLoopRun(launch, arrivals, vocab, max_in_flight, &samples, &progress);
    const double wall_s = Ms(Clock::now() - start) / 1000.0;
    const Summary m = Summarize(samples, *slo_ttft, *slo_tpot);
    any_error = any_error || !m.errors.empty();
    int64_t prompt_tokens = 0;
    for (const Arrival& a : arrivals) prompt_tokens += a.prompt_len;
    if (json) {
      nlohmann::json out;
      if (args.Has("router")) {
        out["router"] = args.GetString("router");
      } else {
        out["local"] = args.GetString("local");
      }
      out["request_rate"] = std::isinf(rate) ? nlohmann::json("inf") : nlohmann::json(rate);
      out["requests"] = num_requests;
      out["warmup_requests"] = *warmup;
      out["warmup_errors"] = warmup_errors;
      out["prompt_tokens"] = prompt_tokens;
      out["output_tokens"] = m.tokens;
      out["wall_seconds"] = wall_s;
      out["output_tokens_per_second"] = m.tokens / wall_s;
      out["requests_per_second"] = m.ok / wall_s;
      out["ttft_ms"] = P50P99(m.ttft);
      out["tpot_ms"] = P50P99(m.tpot);
      out["itl_ms"] = P50P99(m.itl);
      out["goodput_requests_per_second"] = m.good / wall_s;
      out["slo"] = {{"ttft_ms", *slo_ttft}, {"tpot_ms", *slo_tpot}};
      out["errors"] = m.errors;
      std::cout << out.dump() << "\n" << std::flush;
      continue;
    }
    std::cout << std::fixed << std::setprecision(2) << "  " << std::setw(10)
              << (std::isinf(rate) ? std::string("inf") : absl::StrCat(rate)) << " | "
              << std::setprecision(1) << m.tokens / wall_s << " | " << std::setprecision(2)
              << m.ok / wall_s << " | " << Percentile(m.ttft, 50) << " / " << Percentile(m.ttft, 99)
              << " | " << Percentile(m.tpot, 50) << " / " << Percentile(m.tpot, 99) << " | "
              << Percentile(m.itl, 50) << " / " << Percentile(m.itl, 99) << " | " << m.good / wall_s
              << " | ";
    if (m.errors.empty()) std::cout << "none";
    for (const auto& [code, n] : m.errors) std::cout << code << " x" << n << "  ";
    std::cout << "\n" << std::flush;
  }
  return any_error ? 1 : 0;
}

}  // namespace

int BenchCommand(const std::vector<std::string>& argv) {
  absl::StatusOr<Args> args = Args::Parse(
      argv,
      WithTlsValueFlags({"router", "local", "concurrency", "requests", "prompt-len", "output-len",
                         "format", "device", "request-rate", "len-sigma", "overlap-schedule",
                         "seed", "slo-ttft-ms", "slo-tpot-ms", "warmup-requests"}),
      WithTlsBoolFlags({}));
  auto fail = [](const absl::Status& s) {
    std::cerr << "dxs bench: " << s.message() << "\n";
    return 2;
  };
  if (!args.ok()) return fail(args.status());
  absl::StatusOr<TlsConfig> tls = TlsFromArgs(*args, /*for_server=*/false);
  if (!tls.ok()) return fail(tls.status());
  if (args->Has("router") == args->Has("local")) {
    return fail(absl::InvalidArgumentError("give exactly one of --router ADDR or --local MODEL"));
  }
  auto concurrency = args->GetInt("concurrency", 8);
  auto requests = args->GetInt("requests", 64);
  auto prompt_len = args->GetInt("prompt-len", 32);
  auto output_len = args->GetInt("output-len", 32);
  for (const absl::Status& s :
       {concurrency.status(), requests.status(), prompt_len.status(), output_len.status()}) {
    if (!s.ok()) return fail(s);
  }
  if (*concurrency < 1 || *requests < 1 || *prompt_len < 1 || *output_len < 1) {
    return fail(absl::InvalidArgumentError(
        "--concurrency, --requests, --prompt-len and --output-len must be >= 1"));
  }
  const int num_requests = static_cast<int>(*requests);
  if (args->Has("request-rate")) {
    return OpenLoopBench(*args, *tls, num_requests, *prompt_len, *output_len);
  }
  const int lanes = static_cast<int>(std::min<int64_t>(*concurrency, num_requests));
  absl::StatusOr<int64_t> warmup = args->GetInt("warmup-requests", lanes);
  if (!warmup.ok()) return fail(warmup.status());
  if (*warmup < 0) return fail(absl::InvalidArgumentError("--warmup-requests must be >= 0"));
  absl::StatusOr<std::unique_ptr<BenchTarget>> target = MakeBenchTarget(*args, *tls);
  if (!target.ok()) return fail(target.status());
  const std::string mode = (*target)->description;
  // Lanes: every request arrives at once, at most `lanes` in flight, so each lane sends its
  // next request when its last one ends.
  const Arrival fixed{*prompt_len, *output_len, 0};
  const int warmup_errors = WarmUp(**target, *warmup, fixed, lanes, num_requests);
  std::vector<Sample> samples(num_requests);
  Progress progress(num_requests, isatty(STDERR_FILENO) == 1);
  const Clock::time_point start = Clock::now();
  OpenLoopRun((*target)->launch, std::vector<Arrival>(num_requests, fixed), (*target)->vocab, lanes,
              &samples, &progress);
  const double wall_s = Ms(Clock::now() - start) / 1000.0;

  const double no_slo = std::numeric_limits<double>::infinity();
  const Summary m = Summarize(samples, no_slo, no_slo);
  const int64_t tokens = m.tokens;
  const std::vector<double>&ttft = m.ttft, &itl = m.itl, &e2e = m.e2e;
  const std::map<std::string, int>& errors = m.errors;
  const double tokens_per_s = tokens / wall_s;
  if (args->GetString("format", "text") == "json") {
    nlohmann::json out;
    out["mode"] = mode;
    out["concurrency"] = *concurrency;
    out["requests"] = num_requests;
    out["warmup_requests"] = *warmup;
    out["warmup_errors"] = warmup_errors;
    out["output_tokens"] = tokens;
    out["wall_seconds"] = wall_s;
    out["output_tokens_per_second"] = tokens_per_s;
    out["ttft_ms"] = {{"p50", Percentile(ttft, 50)},
                      {"p90", Percentile(ttft, 90)},
                      {"p99", Percentile(ttft, 99)}};
    // max: the longest gap any stream saw between two tokens (a stall, e.g. across a live
    // rebalance: bench/eplb_bench.sh).
    out["itl_ms"] = {{"p50", Percentile(itl, 50)},
                     {"p90", Percentile(itl, 90)},
                     {"p99", Percentile(itl, 99)},
                     {"max", Percentile(itl, 100)}};
    out["e2e_ms"] = {{"p50", Percentile(e2e, 50)}, {"p99", Percentile(e2e, 99)}};
    out["errors"] = errors;
    std::cout << out.dump() << "\n";
    return errors.empty() ? 0 : 1;
  }
  std::cout << std::fixed << std::setprecision(1) << "dxs bench: " << mode << ", concurrency "
            << *concurrency << ", " << num_requests << " requests (after " << *warmup
            << " warm-up, " << warmup_errors << " failed), prompt " << *prompt_len << ", output "
            << *output_len << "\n"
            << "  throughput: " << tokens_per_s << " output tokens/s (" << tokens << " tokens in "
            << std::setprecision(2) << wall_s << " s)\n"
            << std::setprecision(2) << "  TTFT ms:  p50 " << Percentile(ttft, 50) << "  p90 "
            << Percentile(ttft, 90) << "  p99 " << Percentile(ttft, 99) << "\n"
            << "  ITL ms:   p50 " << Percentile(itl, 50) << "  p90 " << Percentile(itl, 90)
            << "  p99 " << Percentile(itl, 99) << "\n"
            << "  E2E ms:   p50 " << Percentile(e2e, 50) << "  p99 " << Percentile(e2e, 99)
            << "\n  errors: " << (errors.empty() ? "none" : "");
  for (const auto& [code, n] : errors) std::cout << code << " x" << n << "  ";
  std::cout << "\n";
  return errors.empty() ? 0 : 1;
}

}  // namespace dxs::cli
