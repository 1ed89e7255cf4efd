// AttentionStream: the router's one AttentionWorker.Serve stream to one attention worker
// (one incarnation of one DP rank), carrying every request the router sends there.
// AttentionStreams: those streams, one per DP rank, opened on first use and re-opened when
// the rank's worker changes (address or incarnation) or the stream ended.
//
// A request registers a RequestMailbox under its id and submits; the stream's reader
// thread takes each ServeEvents message (one per worker step) apart and hands every event
// to its request's mailbox; the request's own thread waits on the mailbox. So per step a
// rank costs one message and one reader wake-up, however many requests it served, instead
// of one upstream call and message per request.
//
// When the stream ends (worker gone, connection broken, Close), every registered mailbox is
// told, with the stream's status. Opening a stream waits for the worker's initial metadata,
// which a worker with Serve sends at once, marked with kServeAcceptedMetadataKey; a worker without
// Serve (UNIMPLEMENTED) or an unreachable one ends the call instead. Then Get returns
// null and the caller falls back to one Generate call per request; AttentionStreams
// remembers a worker without Serve and does not ask it again.
//
// Lock order: AttentionStreams' per-rank lock, then AttentionStream::mu_, then
// AttentionStream::write_mu_, then a mailbox's lock. Mailbox::Stop is safe under any other
// lock (it takes only the mailbox's).
//
// Thread safety: every method may be called from any thread.
#pragma once

#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "dxs/v1/attention_worker.grpc.pb.h"
#include "grpcpp/client_context.h"

namespace dxs {

// Where one request's events land.
class RequestMailbox {
 public:
  // What Wait found.
  struct News {
    std::deque<v1::ServeEvent> events;
    // The router stopped the request (InflightTracker's cancel callback).
    bool stopped = false;
    // The stream ended; `stream_status` says why (after `events`, which came before).
    bool stream_ended = false;
    absl::Status stream_status;
  };

  // Waits until there is news or `deadline` passes; takes the events.
  News Wait(absl::Time deadline);
  void Deliver(v1::ServeEvent event);
  void EndStream(const absl::Status& status);
  void Stop();

 private:
  absl::Mutex mu_;
  absl::CondVar cv_;
  std::deque<v1::ServeEvent> events_ ABSL_GUARDED_BY(mu_);
  bool stopped_ ABSL_GUARDED_BY(mu_) = false;
  bool stream_ended_ ABSL_GUARDED_BY(mu_) = false;
  absl::Status stream_status_ ABSL_GUARDED_BY(mu_);
};

class AttentionStream {
 public:
  // How long opening a stream waits for the worker's answer.
  static constexpr absl::Duration kAcceptTimeout = absl::Seconds(5);

  // Opens the stream: a blocking connect when the channel is not connected yet, and one
  // round trip for the worker's answer (at most kAcceptTimeout).
  explicit AttentionStream(std::shared_ptr<v1::AttentionWorker::Stub> stub);
  // Closes the stream and joins its reader thread.
  ~AttentionStream();
  AttentionStream(const AttentionStream&) = delete;
  AttentionStream& operator=(const AttentionStream&) = delete;

  // Registers `mailbox` under the request's id and sends the request. If the stream has
  // ended, the mailbox is told at once.
  void Submit(const v1::GenerateRequest& request, std::shared_ptr<RequestMailbox> mailbox);
  // Asks the worker to stop the request. False when the request is not registered here
  // (or the stream has ended).
  bool Abort(const std::string& request_id);
  // Unregisters the request's mailbox; later events for it are dropped.
  void Forget(const std::string& request_id);
  // Ends the stream (the worker aborts what it still runs from it).
  void Close();
  // The worker took the stream; false: it ended at once (end_status says why).
  bool accepted() const;
  bool ended() const;
  // Why the stream ended; OK while it has not.
  absl::Status end_status() const;

 private:
  void ReadLoop();
  bool Write(const v1::ServeRequest& request);

  grpc::ClientContext context_;
  std::unique_ptr<grpc::ClientReaderWriter<v1::ServeRequest, v1::ServeEvents>> stream_;
  mutable absl::Mutex mu_;
  std::map<std::string, std::shared_ptr<RequestMailbox>> mailboxes_ ABSL_GUARDED_BY(mu_);
  bool ended_ ABSL_GUARDED_BY(mu_) = false;
  absl::Status end_status_ ABSL_GUARDED_BY(mu_);
  // Serializes writes (and Finish) on the stream.
  absl::Mutex write_mu_ ABSL_ACQUIRED_AFTER(mu_);
  bool finished_ ABSL_GUARDED_BY(write_mu_) = false;
  std::thread reader_;
};

class AttentionStreams {
 public:
  explicit AttentionStreams(int num_ranks);
  ~AttentionStreams();

  // The stream to `rank`'s worker `incarnation` at `address`, opening one if there is no
  // live one for that worker; null if that worker does not implement Serve or could not be
  // reached.
  std::shared_ptr<AttentionStream> Get(int rank, const std::string& address, uint64_t incarnation,
                                       const std::shared_ptr<v1::AttentionWorker::Stub>& stub);
  // Sends an abort for `request_id` on `rank`'s stream; false if it is not registered there.
  bool Abort(int rank, const std::string& request_id);
  // Closes the streams whose rank is no longer held by the same worker incarnation;
  // `live_incarnations[r]` is rank r's, 0 if none.
  void CloseStale(const std::vector<uint64_t>& live_incarnations);
  void CloseAll();

 private:
  struct Slot {
    absl::Mutex mu;
    std::string address ABSL_GUARDED_BY(mu);
    uint64_t incarnation ABSL_GUARDED_BY(mu) = 0;
    std::shared_ptr<AttentionStream> stream ABSL_GUARDED_BY(mu);
    bool unimplemented ABSL_GUARDED_BY(mu) = false;
  };
  std::vector<std::unique_ptr<Slot>> slots_;
};

}  // namespace dxs
