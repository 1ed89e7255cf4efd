// The nccl transport (dataplane/transport/nccl_transport.h) on what one GPU allows: a
// one-rank communicator exchanging with itself (NCCL sends and receives to self), so the
// group posting, zero-size entries, completion, the abort of a refused group and a new
// communicator after it are exercised; two ranks need two GPUs (NCCL refuses two ranks of
// one communicator on one GPU), and so does the deadline watchdog (a pending transfer
// needs a peer that does not answer). Without a GPU, the clear error is checked and the
// rest skips.
#include "dataplane/transport/nccl_transport.h"

#include <cuda_runtime_api.h>

#include <cstdint>
#include <numeric>
#include <vector>

#include "gtest/gtest.h"

namespace dxs {
namespace {

bool HaveGpu() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
}

std::unique_ptr<Transport> Control() { return std::move(MakeInprocTransportGroup(1)[0]); }

// A device buffer of `n` bytes (freed at scope end).
struct DeviceBytes {
  explicit DeviceBytes(size_t n) : bytes(n) {
    if (n > 0) {
      EXPECT_EQ(cudaMalloc(&ptr, n), cudaSuccess);
    }
  }
  ~DeviceBytes() { cudaFree(ptr); }
  void Upload(const std::vector<uint8_t>& v) {
    ASSERT_EQ(cudaMemcpy(ptr, v.data(), v.size(), cudaMemcpyHostToDevice), cudaSuccess);
  }
  std::vector<uint8_t> Download() const {
    std::vector<uint8_t> v(bytes);
    EXPECT_EQ(cudaMemcpy(v.data(), ptr, bytes, cudaMemcpyDeviceToHost), cudaSuccess);
    return v;
  }
  void* ptr = nullptr;
  size_t bytes;
};

Transfer Send(int peer, DeviceBytes& b) {
  return {Transfer::Kind::kSend, peer, b.ptr, b.bytes, MemoryType::kDevice};
}
Transfer Recv(int peer, DeviceBytes& b) {
  return {Transfer::Kind::kRecv, peer, b.ptr, b.bytes, MemoryType::kDevice};
}

TEST(NcclTransport, WithoutAGpuSaysSoClearly) {
  if (HaveGpu()) GTEST_SKIP() << "a GPU is here";
  absl::StatusOr<std::unique_ptr<NcclTransport>> t = MakeNcclTransport(Control(), {});
  ASSERT_FALSE(t.ok());
  EXPECT_EQ(t.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(t.status().message().find("GPU"), std::string::npos) << t.status();
  EXPECT_EQ(NcclUniqueId().status().code(), absl::StatusCode::kFailedPrecondition);
}

class NcclTransportGpu : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!HaveGpu()) GTEST_SKIP() << "GPU case skipped: no GPU here";
    absl::StatusOr<std::unique_ptr<NcclTransport>> t = MakeNcclTransport(Control(), {});
    ASSERT_TRUE(t.ok()) << t.status();
    t_ = std::move(*t);
    absl::StatusOr<std::string> id = NcclUniqueId();
    ASSERT_TRUE(id.ok()) << id.status();
    ASSERT_TRUE(t_->Init(1, 0, *id).ok());
  }
  std::unique_ptr<NcclTransport> t_;
};

TEST_F(NcclTransportGpu, OneGroupMovesEveryEntryZeroSizesIncluded) {
  EXPECT_EQ(t_->name(), "nccl");
  EXPECT_TRUE(t_->SupportsMemory(MemoryType::kDevice));
  EXPECT_FALSE(t_->SupportsMemory(MemoryType::kHost));
  // Two payloads and a zero-size entry each way, to self, in one group.
  std::vector<uint8_t> a(1 << 20), b(4097);
  std::iota(a.begin(), a.end(), uint8_t{1});
  std::iota(b.begin(), b.end(), uint8_t{7});
  DeviceBytes sa(a.size()), sb(b.size()), ra(a.size()), rb(b.size()), s0(0), r0(0);
  sa.Upload(a);
  sb.Upload(b);
  const std::vector<Transfer> group = {Send(0, sa), Send(0, s0), Send(0, sb),
                                       Recv(0, ra), Recv(0, r0), Recv(0, rb)};
  absl::StatusOr<ExchangeId> id = t_->PostExchange(5, group.data(), group.size());
  ASSERT_TRUE(id.ok()) << id.status();
  ASSERT_TRUE(t_->WaitExchange(*id, absl::Now() + absl::Seconds(10)).ok());
  EXPECT_EQ(ra.Download(), a);
  EXPECT_EQ(rb.Download(), b);
  EXPECT_TRUE(t_->Healthy());
  // Forgotten once waited for.
  EXPECT_EQ(t_->WaitExchange(*id, absl::Now()).code(), absl::StatusCode::kNotFound);
}

TEST_F(NcclTransportGpu, GroupsInFlightAreWaitedForInAnyOrder) {
  std::vector<std::unique_ptr<DeviceBytes>> send, recv;
  std::vector<ExchangeId> ids;
  std::vector<std::vector<uint8_t>> want;
  for (int g = 0; g < 4; ++g) {
    want.emplace_back(1000 + 333 * g, static_cast<uint8_t>(g + 1));
    send.push_back(std::make_unique<DeviceBytes>(want.back().size()));
    recv.push_back(std::make_unique<DeviceBytes>(want.back().size()));
    send.back()->Upload(want.back());
    const std::vector<Transfer> group = {Send(0, *send.back()), Recv(0, *recv.back())};
    absl::StatusOr<ExchangeId> id = t_->PostExchange(9, group.data(), group.size());
    ASSERT_TRUE(id.ok()) << id.status();
    ids.push_back(*id);
  }
  for (int g : {2, 0, 3, 1}) {
    ASSERT_TRUE(t_->WaitExchange(ids[g], absl::Now() + absl::Seconds(10)).ok());
    EXPECT_EQ(recv[g]->Download(), want[g]);
  }
  // An empty group is valid and done at once.
  absl::StatusOr<ExchangeId> empty = t_->PostExchange(1, nullptr, 0);
  ASSERT_TRUE(empty.ok());
  EXPECT_TRUE(t_->ExchangeDone(*empty));
  EXPECT_TRUE(t_->WaitExchange(*empty, absl::Now()).ok());
}

TEST_F(NcclTransportGpu, BadGroupsAreRefusedWithoutPosting) {
  DeviceBytes d(64);
  std::vector<uint8_t> host(64);
  const Transfer host_send = {Transfer::Kind::kSend, 0, host.data(), host.size(),
                              MemoryType::kHost};
  EXPECT_EQ(t_->PostExchange(1, &host_send, 1).status().code(), absl::StatusCode::kUnimplemented);
  const Transfer bad_peer = Send(3, d);
  EXPECT_EQ(t_->PostExchange(1, &bad_peer, 1).status().code(), absl::StatusCode::kInvalidArgument);
  const Transfer null_data = {Transfer::Kind::kRecv, 0, nullptr, 8, MemoryType::kDevice};
  EXPECT_EQ(t_->PostExchange(1, &null_data, 1).status().code(), absl::StatusCode::kInvalidArgument);
  const Transfer ok = Send(0, d);
  EXPECT_EQ(t_->PostExchange(kMaxExchangeTag + 1, &ok, 1).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(t_->Healthy());  // nothing was posted
  EXPECT_EQ(t_->Init(2, 2, "x").code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(t_->Init(1, 0, "too short").code(), absl::StatusCode::kInvalidArgument);
}

// One rank cannot leave a transfer pending (NCCL refuses a receive from self without its
// send at once), so the deadline watchdog needs two GPUs; what one GPU shows is the abort
// path: a group NCCL refuses aborts the communicator, later groups fail at once, and a new
// communicator (a new id, as after a worker registers again) serves again.
TEST_F(NcclTransportGpu, ARefusedGroupAbortsAndANewCommunicatorServesAgain) {
  DeviceBytes r(256);
  const Transfer lonely = Recv(0, r);
  const absl::Status refused = t_->PostExchange(3, &lonely, 1).status();
  EXPECT_EQ(refused.code(), absl::StatusCode::kInvalidArgument) << refused;
  EXPECT_FALSE(t_->Healthy());
  DeviceBytes d(16);
  const Transfer send = Send(0, d);
  EXPECT_EQ(t_->PostExchange(4, &send, 1).status().code(), absl::StatusCode::kUnavailable);
  absl::StatusOr<std::string> fresh = NcclUniqueId();
  ASSERT_TRUE(fresh.ok());
  ASSERT_TRUE(t_->Init(1, 0, *fresh).ok());
  EXPECT_TRUE(t_->Healthy());
  std::vector<uint8_t> v(16, 0x5a);
  DeviceBytes out(16);
  d.Upload(v);
  const std::vector<Transfer> group = {Send(0, d), Recv(0, out)};
  absl::StatusOr<ExchangeId> again = t_->PostExchange(4, group.data(), group.size());
  ASSERT_TRUE(again.ok()) << again.status();
  ASSERT_TRUE(t_->WaitExchange(*again, absl::Now() + absl::Seconds(10)).ok());
  EXPECT_EQ(out.Download(), v);
}

// Peers are transport ranks: a communicator over the live workers of a cluster with a gap
// (one member here, transport rank 5) maps them to its dense ranks.
TEST_F(NcclTransportGpu, MembersMapSparseTransportRanks) {
  absl::StatusOr<std::string> id = NcclUniqueId();
  ASSERT_TRUE(id.ok()) << id.status();
  EXPECT_EQ(t_->InitMembers({}, 0, *id).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(t_->InitMembers({5}, 4, *id).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(t_->InitMembers({5, 5}, 5, *id).code(), absl::StatusCode::kInvalidArgument);
  ASSERT_TRUE(t_->InitMembers({5}, 5, *id).ok());
  std::vector<uint8_t> a(70000);
  std::iota(a.begin(), a.end(), uint8_t{3});
  DeviceBytes s(a.size()), r(a.size());
  s.Upload(a);
  const std::vector<Transfer> to_zero = {Send(0, s), Recv(0, r)};
  EXPECT_EQ(t_->PostExchange(2, to_zero.data(), to_zero.size()).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(t_->Healthy());  // refused before anything was posted
  const std::vector<Transfer> to_self = {Send(5, s), Recv(5, r)};
  absl::StatusOr<ExchangeId> group = t_->PostExchange(2, to_self.data(), to_self.size());
  ASSERT_TRUE(group.ok()) << group.status();
  ASSERT_TRUE(t_->WaitExchange(*group, absl::Now() + absl::Seconds(10)).ok());
  EXPECT_EQ(r.Download(), a);
}

TEST_F(NcclTransportGpu, TheControlChannelIsTheWrappedTransport) {
  ASSERT_TRUE(t_->SetSelf(0).ok());
  ASSERT_TRUE(t_->Send(0, "hdr", "abc", 3).ok());
  absl::StatusOr<TransportMessage> m = t_->Recv(0, absl::Now() + absl::Seconds(5));
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_EQ(m->header, "hdr");
  EXPECT_EQ(m->payload.size(), 3u);
}

}  // namespace
}  // namespace dxs
