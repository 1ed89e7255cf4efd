// The metrics server tests' HTTP client: common/http_client.h under the tests' names.
#pragma once

#include "common/http_client.h"

namespace dxs::metrics::testing {

using ::dxs::HttpRequest;
using ::dxs::HttpResponse;

}  // namespace dxs::metrics::testing
