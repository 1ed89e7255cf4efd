// The workers' --transport (worker/worker_transport.h): the flag's check, the members of a
// view's NCCL communicator, and the transports it makes. The nccl transport comes from
// its plugin (libdxs_nccl.so beside the binaries): without a GPU that is a clear
// FAILED_PRECONDITION; with one, a one-rank communicator over a sparse transport rank
// (two ranks need two GPUs: NCCL refuses two ranks of one communicator on one GPU).
#include "worker/worker_transport.h"

#include <cstdlib>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "router/control_plane/nccl_unique_id.h"

namespace dxs {
namespace {

v1::WorkerInfo Worker(v1::Role role, int rank, int transport_rank, v1::WorkerState state) {
  v1::WorkerInfo w;
  w.set_role(role);
  w.set_rank(static_cast<uint32_t>(rank));
  w.set_transport_rank(static_cast<uint32_t>(transport_rank));
  w.set_state(state);
  return w;
}

TEST(WorkerTransport, FlagChecks) {
  EXPECT_TRUE(ValidateWorkerTransport("ucx", "cpu").ok());
  EXPECT_TRUE(ValidateWorkerTransport("ucx", "cuda:3").ok());
  EXPECT_TRUE(ValidateWorkerTransport("nccl", "cuda").ok());
  EXPECT_TRUE(ValidateWorkerTransport("nccl", "cuda:1").ok());
  for (const auto& [transport, device, message] :
       std::vector<std::tuple<std::string, std::string, std::string>>{
           {"nccl", "cpu", "it needs --device cuda or cuda:N, not --device cpu"},
           {"tcp", "cuda", "--transport must be ucx or nccl, got 'tcp'"},
           {"", "cpu", "--transport must be ucx or nccl, got ''"},
           {"nccl", "gpu", "expected cpu, cuda or cuda:N"}}) {
    const absl::Status s = ValidateWorkerTransport(transport, device);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << transport << " " << device;
    EXPECT_NE(s.message().find(message), std::string::npos) << s;
  }
}

TEST(WorkerTransport, NcclMembersAreTheLiveTransportRanksAscending) {
  v1::ClusterView view;
  *view.add_workers() = Worker(v1::ROLE_EXPERT, 1, 4, v1::WORKER_STATE_READY);
  *view.add_workers() = Worker(v1::ROLE_ATTENTION, 0, 0, v1::WORKER_STATE_READY);
  *view.add_workers() = Worker(v1::ROLE_ATTENTION, 1, 1, v1::WORKER_STATE_DEAD);
  *view.add_workers() = Worker(v1::ROLE_EXPERT, 0, 3, v1::WORKER_STATE_JOINING);
  *view.add_workers() = Worker(v1::ROLE_EXPERT, 2, 5, v1::WORKER_STATE_DRAINING);
  // The dead attention rank leaves a gap: communicator ranks 0, 1, 2, 3 are transport
  // ranks 0, 3, 4, 5.
  EXPECT_EQ(NcclMembers(view), (std::vector<int>{0, 3, 4, 5}));
  EXPECT_TRUE(NcclMembers(v1::ClusterView()).empty());
}

TEST(WorkerTransport, UcxIsTheDefaultsTransport) {
  absl::StatusOr<WorkerTransport> t = MakeWorkerTransport("ucx", "cpu");
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_EQ(t->transport->name(), "ucx");
  EXPECT_EQ(t->nccl, nullptr);
  EXPECT_EQ(MakeWorkerTransport("nccl", "cpu").status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(WorkerTransport, AMissingNcclPluginNamesThePath) {
  setenv("DXS_NCCL_PLUGIN", "/no/such/dir/libdxs_nccl.so", 1);
  absl::StatusOr<WorkerTransport> t = MakeWorkerTransport("nccl", "cuda");
  unsetenv("DXS_NCCL_PLUGIN");
  ASSERT_FALSE(t.ok());
  EXPECT_EQ(t.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(t.status().message().find("--transport nccl"), std::string::npos) << t.status();
  EXPECT_NE(t.status().message().find("/no/such/dir/libdxs_nccl.so"), std::string::npos)
      << t.status();
}

// The plugin built beside this test: without a GPU (CI) a clear error and no crash; with
// one, the nccl transport over ucx, its communicator over one sparse transport rank.
TEST(WorkerTransport, NcclFromItsPluginOrAClearError) {
  absl::StatusOr<WorkerTransport> t = MakeWorkerTransport("nccl", "cuda");
  if (!t.ok()) {
    EXPECT_EQ(t.status().code(), absl::StatusCode::kFailedPrecondition) << t.status();
    const std::string why(t.status().message());
    EXPECT_TRUE(why.find("GPU") != std::string::npos ||
                why.find("cannot load") != std::string::npos)
        << why;
    GTEST_SKIP() << "no nccl transport here: " << why;
  }
  ASSERT_NE(t->nccl, nullptr);
  EXPECT_EQ(t->transport.get(), t->nccl);
  EXPECT_EQ(t->transport->name(), "nccl");
  EXPECT_FALSE(t->nccl->Healthy());
  EXPECT_FALSE(t->nccl->DeviceBusId().empty());
  absl::StatusOr<std::string> id = NewNcclUniqueId();
  ASSERT_TRUE(id.ok()) << id.status();
  EXPECT_EQ(t->nccl->InitMembers({2, 7}, 3, *id).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(t->nccl->InitMembers({7, 2}, 7, *id).code(), absl::StatusCode::kInvalidArgument);
  ASSERT_TRUE(t->nccl->InitMembers({7}, 7, *id).ok());
  EXPECT_TRUE(t->nccl->Healthy());
  // A transport rank outside the communicator is refused before anything is posted.
  const Transfer to_absent = {Transfer::Kind::kSend, 2, nullptr, 0, MemoryType::kDevice};
  EXPECT_EQ(t->transport->PostExchange(1, &to_absent, 1).status().code(),
            absl::StatusCode::kInvalidArgument);
  // Zero-byte entries to and from the member itself complete.
  const std::vector<Transfer> self = {{Transfer::Kind::kSend, 7, nullptr, 0, MemoryType::kDevice},
                                      {Transfer::Kind::kRecv, 7, nullptr, 0, MemoryType::kDevice}};
  absl::StatusOr<ExchangeId> group = t->transport->PostExchange(1, self.data(), self.size());
  ASSERT_TRUE(group.ok()) << group.status();
  EXPECT_TRUE(t->transport->WaitExchange(*group, absl::Now() + absl::Seconds(10)).ok());
}

}  // namespace
}  // namespace dxs
