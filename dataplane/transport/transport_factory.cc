#include "dataplane/transport/transport_factory.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "dataplane/transport/transport_table.h"

namespace dxs {
namespace {

using Factory = absl::StatusOr<MadeTransport> (*)(std::unique_ptr<Transport>, int);

// The factory column, in the order of Transports().
constexpr Factory kFactories[] = {
#define DXS_TRANSPORT(name, address_field, control, capabilities, factory) &factory,
#include "dataplane/transport/transports.def"
#undef DXS_TRANSPORT
};

}  // namespace

absl::StatusOr<MadeTransport> MakeTransport(const TransportSpec& spec, int cuda_device) {
  std::unique_ptr<Transport> control;
  if (const TransportSpec& base = MessageTransport(spec); &base != &spec) {
    absl::StatusOr<MadeTransport> made = MakeTransport(base, cuda_device);
    if (!made.ok()) return made.status();
    control = std::move(made->transport);
  }
  const TransportSpec* row = FindTransport(spec.name);
  if (row == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat("no transport '", spec.name, "'"));
  }
  return kFactories[row - Transports().data()](std::move(control), cuda_device);
}

}  // namespace dxs
