// Carver: carves 256-byte-aligned arrays out of one workspace. The same calls with a null
// base only size it, so a launcher's *WorkspaceBytes and the launcher itself cannot
// disagree (moe_ops.cu, sampling.cu).
#pragma once

#include <cstddef>
#include <cstdint>

namespace dxs::cuda {

class Carver {
 public:
  explicit Carver(void* base) : base_(static_cast<char*>(base)) {}
  template <typename T>
  T* Take(int64_t count) {
    T* p = base_ == nullptr ? nullptr : reinterpret_cast<T*>(base_ + used_);
    used_ += (static_cast<size_t>(count) * sizeof(T) + 255) / 256 * 256;
    return p;
  }
  size_t used() const { return used_; }

 private:
  char* base_;
  size_t used_ = 0;
};

}  // namespace dxs::cuda
