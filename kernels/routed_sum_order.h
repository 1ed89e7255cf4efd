// The order in which a token's routed pairs are added into its MoE output: ascending expert,
// ties by pair index, pairs of no expert (-1) left out. It is the sorted path's order (a
// stable sort of the pairs by expert, then ScaleSumRows), which the fused decode FFN
// (gemv.cu's MoeDownSumKernel) reproduces bit for bit; shared with the host so the order is
// tested without a GPU (tests/kernels/routed_sum_order_test.cc).
#pragma once

#include <cstdint>

#include "common/host_device.h"

namespace dxs {

// Where pair j of `pairs` (experts[j] >= 0) comes in that order: the number of counted pairs
// before it. Every counted pair gets a distinct rank in [0, counted pairs).
inline DXS_HOST_DEVICE int RoutedSumRank(const int32_t* experts, int pairs, int j) {
  const int32_t e = experts[j];
  int rank = 0;
  for (int i = 0; i < pairs; ++i) {
    const int32_t other = experts[i];
    rank += other >= 0 && (other < e || (other == e && i < j)) ? 1 : 0;
  }
  return rank;
}

}  // namespace dxs
