// Tensor: a shaped, row-major view into a Buffer that may live on the host or on a device.
//
// Buffers are shared; views made with Rows()/Reshape() alias their parent. A Tensor never
// owns compute: every operation on it is a Backend method (kernels/backend.h), so the model
// code is the same for every device. A tensor carries its dtype (floating data, or i32/i64
// index tensors) and its buffer's device. Only backends (and transports handed a backend's
// memory) dereference data(): the memory of a device tensor may not be readable by the
// host at all (kernels/opaque_backend.h enforces that in tests).
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "common/dtype.h"

namespace dxs {

// kOpaque: the opaque test backend's memory, which the host cannot read
// (kernels/opaque_backend.h).
enum class Device { kCpu, kCuda, kOpaque };

class Buffer {
 public:
  Buffer(Device device, void* data, size_t num_bytes, std::function<void(void*)> release)
      : device_(device), data_(data), num_bytes_(num_bytes), release_(std::move(release)) {}
  ~Buffer() {
    if (release_) release_(data_);
  }
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;

  Device device() const { return device_; }
  void* data() const { return data_; }
  size_t num_bytes() const { return num_bytes_; }

 private:
  Device device_;
  void* data_;
  size_t num_bytes_;
  std::function<void(void*)> release_;
};

class Tensor {
 public:
  Tensor() = default;
  Tensor(std::shared_ptr<Buffer> buffer, DType dtype, std::vector<int64_t> shape,
         size_t offset_elements = 0);

  bool defined() const { return buffer_ != nullptr; }
  Device device() const { return buffer_->device(); }
  DType dtype() const { return dtype_; }
  const std::vector<int64_t>& shape() const { return shape_; }
  int64_t dim(size_t i) const { return shape_.at(i); }
  int64_t num_elements() const;
  // First dimension, and the product of the others.
  int64_t rows() const { return shape_.empty() ? 1 : shape_[0]; }
  int64_t row_size() const;

  // Rows [begin, begin + count) of the first dimension; aliases this tensor.
  Tensor Rows(int64_t begin, int64_t count) const;
  // Same elements, new shape (element counts must match).
  Tensor Reshape(std::vector<int64_t> shape) const;

  // Typed element pointers; check the dtype in debug builds. For backends only.
  float* f32() const;
  int32_t* i32() const;
  int64_t* i64() const;
  void* raw() const;
  size_t num_bytes() const { return static_cast<size_t>(num_elements()) * DTypeSize(dtype_); }
  size_t offset_bytes() const { return offset_elements_ * DTypeSize(dtype_); }
  const std::shared_ptr<Buffer>& buffer() const { return buffer_; }

  std::string ShapeString() const;

  // A block-scaled FP8 weight (kF8E4M3 [n, k], both multiples of kWeightBlock) kept in FP8
  // on a backend with capabilities().fp8_block_weights carries its scales: value (r, c) is
  // fp8[r, c] * scales[r / 128, c / 128], scales f32 [n / 128, stride] with stride =
  // k / 128 rounded up to a multiple of 4 (the padding unused), the layout cuBLASLt's
  // 128x128 block scaling reads. Null for every other tensor. Rows() of a whole number of
  // blocks keeps the matching rows of the scales; Reshape() keeps them only when the shape
  // is unchanged.
  static constexpr int64_t kWeightBlock = 128;
  const Tensor* block_scales() const { return block_scales_.get(); }
  Tensor WithBlockScales(Tensor scales) const;

 private:
  std::shared_ptr<Buffer> buffer_;
  DType dtype_ = DType::kF32;
  std::vector<int64_t> shape_;
  size_t offset_elements_ = 0;
  std::shared_ptr<const Tensor> block_scales_;
};

// The row stride of a block-scaled weight's scales for k input features (above).
inline int64_t BlockScaleStride(int64_t k) {
  return ((k + Tensor::kWeightBlock - 1) / Tensor::kWeightBlock + 3) / 4 * 4;
}

// A host tensor of `dtype` (64-byte aligned, uninitialised), for data that is moved or
// converted rather than computed on: bf16 rows on the dispatch/combine wire.
Tensor AllocateHostTensor(DType dtype, std::vector<int64_t> shape);

}  // namespace dxs
