// absl::Status <-> grpc::Status: every canonical code maps 1:1, messages survive.
#include "common/grpc/status_conversion.h"

#include <utility>
#include <vector>

#include "gtest/gtest.h"

namespace dxs {
namespace {

const std::vector<std::pair<absl::StatusCode, grpc::StatusCode>> kCodes = {
    {absl::StatusCode::kCancelled, grpc::StatusCode::CANCELLED},
    {absl::StatusCode::kUnknown, grpc::StatusCode::UNKNOWN},
    {absl::StatusCode::kInvalidArgument, grpc::StatusCode::INVALID_ARGUMENT},
    {absl::StatusCode::kDeadlineExceeded, grpc::StatusCode::DEADLINE_EXCEEDED},
    {absl::StatusCode::kNotFound, grpc::StatusCode::NOT_FOUND},
    {absl::StatusCode::kAlreadyExists, grpc::StatusCode::ALREADY_EXISTS},
    {absl::StatusCode::kPermissionDenied, grpc::StatusCode::PERMISSION_DENIED},
    {absl::StatusCode::kResourceExhausted, grpc::StatusCode::RESOURCE_EXHAUSTED},
    {absl::StatusCode::kFailedPrecondition, grpc::StatusCode::FAILED_PRECONDITION},
    {absl::StatusCode::kAborted, grpc::StatusCode::ABORTED},
    {absl::StatusCode::kOutOfRange, grpc::StatusCode::OUT_OF_RANGE},
    {absl::StatusCode::kUnimplemented, grpc::StatusCode::UNIMPLEMENTED},
    {absl::StatusCode::kInternal, grpc::StatusCode::INTERNAL},
    {absl::StatusCode::kUnavailable, grpc::StatusCode::UNAVAILABLE},
    {absl::StatusCode::kDataLoss, grpc::StatusCode::DATA_LOSS},
    {absl::StatusCode::kUnauthenticated, grpc::StatusCode::UNAUTHENTICATED},
};

TEST(StatusConversionTest, OkIsOk) {
  EXPECT_TRUE(ToGrpcStatus(absl::OkStatus()).ok());
  EXPECT_EQ(ToGrpcStatus(absl::OkStatus()).error_message(), "");
  EXPECT_TRUE(FromGrpcStatus(grpc::Status::OK).ok());
}

TEST(StatusConversionTest, EveryCodeMapsOneToOneWithItsMessage) {
  ASSERT_EQ(kCodes.size(), 16u);  // every canonical error code
  for (const auto& [absl_code, grpc_code] : kCodes) {
    const absl::Status internal(absl_code, "token id 99 >= vocab_size 64");
    const grpc::Status wire = ToGrpcStatus(internal);
    EXPECT_EQ(wire.error_code(), grpc_code) << internal;
    EXPECT_EQ(wire.error_message(), "token id 99 >= vocab_size 64");

    const absl::Status back = FromGrpcStatus(wire);
    EXPECT_EQ(back, internal);
  }
}

TEST(StatusConversionTest, TheCodesTheApiDocumentsSurvive) {
  EXPECT_EQ(ToGrpcStatus(absl::InvalidArgumentError("x")).error_code(),
            grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(ToGrpcStatus(absl::ResourceExhaustedError("x")).error_code(),
            grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_EQ(ToGrpcStatus(absl::NotFoundError("x")).error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_EQ(ToGrpcStatus(absl::AlreadyExistsError("x")).error_code(),
            grpc::StatusCode::ALREADY_EXISTS);
  EXPECT_EQ(ToGrpcStatus(absl::UnavailableError("x")).error_code(), grpc::StatusCode::UNAVAILABLE);
  EXPECT_EQ(ToGrpcStatus(absl::DeadlineExceededError("x")).error_code(),
            grpc::StatusCode::DEADLINE_EXCEEDED);
}

TEST(StatusConversionTest, OutOfRangeCodesBecomeUnknown) {
  const absl::Status odd(static_cast<absl::StatusCode>(42), "odd");
  EXPECT_EQ(ToGrpcStatus(odd).error_code(), grpc::StatusCode::UNKNOWN);
  EXPECT_EQ(ToGrpcStatus(odd).error_message(), "odd");
  const grpc::Status odd_wire(static_cast<grpc::StatusCode>(42), "odd");
  EXPECT_EQ(FromGrpcStatus(odd_wire), absl::UnknownError("odd"));
}

}  // namespace
}  // namespace dxs
