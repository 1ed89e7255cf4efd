// CPU backend: memory, the immediate queue and the dense ops. Paged attention is in
// cpu_attention.cc, routing and the MoE exchange ops in cpu_moe_ops.cc.
#include "kernels/cpu_backend.h"

#include <cblas.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/splitmix64.h"
#include "common/status_macros.h"

namespace dxs {
namespace {

// Freed host blocks kept for reuse: enough for a step's activations at serving batch sizes.
constexpr size_t kMaxCachedHostBytes = size_t{1} << 30;

class CpuEvent final : public Event {};

std::shared_ptr<CachingAllocator> MakeHostAllocator() {
  return CachingAllocator::Create(
      Device::kCpu,
      // 64-byte alignment for vector loads; size classes are multiples of 64 already.
      [](size_t bytes) { return std::aligned_alloc(64, bytes); },
      [](void* p, size_t) { std::free(p); }, kMaxCachedHostBytes);
}

// out = w * (in * rsqrt(mean(in^2) + eps)) over one row of d values (in may be out):
// RmsNorm's arithmetic, shared with the fused ops so that they give the same bits.
void NormRow(const float* in, const float* w, int64_t d, float eps, float* out) {
  float sum_sq = 0.f;
  for (int64_t i = 0; i < d; ++i) sum_sq += in[i] * in[i];
  const float inv = 1.f / std::sqrt(sum_sq / static_cast<float>(d) + eps);
  for (int64_t i = 0; i < d; ++i) out[i] = w[i] * (in[i] * inv);
}

// The rotary embedding of Rope and QkNormRope: the same float32 arithmetic as
// transformers' default rotary embedding, rotate-half layout.
class RotaryTable {
 public:
  RotaryTable(double theta, int64_t head_dim)
      : half_(head_dim / 2), inv_freq_(half_), cos_(half_), sin_(half_) {
    for (int64_t i = 0; i < half_; ++i) {
      inv_freq_[i] = 1.f / std::pow(static_cast<float>(theta),
                                    static_cast<float>(2 * i) / static_cast<float>(head_dim));
    }
  }
  // The angles of one token's position.
  void SetPosition(int32_t position) {
    for (int64_t i = 0; i < half_; ++i) {
      const float angle = static_cast<float>(position) * inv_freq_[i];
      cos_[i] = std::cos(angle);
      sin_[i] = std::sin(angle);
    }
  }
  // Rotates one head's row at the position set last.
  void Rotate(float* v) const {
    for (int64_t i = 0; i < half_; ++i) {
      const float a = v[i], b = v[i + half_];
      v[i] = a * cos_[i] - b * sin_[i];
      v[i + half_] = b * cos_[i] + a * sin_[i];
    }
  }

 private:
  int64_t half_;
  std::vector<float> inv_freq_, cos_, sin_;
};

}  // namespace

CpuBackend::CpuBackend() : CpuBackend(MakeHostAllocator()) {}
CpuBackend::CpuBackend(std::shared_ptr<CachingAllocator> allocator)
    : allocator_(std::move(allocator)) {}

absl::StatusOr<Tensor> CpuBackend::Allocate(std::vector<int64_t> shape, DType dtype) {
  DXS_ASSIGN_OR_RETURN(const int64_t n, CountElements("allocate", shape));
  DXS_ASSIGN_OR_RETURN(std::shared_ptr<Buffer> buffer,
                       allocator_->Allocate(static_cast<size_t>(n) * DTypeSize(dtype)));
  return Tensor(std::move(buffer), dtype, std::move(shape));
}

// Converts `count` elements between dtypes on the host: equal dtypes copy, floating ones
// go through float32.
static absl::Status ConvertElements(const char* op, const void* src, DType src_dtype, void* dst,
                                    DType dst_dtype, size_t count) {
  if (count == 0) return absl::OkStatus();
  if (src_dtype == dst_dtype) {
    std::memcpy(dst, src, count * DTypeSize(src_dtype));
    return absl::OkStatus();
  }
  if (!IsFloatDType(src_dtype) || !IsFloatDType(dst_dtype)) {
    return absl::InvalidArgumentError(absl::StrCat(op, ": cannot convert ",
                                                   std::string(DTypeName(src_dtype)), " to ",
                                                   std::string(DTypeName(dst_dtype))));
  }
  if (dst_dtype == DType::kF32) {
    WidenToFloat32(src_dtype, src, count, static_cast<float*>(dst));
  } else if (src_dtype == DType::kF32) {
    NarrowFromFloat32(dst_dtype, static_cast<const float*>(src), count, dst);
  } else {
    std::vector<float> wide(count);
    WidenToFloat32(src_dtype, src, count, wide.data());
    NarrowFromFloat32(dst_dtype, wide.data(), count, dst);
  }
  return absl::OkStatus();
}

absl::Status CpuBackend::CopyFromHost(const void* src, DType src_dtype, Tensor* dst) {
  return ConvertElements("copy from host", src, src_dtype, dst->raw(), dst->dtype(),
                         static_cast<size_t>(dst->num_elements()));
}

absl::Status CpuBackend::CopyToHost(const Tensor& src, DType dst_dtype, void* dst) {
  return ConvertElements("copy to host", src.raw(), src.dtype(), dst, dst_dtype,
                         static_cast<size_t>(src.num_elements()));
}

absl::Status CpuBackend::Copy(const Tensor& src, Tensor* dst) {
  DXS_RETURN_IF_ERROR(CheckSameElements("copy", src, *dst));
  return ConvertElements("copy", src.raw(), src.dtype(), dst->raw(), dst->dtype(),
                         static_cast<size_t>(src.num_elements()));
}

absl::Status CpuBackend::Fill(Tensor* t, float value) {
  const size_t n = static_cast<size_t>(t->num_elements());
  if (t->dtype() == DType::kF32) {
    std::fill(t->f32(), t->f32() + n, value);
  } else if (t->dtype() == DType::kI32) {
    std::fill(t->i32(), t->i32() + n, static_cast<int32_t>(value));
  } else if (IsFloatDType(t->dtype())) {
    std::vector<float> v(n, value);
    NarrowFromFloat32(t->dtype(), v.data(), n, t->raw());
  } else {
    std::fill(t->i64(), t->i64() + n, static_cast<int64_t>(value));
  }
  return absl::OkStatus();
}

absl::Status CpuBackend::FillUniform(Tensor* t, uint64_t seed, double mean, double half_width,
                                     DType values_dtype) {
  if (!IsFloatDType(t->dtype()) || !IsFloatDType(values_dtype)) {
    return absl::InvalidArgumentError("fill uniform: floating tensors only");
  }
  const size_t n = static_cast<size_t>(t->num_elements());
  std::vector<float> v(n);
  uint64_t state = seed;
  for (size_t i = 0; i < n; ++i) {
    const double u = static_cast<double>(SplitMix64Next(&state) >> 11) * 0x1.0p-53;
    v[i] = static_cast<float>(mean + (2.0 * u - 1.0) * half_width);
  }
  if (values_dtype != DType::kF32) {
    std::vector<uint16_t> narrow(n);
    NarrowFromFloat32(values_dtype, v.data(), n, narrow.data());
    WidenToFloat32(values_dtype, narrow.data(), n, v.data());
  }
  return ConvertElements("fill uniform", v.data(), DType::kF32, t->raw(), t->dtype(), n);
}

absl::StatusOr<std::unique_ptr<Event>> CpuBackend::CreateEvent() {
  return std::unique_ptr<Event>(new CpuEvent());
}
// The queue is immediate: every op has completed when it returns.
absl::Status CpuBackend::RecordEvent(Event* event) { return absl::OkStatus(); }
absl::Status CpuBackend::WaitEvent(Event* event) { return absl::OkStatus(); }
absl::Status CpuBackend::SynchronizeEvent(Event* event) { return absl::OkStatus(); }

void CpuRowsTimesWeight(const float* x, int64_t m, const float* w, int64_t n, int64_t k, float* y) {
  for (int64_t i = 0; i < m; ++i) {
    cblas_sgemv(CblasRowMajor, CblasNoTrans, n, k, 1.f, w, k, x + i * k, 1, 0.f, y + i * n, 1);
  }
}

absl::Status CpuBackend::Linear(const Tensor& x, const Tensor& w, const Tensor* bias, Tensor* y) {
  DXS_RETURN_IF_ERROR(CheckDType("linear", x, DType::kF32, "x"));
  DXS_RETURN_IF_ERROR(CheckDType("linear", w, DType::kF32, "w"));
  const int64_t m = x.rows(), k = x.row_size(), n = w.rows();
  if (w.row_size() != k || y->num_elements() != m * n) {
    return absl::InvalidArgumentError(absl::StrCat("linear: x ", x.ShapeString(), ", w ",
                                                   w.ShapeString(), ", y ", y->ShapeString()));
  }
  if (m == 0) return absl::OkStatus();
  CpuRowsTimesWeight(x.f32(), m, w.f32(), n, k, y->f32());
  if (bias != nullptr) {
    const float* b = bias->f32();
    for (int64_t i = 0; i < m; ++i) {
      float* row = y->f32() + i * n;
      for (int64_t j = 0; j < n; ++j) row[j] += b[j];
    }
  }
  return absl::OkStatus();
}

absl::Status CpuBackend::RmsNorm(const Tensor& x, const Tensor& weight, float eps, Tensor* y) {
  DXS_RETURN_IF_ERROR(CheckSameElements("rms norm", x, *y));
  const int64_t d = weight.num_elements();
  if (d == 0 || x.num_elements() % d != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("rms norm: rows of ", d, " do not tile ", x.ShapeString()));
  }
  const int64_t rows = x.num_elements() / d;
  for (int64_t r = 0; r < rows; ++r)
    NormRow(x.f32() + r * d, weight.f32(), d, eps, y->f32() + r * d);
  return absl::OkStatus();
}

absl::Status CpuBackend::AddRmsNorm(const Tensor& x, const Tensor& weight, float eps,
                                    Tensor* residual, Tensor* y) {
  DXS_RETURN_IF_ERROR(CheckAddRmsNormArgs(x, weight, *residual, *y));
  DXS_RETURN_IF_ERROR(CheckDType("add rms norm", x, DType::kF32, "x"));
  DXS_RETURN_IF_ERROR(CheckDType("add rms norm", *y, DType::kF32, "y"));
  const int64_t d = weight.num_elements(), rows = x.num_elements() / d;
  // Row by row, Add's then RmsNorm's arithmetic: the row is in cache for the norm.
  for (int64_t r = 0; r < rows; ++r) {
    const float* a = x.f32() + r * d;
    float* res = residual->f32() + r * d;
    for (int64_t i = 0; i < d; ++i) res[i] += a[i];
    NormRow(res, weight.f32(), d, eps, y->f32() + r * d);
  }
  return absl::OkStatus();
}

absl::Status CpuBackend::QkNormRope(Tensor* q, Tensor* k, const Tensor& q_weight,
                                    const Tensor& k_weight, float eps, const Tensor& positions,
                                    double theta) {
  DXS_RETURN_IF_ERROR(CheckQkNormRopeArgs(*q, *k, q_weight, k_weight, positions));
  DXS_RETURN_IF_ERROR(CheckDType("qk norm rope", *q, DType::kF32, "q"));
  const int64_t tokens = q->dim(0), d = q->dim(2);
  RotaryTable rotary(theta, d);
  // Per token and head, RmsNorm's then Rope's arithmetic.
  for (int64_t t = 0; t < tokens; ++t) {
    rotary.SetPosition(positions.i32()[t]);
    for (auto [x, w] : {std::pair{q, &q_weight}, std::pair{k, &k_weight}}) {
      const int64_t heads = x->dim(1);
      for (int64_t h = 0; h < heads; ++h) {
        float* v = x->f32() + (t * heads + h) * d;
        NormRow(v, w->f32(), d, eps, v);
        rotary.Rotate(v);
      }
    }
  }
  return absl::OkStatus();
}

absl::Status CpuBackend::Embedding(const Tensor& table, const Tensor& ids, Tensor* y) {
  DXS_RETURN_IF_ERROR(CheckDType("embedding", ids, DType::kI32, "ids"));
  const int64_t d = table.row_size(), n = ids.num_elements();
  if (y->num_elements() != n * d) {
    return absl::InvalidArgumentError(
        absl::StrCat("embedding: ", n, " ids into ", y->ShapeString()));
  }
  for (int64_t i = 0; i < n; ++i) {
    const int32_t id = ids.i32()[i];
    if (id < 0 || id >= table.rows()) {
      return absl::InvalidArgumentError(absl::StrCat("embedding: id ", id, " outside the table"));
    }
    std::memcpy(y->f32() + i * d, table.f32() + static_cast<int64_t>(id) * d, d * sizeof(float));
  }
  return absl::OkStatus();
}

absl::Status CpuBackend::Rope(Tensor* x, const Tensor& positions, double theta) {
  DXS_RETURN_IF_ERROR(CheckDType("rope", positions, DType::kI32, "positions"));
  const int64_t tokens = x->dim(0), heads = x->dim(1), d = x->dim(2), half = d / 2;
  if (positions.num_elements() != tokens) {
    return absl::InvalidArgumentError(
        absl::StrCat("rope: ", positions.num_elements(), " positions for ", tokens, " tokens"));
  }
  if (half == 0) return absl::OkStatus();
  RotaryTable rotary(theta, d);
  for (int64_t t = 0; t < tokens; ++t) {
    rotary.SetPosition(positions.i32()[t]);
    for (int64_t h = 0; h < heads; ++h) rotary.Rotate(x->f32() + (t * heads + h) * d);
  }
  return absl::OkStatus();
}

absl::Status CpuBackend::SiluMul(const Tensor& gate, const Tensor& up, Tensor* out) {
  DXS_RETURN_IF_ERROR(CheckSameElements("silu mul", gate, up));
  DXS_RETURN_IF_ERROR(CheckSameElements("silu mul", gate, *out));
  const int64_t n = gate.num_elements();
  const float* g = gate.f32();
  const float* u = up.f32();
  float* o = out->f32();
  for (int64_t i = 0; i < n; ++i) o[i] = g[i] / (1.f + std::exp(-g[i])) * u[i];
  return absl::OkStatus();
}

absl::Status CpuBackend::Add(const Tensor& x, Tensor* inout) {
  DXS_RETURN_IF_ERROR(CheckSameElements("add", x, *inout));
  const int64_t n = x.num_elements();
  const float* a = x.f32();
  float* b = inout->f32();
  for (int64_t i = 0; i < n; ++i) b[i] += a[i];
  return absl::OkStatus();
}

absl::Status CpuBackend::GatherRows(const Tensor& src, const Tensor& rows, Tensor* dst) {
  DXS_RETURN_IF_ERROR(CheckDType("gather rows", rows, DType::kI32, "rows"));
  const int64_t n = rows.num_elements(), d = src.row_size();
  if (dst->rows() < n || dst->row_size() != d) {
    return absl::InvalidArgumentError(absl::StrCat(
        "gather rows: ", n, " rows of ", src.ShapeString(), " into ", dst->ShapeString()));
  }
  const size_t src_row = static_cast<size_t>(d) * DTypeSize(src.dtype());
  const size_t dst_row = static_cast<size_t>(d) * DTypeSize(dst->dtype());
  const uint8_t* in = static_cast<const uint8_t*>(src.raw());
  uint8_t* out = static_cast<uint8_t*>(dst->raw());
  const int32_t* r = rows.i32();
  for (int64_t i = 0; i < n; ++i) {
    if (r[i] < 0 || r[i] >= src.rows()) {
      return absl::InvalidArgumentError(
          absl::StrCat("gather rows: row ", r[i], " outside [0, ", src.rows(), ")"));
    }
    if (src.dtype() == dst->dtype()) {
      std::memcpy(out + i * dst_row, in + static_cast<int64_t>(r[i]) * src_row, src_row);
      continue;
    }
    DXS_RETURN_IF_ERROR(ConvertElements("gather rows", in + static_cast<int64_t>(r[i]) * src_row,
                                        src.dtype(), out + i * dst_row, dst->dtype(),
                                        static_cast<size_t>(d)));
  }
  return absl::OkStatus();
}

std::unique_ptr<Backend> MakeCpuBackend() { return std::make_unique<CpuBackend>(); }

}  // namespace dxs
