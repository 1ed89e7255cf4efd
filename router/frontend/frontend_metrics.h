// FrontendMetrics: the router's request series (docs/metrics.md, "Router"). The router
// sees every request, so request latencies and outcomes are measured here, not per rank:
//
//   dxs_requests_total{code}        Generate calls by final gRPC code name ("OK", ...)
//   dxs_request_errors_total{code}  the same, codes other than OK
//   dxs_inflight_requests           admitted and not finished
//   dxs_time_to_first_token_seconds, dxs_inter_token_latency_seconds,
//   dxs_request_duration_seconds    histograms
//
// Every code's child is made at creation (so rate() sees a series from the start) and
// kept, so recording is an atomic add or one histogram Observe; no lookups.
//
// Thread safety: every method may be called from any thread. The registry must outlive
// this object.
#pragma once

#include <array>
#include <memory>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "prometheus/counter.h"
#include "prometheus/gauge.h"
#include "prometheus/histogram.h"
#include "prometheus/registry.h"

namespace dxs {

class FrontendMetrics {
 public:
  static absl::StatusOr<std::unique_ptr<FrontendMetrics>> Create(prometheus::Registry* registry);

  // A Generate call ended with `code` (whatever the stage: validation, admission, relay).
  // A code outside the gRPC set counts as UNKNOWN.
  void OnRequestDone(absl::StatusCode code);
  void OnAdmitted() { inflight_->Increment(); }
  void OnReleased() { inflight_->Decrement(); }
  // From the call's arrival to the first generated token relayed.
  void ObserveTimeToFirstToken(double seconds) { ttft_->Observe(seconds); }
  // `num_tokens` tokens arrived `seconds` after the previous ones: each is observed at
  // seconds / num_tokens.
  void ObserveInterToken(double seconds, int num_tokens);
  // From arrival to the end of a request that completed (finished or aborted).
  void ObserveRequestDuration(double seconds) { duration_->Observe(seconds); }

 private:
  static constexpr int kNumCodes = 17;  // absl::StatusCode 0..16, the gRPC codes
  FrontendMetrics() = default;

  std::array<prometheus::Counter*, kNumCodes> requests_{};
  std::array<prometheus::Counter*, kNumCodes> errors_{};  // errors_[0] (OK) stays null
  prometheus::Gauge* inflight_ = nullptr;
  prometheus::Histogram* ttft_ = nullptr;
  prometheus::Histogram* itl_ = nullptr;
  prometheus::Histogram* duration_ = nullptr;
};

}  // namespace dxs
