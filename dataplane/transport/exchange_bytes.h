// The bytes a worker posts to its data exchange, by direction and memory type, under one
// name for both roles (docs/metrics.md):
//
//   dxs_exchange_bytes_total{role="attention"|"expert", rank, direction="send"|"recv",
//                            memory="host"|"device"|"mapped"}
//
// memory is where the bytes lie on this process's side of the transfer (what it handed to
// the transport). On `--device cuda` with a transport that moves GPU memory, the rows
// never leave the device: a dashboard shows memory="host" flat for the rows, and only the
// routing pairs an expert rank checks on the host (12 bytes per pair) as host bytes there.
// memory="mapped": the one-copy exchange's rows and pairs, which the expert rank loads
// from and stores into the DP rank's mapped region in place (their groups carry only a
// 4-byte status each, counted as host bytes); both sides count them.
#pragma once

#include <cstddef>
#include <string_view>

#include "absl/status/statusor.h"
#include "dataplane/transport/data_exchange.h"
#include "prometheus/counter.h"
#include "prometheus/registry.h"

namespace dxs::metrics {

class ExchangeBytes {
 public:
  // Registers the family (or finds it) and this rank's six children, at zero.
  static absl::StatusOr<ExchangeBytes> Register(prometheus::Registry* registry,
                                                std::string_view role, int rank);
  // Adds every entry of one group (zero-byte entries add nothing).
  void Count(const Transfer* transfers, size_t num_transfers);
  // Adds bytes that went through a mapped region instead (memory="mapped").
  void CountMapped(size_t sent, size_t received);

 private:
  // [send, recv][host, device, mapped]
  prometheus::Counter* bytes_[2][3] = {};
};

}  // namespace dxs::metrics
