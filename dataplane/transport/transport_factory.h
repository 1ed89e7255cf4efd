// The factory column of the transport table (transports.def): each row's Factory, declared
// here and defined beside its transport, and MakeTransport, which makes a row's transport
// over its control row's. The workers link this (library dxs_transport_factory); the
// router and `dxs up` check names against transport_table.h alone.
#pragma once

#include <memory>

#include "absl/status/statusor.h"
#include "dataplane/transport/transport.h"

namespace dxs {

class NcclTransport;
struct TransportSpec;  // transport_table.h

// What a Factory makes.
struct MadeTransport {
  std::unique_ptr<Transport> transport;
  // The same object as a communicator when the row has kCommunicatorPerView (the nccl
  // transport), else null.
  NcclTransport* communicator = nullptr;
};

// Each row's Factory: its transport over `control` (the control row's transport, owned
// from here on, also on failure; null when the row has no control), for GPU `cuda_device`
// (-1: the CPU).
#define DXS_TRANSPORT(name, address_field, control, capabilities, factory)            \
  absl::StatusOr<MadeTransport> factory(std::unique_ptr<Transport> control_transport, \
                                        int cuda_device);
#include "dataplane/transport/transports.def"
#undef DXS_TRANSPORT

// `spec`'s transport: its control row's first (recursively), then its own Factory over it.
// The Factory's error as it is (nccl: FAILED_PRECONDITION when the plugin does not load or
// there is no usable GPU).
absl::StatusOr<MadeTransport> MakeTransport(const TransportSpec& spec, int cuda_device);

}  // namespace dxs
