// Backend: the compute interface the model is written against.
//
// A backend owns device memory (Allocate/Upload/Download) and implements each operation
// the Qwen3-MoE forward pass needs. The model never touches element pointers itself, so a
// CUDA backend slots in without changing model code. All tensors are row-major.
//
// Empty batches: every operation accepts zero rows and then does nothing (no kernel
// launch). TopKSoftmax additionally validates its arguments and returns a Status.
//
// Thread safety: a Backend may be shared by threads that operate on distinct tensors.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "kernels/tensor.h"

namespace dxs {

class Backend {
 public:
  virtual ~Backend() = default;
  virtual std::string name() const = 0;
  virtual Device device() const = 0;

  // Memory. Allocate returns uninitialised memory; Zeros zero-fills.
  virtual Tensor Allocate(std::vector<int64_t> shape) = 0;
  virtual Tensor Zeros(std::vector<int64_t> shape) = 0;
  virtual Tensor Upload(const std::vector<float>& host, std::vector<int64_t> shape) = 0;
  virtual std::vector<float> Download(const Tensor& t) = 0;
  virtual void Fill(Tensor* t, float value) = 0;

  // y[m, n] = x[m, k] * w[n, k]^T (+ bias[n] when given). The GEMM.
  virtual void Linear(const Tensor& x, const Tensor& w, const Tensor* bias, Tensor* y) = 0;
  // y = x * rsqrt(mean(x^2) + eps) * weight over rows of weight.num_elements() values.
  virtual void RmsNorm(const Tensor& x, const Tensor& weight, float eps, Tensor* y) = 0;
  // y[i] = table[ids[i]]; ids are host values already checked against the table.
  virtual void Embedding(const Tensor& table, const std::vector<int32_t>& ids, Tensor* y) = 0;
  // Rotary embedding, rotate-half layout, in place on x[tokens, heads, head_dim].
  virtual void Rope(Tensor* x, const std::vector<int64_t>& positions, double theta) = 0;
  // dst rows [dst_row, dst_row + src.rows()) = src.
  virtual void CopyRows(const Tensor& src, Tensor* dst, int64_t dst_row) = 0;
  // Causal attention for one sequence. q[n, heads, d]; caches [capacity, kv_heads, d] hold
  // past_len + n valid rows; query i sees positions [0, past_len + i]. out[n, heads * d].
  virtual void Attention(const Tensor& q, const Tensor& k_cache, const Tensor& v_cache,
                         int64_t past_len, float scale, Tensor* out) = 0;
  // out = silu(gate) * up, elementwise.
  virtual void SiluMul(const Tensor& gate, const Tensor& up, Tensor* out) = 0;
  // inout += x, elementwise.
  virtual void Add(const Tensor& x, Tensor* inout) = 0;
  // dst[i] = src[rows[i]]. The CPU backend also gathers from host tensors of a narrower
  // dtype (AllocateHostTensor; bf16 wire rows), widening them.
  virtual void GatherRows(const Tensor& src, const std::vector<int32_t>& rows, Tensor* dst) = 0;
  // dst[rows[i]] += scales[i] * src[i], in order of i (the fixed summation order).
  virtual void ScaleAddRows(const Tensor& src, const std::vector<float>& scales,
                            const std::vector<int32_t>& rows, Tensor* dst) = 0;

  // Router: softmax over logits[tokens, num_experts] (float32), then the top_k largest
  // (ties to the lower expert id), renormalised to sum 1 when `normalize`. Writes
  // ids/weights[tokens * top_k] in descending weight order. Zero tokens returns at once;
  // top_k <= 0, num_experts <= 0 or top_k > num_experts is INVALID_ARGUMENT.
  virtual absl::Status TopKSoftmax(const Tensor& logits, int top_k, bool normalize,
                                   std::vector<int32_t>* ids, std::vector<float>* weights) = 0;
};

// The CPU backend: float32, OpenBLAS for GEMM, threads sized to the machine.
std::unique_ptr<Backend> MakeCpuBackend();

}  // namespace dxs
