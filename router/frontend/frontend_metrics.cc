#include "router/frontend/frontend_metrics.h"

#include <string>

#include "common/metrics/families.h"
#include "common/status_macros.h"

namespace dxs {

namespace m = metrics;

absl::StatusOr<std::unique_ptr<FrontendMetrics>> FrontendMetrics::Create(
    prometheus::Registry* registry) {
  std::unique_ptr<FrontendMetrics> fm(new FrontendMetrics());
  DXS_ASSIGN_OR_RETURN(
      m::CounterFamily * requests,
      m::AddCounter(registry, "dxs_requests_total",
                    "Generate calls the router answered, by final gRPC status code."));
  DXS_ASSIGN_OR_RETURN(
      m::CounterFamily * errors,
      m::AddCounter(registry, "dxs_request_errors_total",
                    "Generate calls the router answered with an error, by gRPC status "
                    "code."));
  for (int c = 0; c < kNumCodes; ++c) {
    const std::string name = absl::StatusCodeToString(static_cast<absl::StatusCode>(c));
    fm->requests_[c] = &requests->Add({{"code", name}});
    if (c != 0) fm->errors_[c] = &errors->Add({{"code", name}});
  }
  DXS_ASSIGN_OR_RETURN(m::GaugeFamily * inflight,
                       m::AddGauge(registry, "dxs_inflight_requests",
                                   "Generate calls admitted by the router and not "
                                   "finished."));
  fm->inflight_ = &inflight->Add({});
  DXS_ASSIGN_OR_RETURN(
      m::HistogramFamily * ttft,
      m::AddHistogram(registry, "dxs_time_to_first_token_seconds",
                      "Time from a Generate call's arrival at the router to its first "
                      "generated token."));
  fm->ttft_ = &ttft->Add({}, m::ExponentialBuckets(1e-3, 2, 16));
  DXS_ASSIGN_OR_RETURN(
      m::HistogramFamily * itl,
      m::AddHistogram(registry, "dxs_inter_token_latency_seconds",
                      "Time between consecutive generated tokens of a request, as the "
                      "router relays them."));
  fm->itl_ = &itl->Add({}, m::ExponentialBuckets(1e-4, 2, 17));
  DXS_ASSIGN_OR_RETURN(
      m::HistogramFamily * duration,
      m::AddHistogram(registry, "dxs_request_duration_seconds",
                      "End-to-end time of a completed Generate call (finished or "
                      "aborted), from arrival at the router to its final message."));
  fm->duration_ = &duration->Add({}, m::ExponentialBuckets(1e-2, 2, 15));
  return fm;
}

void FrontendMetrics::OnRequestDone(absl::StatusCode code) {
  int c = static_cast<int>(code);
  if (c < 0 || c >= kNumCodes) c = static_cast<int>(absl::StatusCode::kUnknown);
  requests_[c]->Increment();
  if (c != 0) errors_[c]->Increment();
}

void FrontendMetrics::ObserveInterToken(double seconds, int num_tokens) {
  if (num_tokens <= 0) return;
  const double each = seconds / num_tokens;
  for (int i = 0; i < num_tokens; ++i) itl_->Observe(each);
}

}  // namespace dxs
