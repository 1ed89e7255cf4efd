#include "common/grpc/status_conversion.h"

#include <string>

namespace dxs {
namespace {

// The 1:1 mapping relies on both enums using the canonical code values.
#define DXS_SAME_CODE(absl_code, grpc_code)                        \
  static_assert(static_cast<int>(absl::StatusCode::absl_code) ==   \
                    static_cast<int>(grpc::StatusCode::grpc_code), \
                #absl_code " and " #grpc_code " must have the same value")
DXS_SAME_CODE(kOk, OK);
DXS_SAME_CODE(kCancelled, CANCELLED);
DXS_SAME_CODE(kUnknown, UNKNOWN);
DXS_SAME_CODE(kInvalidArgument, INVALID_ARGUMENT);
DXS_SAME_CODE(kDeadlineExceeded, DEADLINE_EXCEEDED);
DXS_SAME_CODE(kNotFound, NOT_FOUND);
DXS_SAME_CODE(kAlreadyExists, ALREADY_EXISTS);
DXS_SAME_CODE(kPermissionDenied, PERMISSION_DENIED);
DXS_SAME_CODE(kResourceExhausted, RESOURCE_EXHAUSTED);
DXS_SAME_CODE(kFailedPrecondition, FAILED_PRECONDITION);
DXS_SAME_CODE(kAborted, ABORTED);
DXS_SAME_CODE(kOutOfRange, OUT_OF_RANGE);
DXS_SAME_CODE(kUnimplemented, UNIMPLEMENTED);
DXS_SAME_CODE(kInternal, INTERNAL);
DXS_SAME_CODE(kUnavailable, UNAVAILABLE);
DXS_SAME_CODE(kDataLoss, DATA_LOSS);
DXS_SAME_CODE(kUnauthenticated, UNAUTHENTICATED);
#undef DXS_SAME_CODE

// Highest canonical code; anything above it is not a valid code on either side.
constexpr int kMaxCanonicalCode = static_cast<int>(grpc::StatusCode::UNAUTHENTICATED);

}  // namespace

grpc::Status ToGrpcStatus(const absl::Status& status) {
  if (status.ok()) return grpc::Status::OK;
  const int code = static_cast<int>(status.code());
  if (code < 0 || code > kMaxCanonicalCode) {
    return grpc::Status(grpc::StatusCode::UNKNOWN, std::string(status.message()));
  }
  return grpc::Status(static_cast<grpc::StatusCode>(code), std::string(status.message()));
}

absl::Status FromGrpcStatus(const grpc::Status& status) {
  if (status.ok()) return absl::OkStatus();
  const int code = static_cast<int>(status.error_code());
  if (code < 0 || code > kMaxCanonicalCode) {
    return absl::UnknownError(status.error_message());
  }
  return absl::Status(static_cast<absl::StatusCode>(code), status.error_message());
}

}  // namespace dxs
