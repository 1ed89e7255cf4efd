// Gauges whose values live elsewhere and are read at scrape time: KV cache use, scheduler
// queue length. Copying such a value into a prometheus::Gauge on every change is easy to
// forget; a callback reads the owner's own state when Prometheus asks. prometheus-cpp has
// no callback gauge, so this is a prometheus::Collectable of its own, exposed beside the
// registry (MetricsServer::Expose).
//
//   auto gauges = std::make_shared<CallbackGauges>();
//   CallbackGaugeFamily* kv = gauges->Add("dxs_kv_cache_used_tokens", "KV positions.").value();
//   kv_metric_ = kv->Bind({{"rank", "0"}}, [this] { return cache_.used(); }).value();
//
// Lifetime: Bind returns a CallbackRegistration; destroying it (or Reset) unbinds the
// callback and, once that returns, the callback is not running and never runs again. Keep
// it as a member declared after the state the callback reads, so it is destroyed first.
// A registration must not outlive its CallbackGauges.
//
// Thread safety: every method may be called from any thread. Callbacks run on the scraping
// thread while their family's lock is held shared; they must be cheap, safe to call
// concurrently with the owner's updates, and must not call into CallbackGauges.
#pragma once

#include <functional>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "prometheus/collectable.h"
#include "prometheus/labels.h"
#include "prometheus/metric_family.h"

namespace dxs::metrics {

class CallbackGaugeFamily;

class CallbackRegistration {
 public:
  CallbackRegistration() = default;
  CallbackRegistration(CallbackRegistration&& other) noexcept;
  CallbackRegistration& operator=(CallbackRegistration&& other) noexcept;
  ~CallbackRegistration() { Reset(); }

  // Unbinds the callback (no-op when empty); after return it is not running anymore.
  void Reset();
  bool bound() const { return family_ != nullptr; }

 private:
  friend class CallbackGaugeFamily;
  CallbackRegistration(CallbackGaugeFamily* family, prometheus::Labels labels)
      : family_(family), labels_(std::move(labels)) {}

  CallbackGaugeFamily* family_ = nullptr;
  prometheus::Labels labels_;
};

// One gauge name with a callback per label set.
class CallbackGaugeFamily {
 public:
  CallbackGaugeFamily(std::string name, std::string help)
      : name_(std::move(name)), help_(std::move(help)) {}

  // Binds fn to these labels. InvalidArgument for an invalid label name or an empty fn,
  // AlreadyExists when these labels already have a callback.
  absl::StatusOr<CallbackRegistration> Bind(prometheus::Labels labels, std::function<double()> fn);

  const std::string& name() const { return name_; }
  const std::string& help() const { return help_; }
  // The family with every callback's current value; no samples when none is bound.
  prometheus::MetricFamily Collect() const;

 private:
  friend class CallbackRegistration;
  void Unbind(const prometheus::Labels& labels);

  const std::string name_;
  const std::string help_;
  mutable absl::Mutex mu_;
  std::map<prometheus::Labels, std::function<double()>> callbacks_ ABSL_GUARDED_BY(mu_);
};

class CallbackGauges final : public prometheus::Collectable {
 public:
  // Adds a family, or returns the one of that name when the help matches. InvalidArgument
  // for a bad name or help (families.h's rules), AlreadyExists for another help.
  absl::StatusOr<CallbackGaugeFamily*> Add(std::string_view name, std::string_view help);

  // Families with at least one bound callback, in name order.
  std::vector<prometheus::MetricFamily> Collect() const override;

 private:
  mutable absl::Mutex mu_;
  // Families live as long as this object, so their pointers may be kept.
  std::map<std::string, std::unique_ptr<CallbackGaugeFamily>> families_ ABSL_GUARDED_BY(mu_);
};

}  // namespace dxs::metrics
