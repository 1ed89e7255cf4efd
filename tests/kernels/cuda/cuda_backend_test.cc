// CudaBackend against CpuBackend, op by op through the Backend interface: the same host
// inputs go to both, outputs of the CUDA op are poisoned (NaN / 0xFF) before it runs, and
// results are compared (index outputs exactly, floating ones within bf16 error). Zero rows
// for every op. The device-selection errors run everywhere; the rest skip without a GPU.
#include "kernels/cuda/cuda_backend.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/backend.h"
#include "kernels/make_backend.h"
#include "kernels/sampling.h"

namespace dxs {
namespace {

TEST(CudaBackendDevice, NamesAreCheckedAndAMissingGpuIsFailedPrecondition) {
  EXPECT_EQ(MakeBackend("tpu").status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(MakeBackend("cuda:x").status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(MakeBackend("cuda:-1").status().code(), absl::StatusCode::kInvalidArgument);
  absl::StatusOr<std::unique_ptr<Backend>> far = MakeBackend("cuda:64");
  ASSERT_FALSE(far.ok());
  EXPECT_EQ(far.status().code(), absl::StatusCode::kFailedPrecondition) << far.status();
  if (CudaDeviceCount() == 0) {
    absl::StatusOr<std::unique_ptr<Backend>> none = MakeBackend("cuda");
    ASSERT_FALSE(none.ok());
    EXPECT_EQ(none.status().code(), absl::StatusCode::kFailedPrecondition) << none.status();
    EXPECT_NE(none.status().message().find("GPU"), std::string::npos) << none.status();
  }
  ASSERT_TRUE(MakeBackend("cpu").ok());
}

std::vector<float> RandomFloats(size_t n, uint32_t seed, float scale = 1.f) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> dist(0.f, scale);
  std::vector<float> v(n);
  for (float& x : v) x = dist(rng);
  return v;
}

// Rounds through bf16, so that both backends start from identical values.
std::vector<float> Bf16Exact(std::vector<float> v) {
  for (float& x : v) x = Bf16ToFloat(FloatToBf16(x));
  return v;
}

double MaxRelError(const std::vector<float>& got, const std::vector<float>& want) {
  double diff = 0, ref = 1e-6;
  for (size_t i = 0; i < want.size(); ++i) {
    if (std::isnan(got[i])) return INFINITY;
    diff = std::max(diff, std::fabs(static_cast<double>(got[i]) - want[i]));
    ref = std::max(ref, std::fabs(static_cast<double>(want[i])));
  }
  return diff / ref;
}

class CudaBackendTest : public ::testing::Test {
 protected:
  void SetUp() override {
    absl::StatusOr<std::unique_ptr<Backend>> gpu = MakeBackend("cuda");
    if (!gpu.ok()) GTEST_SKIP() << "no GPU here: " << gpu.status().message();
    gpu_ = std::move(*gpu);
    cpu_ = MakeCpuBackend();
  }

  // A tensor on `b` holding `host` (floats) in `dtype`.
  Tensor Put(Backend* b, const std::vector<float>& host, std::vector<int64_t> shape, DType dtype) {
    absl::StatusOr<Tensor> t = b->Allocate(std::move(shape), dtype);
    EXPECT_TRUE(t.ok()) << t.status();
    EXPECT_TRUE(b->CopyFromHost(host.data(), DType::kF32, &*t).ok());
    return *t;
  }
  Tensor PutIndices(Backend* b, const std::vector<int32_t>& host) {
    absl::StatusOr<Tensor> t = b->UploadIndices(host);
    EXPECT_TRUE(t.ok()) << t.status();
    return *t;
  }
  // An output on `b`, poisoned: NaN for floating types, all-ones bits for indices.
  Tensor Poisoned(Backend* b, std::vector<int64_t> shape, DType dtype) {
    absl::StatusOr<Tensor> t = b->Allocate(std::move(shape), dtype);
    EXPECT_TRUE(t.ok()) << t.status();
    EXPECT_TRUE(b->Fill(&*t, IsFloatDType(dtype) ? NAN : -1.f).ok());
    return *t;
  }
  std::vector<float> Get(Backend* b, const Tensor& t) {
    absl::StatusOr<std::vector<float>> v = b->Download(t);
    EXPECT_TRUE(v.ok()) << v.status();
    return v.ok() ? *v : std::vector<float>{};
  }
  std::vector<int32_t> GetIndices(Backend* b, const Tensor& t) {
    absl::StatusOr<std::vector<int32_t>> v = b->DownloadIndices(t);
    EXPECT_TRUE(v.ok()) << v.status();
    return v.ok() ? *v : std::vector<int32_t>{};
  }

  // Seeded random experts on each (backend, dtype), the same bf16-exact values on all:
  // expert e's gate_up [2 * inter, hidden] from seed gate_seed + e, its down [hidden, inter]
  // from down_seed + e. gate_up[b] / down[b] are GroupedSwiGlu's tables on backend b.
  struct ExpertSets {
    std::vector<std::vector<Tensor>> tensors;  // [backend]: each gate_up, then each down
    std::vector<std::vector<const Tensor*>> gate_up, down;
  };
  ExpertSets PutExperts(const std::vector<std::pair<Backend*, DType>>& on, int64_t experts,
                        int64_t hidden, int64_t inter, uint32_t gate_seed, uint32_t down_seed) {
    ExpertSets sets;
    sets.tensors.assign(on.size(), std::vector<Tensor>(2 * experts));
    for (int64_t e = 0; e < experts; ++e) {
      const std::vector<float> gate_up =
          Bf16Exact(RandomFloats(2 * inter * hidden, gate_seed + e, 0.02f));
      const std::vector<float> down = Bf16Exact(RandomFloats(hidden * inter, down_seed + e, 0.02f));
      for (size_t b = 0; b < on.size(); ++b) {
        sets.tensors[b][e] = Put(on[b].first, gate_up, {2 * inter, hidden}, on[b].second);
        sets.tensors[b][experts + e] = Put(on[b].first, down, {hidden, inter}, on[b].second);
      }
    }
    sets.gate_up.resize(on.size());
    sets.down.resize(on.size());
    for (size_t b = 0; b < on.size(); ++b) {
      for (int64_t e = 0; e < experts; ++e) {
        sets.gate_up[b].push_back(&sets.tensors[b][e]);
        sets.down[b].push_back(&sets.tensors[b][experts + e]);
      }
    }
    return sets;
  }

  std::unique_ptr<Backend> gpu_, cpu_;
};

// AllocateShared / OpenShared (the one-copy exchange's GPU regions): a block this process
// shares opens as itself here (CUDA refuses a process its own IPC handles; another process
// opens it through cudaIpcOpenMemHandle, which gpu_cluster_test runs); bad keys are refused;
// the CPU backend shares nothing.
TEST_F(CudaBackendTest, SharedBlocksOpenByTheirKey) {
  absl::StatusOr<SharedMemory> shared = gpu_->AllocateShared(1 << 20);
  ASSERT_TRUE(shared.ok()) << shared.status();
  EXPECT_EQ(shared->buffer->device(), Device::kCuda);
  EXPECT_GE(shared->buffer->num_bytes(), size_t{1} << 20);
  absl::StatusOr<std::shared_ptr<Buffer>> opened = gpu_->OpenShared(shared->key);
  ASSERT_TRUE(opened.ok()) << opened.status();
  EXPECT_EQ((*opened)->data(), shared->buffer->data());
  // Written through one view, read through the other.
  Tensor a(shared->buffer, DType::kF32, {256});
  Tensor b(*opened, DType::kF32, {256});
  std::vector<float> values(256);
  for (int i = 0; i < 256; ++i) values[i] = 0.5f + i;
  ASSERT_TRUE(gpu_->CopyFromHost(values.data(), DType::kF32, &a).ok());
  std::vector<float> back(256, -1.f);
  ASSERT_TRUE(gpu_->CopyToHost(b, DType::kF32, back.data()).ok());
  EXPECT_EQ(back, values);
  EXPECT_EQ(gpu_->OpenShared("short").status().code(), absl::StatusCode::kInvalidArgument);
  std::string other = shared->key;
  other[other.size() - 1] ^= 0x40;  // the address: no block of this process
  EXPECT_EQ(gpu_->OpenShared(other).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(cpu_->AllocateShared(64).status().code(), absl::StatusCode::kUnimplemented);
  EXPECT_EQ(cpu_->OpenShared(shared->key).status().code(), absl::StatusCode::kUnimplemented);
}

TEST_F(CudaBackendTest, CopiesConvertBetweenDtypes) {
  const std::vector<float> v = RandomFloats(1000, 1);
  for (DType dtype : {DType::kF32, DType::kBF16, DType::kF16}) {
    Tensor t = Put(gpu_.get(), v, {10, 100}, dtype);
    std::vector<float> back = Get(gpu_.get(), t);
    EXPECT_LT(MaxRelError(back, v), dtype == DType::kF32 ? 1e-7 : 1e-2) << DTypeName(dtype);
    Tensor wide = Poisoned(gpu_.get(), {1000}, DType::kF32);
    ASSERT_TRUE(gpu_->Copy(t, &wide).ok());
    EXPECT_EQ(Get(gpu_.get(), wide), back);
  }
  Tensor i64 = Poisoned(gpu_.get(), {3}, DType::kI64);
  const std::vector<int64_t> host = {1, -2, int64_t{1} << 40};
  ASSERT_TRUE(gpu_->CopyFromHost(host.data(), DType::kI64, &i64).ok());
  std::vector<int64_t> out(3);
  ASSERT_TRUE(gpu_->CopyToHost(i64, DType::kI64, out.data()).ok());
  EXPECT_EQ(out, host);
  EXPECT_EQ(gpu_->CopyToHost(i64, DType::kF32, out.data()).code(),
            absl::StatusCode::kInvalidArgument);
}

// Up to cuda::kGemvMaxRows rows without a bias run gemv.cu, else cuBLAS; k = 260 is not a
// multiple of 8, so cuBLAS at every m.
TEST_F(CudaBackendTest, LinearMatchesTheCpu) {
  for (const auto& [m, k] : std::vector<std::pair<int64_t, int64_t>>{
           {0, 256}, {1, 256}, {2, 256}, {7, 256}, {8, 256}, {9, 256}, {300, 256}, {1, 260}}) {
    SCOPED_TRACE(::testing::Message() << "m " << m << " k " << k);
    const int64_t n = 384;
    const std::vector<float> x = Bf16Exact(RandomFloats(m * k, 2));
    const std::vector<float> w = Bf16Exact(RandomFloats(n * k, 3, 0.05f));
    const std::vector<float> bias = Bf16Exact(RandomFloats(n, 4));
    Tensor cx = Put(cpu_.get(), x, {m, k}, DType::kF32),
           cw = Put(cpu_.get(), w, {n, k}, DType::kF32);
    Tensor cb = Put(cpu_.get(), bias, {n}, DType::kF32);
    Tensor cy = Poisoned(cpu_.get(), {m, n}, DType::kF32);
    ASSERT_TRUE(cpu_->Linear(cx, cw, &cb, &cy).ok());
    Tensor cy_no_bias = Poisoned(cpu_.get(), {m, n}, DType::kF32);
    ASSERT_TRUE(cpu_->Linear(cx, cw, nullptr, &cy_no_bias).ok());
    for (DType out : {DType::kBF16, DType::kF32}) {
      Tensor gx = Put(gpu_.get(), x, {m, k}, DType::kBF16);
      Tensor gw = Put(gpu_.get(), w, {n, k}, DType::kBF16);
      Tensor gb = Put(gpu_.get(), bias, {n}, DType::kBF16);
      Tensor gy = Poisoned(gpu_.get(), {m, n}, out);
      ASSERT_TRUE(gpu_->Linear(gx, gw, &gb, &gy).ok());
      EXPECT_LT(MaxRelError(Get(gpu_.get(), gy), Get(cpu_.get(), cy)), 1e-2);
      Tensor no_bias = Poisoned(gpu_.get(), {m, n}, out);
      ASSERT_TRUE(gpu_->Linear(gx, gw, nullptr, &no_bias).ok());
      EXPECT_LT(MaxRelError(Get(gpu_.get(), no_bias), Get(cpu_.get(), cy_no_bias)), 1e-2);
    }
  }
}

// Linears: q, k and v of one input, in one gemv.cu launch up to cuda::kGemvMaxRows rows,
// else a Linear each; every output equals the CPU's Linear.
TEST_F(CudaBackendTest, LinearsMatchTheCpu) {
  const int64_t k = 512;
  for (int64_t m : {0, 1, 3, 8, 9}) {
    SCOPED_TRACE(::testing::Message() << "m " << m);
    const std::vector<float> x = Bf16Exact(RandomFloats(m * k, 31));
    std::vector<Tensor> gw, gy;
    std::vector<std::vector<float>> want;
    for (int64_t n : {640, 128, 136}) {
      const std::vector<float> w = Bf16Exact(RandomFloats(n * k, 32 + n, 0.05f));
      Tensor cy = Poisoned(cpu_.get(), {m, n}, DType::kF32);
      ASSERT_TRUE(cpu_->Linear(Put(cpu_.get(), x, {m, k}, DType::kF32),
                               Put(cpu_.get(), w, {n, k}, DType::kF32), nullptr, &cy)
                      .ok());
      want.push_back(Get(cpu_.get(), cy));
      gw.push_back(Put(gpu_.get(), w, {n, k}, DType::kBF16));
      gy.push_back(Poisoned(gpu_.get(), {m, n}, DType::kBF16));
    }
    ASSERT_TRUE(gpu_->Linears(Put(gpu_.get(), x, {m, k}, DType::kBF16), {&gw[0], &gw[1], &gw[2]},
                              {&gy[0], &gy[1], &gy[2]})
                    .ok());
    for (size_t i = 0; i < gy.size(); ++i) {
      EXPECT_LT(MaxRelError(Get(gpu_.get(), gy[i]), want[i]), 1e-2) << "output " << i;
    }
  }
}

TEST_F(CudaBackendTest, DenseOpsMatchTheCpu) {
  const int64_t t = 37, heads = 4, d = 128, hidden = heads * d;
  const std::vector<float> x = Bf16Exact(RandomFloats(t * hidden, 5));
  const std::vector<float> w = Bf16Exact(RandomFloats(d, 6));
  const std::vector<float> u = Bf16Exact(RandomFloats(t * hidden, 7));
  std::vector<int32_t> positions(t);
  for (int64_t i = 0; i < t; ++i) positions[i] = static_cast<int32_t>(3 * i + 11);
  for (DType dtype : {DType::kF32, DType::kBF16}) {
    SCOPED_TRACE(DTypeName(dtype));
    const double tol = dtype == DType::kF32 ? 1e-5 : 1e-2;
    // RmsNorm over per-head rows of d (the q/k norm) and over whole rows.
    for (int64_t cols : {d, hidden}) {
      const std::vector<float> wc = Bf16Exact(RandomFloats(cols, 8));
      Tensor cy = Poisoned(cpu_.get(), {t, hidden}, DType::kF32);
      ASSERT_TRUE(cpu_->RmsNorm(Put(cpu_.get(), x, {t, hidden}, DType::kF32),
                                Put(cpu_.get(), wc, {cols}, DType::kF32), 1e-6f, &cy)
                      .ok());
      Tensor gy = Poisoned(gpu_.get(), {t, hidden}, dtype);
      ASSERT_TRUE(gpu_->RmsNorm(Put(gpu_.get(), x, {t, hidden}, dtype),
                                Put(gpu_.get(), wc, {cols}, dtype), 1e-6f, &gy)
                      .ok());
      EXPECT_LT(MaxRelError(Get(gpu_.get(), gy), Get(cpu_.get(), cy)), tol) << cols;
    }
    {  // Rope in place.
      Tensor cx = Put(cpu_.get(), x, {t, heads, d}, DType::kF32);
      Tensor gx = Put(gpu_.get(), x, {t, heads, d}, dtype);
      ASSERT_TRUE(cpu_->Rope(&cx, PutIndices(cpu_.get(), positions), 1e6).ok());
      ASSERT_TRUE(gpu_->Rope(&gx, PutIndices(gpu_.get(), positions), 1e6).ok());
      EXPECT_LT(MaxRelError(Get(gpu_.get(), gx), Get(cpu_.get(), cx)), tol);
    }
    {  // SiluMul and Add.
      Tensor cy = Poisoned(cpu_.get(), {t, hidden}, DType::kF32);
      Tensor gy = Poisoned(gpu_.get(), {t, hidden}, dtype);
      ASSERT_TRUE(cpu_->SiluMul(Put(cpu_.get(), x, {t, hidden}, DType::kF32),
                                Put(cpu_.get(), u, {t, hidden}, DType::kF32), &cy)
                      .ok());
      ASSERT_TRUE(gpu_->SiluMul(Put(gpu_.get(), x, {t, hidden}, dtype),
                                Put(gpu_.get(), u, {t, hidden}, dtype), &gy)
                      .ok());
      EXPECT_LT(MaxRelError(Get(gpu_.get(), gy), Get(cpu_.get(), cy)), tol);
      ASSERT_TRUE(cpu_->Add(Put(cpu_.get(), u, {t, hidden}, DType::kF32), &cy).ok());
      ASSERT_TRUE(gpu_->Add(Put(gpu_.get(), u, {t, hidden}, dtype), &gy).ok());
      EXPECT_LT(MaxRelError(Get(gpu_.get(), gy), Get(cpu_.get(), cy)), tol);
    }
    {  // Embedding and GatherRows (narrowing into the wire dtype and widening back).
      std::vector<int32_t> ids = {5, 0, 36, 5, 17};
      Tensor cy = Poisoned(cpu_.get(), {5, hidden}, DType::kF32);
      Tensor gy = Poisoned(gpu_.get(), {5, hidden}, dtype);
      ASSERT_TRUE(cpu_->Embedding(Put(cpu_.get(), x, {t, hidden}, DType::kF32),
                                  PutIndices(cpu_.get(), ids), &cy)
                      .ok());
      ASSERT_TRUE(
          gpu_->Embedding(Put(gpu_.get(), x, {t, hidden}, dtype), PutIndices(gpu_.get(), ids), &gy)
              .ok());
      EXPECT_EQ(Get(gpu_.get(), gy), Get(cpu_.get(), cy));
      Tensor narrow = Poisoned(gpu_.get(), {5, hidden}, DType::kBF16);
      ASSERT_TRUE(gpu_->GatherRows(Put(gpu_.get(), x, {t, hidden}, dtype),
                                   PutIndices(gpu_.get(), ids), &narrow)
                      .ok());
      EXPECT_EQ(Get(gpu_.get(), narrow), Get(cpu_.get(), cy));
    }
  }
  // Zero rows: every op accepts them and leaves the output alone.
  Tensor empty = Poisoned(gpu_.get(), {0, hidden}, DType::kBF16);
  Tensor w0 = Put(gpu_.get(), std::vector<float>(hidden, 1.f), {hidden}, DType::kBF16);
  EXPECT_TRUE(gpu_->RmsNorm(empty, w0, 1e-6f, &empty).ok());
  EXPECT_TRUE(gpu_->Add(empty, &empty).ok());
  EXPECT_TRUE(gpu_->SiluMul(empty, empty, &empty).ok());
  Tensor no_rows = PutIndices(gpu_.get(), {});
  EXPECT_TRUE(gpu_->GatherRows(w0.Reshape({1, hidden}), no_rows, &empty).ok());
  EXPECT_TRUE(gpu_->Embedding(w0.Reshape({1, hidden}), no_rows, &empty).ok());
  EXPECT_TRUE(gpu_->Synchronize().ok());
}

// Several sequences in one call: a prefill chunk over a cached prefix, a whole prompt and
// decode tokens, GQA 4:1, blocks scattered through the pool.
// The engine's presets' shapes too: (6, 2, 24) is the odd preset's GQA 3 with head_dim 24.
class CudaPagedAttentionTest : public CudaBackendTest,
                               public ::testing::WithParamInterface<std::tuple<int, int, int>> {};

TEST_P(CudaPagedAttentionTest, MatchesTheCpu) {
  const int64_t heads = std::get<0>(GetParam()), kv_heads = std::get<1>(GetParam()),
                d = std::get<2>(GetParam()), bs = 16, num_blocks = 64;
  const std::vector<int32_t> query_lens = {5, 1, 19, 1};
  const std::vector<int32_t> context_lens = {40, 77, 19, 1};
  const int64_t num_seqs = 4, max_blocks = 5;
  std::vector<int32_t> tables(num_seqs * max_blocks, 0), query_start = {0};
  std::mt19937 rng(9);
  std::vector<int32_t> pool(num_blocks);
  for (int i = 0; i < num_blocks; ++i) pool[i] = i;
  std::shuffle(pool.begin(), pool.end(), rng);
  for (int64_t s = 0, next = 0; s < num_seqs; ++s) {
    query_start.push_back(query_start.back() + query_lens[s]);
    for (int64_t b = 0; b * bs < context_lens[s]; ++b) tables[s * max_blocks + b] = pool[next++];
  }
  const int64_t tokens = query_start.back();
  std::vector<int64_t> slots;
  for (int64_t s = 0; s < num_seqs; ++s) {
    for (int32_t i = 0; i < query_lens[s]; ++i) {
      const int64_t pos = context_lens[s] - query_lens[s] + i;
      slots.push_back(int64_t{tables[s * max_blocks + pos / bs]} * bs + pos % bs);
    }
  }
  const std::vector<float> cache_init = Bf16Exact(RandomFloats(num_blocks * bs * kv_heads * d, 10));
  const std::vector<float> q = Bf16Exact(RandomFloats(tokens * heads * d, 11));
  const std::vector<float> k = Bf16Exact(RandomFloats(tokens * kv_heads * d, 12));
  const std::vector<float> v = Bf16Exact(RandomFloats(tokens * kv_heads * d, 13));
  auto run = [&](Backend* b, DType dtype) {
    PagedAttentionMeta meta;
    meta.num_seqs = num_seqs;
    meta.block_size = bs;
    meta.max_blocks_per_seq = max_blocks;
    meta.max_query_len = 19;
    meta.max_context_len = 77;
    meta.query_start = PutIndices(b, query_start);
    meta.context_lens = PutIndices(b, context_lens);
    meta.block_tables = PutIndices(b, tables);
    meta.slot_mapping = *b->Allocate({tokens}, DType::kI64);
    EXPECT_TRUE(b->CopyFromHost(slots.data(), DType::kI64, &meta.slot_mapping).ok());
    Tensor kc = Put(b, cache_init, {num_blocks, bs, kv_heads, d}, dtype);
    Tensor vc = Put(b, cache_init, {num_blocks, bs, kv_heads, d}, dtype);
    EXPECT_TRUE(b->WriteKvCache(Put(b, k, {tokens, kv_heads, d}, dtype),
                                Put(b, v, {tokens, kv_heads, d}, dtype), meta, &kc, &vc)
                    .ok());
    Tensor out = Poisoned(b, {tokens, heads * d}, dtype);
    absl::Status s = b->PagedAttention(Put(b, q, {tokens, heads, d}, dtype), kc, vc, meta,
                                       1.f / std::sqrt(static_cast<float>(d)), &out);
    EXPECT_TRUE(s.ok()) << s;
    return std::make_pair(Get(b, out), Get(b, kc));
  };
  const auto want = run(cpu_.get(), DType::kF32);
  for (DType dtype : {DType::kF32, DType::kBF16}) {
    SCOPED_TRACE(DTypeName(dtype));
    const auto got = run(gpu_.get(), dtype);
    EXPECT_EQ(got.second, want.second);  // the cache writes are exact (inputs are bf16 values)
    EXPECT_LT(MaxRelError(got.first, want.first), dtype == DType::kF32 ? 1e-4 : 2e-2);
  }
}

// An empty step (a DP rank with no requests) may come before its KV cache has a page: with
// no tokens, WriteKvCache and PagedAttention take a cache never allocated and launch
// nothing, on the GPU as on the CPU (gpu_cluster_test's empty DP rank found the GPU refusing).
TEST_F(CudaBackendTest, AnEmptyStepNeedsNoCache) {
  for (Backend* b : {cpu_.get(), gpu_.get()}) {
    SCOPED_TRACE(b->name());
    PagedAttentionMeta meta;
    meta.num_seqs = 0;
    meta.block_size = 16;
    meta.max_blocks_per_seq = 0;
    meta.query_start = PutIndices(b, {0});
    meta.context_lens = *b->Allocate({0}, DType::kI32);
    meta.block_tables = *b->Allocate({0}, DType::kI32);
    meta.slot_mapping = *b->Allocate({0}, DType::kI64);
    const DType dtype = b == gpu_.get() ? DType::kBF16 : DType::kF32;
    Tensor q = *b->Allocate({0, 4, 32}, dtype);
    Tensor k = *b->Allocate({0, 2, 32}, dtype);
    Tensor out = *b->Allocate({0, 4 * 32}, dtype);
    Tensor k_cache, v_cache;  // never allocated
    absl::Status written = b->WriteKvCache(k, k, meta, &k_cache, &v_cache);
    EXPECT_TRUE(written.ok()) << written;
    absl::Status attended = b->PagedAttention(q, k_cache, v_cache, meta, 0.125f, &out);
    EXPECT_TRUE(attended.ok()) << attended;
    Tensor w = *b->Allocate({32}, dtype);
    Tensor positions = *b->Allocate({0}, DType::kI32);
    absl::Status fused =
        b->QkNormRopeWriteKv(&q, &k, k, w, w, 1e-6f, positions, 1e4, meta, &k_cache, &v_cache);
    EXPECT_TRUE(fused.ok()) << fused;
  }
}

// QkNormRopeWriteKv in one kernel gives the bits of QkNormRope then WriteKvCache (the
// default, which DXS_CUDA_FUSED_KV_WRITE=off runs) and the CPU's values within bf16 error:
// q and k rotated in place, k and v in the caches at their slots, a padding token (slot -1)
// caching nothing; bf16 and f32, the vector path (head_dim 128, 64) and the scalar one (96).
TEST_F(CudaBackendTest, QkNormRopeWriteKvEqualsTheTwoOps) {
  struct Shape {
    int64_t tokens, q_heads, k_heads, d;
    DType dtype;
  };
  for (const Shape& s : {Shape{1, 32, 4, 128, DType::kBF16}, Shape{5, 8, 2, 64, DType::kBF16},
                         Shape{3, 4, 2, 96, DType::kF32}}) {
    SCOPED_TRACE(::testing::Message() << s.tokens << " tokens, " << s.q_heads << "/" << s.k_heads
                                      << " heads of " << s.d);
    const int64_t bs = 16, blocks = 4, row = s.k_heads * s.d;
    std::vector<int64_t> slots;
    std::vector<int32_t> positions;
    for (int64_t t = 0; t < s.tokens; ++t) {
      slots.push_back(t == 1 ? -1 : (t * 7 + 3) % (blocks * bs));
      positions.push_back(static_cast<int32_t>(t * 13 + 5));
    }
    const std::vector<float> q = Bf16Exact(RandomFloats(s.tokens * s.q_heads * s.d, 71));
    const std::vector<float> k = Bf16Exact(RandomFloats(s.tokens * row, 72));
    const std::vector<float> v = Bf16Exact(RandomFloats(s.tokens * row, 73));
    std::vector<float> qw = Bf16Exact(RandomFloats(s.d, 74, 0.1f)), kw = qw;
    for (float& x : qw) x = Bf16ToFloat(FloatToBf16(1.f + x));
    for (float& x : kw) x = Bf16ToFloat(FloatToBf16(1.f - x));
    struct Run {
      Tensor q, k, k_cache, v_cache;
    };
    auto run = [&](Backend* b, DType dtype, bool fused) {
      PagedAttentionMeta meta;
      meta.num_seqs = 1;
      meta.block_size = bs;
      meta.max_blocks_per_seq = blocks;
      meta.query_start = PutIndices(b, {0, static_cast<int32_t>(s.tokens)});
      meta.context_lens = PutIndices(b, {static_cast<int32_t>(s.tokens)});
      meta.block_tables = PutIndices(b, {0, 1, 2, 3});
      meta.slot_mapping = *b->Allocate({s.tokens}, DType::kI64);
      EXPECT_TRUE(b->CopyFromHost(slots.data(), DType::kI64, &meta.slot_mapping).ok());
      Run r;
      r.q = Put(b, q, {s.tokens, s.q_heads, s.d}, dtype);
      r.k = Put(b, k, {s.tokens, s.k_heads, s.d}, dtype);
      const Tensor vt = Put(b, v, {s.tokens, s.k_heads, s.d}, dtype);
      const Tensor qwt = Put(b, qw, {s.d}, dtype), kwt = Put(b, kw, {s.d}, dtype);
      const Tensor pos = PutIndices(b, positions);
      for (Tensor* c : {&r.k_cache, &r.v_cache}) {
        *c = *b->Allocate({blocks, bs, s.k_heads, s.d}, dtype);
        EXPECT_TRUE(b->Fill(c, -7.f).ok());  // what a skipped slot keeps
      }
      absl::Status st;
      if (fused) {
        st = b->QkNormRopeWriteKv(&r.q, &r.k, vt, qwt, kwt, 1e-6f, pos, 1e6, meta, &r.k_cache,
                                  &r.v_cache);
      } else {
        st = b->QkNormRope(&r.q, &r.k, qwt, kwt, 1e-6f, pos, 1e6);
        if (st.ok()) st = b->WriteKvCache(r.k, vt, meta, &r.k_cache, &r.v_cache);
      }
      EXPECT_TRUE(st.ok()) << st;
      return r;
    };
    const Run fused = run(gpu_.get(), s.dtype, true);
    const Run apart = run(gpu_.get(), s.dtype, false);
    const Run cpu = run(cpu_.get(), DType::kF32, false);
    for (const auto& [name, got, want, ref] :
         {std::tuple{"q", &fused.q, &apart.q, &cpu.q}, std::tuple{"k", &fused.k, &apart.k, &cpu.k},
          std::tuple{"k_cache", &fused.k_cache, &apart.k_cache, &cpu.k_cache},
          std::tuple{"v_cache", &fused.v_cache, &apart.v_cache, &cpu.v_cache}}) {
      SCOPED_TRACE(name);
      const std::vector<float> g = Get(gpu_.get(), *got);
      EXPECT_EQ(g, Get(gpu_.get(), *want));
      EXPECT_LT(MaxRelError(g, Get(cpu_.get(), *ref)), 2e-2);
    }
    // Every token but the padding one reached the caches: its k and v rows, nothing else.
    const std::vector<float> kc = Get(gpu_.get(), fused.k_cache);
    const int64_t written = std::count_if(kc.begin(), kc.end(), [](float x) { return x != -7.f; });
    EXPECT_EQ(written, (s.tokens > 1 ? s.tokens - 1 : s.tokens) * row);
  }
}

INSTANTIATE_TEST_SUITE_P(Shapes, CudaPagedAttentionTest,
                         ::testing::Values(std::make_tuple(8, 2, 128), std::make_tuple(6, 2, 24),
                                           std::make_tuple(4, 2, 32), std::make_tuple(4, 1, 16),
                                           std::make_tuple(32, 4, 128), std::make_tuple(8, 8, 64)));

TEST_F(CudaBackendTest, RoutingAndTheExchangeMatchTheCpu) {
  const int64_t experts = 128, top_k = 8, hidden = 256;
  for (int64_t tokens : {0, 1, 300}) {
    for (int ranks : {1, 3, 8}) {
      SCOPED_TRACE(::testing::Message() << tokens << " tokens, " << ranks << " ranks");
      const std::vector<float> logits = RandomFloats(tokens * experts, 20 + tokens);
      std::vector<int32_t> owner(experts);
      for (int64_t e = 0; e < experts; ++e) owner[e] = static_cast<int32_t>((e * 7) % ranks);
      if (ranks == 8) std::replace(owner.begin(), owner.end(), 5, 6);  // rank 5 holds nothing
      DispatchLayoutTensors cl, gl;
      Tensor cids = Poisoned(cpu_.get(), {tokens, top_k}, DType::kI32);
      Tensor cw = Poisoned(cpu_.get(), {tokens, top_k}, DType::kF32);
      Tensor gids = Poisoned(gpu_.get(), {tokens, top_k}, DType::kI32);
      Tensor gw = Poisoned(gpu_.get(), {tokens, top_k}, DType::kF32);
      ASSERT_TRUE(cpu_->TopKSoftmax(Put(cpu_.get(), logits, {tokens, experts}, DType::kF32),
                                    static_cast<int>(top_k), true, &cids, &cw)
                      .ok());
      ASSERT_TRUE(gpu_->TopKSoftmax(Put(gpu_.get(), logits, {tokens, experts}, DType::kF32),
                                    static_cast<int>(top_k), true, &gids, &gw)
                      .ok());
      ASSERT_EQ(GetIndices(gpu_.get(), gids), GetIndices(cpu_.get(), cids));
      EXPECT_LT(MaxRelError(Get(gpu_.get(), gw), Get(cpu_.get(), cw)), 1e-5);
      // The layout from identical routing (the CPU's weights on both).
      Tensor gw_same = Put(gpu_.get(), Get(cpu_.get(), cw), {tokens, top_k}, DType::kF32);
      ASSERT_TRUE(
          cpu_->ComputeDispatchLayout(cids, cw, PutIndices(cpu_.get(), owner), ranks, &cl).ok());
      ASSERT_TRUE(
          gpu_->ComputeDispatchLayout(gids, gw_same, PutIndices(gpu_.get(), owner), ranks, &gl)
              .ok());
      const std::vector<int32_t> counts = GetIndices(cpu_.get(), cl.num_tokens_per_rank);
      EXPECT_EQ(GetIndices(gpu_.get(), gl.num_tokens_per_rank), counts);
      EXPECT_EQ(GetIndices(gpu_.get(), gl.num_pairs_per_rank),
                GetIndices(cpu_.get(), cl.num_pairs_per_rank));
      EXPECT_EQ(GetIndices(gpu_.get(), gl.num_tokens_per_expert),
                GetIndices(cpu_.get(), cl.num_tokens_per_expert));
      int64_t used = 0;
      for (int32_t c : counts) used += c;
      std::vector<int32_t> crows = GetIndices(cpu_.get(), cl.token_rows);
      std::vector<int32_t> grows = GetIndices(gpu_.get(), gl.token_rows);
      crows.resize(used);
      grows.resize(used);
      EXPECT_EQ(grows, crows);
      EXPECT_EQ(GetIndices(gpu_.get(), gl.pairs), GetIndices(cpu_.get(), cl.pairs));
      // The combine over what each rank "sent back": random rows per (rank, token).
      std::vector<int64_t> offsets = {0};
      for (int32_t c : counts) offsets.push_back(offsets.back() + c);
      const std::vector<float> recv = Bf16Exact(RandomFloats(used * hidden, 30));
      for (DType wire : {DType::kF32, DType::kBF16}) {
        Tensor cout = Poisoned(cpu_.get(), {tokens, hidden}, DType::kF32);
        Tensor gout = Poisoned(gpu_.get(), {tokens, hidden}, DType::kF32);
        ASSERT_TRUE(cpu_->CombineRows(Put(cpu_.get(), recv, {used, hidden}, DType::kF32),
                                      cl.token_rows, offsets, &cout)
                        .ok());
        ASSERT_TRUE(gpu_->CombineRows(Put(gpu_.get(), recv, {used, hidden}, wire), gl.token_rows,
                                      offsets, &gout)
                        .ok());
        EXPECT_LT(MaxRelError(Get(gpu_.get(), gout), Get(cpu_.get(), cout)), 1e-6);
      }
    }
  }
}

// The fused dense ops through the Backend interface (the model's dtypes: bf16 activations
// and weights, an f32 residual) against the CPU's unfused sequences.
TEST_F(CudaBackendTest, FusedNormsMatchTheUnfusedCpuOps) {
  struct Shape {
    int64_t hidden, heads, kv_heads, d;
  };
  // Qwen3-30B-A3B's, then the golden presets' (default, odd, bf16-sharded).
  for (const Shape& shape :
       {Shape{2048, 32, 4, 128}, Shape{128, 4, 2, 32}, Shape{96, 6, 2, 24}, Shape{64, 4, 1, 16}})
    for (int64_t t : {0, 1, 7, 23, 33}) {
      SCOPED_TRACE(::testing::Message()
                   << t << " tokens, hidden " << shape.hidden << ", heads " << shape.heads << "/"
                   << shape.kv_heads << " of " << shape.d);
      const int64_t hidden = shape.hidden, heads = shape.heads, kv_heads = shape.kv_heads,
                    d = shape.d;
      const std::vector<float> x = Bf16Exact(RandomFloats(t * hidden, 11));
      const std::vector<float> r = RandomFloats(t * hidden, 12, 3.f);
      const std::vector<float> w = Bf16Exact(RandomFloats(hidden, 13));
      Tensor cr = Put(cpu_.get(), r, {t, hidden}, DType::kF32);
      Tensor cy = Poisoned(cpu_.get(), {t, hidden}, DType::kF32);
      ASSERT_TRUE(cpu_->Add(Put(cpu_.get(), x, {t, hidden}, DType::kF32), &cr).ok());
      ASSERT_TRUE(cpu_->RmsNorm(cr, Put(cpu_.get(), w, {hidden}, DType::kF32), 1e-6f, &cy).ok());
      Tensor gr = Put(gpu_.get(), r, {t, hidden}, DType::kF32);
      Tensor gy = Poisoned(gpu_.get(), {t, hidden}, DType::kBF16);
      ASSERT_TRUE(gpu_->AddRmsNorm(Put(gpu_.get(), x, {t, hidden}, DType::kBF16),
                                   Put(gpu_.get(), w, {hidden}, DType::kBF16), 1e-6f, &gr, &gy)
                      .ok());
      EXPECT_EQ(Get(gpu_.get(), gr), Get(cpu_.get(), cr));  // the same f32 additions
      EXPECT_LT(MaxRelError(Get(gpu_.get(), gy), Get(cpu_.get(), cy)), 1e-2);

      const std::vector<float> q = Bf16Exact(RandomFloats(t * heads * d, 14, 2.f));
      const std::vector<float> k = Bf16Exact(RandomFloats(t * kv_heads * d, 15, 2.f));
      const std::vector<float> qw = Bf16Exact(RandomFloats(d, 16)),
                               kw = Bf16Exact(RandomFloats(d, 17));
      std::vector<int32_t> pos(t);
      for (int64_t i = 0; i < t; ++i) pos[i] = static_cast<int32_t>(i * 1237 % 32768);
      Tensor cq = Put(cpu_.get(), q, {t, heads, d}, DType::kF32);
      Tensor ck = Put(cpu_.get(), k, {t, kv_heads, d}, DType::kF32);
      const Tensor cpos = PutIndices(cpu_.get(), pos);
      ASSERT_TRUE(cpu_->RmsNorm(cq, Put(cpu_.get(), qw, {d}, DType::kF32), 1e-6f, &cq).ok());
      ASSERT_TRUE(cpu_->RmsNorm(ck, Put(cpu_.get(), kw, {d}, DType::kF32), 1e-6f, &ck).ok());
      ASSERT_TRUE(cpu_->Rope(&cq, cpos, 1e6).ok());
      ASSERT_TRUE(cpu_->Rope(&ck, cpos, 1e6).ok());
      Tensor gq = Put(gpu_.get(), q, {t, heads, d}, DType::kBF16);
      Tensor gk = Put(gpu_.get(), k, {t, kv_heads, d}, DType::kBF16);
      ASSERT_TRUE(gpu_->QkNormRope(&gq, &gk, Put(gpu_.get(), qw, {d}, DType::kBF16),
                                   Put(gpu_.get(), kw, {d}, DType::kBF16), 1e-6f,
                                   PutIndices(gpu_.get(), pos), 1e6)
                      .ok());
      EXPECT_LT(MaxRelError(Get(gpu_.get(), gq), Get(cpu_.get(), cq)), 1e-2);
      EXPECT_LT(MaxRelError(Get(gpu_.get(), gk), Get(cpu_.get(), ck)), 1e-2);
    }
  // The shared argument checks: a bf16 residual, an odd head_dim.
  Tensor x = Poisoned(gpu_.get(), {2, 64}, DType::kBF16),
         w = Poisoned(gpu_.get(), {64}, DType::kBF16);
  Tensor r16 = Poisoned(gpu_.get(), {2, 64}, DType::kBF16),
         y = Poisoned(gpu_.get(), {2, 64}, DType::kBF16);
  EXPECT_EQ(gpu_->AddRmsNorm(x, w, 1e-6f, &r16, &y).code(), absl::StatusCode::kInvalidArgument);
  Tensor q = Poisoned(gpu_.get(), {2, 4, 7}, DType::kBF16),
         k = Poisoned(gpu_.get(), {2, 1, 7}, DType::kBF16);
  Tensor w7 = Poisoned(gpu_.get(), {7}, DType::kBF16);
  EXPECT_EQ(gpu_->QkNormRope(&q, &k, w7, w7, 1e-6f, PutIndices(gpu_.get(), {0, 1}), 1e4).code(),
            absl::StatusCode::kInvalidArgument);
}

// AddRmsNormRoute: one kernel at decode sizes (route_decode.cu, DXS_CUDA_FUSED_ROUTE=auto), the
// default's three ops past them; the same bits as AddRmsNorm, Linear into float32 and
// TopKSoftmax either way, and a backend with DXS_CUDA_FUSED_ROUTE=off gives them too. The
// CPU's routing agrees.
TEST_F(CudaBackendTest, AddRmsNormRouteIsTheNormTheRouterAndTheTopK) {
  setenv("DXS_CUDA_FUSED_ROUTE", "auto", 1);
  absl::StatusOr<std::unique_ptr<Backend>> fused = MakeBackend("cuda");
  setenv("DXS_CUDA_FUSED_ROUTE", "off", 1);
  absl::StatusOr<std::unique_ptr<Backend>> unfused = MakeBackend("cuda");
  unsetenv("DXS_CUDA_FUSED_ROUTE");
  ASSERT_TRUE(fused.ok()) << fused.status();
  ASSERT_TRUE(unfused.ok()) << unfused.status();
  const int64_t hidden = 2048, experts = 128, top_k = 8;
  const std::vector<float> w = Bf16Exact(RandomFloats(hidden, 21));
  const std::vector<float> router = Bf16Exact(RandomFloats(experts * hidden, 22, 0.05f));
  for (int64_t t : {1, 2, 5, 8, 12}) {
    SCOPED_TRACE(::testing::Message() << t << " tokens");
    const std::vector<float> x = Bf16Exact(RandomFloats(t * hidden, 23));
    const std::vector<float> r = RandomFloats(t * hidden, 24, 3.f);
    struct Out {
      std::vector<float> residual, normed, weights;
      std::vector<int32_t> ids;
    };
    // kind 0: the op on the fused backend; 1: on the unfused one; 2: the three ops.
    std::vector<Out> outs;
    for (int kind = 0; kind < 3; ++kind) {
      Backend* be = kind == 0 ? fused->get() : kind == 1 ? unfused->get() : gpu_.get();
      const Tensor gx = Put(be, x, {t, hidden}, DType::kBF16);
      const Tensor gw = Put(be, w, {hidden}, DType::kBF16);
      const Tensor grouter = Put(be, router, {experts, hidden}, DType::kBF16);
      Tensor gr = Put(be, r, {t, hidden}, DType::kF32);
      Tensor normed = Poisoned(be, {t, hidden}, DType::kBF16);
      Tensor ids = Poisoned(be, {t, top_k}, DType::kI32);
      Tensor weights = Poisoned(be, {t, top_k}, DType::kF32);
      if (kind < 2) {
        ASSERT_TRUE(
            be->AddRmsNormRoute(gx, gw, 1e-6f, &gr, &normed, grouter, top_k, true, &ids, &weights)
                .ok());
      } else {
        Tensor logits = Poisoned(be, {t, experts}, DType::kF32);
        ASSERT_TRUE(be->AddRmsNorm(gx, gw, 1e-6f, &gr, &normed).ok());
        ASSERT_TRUE(be->Linear(normed, grouter, nullptr, &logits).ok());
        ASSERT_TRUE(be->TopKSoftmax(logits, top_k, true, &ids, &weights).ok());
      }
      outs.push_back({Get(be, gr), Get(be, normed), Get(be, weights), GetIndices(be, ids)});
    }
    for (int kind = 1; kind < 3; ++kind) {
      EXPECT_EQ(outs[0].residual, outs[kind].residual) << kind;
      EXPECT_EQ(outs[0].normed, outs[kind].normed) << kind;
      EXPECT_EQ(outs[0].ids, outs[kind].ids) << kind;
      EXPECT_EQ(outs[0].weights, outs[kind].weights) << kind;
    }
    // The CPU (float32 throughout): the same residual; the picks where their logits are
    // apart by more than bf16's normed activations move them.
    Tensor cr = Put(cpu_.get(), r, {t, hidden}, DType::kF32);
    Tensor cn = Poisoned(cpu_.get(), {t, hidden}, DType::kF32);
    Tensor cids = Poisoned(cpu_.get(), {t, top_k}, DType::kI32);
    Tensor cweights = Poisoned(cpu_.get(), {t, top_k}, DType::kF32);
    ASSERT_TRUE(cpu_->AddRmsNormRoute(Put(cpu_.get(), x, {t, hidden}, DType::kF32),
                                      Put(cpu_.get(), w, {hidden}, DType::kF32), 1e-6f, &cr, &cn,
                                      Put(cpu_.get(), router, {experts, hidden}, DType::kF32),
                                      top_k, true, &cids, &cweights)
                    .ok());
    EXPECT_EQ(Get(cpu_.get(), cr), outs[0].residual);
    EXPECT_LT(MaxRelError(outs[0].normed, Get(cpu_.get(), cn)), 1e-2);
    EXPECT_LT(MaxRelError(outs[0].weights, Get(cpu_.get(), cweights)), 5e-2);
  }
}

TEST_F(CudaBackendTest, TheExpertPathMatchesTheCpu) {
  const int64_t experts = 16, hidden = 256, inter = 128;
  // Per expert: gate_up [2 * inter, hidden] (gate's rows, then up's) and down.
  std::vector<std::vector<Tensor>> cw(2), gw(2);
  for (int64_t e = 0; e < experts; ++e) {
    std::vector<float> gate_up = Bf16Exact(RandomFloats(inter * hidden, 100 + e, 0.06f));
    const std::vector<float> up = Bf16Exact(RandomFloats(inter * hidden, 116 + e, 0.06f));
    gate_up.insert(gate_up.end(), up.begin(), up.end());
    const std::vector<float> down = Bf16Exact(RandomFloats(inter * hidden, 132 + e, 0.06f));
    cw[0].push_back(Put(cpu_.get(), gate_up, {2 * inter, hidden}, DType::kF32));
    gw[0].push_back(Put(gpu_.get(), gate_up, {2 * inter, hidden}, DType::kBF16));
    cw[1].push_back(Put(cpu_.get(), down, {hidden, inter}, DType::kF32));
    gw[1].push_back(Put(gpu_.get(), down, {hidden, inter}, DType::kBF16));
  }
  // Up to cuda::kGemvMaxPairs (128) pairs: gemv.cu (runs of one expert longer than its 4
  // pairs a pass at 40 and 128); then up to ~54 rows an expert (the small tiles), ~108
  // (128-row tiles), ~310 (128x256 tiles).
  for (int64_t pairs : {0, 1, 8, 40, 128, 129, 700, 1400, 4000}) {
    SCOPED_TRACE(::testing::Message() << pairs << " pairs");
    const int64_t rows_in = std::max<int64_t>(pairs / 3, 1);
    std::mt19937 rng(static_cast<uint32_t>(pairs));
    std::vector<int32_t> ex(pairs), rows(pairs), out_rows(pairs);
    for (int64_t p = 0; p < pairs; ++p) {
      ex[p] = static_cast<int32_t>(rng() % (experts - 3));  // the last 3 experts get nothing
      rows[p] = static_cast<int32_t>(rng() % rows_in);
      out_rows[p] = static_cast<int32_t>(rng() % rows_in);
    }
    const std::vector<float> scales = RandomFloats(pairs, 7);
    const std::vector<float> x = Bf16Exact(RandomFloats(rows_in * hidden, 8));
    auto run = [&](Backend* b, const std::vector<std::vector<Tensor>>& w, DType xdtype) {
      Tensor order = Poisoned(b, {pairs}, DType::kI32);
      Tensor offsets = Poisoned(b, {experts + 1}, DType::kI32);
      EXPECT_TRUE(b->SortPairsByExpert(PutIndices(b, ex), experts, &order, &offsets, {}).ok());
      Tensor counts = *b->Zeros({experts}, DType::kI64);
      EXPECT_TRUE(b->AccumulateCounts(offsets, &counts).ok());
      EXPECT_TRUE(b->AccumulateCounts(offsets, &counts).ok());
      std::vector<int64_t> host_counts(experts);
      EXPECT_TRUE(b->CopyToHost(counts, DType::kI64, host_counts.data()).ok());
      for (int64_t e = 0; e < experts; ++e) {
        EXPECT_EQ(host_counts[e], 2 * std::count(ex.begin(), ex.end(), static_cast<int32_t>(e)));
      }
      Tensor sorted_rows = Poisoned(b, {pairs}, DType::kI32);
      Tensor sorted_out = Poisoned(b, {pairs}, DType::kI32);
      Tensor sorted_scales = Poisoned(b, {pairs}, DType::kF32);
      EXPECT_TRUE(b->GatherRows(PutIndices(b, rows), order, &sorted_rows).ok());
      EXPECT_TRUE(b->GatherRows(PutIndices(b, out_rows), order, &sorted_out).ok());
      EXPECT_TRUE(b->GatherRows(Put(b, scales, {pairs}, DType::kF32), order, &sorted_scales).ok());
      // The sort's payload form (the expert shard's) writes what the gathers wrote.
      {
        const Tensor rows_t = PutIndices(b, rows), out_t = PutIndices(b, out_rows);
        const Tensor scales_t = Put(b, scales, {pairs}, DType::kF32);
        Tensor order2 = Poisoned(b, {pairs}, DType::kI32);
        Tensor offsets2 = Poisoned(b, {experts + 1}, DType::kI32);
        Tensor p_rows = Poisoned(b, {pairs}, DType::kI32),
               p_out = Poisoned(b, {pairs}, DType::kI32);
        Tensor p_scales = Poisoned(b, {pairs}, DType::kF32);
        EXPECT_TRUE(
            b->SortPairsByExpert(PutIndices(b, ex), experts, &order2, &offsets2,
                                 {{&rows_t, &p_rows}, {&out_t, &p_out}, {&scales_t, &p_scales}})
                .ok());
        EXPECT_EQ(GetIndices(b, order2), GetIndices(b, order));
        EXPECT_EQ(GetIndices(b, offsets2), GetIndices(b, offsets));
        EXPECT_EQ(GetIndices(b, p_rows), GetIndices(b, sorted_rows));
        EXPECT_EQ(GetIndices(b, p_out), GetIndices(b, sorted_out));
        const std::vector<float> ps = Get(b, p_scales), gs = Get(b, sorted_scales);
        EXPECT_EQ(ps.size(), gs.size());
        EXPECT_TRUE(ps.size() == gs.size() &&
                    std::memcmp(ps.data(), gs.data(), ps.size() * sizeof(float)) == 0);
      }
      std::vector<const Tensor*> gu(experts), dn(experts);
      for (int64_t e = 0; e < experts; ++e) {
        const bool held = e < experts - 3;  // experts without rows may have no weights
        gu[e] = held ? &w[0][e] : nullptr;
        dn[e] = held ? &w[1][e] : nullptr;
      }
      Tensor y = Poisoned(b, {pairs, hidden}, DType::kF32);
      absl::Status s =
          b->GroupedSwiGlu(Put(b, x, {rows_in, hidden}, xdtype), &sorted_rows, offsets, gu, dn, &y);
      EXPECT_TRUE(s.ok()) << s;
      Tensor sum =
          Put(b, std::vector<float>(rows_in * hidden, 0.5f), {rows_in, hidden}, DType::kF32);
      EXPECT_TRUE(b->ScaleAddRows(y, sorted_scales, sorted_out, &sum).ok());
      return std::make_tuple(GetIndices(b, order), GetIndices(b, offsets), Get(b, y), Get(b, sum));
    };
    const auto want = run(cpu_.get(), cw, DType::kF32);
    for (DType xdtype : {DType::kBF16, DType::kF32}) {
      SCOPED_TRACE(DTypeName(xdtype));
      const auto got = run(gpu_.get(), gw, xdtype);
      EXPECT_EQ(std::get<0>(got), std::get<0>(want));
      EXPECT_EQ(std::get<1>(got), std::get<1>(want));
      EXPECT_LT(MaxRelError(std::get<2>(got), std::get<2>(want)), 2e-2);
      EXPECT_LT(MaxRelError(std::get<3>(got), std::get<3>(want)), 2e-2);
    }
  }
}

// An unknown value of a switch read outside the backend (FlashInfer's SM90 prefill, PDL,
// the GEMVs' split-k and early slices, the norms' early trigger) fails the backend's
// creation, as the backend's own auto|off switches do, rather than the first prefill step or
// silently meaning "on".
TEST_F(CudaBackendTest, UnknownSwitchValuesFailCreation) {
  for (const char* name : {"DXS_CUDA_PREFILL_SM90", "DXS_CUDA_PDL", "DXS_CUDA_GEMV_SPLITK",
                           "DXS_CUDA_NORM_EARLY_TRIGGER", "DXS_CUDA_GEMV_EARLY",
                           "DXS_CUDA_DECODE_ATTENTION", "DXS_CUDA_GEMV_FP8_FEATURES"}) {
    SCOPED_TRACE(name);
    setenv(name, "sideways", 1);
    const absl::StatusOr<std::unique_ptr<Backend>> made = MakeBackend("cuda");
    unsetenv(name);
    ASSERT_FALSE(made.ok());
    EXPECT_EQ(made.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(made.status().message().find(name), std::string::npos) << made.status();
  }
}

// DXS_CUDA_GEMV=off takes cuBLAS / CUTLASS for what gemv.cu runs by default: on the
// Qwen3-30B-A3B shapes of a decode step both agree within bf16 error.
TEST_F(CudaBackendTest, GemvAndGemmPathsAgree) {
  setenv("DXS_CUDA_GEMV", "sideways", 1);
  EXPECT_EQ(MakeBackend("cuda").status().code(), absl::StatusCode::kInvalidArgument);
  setenv("DXS_CUDA_GEMV", "off", 1);
  absl::StatusOr<std::unique_ptr<Backend>> made = MakeBackend("cuda");
  unsetenv("DXS_CUDA_GEMV");
  ASSERT_TRUE(made.ok()) << made.status();
  Backend* gemm = made->get();
  Backend* gemv = gpu_.get();
  const int64_t hidden = 2048;
  for (const auto& [m, n] : std::vector<std::pair<int64_t, int64_t>>{
           {1, 4096}, {1, 512}, {4, 128}, {8, 4096}, {3, 2050}}) {
    SCOPED_TRACE(::testing::Message() << "linear m " << m << " n " << n);
    const std::vector<float> x = Bf16Exact(RandomFloats(m * hidden, 21));
    const std::vector<float> w = Bf16Exact(RandomFloats(n * hidden, 22, 0.02f));
    std::vector<std::vector<float>> out;
    for (Backend* b : {gemv, gemm}) {
      Tensor y = Poisoned(b, {m, n}, DType::kF32);
      ASSERT_TRUE(b->Linear(Put(b, x, {m, hidden}, DType::kBF16),
                            Put(b, w, {n, hidden}, DType::kBF16), nullptr, &y)
                      .ok());
      out.push_back(Get(b, y));
    }
    EXPECT_LT(MaxRelError(out[0], out[1]), 1e-2);
  }
  // The grouped FFN: Qwen3-30B-A3B's expert shape (inter 768), top-8 of 1 and of 16 tokens
  // over 32 experts (fewer than its 128, to keep the host's random weights quick).
  const int64_t experts = 32, inter = 768;
  const ExpertSets expert_weights =
      PutExperts({{gemv, DType::kBF16}, {gemm, DType::kBF16}}, experts, hidden, inter, 300, 500);
  const auto& gu = expert_weights.gate_up;
  const auto& dn = expert_weights.down;
  for (int64_t tokens : {1, 16}) {
    SCOPED_TRACE(::testing::Message() << tokens << " tokens");
    const int64_t pairs = tokens * 8;
    std::mt19937 rng(static_cast<uint32_t>(tokens));
    std::vector<int32_t> ex(pairs), rows(pairs);
    for (int64_t p = 0; p < pairs; ++p) {
      ex[p] = static_cast<int32_t>(rng() % experts);
      rows[p] = static_cast<int32_t>(p / 8);
    }
    const std::vector<float> x = Bf16Exact(RandomFloats(tokens * hidden, 23));
    std::vector<std::vector<float>> out;
    for (int b = 0; b < 2; ++b) {
      Backend* be = b == 0 ? gemv : gemm;
      Tensor order = Poisoned(be, {pairs}, DType::kI32);
      Tensor offsets = Poisoned(be, {experts + 1}, DType::kI32);
      Tensor sorted_rows = Poisoned(be, {pairs}, DType::kI32);
      const Tensor rows_t = PutIndices(be, rows);
      ASSERT_TRUE(be->SortPairsByExpert(PutIndices(be, ex), experts, &order, &offsets,
                                        {{&rows_t, &sorted_rows}})
                      .ok());
      Tensor y = Poisoned(be, {pairs, hidden}, DType::kBF16);
      ASSERT_TRUE(be->GroupedSwiGlu(Put(be, x, {tokens, hidden}, DType::kBF16), &sorted_rows,
                                    offsets, gu[b], dn[b], &y)
                      .ok());
      out.push_back(Get(be, y));
    }
    EXPECT_LT(MaxRelError(out[0], out[1]), 2e-2);
  }
}

// RoutedSwiGlu, the decode-sized MoE FFN without the sort: the sorted path's bits
// (SortPairsByExpert, GroupedSwiGlu into the activation dtype, ScaleSumRows), the experts'
// counts, and the CPU's ops within bf16 rounding.
TEST_F(CudaBackendTest, RoutedSwiGluEqualsTheSortedPath) {
  Backend* gpu = gpu_.get();
  EXPECT_FALSE(cpu_->TakesRoutedSwiGlu(1, 8));
  EXPECT_TRUE(gpu->TakesRoutedSwiGlu(1, 8));
  EXPECT_TRUE(gpu->TakesRoutedSwiGlu(2, 8));
  EXPECT_FALSE(gpu->TakesRoutedSwiGlu(3, 8));
  EXPECT_FALSE(gpu->TakesRoutedSwiGlu(0, 8));
  const int64_t experts = 32, hidden = 2048, inter = 768;
  // The same bf16-exact values: bf16 on the GPU, f32 on the CPU.
  const ExpertSets expert_weights = PutExperts({{gpu, DType::kBF16}, {cpu_.get(), DType::kF32}},
                                               experts, hidden, inter, 700, 900);
  const auto& gu = expert_weights.gate_up;
  const auto& dn = expert_weights.down;
  for (const auto& [tokens, top_k] :
       std::vector<std::pair<int64_t, int64_t>>{{1, 8}, {2, 8}, {3, 4}, {1, 16}, {1, 1}}) {
    SCOPED_TRACE(::testing::Message() << tokens << " tokens of top-" << top_k);
    ASSERT_TRUE(gpu->TakesRoutedSwiGlu(tokens, top_k));
    const int64_t pairs = tokens * top_k;
    std::mt19937 rng(static_cast<uint32_t>(pairs + 77));
    std::vector<int32_t> ids(pairs), rows(pairs);
    std::vector<int64_t> want_counts(experts, 0);
    for (int64_t t = 0; t < tokens; ++t) {
      std::vector<int32_t> all(experts);
      for (int64_t e = 0; e < experts; ++e) all[e] = static_cast<int32_t>(e);
      std::shuffle(all.begin(), all.end(), rng);  // distinct experts a token, unsorted
      for (int64_t j = 0; j < top_k; ++j) {
        ids[t * top_k + j] = all[j];
        rows[t * top_k + j] = static_cast<int32_t>(t);
        ++want_counts[all[j]];
      }
    }
    const std::vector<float> scales = RandomFloats(pairs, 78, 0.3f);
    const std::vector<float> x = Bf16Exact(RandomFloats(tokens * hidden, 79));
    for (DType x_dtype : {DType::kBF16, DType::kF32}) {
      for (DType out_dtype : {DType::kBF16, DType::kF32}) {
        SCOPED_TRACE(::testing::Message()
                     << "x " << DTypeName(x_dtype) << ", out " << DTypeName(out_dtype));
        // The fused path, with counts from zero.
        const Tensor x_gpu = Put(gpu, x, {tokens, hidden}, x_dtype);
        Tensor fused = Poisoned(gpu, {tokens, hidden}, out_dtype);
        absl::StatusOr<Tensor> counts = gpu->Zeros({experts}, DType::kI64);
        ASSERT_TRUE(counts.ok()) << counts.status();
        const absl::Status st = gpu->RoutedSwiGlu(
            x_gpu, PutIndices(gpu, ids).Reshape({tokens, top_k}),
            Put(gpu, scales, {tokens, top_k}, DType::kF32), gu[0], dn[0], &*counts, &fused);
        ASSERT_TRUE(st.ok()) << st;
        std::vector<int64_t> got_counts(experts, -1);
        ASSERT_TRUE(gpu->CopyToHost(*counts, DType::kI64, got_counts.data()).ok());
        EXPECT_EQ(got_counts, want_counts);
        // The sorted path, on each backend.
        std::vector<std::vector<float>> sorted;
        for (int b = 0; b < 2; ++b) {
          Backend* be = b == 0 ? gpu : cpu_.get();
          Tensor order = Poisoned(be, {pairs}, DType::kI32);
          Tensor offsets = Poisoned(be, {experts + 1}, DType::kI32);
          Tensor sorted_rows = Poisoned(be, {pairs}, DType::kI32);
          Tensor sorted_scales = Poisoned(be, {pairs}, DType::kF32);
          const Tensor rows_t = PutIndices(be, rows);
          const Tensor scales_t = Put(be, scales, {pairs}, DType::kF32);
          ASSERT_TRUE(be->SortPairsByExpert(PutIndices(be, ids), experts, &order, &offsets,
                                            {{&rows_t, &sorted_rows}, {&scales_t, &sorted_scales}})
                          .ok());
          absl::StatusOr<Tensor> y = be->Allocate({pairs, hidden});  // the activation dtype
          ASSERT_TRUE(y.ok());
          ASSERT_TRUE(
              be->GroupedSwiGlu(Put(be, x, {tokens, hidden}, b == 0 ? x_dtype : DType::kF32),
                                &sorted_rows, offsets, gu[b], dn[b], &*y)
                  .ok());
          Tensor out = Poisoned(be, {tokens, hidden}, out_dtype);
          ASSERT_TRUE(be->ScaleSumRows(*y, sorted_scales, sorted_rows, &out).ok());
          sorted.push_back(Get(be, out));
        }
        const std::vector<float> got = Get(gpu, fused);
        ASSERT_EQ(got.size(), sorted[0].size());
        EXPECT_EQ(std::memcmp(got.data(), sorted[0].data(), got.size() * sizeof(float)), 0);
        EXPECT_LT(MaxRelError(got, sorted[1]), 2e-2);
      }
    }
  }
  // No tokens: nothing to do, nothing written.
  Tensor none = Poisoned(gpu, {0, hidden}, DType::kBF16);
  EXPECT_TRUE(gpu->RoutedSwiGlu(Poisoned(gpu, {0, hidden}, DType::kBF16),
                                Poisoned(gpu, {0, 8}, DType::kI32),
                                Poisoned(gpu, {0, 8}, DType::kF32), gu[0], dn[0], nullptr, &none)
                  .ok());
  // Mismatched shapes, a batch it does not take, and a backend without the path.
  Tensor out = Poisoned(gpu, {1, hidden}, DType::kBF16);
  const Tensor x1 = Poisoned(gpu, {1, hidden}, DType::kBF16);
  EXPECT_EQ(gpu->RoutedSwiGlu(x1, Poisoned(gpu, {1, 8}, DType::kI32),
                              Poisoned(gpu, {1, 4}, DType::kF32), gu[0], dn[0], nullptr, &out)
                .code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(gpu->RoutedSwiGlu(x1, Poisoned(gpu, {1, 32}, DType::kI32),
                              Poisoned(gpu, {1, 32}, DType::kF32), gu[0], dn[0], nullptr, &out)
                .code(),
            absl::StatusCode::kFailedPrecondition);
  Tensor cpu_out = Poisoned(cpu_.get(), {1, hidden}, DType::kF32);
  EXPECT_EQ(
      cpu_->RoutedSwiGlu(Poisoned(cpu_.get(), {1, hidden}, DType::kF32),
                         Poisoned(cpu_.get(), {1, 8}, DType::kI32),
                         Poisoned(cpu_.get(), {1, 8}, DType::kF32), gu[1], dn[1], nullptr, &cpu_out)
          .code(),
      absl::StatusCode::kFailedPrecondition);
}

// ScaleSumRows: zeros, ScaleAddRows, one rounding into out. gemv.cu's one-kernel form (up
// to cuda::kScaleSumMaxPairs rows, scanned in windows of 256, so a row's pairs may span
// several) and the ops it stands for (past that) give the CPU's bits.
TEST_F(CudaBackendTest, ScaleSumRowsIsZerosThenScaleAddRows) {
  const int64_t cols = 2050, out_rows = 5;
  for (int64_t n : {0, 1, 8, 128, 129, 257, 1024, 4096, 4097}) {
    SCOPED_TRACE(::testing::Message() << n << " rows");
    std::mt19937 rng(static_cast<uint32_t>(n) + 40);
    std::vector<int32_t> rows(n);
    for (int32_t& r : rows) r = static_cast<int32_t>(rng() % (out_rows - 1));  // the last: none
    const std::vector<float> src = Bf16Exact(RandomFloats(std::max<int64_t>(n, 1) * cols, 41));
    const std::vector<float> scales = RandomFloats(n, 42);
    for (DType out_dtype : {DType::kF32, DType::kBF16}) {
      SCOPED_TRACE(DTypeName(out_dtype));
      std::vector<std::vector<float>> got;
      for (Backend* b : {cpu_.get(), gpu_.get()}) {
        Tensor out = Poisoned(b, {out_rows, cols}, out_dtype);
        // The same (bf16-exact) values: f32 on the CPU, whose activations are f32.
        const Tensor src_t = Put(b, src, {std::max<int64_t>(n, 1), cols},
                                 b == cpu_.get() ? DType::kF32 : DType::kBF16);
        ASSERT_TRUE(b->ScaleSumRows(src_t.Rows(0, n), Put(b, scales, {n}, DType::kF32),
                                    PutIndices(b, rows), &out)
                        .ok());
        got.push_back(Get(b, out));
      }
      ASSERT_EQ(got[0].size(), got[1].size());
      EXPECT_EQ(std::memcmp(got[0].data(), got[1].data(), got[0].size() * sizeof(float)), 0);
      for (int64_t c = 0; c < cols; ++c) EXPECT_EQ(got[1][(out_rows - 1) * cols + c], 0.f);
    }
  }
}

// GroupedSwiGluCounted: a capacity of entries of which the device's offsets count the pairs
// (a low-latency round's: the pairs sorted first, the entries of no pair after
// offsets[E]). Whatever the count, the pairs' rows are GroupedSwiGlu's over the count and
// the CPU's within bf16 rounding, and the rows past the count are not written.
TEST_F(CudaBackendTest, GroupedSwiGluCountedTakesTheCountOnTheDevice) {
  Backend* gpu = gpu_.get();
  const int64_t experts = 32, hidden = 2048, inter = 768, capacity = 1024, x_rows = 128;
  const ExpertSets w = PutExperts({{gpu, DType::kBF16}, {cpu_.get(), DType::kF32}}, experts, hidden,
                                  inter, 500, 600);
  const std::vector<float> x = Bf16Exact(RandomFloats(x_rows * hidden, 601));
  for (int64_t count : {0, 1, 8, 128, 129, 1000}) {
    SCOPED_TRACE(::testing::Message() << count << " pairs in " << capacity);
    std::mt19937 rng(static_cast<uint32_t>(count) + 602);
    std::vector<int32_t> ids(capacity, static_cast<int32_t>(experts)), rows(capacity, 0);
    for (int64_t i = 0; i < count; ++i) {
      ids[i] = static_cast<int32_t>(rng() % experts);
      rows[i] = static_cast<int32_t>(rng() % x_rows);
    }
    std::shuffle(ids.begin(), ids.end(), rng);  // the no-pair entries anywhere, as received
    std::vector<std::vector<float>> got;
    for (Backend* be : {gpu, cpu_.get()}) {
      const bool on_gpu = be == gpu;
      Tensor order = Poisoned(be, {capacity}, DType::kI32);
      Tensor offsets = Poisoned(be, {experts + 2}, DType::kI32);
      Tensor sorted_rows = Poisoned(be, {capacity}, DType::kI32);
      const Tensor rows_t = PutIndices(be, rows);
      ASSERT_TRUE(be->SortPairsByExpert(PutIndices(be, ids), experts + 1, &order, &offsets,
                                        {{&rows_t, &sorted_rows}})
                      .ok());
      const Tensor pair_offsets = offsets.Rows(0, experts + 1);
      const Tensor xs = Put(be, x, {x_rows, hidden}, on_gpu ? DType::kBF16 : DType::kF32);
      Tensor y = Poisoned(be, {capacity, hidden}, on_gpu ? DType::kBF16 : DType::kF32);
      const absl::Status st = be->GroupedSwiGluCounted(
          xs, sorted_rows, pair_offsets, w.gate_up[on_gpu ? 0 : 1], w.down[on_gpu ? 0 : 1], &y);
      ASSERT_TRUE(st.ok()) << st;
      const std::vector<float> all = Get(be, y);
      for (size_t i = static_cast<size_t>(count * hidden); i < all.size(); ++i) {
        ASSERT_TRUE(std::isnan(all[i])) << "entry " << i / hidden << " past the count written";
      }
      got.emplace_back(all.begin(), all.begin() + count * hidden);
      if (on_gpu && count > 0) {
        // GroupedSwiGlu over the pairs alone.
        Tensor want = Poisoned(gpu, {count, hidden}, DType::kBF16);
        const Tensor counted_rows = sorted_rows.Rows(0, count);
        ASSERT_TRUE(
            gpu->GroupedSwiGlu(xs, &counted_rows, pair_offsets, w.gate_up[0], w.down[0], &want)
                .ok());
        EXPECT_LT(MaxRelError(got.back(), Get(gpu, want)), 1e-2);
      }
    }
    EXPECT_LT(MaxRelError(got[0], got[1]), 2e-2);
  }
}

TEST_F(CudaBackendTest, ArgmaxRowsMatchesTheCpu) {
  const float nan = std::nanf(""), inf = INFINITY;
  // Special rows, then random ones of Qwen3's vocabulary with planted ties.
  std::vector<std::vector<float>> rows = {{1, 3, 3, 2}, {nan, 5, 6},   {1, nan, 0.5f},
                                          {-inf, -inf}, {2, inf, inf}, {7}};
  for (const auto& row : rows) {
    Tensor ids = Poisoned(gpu_.get(), {1}, DType::kI32),
           want = Poisoned(cpu_.get(), {1}, DType::kI32);
    const int64_t n = static_cast<int64_t>(row.size());
    ASSERT_TRUE(gpu_->ArgmaxRows(Put(gpu_.get(), row, {1, n}, DType::kF32), &ids).ok());
    ASSERT_TRUE(cpu_->ArgmaxRows(Put(cpu_.get(), row, {1, n}, DType::kF32), &want).ok());
    EXPECT_EQ(GetIndices(gpu_.get(), ids), GetIndices(cpu_.get(), want));
  }
  for (int64_t batch : {0, 1, 37}) {
    const int64_t vocab = 151936;
    std::vector<float> v = RandomFloats(batch * vocab, 77);
    for (int64_t i = 0; i < batch; ++i) {
      v[i * vocab + 1000 + i] = 50.f;  // the same maximum twice: the earlier index wins
      v[i * vocab + 90000 - i] = 50.f;
    }
    Tensor ids = Poisoned(gpu_.get(), {batch}, DType::kI32),
           want = Poisoned(cpu_.get(), {batch}, DType::kI32);
    ASSERT_TRUE(gpu_->ArgmaxRows(Put(gpu_.get(), v, {batch, vocab}, DType::kF32), &ids).ok());
    ASSERT_TRUE(cpu_->ArgmaxRows(Put(cpu_.get(), v, {batch, vocab}, DType::kF32), &want).ok());
    EXPECT_EQ(GetIndices(gpu_.get(), ids), GetIndices(cpu_.get(), want)) << batch;
  }
}

// SampleRows beside the CPU on a small case (sampling_cuda_test has the full comparison;
// this one runs under memcheck too): greedy, top-k, top-p and both.
TEST_F(CudaBackendTest, SampleRowsMatchesTheCpu) {
  for (int64_t batch : {0, 1, 9}) {
    for (int64_t vocab : {1, 300, 5000}) {
      const std::vector<float> v = RandomFloats(batch * vocab, 5, 2.f);
      std::vector<SamplingRow> rows;
      for (int64_t i = 0; i < batch; ++i) {
        const SamplingParams kinds[] = {
            {0.f, 1.f, 0, 1}, {1.f, 1.f, 20, 2}, {0.8f, 0.9f, 0, 3}, {1.2f, 0.95f, 64, 4}};
        rows.push_back(ToSamplingRow(kinds[i % 4], static_cast<uint64_t>(i)));
      }
      std::vector<int32_t> got, want;
      for (Backend* b : {gpu_.get(), cpu_.get()}) {
        Tensor logits = Put(b, v, {batch, vocab}, DType::kF32);
        Tensor params = *b->Allocate({batch, kSamplingRowWords}, DType::kI64);
        ASSERT_TRUE(b->CopyFromHost(rows.data(), DType::kI64, &params).ok());
        Tensor ids = Poisoned(b, {batch}, DType::kI32);
        ASSERT_TRUE(b->SampleRows(logits, params, nullptr, &ids).ok()) << b->name();
        (b == gpu_.get() ? got : want) = GetIndices(b, ids);
      }
      EXPECT_EQ(got, want) << "batch " << batch << " vocab " << vocab;
    }
  }
}

// An expert round's pairs checked and unpacked on the device equal the CPU's, bad pairs and
// the lowest one included, over DP-rank segments (empty ones among them) of random sizes.
TEST_F(CudaBackendTest, UnpackRoutedPairsMatchesTheCpu) {
  const int64_t experts = 128;
  std::mt19937 rng(11);
  std::vector<int32_t> held_host(experts);
  for (int32_t& h : held_host) h = rng() % 4 != 0;
  for (int num_segments : {1, 3, 64}) {
    for (int bad_every : {0, 97, 5}) {
      SCOPED_TRACE(::testing::Message() << num_segments << " segments, bad every " << bad_every);
      std::vector<PairSegment> segments;
      std::vector<int32_t> blocks;
      int32_t pairs = 0, rows_before = 0;
      for (int s = 0; s < num_segments; ++s) {
        const int32_t n = s % 3 == 1 ? 0 : static_cast<int32_t>(rng() % 300);
        const int32_t num_rows = n == 0 ? static_cast<int32_t>(rng() % 2) : 1 + n / 4;
        segments.push_back({pairs, n, rows_before, num_rows});
        std::vector<int32_t> r(n), e(n), w(n);
        for (int32_t k = 0; k < n; ++k) {
          r[k] = static_cast<int32_t>(rng() % num_rows);
          do {
            e[k] = static_cast<int32_t>(rng() % experts);
          } while (held_host[e[k]] == 0);
          const float weight = static_cast<float>(rng() % 1000) / 1000.f;
          std::memcpy(&w[k], &weight, sizeof(weight));
          if (bad_every > 0 && (pairs + k) % bad_every == 3) {
            if (k % 2 == 0)
              r[k] = num_rows + static_cast<int32_t>(rng() % 3);
            else
              e[k] = -1 - static_cast<int32_t>(rng() % 2);
          }
        }
        blocks.insert(blocks.end(), r.begin(), r.end());
        blocks.insert(blocks.end(), e.begin(), e.end());
        blocks.insert(blocks.end(), w.begin(), w.end());
        pairs += n;
        rows_before += num_rows;
      }
      auto run = [&](Backend* b) {
        Tensor rows = Poisoned(b, {pairs}, DType::kI32);
        Tensor ex = Poisoned(b, {pairs}, DType::kI32);
        Tensor w = Poisoned(b, {pairs}, DType::kF32);
        Tensor bad = Poisoned(b, {2}, DType::kI32);
        EXPECT_TRUE(b->UnpackRoutedPairs(PutIndices(b, blocks), segments, PutIndices(b, held_host),
                                         &rows, &ex, &w, &bad)
                        .ok());
        std::vector<float> weights(pairs);
        EXPECT_TRUE(b->CopyToHost(w, DType::kF32, weights.data()).ok());
        return std::make_tuple(GetIndices(b, rows), GetIndices(b, ex), weights, GetIndices(b, bad));
      };
      const auto want = run(cpu_.get());
      const auto got = run(gpu_.get());
      EXPECT_EQ(std::get<0>(got), std::get<0>(want));
      EXPECT_EQ(std::get<1>(got), std::get<1>(want));
      EXPECT_EQ(std::get<2>(got), std::get<2>(want));
      EXPECT_EQ(std::get<3>(got), std::get<3>(want));
      EXPECT_EQ(std::get<3>(want)[0] > 0, bad_every > 0 && pairs > 3);
    }
  }
}

// Random checkpoints made in place on the GPU (model/random_checkpoint.h) are the host's
// values bit for bit: FillUniform on CUDA against the CPU's, for each stored and value
// dtype, over a poisoned tensor of an odd size (several blocks, a ragged tail).
TEST_F(CudaBackendTest, FillUniformIsTheCpusValuesBitForBit) {
  const int64_t n = (1 << 20) + 7;
  for (DType stored : {DType::kF32, DType::kBF16}) {
    for (DType values : {DType::kF32, DType::kBF16}) {
      Tensor g = Poisoned(gpu_.get(), {n}, stored);
      Tensor c = Poisoned(cpu_.get(), {n}, stored);
      ASSERT_TRUE(gpu_->FillUniform(&g, 1234567, 0.25, 0.05, values).ok());
      ASSERT_TRUE(cpu_->FillUniform(&c, 1234567, 0.25, 0.05, values).ok());
      const std::vector<float> got = Get(gpu_.get(), g), want = Get(cpu_.get(), c);
      ASSERT_EQ(got.size(), want.size());
      int64_t differ = 0;
      float lo = 1.f, hi = 0.f;
      for (size_t i = 0; i < got.size(); ++i) {
        differ += std::memcmp(&got[i], &want[i], sizeof(float)) != 0 ? 1 : 0;
        lo = std::min(lo, got[i]);
        hi = std::max(hi, got[i]);
      }
      EXPECT_EQ(differ, 0) << DTypeName(stored) << " / " << DTypeName(values);
      // Not a constant: the values span [0.2, 0.3] (bf16 spacing there is below 2e-3).
      EXPECT_LT(lo, 0.205f);
      EXPECT_GT(hi, 0.295f);
      EXPECT_GE(lo, 0.2f - 2e-3f);
      EXPECT_LE(hi, 0.3f + 2e-3f);
    }
  }
  // Another seed, other values; an index tensor is refused; no elements is nothing to do.
  Tensor a = Poisoned(gpu_.get(), {64}, DType::kF32), b = Poisoned(gpu_.get(), {64}, DType::kF32);
  ASSERT_TRUE(gpu_->FillUniform(&a, 1, 0.0, 1.0, DType::kF32).ok());
  ASSERT_TRUE(gpu_->FillUniform(&b, 2, 0.0, 1.0, DType::kF32).ok());
  EXPECT_NE(Get(gpu_.get(), a), Get(gpu_.get(), b));
  Tensor ids = PutIndices(gpu_.get(), {1, 2, 3});
  EXPECT_EQ(gpu_->FillUniform(&ids, 1, 0.0, 1.0, DType::kF32).code(),
            absl::StatusCode::kInvalidArgument);
  Tensor empty = Poisoned(gpu_.get(), {0}, DType::kF32);
  EXPECT_TRUE(gpu_->FillUniform(&empty, 1, 0.0, 1.0, DType::kF32).ok());
}

// --wire-dtype fp8's records (kernels/moe_compute.h): QuantizeRowsFp8 writes the CPU's
// records byte for byte (scales and e4m3 values), from f32 and bf16 rows, for hidden sizes
// with a partial last group, rows gathered out of order and repeated, a row of zeros (the
// 1e-4 scale floor) and rows whose largest value lands on 448; DequantizeRowsFp8 gives the
// CPU's values bit for bit into f32 and bf16. Zero rows are nothing to do; a record of the
// wrong width is INVALID_ARGUMENT.
TEST_F(CudaBackendTest, Fp8RecordsAreTheCpusBitForBit) {
  for (const int64_t hidden : {int64_t{64}, int64_t{200}, int64_t{2048}}) {
    const int64_t src_rows = 50, bytes = Fp8RecordBytes(hidden);
    std::vector<float> host = RandomFloats(src_rows * hidden, 77 + static_cast<uint32_t>(hidden));
    for (int64_t r = 0; r < src_rows; ++r) {
      const float scale = std::pow(10.f, static_cast<float>(r % 7) - 3.f);  // 1e-3 .. 1e3
      for (int64_t j = 0; j < hidden; ++j) host[r * hidden + j] *= scale;
    }
    std::fill(host.begin() + 3 * hidden, host.begin() + 4 * hidden, 0.f);  // row 3: zeros
    std::vector<int32_t> rows;
    for (int i = 0; i < 37; ++i) rows.push_back((i * 17 + 5) % src_rows);
    rows.push_back(3);
    rows.push_back(rows.front());
    const int64_t n = static_cast<int64_t>(rows.size());
    for (DType dtype : {DType::kF32, DType::kBF16}) {
      SCOPED_TRACE(::testing::Message() << "hidden " << hidden << ", " << DTypeName(dtype));
      Tensor gs = Put(gpu_.get(), host, {src_rows, hidden}, dtype);
      Tensor cs = Put(cpu_.get(), host, {src_rows, hidden}, dtype);
      Tensor gr = *gpu_->Allocate({n, bytes}, DType::kF8E4M3);
      Tensor cr = *cpu_->Allocate({n, bytes}, DType::kF8E4M3);
      ASSERT_TRUE(gpu_->QuantizeRowsFp8(gs, PutIndices(gpu_.get(), rows), &gr).ok());
      ASSERT_TRUE(cpu_->QuantizeRowsFp8(cs, PutIndices(cpu_.get(), rows), &cr).ok());
      std::vector<uint8_t> got(n * bytes, 0xAB), want(n * bytes);
      ASSERT_TRUE(gpu_->CopyToHost(gr, DType::kF8E4M3, got.data()).ok());
      ASSERT_TRUE(cpu_->CopyToHost(cr, DType::kF8E4M3, want.data()).ok());
      int64_t differ = 0, saturated = 0;
      for (size_t b = 0; b < got.size(); ++b) {
        differ += got[b] != want[b] ? 1 : 0;
        const int64_t in_record = static_cast<int64_t>(b) % bytes;
        if (in_record >= bytes - hidden && (want[b] & 0x7f) == 0x7e) ++saturated;
      }
      EXPECT_EQ(differ, 0) << "of " << got.size() << " record bytes";
      EXPECT_GT(saturated, 0) << "no group's largest value landed on 448";
      // Dequantized from the CPU's records on each backend.
      for (DType out : {DType::kF32, DType::kBF16}) {
        Tensor records = *gpu_->Allocate({n, bytes}, DType::kF8E4M3);
        ASSERT_TRUE(gpu_->CopyFromHost(want.data(), DType::kF8E4M3, &records).ok());
        Tensor gd = Poisoned(gpu_.get(), {n, hidden}, out);
        Tensor cd = Poisoned(cpu_.get(), {n, hidden}, out);
        ASSERT_TRUE(gpu_->DequantizeRowsFp8(records, &gd).ok());
        ASSERT_TRUE(cpu_->DequantizeRowsFp8(cr, &cd).ok());
        const std::vector<float> g = Get(gpu_.get(), gd), c = Get(cpu_.get(), cd);
        ASSERT_EQ(g.size(), c.size());
        EXPECT_EQ(std::memcmp(g.data(), c.data(), g.size() * sizeof(float)), 0)
            << "dequantized into " << DTypeName(out);
      }
    }
  }
  Tensor src = Put(gpu_.get(), RandomFloats(4 * 64, 5), {4, 64}, DType::kF32);
  Tensor none = *gpu_->Allocate({0, Fp8RecordBytes(64)}, DType::kF8E4M3);
  EXPECT_TRUE(gpu_->QuantizeRowsFp8(src, PutIndices(gpu_.get(), {}), &none).ok());
  Tensor narrow = *gpu_->Allocate({4, 64}, DType::kF8E4M3);
  EXPECT_EQ(gpu_->QuantizeRowsFp8(src, PutIndices(gpu_.get(), {0, 1}), &narrow).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(gpu_->DequantizeRowsFp8(narrow, &src).code(), absl::StatusCode::kInvalidArgument);
}

TEST_F(CudaBackendTest, EventsOrderTheQueue) {
  absl::StatusOr<std::unique_ptr<Event>> e = gpu_->CreateEvent();
  ASSERT_TRUE(e.ok()) << e.status();
  Tensor t = Poisoned(gpu_.get(), {1 << 20}, DType::kF32);
  ASSERT_TRUE(gpu_->Fill(&t, 3.f).ok());
  ASSERT_TRUE(gpu_->RecordEvent(e->get()).ok());
  ASSERT_TRUE(gpu_->WaitEvent(e->get()).ok());
  ASSERT_TRUE(gpu_->SynchronizeEvent(e->get()).ok());
  std::vector<float> v = Get(gpu_.get(), t);
  EXPECT_TRUE(std::all_of(v.begin(), v.end(), [](float x) { return x == 3.f; }));
}

TEST_F(CudaBackendTest, BadShapesAreInvalidArgumentAndLaunchNothing) {
  Tensor x = Poisoned(gpu_.get(), {4, 8}, DType::kBF16);
  Tensor w = Poisoned(gpu_.get(), {6, 9}, DType::kBF16);
  Tensor y = Poisoned(gpu_.get(), {4, 6}, DType::kBF16);
  EXPECT_EQ(gpu_->Linear(x, w, nullptr, &y).code(), absl::StatusCode::kInvalidArgument);
  Tensor wf = Poisoned(gpu_.get(), {6, 8}, DType::kF32);
  EXPECT_EQ(gpu_->Linear(x, wf, nullptr, &y).code(), absl::StatusCode::kInvalidArgument);
  Tensor ids = Poisoned(gpu_.get(), {4, 8}, DType::kI32),
         wts = Poisoned(gpu_.get(), {4, 8}, DType::kF32);
  EXPECT_EQ(gpu_->TopKSoftmax(y, 9, true, &ids, &wts).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(gpu_->Synchronize().ok());
}

}  // namespace
}  // namespace dxs
