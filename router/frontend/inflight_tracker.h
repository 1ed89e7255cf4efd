// InflightTracker: the router's table of requests in flight, cluster-wide. It admits
// requests (bounded: at most max_inflight at once), picks each one's DP rank by least
// outstanding tokens, counts what every rank still owes, and lets other threads stop a
// request's upstream call (Abort, a lost rank, shutdown).
//
// Outstanding tokens of a request: prompt tokens + n * max_new_tokens (its n samples share
// the prompt) - tokens generated so far; of a rank: the sum over its requests. The
// least-loaded rank is the eligible one with the fewest outstanding tokens, then the
// fewest requests, then the lowest rank.
//
// Invariants: an id is in the table from a successful Admit until its Release; the table
// never holds more than max_inflight entries.
//
// Thread safety: every method may be called from any thread. The cancel callback given to
// AttachUpstream runs under the table's lock (so it never races DetachUpstream); it must
// not block or call back into the tracker.
#pragma once

#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace dxs {

// Why the router, not the worker or the caller, ended a request's upstream call.
enum class StopReason {
  kNone,
  // Frontend.Abort, when the worker could not abort it itself.
  kAbort,
  // Its rank's worker died or was replaced.
  kRankLost,
  // The router is shutting down.
  kShutdown,
};

// What admission needs to know about one configured DP rank.
struct RankCandidate {
  // Has a live worker that accepts new requests (JOINING or READY, not DRAINING or DEAD).
  bool eligible = false;
  // That worker's incarnation; 0 when no live worker holds the rank.
  uint64_t incarnation = 0;
  // When not eligible: why, for the UNAVAILABLE message ("state DEAD", "not registered").
  std::string why_not;
  // READY (not JOINING). A request without a pinned rank goes to a READY rank while there is
  // one: a JOINING rank may be one that registered again after a freeze or a partition and
  // does not serve yet. A pinned request may go to a JOINING rank.
  bool ready = true;
};

// Per-rank numbers for GetLoads.
struct RankTraffic {
  int64_t num_outstanding_tokens = 0;
  int num_requests = 0;
  // Tokens relayed for this rank, averaged over the last kRateWindow.
  double tokens_per_second = 0;
};

class InflightTracker {
 public:
  static constexpr absl::Duration kRateWindow = absl::Seconds(5);

  // `num_ranks` configured DP ranks (>= 1); `max_inflight` >= 1.
  InflightTracker(int num_ranks, int64_t max_inflight);

  InflightTracker(const InflightTracker&) = delete;
  InflightTracker& operator=(const InflightTracker&) = delete;

  // Records `request_id` owing `num_tokens` tokens on the least-loaded eligible rank, or
  // on `pinned_rank`. Returns the rank. Errors: ALREADY_EXISTS (id in flight),
  // RESOURCE_EXHAUSTED (max_inflight reached), UNAVAILABLE (no eligible rank, or the
  // pinned one is not). `candidates` has one entry per configured rank.
  absl::StatusOr<int> Admit(const std::string& request_id, int64_t num_tokens,
                            std::optional<int> pinned_rank,
                            const std::vector<RankCandidate>& candidates);
  // Forgets the request. No-op for an unknown id.
  void Release(const std::string& request_id);

  // The request's rank; NOT_FOUND if not in flight.
  absl::StatusOr<int> RankOf(const std::string& request_id) const;
  // `num_tokens` more tokens were generated for the request at `now`.
  void RecordTokens(const std::string& request_id, int64_t num_tokens, absl::Time now);

  // Installs how to cancel the request's upstream call. If a stop was already requested,
  // `cancel` runs at once. Returns the stop reason so far.
  StopReason AttachUpstream(const std::string& request_id, std::function<void()> cancel);
  // Removes the cancel callback; call before the upstream call's context dies.
  void DetachUpstream(const std::string& request_id);
  // Records `reason` (the first reason sticks) and cancels the upstream call if attached.
  // False for an unknown id.
  bool Stop(const std::string& request_id, StopReason reason);
  StopReason stop_reason(const std::string& request_id) const;

  // Stops (kRankLost) every request whose rank is no longer held by the incarnation it
  // was admitted on; `live_incarnations[r]` is rank r's live worker's, 0 if none. Returns
  // how many were stopped.
  int StopLostRanks(const std::vector<uint64_t>& live_incarnations);
  // Stops every request with `reason`.
  void StopAll(StopReason reason);

  std::vector<RankTraffic> Traffic(absl::Time now);
  size_t size() const;
  int64_t max_inflight() const { return max_inflight_; }

 private:
  struct Entry {
    int rank = 0;
    uint64_t incarnation = 0;
    int64_t num_outstanding_tokens = 0;
    StopReason stop = StopReason::kNone;
    std::function<void()> cancel;
  };
  struct Rank {
    int64_t num_outstanding_tokens = 0;
    int num_requests = 0;
    // (time, tokens) relayed within the last kRateWindow.
    std::deque<std::pair<absl::Time, int64_t>> recent_tokens;
  };

  void StopLocked(Entry& entry, StopReason reason) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const int64_t max_inflight_;
  mutable absl::Mutex mu_;
  std::map<std::string, Entry> entries_ ABSL_GUARDED_BY(mu_);
  std::vector<Rank> ranks_ ABSL_GUARDED_BY(mu_);
};

}  // namespace dxs
