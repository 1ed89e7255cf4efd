// The nccl transport (nccl_transport.h): the data exchange over a non-blocking NCCL
// communicator, the control channel forwarded to another transport.
#include "dataplane/transport/nccl_transport.h"

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <map>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"

namespace dxs {
namespace {

// How long a clean end waits for ncclCommFinalize before it aborts the communicator instead.
// Finalizing waits for the peers' outstanding operations; a peer that died never completes
// them, and the process should still end in seconds.
constexpr absl::Duration kFinalizeTimeout = absl::Seconds(5);

std::string NcclError(ncclResult_t r, ncclComm_t comm) {
  std::string s = ncclGetErrorString(r);
  const char* last = ncclGetLastError(comm);
  if (last != nullptr && last[0] != '\0') absl::StrAppend(&s, " (", last, ")");
  return s;
}

absl::Status CudaFailure(cudaError_t e, const char* what) {
  return absl::InternalError(absl::StrCat("nccl transport: ", what, ": ", cudaGetErrorName(e), ": ",
                                          cudaGetErrorString(e)));
}

// A short spin, then sleeps between polls: waits must not burn a core (data_exchange.h).
class Poller {
 public:
  void Pause() {
    if (++polls_ < 64) return;
    std::this_thread::sleep_for(std::chrono::microseconds(polls_ < 1024 ? 5 : 50));
  }

 private:
  int polls_ = 0;
};

absl::Status UsableGpu(int device) {
  int count = 0;
  const cudaError_t e = cudaGetDeviceCount(&count);
  if (e != cudaSuccess) {
    return absl::FailedPreconditionError(absl::StrCat(
        "nccl transport: no usable GPU (", cudaGetErrorName(e), ": ", cudaGetErrorString(e), ")"));
  }
  if (device < 0 || device >= count) {
    return absl::FailedPreconditionError(
        absl::StrCat("nccl transport: GPU ", device, " does not exist (", count, " here)"));
  }
  return absl::OkStatus();
}

class NcclTransportImpl final : public NcclTransport {
 public:
  NcclTransportImpl(std::unique_ptr<Transport> control, const NcclTransportOptions& options)
      : control_(std::move(control)), options_(options) {}

  ~NcclTransportImpl() override {
    cudaSetDevice(options_.device);
    for (auto& [id, group] : groups_) cudaEventDestroy(group.event);
    DropCommunicator(/*abort=*/!Healthy());
    if (stream_ != nullptr) cudaStreamDestroy(stream_);
  }

  absl::Status Start() {
    if (absl::Status s = UsableGpu(options_.device); !s.ok()) return s;
    if (cudaError_t e = cudaSetDevice(options_.device); e != cudaSuccess) {
      return CudaFailure(e, "set device");
    }
    if (cudaError_t e = cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking);
        e != cudaSuccess) {
      return CudaFailure(e, "stream");
    }
    return absl::OkStatus();
  }

  // ---- NcclTransport ----

  absl::Status InitMembers(const std::vector<int>& members, int self,
                           const std::string& unique_id) override {
    if (members.empty()) return absl::InvalidArgumentError("nccl transport: no members");
    for (size_t i = 0; i < members.size(); ++i) {
      if (members[i] < 0 || (i > 0 && members[i] <= members[i - 1])) {
        return absl::InvalidArgumentError(absl::StrCat(
            "nccl transport: member transport ranks must ascend from 0 or more; entry ", i, " is ",
            members[i]));
      }
    }
    const auto self_at = std::find(members.begin(), members.end(), self);
    if (self_at == members.end()) {
      return absl::InvalidArgumentError(
          absl::StrCat("nccl transport: transport rank ", self, " is not among the members"));
    }
    const int world_size = static_cast<int>(members.size());
    const int rank = static_cast<int>(self_at - members.begin());
    if (unique_id.size() != sizeof(ncclUniqueId)) {
      return absl::InvalidArgumentError(absl::StrCat("nccl transport: a unique id is ",
                                                     sizeof(ncclUniqueId), " bytes, got ",
                                                     unique_id.size()));
    }
    if (!groups_.empty()) {
      return absl::FailedPreconditionError(absl::StrCat(
          "nccl transport: ", groups_.size(), " groups of the old communicator not waited for"));
    }
    cudaSetDevice(options_.device);
    DropCommunicator(/*abort=*/!Healthy());
    ncclUniqueId id;
    std::memcpy(&id, unique_id.data(), sizeof(id));
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0;
    ncclComm_t comm = nullptr;
    ncclResult_t r = ncclCommInitRankConfig(&comm, world_size, id, rank, &config);
    if (r != ncclSuccess && r != ncclInProgress) {
      failure_ = absl::UnavailableError(
          absl::StrCat("nccl transport: communicator init: ", NcclError(r, comm)));
      if (comm != nullptr) ncclCommAbort(comm);
      return failure_;
    }
    const absl::Time deadline = absl::Now() + options_.init_timeout;
    Poller poller;
    while (true) {
      ncclResult_t state = ncclSuccess;
      r = ncclCommGetAsyncError(comm, &state);
      if (r == ncclSuccess && state == ncclSuccess) break;
      if ((r != ncclSuccess && r != ncclInProgress) ||
          (state != ncclSuccess && state != ncclInProgress) || absl::Now() >= deadline) {
        const std::string why = absl::Now() >= deadline
                                    ? absl::StrCat("not every rank joined within ",
                                                   absl::FormatDuration(options_.init_timeout))
                                    : NcclError(state != ncclSuccess ? state : r, comm);
        ncclCommAbort(comm);
        failure_ = absl::UnavailableError(absl::StrCat("nccl transport: communicator init (rank ",
                                                       rank, " of ", world_size, "): ", why));
        return failure_;
      }
      poller.Pause();
    }
    comm_ = comm;
    comm_rank_.clear();
    for (int i = 0; i < world_size; ++i) comm_rank_[members[static_cast<size_t>(i)]] = i;
    failure_ = absl::OkStatus();
    return absl::OkStatus();
  }

  bool Healthy() const override { return comm_ != nullptr && failure_.ok(); }

  std::string DeviceBusId() const override {
    char bus_id[32] = {};
    if (cudaDeviceGetPCIBusId(bus_id, sizeof(bus_id), options_.device) != cudaSuccess) return "";
    return bus_id;
  }

  // ---- DataExchange ----

  absl::StatusOr<ExchangeId> PostExchange(uint64_t tag, const Transfer* transfers,
                                          size_t num_transfers) override {
    if (tag > kMaxExchangeTag) {
      return absl::InvalidArgumentError(absl::StrCat("nccl transport: tag ", tag, " too large"));
    }
    if (num_transfers > 0 && transfers == nullptr) {
      return absl::InvalidArgumentError("nccl transport: null transfer list");
    }
    for (size_t i = 0; i < num_transfers; ++i) {
      const Transfer& t = transfers[i];
      if (t.bytes > 0 && t.data == nullptr) {
        return absl::InvalidArgumentError(
            absl::StrCat("nccl transport: transfer ", i, " has ", t.bytes, " bytes at null"));
      }
      if (t.memory != MemoryType::kDevice) {
        return absl::UnimplementedError(absl::StrCat(
            "nccl transport: transfer ", i, " is in host memory; NCCL moves device memory"));
      }
      if (comm_ != nullptr && comm_rank_.count(t.peer) == 0) {
        return absl::InvalidArgumentError(absl::StrCat("nccl transport: peer (transport rank) ",
                                                       t.peer, " is not in the communicator"));
      }
    }
    if (!failure_.ok()) return failure_;
    if (comm_ == nullptr) {
      return absl::FailedPreconditionError("nccl transport: no communicator (call Init)");
    }
    const ExchangeId id = next_id_++;
    Group group;
    group.tag = tag;
    for (size_t i = 0; i < num_transfers; ++i) group.ops.push_back({transfers[i], false});
    if (num_transfers == 0) {  // empty: done at once, nothing posted
      groups_.emplace(id, std::move(group));
      return id;
    }
    cudaSetDevice(options_.device);
    ncclResult_t r = ncclGroupStart();
    for (size_t i = 0; i < num_transfers && r == ncclSuccess; ++i) {
      const Transfer& t = transfers[i];
      const int peer = comm_rank_.at(t.peer);
      r = t.kind == Transfer::Kind::kSend
              ? ncclSend(t.data, t.bytes, ncclUint8, peer, comm_, stream_)
              : ncclRecv(t.data, t.bytes, ncclUint8, peer, comm_, stream_);
    }
    const ncclResult_t end = ncclGroupEnd();
    if (r == ncclSuccess) r = end;
    // Non-blocking: the group may still be enqueueing; wait for that (not for the
    // transfers) before recording the completion event behind it.
    const absl::Time deadline = absl::Now() + absl::Seconds(10);
    Poller poller;
    while (r == ncclInProgress) {
      ncclResult_t state = ncclSuccess;
      const ncclResult_t q = ncclCommGetAsyncError(comm_, &state);
      r = q != ncclSuccess ? q : state;
      if (r == ncclInProgress && absl::Now() >= deadline) r = ncclSystemError;
      if (r == ncclInProgress) poller.Pause();
    }
    if (r != ncclSuccess) {
      // The communicator is not trusted after a failed group: aborted either way. A group
      // NCCL calls invalid (a receive from self with no send, say) is the caller's error.
      const std::string why =
          absl::StrCat("nccl transport: posting exchange tag ", tag, ": ", NcclError(r, comm_));
      Abort(absl::UnavailableError(absl::StrCat(why, "; the communicator was aborted")));
      if (r == ncclInvalidUsage || r == ncclInvalidArgument) {
        return absl::InvalidArgumentError(why);
      }
      return failure_;
    }
    if (cudaError_t e = cudaEventCreateWithFlags(&group.event, cudaEventDisableTiming);
        e != cudaSuccess) {
      return CudaFailure(e, "event");
    }
    if (cudaError_t e = cudaEventRecord(group.event, stream_); e != cudaSuccess) {
      cudaEventDestroy(group.event);
      return CudaFailure(e, "event record");
    }
    groups_.emplace(id, std::move(group));
    return id;
  }

  absl::Status WaitExchange(ExchangeId id, absl::Time deadline) override {
    auto it = groups_.find(id);
    if (it == groups_.end()) {
      return absl::NotFoundError(absl::StrCat("nccl transport: no exchange ", id));
    }
    Poller poller;
    absl::Status result;
    while (true) {
      const absl::StatusOr<bool> done = Poll(it->second);
      if (!done.ok()) {
        result = done.status();
        break;
      }
      if (*done) break;
      if (absl::Now() >= deadline) {
        // The watchdog: what is pending now never completes on this communicator.
        size_t pending = 0;
        for (const Op& op : it->second.ops) pending += op.done ? 0 : 1;
        result = ExchangeDeadlineError(it->second.tag, it->second.ops, pending);
        Abort(absl::UnavailableError(absl::StrCat("nccl transport: aborted after exchange tag ",
                                                  it->second.tag, " missed its deadline")));
        break;
      }
      poller.Pause();
    }
    if (it->second.event != nullptr) cudaEventDestroy(it->second.event);
    groups_.erase(it);
    return result;
  }

  bool ExchangeDone(ExchangeId id) override {
    auto it = groups_.find(id);
    if (it == groups_.end()) return true;  // unknown: WaitExchange answers at once
    const absl::StatusOr<bool> done = Poll(it->second);
    return !done.ok() || *done;
  }

  bool SupportsMemory(MemoryType memory) const override { return memory == MemoryType::kDevice; }

  // ---- The control channel: the wrapped transport ----

  std::string name() const override { return "nccl"; }
  std::string LocalAddress() const override { return control_->LocalAddress(); }
  absl::Status SetSelf(int peer) override { return control_->SetSelf(peer); }
  absl::Status Connect(int peer, const std::string& address) override {
    return control_->Connect(peer, address);
  }
  void Disconnect(int peer) override { control_->Disconnect(peer); }
  absl::Status SendV(int peer, std::string_view header, const PayloadSegment* segments,
                     size_t num_segments) override {
    return control_->SendV(peer, header, segments, num_segments);
  }
  absl::StatusOr<TransportMessage> Recv(int peer, absl::Time deadline) override {
    return control_->Recv(peer, deadline);
  }
  bool HasMessage(int peer) override { return control_->HasMessage(peer); }
  absl::Status WaitForActivity(absl::Time deadline) override {
    return control_->WaitForActivity(deadline);
  }
  void Wake() override { control_->Wake(); }
  absl::Status PeerStatus(int peer) override { return control_->PeerStatus(peer); }

 private:
  // One entry of a group (ExchangeDeadlineError's shape); NCCL completes a group as a
  // whole, so `done` flips for every entry at once.
  struct Op {
    Transfer transfer;
    bool done = false;
  };
  struct Group {
    uint64_t tag = 0;
    std::vector<Op> ops;
    cudaEvent_t event = nullptr;  // null for an empty group
  };

  // Done, not yet, or the failure that ends the group.
  absl::StatusOr<bool> Poll(Group& group) {
    if (group.event == nullptr) return true;
    if (!failure_.ok()) return failure_;
    const cudaError_t e = cudaEventQuery(group.event);
    if (e == cudaSuccess) {
      for (Op& op : group.ops) op.done = true;
      return true;
    }
    if (e != cudaErrorNotReady) {
      Abort(CudaFailure(e, "exchange"));
      return failure_;
    }
    ncclResult_t state = ncclSuccess;
    const ncclResult_t r = ncclCommGetAsyncError(comm_, &state);
    if (r != ncclSuccess || (state != ncclSuccess && state != ncclInProgress)) {
      Abort(absl::UnavailableError(absl::StrCat("nccl transport: exchange tag ", group.tag, ": ",
                                                NcclError(r != ncclSuccess ? r : state, comm_))));
      return failure_;
    }
    return false;
  }

  // Ends the communicator: every group in flight and every later one fails with `why`
  // until Init makes a new one.
  void Abort(absl::Status why) {
    if (failure_.ok()) failure_ = std::move(why);
    DropCommunicator(/*abort=*/true);
  }

  void DropCommunicator(bool abort) {
    if (comm_ == nullptr) return;
    if (abort) {
      ncclCommAbort(comm_);
    } else {
      // A clean end: finalize (non-blocking: poll it, bounded), then destroy; abort if it
      // does not finish.
      const ncclResult_t r = ncclCommFinalize(comm_);
      ncclResult_t state = r == ncclSuccess ? ncclInProgress : r;
      const absl::Time deadline = absl::Now() + kFinalizeTimeout;
      Poller poller;
      while (state == ncclInProgress && absl::Now() < deadline) {
        if (ncclCommGetAsyncError(comm_, &state) != ncclSuccess) break;
        if (state == ncclInProgress) poller.Pause();
      }
      if (state == ncclSuccess) {
        ncclCommDestroy(comm_);
      } else {
        ncclCommAbort(comm_);
      }
    }
    comm_ = nullptr;
  }

  std::unique_ptr<Transport> control_;
  NcclTransportOptions options_;
  cudaStream_t stream_ = nullptr;
  ncclComm_t comm_ = nullptr;
  std::map<int, int> comm_rank_;  // transport rank -> communicator rank, of the members
  absl::Status failure_;          // why the communicator was aborted (OK: it was not)
  ExchangeId next_id_ = 1;
  std::map<ExchangeId, Group> groups_;
};

}  // namespace

absl::StatusOr<std::string> NcclUniqueId() {
  if (absl::Status s = UsableGpu(0); !s.ok()) return s;
  ncclUniqueId id;
  if (ncclResult_t r = ncclGetUniqueId(&id); r != ncclSuccess) {
    return absl::FailedPreconditionError(
        absl::StrCat("nccl transport: unique id: ", ncclGetErrorString(r)));
  }
  return std::string(reinterpret_cast<const char*>(&id), sizeof(id));
}

absl::StatusOr<std::unique_ptr<NcclTransport>> MakeNcclTransport(
    std::unique_ptr<Transport> control, const NcclTransportOptions& options) {
  if (control == nullptr) {
    return absl::InvalidArgumentError("nccl transport: needs a control-channel transport");
  }
  auto t = std::make_unique<NcclTransportImpl>(std::move(control), options);
  if (absl::Status s = t->Start(); !s.ok()) return s;
  return t;
}

}  // namespace dxs
