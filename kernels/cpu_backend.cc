// CPU backend: float32 throughout, OpenBLAS sgemm for Linear.
#include <cblas.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>

#include "kernels/backend.h"
#include "kernels/topk_softmax.h"

namespace dxs {
namespace {

class CpuBackend final : public Backend {
 public:
  std::string name() const override { return "cpu"; }
  Device device() const override { return Device::kCpu; }

  Tensor Allocate(std::vector<int64_t> shape) override {
    int64_t n = 1;
    for (int64_t d : shape) n *= d;
    size_t bytes = std::max<size_t>(static_cast<size_t>(n) * sizeof(float), 64);
    // 64-byte alignment for vector loads; rounded up as aligned_alloc requires.
    bytes = (bytes + 63) / 64 * 64;
    void* p = std::aligned_alloc(64, bytes);
    if (p == nullptr) std::abort();
    auto buf = std::make_shared<Buffer>(Device::kCpu, p, bytes, [](void* q) { std::free(q); });
    return Tensor(std::move(buf), DType::kF32, std::move(shape));
  }

  Tensor Zeros(std::vector<int64_t> shape) override {
    Tensor t = Allocate(std::move(shape));
    Fill(&t, 0.f);
    return t;
  }

  Tensor Upload(const std::vector<float>& host, std::vector<int64_t> shape) override {
    Tensor t = Allocate(std::move(shape));
    if (static_cast<int64_t>(host.size()) != t.num_elements()) std::abort();
    std::memcpy(t.f32(), host.data(), host.size() * sizeof(float));
    return t;
  }

  std::vector<float> Download(const Tensor& t) override {
    return std::vector<float>(t.f32(), t.f32() + t.num_elements());
  }

  void Fill(Tensor* t, float value) override {
    std::fill(t->f32(), t->f32() + t->num_elements(), value);
  }

  void Linear(const Tensor& x, const Tensor& w, const Tensor* bias, Tensor* y) override {
    const int64_t m = x.rows(), k = x.row_size(), n = w.rows();
    if (m == 0) return;
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, m, n, k, 1.f, x.f32(), k, w.f32(), k, 0.f,
                y->f32(), n);
    if (bias != nullptr) {
      const float* b = bias->f32();
      for (int64_t i = 0; i < m; ++i) {
        float* row = y->f32() + i * n;
        for (int64_t j = 0; j < n; ++j) row[j] += b[j];
      }
    }
  }

  void RmsNorm(const Tensor& x, const Tensor& weight, float eps, Tensor* y) override {
    const int64_t d = weight.num_elements();
    const int64_t rows = x.num_elements() / d;
    const float* w = weight.f32();
    for (int64_t r = 0; r < rows; ++r) {
      const float* in = x.f32() + r * d;
      float* out = y->f32() + r * d;
      float sum_sq = 0.f;
      for (int64_t i = 0; i < d; ++i) sum_sq += in[i] * in[i];
      const float inv = 1.f / std::sqrt(sum_sq / static_cast<float>(d) + eps);
      for (int64_t i = 0; i < d; ++i) out[i] = w[i] * (in[i] * inv);
    }
  }

  void Embedding(const Tensor& table, const std::vector<int32_t>& ids, Tensor* y) override {
    const int64_t d = table.row_size();
    for (size_t i = 0; i < ids.size(); ++i) {
      std::memcpy(y->f32() + i * d, table.f32() + static_cast<int64_t>(ids[i]) * d,
                  d * sizeof(float));
    }
  }

  void Rope(Tensor* x, const std::vector<int64_t>& positions, double theta) override {
    const int64_t tokens = x->dim(0), heads = x->dim(1), d = x->dim(2), half = d / 2;
    // Same float32 arithmetic as transformers' default rotary embedding.
    std::vector<float> inv_freq(half), cos_v(half), sin_v(half);
    for (int64_t i = 0; i < half; ++i) {
      inv_freq[i] = 1.f / std::pow(static_cast<float>(theta),
                                   static_cast<float>(2 * i) / static_cast<float>(d));
    }
    for (int64_t t = 0; t < tokens; ++t) {
      for (int64_t i = 0; i < half; ++i) {
        const float angle = static_cast<float>(positions[t]) * inv_freq[i];
        cos_v[i] = std::cos(angle);
        sin_v[i] = std::sin(angle);
      }
      for (int64_t h = 0; h < heads; ++h) {
        float* v = x->f32() + (t * heads + h) * d;
        for (int64_t i = 0; i < half; ++i) {
          const float a = v[i], b = v[i + half];
          v[i] = a * cos_v[i] - b * sin_v[i];
          v[i + half] = b * cos_v[i] + a * sin_v[i];
        }
      }
    }
  }

  void CopyRows(const Tensor& src, Tensor* dst, int64_t dst_row) override {
    if (src.rows() == 0) return;
    std::memcpy(dst->f32() + dst_row * dst->row_size(), src.f32(),
                src.num_elements() * sizeof(float));
  }

  void Attention(const Tensor& q, const Tensor& k_cache, const Tensor& v_cache, int64_t past_len,
                 float scale, Tensor* out) override {
    const int64_t n = q.dim(0), heads = q.dim(1), d = q.dim(2);
    const int64_t kv_heads = k_cache.dim(1);
    const int64_t group = heads / kv_heads;
    std::vector<float> scores(past_len + n);
    for (int64_t i = 0; i < n; ++i) {
      const int64_t visible = past_len + i + 1;
      for (int64_t h = 0; h < heads; ++h) {
        const float* qv = q.f32() + (i * heads + h) * d;
        const int64_t kvh = h / group;
        float max_score = -INFINITY;
        for (int64_t p = 0; p < visible; ++p) {
          const float* kv = k_cache.f32() + (p * kv_heads + kvh) * d;
          float s = 0.f;
          for (int64_t j = 0; j < d; ++j) s += qv[j] * kv[j];
          s *= scale;
          scores[p] = s;
          max_score = std::max(max_score, s);
        }
        float sum = 0.f;
        for (int64_t p = 0; p < visible; ++p) {
          scores[p] = std::exp(scores[p] - max_score);
          sum += scores[p];
        }
        float* o = out->f32() + (i * heads + h) * d;
        std::fill(o, o + d, 0.f);
        for (int64_t p = 0; p < visible; ++p) {
          const float w = scores[p] / sum;
          const float* vv = v_cache.f32() + (p * kv_heads + kvh) * d;
          for (int64_t j = 0; j < d; ++j) o[j] += w * vv[j];
        }
      }
    }
  }

  void SiluMul(const Tensor& gate, const Tensor& up, Tensor* out) override {
    const int64_t n = gate.num_elements();
    const float* g = gate.f32();
    const float* u = up.f32();
    float* o = out->f32();
    for (int64_t i = 0; i < n; ++i) o[i] = g[i] / (1.f + std::exp(-g[i])) * u[i];
  }

  void Add(const Tensor& x, Tensor* inout) override {
    const int64_t n = x.num_elements();
    const float* a = x.f32();
    float* b = inout->f32();
    for (int64_t i = 0; i < n; ++i) b[i] += a[i];
  }

  void GatherRows(const Tensor& src, const std::vector<int32_t>& rows, Tensor* dst) override {
    const int64_t d = src.row_size();
    if (src.dtype() != DType::kF32) {
      // Rows in a narrower dtype (bf16 from the wire) are widened as they are gathered.
      const size_t row_bytes = static_cast<size_t>(d) * DTypeSize(src.dtype());
      const uint8_t* base = static_cast<const uint8_t*>(src.raw());
      for (size_t i = 0; i < rows.size(); ++i) {
        WidenToFloat32(src.dtype(), base + static_cast<int64_t>(rows[i]) * row_bytes, d,
                       dst->f32() + i * d);
      }
      return;
    }
    for (size_t i = 0; i < rows.size(); ++i) {
      std::memcpy(dst->f32() + i * d, src.f32() + static_cast<int64_t>(rows[i]) * d,
                  d * sizeof(float));
    }
  }

  void ScaleAddRows(const Tensor& src, const std::vector<float>& scales,
                    const std::vector<int32_t>& rows, Tensor* dst) override {
    const int64_t d = src.row_size();
    for (size_t i = 0; i < rows.size(); ++i) {
      const float* s = src.f32() + i * d;
      float* o = dst->f32() + static_cast<int64_t>(rows[i]) * d;
      const float w = scales[i];
      for (int64_t j = 0; j < d; ++j) o[j] += w * s[j];
    }
  }

  absl::Status TopKSoftmax(const Tensor& logits, int top_k, bool normalize,
                           std::vector<int32_t>* ids, std::vector<float>* weights) override {
    const int64_t tokens = logits.rows();
    const int64_t experts = logits.row_size();
    ids->resize(std::max<int64_t>(tokens * std::max(top_k, 0), 0));
    weights->resize(ids->size());
    return TopKSoftmaxCpu(logits.f32(), tokens, experts, top_k, normalize, ids->data(),
                          weights->data());
  }
};

}  // namespace

std::unique_ptr<Backend> MakeCpuBackend() { return std::make_unique<CpuBackend>(); }

}  // namespace dxs
