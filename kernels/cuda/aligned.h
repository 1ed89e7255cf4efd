// 16-byte alignment, which the vector loads of the decode kernels (gemv.cu, the norms, the
// exchange's rows) need: the launchers check it on the device side of the API, the backend
// before it picks a kernel. Host-only and free of CUDA headers, so both sides share one.
#pragma once

#include <cstdint>

namespace dxs {

inline bool Aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

}  // namespace dxs
