// ClusterRegistry: every refusal (code and a message naming the problem), version bumps,
// rank assignment, placement from claims (default blocks and uneven explicit ones), lease
// expiry and recovery by re-registration, drain and deregistration.
#include "router/control_plane/cluster_registry.h"

#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "router/control_plane/nccl_unique_id.h"

namespace dxs {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::IsEmpty;

constexpr char kCheckpoint[] = "0123456789abcdef";
constexpr char kConfig[] = "fedcba9876543210";

class FakeClock {
 public:
  absl::Time Now() const { return now_; }
  void Advance(absl::Duration d) { now_ += d; }

 private:
  absl::Time now_ = absl::FromUnixSeconds(1'000'000);
};

class ClusterRegistryTest : public ::testing::Test {
 protected:
  ClusterRegistryOptions Options(int m, int n, int e) {
    ClusterRegistryOptions o;
    o.num_attention_ranks = m;
    o.num_expert_ranks = n;
    o.num_experts = e;
    o.num_layers = 4;
    o.fingerprint.set_checkpoint_fingerprint(kCheckpoint);
    o.fingerprint.set_config_fingerprint(kConfig);
    o.now = [this] { return clock_.Now(); };
    return o;
  }

  static v1::RegisterRequest Request(v1::Role role, std::optional<uint32_t> rank,
                                     const std::string& address) {
    v1::RegisterRequest r;
    r.set_role(role);
    if (rank.has_value()) r.set_rank(*rank);
    r.set_grpc_address(address);
    r.mutable_transport()->set_ucx_worker_address(absl::StrCat("ucx:", address));
    r.mutable_fingerprint()->set_checkpoint_fingerprint(kCheckpoint);
    r.mutable_fingerprint()->set_config_fingerprint(kConfig);
    return r;
  }
  static v1::RegisterRequest Attention(uint32_t rank, const std::string& address) {
    return Request(v1::ROLE_ATTENTION, rank, address);
  }
  static v1::RegisterRequest Expert(uint32_t rank, const std::string& address,
                                    const std::vector<uint32_t>& experts = {}) {
    v1::RegisterRequest r = Request(v1::ROLE_EXPERT, rank, address);
    for (uint32_t e : experts) r.add_loaded_experts(e);
    return r;
  }
  static v1::WorkerId Id(v1::Role role, const v1::RegisterResponse& response) {
    v1::WorkerId id;
    id.set_role(role);
    id.set_rank(response.rank());
    id.set_incarnation(response.incarnation());
    return id;
  }
  static v1::HeartbeatRequest Beat(const v1::WorkerId& id,
                                   v1::WorkerState state = v1::WORKER_STATE_READY) {
    v1::HeartbeatRequest h;
    *h.mutable_worker() = id;
    h.set_state(state);
    return h;
  }
  // ep_ranks of every expert, -1 where unclaimed (one owner at most here).
  static std::vector<int> Owners(const v1::ExpertPlacement& p) {
    std::vector<int> owners;
    for (const v1::ExpertReplicas& r : p.expert_to_rank()) {
      owners.push_back(r.ep_ranks().empty() ? -1 : static_cast<int>(r.ep_ranks(0)));
    }
    return owners;
  }

  FakeClock clock_;
};

void ExpectRefused(const absl::StatusOr<v1::RegisterResponse>& r, absl::StatusCode code,
                   const std::string& text) {
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), code) << r.status();
  EXPECT_THAT(std::string(r.status().message()), HasSubstr(text));
}

TEST_F(ClusterRegistryTest, OptionsAreValidated) {
  ClusterRegistryOptions o = Options(1, 1, 4);
  EXPECT_TRUE(o.Validate().ok());
  o.num_expert_ranks = 0;
  EXPECT_THAT(std::string(o.Validate().message()), HasSubstr("num_expert_ranks"));
  o = Options(1, 1, 4);
  o.transport_backend = "carrier-pigeon";
  EXPECT_THAT(std::string(o.Validate().message()), HasSubstr("transport backend"));
  o = Options(1, 1, 4);
  o.lease_timeout = absl::Milliseconds(100);
  EXPECT_THAT(std::string(o.Validate().message()), HasSubstr("lease timeout"));
  o = Options(1, 1, 4);
  o.transport_backend = "nccl";  // without a source of communicator ids
  EXPECT_THAT(std::string(o.Validate().message()), HasSubstr("nccl_unique_id"));
}

TEST_F(ClusterRegistryTest, EmptyClusterIsVersionOne) {
  ClusterRegistry reg(Options(2, 2, 8));
  v1::ClusterView view = reg.View();
  EXPECT_EQ(view.version(), 1u);
  EXPECT_THAT(view.workers(), IsEmpty());
  EXPECT_EQ(view.num_attention_ranks(), 2u);
  EXPECT_EQ(view.num_expert_ranks(), 2u);
  EXPECT_EQ(view.fingerprint().checkpoint_fingerprint(), kCheckpoint);
  EXPECT_EQ(view.transport().backend(), "ucx");
  EXPECT_EQ(view.transport().wire_dtype(), v1::DTYPE_FLOAT32);
  EXPECT_EQ(view.placement().version(), 0u);
  EXPECT_EQ(view.placement().num_experts(), 8u);
  EXPECT_EQ(view.placement().num_layers(), 4u);
  EXPECT_EQ(view.placement().expert_to_rank_size(), 8);
  EXPECT_FALSE(reg.IsComplete());
}

TEST_F(ClusterRegistryTest, InvalidArgumentRefusals) {
  ClusterRegistry reg(Options(2, 2, 8));
  v1::RegisterRequest r = Attention(0, "a0:1");
  r.set_role(v1::ROLE_UNSPECIFIED);
  ExpectRefused(reg.Register(r), absl::StatusCode::kInvalidArgument, "role is required");

  r = Attention(0, "");
  ExpectRefused(reg.Register(r), absl::StatusCode::kInvalidArgument, "grpc_address is required");

  ExpectRefused(reg.Register(Attention(2, "a2:1")), absl::StatusCode::kInvalidArgument,
                "attention rank 2 is out of range");
  ExpectRefused(reg.Register(Expert(2, "e2:1")), absl::StatusCode::kInvalidArgument,
                "expert rank 2 is out of range");

  r = Attention(0, "a0:1");
  r.mutable_transport()->clear_ucx_worker_address();
  ExpectRefused(reg.Register(r), absl::StatusCode::kInvalidArgument, "ucx_worker_address");

  ExpectRefused(reg.Register(Expert(0, "e0:1", {3, 8})), absl::StatusCode::kInvalidArgument,
                "expert 8 is outside [0, 8)");
  ExpectRefused(reg.Register(Expert(0, "e0:1", {3, 3})), absl::StatusCode::kInvalidArgument,
                "expert 3 is listed twice");
  r = Attention(0, "a0:1");
  r.add_loaded_experts(1);
  ExpectRefused(reg.Register(r), absl::StatusCode::kInvalidArgument, "loaded_experts");

  // Nothing was accepted.
  EXPECT_EQ(reg.version(), 1u);
  EXPECT_EQ(reg.counters().refusals_total, 8u);
  EXPECT_EQ(reg.counters().registrations_total, 0u);
}

TEST_F(ClusterRegistryTest, OtherBackendsNeedTheirAddress) {
  ClusterRegistryOptions o = Options(1, 1, 2);
  o.transport_backend = "nccl";
  o.nccl_unique_id = [] { return std::string(kNcclUniqueIdBytes, 'x'); };
  ClusterRegistry nccl(o);
  ExpectRefused(nccl.Register(Attention(0, "a:1")), absl::StatusCode::kInvalidArgument,
                "transport.nccl is required");
  o.transport_backend = "inproc";
  ClusterRegistry inproc(o);
  v1::RegisterRequest r = Attention(0, "a:1");
  r.clear_transport();
  EXPECT_TRUE(inproc.Register(r).ok());
}

TEST_F(ClusterRegistryTest, DifferentCheckpointIsRefused) {
  ClusterRegistry reg(Options(1, 1, 4));
  v1::RegisterRequest r = Attention(0, "a0:1");
  r.mutable_fingerprint()->set_checkpoint_fingerprint("1111111111111111");
  absl::StatusOr<v1::RegisterResponse> refused = reg.Register(r);
  ExpectRefused(refused, absl::StatusCode::kFailedPrecondition, "different checkpoint");
  EXPECT_THAT(std::string(refused.status().message()),
              HasSubstr("worker has checkpoint 1111111111111111"));
  EXPECT_THAT(std::string(refused.status().message()),
              HasSubstr(absl::StrCat("cluster has checkpoint ", kCheckpoint)));

  r = Attention(0, "a0:1");
  r.clear_fingerprint();
  ExpectRefused(reg.Register(r), absl::StatusCode::kFailedPrecondition,
                "worker has checkpoint (none)");
}

TEST_F(ClusterRegistryTest, FirstRegistrationPinsAnUnsetFingerprint) {
  ClusterRegistryOptions o = Options(2, 1, 4);
  o.fingerprint.Clear();
  ClusterRegistry reg(o);
  v1::RegisterRequest first = Attention(0, "a0:1");
  first.mutable_fingerprint()->set_checkpoint_fingerprint("aaaaaaaaaaaaaaaa");
  ASSERT_TRUE(reg.Register(first).ok());
  EXPECT_EQ(reg.View().fingerprint().checkpoint_fingerprint(), "aaaaaaaaaaaaaaaa");
  ExpectRefused(reg.Register(Attention(1, "a1:1")), absl::StatusCode::kFailedPrecondition,
                "cluster has checkpoint aaaaaaaaaaaaaaaa");
}

TEST_F(ClusterRegistryTest, DuplicateRankIsRefusedButSameAddressReplaces) {
  ClusterRegistry reg(Options(2, 1, 4));
  absl::StatusOr<v1::RegisterResponse> first = reg.Register(Attention(1, "a:1"));
  ASSERT_TRUE(first.ok()) << first.status();
  EXPECT_EQ(first->rank(), 1u);

  ExpectRefused(reg.Register(Attention(1, "b:1")), absl::StatusCode::kAlreadyExists,
                "rank 1 is held by a live worker at a:1");

  // The same worker restarted on the same port: a new incarnation replaces the old one.
  absl::StatusOr<v1::RegisterResponse> again = reg.Register(Attention(1, "a:1"));
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(again->rank(), 1u);
  EXPECT_GT(again->incarnation(), first->incarnation());
  EXPECT_GT(again->cluster_view_version(), first->cluster_view_version());
  EXPECT_EQ(reg.Workers().size(), 1u);

  // The old incarnation is stale now.
  absl::StatusOr<v1::HeartbeatResponse> stale = reg.Heartbeat(Beat(Id(v1::ROLE_ATTENTION, *first)));
  EXPECT_EQ(stale.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(std::string(stale.status().message()), HasSubstr("stale"));
  EXPECT_TRUE(reg.Heartbeat(Beat(Id(v1::ROLE_ATTENTION, *again))).ok());
}

TEST_F(ClusterRegistryTest, OneLiveWorkerPerAddress) {
  ClusterRegistry reg(Options(2, 1, 4));
  ASSERT_TRUE(reg.Register(Attention(0, "a:1")).ok());
  ExpectRefused(reg.Register(Attention(1, "a:1")), absl::StatusCode::kAlreadyExists,
                "grpc_address a:1 is already registered by live attention rank 0");
}

TEST_F(ClusterRegistryTest, UnsetRankGetsLowestFreeOrItsOwn) {
  ClusterRegistry reg(Options(3, 1, 4));
  ASSERT_TRUE(reg.Register(Attention(1, "a1:1")).ok());
  absl::StatusOr<v1::RegisterResponse> r = reg.Register(Request(v1::ROLE_ATTENTION, {}, "x:1"));
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->rank(), 0u);
  r = reg.Register(Request(v1::ROLE_ATTENTION, {}, "y:1"));
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->rank(), 2u);
  // A known address gets its rank back.
  r = reg.Register(Request(v1::ROLE_ATTENTION, {}, "a1:1"));
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->rank(), 1u);
  ExpectRefused(reg.Register(Request(v1::ROLE_ATTENTION, {}, "z:1")),
                absl::StatusCode::kResourceExhausted, "no free attention rank: all 3");
}

TEST_F(ClusterRegistryTest, ResponseCarriesRankTransportAndTimers) {
  ClusterRegistryOptions o = Options(2, 2, 8);
  o.wire_dtype = v1::DTYPE_BFLOAT16;
  ClusterRegistry reg(o);
  absl::StatusOr<v1::RegisterResponse> r = reg.Register(Expert(1, "e1:1"));
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->rank(), 1u);
  EXPECT_EQ(r->incarnation(), 1u);
  EXPECT_EQ(r->cluster_view_version(), 2u);
  EXPECT_EQ(r->transport().backend(), "ucx");
  EXPECT_EQ(r->transport().wire_dtype(), v1::DTYPE_BFLOAT16);
  EXPECT_EQ(r->heartbeat_interval_ms(), 500u);
  EXPECT_EQ(r->lease_timeout_ms(), 3000u);
  // Default block of rank 1 of 2 over 8 experts; the rest unclaimed so far.
  EXPECT_EQ(r->placement().version(), 1u);
  EXPECT_THAT(Owners(r->placement()), ElementsAre(-1, -1, -1, -1, 1, 1, 1, 1));

  std::vector<v1::WorkerInfo> workers = reg.Workers();
  ASSERT_EQ(workers.size(), 1u);
  EXPECT_EQ(workers[0].transport_rank(), 3u);  // M + r
  EXPECT_EQ(workers[0].state(), v1::WORKER_STATE_JOINING);
  EXPECT_EQ(workers[0].transport().ucx_worker_address(), "ucx:e1:1");

  ASSERT_TRUE(reg.Register(Attention(1, "a1:1")).ok());
  workers = reg.Workers();
  ASSERT_EQ(workers.size(), 2u);  // ordered by (role, rank): attention first
  EXPECT_EQ(workers[0].role(), v1::ROLE_ATTENTION);
  EXPECT_EQ(workers[0].transport_rank(), 1u);
  EXPECT_EQ(workers[1].role(), v1::ROLE_EXPERT);
}

TEST_F(ClusterRegistryTest, EveryChangeBumpsTheVersion) {
  ClusterRegistry reg(Options(1, 1, 2));
  uint64_t v = reg.version();
  absl::StatusOr<v1::RegisterResponse> a = reg.Register(Attention(0, "a:1"));
  ASSERT_TRUE(a.ok());
  EXPECT_EQ(reg.version(), ++v);
  EXPECT_EQ(a->cluster_view_version(), v);

  // A heartbeat that changes the state bumps; one that does not, doesn't.
  ASSERT_TRUE(reg.Heartbeat(Beat(Id(v1::ROLE_ATTENTION, *a))).ok());
  EXPECT_EQ(reg.version(), ++v);
  absl::StatusOr<v1::HeartbeatResponse> hb = reg.Heartbeat(Beat(Id(v1::ROLE_ATTENTION, *a)));
  ASSERT_TRUE(hb.ok());
  EXPECT_EQ(hb->cluster_view_version(), v);
  EXPECT_EQ(reg.version(), v);

  v1::DrainRequest drain;
  *drain.mutable_worker() = Id(v1::ROLE_ATTENTION, *a);
  absl::StatusOr<v1::DrainResponse> d = reg.Drain(drain);
  ASSERT_TRUE(d.ok()) << d.status();
  EXPECT_EQ(d->cluster_view_version(), ++v);
  EXPECT_EQ(reg.Workers()[0].state(), v1::WORKER_STATE_DRAINING);
  // Draining sticks even if the worker still reports READY.
  ASSERT_TRUE(reg.Heartbeat(Beat(Id(v1::ROLE_ATTENTION, *a))).ok());
  EXPECT_EQ(reg.Workers()[0].state(), v1::WORKER_STATE_DRAINING);
  EXPECT_EQ(reg.version(), v);

  v1::DeregisterRequest dereg;
  *dereg.mutable_worker() = Id(v1::ROLE_ATTENTION, *a);
  absl::StatusOr<v1::DeregisterResponse> gone = reg.Deregister(dereg);
  ASSERT_TRUE(gone.ok()) << gone.status();
  EXPECT_EQ(gone->cluster_view_version(), ++v);
  EXPECT_THAT(reg.Workers(), IsEmpty());
  EXPECT_EQ(reg.Deregister(dereg).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(reg.version(), v);
}

TEST_F(ClusterRegistryTest, HeartbeatRecordsCountersAndRefusesUnknown) {
  ClusterRegistry reg(Options(1, 1, 2));
  absl::StatusOr<v1::RegisterResponse> a = reg.Register(Attention(0, "a:1"));
  ASSERT_TRUE(a.ok());
  v1::HeartbeatRequest hb = Beat(Id(v1::ROLE_ATTENTION, *a));
  hb.mutable_counters()->set_steps_total(10);
  hb.mutable_counters()->set_empty_steps_total(4);
  hb.mutable_load()->set_num_running_requests(3);
  ASSERT_TRUE(reg.Heartbeat(hb).ok());
  std::vector<WorkerStatus> statuses = reg.WorkerStatuses();
  ASSERT_EQ(statuses.size(), 1u);
  EXPECT_EQ(statuses[0].counters.steps_total(), 10u);
  EXPECT_EQ(statuses[0].counters.empty_steps_total(), 4u);
  EXPECT_EQ(statuses[0].load.num_running_requests(), 3u);
  EXPECT_EQ(statuses[0].info.state(), v1::WORKER_STATE_READY);

  v1::HeartbeatRequest unknown = Beat(Id(v1::ROLE_EXPERT, *a));
  absl::StatusOr<v1::HeartbeatResponse> r = reg.Heartbeat(unknown);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(std::string(r.status().message()), HasSubstr("expert rank 0 is not registered"));

  v1::HeartbeatRequest no_role = hb;
  no_role.mutable_worker()->set_role(v1::ROLE_UNSPECIFIED);
  EXPECT_EQ(reg.Heartbeat(no_role).status().code(), absl::StatusCode::kInvalidArgument);
  v1::HeartbeatRequest no_incarnation = hb;
  no_incarnation.mutable_worker()->set_incarnation(0);
  EXPECT_EQ(reg.Heartbeat(no_incarnation).status().code(), absl::StatusCode::kInvalidArgument);
  v1::HeartbeatRequest dead_state = hb;
  dead_state.set_state(v1::WORKER_STATE_DEAD);
  EXPECT_EQ(reg.Heartbeat(dead_state).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST_F(ClusterRegistryTest, OverlappingClaimIsRefused) {
  ClusterRegistry reg(Options(1, 3, 12));
  ASSERT_TRUE(reg.Register(Expert(0, "e0:1", {0, 1, 2, 3})).ok());
  absl::StatusOr<v1::RegisterResponse> r = reg.Register(Expert(1, "e1:1", {3, 4}));
  ExpectRefused(r, absl::StatusCode::kFailedPrecondition,
                "experts overlapping: expert 3 already held by EP rank 0");
  // An empty claim means the default block [4, 8) of rank 1 of 3: no overlap.
  r = reg.Register(Expert(1, "e1:1"));
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_THAT(Owners(r->placement()), ElementsAre(0, 0, 0, 0, 1, 1, 1, 1, -1, -1, -1, -1));
}

TEST_F(ClusterRegistryTest, MissingExpertsRefuseTheCompletingWorker) {
  ClusterRegistry reg(Options(1, 3, 12));
  ASSERT_TRUE(reg.Register(Expert(0, "e0:1", {0, 1, 2, 3})).ok());
  ASSERT_TRUE(reg.Register(Expert(1, "e1:1", {4, 5, 6, 7})).ok());
  absl::StatusOr<v1::RegisterResponse> r = reg.Register(Expert(2, "e2:1", {8, 9}));
  ExpectRefused(r, absl::StatusCode::kFailedPrecondition, "experts missing: 10-11");
  r = reg.Register(Expert(2, "e2:1", {8, 9, 10, 11}));
  ASSERT_TRUE(r.ok()) << r.status();
}

TEST_F(ClusterRegistryTest, UnevenPlacementCompletesTheCluster) {
  // 12 experts on 5 ranks: 0-3, 4-5, 6-8, 9, 10-11.
  ClusterRegistry reg(Options(2, 5, 12));
  const std::vector<std::vector<uint32_t>> claims = {
      {0, 1, 2, 3}, {4, 5}, {6, 7, 8}, {9}, {10, 11}};
  // Register out of order; the placement fills in as claims arrive.
  uint64_t placement_version = reg.View().placement().version();
  for (uint32_t rank : {3u, 0u, 4u, 2u}) {
    absl::StatusOr<v1::RegisterResponse> r =
        reg.Register(Expert(rank, absl::StrCat("e", rank, ":1"), claims[rank]));
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_GT(r->placement().version(), placement_version);
    placement_version = r->placement().version();
  }
  EXPECT_THAT(Owners(reg.View().placement()), ElementsAre(0, 0, 0, 0, -1, -1, 2, 2, 2, 3, 4, 4));
  ASSERT_TRUE(reg.Register(Attention(0, "a0:1")).ok());
  ASSERT_TRUE(reg.Register(Attention(1, "a1:1")).ok());
  EXPECT_FALSE(reg.IsComplete());
  // Attention registrations do not change the placement.
  EXPECT_EQ(reg.View().placement().version(), placement_version);

  absl::StatusOr<v1::RegisterResponse> last = reg.Register(Expert(1, "e1:1", claims[1]));
  ASSERT_TRUE(last.ok()) << last.status();
  EXPECT_TRUE(reg.IsComplete());
  v1::ClusterView view = reg.View();
  EXPECT_THAT(Owners(view.placement()), ElementsAre(0, 0, 0, 0, 1, 1, 2, 2, 2, 3, 4, 4));
  EXPECT_EQ(view.placement().num_expert_ranks(), 5u);
  ASSERT_EQ(view.workers_size(), 7);
  for (int i = 0; i < view.workers_size(); ++i) {
    EXPECT_EQ(view.workers(i).transport_rank(), static_cast<uint32_t>(i));
  }
}

// The nccl backend: every view carries the id of the communicator for its set of live
// workers; the id stands while the set does (state changes, heartbeats) and is new when a
// rank joins, dies or comes back. A failing source leaves the id empty until the next change.
TEST_F(ClusterRegistryTest, NcclViewsCarryAnIdPerSetOfLiveWorkers) {
  ClusterRegistryOptions o = Options(1, 2, 4);
  o.transport_backend = "nccl";
  int made = 0;
  bool fail = false;
  o.nccl_unique_id = [&]() -> absl::StatusOr<std::string> {
    if (fail) return absl::FailedPreconditionError("no NCCL here");
    std::string id = absl::StrCat("id-", ++made);
    id.resize(kNcclUniqueIdBytes, '\0');
    return id;
  };
  ClusterRegistry reg(o);
  EXPECT_TRUE(reg.View().transport().nccl_unique_id().empty());  // nobody yet
  auto nccl = [](v1::RegisterRequest r) {
    r.mutable_transport()->clear_ucx_worker_address();
    r.mutable_transport()->mutable_nccl()->set_hostname("node-0");
    return r;
  };
  auto id = [&] { return reg.View().transport().nccl_unique_id().substr(0, 4); };
  absl::StatusOr<v1::RegisterResponse> a = reg.Register(nccl(Attention(0, "a:1")));
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_EQ(reg.View().transport().nccl_unique_id().size(), kNcclUniqueIdBytes);
  EXPECT_EQ(id(), "id-1");
  EXPECT_EQ(a->transport().nccl_unique_id(), reg.View().transport().nccl_unique_id());
  absl::StatusOr<v1::RegisterResponse> e0 = reg.Register(nccl(Expert(0, "e0:1")));
  absl::StatusOr<v1::RegisterResponse> e1 = reg.Register(nccl(Expert(1, "e1:1")));
  ASSERT_TRUE(e0.ok() && e1.ok());
  EXPECT_EQ(id(), "id-3");
  // The same set: heartbeats moving workers to READY publish new views, not new ids.
  const uint64_t before = reg.version();
  for (const auto& [role, response] :
       {std::pair{v1::ROLE_ATTENTION, *a}, std::pair{v1::ROLE_EXPERT, *e0},
        std::pair{v1::ROLE_EXPERT, *e1}}) {
    ASSERT_TRUE(reg.Heartbeat(Beat(Id(role, response))).ok());
  }
  EXPECT_GT(reg.version(), before);
  EXPECT_EQ(id(), "id-3");
  EXPECT_EQ(made, 3);
  // Expert 1 dies: a new communicator without it.
  clock_.Advance(absl::Seconds(2));
  ASSERT_TRUE(reg.Heartbeat(Beat(Id(v1::ROLE_ATTENTION, *a))).ok());
  ASSERT_TRUE(reg.Heartbeat(Beat(Id(v1::ROLE_EXPERT, *e0))).ok());
  clock_.Advance(absl::Seconds(1) + absl::Milliseconds(1));
  ASSERT_EQ(reg.ExpireLeases(clock_.Now()).size(), 1u);
  EXPECT_EQ(id(), "id-4");
  // It comes back while NCCL fails in the router: no id, then one at the next change.
  fail = true;
  absl::StatusOr<v1::RegisterResponse> back = reg.Register(nccl(Expert(1, "e1:2")));
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_TRUE(reg.View().transport().nccl_unique_id().empty());
  fail = false;
  ASSERT_TRUE(reg.Heartbeat(Beat(Id(v1::ROLE_EXPERT, *back))).ok());
  EXPECT_EQ(id(), "id-5");
  // Other backends carry none.
  ClusterRegistry ucx(Options(1, 1, 4));
  ASSERT_TRUE(ucx.Register(Attention(0, "a:1")).ok());
  EXPECT_TRUE(ucx.View().transport().nccl_unique_id().empty());
}

// The router's real source: NCCL's ncclGetUniqueId, loaded at run time; it needs no GPU.
TEST(NcclUniqueId, NcclMakesDistinctIdsWithoutAGpu) {
  if (absl::Status s = CheckNcclLoads(); !s.ok()) {
    EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
    EXPECT_THAT(std::string(s.message()), HasSubstr("DXS_NCCL_LIBRARY"));
    GTEST_SKIP() << "no NCCL on this machine: " << s.message();
  }
  absl::StatusOr<std::string> first = NewNcclUniqueId();
  absl::StatusOr<std::string> second = NewNcclUniqueId();
  ASSERT_TRUE(first.ok()) << first.status();
  ASSERT_TRUE(second.ok()) << second.status();
  EXPECT_EQ(first->size(), kNcclUniqueIdBytes);
  EXPECT_NE(*first, *second);
  EXPECT_NE(*first, std::string(kNcclUniqueIdBytes, '\0'));
}

TEST_F(ClusterRegistryTest, LeaseExpiryAndRecovery) {
  ClusterRegistry reg(Options(1, 2, 4));
  absl::StatusOr<v1::RegisterResponse> a = reg.Register(Attention(0, "a:1"));
  absl::StatusOr<v1::RegisterResponse> e0 = reg.Register(Expert(0, "e0:1"));
  absl::StatusOr<v1::RegisterResponse> e1 = reg.Register(Expert(1, "e1:1"));
  ASSERT_TRUE(a.ok() && e0.ok() && e1.ok());
  ASSERT_TRUE(reg.IsComplete());

  // Everyone but expert 1 keeps heartbeating past the lease.
  clock_.Advance(absl::Seconds(2));
  ASSERT_TRUE(reg.Heartbeat(Beat(Id(v1::ROLE_ATTENTION, *a))).ok());
  ASSERT_TRUE(reg.Heartbeat(Beat(Id(v1::ROLE_EXPERT, *e0))).ok());
  EXPECT_THAT(reg.ExpireLeases(clock_.Now()), IsEmpty());
  clock_.Advance(absl::Seconds(1) + absl::Milliseconds(1));
  const uint64_t before = reg.version();
  const uint64_t placement_before = reg.View().placement().version();
  std::vector<v1::WorkerInfo> expired = reg.ExpireLeases(clock_.Now());
  ASSERT_EQ(expired.size(), 1u);
  EXPECT_EQ(expired[0].role(), v1::ROLE_EXPERT);
  EXPECT_EQ(expired[0].rank(), 1u);
  EXPECT_EQ(expired[0].state(), v1::WORKER_STATE_DEAD);
  EXPECT_EQ(reg.counters().expirations_total, 1u);

  // DEAD stays in the view; its experts are released; the cluster is incomplete.
  v1::ClusterView view = reg.View();
  EXPECT_EQ(view.version(), before + 1);
  EXPECT_GT(view.placement().version(), placement_before);
  ASSERT_EQ(view.workers_size(), 3);
  EXPECT_EQ(view.workers(2).state(), v1::WORKER_STATE_DEAD);
  EXPECT_THAT(Owners(view.placement()), ElementsAre(0, 0, -1, -1));
  EXPECT_FALSE(reg.IsComplete());

  // The dead worker's calls are refused: it must register again.
  absl::StatusOr<v1::HeartbeatResponse> hb = reg.Heartbeat(Beat(Id(v1::ROLE_EXPERT, *e1)));
  EXPECT_EQ(hb.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(std::string(hb.status().message()), HasSubstr("lease expired"));

  // It comes back (here on another address: a rescheduled pod) and serving resumes; the
  // surviving workers keep their incarnations.
  absl::StatusOr<v1::RegisterResponse> back = reg.Register(Expert(1, "e1-new:1"));
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_GT(back->incarnation(), e1->incarnation());
  EXPECT_TRUE(reg.IsComplete());
  view = reg.View();
  EXPECT_THAT(Owners(view.placement()), ElementsAre(0, 0, 1, 1));
  EXPECT_EQ(view.workers(0).incarnation(), a->incarnation());
  EXPECT_EQ(view.workers(1).incarnation(), e0->incarnation());
  EXPECT_EQ(view.workers(2).state(), v1::WORKER_STATE_JOINING);
  EXPECT_EQ(view.workers(2).grpc_address(), "e1-new:1");
  EXPECT_TRUE(reg.Heartbeat(Beat(Id(v1::ROLE_EXPERT, *back))).ok());
}

TEST_F(ClusterRegistryTest, ExpiredWorkerCanBeDeregistered) {
  ClusterRegistry reg(Options(1, 1, 2));
  absl::StatusOr<v1::RegisterResponse> a = reg.Register(Attention(0, "a:1"));
  ASSERT_TRUE(a.ok());
  clock_.Advance(absl::Seconds(4));
  ASSERT_EQ(reg.ExpireLeases(clock_.Now()).size(), 1u);
  v1::DeregisterRequest dereg;
  *dereg.mutable_worker() = Id(v1::ROLE_ATTENTION, *a);
  EXPECT_TRUE(reg.Deregister(dereg).ok());
  EXPECT_THAT(reg.Workers(), IsEmpty());
}

// Elastic EP: a new expert rank joins with the next rank number once the cluster has
// started; any other number beyond the cluster is refused, saying which one would do.
TEST_F(ClusterRegistryTest, ElasticExpertRankJoinsWithTheNextNumber) {
  ClusterRegistryOptions o = Options(1, 2, 4);
  o.elastic_ep = true;
  ClusterRegistry reg(o);
  ASSERT_TRUE(reg.Register(Attention(0, "a0:1")).ok());
  ASSERT_TRUE(reg.Register(Expert(0, "e0:1")).ok());
  // Not started yet (rank 1 never was live): nobody joins.
  ExpectRefused(reg.Register(Expert(2, "e2:1")), absl::StatusCode::kFailedPrecondition,
                "cannot join yet");
  ASSERT_TRUE(reg.Register(Expert(1, "e1:1")).ok());
  ASSERT_TRUE(reg.started());
  const uint64_t placement_version = reg.View().placement().version();
  ExpectRefused(reg.Register(Expert(3, "e3:1")), absl::StatusCode::kFailedPrecondition,
                "the next one to join is rank 2");
  ExpectRefused(reg.Register(Expert(2, "e0:1")), absl::StatusCode::kAlreadyExists,
                "already registered");
  EXPECT_EQ(reg.num_expert_ranks(), 2);  // refusals change nothing

  absl::StatusOr<v1::RegisterResponse> joined = reg.Register(Expert(2, "e2:1"));
  ASSERT_TRUE(joined.ok()) << joined.status();
  EXPECT_EQ(joined->rank(), 2u);
  EXPECT_EQ(reg.num_expert_ranks(), 3);
  const v1::ClusterView view = reg.View();
  EXPECT_EQ(view.num_expert_ranks(), 3u);
  EXPECT_EQ(view.placement().num_expert_ranks(), 3u);
  // It holds nothing until the Rebalancer gives it experts: the map is unchanged.
  EXPECT_EQ(view.placement().version(), placement_version);
  EXPECT_THAT(Owners(view.placement()), ElementsAre(0, 0, 1, 1));
  EXPECT_EQ(view.workers(view.workers_size() - 1).transport_rank(), 1u + 2u);
  EXPECT_TRUE(reg.IsComplete());

  // An unset rank with every rank live joins as the next one.
  absl::StatusOr<v1::RegisterResponse> unset =
      reg.Register(Request(v1::ROLE_EXPERT, std::nullopt, "e3:1"));
  ASSERT_TRUE(unset.ok()) << unset.status();
  EXPECT_EQ(unset->rank(), 3u);

  // The new ranks take experts from a placement over all four.
  absl::StatusOr<Placement> four = Placement::FromExpertRanks(4, {{0}, {1}, {2}, {3}}, 9);
  ASSERT_TRUE(four.ok());
  absl::StatusOr<v1::ClusterView> published = reg.SetPlacement(*four);
  ASSERT_TRUE(published.ok()) << published.status();
  EXPECT_THAT(Owners(published->placement()), ElementsAre(0, 1, 2, 3));
  // One computed before rank 3 joined leaves it empty; one over more ranks is refused.
  ASSERT_TRUE(reg.SetPlacement(*Placement::FromExpertRanks(3, {{0}, {1}, {2}, {2}}, 10)).ok());
  EXPECT_THAT(Owners(reg.View().placement()), ElementsAre(0, 1, 2, 2));
  EXPECT_EQ(
      reg.SetPlacement(*Placement::FromExpertRanks(5, {{0}, {1}, {2}, {4}}, 11)).status().code(),
      absl::StatusCode::kInvalidArgument);

  // A joined rank that deregisters leaves its number free; the count stays.
  ASSERT_TRUE(reg.Deregister([&] {
                   v1::DeregisterRequest d;
                   *d.mutable_worker() = Id(v1::ROLE_EXPERT, *unset);
                   return d;
                 }())
                  .ok());
  EXPECT_EQ(reg.num_expert_ranks(), 4);
  absl::StatusOr<v1::RegisterResponse> again = reg.Register(Expert(3, "e3:2"));
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(again->rank(), 3u);
}

TEST_F(ClusterRegistryTest, ExpertRanksBeyondTheClusterNeedElasticEp) {
  ClusterRegistry reg(Options(1, 1, 4));
  ASSERT_TRUE(reg.Register(Attention(0, "a0:1")).ok());
  ASSERT_TRUE(reg.Register(Expert(0, "e0:1")).ok());
  ExpectRefused(reg.Register(Expert(1, "e1:1")), absl::StatusCode::kInvalidArgument,
                "new expert ranks join only with dxs-router --elastic-ep");
  ExpectRefused(reg.Register(Request(v1::ROLE_EXPERT, std::nullopt, "e1:1")),
                absl::StatusCode::kResourceExhausted, "no free expert rank");
}

TEST_F(ClusterRegistryTest, DrainRules) {
  ClusterRegistry reg(Options(1, 3, 2));
  absl::StatusOr<v1::RegisterResponse> e0 = reg.Register(Expert(0, "e0:1", {0}));
  ASSERT_TRUE(e0.ok());
  v1::DrainRequest drain;
  *drain.mutable_worker() = Id(v1::ROLE_EXPERT, *e0);
  absl::StatusOr<v1::DrainResponse> d = reg.Drain(drain);
  EXPECT_EQ(d.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(d.status().message()), HasSubstr("no other replica"));

  // Rank 0 of 3 over 2 experts has an empty default block: nothing to lose by draining.
  absl::StatusOr<v1::RegisterResponse> empty = reg.Register(Expert(0, "e0:1", {}));
  ASSERT_TRUE(empty.ok());
  EXPECT_THAT(Owners(empty->placement()), ElementsAre(-1, -1));
  drain.mutable_worker()->set_incarnation(0);  // operator tools: any incarnation
  EXPECT_TRUE(reg.Drain(drain).ok());

  drain.mutable_worker()->set_rank(2);
  EXPECT_EQ(reg.Drain(drain).status().code(), absl::StatusCode::kNotFound);
}

TEST_F(ClusterRegistryTest, WaitForVersionWakesOnChangeAndShutdown) {
  ClusterRegistry reg(Options(1, 1, 2));
  EXPECT_EQ(reg.WaitForVersion(0, absl::ZeroDuration())->version(), 1u);
  EXPECT_FALSE(reg.WaitForVersion(1, absl::Milliseconds(10)).has_value());

  std::optional<v1::ClusterView> seen;
  std::thread waiter([&] { seen = reg.WaitForVersion(1, absl::Seconds(10)); });
  ASSERT_TRUE(reg.Register(Attention(0, "a:1")).ok());
  waiter.join();
  ASSERT_TRUE(seen.has_value());
  EXPECT_EQ(seen->version(), 2u);

  absl::Time start = absl::Now();
  std::thread blocked([&] { seen = reg.WaitForVersion(2, absl::Seconds(10)); });
  absl::SleepFor(absl::Milliseconds(20));
  reg.Shutdown();
  blocked.join();
  EXPECT_FALSE(seen.has_value());
  EXPECT_LT(absl::Now() - start, absl::Seconds(5));
  EXPECT_TRUE(reg.IsShutDown());
  ExpectRefused(reg.Register(Attention(0, "a:1")), absl::StatusCode::kUnavailable, "shutting down");
}

}  // namespace
}  // namespace dxs
