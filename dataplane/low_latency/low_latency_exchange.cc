#include "dataplane/low_latency/low_latency_exchange.h"

#include <atomic>

#include "absl/strings/str_cat.h"
#include "common/plugin_loader.h"
#include "common/status_macros.h"
#include "common/tunables.h"

namespace dxs {
namespace {

std::atomic<LowLatencyExchangeMaker> in_process_maker{nullptr};

// libdxs_cuda.so's second entry point (dataplane/low_latency/cuda/low_latency_plugin_entry.cc):
// the exchange, or null with *error set. The exchange is made by the plugin's code, on a
// backend the plugin made, and destroyed through its virtual destructor like the backend.
using PluginMakerFn = LowLatencyExchange* (*)(Backend* backend, const LowLatencyShape* shape,
                                              int side, int rank, absl::Status* error);

}  // namespace

void UseInProcessLowLatencyExchange(LowLatencyExchangeMaker maker) {
  in_process_maker.store(maker);
}

absl::StatusOr<std::unique_ptr<LowLatencyExchange>> MakeLowLatencyExchange(
    Backend* backend, const LowLatencyShape& shape, LowLatencySide side, int rank) {
  if (!backend->capabilities().low_latency_exchange) {
    return absl::UnimplementedError(absl::StrCat(
        "the ", backend->name(),
        " backend has no low-latency exchange (a CUDA path; the host-driven exchange serves it)"));
  }
  if (LowLatencyExchangeMaker maker = in_process_maker.load()) {
    return maker(backend, shape, side, rank);
  }
  DXS_ASSIGN_OR_RETURN(void* symbol,
                       LoadPluginSymbol("libdxs_cuda.so", tunables::kCudaPlugin,
                                        "dxs_make_cuda_low_latency_exchange", "--device cuda",
                                        "the CUDA backend's low-latency exchange"));
  absl::Status error;
  LowLatencyExchange* exchange = reinterpret_cast<PluginMakerFn>(symbol)(
      backend, &shape, side == LowLatencySide::kAttention ? 0 : 1, rank, &error);
  if (exchange == nullptr) return error;
  return std::unique_ptr<LowLatencyExchange>(exchange);
}

}  // namespace dxs
