#include "router/dispatch/placement.h"

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
  Placement p;
  p.version_ = version;
  p.owner_.assign(num_experts, -1);
  p.rank_experts_ = experts;
  std::vector<std::string> problems;
  for (size_t r = 0; r < experts.size(); ++r) {
    std::sort(p.rank_experts_[r].begin(), p.rank_experts_[r].end());
    for (int e : experts[r]) {
      if (e < 0 || e >= num_experts) {
        problems.push_back(
            absl::StrCat("expert ", e, " on rank ", r, " is outside [0, ", num_experts, ")"));
      } else if (p.owner_[e] >= 0) {
        problems.push_back(
            absl::StrCat("expert ", e, " overlaps: held by ranks ", p.owner_[e], " and ", r));
      } else {
        p.owner_[e] = static_cast<int>(r);
      }
    }
  }
  std::vector<int> missing;
  for (int e = 0; e < num_experts; ++e) {
    if (p.owner_[e] < 0) missing.push_back(e);
  }
  if (!missing.empty()) {
    problems.push_back(absl::StrCat("experts missing: ", absl::StrJoin(missing, ",")));
  }
  if (!problems.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("bad placement: ", absl::StrJoin(problems, "; ")));
  }
  return p;
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
