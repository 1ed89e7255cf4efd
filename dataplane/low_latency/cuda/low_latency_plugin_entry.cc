// libdxs_cuda.so's second entry point, beside the backend's (kernels/cuda/cuda_plugin.cc):
// the low-latency exchange on a backend the plugin made, which
// dataplane/low_latency/low_latency_exchange.cc looks up. abseil is a shared library of the
// process, so a Status crosses the boundary as is.
#include <memory>

#include "absl/status/status.h"
#include "dataplane/low_latency/cuda/cuda_low_latency_exchange.h"

// The exchange (side 0: attention, 1: expert), or null with *error set.
extern "C" __attribute__((visibility("default"))) dxs::LowLatencyExchange*
dxs_make_cuda_low_latency_exchange(dxs::Backend* backend, const dxs::LowLatencyShape* shape,
                                   int side, int rank, absl::Status* error) {
  absl::StatusOr<std::unique_ptr<dxs::LowLatencyExchange>> exchange =
      dxs::MakeCudaLowLatencyExchange(
          backend, *shape,
          side == 0 ? dxs::LowLatencySide::kAttention : dxs::LowLatencySide::kExpert, rank);
  if (!exchange.ok()) {
    *error = exchange.status();
    return nullptr;
  }
  return exchange->release();
}
