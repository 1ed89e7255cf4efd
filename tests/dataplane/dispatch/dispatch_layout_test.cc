// The routing bookkeeping around the exchange: the backend's ComputeDispatchLayout
// (attention side) against a plain per-token reference, for one and several EP ranks, any
// placement, repeated experts and one backend through every size; and ExpertStepServer's check of
// every routed pair (row in range, expert held), whose errors name the bad pair whether the round
// is checked against the per-round table of held experts or pair by pair.
#include <gtest/gtest.h>

#include <cstring>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/time/clock.h"
#include "common/model_config.h"
#include "dataplane/dispatch/dispatch_combine.h"
#include "dataplane/dispatch/placement.h"
#include "dataplane/dispatch/wire.h"
#include "dataplane/transport/transport.h"
#include "expert_service/expert_step_server.h"
#include "expert_service/low_latency_expert_steps.h"
#include "kernels/backend.h"
#include "model/expert_shard.h"

namespace dxs {
namespace {

// Per rank: the tokens sent to it and the pairs it receives.
struct DispatchLayout {
  std::vector<std::vector<int32_t>> token_rows;
  std::vector<RoutedPairs> pairs;
};

// The backend op's flat, rank-major tensors, split per rank.
DispatchLayout ComputeLayout(Backend* backend, const Placement& placement,
                             const std::vector<int32_t>& ids, const std::vector<float>& weights,
                             int top_k) {
  const int num_ranks = placement.num_ranks();
  const int64_t tokens = static_cast<int64_t>(ids.size()) / top_k;
  std::vector<int32_t> owner(placement.num_experts());
  for (size_t e = 0; e < owner.size(); ++e) owner[e] = placement.owner(static_cast<int>(e));
  DispatchLayoutTensors t;
  absl::Status s = backend->ComputeDispatchLayout(
      backend->UploadIndices(ids)->Reshape({tokens, top_k}),
      *backend->Upload(weights, {tokens, top_k}), *backend->UploadIndices(owner), num_ranks, &t);
  EXPECT_TRUE(s.ok()) << s;
  const std::vector<int32_t> num_tokens = *backend->DownloadIndices(t.num_tokens_per_rank);
  const std::vector<int32_t> num_pairs = *backend->DownloadIndices(t.num_pairs_per_rank);
  const std::vector<int32_t> token_rows = *backend->DownloadIndices(t.token_rows);
  const std::vector<int32_t> blocks = *backend->DownloadIndices(t.pairs);
  DispatchLayout layout;
  layout.token_rows.resize(num_ranks);
  layout.pairs.resize(num_ranks);
  size_t token = 0, pair = 0;
  for (int r = 0; r < num_ranks; ++r) {
    layout.token_rows[r].assign(token_rows.begin() + token,
                                token_rows.begin() + token + num_tokens[r]);
    token += num_tokens[r];
    // The rank's block: rows | experts | weights.
    const int32_t* block = blocks.data() + 3 * pair;
    for (int32_t p = 0; p < num_pairs[r]; ++p) {
      float weight;
      std::memcpy(&weight, &block[2 * num_pairs[r] + p], sizeof(weight));
      layout.pairs[r].Add(block[p], block[num_pairs[r] + p], weight);
    }
    pair += num_pairs[r];
  }
  EXPECT_EQ(pair, ids.size());
  return layout;
}

// The layout as first written: per token, a fresh rank -> local row map and push_back.
DispatchLayout ReferenceLayout(const Placement& placement, const std::vector<int32_t>& ids,
                               const std::vector<float>& weights, int top_k) {
  const int num_ranks = placement.num_ranks();
  DispatchLayout layout;
  layout.token_rows.resize(num_ranks);
  layout.pairs.resize(num_ranks);
  const int64_t num_tokens = top_k > 0 ? static_cast<int64_t>(ids.size()) / top_k : 0;
  for (int64_t t = 0; t < num_tokens; ++t) {
    std::vector<int32_t> local_row(num_ranks, -1);
    for (int k = 0; k < top_k; ++k) {
      const int32_t expert = ids[t * top_k + k];
      const int r = placement.owner(expert);
      if (local_row[r] < 0) {
        local_row[r] = static_cast<int32_t>(layout.token_rows[r].size());
        layout.token_rows[r].push_back(static_cast<int32_t>(t));
      }
      layout.pairs[r].Add(local_row[r], expert, weights[t * top_k + k]);
    }
  }
  return layout;
}

void ExpectSameLayout(const DispatchLayout& got, const DispatchLayout& want,
                      const std::string& what) {
  ASSERT_EQ(got.token_rows.size(), want.token_rows.size()) << what;
  ASSERT_EQ(got.pairs.size(), want.pairs.size()) << what;
  for (size_t r = 0; r < want.token_rows.size(); ++r) {
    EXPECT_EQ(got.token_rows[r], want.token_rows[r]) << what << " rank " << r;
    EXPECT_EQ(got.pairs[r].rows, want.pairs[r].rows) << what << " rank " << r;
    EXPECT_EQ(got.pairs[r].experts, want.pairs[r].experts) << what << " rank " << r;
    EXPECT_EQ(got.pairs[r].weights, want.pairs[r].weights) << what << " rank " << r;
  }
}

TEST(DispatchLayoutTest, MatchesReference) {
  const int num_experts = 16;
  std::vector<Placement> placements = {
      Placement::Contiguous(num_experts, 1), Placement::Contiguous(num_experts, 2),
      Placement::Contiguous(num_experts, 3), Placement::Contiguous(num_experts, 16)};
  auto scattered = Placement::FromRankExperts(
      num_experts, {{1, 5, 6, 15}, {0, 2, 3, 8, 9, 10}, {4, 7, 11, 12, 13, 14}});
  ASSERT_TRUE(scattered.ok()) << scattered.status();
  placements.push_back(*scattered);
  std::mt19937 rng(7);
  for (size_t pi = 0; pi < placements.size(); ++pi) {
    const Placement& placement = placements[pi];
    std::unique_ptr<Backend> backend = MakeCpuBackend();  // one through every size
    for (int top_k : {1, 2, 4, 8}) {
      for (int64_t tokens : {0, 1, 7, 300, 5, 300}) {
        for (bool repeats : {false, true}) {
          std::vector<int32_t> ids;
          std::vector<float> weights;
          for (int64_t t = 0; t < tokens; ++t) {
            for (int k = 0; k < top_k; ++k) {
              // Routers pick distinct experts; repeats (which the layout keeps as pairs of
              // one row) are exercised too.
              const int32_t e =
                  repeats ? static_cast<int32_t>(rng() % 3)
                          : static_cast<int32_t>((t * 7 + k * 5 + rng() % 2) % num_experts);
              ids.push_back(e);
              weights.push_back(static_cast<float>(rng() % 1000) / 1000.f);
            }
          }
          const std::string what = "placement " + std::to_string(pi) + " top_k " +
                                   std::to_string(top_k) + " tokens " + std::to_string(tokens) +
                                   (repeats ? " with repeats" : "");
          const DispatchLayout want = ReferenceLayout(placement, ids, weights, top_k);
          ExpectSameLayout(ComputeLayout(backend.get(), placement, ids, weights, top_k), want,
                           what);
        }
      }
    }
  }
}

constexpr int kNumExperts = 8;
constexpr int64_t kHidden = 4;
constexpr int kNotHeld = 5;  // inside the config's expert range, not held
// Outside the config's range, "held" all the same: still refused, since the pairs are
// checked on the backend against a table of the config's experts (no shard can hold an
// expert the config does not have).
constexpr int kHeldOutside = 11;

// Holds experts 0-7 but kNotHeld, and kHeldOutside; each pair's out row is its x row.
// Keeps the pairs it got.
class SomeExperts final : public ExpertCompute {
 public:
  explicit SomeExperts(Backend* backend) : backend_(backend) {}
  bool Holds(int layer, int expert) const override {
    return (expert >= 0 && expert < kNumExperts && expert != kNotHeld) || expert == kHeldOutside;
  }
  Backend* backend() const override { return backend_; }
  absl::Status Forward(int layer, const Tensor& x, const RoutedPairTensors& pairs,
                       Tensor* out) override {
    // The CPU backend's pair tensors are host memory.
    last_pairs = RoutedPairs();
    for (int64_t p = 0; p < pairs.size(); ++p) {
      last_pairs.Add(pairs.rows.i32()[p], pairs.experts.i32()[p], pairs.weights.f32()[p]);
      std::memcpy(out->f32() + pairs.rows.i32()[p] * kHidden,
                  x.f32() + pairs.rows.i32()[p] * kHidden, kHidden * sizeof(float));
    }
    return absl::OkStatus();
  }
  RoutedPairs last_pairs;

 private:
  Backend* backend_;
};

class ExpertRoutingCheckTest : public ::testing::Test {
 protected:
  void SetUp() override {
    transports_ = MakeInprocTransportGroup(2);
    backend_ = MakeCpuBackend();
    experts_ = std::make_unique<SomeExperts>(backend_.get());
    config_.hidden_size = kHidden;
    config_.num_hidden_layers = 1;
    config_.num_experts = kNumExperts;
    config_.num_experts_per_tok = 2;
    server_ = std::make_unique<ExpertStepServer>(transports_[1].get(), std::vector<int>{0},
                                                 experts_.get(), config_);
  }

  // The next round's dispatch header for `num_rows` rows and these pairs.
  WireHeader NextHeader(int32_t num_rows, const RoutedPairs& pairs) {
    WireHeader h;
    h.kind = MessageKind::kDispatch;
    h.step = ++step_;
    h.layer = 0;
    h.num_rows = num_rows;
    h.num_pairs = static_cast<int32_t>(pairs.size());
    h.hidden = kHidden;
    return h;
  }

  // Announces one dispatch of `num_rows` rows with these pairs, posts its group (rows and
  // pairs out, the combine back) as the attention side does, and serves the round.
  absl::Status Round(int32_t num_rows, const RoutedPairs& pairs) {
    WireHeader h = NextHeader(num_rows, pairs);
    std::vector<float> rows(num_rows * kHidden), answer(rows.size());
    for (size_t i = 0; i < rows.size(); ++i) rows[i] = static_cast<float>(i);
    // The pairs as the wire carries them: one block of rows | experts | weights.
    const size_t n = pairs.size();
    std::vector<int32_t> block(3 * n);
    std::memcpy(block.data(), pairs.rows.data(), n * 4);
    std::memcpy(block.data() + n, pairs.experts.data(), n * 4);
    std::memcpy(block.data() + 2 * n, pairs.weights.data(), n * 4);
    const Transfer group[] = {
        {Transfer::Kind::kSend, 1, rows.data(), rows.size() * sizeof(float)},
        {Transfer::Kind::kSend, 1, block.data(), block.size() * 4},
        {Transfer::Kind::kRecv, 1, answer.data(), answer.size() * sizeof(float)}};
    absl::Status announced = transports_[0]->Send(1, h.Encode(), nullptr, 0);
    if (!announced.ok()) return announced;
    absl::StatusOr<ExchangeId> id = transports_[0]->PostExchange(ExchangeTag(h.key()), group, 3);
    if (!id.ok()) return id.status();
    absl::Status served = server_->ServeRound(absl::Now() + absl::Seconds(5));
    // The combine: the rows back when the round was served; a refused round sends nothing,
    // and the attention side gives up on it.
    absl::Status combined = transports_[0]->WaitExchange(
        *id, served.ok() ? absl::Now() + absl::Seconds(5) : absl::InfinitePast());
    if (served.ok()) {
      EXPECT_TRUE(combined.ok()) << combined;
      // SomeExperts answers each routed row with the row itself.
      for (size_t p = 0; p < pairs.size(); ++p) {
        for (int64_t j = 0; j < kHidden; ++j) {
          const int64_t at = pairs.rows[p] * kHidden + j;
          EXPECT_EQ(answer[at], rows[at]) << "pair " << p;
        }
      }
    }
    return served;
  }

  std::vector<std::unique_ptr<Transport>> transports_;
  // The same round through a mapped region of the DP rank (the one-copy exchange): rows,
  // pairs and room for the answers in one region of transports_[0], the header with its
  // key, and a 4-byte status back in the group. `edit` may change the header (offsets) and
  // the key before they go. Returns the round's status and, in *status, what the server
  // answered (-1: nothing).
  absl::Status MappedRound(int32_t num_rows, const RoutedPairs& pairs, int32_t* status,
                           const std::function<void(WireHeader*, std::string*)>& edit = {}) {
    WireHeader h = NextHeader(num_rows, pairs);
    h.flags = WireHeader::kMapped;
    const size_t n = pairs.size(), rows_bytes = num_rows * kHidden * sizeof(float);
    absl::StatusOr<MappedRegion> region = transports_[0]->MapRegion(2 * rows_bytes + 12 * n + 64);
    if (!region.ok()) return region.status();
    auto* base = static_cast<uint8_t*>(region->data);
    h.rows_at = 0;
    h.answers_at = static_cast<int64_t>(rows_bytes);
    h.pairs_at = static_cast<int64_t>(2 * rows_bytes);
    auto* rows = reinterpret_cast<float*>(base);
    for (int64_t i = 0; i < num_rows * kHidden; ++i) rows[i] = static_cast<float>(i);
    std::memcpy(base + h.pairs_at, pairs.rows.data(), n * 4);
    std::memcpy(base + h.pairs_at + 4 * n, pairs.experts.data(), n * 4);
    std::memcpy(base + h.pairs_at + 8 * n, pairs.weights.data(), n * 4);
    std::string key = region->key;
    if (edit) edit(&h, &key);
    *status = -1;
    const Transfer group[] = {{Transfer::Kind::kRecv, 1, status, sizeof(int32_t)}};
    absl::Status announced = transports_[0]->Send(1, h.Encode(), key.data(), key.size());
    if (!announced.ok()) return announced;
    absl::StatusOr<ExchangeId> id = transports_[0]->PostExchange(ExchangeTag(h.key()), group, 1);
    if (!id.ok()) return id.status();
    absl::Status served = server_->ServeRound(absl::Now() + absl::Seconds(5));
    absl::Status answered = transports_[0]->WaitExchange(
        *id, served.ok() ? absl::Now() + absl::Seconds(5) : absl::InfinitePast());
    if (served.ok() && answered.ok() && *status == 0) {
      const auto* answers = reinterpret_cast<const float*>(base + h.answers_at);
      for (size_t p = 0; p < n; ++p) {
        for (int64_t j = 0; j < kHidden; ++j) {
          const int64_t at = pairs.rows[p] * kHidden + j;
          EXPECT_EQ(answers[at], rows[at]) << "pair " << p;
        }
      }
    }
    transports_[0]->UnmapRegion(region->data);
    return served;
  }

  // The DP rank's low-latency step message for the next step (generation 1, one expert
  // rank), connecting: with its region's key.
  WireHeader LowLatencyStep() {
    WireHeader h;
    h.kind = MessageKind::kLowLatencyStep;
    h.step = ++step_;
    h.layer = -1;
    h.ll_generation = 1;
    h.ll_capacity = 8;
    h.ll_ranks = 1;
    h.num_experts = kNumExperts;
    h.flags = WireHeader::kConnect;
    return h;
  }

  ModelConfig config_;
  std::unique_ptr<Backend> backend_;
  std::unique_ptr<SomeExperts> experts_;
  std::unique_ptr<ExpertStepServer> server_;
  uint64_t step_ = 0;
};

// `num_pairs` valid pairs over `num_rows` rows, then (row, expert) at position `at`.
RoutedPairs PairsWith(int32_t num_rows, int num_pairs, int at, int32_t row, int32_t expert) {
  RoutedPairs pairs;
  for (int p = 0; p < num_pairs; ++p) {
    const int32_t e = p % kNumExperts == kNotHeld ? 0 : p % kNumExperts;
    pairs.Add(p % num_rows, e, 0.5f);
  }
  if (at >= 0) {
    pairs.rows[at] = row;
    pairs.experts[at] = expert;
  }
  return pairs;
}

TEST_F(ExpertRoutingCheckTest, AcceptsHeldExpertsAndRowsInRange) {
  // Fewer pairs than experts, and more.
  for (int num_pairs : {3, 40}) {
    RoutedPairs pairs = PairsWith(10, num_pairs, 1, 9, kNumExperts - 1);
    absl::Status s = Round(10, pairs);
    ASSERT_TRUE(s.ok()) << s;
    EXPECT_EQ(experts_->last_pairs.rows, pairs.rows);
    EXPECT_EQ(experts_->last_pairs.experts, pairs.experts);
    EXPECT_EQ(experts_->last_pairs.weights, pairs.weights);
  }
}

TEST_F(ExpertRoutingCheckTest, RejectsBadPairsNamingTheFirst) {
  struct Case {
    int32_t row, expert;
  };
  const Case cases[] = {{10, 1},          {-1, 1},           {2, kNotHeld}, {2, -3},
                        {2, kNumExperts}, {2, kHeldOutside}, {2, 1000}};
  for (int num_pairs : {3, 40}) {
    for (const Case& c : cases) {
      for (bool second : {false, true}) {
        RoutedPairs pairs = PairsWith(10, num_pairs, 1, c.row, c.expert);
        if (second) pairs.rows[2] = 99;  // a second bad pair: the error names the first
        absl::Status s = Round(10, pairs);
        ASSERT_FALSE(s.ok()) << "row " << c.row << " expert " << c.expert;
        EXPECT_EQ(s.message(), "DP peer 0 routed row " + std::to_string(c.row) + " to expert " +
                                   std::to_string(c.expert) + ", which this rank does not hold");
        // The server carries on with the next round.
        ASSERT_TRUE(Round(10, PairsWith(10, num_pairs, -1, 0, 0)).ok());
      }
    }
  }
}

// The one-copy exchange's round: the experts read the rows in the DP rank's region and
// answer there, and the routing check holds for pairs read there too.
TEST_F(ExpertRoutingCheckTest, MappedRoundsReadAndAnswerInPlace) {
  int32_t status = -1;
  RoutedPairs pairs = PairsWith(10, 40, 1, 9, kNumExperts - 1);
  ASSERT_TRUE(MappedRound(10, pairs, &status).ok());
  EXPECT_EQ(status, 0);
  EXPECT_EQ(experts_->last_pairs.rows, pairs.rows);
  EXPECT_EQ(experts_->last_pairs.experts, pairs.experts);
  EXPECT_EQ(server_->counters().rows_mapped.load(), 10);
  absl::Status bad = MappedRound(10, PairsWith(10, 40, 1, 2, kNotHeld), &status);
  EXPECT_EQ(bad.message(), "DP peer 0 routed row 2 to expert " + std::to_string(kNotHeld) +
                               ", which this rank does not hold");
  // An empty round answers too.
  ASSERT_TRUE(MappedRound(0, RoutedPairs(), &status).ok());
  EXPECT_EQ(status, 0);
}

// Offsets outside the region fail the round like any malformed dispatch, before anything
// is read; the server carries on.
TEST_F(ExpertRoutingCheckTest, MappedOffsetsOutsideTheRegionFailTheRound) {
  const RoutedPairs pairs = PairsWith(10, 20, -1, 0, 0);
  const std::function<void(WireHeader*, std::string*)> edits[] = {
      [](WireHeader* h, std::string*) { h->rows_at = int64_t{1} << 40; },
      [](WireHeader* h, std::string*) { h->answers_at += 1 << 20; },
      [](WireHeader* h, std::string*) { h->pairs_at += 2; },  // misaligned
      [](WireHeader* h, std::string*) { h->num_rows = 1 << 20; },
  };
  for (const auto& edit : edits) {
    int32_t status = -1;
    absl::Status s = MappedRound(10, pairs, &status, edit);
    EXPECT_EQ(s.code(), absl::StatusCode::kInternal) << s;
    EXPECT_NE(s.message().find("outside"), std::string::npos) << s;
    EXPECT_EQ(status, -1);
    ASSERT_TRUE(MappedRound(10, pairs, &status).ok());
    EXPECT_EQ(status, 0);
  }
}

// A region that does not map (here: a key naming none) is answered kRegionUnmappable and
// nothing of it is computed; the round itself completes.
TEST_F(ExpertRoutingCheckTest, UnmappableRegionIsAnsweredWithAStatus) {
  int32_t status = -1;
  experts_->last_pairs = PairsWith(3, 3, -1, 0, 0);
  ASSERT_TRUE(
      MappedRound(10, PairsWith(10, 20, -1, 0, 0), &status, [](WireHeader*, std::string* key) {
        (*key)[8] ^= 0x55;
      }).ok());
  EXPECT_EQ(status, kRegionUnmappable);
  EXPECT_EQ(experts_->last_pairs.size(), 0);  // the round computed no pair
  ASSERT_TRUE(MappedRound(10, PairsWith(10, 20, -1, 0, 0), &status).ok());
  EXPECT_EQ(status, 0);
}

// A DP rank asks for a low-latency step (the first of its generation, with its region's
// key); the CPU backend has no low-latency exchange, so the expert rank answers with no key
// (the DP ranks then run the step by the host-driven exchange) and serves the dispatches
// that follow.
TEST_F(ExpertRoutingCheckTest, LowLatencyStepOnTheCpuIsAnsweredWithNoKey) {
  ExpertShard shard(config_, ExpertWeightMap(), backend_.get());
  LowLatencyExpertSteps low_latency(transports_[1].get(), &shard, config_);
  server_->set_low_latency(&low_latency);
  const WireHeader h = LowLatencyStep();
  const std::string key = "the DP rank's region";
  ASSERT_TRUE(transports_[0]->Send(1, h.Encode(), key.data(), key.size()).ok());
  const absl::Status served = server_->ServeRound(absl::Now() + absl::Seconds(5));
  EXPECT_EQ(served.code(), absl::StatusCode::kUnimplemented) << served;
  absl::StatusOr<TransportMessage> answer = transports_[0]->Recv(1, absl::Now() + absl::Seconds(5));
  ASSERT_TRUE(answer.ok()) << answer.status();
  absl::StatusOr<WireHeader> a = WireHeader::Decode(answer->header);
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_EQ(a->kind, MessageKind::kLowLatencyRegion);
  EXPECT_EQ(a->ll_generation, h.ll_generation);
  EXPECT_EQ(a->step, h.step);
  EXPECT_EQ(answer->payload_size(), 0u);  // no exchange here
  EXPECT_EQ(low_latency.generation(), 0u);
  EXPECT_EQ(server_->counters().low_latency_steps.load(), 0);
  // The step goes by the host-driven exchange.
  const absl::Status round = Round(10, PairsWith(10, 12, -1, 0, 0));
  EXPECT_TRUE(round.ok()) << round;
  EXPECT_EQ(server_->counters().rounds.load(), 1);
}

// A later step of a generation this rank never made (it restarted, or it refused) fails
// without an answer: the DP ranks' waits time out and they make a new generation.
TEST_F(ExpertRoutingCheckTest, LowLatencyStepOfAnUnknownGenerationFails) {
  ExpertShard shard(config_, ExpertWeightMap(), backend_.get());
  LowLatencyExpertSteps low_latency(transports_[1].get(), &shard, config_);
  server_->set_low_latency(&low_latency);
  WireHeader h = LowLatencyStep();
  h.flags = 0;
  ASSERT_TRUE(transports_[0]->Send(1, h.Encode(), nullptr, 0).ok());
  const absl::Status served = server_->ServeRound(absl::Now() + absl::Seconds(5));
  EXPECT_EQ(served.code(), absl::StatusCode::kFailedPrecondition) << served;
  EXPECT_FALSE(transports_[0]->HasMessage(1));
}

// Low-latency messages the wire does not allow are refused as bad messages: one placed
// after a dispatch (layer >= 0), or a connecting one without its region's key.
TEST_F(ExpertRoutingCheckTest, MalformedLowLatencyStepsAreBadMessages) {
  WireHeader late = LowLatencyStep();
  late.layer = 0;
  const std::string key = "k";
  ASSERT_TRUE(transports_[0]->Send(1, late.Encode(), key.data(), key.size()).ok());
  absl::Status served = server_->ServeRound(absl::Now() + absl::Seconds(5));
  EXPECT_EQ(served.code(), absl::StatusCode::kInternal) << served;
  EXPECT_NE(served.message().find("bad message"), std::string::npos) << served;
  ASSERT_TRUE(transports_[0]->Send(1, LowLatencyStep().Encode(), nullptr, 0).ok());
  served = server_->ServeRound(absl::Now() + absl::Seconds(5));
  EXPECT_EQ(served.code(), absl::StatusCode::kInternal) << served;
  EXPECT_NE(served.message().find("bad payload"), std::string::npos) << served;
}

// The low-latency fields survive the wire, and flags it does not know are refused.
TEST(WireHeaderTest, LowLatencyFieldsRoundTrip) {
  WireHeader h;
  h.kind = MessageKind::kLowLatencyStep;
  h.step = 77;
  h.flags = WireHeader::kConnect;
  h.ll_generation = 3;
  h.ll_capacity = 128;
  h.ll_ranks = 4;
  h.ll_rank = 2;
  h.num_experts = 128;
  absl::StatusOr<WireHeader> back = WireHeader::Decode(h.Encode());
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->kind, h.kind);
  EXPECT_EQ(back->flags, h.flags);
  EXPECT_EQ(back->ll_generation, 3u);
  EXPECT_EQ(back->ll_capacity, 128);
  EXPECT_EQ(back->ll_ranks, 4);
  EXPECT_EQ(back->ll_rank, 2);
  EXPECT_EQ(back->num_experts, 128);
  std::string bad = h.Encode();
  bad[4] = 7;  // the kind after kStepAbandoned, the last
  EXPECT_FALSE(WireHeader::Decode(bad).ok());
}

TEST(WireHeaderTest, StepAbandonedRoundTrips) {
  WireHeader h;
  h.kind = MessageKind::kStepAbandoned;
  h.step = 1234567890123ull;
  absl::StatusOr<WireHeader> back = WireHeader::Decode(h.Encode());
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->kind, MessageKind::kStepAbandoned);
  EXPECT_EQ(back->step, h.step);
}

}  // namespace
}  // namespace dxs
