// The replica choice of the dispatch layout (dataplane/dispatch/placement.h), shared by the
// CPU backend and the CUDA kernels so that every backend sends a pair to the same rank.
//
// An expert's row of the rank table holds its replicas' EP ranks, primary first, then -1
// up to the table's width. The pair of token row `row` goes to ranks[row mod n], n the
// replicas listed; -1 when none is (the layout refuses the pair).
#pragma once

#include <cstdint>

#include "common/host_device.h"

namespace dxs {

inline DXS_HOST_DEVICE int32_t ChooseReplicaRank(const int32_t* ranks, int64_t width, int64_t row) {
  int64_t n = 0;
  while (n < width && ranks[n] >= 0) ++n;
  return n == 0 ? -1 : ranks[row % n];
}

}  // namespace dxs
