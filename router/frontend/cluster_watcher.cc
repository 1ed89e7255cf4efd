#include "router/frontend/cluster_watcher.h"

#include <optional>
#include <utility>

namespace dxs {
namespace {

// Longest the thread waits before checking for Stop.
constexpr absl::Duration kPollInterval = absl::Milliseconds(200);

}  // namespace

ClusterWatcher::ClusterWatcher(ClusterRegistry* registry, Callback callback)
    : registry_(registry), callback_(std::move(callback)) {
  const v1::ClusterView view = registry_->View();
  callback_(view, registry_->IsComplete());
  thread_ = std::thread([this, version = view.version()] { Run(version); });
}

ClusterWatcher::~ClusterWatcher() { Stop(); }

void ClusterWatcher::Stop() {
  absl::MutexLock lock(&join_mu_);
  if (!stop_.HasBeenNotified()) stop_.Notify();
  if (thread_.joinable() && thread_.get_id() != std::this_thread::get_id()) thread_.join();
}

void ClusterWatcher::Run(uint64_t known_version) {
  while (!stop_.HasBeenNotified()) {
    std::optional<v1::ClusterView> view = registry_->WaitForVersion(known_version, kPollInterval);
    if (!view.has_value()) {
      if (registry_->IsShutDown()) stop_.WaitForNotificationWithTimeout(kPollInterval);
      continue;
    }
    known_version = view->version();
    // IsComplete reads the registry again; if it changed in between, the next iteration
    // reports the newer view, so the last report always matches the registry.
    callback_(*view, registry_->IsComplete());
  }
}

}  // namespace dxs
