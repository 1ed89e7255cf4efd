// Conversion between absl::Status, used everywhere inside dxs, and grpc::Status, used on
// the wire. This is the one place where the conversion happens; service handlers return
// ToGrpcStatus(internal_status) and clients wrap call results with FromGrpcStatus.
//
// Both types use the canonical error space, so codes map 1:1 (static_asserts in the .cc
// pin that); the message is kept, absl payloads are dropped.
#pragma once

#include "absl/status/status.h"
#include "grpcpp/support/status.h"

namespace dxs {

// OK stays OK; any other status keeps its code and message.
grpc::Status ToGrpcStatus(const absl::Status& status);

// Inverse of ToGrpcStatus. grpc::Status error details (binary trailers) are dropped.
absl::Status FromGrpcStatus(const grpc::Status& status);

}  // namespace dxs
