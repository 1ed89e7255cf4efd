#include "bench/exchange_bench_util.h"

#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <csignal>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <limits>
#include <numeric>
#include <string>

#include "bench/raw_ucx_pingpong.h"
#include "model/sampler.h"

namespace dxs::bench {

ForkedRank ForkRank(int watchdog_seconds, const std::function<int(int, int)>& body) {
  int to_rank[2], from_rank[2];
  if (pipe(to_rank) != 0 || pipe(from_rank) != 0) Die("pipe");
  const pid_t pid = fork();
  if (pid < 0) Die("fork");
  if (pid == 0) {
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    alarm(watchdog_seconds);
    std::exit(body(to_rank[0], from_rank[1]));
  }
  close(to_rank[0]);
  close(from_rank[1]);
  return {pid, to_rank[1], from_rank[0]};
}

bool RankSucceeded(pid_t pid, bool kill) {
  if (kill) ::kill(pid, SIGKILL);
  int status = 0;
  waitpid(pid, &status, 0);
  return WIFEXITED(status) && WEXITSTATUS(status) == 0;
}
WeightedSumExperts::WeightedSumExperts(Backend* backend, int64_t hidden, int64_t max_rows,
                                       int first_expert, int num_held)
    : backend_(backend), hidden_(hidden), first_expert_(first_expert), num_held_(num_held) {
  sum_ = Must(backend->Allocate({max_rows, hidden}, DType::kF32), "allocate sums");
}

absl::Status WeightedSumExperts::Forward(int layer, const Tensor& x, const RoutedPairTensors& pairs,
                                         Tensor* out) {
  const int64_t rows = out->rows(), n = pairs.size();
  if (rows > sum_.rows()) {
    return absl::InvalidArgumentError("stand-in experts: more rows than the bench sized for");
  }
  if (rows == 0) return absl::OkStatus();
  Tensor sum = sum_.Rows(0, rows);
  absl::Status s = backend_->Fill(&sum, 0.f);
  if (s.ok() && n > 0) {
    // ScaleAddRows reads f32 or the backend's activation dtype: gather into the latter.
    if (!gathered_.defined() || gathered_.rows() < n) {
      absl::StatusOr<Tensor> g = backend_->Allocate({n, hidden_}, backend_->ActivationDType());
      if (!g.ok()) return g.status();
      gathered_ = *g;
    }
    Tensor g = gathered_.Rows(0, n);
    s = backend_->GatherRows(x, pairs.rows, &g);
    if (s.ok()) s = backend_->ScaleAddRows(g, pairs.weights, pairs.rows, &sum);
  }
  if (s.ok()) s = backend_->Copy(sum, out);
  if (s.ok()) s = backend_->Synchronize();
  return s;
}

ExchangeInputs MakeExchangeInputs(Backend* backend, int64_t hidden, int64_t max_tokens,
                                  int num_experts, int top_k, DType wire, uint64_t seed) {
  if (DTypeSize(wire) != sizeof(uint16_t)) Die("MakeExchangeInputs: the wire must be 16-bit");
  SplitMix64 rng(seed);
  ExchangeInputs in;
  in.hidden = hidden;
  in.top_k = top_k;
  in.wire = wire;
  std::vector<float> x(static_cast<size_t>(max_tokens * hidden));
  for (float& v : x) {
    const float sign = (rng.Next() & 1) != 0 ? 1.f : -1.f;
    v = sign * static_cast<float>(0.05 + 0.95 * rng.NextDouble());
  }
  in.x_wire.resize(x.size());
  NarrowFromFloat32(wire, x.data(), x.size(), in.x_wire.data());
  std::vector<int32_t> experts(static_cast<size_t>(num_experts));
  for (int64_t t = 0; t < max_tokens; ++t) {
    std::iota(experts.begin(), experts.end(), 0);
    for (int k = 0; k < top_k; ++k) {
      const int pick = k + static_cast<int>(rng.Next() % static_cast<uint64_t>(num_experts - k));
      std::swap(experts[k], experts[pick]);
      in.ids.push_back(experts[k]);
      in.weights.push_back(static_cast<float>(0.05 + 0.95 * rng.NextDouble()));
    }
  }
  in.x = Must(backend->Allocate({max_tokens, hidden}, wire), "allocate x");
  Check(backend->CopyFromHost(in.x_wire.data(), wire, &in.x), "upload x");
  in.ids_dev = Must(backend->UploadIndices(in.ids), "upload ids").Reshape({max_tokens, top_k});
  in.weights_dev = Must(backend->Upload(in.weights, {max_tokens, top_k}), "upload weights");
  in.out = Must(backend->Allocate({max_tokens, hidden}, wire), "allocate out");
  Check(backend->Synchronize(), "upload inputs");
  return in;
}

double MaxRelativeError(Backend* backend, const ExchangeInputs& in, int64_t tokens) {
  const int64_t hidden = in.hidden;
  std::vector<float> got(static_cast<size_t>(tokens * hidden));
  Check(backend->CopyToHost(in.out.Rows(0, tokens), DType::kF32, got.data()), "download out");
  std::vector<float> x(static_cast<size_t>(tokens * hidden));
  WidenToFloat32(in.wire, in.x_wire.data(), x.size(), x.data());
  double worst = 0;
  for (int64_t t = 0; t < tokens; ++t) {
    float scale = 0;
    for (int k = 0; k < in.top_k; ++k) scale += in.weights[t * in.top_k + k];
    for (int64_t j = 0; j < hidden; ++j) {
      const double expect = scale * x[t * hidden + j];
      const double error = std::abs(got[t * hidden + j] - expect) / std::abs(expect);
      if (std::isnan(error)) return std::numeric_limits<double>::infinity();
      worst = std::max(worst, error);
    }
  }
  return worst;
}

Stats StatsOf(std::vector<double> values) {
  std::sort(values.begin(), values.end());
  const size_t n = values.size();
  const size_t p99 = static_cast<size_t>(std::ceil(0.99 * static_cast<double>(n))) - 1;
  return {values[n / 2], values[std::min(p99, n - 1)]};
}

namespace {
// The value of the first line of `path` that starts with `key`, after its colon.
std::string FieldOf(const std::string& path, const std::string& key) {
  std::ifstream file(path);
  std::string line;
  while (std::getline(file, line)) {
    if (line.rfind(key, 0) != 0) continue;
    const size_t colon = line.find(':');
    const size_t start =
        colon == std::string::npos ? colon : line.find_first_not_of(" \t", colon + 1);
    if (start != std::string::npos) return line.substr(start);
  }
  return "";
}
}  // namespace

std::string CpuModel() {
  const std::string model = FieldOf("/proc/cpuinfo", "model name");
  return model.empty() ? "unknown CPU" : model;
}

std::string GpuModel() {
  std::error_code ec;
  for (const auto& entry : std::filesystem::directory_iterator("/proc/driver/nvidia/gpus", ec)) {
    const std::string model = FieldOf((entry.path() / "information").string(), "Model");
    if (!model.empty()) return model;
  }
  return "unknown GPU";
}

}  // namespace dxs::bench
