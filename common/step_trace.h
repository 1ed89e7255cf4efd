// Step tracing (DXS_TRACE_STEPS=on): one stderr line per step event of a worker, stamped
// with the monotonic clock in milliseconds, so that the lines of every process of a cluster
// on one machine sort into one timeline. Off (the default), a trace costs one load of a
// static and builds no string.
#pragma once

#include <chrono>
#include <cstdio>
#include <string>

#include "absl/strings/str_cat.h"
#include "common/tunables.h"

namespace dxs {

inline bool StepTraceOn() {
  static const bool on = tunables::Get(tunables::kTraceSteps) == "on";
  return on;
}

// Writes "[<ms>] <parts...>" as one line when tracing is on.
template <typename... Parts>
void TraceStep(const Parts&... parts) {
  if (!StepTraceOn()) return;
  const double ms =
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now().time_since_epoch())
          .count();
  char stamp[32];
  std::snprintf(stamp, sizeof(stamp), "[%.1f] ", ms);
  const std::string line = absl::StrCat(stamp, parts..., "\n");
  std::fwrite(line.data(), 1, line.size(), stderr);
}

}  // namespace dxs
