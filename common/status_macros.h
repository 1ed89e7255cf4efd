// Status propagation helpers. Everything fallible inside dxs returns absl::Status or
// absl::StatusOr<T>; these macros keep the happy path readable. gRPC statuses are made
// from absl::Status in exactly one place per service.
#pragma once

#include "absl/status/status.h"
#include "absl/status/statusor.h"

#define DXS_CONCAT_INNER_(a, b) a##b
#define DXS_CONCAT_(a, b) DXS_CONCAT_INNER_(a, b)

#define DXS_RETURN_IF_ERROR(expr)              \
  do {                                         \
    ::absl::Status dxs_status_ = (expr);       \
    if (!dxs_status_.ok()) return dxs_status_; \
  } while (0)

#define DXS_ASSIGN_OR_RETURN_IMPL_(tmp, lhs, expr) \
  auto tmp = (expr);                               \
  if (!tmp.ok()) return tmp.status();              \
  lhs = std::move(tmp).value()

#define DXS_ASSIGN_OR_RETURN(lhs, expr) \
  DXS_ASSIGN_OR_RETURN_IMPL_(DXS_CONCAT_(dxs_statusor_, __LINE__), lhs, expr)
