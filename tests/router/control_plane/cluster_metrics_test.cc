// ClusterMetrics over a real ClusterRegistry with a fake clock: heartbeat counters are
// mirrored (and keep growing across a worker restart, from what a re-registering worker
// registers with), the empty-ranks gauge follows the window from each registration, EP token
// imbalance is max / mean over the window, workers are counted by state.
#include "router/control_plane/cluster_metrics.h"

#include <map>
#include <sstream>
#include <string>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "prometheus/text_serializer.h"

namespace dxs {
namespace {

constexpr char kCheckpoint[] = "0123456789abcdef";
constexpr char kConfig[] = "fedcba9876543210";

// What a scrape returns, in the text format.
std::string Scrape(const ClusterMetrics& metrics) {
  return prometheus::TextSerializer().Serialize(metrics.Collect());
}

// Sample lines of an exposition keyed by series as written.
std::map<std::string, double> Samples(const ClusterMetrics& metrics) {
  std::map<std::string, double> out;
  std::istringstream in(Scrape(metrics));
  for (std::string line; std::getline(in, line);) {
    if (line.empty() || line[0] == '#') continue;
    const size_t space = line.rfind(' ');
    out[line.substr(0, space)] = std::stod(line.substr(space + 1));
  }
  return out;
}

class ClusterMetricsTest : public ::testing::Test {
 protected:
  explicit ClusterMetricsTest(bool elastic_ep = false) : cluster_(Options(elastic_ep)) {
    ClusterMetricsOptions options;
    options.window = absl::Seconds(5);
    options.interval = absl::Seconds(1);
    options.now = [this] { return now_; };
    metrics_ = ClusterMetrics::Create(&cluster_, options).value();
  }

  ClusterRegistryOptions Options(bool elastic_ep) {
    ClusterRegistryOptions o;
    o.elastic_ep = elastic_ep;
    o.num_attention_ranks = 2;
    o.num_expert_ranks = 2;
    o.num_experts = 4;
    o.fingerprint.set_checkpoint_fingerprint(kCheckpoint);
    o.fingerprint.set_config_fingerprint(kConfig);
    o.lease_timeout = absl::Seconds(30);
    o.now = [this] { return now_; };
    return o;
  }

  // Registers (role, rank) from `address`; returns its id.
  v1::WorkerId Register(v1::Role role, uint32_t rank, const std::string& address) {
    v1::RegisterRequest r;
    r.set_role(role);
    r.set_rank(rank);
    r.set_grpc_address(address);
    r.mutable_transport()->set_ucx_worker_address("ucx:" + address);
    r.mutable_fingerprint()->set_checkpoint_fingerprint(kCheckpoint);
    r.mutable_fingerprint()->set_config_fingerprint(kConfig);
    absl::StatusOr<v1::RegisterResponse> response = cluster_.Register(r);
    EXPECT_TRUE(response.ok()) << response.status();
    v1::WorkerId id;
    id.set_role(role);
    id.set_rank(rank);
    id.set_incarnation(response->incarnation());
    return id;
  }

  void Beat(const v1::WorkerId& id, uint64_t steps, uint64_t empty, uint64_t tokens) {
    v1::HeartbeatRequest h;
    *h.mutable_worker() = id;
    h.set_state(v1::WORKER_STATE_READY);
    h.mutable_counters()->set_steps_total(steps);
    h.mutable_counters()->set_empty_steps_total(empty);
    h.mutable_counters()->set_tokens_total(tokens);
    ASSERT_TRUE(cluster_.Heartbeat(h).ok());
  }

  // Advances the clock by one second and samples.
  std::map<std::string, double> Tick() {
    now_ += absl::Seconds(1);
    metrics_->Sample(now_);
    return Samples(*metrics_);
  }

  absl::Time now_ = absl::FromUnixSeconds(1'000'000);
  ClusterRegistry cluster_;
  std::shared_ptr<ClusterMetrics> metrics_;
};

TEST_F(ClusterMetricsTest, MirrorsHeartbeatsAndFindsEmptyRanksInTheWindow) {
  const v1::WorkerId a0 = Register(v1::ROLE_ATTENTION, 0, "a0:1");
  const v1::WorkerId a1 = Register(v1::ROLE_ATTENTION, 1, "a1:1");
  const v1::WorkerId e0 = Register(v1::ROLE_EXPERT, 0, "e0:1");
  const v1::WorkerId e1 = Register(v1::ROLE_EXPERT, 1, "e1:1");
  std::map<std::string, double> s = Tick();
  EXPECT_EQ(s[R"(dxs_workers{role="attention",state="joining"})"], 2);
  EXPECT_EQ(s[R"(dxs_workers{role="expert",state="joining"})"], 2);
  EXPECT_EQ(s["dxs_cluster_view_version"], cluster_.version());
  EXPECT_EQ(s["dxs_ep_token_imbalance"], 1);  // no traffic yet

  // DP rank 1 runs empty steps while rank 0 works; EP rank 0 gets 3x EP rank 1's rows.
  Beat(a0, 10, 0, 40);
  Beat(a1, 10, 10, 0);
  Beat(e0, 10, 0, 300);
  Beat(e1, 10, 0, 100);
  s = Tick();
  EXPECT_EQ(s[R"(dxs_workers{role="attention",state="ready"})"], 2);
  EXPECT_EQ(s[R"(dxs_cluster_empty_batch_steps_total{role="attention",rank="1"})"], 10);
  EXPECT_EQ(s[R"(dxs_cluster_empty_batch_steps_total{role="attention",rank="0"})"], 0);
  EXPECT_EQ(s[R"(dxs_cluster_steps_total{role="expert",rank="0"})"], 10);
  EXPECT_EQ(s[R"(dxs_cluster_tokens_total{role="expert",rank="0"})"], 300);
  EXPECT_EQ(s[R"(dxs_cluster_empty_ranks{role="attention"})"], 1);
  EXPECT_EQ(s[R"(dxs_cluster_empty_ranks{role="expert"})"], 0);
  EXPECT_DOUBLE_EQ(s["dxs_ep_token_imbalance"], 300.0 / 200.0);

  // Nothing moves: after the window (5 s) no rank counts as empty, imbalance back to 1.
  for (int i = 0; i < 4; ++i) s = Tick();
  EXPECT_EQ(s[R"(dxs_cluster_empty_ranks{role="attention"})"], 1);  // 5 s: still in
  s = Tick();
  EXPECT_EQ(s[R"(dxs_cluster_empty_ranks{role="attention"})"], 0);
  EXPECT_EQ(s["dxs_ep_token_imbalance"], 1);
  EXPECT_EQ(s[R"(dxs_cluster_empty_batch_steps_total{role="attention",rank="1"})"], 10);

  // DP rank 1 restarts (same address, new incarnation): its counters start again at 0, and
  // the mirrored counter keeps growing from 10.
  const v1::WorkerId a1b = Register(v1::ROLE_ATTENTION, 1, "a1:1");
  ASSERT_NE(a1b.incarnation(), a1.incarnation());
  Beat(a1b, 4, 3, 0);
  s = Tick();
  EXPECT_EQ(s[R"(dxs_cluster_empty_batch_steps_total{role="attention",rank="1"})"], 13);
  EXPECT_EQ(s[R"(dxs_cluster_steps_total{role="attention",rank="1"})"], 14);
  // A new incarnation's window starts at its registration, with the counters it registered
  // with (0 for a new process): the empty steps it took before the first sample here count.
  // (Taking the first report as the baseline missed a rank whose empty steps all came
  // between its registration and the first sample: metrics_test's flake.)
  EXPECT_EQ(s[R"(dxs_cluster_empty_ranks{role="attention"})"], 1);
  Beat(a1b, 6, 5, 0);
  s = Tick();
  EXPECT_EQ(s[R"(dxs_cluster_empty_batch_steps_total{role="attention",rank="1"})"], 15);
  EXPECT_EQ(s[R"(dxs_cluster_empty_ranks{role="attention"})"], 1);

  // The same process registers again (its lease lost) with its totals: the mirrored
  // counters go on from them, not from 0 (no count twice), and its window starts there.
  for (int i = 0; i < 6; ++i) s = Tick();
  EXPECT_EQ(s[R"(dxs_cluster_empty_ranks{role="attention"})"], 0);
  v1::RegisterRequest again;
  again.set_role(v1::ROLE_ATTENTION);
  again.set_rank(1);
  again.set_grpc_address("a1:1");
  again.mutable_transport()->set_ucx_worker_address("ucx:a1:1");
  again.mutable_fingerprint()->set_checkpoint_fingerprint(kCheckpoint);
  again.mutable_fingerprint()->set_config_fingerprint(kConfig);
  again.mutable_counters()->set_steps_total(6);
  again.mutable_counters()->set_empty_steps_total(5);
  absl::StatusOr<v1::RegisterResponse> registered = cluster_.Register(again);
  ASSERT_TRUE(registered.ok()) << registered.status();
  v1::WorkerId a1c = a1b;
  a1c.set_incarnation(registered->incarnation());
  s = Tick();
  EXPECT_EQ(s[R"(dxs_cluster_empty_batch_steps_total{role="attention",rank="1"})"], 15);
  EXPECT_EQ(s[R"(dxs_cluster_empty_ranks{role="attention"})"], 0);
  Beat(a1c, 8, 6, 0);
  s = Tick();
  EXPECT_EQ(s[R"(dxs_cluster_empty_batch_steps_total{role="attention",rank="1"})"], 16);
  EXPECT_EQ(s[R"(dxs_cluster_steps_total{role="attention",rank="1"})"], 18);  // 10 + 6 + 2
  EXPECT_EQ(s[R"(dxs_cluster_empty_ranks{role="attention"})"], 1);

  const std::string text = Scrape(*metrics_);
  EXPECT_NE(text.find("# TYPE dxs_cluster_empty_batch_steps_total counter"), std::string::npos);
  EXPECT_NE(text.find("# TYPE dxs_cluster_empty_ranks gauge"), std::string::npos);
}

// A scrape samples the registry itself: what it shows is as of the scrape, whether or not
// anything sampled in between.
TEST_F(ClusterMetricsTest, AScrapeShowsTheRegistryAsOfTheScrape) {
  const v1::WorkerId a0 = Register(v1::ROLE_ATTENTION, 0, "a0:1");
  std::map<std::string, double> s = Samples(*metrics_);
  EXPECT_EQ(s[R"(dxs_workers{role="attention",state="joining"})"], 1);
  EXPECT_EQ(s["dxs_cluster_view_version"], cluster_.version());
  Beat(a0, 5, 2, 9);
  s = Samples(*metrics_);
  EXPECT_EQ(s[R"(dxs_workers{role="attention",state="ready"})"], 1);
  EXPECT_EQ(s[R"(dxs_workers{role="attention",state="joining"})"], 0);
  EXPECT_EQ(s[R"(dxs_cluster_steps_total{role="attention",rank="0"})"], 5);
  EXPECT_EQ(s["dxs_cluster_view_version"], cluster_.version());
}

TEST_F(ClusterMetricsTest, BackgroundSamplingStartsAndStops) {
  Register(v1::ROLE_ATTENTION, 0, "a0:1");
  metrics_->Start();
  metrics_->Start();  // once only
  for (int i = 0; i < 200; ++i) {
    if (Samples(*metrics_)[R"(dxs_workers{role="attention",state="joining"})"] == 1) break;
    absl::SleepFor(absl::Milliseconds(10));
  }
  EXPECT_EQ(Samples(*metrics_)[R"(dxs_workers{role="attention",state="joining"})"], 1);
  metrics_->Stop();
  metrics_->Stop();  // idempotent
}

class ElasticClusterMetricsTest : public ClusterMetricsTest {
 protected:
  ElasticClusterMetricsTest() : ClusterMetricsTest(/*elastic_ep=*/true) {}
};

// The balance is over the EP ranks that take part in steps. A dead rank, a restarted one
// that came back empty and a rank that joined and holds nothing yet receive no rows by
// design; counting them as ranks with 0 tokens read a perfectly even cluster as 3x
// imbalanced.
TEST_F(ElasticClusterMetricsTest, BalanceIsOverLiveRanksHoldingExperts) {
  const v1::WorkerId a0 = Register(v1::ROLE_ATTENTION, 0, "a0:1");
  Register(v1::ROLE_ATTENTION, 1, "a1:1");
  const v1::WorkerId e0 = Register(v1::ROLE_EXPERT, 0, "e0:1");
  const v1::WorkerId e1 = Register(v1::ROLE_EXPERT, 1, "e1:1");
  ASSERT_TRUE(cluster_.started());
  // EP rank 1 dies and comes back empty (elastic EP); rank 2 joins, empty too.
  ASSERT_TRUE(cluster_.MarkDead(e1).ok());
  const v1::WorkerId e1b = Register(v1::ROLE_EXPERT, 1, "e1:2");
  const v1::WorkerId e2 = Register(v1::ROLE_EXPERT, 2, "e2:1");
  ASSERT_EQ(cluster_.num_expert_ranks(), 3);
  std::map<std::string, double> s = Tick();  // the window's first point: no rows yet
  Beat(a0, 10, 0, 40);
  Beat(e0, 10, 0, 100);
  Beat(e1b, 10, 10, 0);
  Beat(e2, 10, 10, 0);
  s = Tick();
  EXPECT_DOUBLE_EQ(s["dxs_ep_token_imbalance"], 1.0);  // was 3: 100 * 3 ranks / 100
  EXPECT_DOUBLE_EQ(s["dxs_cluster_ep_balance_ratio"], 1.0);
  EXPECT_EQ(s[R"(dxs_placement_experts{rank="0"})"], 2);
  EXPECT_EQ(s[R"(dxs_placement_experts{rank="2"})"], 0);  // the joined rank is listed

  // Rank 1 is given experts 2 and 3 and takes 300 rows: the ratio is over ranks 0 and 1.
  ASSERT_TRUE(cluster_.SetPlacement(*Placement::FromExpertRanks(3, {{0}, {0}, {1}, {1}}, 10)).ok());
  Beat(e0, 20, 0, 200);
  Beat(e1b, 20, 10, 300);
  Beat(e2, 20, 20, 0);
  s = Tick();
  // Within the window rank 0 took 200 rows and rank 1 300: max 300 over mean 250.
  EXPECT_DOUBLE_EQ(s["dxs_ep_token_imbalance"], 300.0 / 250.0);
  EXPECT_DOUBLE_EQ(s["dxs_cluster_ep_balance_ratio"], 250.0 / 300.0);
  EXPECT_EQ(s[R"(dxs_placement_experts{rank="1"})"], 2);
}

TEST(ClusterMetricsOptionsTest, RefusesANonPositiveWindowOrInterval) {
  ClusterRegistryOptions o;
  ClusterRegistry cluster(o);
  EXPECT_FALSE(ClusterMetrics::Create(&cluster, {absl::ZeroDuration(), absl::Seconds(1)}).ok());
  EXPECT_FALSE(ClusterMetrics::Create(&cluster, {absl::Seconds(1), absl::ZeroDuration()}).ok());
}

}  // namespace
}  // namespace dxs
