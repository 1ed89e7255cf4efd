// The transport table (dataplane/transport/transports.def): every row well formed (its
// address field a field of v1::TransportAddress, its control a row), the names as messages
// list them, the registration addresses each row asks for, and the factories.
#include "dataplane/transport/transport_table.h"

#include <string>

#include "dataplane/transport/transport_factory.h"
#include "google/protobuf/descriptor.h"
#include "gtest/gtest.h"

namespace dxs {
namespace {

using google::protobuf::FieldDescriptor;

TEST(TransportTable, EveryRowIsWellFormed) {
  ASSERT_FALSE(Transports().empty());
  for (const TransportSpec& spec : Transports()) {
    SCOPED_TRACE(spec.name);
    EXPECT_EQ(FindTransport(spec.name), &spec) << "names are unique";
    if (spec.address_field[0] != '\0') {
      EXPECT_NE(v1::TransportAddress::descriptor()->FindFieldByName(spec.address_field), nullptr)
          << spec.address_field << " is no field of v1::TransportAddress";
    }
    if (spec.control[0] != '\0') {
      const TransportSpec* control = FindTransport(spec.control);
      ASSERT_NE(control, nullptr) << "control " << spec.control << " is no row";
      EXPECT_NE(control, &spec);
      EXPECT_EQ(control->control[0], '\0') << "a control row has its own message API";
      EXPECT_EQ(&MessageTransport(spec), control);
    } else {
      EXPECT_EQ(&MessageTransport(spec), &spec);
    }
    // A worker publishes Transport::LocalAddress() in its message API's field, for Connect.
    if (spec.Has(kWorkers)) {
      const FieldDescriptor* field =
          v1::TransportAddress::descriptor()->FindFieldByName(MessageTransport(spec).address_field);
      ASSERT_NE(field, nullptr);
      EXPECT_EQ(field->type(), FieldDescriptor::TYPE_BYTES);
    }
  }
  EXPECT_EQ(FindTransport("tcp"), nullptr);
  EXPECT_EQ(FindTransport(""), nullptr);
}

TEST(TransportTable, NamesAsMessagesListThem) {
  EXPECT_EQ(TransportNames(), "ucx, nccl or inproc");
  EXPECT_EQ(TransportNames(kWorkers), "ucx or nccl");
  EXPECT_EQ(TransportNames(kWorkers | kGpuMemoryOnly), "nccl");
}

TEST(TransportTable, CapabilitiesOfTheRows) {
  const TransportSpec& ucx = *FindTransport("ucx");
  const TransportSpec& nccl = *FindTransport("nccl");
  const TransportSpec& inproc = *FindTransport("inproc");
  EXPECT_TRUE(ucx.Has(kWorkers));
  EXPECT_FALSE(ucx.Has(kGpuMemoryOnly));
  EXPECT_FALSE(ucx.Has(kCommunicatorPerView));
  EXPECT_TRUE(nccl.Has(kWorkers));
  EXPECT_TRUE(nccl.Has(kGpuMemoryOnly));
  EXPECT_TRUE(nccl.Has(kCommunicatorPerView));
  EXPECT_EQ(&MessageTransport(nccl), &ucx);
  EXPECT_FALSE(inproc.Has(kWorkers));
}

TEST(TransportTable, RegisteredAddresses) {
  const TransportSpec& ucx = *FindTransport("ucx");
  const TransportSpec& nccl = *FindTransport("nccl");
  const TransportSpec& inproc = *FindTransport("inproc");
  v1::TransportAddress address;
  EXPECT_FALSE(HasRegisteredAddress(ucx, address));
  EXPECT_FALSE(HasRegisteredAddress(nccl, address));
  EXPECT_TRUE(HasRegisteredAddress(inproc, address));

  // A worker on nccl keeps its ucx control channel's address for Connect, and registers
  // its NcclPeerInfo as well; the router requires the latter.
  SetConnectAddress(nccl, "blob", &address);
  EXPECT_EQ(address.ucx_worker_address(), "blob");
  EXPECT_EQ(ConnectAddress(nccl, address), "blob");
  EXPECT_EQ(ConnectAddress(ucx, address), "blob");
  EXPECT_TRUE(HasRegisteredAddress(ucx, address));
  EXPECT_FALSE(HasRegisteredAddress(nccl, address));
  address.mutable_nccl();
  EXPECT_TRUE(HasRegisteredAddress(nccl, address));

  // inproc registers nothing and connects without an address.
  v1::TransportAddress none;
  SetConnectAddress(inproc, "inproc:3", &none);
  EXPECT_EQ(none.ByteSizeLong(), 0u);
  EXPECT_EQ(ConnectAddress(inproc, address), "");
}

TEST(TransportFactory, MakesTheRowsTransport) {
  absl::StatusOr<MadeTransport> ucx = MakeTransport(*FindTransport("ucx"), -1);
  ASSERT_TRUE(ucx.ok()) << ucx.status();
  EXPECT_EQ(ucx->transport->name(), "ucx");
  EXPECT_EQ(ucx->communicator, nullptr);
  // inproc's transports come as a group (MakeInprocTransportGroup), never one at a time.
  EXPECT_EQ(MakeTransport(*FindTransport("inproc"), -1).status().code(),
            absl::StatusCode::kUnimplemented);
}

}  // namespace
}  // namespace dxs
