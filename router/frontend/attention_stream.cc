#include "router/frontend/attention_stream.h"

#include <utility>

#include "absl/synchronization/notification.h"
#include "common/grpc/metadata.h"
#include "common/grpc/status_conversion.h"

namespace dxs {

RequestMailbox::News RequestMailbox::Wait(absl::Time deadline) {
  absl::MutexLock lock(&mu_);
  while (events_.empty() && !stopped_ && !stream_ended_) {
    if (cv_.WaitWithDeadline(&mu_, deadline)) break;
  }
  News news;
  news.events.swap(events_);
  news.stopped = stopped_;
  news.stream_ended = stream_ended_;
  news.stream_status = stream_status_;
  return news;
}

void RequestMailbox::Deliver(v1::ServeEvent event) {
  absl::MutexLock lock(&mu_);
  events_.push_back(std::move(event));
  cv_.Signal();
}

void RequestMailbox::EndStream(const absl::Status& status) {
  absl::MutexLock lock(&mu_);
  stream_ended_ = true;
  stream_status_ = status;
  cv_.Signal();
}

void RequestMailbox::Stop() {
  absl::MutexLock lock(&mu_);
  stopped_ = true;
  cv_.Signal();
}

AttentionStream::AttentionStream(std::shared_ptr<v1::AttentionWorker::Stub> stub) {
  stream_ = stub->Serve(&context_);
  // A worker with Serve answers at once with its initial metadata, marked; anything else
  // (no Serve, unreachable) ends the call at once, with its status. One that does neither
  // is given up on after kAcceptTimeout.
  absl::Notification answered;
  std::thread watchdog([&] {
    if (!answered.WaitForNotificationWithTimeout(kAcceptTimeout)) context_.TryCancel();
  });
  stream_->WaitForInitialMetadata();
  answered.Notify();
  watchdog.join();
  const auto& metadata = context_.GetServerInitialMetadata();
  if (metadata.find(kServeAcceptedMetadataKey) != metadata.end()) {
    reader_ = std::thread([this] { ReadLoop(); });
    return;
  }
  context_.TryCancel();  // in case the call is still open after all
  absl::Status status = FromGrpcStatus(stream_->Finish());
  if (status.ok()) status = absl::UnavailableError("the worker did not accept the stream");
  absl::MutexLock lock(&mu_);
  ended_ = true;
  end_status_ = status;
  absl::MutexLock write_lock(&write_mu_);
  finished_ = true;
}

AttentionStream::~AttentionStream() {
  Close();
  if (reader_.joinable()) reader_.join();
}

bool AttentionStream::accepted() const { return reader_.joinable(); }

void AttentionStream::ReadLoop() {
  v1::ServeEvents message;
  while (stream_->Read(&message)) {
    absl::MutexLock lock(&mu_);
    for (v1::ServeEvent& event : *message.mutable_events()) {
      auto it = mailboxes_.find(event.request_id());
      if (it != mailboxes_.end()) it->second->Deliver(std::move(event));
    }
  }
  absl::Status status;
  {
    absl::MutexLock lock(&write_mu_);
    finished_ = true;
    status = FromGrpcStatus(stream_->Finish());
  }
  // The worker closing the stream with OK is still the end of every request on it.
  if (status.ok()) status = absl::UnavailableError("the worker closed the stream");
  std::map<std::string, std::shared_ptr<RequestMailbox>> mailboxes;
  {
    absl::MutexLock lock(&mu_);
    ended_ = true;
    end_status_ = status;
    mailboxes.swap(mailboxes_);
  }
  for (auto& [id, mailbox] : mailboxes) mailbox->EndStream(status);
}

bool AttentionStream::Write(const v1::ServeRequest& request) {
  absl::MutexLock lock(&write_mu_);
  if (finished_) return false;
  // A failed write means the call is over: Read fails too and the reader ends the stream.
  return stream_->Write(request);
}

void AttentionStream::Submit(const v1::GenerateRequest& request,
                             std::shared_ptr<RequestMailbox> mailbox) {
  {
    absl::MutexLock lock(&mu_);
    if (ended_) {
      mailbox->EndStream(end_status_);
      return;
    }
    mailboxes_[request.request_id()] = std::move(mailbox);
  }
  v1::ServeRequest message;
  *message.mutable_submit() = request;
  Write(message);
}

bool AttentionStream::Abort(const std::string& request_id) {
  {
    absl::MutexLock lock(&mu_);
    if (ended_ || mailboxes_.count(request_id) == 0) return false;
  }
  v1::ServeRequest message;
  message.mutable_abort()->set_request_id(request_id);
  return Write(message);
}

void AttentionStream::Forget(const std::string& request_id) {
  absl::MutexLock lock(&mu_);
  mailboxes_.erase(request_id);
}

void AttentionStream::Close() { context_.TryCancel(); }

bool AttentionStream::ended() const {
  absl::MutexLock lock(&mu_);
  return ended_;
}

absl::Status AttentionStream::end_status() const {
  absl::MutexLock lock(&mu_);
  return end_status_;
}

AttentionStreams::AttentionStreams(int num_ranks) {
  for (int r = 0; r < num_ranks; ++r) slots_.push_back(std::make_unique<Slot>());
}

AttentionStreams::~AttentionStreams() { CloseAll(); }

std::shared_ptr<AttentionStream> AttentionStreams::Get(
    int rank, const std::string& address, uint64_t incarnation,
    const std::shared_ptr<v1::AttentionWorker::Stub>& stub) {
  if (rank < 0 || rank >= static_cast<int>(slots_.size()) || stub == nullptr) return nullptr;
  Slot& slot = *slots_[rank];
  absl::MutexLock lock(&slot.mu);
  const bool same_worker = slot.address == address && slot.incarnation == incarnation;
  if (same_worker && slot.unimplemented) return nullptr;
  if (same_worker && slot.stream != nullptr && !slot.stream->ended()) return slot.stream;
  if (slot.stream != nullptr) slot.stream->Close();
  slot.address = address;
  slot.incarnation = incarnation;
  slot.stream = std::make_shared<AttentionStream>(stub);
  if (slot.stream->accepted()) return slot.stream;
  // Refused (no Serve) or unreachable: the caller uses Generate, which reports the latter.
  slot.unimplemented = absl::IsUnimplemented(slot.stream->end_status());
  slot.stream = nullptr;
  return nullptr;
}

bool AttentionStreams::Abort(int rank, const std::string& request_id) {
  if (rank < 0 || rank >= static_cast<int>(slots_.size())) return false;
  std::shared_ptr<AttentionStream> stream;
  {
    Slot& slot = *slots_[rank];
    absl::MutexLock lock(&slot.mu);
    stream = slot.stream;
  }
  return stream != nullptr && stream->Abort(request_id);
}

void AttentionStreams::CloseStale(const std::vector<uint64_t>& live_incarnations) {
  for (size_t r = 0; r < slots_.size(); ++r) {
    Slot& slot = *slots_[r];
    absl::MutexLock lock(&slot.mu);
    const uint64_t live = r < live_incarnations.size() ? live_incarnations[r] : 0;
    if (slot.stream != nullptr && slot.incarnation != live) slot.stream->Close();
  }
}

void AttentionStreams::CloseAll() {
  for (const std::unique_ptr<Slot>& slot : slots_) {
    absl::MutexLock lock(&slot->mu);
    if (slot->stream != nullptr) slot->stream->Close();
  }
}

}  // namespace dxs
