// Registering metric families on a prometheus-cpp registry (prometheus::Registry), with
// absl::Status where the library throws, and the dxs naming rules checked once, at start-up:
//
//   prometheus::Registry registry;
//   prometheus::Family<prometheus::Counter>* tokens = AddCounter(&registry,
//       "dxs_tokens_dispatched_total", "Tokens sent to expert ranks.").value();
//   prometheus::Counter& mine = tokens->Add({{"role", "ep"}, {"rank", "3"}});  // once
//   mine.Increment(num_tokens);  // hot path: an atomic add, no lookup
//
// Rules, on top of the library's own (metric and label names match the Prometheus data
// model, no name used by two types):
//   - counter names end in _total (the library does not append it);
//   - help is non-empty and holds no newline or backslash: prometheus-cpp 1.0.1 writes HELP
//     unescaped, so either would make a scrape Prometheus cannot parse.
// Registering a name again with the same type returns the existing family (the library's
// InsertBehavior::Merge), so independent components may each register what they need.
//
// Children are never removed by dxs, so a reference returned by Family::Add stays valid as
// long as the registry. Family::Add takes the family's mutex and hashes the labels: call it
// at start-up (or when a new label value first appears), never per step.
//
// Thread safety: as prometheus-cpp: every call may come from any thread.
#pragma once

#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "prometheus/counter.h"
#include "prometheus/family.h"
#include "prometheus/gauge.h"
#include "prometheus/histogram.h"
#include "prometheus/registry.h"

namespace dxs::metrics {

using CounterFamily = prometheus::Family<prometheus::Counter>;
using GaugeFamily = prometheus::Family<prometheus::Gauge>;
using HistogramFamily = prometheus::Family<prometheus::Histogram>;

// InvalidArgument for a name or help that breaks the rules above, AlreadyExists when the
// name is taken by a family of another type.
absl::StatusOr<CounterFamily*> AddCounter(prometheus::Registry* registry, std::string_view name,
                                          std::string_view help);
absl::StatusOr<GaugeFamily*> AddGauge(prometheus::Registry* registry, std::string_view name,
                                      std::string_view help);
// The bucket bounds are given per child (Family::Add(labels, bounds)); see the helpers below.
absl::StatusOr<HistogramFamily*> AddHistogram(prometheus::Registry* registry, std::string_view name,
                                              std::string_view help);

// Histogram bucket bounds (prometheus-cpp 1.0.1 has no helpers for them).
// count bounds start, start + width, ...; width > 0, count >= 1.
prometheus::Histogram::BucketBoundaries LinearBuckets(double start, double width, int count);
// count bounds start, start * factor, ...; start > 0, factor > 1, count >= 1.
prometheus::Histogram::BucketBoundaries ExponentialBuckets(double start, double factor, int count);

// The rules for names and help text above; shared with the scrape-time collectables.
absl::Status ValidateNameAndHelp(std::string_view name, std::string_view help);

}  // namespace dxs::metrics
