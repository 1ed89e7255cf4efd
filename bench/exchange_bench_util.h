// What the dispatch + combine benches on the Backend share (gpu_exchange_bench, 1 DP x 1
// EP rank; exchange_ranks_bench, D DP x E EP ranks): the EP ranks' stand-in experts, each
// DP rank's seeded inputs, the check of the combined output, and median / p99.
//
// The stand-in: out[r] = the sum over row r's pairs (those of the experts this EP rank
// holds) of weight * x[r], in float32 on the backend, rounded once to out's dtype. Summed
// over the EP ranks by the combine, every token's output is (sum of its top-k weights) *
// x[t], which MaxRelativeError checks. Forward synchronises the backend before it returns
// (the server waits for that work right after it anyway), so ExpertCounters::compute_ns
// covers the stand-in's kernels and the benches can report the exchange without it.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "bench/raw_ucx_pingpong.h"
#include "common/dtype.h"
#include "expert_service/expert_compute.h"
#include "kernels/backend.h"

namespace dxs::bench {

// Dies naming `what` (bench/raw_ucx_pingpong.h's Die) unless `status` is OK; Must also
// unwraps the value.
inline void Check(const absl::Status& status, const std::string& what) {
  if (!status.ok()) Die(what + ": " + status.ToString());
}

template <typename T>
T Must(absl::StatusOr<T> value, const std::string& what) {
  Check(value.status(), what);
  return std::move(*value);
}

// A rank process of a bench and the parent's ends of the two pipes to it.
struct ForkedRank {
  pid_t pid = -1;
  int to_rank = -1;    // the parent writes commands here
  int from_rank = -1;  // and reads the rank's answers here
};
// Forks a rank that runs body(read_fd, write_fd) and exits with its result; it dies with
// its parent and aborts after `watchdog_seconds`. Call it before anything in the process
// touches CUDA or UCX: neither survives a fork.
ForkedRank ForkRank(int watchdog_seconds, const std::function<int(int, int)>& body);
// Waits for the rank to end (killed first when `kill` is set): true if it exited with 0.
bool RankSucceeded(pid_t pid, bool kill);

class WeightedSumExperts final : public ExpertCompute {
 public:
  // Holds experts [first_expert, first_expert + num_held) of every layer; sums for up to
  // `max_rows` rows are allocated here, the pairs' gathered rows as rounds grow. Dies if
  // the allocation fails.
  WeightedSumExperts(Backend* backend, int64_t hidden, int64_t max_rows, int first_expert,
                     int num_held);

  bool Holds(int layer, int expert) const override {
    return expert >= first_expert_ && expert < first_expert_ + num_held_;
  }
  Backend* backend() const override { return backend_; }
  absl::Status Forward(int layer, const Tensor& x, const RoutedPairTensors& pairs,
                       Tensor* out) override;

 private:
  Backend* backend_;
  int64_t hidden_;
  int first_expert_, num_held_;
  Tensor sum_;       // f32 [max_rows, hidden]
  Tensor gathered_;  // [pairs, hidden] in the activation dtype: each pair's row of x
};

// One DP rank's inputs for its largest token count (a row of n tokens uses the first n):
// random non-zero activations in `wire`, random top-k routing (distinct experts) with
// random positive weights; on the backend, and on the host for the check. `out` is
// allocated, not filled.
struct ExchangeInputs {
  int64_t hidden = 0;
  int top_k = 0;
  DType wire = DType::kBF16;
  std::vector<uint16_t> x_wire;  // [max_tokens, hidden] in `wire`
  std::vector<int32_t> ids;      // [max_tokens, top_k]
  std::vector<float> weights;    // [max_tokens, top_k]
  Tensor x, ids_dev, weights_dev, out;
};
// `wire` is a 16-bit dtype. Dies on a backend error.
ExchangeInputs MakeExchangeInputs(Backend* backend, int64_t hidden, int64_t max_tokens,
                                  int num_experts, int top_k, DType wire, uint64_t seed);

// Largest error of the first `tokens` rows of in.out against (sum of weights) * x,
// relative to the expected magnitude (x is never near zero); infinity if a row holds NaN
// (never written). Dies on a backend error.
double MaxRelativeError(Backend* backend, const ExchangeInputs& in, int64_t tokens);

struct Stats {
  double median = 0;
  double p99 = 0;
};
Stats StatsOf(std::vector<double> values);  // of a non-empty list

// The host's CPU model (/proc/cpuinfo) and its first GPU's (the driver's
// /proc/driver/nvidia/gpus/*/information), for the benches' hardware lines; "unknown ..."
// when they do not say.
std::string CpuModel();
std::string GpuModel();

}  // namespace dxs::bench
