#include "dataplane/transport/transport_table.h"

#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "google/protobuf/descriptor.h"

namespace dxs {
namespace {

constexpr TransportSpec kTransports[] = {
#define DXS_TRANSPORT(name, address_field, control, capabilities, factory) \
  {name, address_field, control, capabilities},
#include "dataplane/transport/transports.def"
#undef DXS_TRANSPORT
};

// The v1::TransportAddress field `name` names; null for "" (transport_table_test checks
// that every row's field exists).
const google::protobuf::FieldDescriptor* AddressField(const char* name) {
  if (name[0] == '\0') return nullptr;
  return v1::TransportAddress::descriptor()->FindFieldByName(name);
}

// The message API row's field, when it holds bytes (Transport::LocalAddress()).
const google::protobuf::FieldDescriptor* ConnectField(const TransportSpec& spec) {
  const google::protobuf::FieldDescriptor* field =
      AddressField(MessageTransport(spec).address_field);
  if (field == nullptr || field->type() != google::protobuf::FieldDescriptor::TYPE_BYTES) {
    return nullptr;
  }
  return field;
}

}  // namespace

absl::Span<const TransportSpec> Transports() { return kTransports; }

const TransportSpec* FindTransport(std::string_view name) {
  for (const TransportSpec& spec : kTransports) {
    if (name == spec.name) return &spec;
  }
  return nullptr;
}

std::string TransportNames(uint32_t required) {
  std::vector<std::string> names;
  for (const TransportSpec& spec : kTransports) {
    if ((spec.capabilities & required) == required) names.push_back(spec.name);
  }
  if (names.size() < 2) return absl::StrJoin(names, "");
  return absl::StrCat(absl::StrJoin(names.begin(), names.end() - 1, ", "), " or ", names.back());
}

const TransportSpec& MessageTransport(const TransportSpec& spec) {
  const TransportSpec* control = spec.control[0] == '\0' ? nullptr : FindTransport(spec.control);
  return control != nullptr ? *control : spec;
}

bool HasRegisteredAddress(const TransportSpec& spec, const v1::TransportAddress& address) {
  const google::protobuf::FieldDescriptor* field = AddressField(spec.address_field);
  // proto3: a message field is set when present, a bytes field when not empty.
  return field == nullptr || address.GetReflection()->HasField(address, field);
}

std::string ConnectAddress(const TransportSpec& spec, const v1::TransportAddress& address) {
  const google::protobuf::FieldDescriptor* field = ConnectField(spec);
  return field == nullptr ? std::string() : address.GetReflection()->GetString(address, field);
}

void SetConnectAddress(const TransportSpec& spec, std::string local_address,
                       v1::TransportAddress* address) {
  const google::protobuf::FieldDescriptor* field = ConnectField(spec);
  if (field != nullptr) {
    address->GetReflection()->SetString(address, field, std::move(local_address));
  }
}

}  // namespace dxs
