#include "kernels/tensor.h"

#include <algorithm>
#include <cassert>
#include <cstdlib>

#include "absl/strings/str_join.h"

namespace dxs {

Tensor::Tensor(std::shared_ptr<Buffer> buffer, DType dtype, std::vector<int64_t> shape,
               size_t offset_elements)
    : buffer_(std::move(buffer)),
      dtype_(dtype),
      shape_(std::move(shape)),
      offset_elements_(offset_elements) {}

int64_t Tensor::num_elements() const {
  int64_t n = 1;
  for (int64_t d : shape_) n *= d;
  return n;
}

int64_t Tensor::row_size() const {
  int64_t n = 1;
  for (size_t i = 1; i < shape_.size(); ++i) n *= shape_[i];
  return n;
}

Tensor Tensor::Rows(int64_t begin, int64_t count) const {
  if (begin < 0 || count < 0 || begin + count > rows()) {
    std::abort();  // programming error: a view outside the tensor
  }
  std::vector<int64_t> shape = shape_;
  shape[0] = count;
  Tensor t(buffer_, dtype_, std::move(shape),
           offset_elements_ + static_cast<size_t>(begin * row_size()));
  if (block_scales_ != nullptr) {
    // A view splitting a 128-row block would need scales no tensor holds.
    if (begin % kWeightBlock != 0 || count % kWeightBlock != 0) std::abort();
    t.block_scales_ = std::make_shared<const Tensor>(
        block_scales_->Rows(begin / kWeightBlock, count / kWeightBlock));
  }
  return t;
}

Tensor Tensor::Reshape(std::vector<int64_t> shape) const {
  Tensor t(buffer_, dtype_, std::move(shape), offset_elements_);
  if (t.num_elements() != num_elements()) std::abort();
  if (t.shape_ == shape_) t.block_scales_ = block_scales_;
  return t;
}

Tensor Tensor::WithBlockScales(Tensor scales) const {
  Tensor t = *this;
  t.block_scales_ = std::make_shared<const Tensor>(std::move(scales));
  return t;
}

float* Tensor::f32() const {
  assert(dtype_ == DType::kF32);
  return static_cast<float*>(buffer_->data()) + offset_elements_;
}

int32_t* Tensor::i32() const {
  assert(dtype_ == DType::kI32);
  return static_cast<int32_t*>(buffer_->data()) + offset_elements_;
}

int64_t* Tensor::i64() const {
  assert(dtype_ == DType::kI64);
  return static_cast<int64_t*>(buffer_->data()) + offset_elements_;
}

void* Tensor::raw() const {
  return static_cast<uint8_t*>(buffer_->data()) + offset_elements_ * DTypeSize(dtype_);
}

Tensor AllocateHostTensor(DType dtype, std::vector<int64_t> shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  // aligned_alloc wants a multiple of the alignment; never zero bytes.
  const size_t bytes =
      (std::max<size_t>(static_cast<size_t>(n) * DTypeSize(dtype), 64) + 63) / 64 * 64;
  void* p = std::aligned_alloc(64, bytes);
  if (p == nullptr) std::abort();
  auto buffer = std::make_shared<Buffer>(Device::kCpu, p, bytes, [](void* q) { std::free(q); });
  return Tensor(std::move(buffer), dtype, std::move(shape));
}

std::string Tensor::ShapeString() const { return "[" + absl::StrJoin(shape_, ", ") + "]"; }

}  // namespace dxs
