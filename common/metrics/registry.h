// The set of metric families one process exposes, and its text exposition.
//
//   Registry registry;
//   CounterFamily* tokens = registry.AddCounter("dxs_tokens_dispatched_total",
//       "Tokens sent to expert ranks.", {"role", "rank"}).value();
//   Counter& mine = tokens->WithLabels({"ep", "3"});  // once, at start-up
//   mine.Increment(num_tokens);                         // hot path: one atomic add
//   std::string text = registry.Scrape();              // what GET /metrics returns
//
// Registration validates everything the exposition depends on, so Scrape cannot fail:
// names match [a-zA-Z_:][a-zA-Z0-9_:]*, counters end in _total, help is non-empty, label
// names are valid, distinct and not reserved (names.h), histogram bounds strictly increase.
// Registering a name again returns the existing family when kind, help, label names and
// bucket bounds all match (so independent components may register what they need), and
// AlreadyExists otherwise; so does a name that collides with another family's sample
// names (a gauge "x_count" next to a histogram "x").
//
// Thread safety: all methods may be called from any thread. Families and their children
// live as long as the registry; pointers to them may be kept.
#pragma once

#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "common/metrics/callback_gauge.h"
#include "common/metrics/family.h"

namespace dxs::metrics {

class Registry {
 public:
  Registry() = default;
  Registry(const Registry&) = delete;
  Registry& operator=(const Registry&) = delete;

  absl::StatusOr<CounterFamily*> AddCounter(std::string_view name, std::string_view help,
                                            std::vector<std::string> label_names = {});
  absl::StatusOr<GaugeFamily*> AddGauge(std::string_view name, std::string_view help,
                                        std::vector<std::string> label_names = {});
  // bucket_bounds: finite upper bounds, strictly increasing (a trailing +Inf is dropped;
  // the +Inf bucket is always there). See LinearBuckets and ExponentialBuckets.
  absl::StatusOr<HistogramFamily*> AddHistogram(std::string_view name, std::string_view help,
                                                std::vector<std::string> label_names,
                                                std::vector<double> bucket_bounds);
  absl::StatusOr<CallbackGaugeFamily*> AddCallbackGauge(std::string_view name,
                                                        std::string_view help,
                                                        std::vector<std::string> label_names = {});

  // Every family in name order, in the text exposition format 0.0.4.
  std::string Scrape() const;

 private:
  // Validates the arguments common to every kind; then under the lock either returns the
  // matching existing family, fails on a conflict, or adds the one make() builds.
  template <typename F, typename Make>
  absl::StatusOr<F*> Add(MetricKind kind, std::string_view name, std::string_view help,
                         const std::vector<std::string>& label_names,
                         const std::vector<double>& bucket_bounds, Make make);

  mutable absl::Mutex mu_;
  std::map<std::string, std::unique_ptr<FamilyBase>, std::less<>> families_ ABSL_GUARDED_BY(mu_);
};

}  // namespace dxs::metrics
