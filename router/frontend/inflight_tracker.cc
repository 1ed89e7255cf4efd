#include "router/frontend/inflight_tracker.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>

#include "absl/strings/str_cat.h"

namespace dxs {

InflightTracker::InflightTracker(int num_ranks, int64_t max_inflight)
    : max_inflight_(max_inflight), ranks_(static_cast<size_t>(num_ranks)) {
  if (num_ranks < 1 || max_inflight < 1) {
    std::fprintf(stderr, "InflightTracker: need num_ranks >= 1 and max_inflight >= 1\n");
    std::abort();
  }
}

absl::StatusOr<int> InflightTracker::Admit(const std::string& request_id, int64_t num_tokens,
                                           std::optional<int> pinned_rank,
                                           const std::vector<RankCandidate>& candidates) {
  absl::MutexLock lock(&mu_);
  if (entries_.count(request_id)) {
    return absl::AlreadyExistsError(
        absl::StrCat("request_id: '", request_id, "' is already in flight"));
  }
  if (static_cast<int64_t>(entries_.size()) >= max_inflight_) {
    return absl::ResourceExhaustedError(
        absl::StrCat("the router's queue is full: ", entries_.size(),
                     " requests in flight (--max-inflight ", max_inflight_, "); retry later"));
  }
  const int num_ranks = static_cast<int>(std::min(ranks_.size(), candidates.size()));
  int chosen = -1;
  if (pinned_rank.has_value()) {
    const int r = *pinned_rank;
    if (r < 0 || r >= num_ranks || !candidates[r].eligible) {
      const std::string why = r >= 0 && r < num_ranks ? candidates[r].why_not : "not configured";
      return absl::UnavailableError(
          absl::StrCat("data_parallel_rank: attention rank ", r, " is not ready (", why, ")"));
    }
    chosen = r;
  } else {
    bool any_ready = false;
    for (int r = 0; r < num_ranks; ++r) any_ready |= candidates[r].eligible && candidates[r].ready;
    for (int r = 0; r < num_ranks; ++r) {
      if (!candidates[r].eligible || (any_ready && !candidates[r].ready)) continue;
      if (chosen < 0) {
        chosen = r;
        continue;
      }
      const Rank& a = ranks_[r];
      const Rank& best = ranks_[chosen];
      if (a.num_outstanding_tokens < best.num_outstanding_tokens ||
          (a.num_outstanding_tokens == best.num_outstanding_tokens &&
           a.num_requests < best.num_requests)) {
        chosen = r;
      }
    }
    if (chosen < 0) {
      return absl::UnavailableError("no attention rank is ready to take requests");
    }
  }
  Entry entry;
  entry.rank = chosen;
  entry.incarnation = candidates[chosen].incarnation;
  entry.num_outstanding_tokens = std::max<int64_t>(num_tokens, 0);
  ranks_[chosen].num_outstanding_tokens += entry.num_outstanding_tokens;
  ranks_[chosen].num_requests += 1;
  entries_.emplace(request_id, std::move(entry));
  return chosen;
}

void InflightTracker::Release(const std::string& request_id) {
  absl::MutexLock lock(&mu_);
  auto it = entries_.find(request_id);
  if (it == entries_.end()) return;
  Rank& rank = ranks_[it->second.rank];
  rank.num_outstanding_tokens -= it->second.num_outstanding_tokens;
  rank.num_requests -= 1;
  entries_.erase(it);
}

absl::StatusOr<int> InflightTracker::RankOf(const std::string& request_id) const {
  absl::MutexLock lock(&mu_);
  auto it = entries_.find(request_id);
  if (it == entries_.end()) {
    return absl::NotFoundError(absl::StrCat("request_id: '", request_id, "' is not in flight"));
  }
  return it->second.rank;
}

void InflightTracker::RecordTokens(const std::string& request_id, int64_t num_tokens,
                                   absl::Time now) {
  if (num_tokens <= 0) return;
  absl::MutexLock lock(&mu_);
  auto it = entries_.find(request_id);
  if (it == entries_.end()) return;
  Entry& entry = it->second;
  const int64_t paid = std::min(num_tokens, entry.num_outstanding_tokens);
  entry.num_outstanding_tokens -= paid;
  Rank& rank = ranks_[entry.rank];
  rank.num_outstanding_tokens -= paid;
  rank.recent_tokens.emplace_back(now, num_tokens);
  while (!rank.recent_tokens.empty() && rank.recent_tokens.front().first < now - kRateWindow) {
    rank.recent_tokens.pop_front();
  }
}

StopReason InflightTracker::AttachUpstream(const std::string& request_id,
                                           std::function<void()> cancel) {
  absl::MutexLock lock(&mu_);
  auto it = entries_.find(request_id);
  if (it == entries_.end()) return StopReason::kNone;
  Entry& entry = it->second;
  entry.cancel = std::move(cancel);
  if (entry.stop != StopReason::kNone && entry.cancel) entry.cancel();
  return entry.stop;
}

void InflightTracker::DetachUpstream(const std::string& request_id) {
  absl::MutexLock lock(&mu_);
  auto it = entries_.find(request_id);
  if (it != entries_.end()) it->second.cancel = nullptr;
}

void InflightTracker::StopLocked(Entry& entry, StopReason reason) {
  if (entry.stop == StopReason::kNone) entry.stop = reason;
  if (entry.cancel) entry.cancel();
}

bool InflightTracker::Stop(const std::string& request_id, StopReason reason) {
  absl::MutexLock lock(&mu_);
  auto it = entries_.find(request_id);
  if (it == entries_.end()) return false;
  StopLocked(it->second, reason);
  return true;
}

StopReason InflightTracker::stop_reason(const std::string& request_id) const {
  absl::MutexLock lock(&mu_);
  auto it = entries_.find(request_id);
  return it == entries_.end() ? StopReason::kNone : it->second.stop;
}

int InflightTracker::StopLostRanks(const std::vector<uint64_t>& live_incarnations) {
  absl::MutexLock lock(&mu_);
  int stopped = 0;
  for (auto& [id, entry] : entries_) {
    const uint64_t live =
        entry.rank < static_cast<int>(live_incarnations.size()) ? live_incarnations[entry.rank] : 0;
    if (live == entry.incarnation || entry.stop != StopReason::kNone) continue;
    StopLocked(entry, StopReason::kRankLost);
    ++stopped;
  }
  return stopped;
}

void InflightTracker::StopAll(StopReason reason) {
  absl::MutexLock lock(&mu_);
  for (auto& [id, entry] : entries_) StopLocked(entry, reason);
}

std::vector<RankTraffic> InflightTracker::Traffic(absl::Time now) {
  absl::MutexLock lock(&mu_);
  std::vector<RankTraffic> out(ranks_.size());
  for (size_t r = 0; r < ranks_.size(); ++r) {
    Rank& rank = ranks_[r];
    while (!rank.recent_tokens.empty() && rank.recent_tokens.front().first < now - kRateWindow) {
      rank.recent_tokens.pop_front();
    }
    int64_t tokens = 0;
    for (const auto& [at, n] : rank.recent_tokens) tokens += n;
    out[r].num_outstanding_tokens = rank.num_outstanding_tokens;
    out[r].num_requests = rank.num_requests;
    out[r].tokens_per_second = static_cast<double>(tokens) / absl::ToDoubleSeconds(kRateWindow);
  }
  return out;
}

size_t InflightTracker::size() const {
  absl::MutexLock lock(&mu_);
  return entries_.size();
}

}  // namespace dxs
