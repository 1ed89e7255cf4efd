// dxs bench: load generator for a running cluster (or, with --local, the single-process
// engine on the same prompts, as the baseline). Prints throughput, time-to-first-token,
// inter-token and end-to-end latency percentiles, and errors by gRPC code.
#include <grpcpp/grpcpp.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <functional>
#include <iomanip>
#include <iostream>
#include <map>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "dxs/v1/frontend.grpc.pb.h"
#include "model/engine.h"
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
};

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
    start_ = last_ = Clock::now();
    stub->async()->Generate(&context_, &request_, this);
    StartRead(&response_);
    StartCall();
  }

  void OnReadDone(bool ok) override {
    if (!ok) return;  // OnDone follows
    if (response_.has_chunk() && response_.chunk().token_ids_size() > 0) {
      const auto now = Clock::now();
      const int n = response_.chunk().token_ids_size();
      if (sample_.tokens == 0) {
        sample_.ttft_ms = Ms(now - start_);
      } else {
        // A chunk of n tokens since the last one: n gaps of equal share.
        for (int k = 0; k < n; ++k) sample_.itl_ms.push_back(Ms(now - last_) / n);
      }
      sample_.tokens += n;
      last_ = now;
    }
    StartRead(&response_);
  }

  void OnDone(const grpc::Status& status) override {
    sample_.code = status.error_code();
    sample_.e2e_ms = Ms(Clock::now() - start_);
    std::function<void(Sample)> done = std::move(done_);
    Sample sample = std::move(sample_);
    delete this;
    done(std::move(sample));
  }

 private:
  grpc::ClientContext context_;
  v1::GenerateRequest request_;
  v1::GenerateResponse response_;
  Sample sample_;
  Clock::time_point start_, last_;
  std::function<void(Sample)> done_;
};

// Runs `num_requests` requests, `concurrency` at a time: each of `concurrency` lanes starts
// its next request when the last one ends.
class RemoteRun {
 public:
  RemoteRun(v1::Frontend::Stub* stub, int num_requests, int64_t prompt_len, int64_t output_len,
            int64_t vocab, std::vector<Sample>* samples, Progress* progress)
      : stub_(stub),
        num_requests_(num_requests),
        prompt_len_(prompt_len),
        output_len_(output_len),
        vocab_(vocab),
        samples_(samples),
        progress_(progress) {}

  void Run(int concurrency) {
    {
      absl::MutexLock lock(&mu_);
      active_lanes_ = concurrency;
    }
    for (int lane = 0; lane < concurrency; ++lane) Next();
    absl::MutexLock lock(&mu_);
    mu_.Await(absl::Condition(
        +[](int* lanes) { return *lanes == 0; }, &active_lanes_));
  }

 private:
  void Next() {
    const int i = next_++;
    if (i >= num_requests_) {
      absl::MutexLock lock(&mu_);
      --active_lanes_;
      return;
    }
    new RemoteCall(stub_, BenchPrompt(i, prompt_len_, vocab_), output_len_, [this, i](Sample s) {
      (*samples_)[i] = std::move(s);
      progress_->Tick();
      Next();
    });
  }

  v1::Frontend::Stub* const stub_;
  const int num_requests_;
  const int64_t prompt_len_, output_len_, vocab_;
  std::vector<Sample>* const samples_;
  Progress* const progress_;
  std::atomic<int> next_{0};
  absl::Mutex mu_;
  int active_lanes_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace

int BenchCommand(const std::vector<std::string>& argv) {
  absl::StatusOr<Args> args =
      Args::Parse(argv,
                  WithTlsValueFlags({"router", "local", "concurrency", "requests", "prompt-len",
                                     "output-len", "format", "device"}),
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
  std::vector<Sample> samples(num_requests);
  Progress progress(num_requests, isatty(STDERR_FILENO) == 1);
  Clock::time_point start;
  std::string mode;

  if (args->Has("local")) {
    // Baseline: the single-process engine, `concurrency` requests batched together.
    mode = "single-process engine";
    EngineOptions options;
    options.device = args->GetString("device", "cpu");
    absl::StatusOr<std::unique_ptr<LocalEngine>> engine =
        LocalEngine::Load(args->GetString("local"), options);
    if (!engine.ok()) return fail(engine.status());
    const int64_t vocab = (*engine)->config().vocab_size;
    start = Clock::now();
    for (int first = 0; first < num_requests; first += static_cast<int>(*concurrency)) {
      std::vector<GenerationRequest> batch;
      for (int i = first; i < std::min(num_requests, first + static_cast<int>(*concurrency)); ++i) {
        GenerationRequest r;
        r.prompt = BenchPrompt(i, *prompt_len, vocab);
        r.max_new_tokens = *output_len;
        r.ignore_eos = true;
        batch.push_back(r);
      }
      const auto t0 = Clock::now();
      absl::StatusOr<std::vector<GenerationResult>> out = (*engine)->GenerateBatch(batch);
      if (!out.ok()) return fail(out.status());
      const double e2e = Ms(Clock::now() - t0);
      for (size_t j = 0; j < out->size(); ++j) {
        samples[first + j].tokens = static_cast<int64_t>((*out)[j].tokens.size());
        samples[first + j].e2e_ms = e2e;
        progress.Tick();
      }
    }
  } else {
    mode = "cluster at " + args->GetString("router");
    absl::StatusOr<std::shared_ptr<grpc::Channel>> channel =
        MakeChannel(args->GetString("router"), *tls);
    if (!channel.ok()) return fail(channel.status());
    auto stub = v1::Frontend::NewStub(*channel);
    int64_t vocab = 1000;
    {
      grpc::ClientContext ctx;
      ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
      v1::GetModelInfoResponse info;
      grpc::Status s = stub->GetModelInfo(&ctx, v1::GetModelInfoRequest(), &info);
      if (!s.ok()) {
        std::cerr << "dxs bench: GetModelInfo: " << s.error_message() << "\n";
        return 1;
      }
      vocab = info.model_info().vocab_size();
    }
    start = Clock::now();
    RemoteRun(stub.get(), num_requests, *prompt_len, *output_len, vocab, &samples, &progress)
        .Run(static_cast<int>(std::min<int64_t>(*concurrency, num_requests)));
  }
  const double wall_s = Ms(Clock::now() - start) / 1000.0;

  int64_t tokens = 0;
  std::vector<double> ttft, itl, e2e;
  std::map<std::string, int> errors;
  for (const Sample& s : samples) {
    tokens += s.tokens;
    e2e.push_back(s.e2e_ms);
    if (s.code != grpc::StatusCode::OK) {
      errors[absl::StrCat("code ", static_cast<int>(s.code))]++;
      continue;
    }
    if (s.ttft_ms > 0) ttft.push_back(s.ttft_ms);
    itl.insert(itl.end(), s.itl_ms.begin(), s.itl_ms.end());
  }
  const double tokens_per_s = tokens / wall_s;
  if (args->GetString("format", "text") == "json") {
    nlohmann::json out;
    out["mode"] = mode;
    out["concurrency"] = *concurrency;
    out["requests"] = num_requests;
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
            << *concurrency << ", " << num_requests << " requests, prompt " << *prompt_len
            << ", output " << *output_len << "\n"
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
