// The transport table (transports.def) as data: one TransportSpec a row, and what the
// router, the registry and the workers' flag check ask of it. No factory is here
// (transport_factory.h has them), so whatever links this links no transport.
//
// Thread safety: the table is constant; every function may be called from any thread.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "absl/types/span.h"
#include "dxs/v1/control_plane.pb.h"

namespace dxs {

// What a transport needs or offers beyond moving bytes: the capabilities column.
enum TransportCapability : uint32_t {
  // Workers can be started on it (their --transport, `dxs up --transport`). Without it
  // (inproc: threads of one process) only a router and tests name it.
  kWorkers = 1u << 0,
  // It moves GPU memory only: its workers need --device cuda or cuda:N.
  kGpuMemoryOnly = 1u << 1,
  // One communicator per set of live workers, whose id the router makes (it needs an id
  // source) and publishes in ClusterView.transport.nccl_unique_id, a new one whenever the
  // set changes; workers make the communicator anew for each id.
  kCommunicatorPerView = 1u << 2,
};

// One row of transports.def.
struct TransportSpec {
  const char* name;           // --transport, ClusterView.transport.backend, Transport::name()
  const char* address_field;  // the v1::TransportAddress field a worker registers ("" none)
  const char* control;        // the row whose message API this one wraps ("" its own)
  uint32_t capabilities;      // TransportCapability bits

  bool Has(TransportCapability c) const { return (capabilities & c) != 0; }
};

// Every row, in the table's order.
absl::Span<const TransportSpec> Transports();

// The row named `name`; null when there is none.
const TransportSpec* FindTransport(std::string_view name);

// The names of the rows with every capability in `required` (0: every row), as messages
// list them: "ucx, nccl or inproc", "ucx or nccl".
std::string TransportNames(uint32_t required = 0);

// The row whose message API `spec` uses: its control row, or itself.
const TransportSpec& MessageTransport(const TransportSpec& spec);

// Whether `address` carries the field a worker on `spec` registers (true when the row
// names none).
bool HasRegisteredAddress(const TransportSpec& spec, const v1::TransportAddress& address);

// A peer's Transport::LocalAddress() as registered for `spec` (the field of its message
// API's row; empty when that row names none), and where a worker puts its own.
std::string ConnectAddress(const TransportSpec& spec, const v1::TransportAddress& address);
void SetConnectAddress(const TransportSpec& spec, std::string local_address,
                       v1::TransportAddress* address);

}  // namespace dxs
