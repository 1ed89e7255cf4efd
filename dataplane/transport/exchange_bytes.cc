#include "dataplane/transport/exchange_bytes.h"

#include <string>

#include "common/metrics/families.h"

namespace dxs::metrics {

absl::StatusOr<ExchangeBytes> ExchangeBytes::Register(prometheus::Registry* registry,
                                                      std::string_view role, int rank) {
  absl::StatusOr<CounterFamily*> family = AddCounter(
      registry, "dxs_exchange_bytes_total",
      "Bytes this rank posted to the data exchange (dispatch rows and pairs, combine rows), "
      "by direction and by the memory they lie in on this side (host or device), or that "
      "the peer loaded from or stored into this exchange's mapped region (mapped).");
  if (!family.ok()) return family.status();
  ExchangeBytes out;
  const char* directions[2] = {"send", "recv"};
  const char* memories[3] = {"host", "device", "mapped"};
  for (int d = 0; d < 2; ++d) {
    for (int m = 0; m < 3; ++m) {
      out.bytes_[d][m] = &(*family)->Add({{"role", std::string(role)},
                                          {"rank", std::to_string(rank)},
                                          {"direction", directions[d]},
                                          {"memory", memories[m]}});
    }
  }
  return out;
}

void ExchangeBytes::Count(const Transfer* transfers, size_t num_transfers) {
  // Summed first: a counter's Increment is a compare-exchange loop, once per series here.
  size_t sums[2][2] = {};
  for (size_t i = 0; i < num_transfers; ++i) {
    const Transfer& t = transfers[i];
    sums[t.kind == Transfer::Kind::kSend ? 0 : 1][t.memory == MemoryType::kDevice ? 1 : 0] +=
        t.bytes;
  }
  for (int d = 0; d < 2; ++d) {
    for (int m = 0; m < 2; ++m) {
      if (sums[d][m] > 0) bytes_[d][m]->Increment(static_cast<double>(sums[d][m]));
    }
  }
}

void ExchangeBytes::CountMapped(size_t sent, size_t received) {
  if (sent > 0) bytes_[0][2]->Increment(static_cast<double>(sent));
  if (received > 0) bytes_[1][2]->Increment(static_cast<double>(received));
}

}  // namespace dxs::metrics
