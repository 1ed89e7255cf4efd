// A step's sampling on the backend, as device work with no host synchronisation: the ops
// (ArgmaxRows or SampleRows, then LogprobRows where a request asked) over a step's logits,
// from parameters already on the device. The scheduler plans a step's sampling
// (Scheduler::PlanStepSampling); SampleStepOnBackend uploads the plan and runs these after a
// forward pass, and Qwen3MoeModel::ForwardDecode runs them inside a decode step's CUDA graph,
// the plan staged in pinned memory, so that the penalties, filters and log-probabilities of
// a graphed decode step add no host round trip.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kernels/backend.h"
#include "kernels/sampling.h"
#include "kernels/sampling_row.h"
#include "kernels/tensor.h"

namespace dxs {

// What the step's rows ask of LogprobRows: whether any wants logprobs, and the most
// alternatives and named ids one asks for.
struct StepLogprobShape {
  bool any = false;
  int64_t top = 0;
  int64_t named = 0;
};

// The step's tokens as the backend sampled them: tokens[r] is row r's token; logprobs[r]
// its log-probabilities, one per row when some request of the step asked, else empty.
// A request of n > 1 whose prompt finished in the step draws its other samples' first
// tokens on the backend too: rows[fork_first[j] + i - 1] is sample i's (chunk j's logits
// row again, the sample's derived seed), after the chunks' rows; fork_first[j] is -1 for
// a chunk without samples to fork (fork_first is empty when no chunk has any).
struct StepTokens {
  std::vector<int32_t> tokens;
  std::vector<TokenLogprobs> logprobs;
  std::vector<int64_t> fork_first;
  // Row of chunk j's sample `sample` (0: the chunk's own).
  size_t Row(size_t j, int32_t sample) const {
    return sample == 0 ? j : static_cast<size_t>(fork_first.at(j) + sample - 1);
  }
};

// A step's sampling, planned on the host (Scheduler::PlanStepSampling).
struct StepSamplingPlan {
  // One row per chunk, then one per forked sample (fork_rows[i]: the chunk whose logits row
  // extra row i samples).
  std::vector<SamplingRow> rows;
  std::vector<LogitAdjustment> adjustments;  // the rows index into it
  std::vector<int32_t> fork_rows;
  bool argmax = false;  // every row greedy without adjustments: ArgmaxRows, no parameters
  StepLogprobShape logprobs;
  std::vector<int32_t> named_ids;  // [rows, logprobs.named], -1 where a row names fewer
  // A step built ahead of its step before's tokens (overlap scheduling) whose penalised rows
  // end in a kAdjustPending entry: the step's input ids are counted into them on the backend
  // (Backend::CountPendingTokens) before the sampling.
  bool pending_tokens = false;
};

// Device tensors a step's sampling writes, one row per sampled row: ids (i32 [n]), and
// where logprobs are asked sampled (f32 [n]), named (f32 [n, named]), top ids (i32 [n, top])
// and top log-probabilities (f32 [n, top]).
struct StepSamplingOutputs {
  Tensor ids, sampled_logprobs, named_logprobs, top_ids, top_logprobs;
  // The first n rows of each (a padded step's real rows).
  StepSamplingOutputs Rows(int64_t n) const;
};

absl::StatusOr<StepSamplingOutputs> AllocateStepSamplingOutputs(Backend* backend, int64_t rows,
                                                                const StepLogprobShape& shape);

// Enqueues the sampling of logits [n, vocab] into `out` (from AllocateStepSamplingOutputs
// with n rows and `shape`): ArgmaxRows when `argmax`, else SampleRows with params (i64 [n,
// kSamplingRowWords]) and adjustments (null: none); then, where shape.any, LogprobRows
// with named (i32 [n, shape.named]). Nothing waits for the device: a graph may record it.
absl::Status EnqueueStepSampling(Backend* backend, const Tensor& logits, bool argmax,
                                 const Tensor* params, const Tensor* adjustments,
                                 const Tensor* named, const StepLogprobShape& shape,
                                 StepSamplingOutputs* out);

// The step's tokens (and log-probabilities where shape.any) from `out`'s rows.
absl::StatusOr<StepTokens> DownloadStepTokens(Backend* backend, const StepSamplingOutputs& out,
                                              const StepLogprobShape& shape);

// A step's tokens on their way to the host (overlap scheduling: step N's are read while step
// N + 1 runs): the outputs' copies into pinned staging, and the event after them.
struct PendingStepTokens {
  std::shared_ptr<Buffer> staging;  // reused from step to step; grown as needed
  std::unique_ptr<Event> copied;
  int64_t rows = 0;
  StepLogprobShape shape;
};
// Enqueues the copies of `out`'s rows (every row of out.ids) into pending->staging, and
// the event after them; nothing waits.
absl::Status EnqueueStepTokensDownload(Backend* backend, const StepSamplingOutputs& out,
                                       const StepLogprobShape& shape, PendingStepTokens* pending);
// Waits for the copies EnqueueStepTokensDownload queued (only for them: work queued since
// goes on) and returns the step's tokens, as DownloadStepTokens.
absl::StatusOr<StepTokens> ReadStepTokens(Backend* backend, PendingStepTokens* pending);

// The overlap scheme's downloads, shared by the single-process engine and the attention
// worker: a step sampled on the device whose tokens are on their way to the host, and the
// step built ahead of them whose tokens follow, each in its own pinned staging (two
// alternate), so that step N's tokens are read while step N + 1 runs.
class StepTokenDownloads {
 public:
  // A step queued on the device whose tokens the host has not read.
  struct Step {
    StepSamplingOutputs outputs;          // its samples, on the device (the next step's ids)
    PendingStepTokens* tokens = nullptr;  // their copy to the host (one of the two)
  };
  explicit StepTokenDownloads(Backend* backend) : backend_(backend) {}
  // Enqueues the copy of `outputs` (of that shape) to the host; nothing waits.
  absl::StatusOr<Step> Launch(StepSamplingOutputs outputs, const StepLogprobShape& shape);
  // Waits for `step`'s copies (only for them) and returns its tokens.
  absl::StatusOr<StepTokens> Read(const Step& step);
  // Waits for the copies of *step, if any, and forgets it, its tokens unread (a failed
  // step's, or one whose requests are gone): the staging is free for the next Launch.
  void Drop(std::optional<Step>* step);

 private:
  Backend* backend_;
  PendingStepTokens downloads_[2];
  int next_ = 0;
};

}  // namespace dxs
