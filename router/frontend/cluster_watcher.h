// ClusterWatcher: a thread that follows the registry's view versions and reports every
// change, with whether the cluster is complete (ClusterRegistry::IsComplete). The router
// drives its health status and the frontend's lost-rank handling from it.
//
// The callback runs once for the current view before the constructor returns, then on the
// watcher thread after each change (a burst of changes may be reported once, with the
// newest view). Calls never overlap.
//
// Thread safety: Stop may be called from any thread, more than once; the destructor stops.
// The registry must outlive the watcher.
#pragma once

#include <functional>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "dxs/v1/control_plane.pb.h"
#include "router/control_plane/cluster_registry.h"

namespace dxs {

class ClusterWatcher {
 public:
  using Callback = std::function<void(const v1::ClusterView& view, bool complete)>;

  ClusterWatcher(ClusterRegistry* registry, Callback callback);
  ~ClusterWatcher();

  ClusterWatcher(const ClusterWatcher&) = delete;
  ClusterWatcher& operator=(const ClusterWatcher&) = delete;

  void Stop() ABSL_LOCKS_EXCLUDED(join_mu_);

 private:
  void Run(uint64_t known_version);

  ClusterRegistry* const registry_;
  const Callback callback_;
  absl::Notification stop_;
  absl::Mutex join_mu_;                           // one joiner at a time
  std::thread thread_ ABSL_GUARDED_BY(join_mu_);  // set in the constructor, joined by Stop
};

}  // namespace dxs
