// This absl is built with its own string_view (ABSL_OPTION_USE_STD_STRING_VIEW 0), so a
// std::string_view must be converted before it goes into absl::StrCat and friends.
#pragma once

#include <string_view>

#include "absl/strings/string_view.h"

namespace dxs::metrics::internal {

inline absl::string_view AsAbsl(std::string_view s) { return {s.data(), s.size()}; }

}  // namespace dxs::metrics::internal
