// Placements with redundant experts (Placement::WithRedundantExperts, FromExpertRanks)
// and the dispatch layout's replica choice on every host-testable backend (CPU, and the
// opaque backend that forwards to it): each routed pair goes to exactly one replica, the
// one Placement::ChooseRank names, the same every time.
#include <gtest/gtest.h>

#include <cstring>
#include <map>
#include <memory>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "dataplane/dispatch/placement.h"
#include "kernels/backend.h"
#include "kernels/opaque_backend.h"

namespace dxs {
namespace {

// Every expert covered, replicas on distinct ranks, experts_of consistent with replicas.
void ExpectWellFormed(const Placement& p, const std::string& what) {
  std::vector<std::set<int>> held(p.num_ranks());
  for (int r = 0; r < p.num_ranks(); ++r)
    held[r].insert(p.experts_of(r).begin(), p.experts_of(r).end());
  int slots = 0;
  for (int e = 0; e < p.num_experts(); ++e) {
    const std::vector<int>& ranks = p.replicas(e);
    ASSERT_FALSE(ranks.empty()) << what << " expert " << e;
    EXPECT_EQ(ranks.front(), p.owner(e)) << what;
    EXPECT_EQ(std::set<int>(ranks.begin(), ranks.end()).size(), ranks.size())
        << what << ": expert " << e << " twice on one rank";
    for (int r : ranks) EXPECT_TRUE(held[r].count(e)) << what << " expert " << e << " rank " << r;
    slots += static_cast<int>(ranks.size());
  }
  int listed = 0;
  for (int r = 0; r < p.num_ranks(); ++r) listed += static_cast<int>(p.experts_of(r).size());
  EXPECT_EQ(listed, slots) << what;
  EXPECT_EQ(p.num_slots(), slots) << what;
}

TEST(ReplicaPlacementTest, ZeroRedundantIsContiguous) {
  for (auto [e, n] : {std::pair{16, 1}, {16, 2}, {12, 5}, {8, 3}, {4, 8}}) {
    absl::StatusOr<Placement> p = Placement::WithRedundantExperts(e, n, 0, 7);
    ASSERT_TRUE(p.ok()) << p.status();
    const Placement want = Placement::Contiguous(e, n, 7);
    EXPECT_EQ(p->DebugString(), want.DebugString());
    EXPECT_EQ(p->max_replicas(), 1);
    EXPECT_EQ(p->num_slots(), e);
    // One owner each: the table is the [E] owner list the layout always took.
    std::vector<int32_t> owners;
    for (int x = 0; x < e; ++x) owners.push_back(want.owner(x));
    EXPECT_EQ(p->RankTable(), owners);
  }
}

TEST(ReplicaPlacementTest, RedundantSlotsOnDistinctRanksCoveringEveryExpert) {
  for (auto [e, n] : {std::pair{16, 2}, {16, 4}, {12, 5}, {8, 3}, {3, 4}}) {
    for (int r = 0; r <= e * (n - 1); ++r) {
      const std::string what =
          "E=" + std::to_string(e) + " N=" + std::to_string(n) + " R=" + std::to_string(r);
      absl::StatusOr<Placement> p = Placement::WithRedundantExperts(e, n, r);
      ASSERT_TRUE(p.ok()) << what << ": " << p.status();
      ExpectWellFormed(*p, what);
      EXPECT_EQ(p->num_slots(), e + r) << what;
      // Spread over experts: copies differ by at most one.
      int fewest = n, most = 0;
      for (int x = 0; x < e; ++x) {
        fewest = std::min(fewest, p->num_replicas(x));
        most = std::max(most, p->num_replicas(x));
      }
      EXPECT_LE(most - fewest, 1) << what;
      // With R >= E every expert survives the loss of any one rank.
      if (r >= e) EXPECT_GE(fewest, 2) << what;
      // Deterministic.
      EXPECT_EQ(p->DebugString(), Placement::WithRedundantExperts(e, n, r)->DebugString());
    }
  }
}

TEST(ReplicaPlacementTest, SlotsSpreadOverRanks) {
  // 16 experts, 2 ranks, 3 redundant: 8 + 8 primaries, the 3 replicas split 2 / 1.
  absl::StatusOr<Placement> p = Placement::WithRedundantExperts(16, 2, 3);
  ASSERT_TRUE(p.ok()) << p.status();
  const int a = static_cast<int>(p->experts_of(0).size());
  const int b = static_cast<int>(p->experts_of(1).size());
  EXPECT_EQ(a + b, 19);
  EXPECT_LE(std::abs(a - b), 1) << p->DebugString();
  // R = E on 2 ranks: every rank holds every expert.
  p = Placement::WithRedundantExperts(16, 2, 16);
  ASSERT_TRUE(p.ok());
  EXPECT_EQ(p->experts_of(0).size(), 16u);
  EXPECT_EQ(p->experts_of(1).size(), 16u);
}

TEST(ReplicaPlacementTest, RefusesImpossibleCounts) {
  EXPECT_FALSE(Placement::WithRedundantExperts(16, 2, -1).ok());
  EXPECT_FALSE(Placement::WithRedundantExperts(16, 2, 17).ok());
  EXPECT_FALSE(Placement::WithRedundantExperts(16, 1, 1).ok());
  EXPECT_TRUE(Placement::WithRedundantExperts(16, 1, 0).ok());
}

TEST(ReplicaPlacementTest, FromExpertRanksChecks) {
  absl::StatusOr<Placement> p = Placement::FromExpertRanks(3, {{0, 2}, {1}, {2, 0, 1}}, 4);
  ASSERT_TRUE(p.ok()) << p.status();
  ExpectWellFormed(*p, "listed");
  EXPECT_EQ(p->version(), 4u);
  EXPECT_EQ(p->max_replicas(), 3);
  EXPECT_EQ(p->RankTable(), (std::vector<int32_t>{0, 2, -1, 1, -1, -1, 0, 1, 2}));
  EXPECT_FALSE(Placement::FromExpertRanks(3, {{0, 0}, {1}}).ok());  // twice on one rank
  EXPECT_FALSE(Placement::FromExpertRanks(3, {{0}, {}}).ok());      // expert without a rank
  EXPECT_FALSE(Placement::FromExpertRanks(3, {{0}, {3}}).ok());     // rank out of range
}

TEST(ReplicaPlacementTest, ChoiceIsRowModuloReplicasInRankOrder) {
  absl::StatusOr<Placement> p = Placement::FromExpertRanks(3, {{2, 0}, {1}, {2, 0, 1}});
  ASSERT_TRUE(p.ok());
  EXPECT_EQ(p->owner(0), 2);  // the primary stays first; the choice takes rank order
  for (int64_t row = 0; row < 12; ++row) {
    EXPECT_EQ(p->ChooseRank(row, 0), row % 2 == 0 ? 0 : 2);
    EXPECT_EQ(p->ChooseRank(row, 1), 1);
    EXPECT_EQ(p->ChooseRank(row, 2), row % 3);
  }
}

// The backend layout, split per rank: the (token, expert, weight) triples each rank gets.
struct Triple {
  int32_t token, expert;
  float weight;
  bool operator<(const Triple& o) const {
    return std::tie(token, expert, weight) < std::tie(o.token, o.expert, o.weight);
  }
};
using PerRank = std::vector<std::vector<Triple>>;

PerRank LayoutOnBackend(Backend* backend, const Placement& placement,
                        const std::vector<int32_t>& ids, const std::vector<float>& weights,
                        int top_k) {
  const int num_ranks = placement.num_ranks();
  const int64_t tokens = static_cast<int64_t>(ids.size()) / top_k;
  Tensor table = *backend->UploadIndices(placement.RankTable());
  if (placement.max_replicas() > 1) {
    table = table.Reshape({placement.num_experts(), placement.max_replicas()});
  }
  DispatchLayoutTensors t;
  absl::Status s = backend->ComputeDispatchLayout(
      backend->UploadIndices(ids)->Reshape({tokens, top_k}),
      *backend->Upload(weights, {tokens, top_k}), table, num_ranks, &t);
  EXPECT_TRUE(s.ok()) << s;
  PerRank out(num_ranks);
  if (!s.ok()) return out;
  const std::vector<int32_t> num_tokens = *backend->DownloadIndices(t.num_tokens_per_rank);
  const std::vector<int32_t> num_pairs = *backend->DownloadIndices(t.num_pairs_per_rank);
  const std::vector<int32_t> token_rows = *backend->DownloadIndices(t.token_rows);
  const std::vector<int32_t> blocks = *backend->DownloadIndices(t.pairs);
  size_t token = 0, pair = 0;
  for (int r = 0; r < num_ranks; ++r) {
    const int32_t* block = blocks.data() + 3 * pair;
    for (int32_t p = 0; p < num_pairs[r]; ++p) {
      float w;
      std::memcpy(&w, &block[2 * num_pairs[r] + p], sizeof(w));
      EXPECT_LT(block[p], num_tokens[r]);
      out[r].push_back({token_rows[token + block[p]], block[num_pairs[r] + p], w});
    }
    token += num_tokens[r];
    pair += num_pairs[r];
  }
  EXPECT_EQ(pair, ids.size());
  return out;
}

TEST(ReplicaLayoutTest, EachPairGoesToExactlyTheChosenReplica) {
  const int num_experts = 16, top_k = 4;
  std::vector<Placement> placements;
  for (auto [n, r] : {std::pair{2, 16}, {2, 5}, {4, 7}, {4, 48}, {3, 1}}) {
    placements.push_back(*Placement::WithRedundantExperts(num_experts, n, r));
  }
  std::vector<std::unique_ptr<Backend>> backends;
  backends.push_back(MakeCpuBackend());
  backends.push_back(*MakeOpaqueBackend(size_t{64} << 20));
  std::mt19937 rng(11);
  for (const Placement& placement : placements) {
    for (int64_t tokens : {0, 1, 9, 257}) {
      std::vector<int32_t> ids;
      std::vector<float> weights;
      for (int64_t t = 0; t < tokens; ++t) {
        std::set<int32_t> picked;
        while (static_cast<int>(picked.size()) < top_k) picked.insert(rng() % num_experts);
        for (int32_t e : picked) {
          ids.push_back(e);
          weights.push_back(static_cast<float>(rng() % 1000) / 1000.f);
        }
      }
      // What each rank must get: every pair once, at the chosen replica.
      PerRank want(placement.num_ranks());
      for (int64_t t = 0; t < tokens; ++t) {
        for (int k = 0; k < top_k; ++k) {
          const int32_t e = ids[t * top_k + k];
          want[placement.ChooseRank(t, e)].push_back(
              {static_cast<int32_t>(t), e, weights[t * top_k + k]});
        }
      }
      for (const auto& backend : backends) {
        const std::string what =
            backend->name() + " " + placement.DebugString() + " tokens " + std::to_string(tokens);
        PerRank first = LayoutOnBackend(backend.get(), placement, ids, weights, top_k);
        EXPECT_EQ(first.size(), want.size());
        for (size_t r = 0; r < want.size() && r < first.size(); ++r) {
          std::vector<Triple> got = first[r], expect = want[r];
          std::sort(got.begin(), got.end());
          std::sort(expect.begin(), expect.end());
          ASSERT_EQ(got.size(), expect.size()) << what << " rank " << r;
          for (size_t i = 0; i < got.size(); ++i) {
            EXPECT_FALSE(got[i] < expect[i] || expect[i] < got[i]) << what << " rank " << r;
          }
        }
        // The same inputs again: the same choice.
        PerRank again = LayoutOnBackend(backend.get(), placement, ids, weights, top_k);
        for (size_t r = 0; r < first.size() && r < again.size(); ++r) {
          ASSERT_EQ(first[r].size(), again[r].size()) << what;
          for (size_t i = 0; i < first[r].size(); ++i) {
            EXPECT_EQ(first[r][i].token, again[r][i].token) << what;
            EXPECT_EQ(first[r][i].expert, again[r][i].expert) << what;
          }
        }
      }
    }
  }
}

TEST(ReplicaLayoutTest, ReplicasShareTheLoad) {
  // Every expert on both ranks: each token goes whole to rank row % 2.
  const Placement placement = *Placement::WithRedundantExperts(8, 2, 8);
  std::unique_ptr<Backend> backend = MakeCpuBackend();
  std::vector<int32_t> ids;
  std::vector<float> weights;
  for (int t = 0; t < 100; ++t) {
    for (int k = 0; k < 2; ++k) {
      ids.push_back((t * 3 + k) % 8);
      weights.push_back(0.5f);
    }
  }
  const PerRank got = LayoutOnBackend(backend.get(), placement, ids, weights, 2);
  ASSERT_EQ(got.size(), 2u);
  EXPECT_EQ(got[0].size(), 100u);
  EXPECT_EQ(got[1].size(), 100u);
  for (int r = 0; r < 2; ++r) {
    for (const Triple& p : got[r]) EXPECT_EQ(p.token % 2, r);
  }
}

TEST(ReplicaLayoutTest, ExpertWithoutReplicaIsRefused) {
  std::unique_ptr<Backend> backend = MakeCpuBackend();
  // Expert 1's row is all -1.
  Tensor table = backend->UploadIndices({0, 1, -1, -1})->Reshape({2, 2});
  DispatchLayoutTensors t;
  absl::Status s =
      backend->ComputeDispatchLayout(backend->UploadIndices({0, 1})->Reshape({1, 2}),
                                     *backend->Upload({0.5f, 0.5f}, {1, 2}), table, 2, &t);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  // A 3-d table is refused by the shared argument check.
  s = backend->ComputeDispatchLayout(
      backend->UploadIndices({0, 1})->Reshape({1, 2}), *backend->Upload({0.5f, 0.5f}, {1, 2}),
      backend->UploadIndices({0, 1, 0, 1})->Reshape({1, 2, 2}), 2, &t);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
}

}  // namespace
}  // namespace dxs
