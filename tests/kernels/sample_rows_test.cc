// Backend::SampleRows on the CPU backend: the host sampler's tokens row by row (it is the
// same code, kernels/sampling.h), greedy rows as ArgmaxRows, the greedy limits of top-k and
// top-p, argument errors and zero rows.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/backend.h"
#include "kernels/sampling.h"
#include "model/sampler.h"

namespace dxs {
namespace {

class SampleRowsTest : public ::testing::Test {
 protected:
  // Normal logits of stddev `scale` (peaked enough that top-p cuts early), a few ties.
  std::vector<float> Logits(int64_t rows, int64_t vocab, uint32_t seed, float scale = 3.f) {
    std::mt19937 rng(seed);
    std::normal_distribution<float> dist(0.f, scale);
    std::vector<float> v(rows * vocab);
    for (float& x : v) x = dist(rng);
    for (int64_t r = 0; r < rows && vocab > 4; ++r) v[r * vocab + 3] = v[r * vocab + 1];
    return v;
  }
  Tensor Params(const std::vector<SamplingRow>& rows) {
    Tensor t = *b_->Allocate({static_cast<int64_t>(rows.size()), kSamplingRowWords}, DType::kI64);
    EXPECT_TRUE(b_->CopyFromHost(rows.data(), DType::kI64, &t).ok());
    return t;
  }
  absl::StatusOr<std::vector<int32_t>> Sample(const Tensor& logits,
                                              const std::vector<SamplingRow>& rows) {
    Tensor ids = *b_->Allocate({logits.rows()}, DType::kI32);
    if (absl::Status s = b_->SampleRows(logits, Params(rows), nullptr, &ids); !s.ok()) return s;
    return b_->DownloadIndices(ids);
  }
  std::unique_ptr<Backend> b_ = MakeCpuBackend();
};

// Mixed rows in one call: greedy, temperature only, top-k only, top-p only, both.
const std::vector<SamplingParams> kMixed = {
    {0.f, 1.f, 0, 0},      {1.f, 1.f, 0, 11},   {0.7f, 1.f, 40, 12},      {1.2f, 0.8f, 0, 13},
    {0.9f, 0.95f, 50, 14}, {1.f, 0.3f, 5, 15},  {2.5f, 1.f, 0, 1u << 31}, {0.f, 0.5f, 3, 16},
    {1.f, 1.f, 1, 17},     {1.f, 1e-7f, 0, 18}, {0.05f, 0.9f, 0, 19},     {1.f, 1.f, 100000, 20}};

TEST_F(SampleRowsTest, SeededRowsAreTheHostSamplersTokens) {
  for (const int64_t vocab : {int64_t{2}, int64_t{10}, int64_t{4096}}) {
    const int64_t rows = static_cast<int64_t>(kMixed.size());
    std::vector<Sampler> samplers(kMixed.begin(), kMixed.end());
    for (uint64_t draw = 0; draw < 48; ++draw) {
      const std::vector<float> host = Logits(rows, vocab, static_cast<uint32_t>(draw + vocab));
      std::vector<SamplingRow> params;
      for (const SamplingParams& p : kMixed) params.push_back(ToSamplingRow(p, draw));
      absl::StatusOr<std::vector<int32_t>> got = Sample(*b_->Upload(host, {rows, vocab}), params);
      ASSERT_TRUE(got.ok()) << got.status();
      for (int64_t r = 0; r < rows; ++r) {
        EXPECT_EQ((*got)[r], samplers[r].Sample(host.data() + r * vocab, vocab, draw))
            << "vocab " << vocab << " row " << r << " draw " << draw;
      }
    }
  }
}

TEST_F(SampleRowsTest, TheDrawNumberPicksTheStreamsOutput) {
  const std::vector<float> host = Logits(1, 512, 3, 0.5f);  // flat: draws spread
  Tensor logits = *b_->Upload(host, {1, 512});
  const SamplingParams p{1.f, 1.f, 0, 77};
  std::vector<int32_t> tokens;
  for (uint64_t draw = 0; draw < 16; ++draw) {
    tokens.push_back(Sample(logits, {ToSamplingRow(p, draw)})->at(0));
    // The same draw again is the same token: nothing is carried between calls.
    EXPECT_EQ(Sample(logits, {ToSamplingRow(p, draw)})->at(0), tokens.back());
  }
  EXPECT_GT(std::set<int32_t>(tokens.begin(), tokens.end()).size(), 8u);
}

TEST_F(SampleRowsTest, GreedyRowsAreArgmaxRows) {
  const int64_t rows = 7, vocab = 1000;
  std::vector<float> host = Logits(rows, vocab, 5);
  host[2 * vocab + 10] = host[2 * vocab + 20] = 100.f;  // a tie: the lower id
  host[4 * vocab] = std::nanf("");                      // NaN at 0 is chosen
  Tensor logits = *b_->Upload(host, {rows, vocab});
  Tensor want = *b_->Allocate({rows}, DType::kI32);
  ASSERT_TRUE(b_->ArgmaxRows(logits, &want).ok());
  std::vector<SamplingRow> greedy(rows, ToSamplingRow({0.f, 0.7f, 3, 9}, 4));
  EXPECT_EQ(*Sample(logits, greedy), *b_->DownloadIndices(want));
  EXPECT_EQ(Sample(logits, greedy)->at(2), 10);
}

TEST_F(SampleRowsTest, TopKOneAndTinyTopPAreGreedy) {
  const int64_t rows = 5, vocab = 3000;
  for (uint64_t draw = 0; draw < 20; ++draw) {
    const std::vector<float> host = Logits(rows, vocab, static_cast<uint32_t>(100 + draw));
    Tensor logits = *b_->Upload(host, {rows, vocab});
    Tensor want = *b_->Allocate({rows}, DType::kI32);
    ASSERT_TRUE(b_->ArgmaxRows(logits, &want).ok());
    std::vector<SamplingRow> top_k(rows, ToSamplingRow({1.7f, 1.f, 1, draw * 31}, draw));
    std::vector<SamplingRow> top_p(rows, ToSamplingRow({1.7f, 1e-6f, 0, draw * 31}, draw));
    EXPECT_EQ(*Sample(logits, top_k), *b_->DownloadIndices(want));
    EXPECT_EQ(*Sample(logits, top_p), *b_->DownloadIndices(want));
  }
}

TEST_F(SampleRowsTest, BadParametersAreInvalidArgument) {
  Tensor logits = *b_->Upload(Logits(2, 8, 1), {2, 8});
  const SamplingRow ok = ToSamplingRow({1.f, 0.9f, 4, 1}, 0);
  const float nan = std::nanf(""), inf = INFINITY;
  std::vector<SamplingRow> bad;
  for (float t : {-1.f, nan, inf}) bad.push_back(ToSamplingRow({t, 1.f, 0, 1}, 0));
  for (float p : {0.f, -0.5f, 1.5f, nan}) bad.push_back(ToSamplingRow({1.f, p, 0, 1}, 0));
  bad.push_back(ToSamplingRow({1.f, 1.f, -1, 1}, 0));
  bad.push_back(ok);
  bad.back().reserved[0] = 1;
  for (const SamplingRow& row : bad) {
    absl::StatusOr<std::vector<int32_t>> got = Sample(logits, {ok, row});
    ASSERT_FALSE(got.ok());
    EXPECT_EQ(got.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(got.status().message().find("row 1"), std::string::npos) << got.status();
  }
  // Shapes and dtypes.
  Tensor ids = *b_->Allocate({2}, DType::kI32);
  Tensor params = Params({ok, ok});
  Tensor short_ids = *b_->Allocate({1}, DType::kI32);
  EXPECT_EQ(b_->SampleRows(logits, params, nullptr, &short_ids).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(b_->SampleRows(logits, Params({ok}), nullptr, &ids).code(),
            absl::StatusCode::kInvalidArgument);
  Tensor narrow = *b_->Allocate({2, 3}, DType::kI64);
  EXPECT_EQ(b_->SampleRows(logits, narrow, nullptr, &ids).code(),
            absl::StatusCode::kInvalidArgument);
  Tensor f32_params = *b_->Allocate({2, kSamplingRowWords}, DType::kF32);
  EXPECT_EQ(b_->SampleRows(logits, f32_params, nullptr, &ids).code(),
            absl::StatusCode::kInvalidArgument);
  Tensor i64_ids = *b_->Allocate({2}, DType::kI64);
  EXPECT_EQ(b_->SampleRows(logits, params, nullptr, &i64_ids).code(),
            absl::StatusCode::kInvalidArgument);
  Tensor index_logits = *b_->Allocate({2, 8}, DType::kI32);
  EXPECT_EQ(b_->SampleRows(index_logits, params, nullptr, &ids).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(b_->SampleRows(logits, Tensor(), nullptr, &ids).code(),
            absl::StatusCode::kInvalidArgument);
}

TEST_F(SampleRowsTest, ZeroRowsDoNothing) {
  Tensor logits = *b_->Allocate({0, 16}, DType::kF32);
  Tensor params = *b_->Allocate({0, kSamplingRowWords}, DType::kI64);
  Tensor ids = *b_->Allocate({0}, DType::kI32);
  EXPECT_TRUE(b_->SampleRows(logits, params, nullptr, &ids).ok());
}

// Rows with adjustments (penalties, bias, a banned token) and min_p: each row is the host's
// ApplyLogitAdjustments then SampleToken, and the logits are not changed.
TEST_F(SampleRowsTest, AdjustedRowsAreTheHostsAdjustedTokens) {
  const int64_t vocab = 50, rows = 6;
  const std::vector<float> host = Logits(rows, vocab, 3);
  std::vector<SamplingRow> params;
  std::vector<LogitAdjustment> adjust;
  for (int64_t r = 0; r < rows; ++r) {
    SamplingParams p{r % 2 == 0 ? 0.f : 0.9f, 0.95f, 0, 40 + static_cast<uint64_t>(r)};
    p.min_p = 0.1f;
    p.repetition_penalty = 1.5f;
    p.frequency_penalty = 0.5f;
    p.presence_penalty = -0.5f;
    const int32_t begin = static_cast<int32_t>(adjust.size());
    const int32_t top = Argmax(host.data() + r * vocab, vocab);
    adjust.push_back({top, 1, 0.f, kAdjustSeen | (r % 3 == 0 ? kAdjustBanned : 0u)});
    adjust.push_back({(top + 7) % 50, 0, 4.f, 0});
    adjust.push_back({(top + 9) % 50, 2, -1.f, kAdjustSeen});
    params.push_back(ToSamplingRow(p, static_cast<uint64_t>(r), begin, 3));
  }
  Tensor logits = *b_->Upload(host, {rows, vocab});
  Tensor a =
      *b_->Allocate({static_cast<int64_t>(adjust.size()), kLogitAdjustmentWords}, DType::kI32);
  ASSERT_TRUE(b_->CopyFromHost(adjust.data(), DType::kI32, &a).ok());
  Tensor ids = *b_->Allocate({rows}, DType::kI32);
  ASSERT_TRUE(b_->SampleRows(logits, Params(params), &a, &ids).ok());
  const std::vector<int32_t> got = *b_->DownloadIndices(ids);
  SamplingScratch scratch;
  for (int64_t r = 0; r < rows; ++r) {
    std::vector<float> row(host.begin() + r * vocab, host.begin() + (r + 1) * vocab);
    const SamplingParams p = FromSamplingRow(params[r]);
    ApplyLogitAdjustments(p, adjust.data() + params[r].adjust_begin, 3, row.data());
    EXPECT_EQ(got[r], SampleToken(row.data(), vocab, p, params[r].draw, &scratch)) << r;
    if (r % 3 == 0) EXPECT_NE(got[r], adjust[params[r].adjust_begin].token) << "banned";
  }
  EXPECT_EQ(*b_->Download(logits), host);
  // An adjustment outside the vocabulary or the list is INVALID_ARGUMENT.
  std::vector<LogitAdjustment> outside = adjust;
  outside[1].token = static_cast<int32_t>(vocab);
  ASSERT_TRUE(b_->CopyFromHost(outside.data(), DType::kI32, &a).ok());
  EXPECT_EQ(b_->SampleRows(logits, Params(params), &a, &ids).code(),
            absl::StatusCode::kInvalidArgument);
  params.back().adjust_count = 100;
  EXPECT_EQ(b_->SampleRows(logits, Params(params), nullptr, &ids).code(),
            absl::StatusCode::kInvalidArgument);
}

TEST_F(SampleRowsTest, LogprobRowsAreRowLogprobs) {
  const int64_t vocab = 40, rows = 3, m = 2, k = 4;
  const std::vector<float> host = Logits(rows, vocab, 8);
  const std::vector<int32_t> sampled = {0, 39, 7}, named = {1, 2, -1, 5, 38, 0};
  Tensor logits = *b_->Upload(host, {rows, vocab});
  Tensor s = *b_->Allocate({rows}, DType::kI32), n = *b_->Allocate({rows, m}, DType::kI32);
  ASSERT_TRUE(b_->CopyFromHost(sampled.data(), DType::kI32, &s).ok());
  ASSERT_TRUE(b_->CopyFromHost(named.data(), DType::kI32, &n).ok());
  Tensor sl = *b_->Allocate({rows}, DType::kF32), nl = *b_->Allocate({rows, m}, DType::kF32);
  Tensor ti = *b_->Allocate({rows, k}, DType::kI32), tl = *b_->Allocate({rows, k}, DType::kF32);
  ASSERT_TRUE(b_->LogprobRows(logits, s, n, &sl, &nl, &ti, &tl).ok());
  const std::vector<float> got_s = *b_->Download(sl), got_n = *b_->Download(nl),
                           got_t = *b_->Download(tl);
  const std::vector<int32_t> got_ti = *b_->DownloadIndices(ti);
  for (int64_t r = 0; r < rows; ++r) {
    TokenLogprobs want;
    RowLogprobs(host.data() + r * vocab, vocab, sampled[r], k,
                {std::max(named[r * m], 0), std::max(named[r * m + 1], 0)}, &want);
    EXPECT_EQ(got_s[r], want.logprob);
    for (int64_t j = 0; j < m; ++j) {
      EXPECT_EQ(got_n[r * m + j], named[r * m + j] < 0 ? 0.f : want.named[j]);
    }
    for (int64_t j = 0; j < k; ++j) {
      EXPECT_EQ(got_ti[r * k + j], want.top[j].first);
      EXPECT_EQ(got_t[r * k + j], want.top[j].second);
    }
  }
  Tensor wide = *b_->Allocate({rows, 21}, DType::kI32),
         wide_f = *b_->Allocate({rows, 21}, DType::kF32);
  EXPECT_EQ(b_->LogprobRows(logits, s, n, &sl, &nl, &wide, &wide_f).code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace dxs
