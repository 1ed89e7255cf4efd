// CPU backend operations against straightforward reference loops.
#include "kernels/cpu_backend.h"

#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <utility>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/backend.h"
#include "model/sampler.h"

namespace dxs {
namespace {

class CpuBackendTest : public ::testing::Test {
 protected:
  Tensor Up(const std::vector<float>& v, std::vector<int64_t> shape) {
    absl::StatusOr<Tensor> t = b_->Upload(v, std::move(shape));
    EXPECT_TRUE(t.ok()) << t.status();
    return *t;
  }
  Tensor Ids(const std::vector<int32_t>& v) { return *b_->UploadIndices(v); }
  Tensor Alloc(std::vector<int64_t> shape, DType dtype = DType::kF32) {
    return *b_->Allocate(std::move(shape), dtype);
  }
  std::vector<float> Down(const Tensor& t) { return *b_->Download(t); }
  std::unique_ptr<Backend> b_ = MakeCpuBackend();
};

TEST_F(CpuBackendTest, LinearMatchesNaiveProduct) {
  const int64_t m = 3, k = 5, n = 4;
  std::vector<float> x(m * k), w(n * k), bias(n);
  for (size_t i = 0; i < x.size(); ++i) x[i] = 0.1f * static_cast<float>(i) - 0.7f;
  for (size_t i = 0; i < w.size(); ++i) w[i] = 0.05f * static_cast<float>(i % 7) - 0.2f;
  for (size_t i = 0; i < bias.size(); ++i) bias[i] = static_cast<float>(i);
  Tensor tx = Up(x, {m, k}), tw = Up(w, {n, k}), tb = Up(bias, {n});
  Tensor ty = Alloc({m, n});
  ASSERT_TRUE(b_->Linear(tx, tw, &tb, &ty).ok());
  std::vector<float> y = Down(ty);
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t j = 0; j < n; ++j) {
      double ref = bias[j];
      for (int64_t p = 0; p < k; ++p) ref += x[i * k + p] * w[j * k + p];
      EXPECT_NEAR(y[i * n + j], ref, 1e-5);
    }
  }
}

TEST_F(CpuBackendTest, LinearsAreLinearForEachWeight) {
  const int64_t m = 2, k = 6;
  std::vector<float> x(m * k);
  for (size_t i = 0; i < x.size(); ++i) x[i] = 0.3f * static_cast<float>(i) - 1.f;
  const Tensor tx = Up(x, {m, k});
  std::vector<Tensor> ws, ys, want;
  for (int64_t n : {3, 1, 5}) {
    std::vector<float> w(n * k);
    for (size_t i = 0; i < w.size(); ++i) w[i] = 0.07f * static_cast<float>((i * n) % 11) - 0.3f;
    ws.push_back(Up(w, {n, k}));
    ys.push_back(Alloc({m, n}));
    want.push_back(Alloc({m, n}));
    ASSERT_TRUE(b_->Linear(tx, ws.back(), nullptr, &want.back()).ok());
  }
  ASSERT_TRUE(b_->Linears(tx, {&ws[0], &ws[1], &ws[2]}, {&ys[0], &ys[1], &ys[2]}).ok());
  for (size_t i = 0; i < ws.size(); ++i) EXPECT_EQ(Down(ys[i]), Down(want[i])) << i;
  EXPECT_EQ(b_->Linears(tx, {&ws[0], &ws[1]}, {&ys[0]}).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(b_->Linears(tx, {&ws[0]}, {nullptr}).code(), absl::StatusCode::kInvalidArgument);
  // A shape mismatch is Linear's INVALID_ARGUMENT.
  EXPECT_EQ(b_->Linears(tx, {&ws[0]}, {&ys[1]}).code(), absl::StatusCode::kInvalidArgument);
}

// CountPendingTokens: a row whose adjustments end in a pending entry counts its token into
// the entry that names it, or makes the pending entry that token's; other rows stay.
TEST_F(CpuBackendTest, CountPendingTokensCountsTheTokenInFlight) {
  const std::vector<LogitAdjustment> adjust = {
      {5, 1, 0.f, kAdjustSeen}, {9, 0, 2.f, kAdjustSeen},    {0, 0, 0.f, kAdjustPending},  // row 0
      {3, 2, 0.f, kAdjustSeen}, {1, 0, 0.f, kAdjustPending},                               // row 1
      {4, 0, 0.f, kAdjustSeen},                                                            // row 2
  };
  std::vector<SamplingRow> rows = {
      ToSamplingRow(SamplingParams{}, 0, 0, 3), ToSamplingRow(SamplingParams{}, 0, 3, 2),
      ToSamplingRow(SamplingParams{}, 0, 5, 1), ToSamplingRow(SamplingParams{}, 0, 6, 0)};
  Tensor params = *b_->Allocate({4, kSamplingRowWords}, DType::kI64);
  ASSERT_TRUE(b_->CopyFromHost(rows.data(), DType::kI64, &params).ok());
  Tensor adjustments = *b_->Allocate({6, kLogitAdjustmentWords}, DType::kI32);
  ASSERT_TRUE(b_->CopyFromHost(adjust.data(), DType::kI32, &adjustments).ok());
  ASSERT_TRUE(b_->CountPendingTokens(Ids({9, 7, 4, 2}), params, &adjustments).ok());
  std::vector<LogitAdjustment> got(6);
  ASSERT_TRUE(b_->CopyToHost(adjustments, DType::kI32, got.data()).ok());
  auto same = [](const LogitAdjustment& a, const LogitAdjustment& b) {
    return a.token == b.token && a.output_count == b.output_count && a.bias == b.bias &&
           a.flags == b.flags;
  };
  EXPECT_TRUE(same(got[0], adjust[0]));
  EXPECT_TRUE(same(got[1], (LogitAdjustment{9, 1, 2.f, kAdjustSeen})));  // counted in place
  EXPECT_TRUE(same(got[2], adjust[2]));                                  // left pending: a no-op
  EXPECT_TRUE(same(got[3], adjust[3]));
  EXPECT_TRUE(same(got[4], (LogitAdjustment{7, 1, 0.f, kAdjustSeen})));  // became token 7's
  EXPECT_TRUE(same(got[5], adjust[5]));  // no pending entry: nothing to count
  // A pending entry changes no logit.
  std::vector<float> row = {1.f, -2.f, 3.f};
  SamplingParams penalised;
  penalised.repetition_penalty = 2.f;
  penalised.frequency_penalty = 1.f;
  penalised.presence_penalty = 1.f;
  const LogitAdjustment pending{1, 0, 0.f, kAdjustPending};
  ApplyLogitAdjustments(penalised, &pending, 1, row.data());
  EXPECT_EQ(row, (std::vector<float>{1.f, -2.f, 3.f}));
  // Adjustments past the list are INVALID_ARGUMENT.
  rows[3] = ToSamplingRow(SamplingParams{}, 0, 5, 2);
  ASSERT_TRUE(b_->CopyFromHost(rows.data(), DType::kI64, &params).ok());
  EXPECT_EQ(b_->CountPendingTokens(Ids({9, 7, 4, 2}), params, &adjustments).code(),
            absl::StatusCode::kInvalidArgument);
}

TEST_F(CpuBackendTest, ZeroRowOperationsAreNoOps) {
  Tensor x = Alloc({0, 8}), w = Up(std::vector<float>(32, 1.f), {4, 8});
  Tensor y = Alloc({0, 4});
  EXPECT_TRUE(b_->Linear(x, w, nullptr, &y).ok());
  Tensor norm_w = Up(std::vector<float>(8, 1.f), {8});
  Tensor xn = Alloc({0, 8});
  EXPECT_TRUE(b_->RmsNorm(x, norm_w, 1e-6f, &xn).ok());
  EXPECT_TRUE(b_->GatherRows(x, Ids({}), &xn).ok());
  EXPECT_TRUE(b_->ScaleAddRows(x, Alloc({0}), Ids({}), &xn).ok());
  EXPECT_EQ(y.num_elements(), 0);
}

TEST_F(CpuBackendTest, RmsNormAndRope) {
  Tensor x = Up({3.f, 4.f}, {1, 2});
  Tensor w = Up({1.f, 2.f}, {2});
  Tensor y = Alloc({1, 2});
  ASSERT_TRUE(b_->RmsNorm(x, w, 0.f, &y).ok());
  const float rms = std::sqrt((9.f + 16.f) / 2.f);
  EXPECT_NEAR(Down(y)[0], 3.f / rms, 1e-6);
  EXPECT_NEAR(Down(y)[1], 2.f * 4.f / rms, 1e-6);
  // RoPE at position 0 is the identity; at p rotates pairs (i, i + d/2) by p * theta^(-2i/d).
  Tensor r = Up({1.f, 0.f, 0.f, 1.f}, {1, 1, 4});
  ASSERT_TRUE(b_->Rope(&r, Ids({0}), 10000.0).ok());
  EXPECT_EQ(Down(r), (std::vector<float>{1.f, 0.f, 0.f, 1.f}));
  Tensor s = Up({1.f, 0.f, 0.f, 0.f}, {1, 1, 4});
  ASSERT_TRUE(b_->Rope(&s, Ids({2}), 10000.0).ok());
  std::vector<float> v = Down(s);
  EXPECT_NEAR(v[0], std::cos(2.0), 1e-6);
  EXPECT_NEAR(v[2], std::sin(2.0), 1e-6);
}

// Paged metadata for sequences of (past, new) tokens with the given block tables.
PagedAttentionMeta Meta(Backend* b, int64_t block_size,
                        const std::vector<std::pair<int, int>>& seqs,
                        const std::vector<std::vector<int32_t>>& tables) {
  PagedAttentionMeta m;
  m.num_seqs = static_cast<int64_t>(seqs.size());
  m.block_size = block_size;
  for (const auto& t : tables) {
    m.max_blocks_per_seq = std::max<int64_t>(m.max_blocks_per_seq, t.size());
  }
  std::vector<int32_t> qs = {0}, ctx, bt;
  std::vector<int64_t> slots;
  for (size_t s = 0; s < seqs.size(); ++s) {
    const auto [past, fresh] = seqs[s];
    for (int i = 0; i < fresh; ++i) {
      const int p = past + i;
      slots.push_back(tables[s][p / block_size] * block_size + p % block_size);
    }
    qs.push_back(qs.back() + fresh);
    ctx.push_back(past + fresh);
    m.max_query_len = std::max<int64_t>(m.max_query_len, fresh);
    m.max_context_len = std::max<int64_t>(m.max_context_len, past + fresh);
    for (int64_t j = 0; j < m.max_blocks_per_seq; ++j) {
      bt.push_back(j < static_cast<int64_t>(tables[s].size()) ? tables[s][j] : 0);
    }
  }
  m.query_start = *b->UploadIndices(qs);
  m.context_lens = *b->UploadIndices(ctx);
  m.block_tables = *b->UploadIndices(bt);
  m.slot_mapping = *b->Allocate({static_cast<int64_t>(slots.size())}, DType::kI64);
  EXPECT_TRUE(b->CopyFromHost(slots.data(), DType::kI64, &m.slot_mapping).ok());
  return m;
}

// A padded decode step's padding rows (slot -1) cache nothing, as on a GPU; a slot past the
// pool is refused.
TEST_F(CpuBackendTest, WriteKvCacheSkipsPaddingRows) {
  Tensor k = Up({1.f, 2.f, 3.f, 4.f}, {2, 1, 2});
  Tensor k_cache = *b_->Zeros({2, 1, 1, 2}, DType::kF32);
  Tensor v_cache = *b_->Zeros({2, 1, 1, 2}, DType::kF32);
  PagedAttentionMeta meta = Meta(b_.get(), 1, {{0, 2}}, {{1, 0}});
  const std::vector<int64_t> slots = {1, -1};
  ASSERT_TRUE(b_->CopyFromHost(slots.data(), DType::kI64, &meta.slot_mapping).ok());
  ASSERT_TRUE(b_->WriteKvCache(k, k, meta, &k_cache, &v_cache).ok());
  EXPECT_EQ(Down(k_cache), (std::vector<float>{0, 0, 1, 2}));
  const std::vector<int64_t> past = {1, 2};
  ASSERT_TRUE(b_->CopyFromHost(past.data(), DType::kI64, &meta.slot_mapping).ok());
  EXPECT_EQ(b_->WriteKvCache(k, k, meta, &k_cache, &v_cache).code(),
            absl::StatusCode::kInvalidArgument);
}

TEST_F(CpuBackendTest, PagedAttentionIsCausalAndGrouped) {
  // Two heads share one KV head; one sequence of two new tokens, block size 1, its blocks
  // out of order in the pool. Query 0 sees only position 0 -> output is v[0].
  Tensor q = Up({1.f, 0.f, 0.f, 1.f, 1.f, 0.f, 0.f, 1.f}, {2, 2, 2});
  Tensor k = Up({1.f, 0.f, 0.f, 1.f}, {2, 1, 2});
  Tensor v = Up({10.f, 20.f, 30.f, 40.f}, {2, 1, 2});
  Tensor k_cache = *b_->Zeros({4, 1, 1, 2}, DType::kF32);
  Tensor v_cache = *b_->Zeros({4, 1, 1, 2}, DType::kF32);
  PagedAttentionMeta meta = Meta(b_.get(), 1, {{0, 2}}, {{3, 1}});
  ASSERT_TRUE(b_->WriteKvCache(k, v, meta, &k_cache, &v_cache).ok());
  EXPECT_EQ(Down(v_cache), (std::vector<float>{0, 0, 30, 40, 0, 0, 10, 20}));
  Tensor out = Alloc({2, 4});
  ASSERT_TRUE(b_->PagedAttention(q, k_cache, v_cache, meta, 1.f, &out).ok());
  std::vector<float> o = Down(out);
  EXPECT_FLOAT_EQ(o[0], 10.f);
  EXPECT_FLOAT_EQ(o[3], 20.f);
  // Query 1, head 0 = (1, 0): scores (1, 0) over positions 0, 1.
  const double w0 = std::exp(1.0) / (std::exp(1.0) + 1.0);
  EXPECT_NEAR(o[4], w0 * 10 + (1 - w0) * 30, 1e-4);
}

TEST_F(CpuBackendTest, PagedAttentionMixesPrefillAndDecodeAcrossBlocks) {
  // Sequence A decodes 1 token after 5 cached (blocks of 2: [4, 0, 2]); sequence B prefills
  // 3 tokens into blocks [1, 3]. Each must equal attention over its own positions only.
  const int64_t d = 4, bs = 2;
  std::vector<float> kv_a(6 * d), kv_b(3 * d), qa(d), qb(3 * d);
  for (size_t i = 0; i < kv_a.size(); ++i) kv_a[i] = std::sin(0.3f * i);
  for (size_t i = 0; i < kv_b.size(); ++i) kv_b[i] = std::cos(0.7f * i);
  for (size_t i = 0; i < qa.size(); ++i) qa[i] = 0.5f - 0.1f * i;
  for (size_t i = 0; i < qb.size(); ++i) qb[i] = std::sin(1.1f * i);
  Tensor k_cache = *b_->Zeros({5, bs, 1, d}, DType::kF32);
  Tensor v_cache = *b_->Zeros({5, bs, 1, d}, DType::kF32);
  // A's first five positions were cached in an earlier step.
  PagedAttentionMeta past = Meta(b_.get(), bs, {{0, 5}}, {{4, 0, 2}});
  std::vector<float> first5(kv_a.begin(), kv_a.begin() + 5 * d);
  ASSERT_TRUE(
      b_->WriteKvCache(Up(first5, {5, 1, d}), Up(first5, {5, 1, d}), past, &k_cache, &v_cache)
          .ok());
  PagedAttentionMeta meta = Meta(b_.get(), bs, {{5, 1}, {0, 3}}, {{4, 0, 2}, {1, 3}});
  std::vector<float> new_k(kv_a.end() - d, kv_a.end());
  new_k.insert(new_k.end(), kv_b.begin(), kv_b.end());
  ASSERT_TRUE(
      b_->WriteKvCache(Up(new_k, {4, 1, d}), Up(new_k, {4, 1, d}), meta, &k_cache, &v_cache).ok());
  std::vector<float> q_all = qa;
  q_all.insert(q_all.end(), qb.begin(), qb.end());
  Tensor out = Alloc({4, d});
  ASSERT_TRUE(b_->PagedAttention(Up(q_all, {4, 1, d}), k_cache, v_cache, meta, 0.5f, &out).ok());
  std::vector<float> o = Down(out);
  // Reference: plain causal attention with k == v.
  auto ref = [&](const float* q, const std::vector<float>& kv, int visible, int j) {
    std::vector<double> w(visible);
    double mx = -1e30, sum = 0;
    for (int p = 0; p < visible; ++p) {
      double dot = 0;
      for (int x = 0; x < d; ++x) dot += q[x] * kv[p * d + x];
      w[p] = 0.5 * dot;
      mx = std::max(mx, w[p]);
    }
    double acc = 0;
    for (int p = 0; p < visible; ++p) sum += std::exp(w[p] - mx);
    for (int p = 0; p < visible; ++p) acc += std::exp(w[p] - mx) / sum * kv[p * d + j];
    return acc;
  };
  for (int j = 0; j < d; ++j) EXPECT_NEAR(o[j], ref(qa.data(), kv_a, 6, j), 1e-5) << j;
  for (int i = 0; i < 3; ++i) {
    for (int j = 0; j < d; ++j) {
      EXPECT_NEAR(o[(1 + i) * d + j], ref(qb.data() + i * d, kv_b, i + 1, j), 1e-5) << i << j;
    }
  }
  // Positions past a sequence's table are an error, not a read out of bounds.
  PagedAttentionMeta bad = Meta(b_.get(), bs, {{5, 1}}, {{4, 0, 2}});
  std::vector<int32_t> too_long = {7};
  ASSERT_TRUE(b_->CopyFromHost(too_long.data(), DType::kI32, &bad.context_lens).ok());
  EXPECT_EQ(b_->PagedAttention(Up(qa, {1, 1, d}), k_cache, v_cache, bad, 1.f, &out).code(),
            absl::StatusCode::kInvalidArgument);
}

TEST_F(CpuBackendTest, DispatchLayoutCombineAndSortPairs) {
  // 3 tokens, top-2 over 4 experts owned by ranks {0, 0, 1, 1}.
  Tensor ids = Ids({0, 2, 1, 0, 3, 2});
  ids = ids.Reshape({3, 2});
  Tensor weights = Up({0.6f, 0.4f, 0.7f, 0.3f, 0.9f, 0.1f}, {3, 2});
  DispatchLayoutTensors layout;
  ASSERT_TRUE(b_->ComputeDispatchLayout(ids, weights, Ids({0, 0, 1, 1}), 2, &layout).ok());
  EXPECT_EQ(*b_->DownloadIndices(layout.num_tokens_per_rank), (std::vector<int32_t>{2, 2}));
  EXPECT_EQ(*b_->DownloadIndices(layout.num_pairs_per_rank), (std::vector<int32_t>{3, 3}));
  EXPECT_EQ(*b_->DownloadIndices(layout.num_tokens_per_expert), (std::vector<int32_t>{2, 1, 2, 1}));
  std::vector<int32_t> token_rows = *b_->DownloadIndices(layout.token_rows);
  EXPECT_EQ(std::vector<int32_t>(token_rows.begin(), token_rows.begin() + 4),
            (std::vector<int32_t>{0, 1, 0, 2}));
  // Per rank one block: rows | experts | weights (float bits).
  const std::vector<int32_t> pairs = *b_->DownloadIndices(layout.pairs);
  ASSERT_EQ(pairs.size(), 18u);
  EXPECT_EQ(std::vector<int32_t>(pairs.begin(), pairs.begin() + 6),
            (std::vector<int32_t>{0, 1, 1, 0, 1, 0}));  // rank 0: rows, experts
  EXPECT_EQ(std::vector<int32_t>(pairs.begin() + 9, pairs.begin() + 15),
            (std::vector<int32_t>{0, 1, 1, 2, 3, 2}));  // rank 1: rows, experts
  float w0;
  std::memcpy(&w0, &pairs[6], sizeof(w0));
  EXPECT_EQ(w0, 0.6f);
  // An expert no rank owns is an error.
  EXPECT_FALSE(b_->ComputeDispatchLayout(ids, weights, Ids({0, 0, 5, 1}), 2, &layout).ok());

  // Combine: rank 0 answers tokens 0, 1; rank 1 tokens 0, 2; token 0 is their sum.
  Tensor recv = Up({1, 2, 3, 4, 10, 20, 30, 40}, {4, 2});
  Tensor out = Alloc({3, 2});
  ASSERT_TRUE(b_->CombineRows(recv, Ids({0, 1, 0, 2}), {0, 2, 4}, &out).ok());
  EXPECT_EQ(Down(out), (std::vector<float>{11, 22, 3, 4, 30, 40}));
  // Into bf16: summed in float32, rounded once; a token no rank holds is zero.
  Tensor out16 = Alloc({4, 2}, DType::kBF16);
  ASSERT_TRUE(b_->CombineRows(recv, Ids({0, 1, 0, 2}), {0, 2, 4}, &out16).ok());
  EXPECT_EQ(Down(out16), (std::vector<float>{11, 22, 3, 4, 30, 40, 0, 0}));

  // Stable sort by expert.
  Tensor order = Alloc({6}, DType::kI32), offsets = Alloc({5}, DType::kI32);
  ASSERT_TRUE(b_->SortPairsByExpert(Ids({2, 0, 2, 1, 0, 3}), 4, &order, &offsets, {}).ok());
  EXPECT_EQ(*b_->DownloadIndices(order), (std::vector<int32_t>{1, 4, 3, 0, 2, 5}));
  EXPECT_EQ(*b_->DownloadIndices(offsets), (std::vector<int32_t>{0, 2, 3, 5, 6}));

  // Payloads come out as GatherRows by the order would write them, bit for bit.
  const Tensor rows = Ids({10, 11, 12, 13, 14, 15});
  const Tensor payload_weights = *b_->Upload({0.5f, -0.f, 1e-30f, 3.f, -2.f, 7.f}, {6});
  Tensor sorted_rows = Alloc({6}, DType::kI32), sorted_weights = Alloc({6}, DType::kF32);
  Tensor order2 = Alloc({6}, DType::kI32), offsets2 = Alloc({5}, DType::kI32);
  ASSERT_TRUE(b_->SortPairsByExpert(Ids({2, 0, 2, 1, 0, 3}), 4, &order2, &offsets2,
                                    {{&rows, &sorted_rows}, {&payload_weights, &sorted_weights}})
                  .ok());
  EXPECT_EQ(*b_->DownloadIndices(order2), *b_->DownloadIndices(order));
  EXPECT_EQ(*b_->DownloadIndices(offsets2), *b_->DownloadIndices(offsets));
  Tensor gathered_rows = Alloc({6}, DType::kI32), gathered_weights = Alloc({6}, DType::kF32);
  ASSERT_TRUE(b_->GatherRows(rows, order, &gathered_rows).ok());
  ASSERT_TRUE(b_->GatherRows(payload_weights, order, &gathered_weights).ok());
  EXPECT_EQ(*b_->DownloadIndices(sorted_rows), *b_->DownloadIndices(gathered_rows));
  EXPECT_EQ(0, std::memcmp(sorted_weights.raw(), gathered_weights.raw(), 6 * sizeof(float)));

  // Payloads of another length or dtype, too many, or missing are refused.
  Tensor short_rows = Alloc({5}, DType::kI32), bf16 = Alloc({6}, DType::kBF16);
  for (const std::vector<PairPayload>& bad :
       {std::vector<PairPayload>{{&rows, &short_rows}},
        std::vector<PairPayload>{{&rows, &sorted_weights}},
        std::vector<PairPayload>{{&bf16, &bf16}}, std::vector<PairPayload>{{&rows, nullptr}},
        std::vector<PairPayload>(4, PairPayload{&rows, &sorted_rows})}) {
    EXPECT_EQ(b_->SortPairsByExpert(Ids({2, 0, 2, 1, 0, 3}), 4, &order2, &offsets2, bad).code(),
              absl::StatusCode::kInvalidArgument);
  }
}

// Seeded normal floats.
std::vector<float> Normal(size_t n, uint32_t seed, float stddev = 1.f) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> dist(0.f, stddev);
  std::vector<float> v(n);
  for (float& x : v) x = dist(rng);
  return v;
}

bool SameBits(const Tensor& a, const Tensor& b) {
  return a.num_bytes() == b.num_bytes() && std::memcmp(a.raw(), b.raw(), a.num_bytes()) == 0;
}

// The fused ops are the unfused sequences' arithmetic: the same bits.
TEST_F(CpuBackendTest, AddRmsNormIsAddThenRmsNorm) {
  for (const auto& [rows, cols] :
       {std::pair<int64_t, int64_t>{0, 64}, {1, 2048}, {37, 96}, {5, 7}}) {
    SCOPED_TRACE(::testing::Message() << rows << "x" << cols);
    const uint32_t seed = static_cast<uint32_t>(rows * 31 + cols);
    const std::vector<float> x = Normal(rows * cols, seed), r = Normal(rows * cols, seed + 1, 4.f);
    std::vector<float> w = Normal(cols, seed + 2);
    Tensor weight = Up(w, {cols});
    Tensor r_want = Up(r, {rows, cols}), y_want = Alloc({rows, cols});
    ASSERT_TRUE(b_->Add(Up(x, {rows, cols}), &r_want).ok());
    ASSERT_TRUE(b_->RmsNorm(r_want, weight, 1e-6f, &y_want).ok());
    Tensor r_got = Up(r, {rows, cols}),
           y_got = Up(std::vector<float>(rows * cols, NAN), {rows, cols});
    ASSERT_TRUE(b_->AddRmsNorm(Up(x, {rows, cols}), weight, 1e-6f, &r_got, &y_got).ok());
    EXPECT_TRUE(SameBits(r_got, r_want));
    EXPECT_TRUE(SameBits(y_got, y_want));
  }
  // Mismatched sizes, a non-f32 residual, rows the weight does not tile.
  Tensor x = Alloc({2, 8}), r = Alloc({2, 8}), y = Alloc({2, 8}), w = Alloc({8});
  Tensor r_short = Alloc({2, 7}), r_bf16 = Alloc({2, 8}, DType::kBF16), w3 = Alloc({3});
  EXPECT_EQ(b_->AddRmsNorm(x, w, 1e-6f, &r_short, &y).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(b_->AddRmsNorm(x, w, 1e-6f, &r_bf16, &y).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(b_->AddRmsNorm(x, w3, 1e-6f, &r, &y).code(), absl::StatusCode::kInvalidArgument);
}

TEST_F(CpuBackendTest, QkNormRopeIsRmsNormThenRope) {
  struct Shape {
    int64_t tokens, q_heads, k_heads, d;
  };
  for (const Shape& s :
       {Shape{0, 4, 2, 16}, Shape{1, 32, 4, 128}, Shape{9, 3, 1, 24}, Shape{4, 2, 2, 64}}) {
    SCOPED_TRACE(::testing::Message() << s.tokens << " tokens, " << s.q_heads << "/" << s.k_heads
                                      << " heads of " << s.d);
    const uint32_t seed = static_cast<uint32_t>(s.tokens * 13 + s.d);
    const std::vector<float> q = Normal(s.tokens * s.q_heads * s.d, seed, 3.f);
    const std::vector<float> k = Normal(s.tokens * s.k_heads * s.d, seed + 1, 3.f);
    Tensor qw = Up(Normal(s.d, seed + 2), {s.d}), kw = Up(Normal(s.d, seed + 3), {s.d});
    std::vector<int32_t> pos;
    for (int64_t t = 0; t < s.tokens; ++t) pos.push_back(static_cast<int32_t>(t * 997 % 40000));
    const Tensor positions = Ids(pos);
    Tensor q_want = Up(q, {s.tokens, s.q_heads, s.d}), k_want = Up(k, {s.tokens, s.k_heads, s.d});
    ASSERT_TRUE(b_->RmsNorm(q_want, qw, 1e-6f, &q_want).ok());
    ASSERT_TRUE(b_->RmsNorm(k_want, kw, 1e-6f, &k_want).ok());
    ASSERT_TRUE(b_->Rope(&q_want, positions, 1e6).ok());
    ASSERT_TRUE(b_->Rope(&k_want, positions, 1e6).ok());
    Tensor q_got = Up(q, {s.tokens, s.q_heads, s.d}), k_got = Up(k, {s.tokens, s.k_heads, s.d});
    ASSERT_TRUE(b_->QkNormRope(&q_got, &k_got, qw, kw, 1e-6f, positions, 1e6).ok());
    EXPECT_TRUE(SameBits(q_got, q_want));
    EXPECT_TRUE(SameBits(k_got, k_want));
  }
  // Odd head_dim, weights of another length, k of other tokens or head_dim, bad positions.
  Tensor q = Alloc({2, 4, 8}), k = Alloc({2, 1, 8}), w = Alloc({8}), pos = Ids({0, 1});
  Tensor q_odd = Alloc({2, 4, 7}), k_odd = Alloc({2, 1, 7}), w7 = Alloc({7}), w4 = Alloc({4});
  Tensor k_tokens = Alloc({3, 1, 8}), k_dim = Alloc({2, 1, 4});
  EXPECT_EQ(b_->QkNormRope(&q_odd, &k_odd, w7, w7, 1e-6f, pos, 1e4).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(b_->QkNormRope(&q, &k, w4, w, 1e-6f, pos, 1e4).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(b_->QkNormRope(&q, &k_tokens, w, w, 1e-6f, pos, 1e4).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(b_->QkNormRope(&q, &k_dim, w, w, 1e-6f, pos, 1e4).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(b_->QkNormRope(&q, &k, w, w, 1e-6f, Ids({0}), 1e4).code(),
            absl::StatusCode::kInvalidArgument);
}

// Greedy sampling on the backend is the sampler's Argmax (model/sampler.h): the first
// maximum, NaN never chosen unless it is at index 0.
TEST_F(CpuBackendTest, ArgmaxRowsIsTheSamplersArgmax) {
  const float nan = std::nanf(""), inf = INFINITY;
  const std::vector<std::pair<std::vector<float>, int32_t>> cases = {
      {{1, 3, 3, 2}, 1}, {{nan, 5, 6}, 0},   {{1, nan, 0.5f}, 0},
      {{-inf, -inf}, 0}, {{2, inf, inf}, 1}, {{7}, 0}};
  for (const auto& [row, want] : cases) {
    Tensor logits = *b_->Upload(row, {1, static_cast<int64_t>(row.size())});
    Tensor ids = Alloc({1}, DType::kI32);
    ASSERT_TRUE(b_->ArgmaxRows(logits, &ids).ok());
    EXPECT_EQ(b_->DownloadIndices(ids)->at(0), want);
  }
  Tensor logits = Alloc({2, 3}), ids = Alloc({3}, DType::kI32);
  EXPECT_EQ(b_->ArgmaxRows(logits, &ids).code(), absl::StatusCode::kInvalidArgument);
}

TEST_F(CpuBackendTest, AccumulateCountsAddsEachExpertsRun) {
  Tensor offsets = *b_->UploadIndices({0, 3, 3, 7, 10});
  Tensor counts = *b_->Zeros({4}, DType::kI64);
  ASSERT_TRUE(b_->AccumulateCounts(offsets, &counts).ok());
  ASSERT_TRUE(b_->AccumulateCounts(offsets, &counts).ok());
  std::vector<int64_t> host(4);
  ASSERT_TRUE(b_->CopyToHost(counts, DType::kI64, host.data()).ok());
  EXPECT_EQ(host, (std::vector<int64_t>{6, 0, 8, 6}));
  Tensor wrong = *b_->Zeros({3}, DType::kI64);
  EXPECT_EQ(b_->AccumulateCounts(offsets, &wrong).code(), absl::StatusCode::kInvalidArgument);
}

// Two DP ranks' pair blocks (rows | experts | weight bits) unpacked with their row offsets;
// bad pairs counted, the lowest named; no pairs touches nothing.
TEST_F(CpuBackendTest, UnpackRoutedPairsChecksEachSegmentsRowsAndTheHeldExperts) {
  auto bits = [](float w) {
    int32_t b;
    std::memcpy(&b, &w, sizeof(b));
    return b;
  };
  // Segment 0: 2 pairs over 3 rows at row 0; segment 1: 3 pairs over 2 rows at row 3.
  std::vector<int32_t> blocks = {2, 0, 1, 3, bits(0.25f), bits(0.75f), 1,        0,
                                 1, 3, 1, 3, bits(0.5f),  bits(1.f),   bits(2.f)};
  const std::vector<PairSegment> segments = {{0, 2, 0, 3}, {2, 3, 3, 2}};
  Tensor held = Ids({0, 1, 0, 1});  // experts 1 and 3
  Tensor rows = Alloc({5}, DType::kI32), experts = Alloc({5}, DType::kI32);
  Tensor weights = Alloc({5}), bad = Alloc({2}, DType::kI32);
  ASSERT_TRUE(
      b_->UnpackRoutedPairs(Ids(blocks), segments, held, &rows, &experts, &weights, &bad).ok());
  EXPECT_EQ(*b_->DownloadIndices(rows), (std::vector<int32_t>{2, 0, 4, 3, 4}));
  EXPECT_EQ(*b_->DownloadIndices(experts), (std::vector<int32_t>{1, 3, 3, 1, 3}));
  EXPECT_EQ(Down(weights), (std::vector<float>{0.25f, 0.75f, 0.5f, 1.f, 2.f}));
  EXPECT_EQ(*b_->DownloadIndices(bad), (std::vector<int32_t>{0, INT32_MAX}));

  blocks[7] = 2;   // segment 1's second row is 2: outside its 2 rows
  blocks[11] = 2;  // segment 1's third expert is 2: not held
  blocks[1] = 9;   // segment 0's second row: outside
  ASSERT_TRUE(
      b_->UnpackRoutedPairs(Ids(blocks), segments, held, &rows, &experts, &weights, &bad).ok());
  EXPECT_EQ(*b_->DownloadIndices(bad), (std::vector<int32_t>{3, 1}));
  // Bad pairs are written harmless: their segment's first row, the lowest held expert (1),
  // weight 0; the good ones as before.
  EXPECT_EQ(*b_->DownloadIndices(rows), (std::vector<int32_t>{2, 0, 4, 3, 3}));
  EXPECT_EQ(*b_->DownloadIndices(experts), (std::vector<int32_t>{1, 1, 3, 1, 1}));
  EXPECT_EQ(Down(weights), (std::vector<float>{0.25f, 0.f, 0.5f, 0.f, 0.f}));
  blocks[1] = 0;
  blocks[11] = 7;  // outside the table
  ASSERT_TRUE(
      b_->UnpackRoutedPairs(Ids(blocks), segments, held, &rows, &experts, &weights, &bad).ok());
  EXPECT_EQ(*b_->DownloadIndices(bad), (std::vector<int32_t>{2, 3}));

  // No pairs: nothing is written, not even `bad`.
  Tensor untouched = Ids({5, 6});
  Tensor none = Alloc({0}, DType::kI32), none_f = Alloc({0});
  ASSERT_TRUE(b_->UnpackRoutedPairs(Alloc({0}, DType::kI32), {{0, 0, 0, 4}}, held, &none, &none,
                                    &none_f, &untouched)
                  .ok());
  EXPECT_EQ(*b_->DownloadIndices(untouched), (std::vector<int32_t>{5, 6}));
  // Segments that do not tile the pairs, and a short `bad`, are refused.
  EXPECT_EQ(b_->UnpackRoutedPairs(Ids(blocks), {{0, 2, 0, 3}, {3, 3, 3, 2}}, held, &rows, &experts,
                                  &weights, &bad)
                .code(),
            absl::StatusCode::kInvalidArgument);
  Tensor short_bad = Alloc({1}, DType::kI32);
  EXPECT_EQ(
      b_->UnpackRoutedPairs(Ids(blocks), segments, held, &rows, &experts, &weights, &short_bad)
          .code(),
      absl::StatusCode::kInvalidArgument);
}

TEST_F(CpuBackendTest, GroupedSwiGluEqualsPerExpertLinears) {
  const int64_t h = 3, inter = 2;
  Tensor g0 = Up({0.1f, 0.2f, 0.3f, -0.1f, 0.0f, 0.5f}, {inter, h});
  Tensor u0 = Up({0.3f, -0.2f, 0.1f, 0.2f, 0.4f, -0.5f}, {inter, h});
  // The packed weight: gate's rows, then up's.
  Tensor gu0 = Up({0.1f, 0.2f, 0.3f, -0.1f, 0.0f, 0.5f, 0.3f, -0.2f, 0.1f, 0.2f, 0.4f, -0.5f},
                  {2 * inter, h});
  Tensor d0 = Up({1, 2, -1, 0.5f, 0, 1}, {h, inter});
  Tensor xs = Up({1, 2, 3, -1, 0, 2}, {2, h});
  Tensor y = Alloc({2, h});
  // Expert 1 has both rows; experts 0 and 2 none (and expert 2 no weights).
  ASSERT_TRUE(b_->GroupedSwiGlu(xs, nullptr, Ids({0, 0, 2, 2}), {&gu0, &gu0, nullptr},
                                {&d0, &d0, nullptr}, &y)
                  .ok());
  Tensor gate = Alloc({2, inter}), up = Alloc({2, inter}), want = Alloc({2, h});
  ASSERT_TRUE(b_->Linear(xs, g0, nullptr, &gate).ok());
  ASSERT_TRUE(b_->Linear(xs, u0, nullptr, &up).ok());
  ASSERT_TRUE(b_->SiluMul(gate, up, &gate).ok());
  ASSERT_TRUE(b_->Linear(gate, d0, nullptr, &want).ok());
  EXPECT_EQ(Down(y), Down(want));
  // Gathering the rows inside (swapped, from bf16) equals gathering them first.
  Tensor xs16 = Alloc({2, h}, DType::kBF16);
  ASSERT_TRUE(b_->Copy(xs, &xs16).ok());
  Tensor y2 = Alloc({2, h}), want2 = Alloc({2, h}), swapped = Alloc({2, h});
  ASSERT_TRUE(b_->GatherRows(xs16, Ids({1, 0}), &swapped).ok());
  ASSERT_TRUE(b_->GroupedSwiGlu(swapped, nullptr, Ids({0, 0, 2, 2}), {&gu0, &gu0, nullptr},
                                {&d0, &d0, nullptr}, &want2)
                  .ok());
  const Tensor order = Ids({1, 0});
  ASSERT_TRUE(b_->GroupedSwiGlu(xs16, &order, Ids({0, 0, 2, 2}), {&gu0, &gu0, nullptr},
                                {&d0, &d0, nullptr}, &y2)
                  .ok());
  EXPECT_EQ(Down(y2), Down(want2));
  EXPECT_EQ(b_->GroupedSwiGlu(xs, nullptr, Ids({0, 0, 0, 2}), {&gu0, &gu0, nullptr},
                              {&d0, &d0, nullptr}, &y)
                .code(),
            absl::StatusCode::kFailedPrecondition);
}

// GroupedSwiGluCounted, the default (the count read from the offsets): the pairs' rows as
// GroupedSwiGlu gives them over the count, the entries past it untouched; a count past the
// capacity is INVALID_ARGUMENT.
TEST_F(CpuBackendTest, GroupedSwiGluCountedRunsTheCountedRows) {
  const int64_t h = 3, inter = 2;
  Tensor gu0 = Up({0.1f, 0.2f, 0.3f, -0.1f, 0.0f, 0.5f, 0.3f, -0.2f, 0.1f, 0.2f, 0.4f, -0.5f},
                  {2 * inter, h});
  Tensor d0 = Up({1, 2, -1, 0.5f, 0, 1}, {h, inter});
  const Tensor xs = Up({1, 2, 3, -1, 0, 2}, {2, h});
  const std::vector<const Tensor*> gu = {&gu0, &gu0, nullptr}, dn = {&d0, &d0, nullptr};
  // Capacity 3: two pairs (expert 1, rows 1 and 0), then an entry of no pair.
  Tensor y = Alloc({3, h});
  ASSERT_TRUE(b_->Fill(&y, 7.f).ok());
  ASSERT_TRUE(b_->GroupedSwiGluCounted(xs, Ids({1, 0, 5}), Ids({0, 0, 2, 2}), gu, dn, &y).ok());
  Tensor want = Alloc({2, h});
  const Tensor rows = Ids({1, 0});
  ASSERT_TRUE(b_->GroupedSwiGlu(xs, &rows, Ids({0, 0, 2, 2}), gu, dn, &want).ok());
  std::vector<float> expect = Down(want);
  expect.insert(expect.end(), h, 7.f);
  EXPECT_EQ(Down(y), expect);
  EXPECT_EQ(b_->GroupedSwiGluCounted(xs, Ids({1, 0, 0}), Ids({0, 0, 2, 4}), gu, dn, &y).code(),
            absl::StatusCode::kInvalidArgument);
}

TEST_F(CpuBackendTest, AllocatorReusesFreedBlocksAndConvertsOnCopy) {
  auto* cpu = static_cast<CpuBackend*>(b_.get());
  { Tensor a = Alloc({1000}); }
  const int64_t before = cpu->allocator_stats().system_allocations;
  for (int i = 0; i < 10; ++i) Tensor a = Alloc({999});  // same size class
  EXPECT_EQ(cpu->allocator_stats().system_allocations, before);
  EXPECT_GE(cpu->allocator_stats().cache_hits, 10);
  // bf16 in, float32 out, and back; integer tensors never convert to float.
  const std::vector<float> values = {1.5f, -2.25f, 3.f};
  Tensor t16 = Alloc({3}, DType::kBF16);
  ASSERT_TRUE(b_->CopyFromHost(values.data(), DType::kF32, &t16).ok());
  EXPECT_EQ(Down(t16), values);
  Tensor ids = Alloc({3}, DType::kI32);
  EXPECT_EQ(b_->Copy(t16, &ids).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(b_->Allocate({-1}, DType::kF32).status().code(), absl::StatusCode::kInvalidArgument);
}

// FP8 dispatch records: per 128-channel group, scale = amax / 448 (the group's largest value
// lands on e4m3's largest), and each value comes back within e4m3's rounding: half a step of
// its 3 mantissa bits (1/16 relative), or of the smallest subnormal step (scale / 512 / 2)
// below the normal range. A partial last group (96 = 0 full groups + 96) and rows picked by
// index, from f32 and bf16.
TEST_F(CpuBackendTest, Fp8RecordsRoundTripWithinE4m3Rounding) {
  for (int64_t hidden : {96, 256, 200}) {
    for (DType dtype : {DType::kF32, DType::kBF16}) {
      std::mt19937 rng(static_cast<uint32_t>(hidden));
      std::normal_distribution<float> normal(0.f, 1.f);
      const int64_t rows = 3;
      std::vector<float> host(rows * hidden);
      for (float& v : host) v = normal(rng) * 3.f;
      for (int64_t j = 0; j < hidden; ++j) host[hidden + j] = 0.f;  // row 1: all zeros
      Tensor src = Alloc({rows, hidden}, dtype);
      ASSERT_TRUE(b_->CopyFromHost(host.data(), DType::kF32, &src).ok());
      std::vector<float> exact(host.size());  // what src holds (bf16-rounded)
      ASSERT_TRUE(b_->CopyToHost(src, DType::kF32, exact.data()).ok());
      const std::vector<int32_t> pick = {2, 0, 1};
      Tensor records = Alloc({3, Fp8RecordBytes(hidden)}, DType::kF8E4M3);
      ASSERT_TRUE(b_->QuantizeRowsFp8(src, Ids(pick), &records).ok());
      Tensor back = Alloc({3, hidden});
      ASSERT_TRUE(b_->DequantizeRowsFp8(records, &back).ok());
      const std::vector<float> got = Down(back);
      std::vector<uint8_t> bytes(records.num_bytes());
      std::memcpy(bytes.data(), records.raw(), bytes.size());
      const int64_t groups = (hidden + 127) / 128;
      for (int64_t i = 0; i < 3; ++i) {
        const float* want = exact.data() + pick[i] * hidden;
        for (int64_t g = 0; g < groups; ++g) {
          const int64_t begin = g * 128, end = std::min<int64_t>(hidden, begin + 128);
          float amax = 0.f;
          for (int64_t j = begin; j < end; ++j) amax = std::max(amax, std::fabs(want[j]));
          float scale;
          std::memcpy(&scale, bytes.data() + i * Fp8RecordBytes(hidden) + 4 * g, 4);
          EXPECT_FLOAT_EQ(scale, std::max(amax, 1e-4f) / 448.f) << "row " << i << " group " << g;
          for (int64_t j = begin; j < end; ++j) {
            const float bound = std::max(std::fabs(want[j]) / 16.f, scale / 1024.f) * 1.0001f;
            EXPECT_LE(std::fabs(got[i * hidden + j] - want[j]), bound)
                << "hidden " << hidden << " " << std::string(DTypeName(dtype)) << " row " << i
                << " col " << j;
          }
        }
      }
      for (int64_t j = 0; j < hidden; ++j) EXPECT_EQ(got[2 * hidden + j], 0.f);  // the zero row
    }
  }
}

TEST_F(CpuBackendTest, Fp8RecordsRefuseBadShapes) {
  Tensor src = Up(std::vector<float>(2 * 6, 1.f), {2, 6});  // 6: not a multiple of 4
  Tensor records = Alloc({2, Fp8RecordBytes(6)}, DType::kF8E4M3);
  EXPECT_EQ(b_->QuantizeRowsFp8(src, Ids({0, 1}), &records).code(),
            absl::StatusCode::kInvalidArgument);
  Tensor src8 = Up(std::vector<float>(2 * 8, 1.f), {2, 8});
  Tensor narrow = Alloc({2, 8}, DType::kF8E4M3);  // no room for the scale
  EXPECT_EQ(b_->QuantizeRowsFp8(src8, Ids({0, 1}), &narrow).code(),
            absl::StatusCode::kInvalidArgument);
  Tensor good = Alloc({2, Fp8RecordBytes(8)}, DType::kF8E4M3);
  EXPECT_EQ(b_->QuantizeRowsFp8(src8, Ids({0, 2}), &good).code(),
            absl::StatusCode::kInvalidArgument);                // row 2 of 2
  EXPECT_TRUE(b_->QuantizeRowsFp8(src8, Ids({}), &good).ok());  // no rows
  Tensor wide = Alloc({2, 12});
  EXPECT_EQ(b_->DequantizeRowsFp8(good, &wide).code(), absl::StatusCode::kInvalidArgument);
  Tensor ints = Alloc({2, 8}, DType::kI32);
  EXPECT_EQ(b_->DequantizeRowsFp8(good, &ints).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(b_->capabilities().fp8_dispatch_rows);
}

}  // namespace
}  // namespace dxs
