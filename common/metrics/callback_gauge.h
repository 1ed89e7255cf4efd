// Gauges whose values live elsewhere and are read at scrape time: KV cache blocks in use,
// scheduler queue length. Copying such a value into a Gauge on every change is easy to
// forget; a callback reads the owner's own state when Prometheus asks.
//
//   CallbackGaugeFamily* kv = registry.AddCallbackGauge(
//       "dxs_kv_cache_used_blocks", "KV cache blocks in use.", {"rank"}).value();
//   kv_metric_ = kv->Bind({"0"}, [this] { return cache_.num_used_blocks(); }).value();
//
// Lifetime: Bind returns a CallbackRegistration; destroying it (or Reset) unbinds the
// callback and, once that returns, the callback is not running and never runs again. Keep
// it as a member declared after the state the callback reads, so it is destroyed first.
// A registration must not outlive its registry.
//
// Thread safety: callbacks run on the scraping thread while this family's lock is held
// shared. They must be cheap, safe to call concurrently with the owner's updates, and must
// not call into the registry or destroy their own registration.
#pragma once

#include <functional>
#include <initializer_list>
#include <map>
#include <string>
#include <string_view>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "common/metrics/family.h"

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
  CallbackRegistration(CallbackGaugeFamily* family, std::vector<std::string> label_values)
      : family_(family), label_values_(std::move(label_values)) {}

  CallbackGaugeFamily* family_ = nullptr;
  std::vector<std::string> label_values_;
};

class CallbackGaugeFamily final : public FamilyBase {
 public:
  CallbackGaugeFamily(std::string name, std::string help, std::vector<std::string> label_names);

  // Binds fn to these label values (one per label name). InvalidArgument on a wrong count,
  // AlreadyExists when these label values already have a callback.
  absl::StatusOr<CallbackRegistration> Bind(std::initializer_list<std::string_view> label_values,
                                            std::function<double()> fn);
  absl::StatusOr<CallbackRegistration> Bind(std::vector<std::string> label_values,
                                            std::function<double()> fn);

  void AppendText(std::string* out) const override;

 private:
  friend class CallbackRegistration;
  void Unbind(const std::vector<std::string>& label_values);

  mutable absl::Mutex mu_;
  std::map<std::vector<std::string>, std::function<double()>> callbacks_ ABSL_GUARDED_BY(mu_);
};

}  // namespace dxs::metrics
