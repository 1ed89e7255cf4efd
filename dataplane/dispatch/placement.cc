#include "dataplane/dispatch/placement.h"

#include <algorithm>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"

namespace dxs {

Placement Placement::Contiguous(int num_experts, int num_ranks, uint64_t version) {
  std::vector<std::vector<int>> experts(num_ranks);
  for (int r = 0; r < num_ranks; ++r) {
    const int begin = static_cast<int>(int64_t{r} * num_experts / num_ranks);
    const int end = static_cast<int>(int64_t{r + 1} * num_experts / num_ranks);
    for (int e = begin; e < end; ++e) experts[r].push_back(e);
  }
  return *FromRankExperts(num_experts, experts, version);
}

absl::StatusOr<Placement> Placement::FromRankExperts(int num_experts,
                                                     const std::vector<std::vector<int>>& experts,
                                                     uint64_t version) {
  if (num_experts <= 0 || experts.empty()) {
    return absl::InvalidArgumentError("placement needs at least one expert and one rank");
  }
  std::vector<int> owner(num_experts, -1);
  std::vector<std::string> problems;
  for (size_t r = 0; r < experts.size(); ++r) {
    for (int e : experts[r]) {
      if (e < 0 || e >= num_experts) {
        problems.push_back(
            absl::StrCat("expert ", e, " on rank ", r, " is outside [0, ", num_experts, ")"));
      } else if (owner[e] >= 0) {
        problems.push_back(
            absl::StrCat("expert ", e, " overlaps: held by ranks ", owner[e], " and ", r));
      } else {
        owner[e] = static_cast<int>(r);
      }
    }
  }
  std::vector<int> missing;
  for (int e = 0; e < num_experts; ++e) {
    if (owner[e] < 0) missing.push_back(e);
  }
  if (!missing.empty()) {
    problems.push_back(absl::StrCat("experts missing: ", absl::StrJoin(missing, ",")));
  }
  if (!problems.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("bad placement: ", absl::StrJoin(problems, "; ")));
  }
  std::vector<std::vector<int>> ranks(num_experts);
  for (int e = 0; e < num_experts; ++e) ranks[e] = {owner[e]};
  return FromExpertRanks(static_cast<int>(experts.size()), ranks, version);
}

absl::StatusOr<Placement> Placement::FromExpertRanks(int num_ranks,
                                                     const std::vector<std::vector<int>>& ranks,
                                                     uint64_t version) {
  if (num_ranks <= 0 || ranks.empty()) {
    return absl::InvalidArgumentError("placement needs at least one expert and one rank");
  }
  Placement p;
  p.version_ = version;
  p.replicas_ = ranks;
  p.rank_experts_.assign(num_ranks, {});
  std::vector<std::string> problems;
  std::vector<int> missing;
  for (size_t e = 0; e < ranks.size(); ++e) {
    if (ranks[e].empty()) missing.push_back(static_cast<int>(e));
    std::vector<bool> seen(num_ranks, false);
    for (int r : ranks[e]) {
      if (r < 0 || r >= num_ranks) {
        problems.push_back(
            absl::StrCat("expert ", e, " on rank ", r, ", outside [0, ", num_ranks, ")"));
      } else if (seen[r]) {
        problems.push_back(absl::StrCat("expert ", e, " twice on rank ", r));
      } else {
        seen[r] = true;
        p.rank_experts_[r].push_back(static_cast<int>(e));
      }
    }
  }
  if (!missing.empty()) {
    problems.push_back(absl::StrCat("experts missing: ", absl::StrJoin(missing, ",")));
  }
  if (!problems.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("bad placement: ", absl::StrJoin(problems, "; ")));
  }
  p.choice_ = p.replicas_;
  for (std::vector<int>& r : p.choice_) std::sort(r.begin(), r.end());
  return p;
}

absl::StatusOr<Placement> Placement::WithRedundantExperts(int num_experts, int num_ranks,
                                                          int num_redundant, uint64_t version) {
  if (num_experts <= 0 || num_ranks <= 0) {
    return absl::InvalidArgumentError("placement needs at least one expert and one rank");
  }
  const int64_t most = int64_t{num_experts} * (num_ranks - 1);
  if (num_redundant < 0 || num_redundant > most) {
    return absl::InvalidArgumentError(absl::StrCat(
        num_redundant, " redundant experts: with ", num_experts, " experts on ", num_ranks,
        " EP ranks there can be 0..", most, " (every rank holding every expert)"));
  }
  const Placement base = Contiguous(num_experts, num_ranks, version);
  std::vector<std::vector<int>> ranks = base.replicas_;
  std::vector<int> slots(num_ranks);
  for (int r = 0; r < num_ranks; ++r) slots[r] = static_cast<int>(base.experts_of(r).size());
  std::vector<std::vector<bool>> holds(num_experts, std::vector<bool>(num_ranks, false));
  for (int e = 0; e < num_experts; ++e) holds[e][ranks[e][0]] = true;
  for (int slot = 0; slot < num_redundant; ++slot) {
    // The (copies, rank slots, expert, rank) minimum over experts with a free rank.
    int best_e = -1, best_r = -1;
    for (int e = 0; e < num_experts; ++e) {
      const size_t copies = ranks[e].size();
      if (copies == static_cast<size_t>(num_ranks)) continue;
      if (best_e >= 0 && copies > ranks[best_e].size()) continue;
      int r_e = -1;
      for (int r = 0; r < num_ranks; ++r) {
        if (!holds[e][r] && (r_e < 0 || slots[r] < slots[r_e])) r_e = r;
      }
      if (best_e < 0 || copies < ranks[best_e].size() || slots[r_e] < slots[best_r]) {
        best_e = e;
        best_r = r_e;
      }
    }
    ranks[best_e].push_back(best_r);
    holds[best_e][best_r] = true;
    ++slots[best_r];
  }
  return FromExpertRanks(num_ranks, ranks, version);
}

int Placement::max_replicas() const {
  size_t most = 0;
  for (const std::vector<int>& r : replicas_) most = std::max(most, r.size());
  return static_cast<int>(most);
}

int Placement::num_slots() const {
  size_t n = 0;
  for (const std::vector<int>& r : replicas_) n += r.size();
  return static_cast<int>(n);
}

std::vector<int32_t> Placement::RankTable() const {
  const size_t width = static_cast<size_t>(max_replicas());
  std::vector<int32_t> table(replicas_.size() * width, -1);
  for (size_t e = 0; e < replicas_.size(); ++e) {
    std::copy(choice_[e].begin(), choice_[e].end(), table.begin() + e * width);
  }
  return table;
}

std::string Placement::DebugString() const {
  std::vector<std::string> parts;
  for (size_t r = 0; r < rank_experts_.size(); ++r) {
    parts.push_back(absl::StrCat(r, ":[", absl::StrJoin(rank_experts_[r], ","), "]"));
  }
  return absl::StrCat("v", version_, " ", absl::StrJoin(parts, " "));
}

absl::StatusOr<std::vector<int>> ParseExpertList(const std::string& text) {
  std::vector<int> out;
  for (absl::string_view part : absl::StrSplit(text, ',', absl::SkipEmpty())) {
    std::vector<absl::string_view> range = absl::StrSplit(part, '-');
    int lo, hi;
    if (range.size() == 1 && absl::SimpleAtoi(range[0], &lo)) {
      hi = lo;
    } else if (range.size() != 2 || !absl::SimpleAtoi(range[0], &lo) ||
               !absl::SimpleAtoi(range[1], &hi) || hi < lo) {
      return absl::InvalidArgumentError(
          absl::StrCat("bad expert list '", text, "': expected e.g. 0-3,5,7-8"));
    }
    for (int e = lo; e <= hi; ++e) out.push_back(e);
  }
  return out;
}

}  // namespace dxs
