// CUDA SampleRows against the CPU backend (the host sampler's code) on fresh random logits:
// Qwen3's vocabulary and small ones, 0 to 64 rows (more than one sort chunk at 151936),
// mixed parameters per row (greedy, temperature only, top-k only, top-p only, both), ties,
// and rows with bad parameters. Outputs are poisoned before each call. Tokens must be
// identical, except where recomputing on the host shows that the draw (or the top-p cut)
// lies within 1e-9 relative of a cumulative-mass boundary: the device sums in another
// order. Skips without a GPU.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <random>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/backend.h"
#include "kernels/make_backend.h"
#include "kernels/sampling.h"

namespace dxs {
namespace {

constexpr double kBoundaryTolerance = 1e-9;

// Whether the host's sampling of `row` with `p` and draw `draw` has its draw or its top-p
// cut within kBoundaryTolerance (relative) of a cumulative-mass boundary.
bool NearBoundary(const float* row, int64_t vocab, const SamplingParams& p, uint64_t draw) {
  if (p.temperature == 0.f) return false;
  std::vector<std::pair<float, int32_t>> cand(vocab);
  for (int64_t i = 0; i < vocab; ++i) cand[i] = {row[i] / p.temperature, static_cast<int32_t>(i)};
  std::sort(cand.begin(), cand.end(), [](const auto& a, const auto& b) {
    return a.first > b.first || (a.first == b.first && a.second < b.second);
  });
  const int64_t keep = p.top_k > 0 && p.top_k < vocab ? p.top_k : vocab;
  std::vector<double> prefix(keep);
  double acc = 0;
  for (int64_t i = 0; i < keep; ++i) {
    acc += std::exp(static_cast<double>(cand[i].first - cand[0].first));
    prefix[i] = acc;
  }
  const double total = prefix[keep - 1];
  int64_t cut = keep;
  if (p.top_p < 1.f) {
    for (int64_t i = 0; i < keep; ++i) {
      if (std::fabs(prefix[i] / total - p.top_p) <= kBoundaryTolerance * p.top_p) return true;
    }
    for (int64_t i = 0; i < keep; ++i) {
      if (prefix[i] / total >= p.top_p) {
        cut = i + 1;
        break;
      }
    }
  }
  if (p.min_p > 0.f) {
    for (int64_t i = 0; i < cut; ++i) {
      const double w = std::exp(static_cast<double>(cand[i].first - cand[0].first));
      if (std::fabs(w - p.min_p) <= kBoundaryTolerance * p.min_p) return true;
      if (i > 0 && w < p.min_p) {
        cut = i;
        break;
      }
    }
  }
  const double kept = prefix[cut - 1];
  const double target = SamplingUniform(p.seed, draw) * kept;
  for (int64_t i = 0; i < cut; ++i) {
    if (std::fabs(prefix[i] - target) <= kBoundaryTolerance * kept) return true;
  }
  return false;
}

class SamplingCudaTest : public ::testing::Test {
 protected:
  void SetUp() override {
    absl::StatusOr<std::unique_ptr<Backend>> gpu = MakeBackend("cuda");
    if (!gpu.ok()) GTEST_SKIP() << "no GPU here: " << gpu.status().message();
    gpu_ = std::move(*gpu);
    cpu_ = MakeCpuBackend();
  }

  static std::vector<float> RandomLogits(int64_t n, uint32_t seed, float scale) {
    std::mt19937 rng(seed);
    std::normal_distribution<float> dist(0.f, scale);
    std::vector<float> v(n);
    for (float& x : v) x = dist(rng);
    return v;
  }

  // The ids of the row's n largest logits.
  static std::vector<int32_t> TopIds(const float* row, int64_t vocab, int64_t n) {
    std::vector<int32_t> ids(vocab);
    for (int64_t i = 0; i < vocab; ++i) ids[i] = static_cast<int32_t>(i);
    n = std::min(n, vocab);
    std::partial_sort(ids.begin(), ids.begin() + n, ids.end(),
                      [row](int32_t a, int32_t b) { return row[a] > row[b]; });
    ids.resize(n);
    return ids;
  }

  // SampleRows on `b` into an output poisoned with -7.
  std::vector<int32_t> Sample(Backend* b, const std::vector<float>& logits, int64_t rows,
                              int64_t vocab, const std::vector<SamplingRow>& params,
                              const std::vector<LogitAdjustment>& adjust = {}) {
    absl::StatusOr<Tensor> l = b->Allocate({rows, vocab}, DType::kF32);
    absl::StatusOr<Tensor> p = b->Allocate({rows, kSamplingRowWords}, DType::kI64);
    absl::StatusOr<Tensor> ids = b->Allocate({rows}, DType::kI32);
    EXPECT_TRUE(l.ok() && p.ok() && ids.ok());
    EXPECT_TRUE(b->CopyFromHost(logits.data(), DType::kF32, &*l).ok());
    EXPECT_TRUE(b->CopyFromHost(params.data(), DType::kI64, &*p).ok());
    EXPECT_TRUE(b->Fill(&*ids, -7.f).ok());
    std::optional<Tensor> a;
    if (!adjust.empty()) {
      a = *b->Allocate({static_cast<int64_t>(adjust.size()), kLogitAdjustmentWords}, DType::kI32);
      EXPECT_TRUE(b->CopyFromHost(adjust.data(), DType::kI32, &*a).ok());
    }
    const absl::Status s = b->SampleRows(*l, *p, a ? &*a : nullptr, &*ids);
    EXPECT_TRUE(s.ok()) << b->name() << ": " << s;
    absl::StatusOr<std::vector<int32_t>> out = b->DownloadIndices(*ids);
    EXPECT_TRUE(out.ok()) << out.status();
    return out.ok() ? *out : std::vector<int32_t>{};
  }

  // The GPU's tokens against the CPU's, row by row; a mismatch must sit on a boundary (of
  // the row as its adjustments leave it).
  void ExpectCpuTokens(const std::vector<float>& logits, int64_t rows, int64_t vocab,
                       const std::vector<SamplingRow>& params,
                       const std::vector<LogitAdjustment>& adjust = {}) {
    const std::vector<int32_t> got = Sample(gpu_.get(), logits, rows, vocab, params, adjust);
    const std::vector<int32_t> want = Sample(cpu_.get(), logits, rows, vocab, params, adjust);
    ASSERT_EQ(got.size(), static_cast<size_t>(rows));
    ASSERT_EQ(want.size(), static_cast<size_t>(rows));
    for (int64_t r = 0; r < rows; ++r) {
      ++rows_checked_;
      if (got[r] == want[r]) continue;
      const SamplingParams p = FromSamplingRow(params[r]);
      std::vector<float> row(logits.begin() + r * vocab, logits.begin() + (r + 1) * vocab);
      ApplyLogitAdjustments(p, adjust.data() + params[r].adjust_begin, params[r].adjust_count,
                            row.data());
      EXPECT_TRUE(NearBoundary(row.data(), vocab, p, params[r].draw))
          << "row " << r << " of " << rows << " (vocab " << vocab << ", T " << p.temperature
          << ", top_p " << p.top_p << ", top_k " << p.top_k << ", seed " << p.seed << ", draw "
          << params[r].draw << "): gpu " << got[r] << ", cpu " << want[r];
      ++boundary_mismatches_;
    }
  }

  void TearDown() override {
    if (rows_checked_ > 0) {
      // Boundary cases have probability ~1e-9 a row: more than one is suspicious.
      EXPECT_LE(boundary_mismatches_, 1) << "of " << rows_checked_ << " rows";
    }
  }

  std::unique_ptr<Backend> gpu_, cpu_;
  int64_t rows_checked_ = 0;
  int64_t boundary_mismatches_ = 0;
};

// Mixed parameters, cycled over the rows: greedy, temperature only, top-k only, top-p
// only, both, and their greedy limits.
const std::vector<SamplingParams> kMixed = {
    {0.f, 1.f, 0, 0},     {1.f, 1.f, 0, 1},      {0.7f, 1.f, 50, 2},  {1.f, 0.9f, 0, 3},
    {0.8f, 0.95f, 40, 4}, {1.f, 1.f, 1, 5},      {1.3f, 1e-7f, 0, 6}, {5.f, 0.99f, 0, 7},
    {0.2f, 0.5f, 0, 8},   {1.f, 1.f, 100000, 9}, {0.f, 0.3f, 7, 10},  {2.f, 0.7f, 1000, 11}};

std::vector<SamplingRow> MixedRows(int64_t rows, uint64_t salt) {
  std::vector<SamplingRow> out;
  for (int64_t r = 0; r < rows; ++r) {
    SamplingParams p = kMixed[r % kMixed.size()];
    p.seed = p.seed * 0x9e3779b97f4a7c15ull + salt;
    out.push_back(ToSamplingRow(p, static_cast<uint64_t>(r) * 3 + salt));
  }
  return out;
}

TEST_F(SamplingCudaTest, QwenVocabularyMatchesTheCpu) {
  const int64_t vocab = 151936;
  for (int64_t rows : {0, 1, 7, 64}) {
    SCOPED_TRACE(rows);
    for (uint64_t salt : {0u, 1u}) {
      const std::vector<float> logits =
          RandomLogits(rows * vocab, static_cast<uint32_t>(rows * 10 + salt), 2.f);
      ExpectCpuTokens(logits, rows, vocab, MixedRows(rows, salt));
    }
  }
}

TEST_F(SamplingCudaTest, SmallVocabulariesMatchTheCpu) {
  for (int64_t vocab : {1, 2, 3, 10, 257, 4096, 5000}) {
    for (int64_t rows : {1, 7, 64}) {
      SCOPED_TRACE(::testing::Message() << "vocab " << vocab << " rows " << rows);
      for (uint64_t salt = 0; salt < 8; ++salt) {
        const std::vector<float> logits =
            RandomLogits(rows * vocab, static_cast<uint32_t>(vocab * 131 + rows + salt), 1.5f);
        ExpectCpuTokens(logits, rows, vocab, MixedRows(rows, salt));
      }
    }
  }
}

// Every row on one kind of parameters, many draws of a few rows.
TEST_F(SamplingCudaTest, EachKindOfRowMatchesTheCpu) {
  const int64_t vocab = 32000, rows = 7;
  for (const SamplingParams& base : kMixed) {
    for (uint64_t draw = 0; draw < 6; ++draw) {
      const std::vector<float> logits =
          RandomLogits(rows * vocab, static_cast<uint32_t>(base.seed * 100 + draw), 2.5f);
      std::vector<SamplingRow> params;
      for (int64_t r = 0; r < rows; ++r) {
        SamplingParams p = base;
        p.seed = 1000 * base.seed + r;
        params.push_back(ToSamplingRow(p, draw));
      }
      ExpectCpuTokens(logits, rows, vocab, params);
    }
  }
}

// Many equal logits (and -0 beside +0): the order among ties is by id, as on the host.
TEST_F(SamplingCudaTest, TiesOrderByIdAsOnTheHost) {
  const int64_t vocab = 4096, rows = 64;
  std::vector<float> logits = RandomLogits(rows * vocab, 99, 1.f);
  for (float& x : logits) x = std::round(x * 2.f) / 2.f;  // a few distinct values
  for (int64_t r = 0; r < rows; ++r) {
    logits[r * vocab + 5] = -0.f;
    logits[r * vocab + 6] = 0.f;
  }
  for (uint64_t salt = 0; salt < 4; ++salt)
    ExpectCpuTokens(logits, rows, vocab, MixedRows(rows, salt));
}

// A device cannot report data-dependent errors: rows with bad parameters get -1, the
// others their tokens. Zero rows write nothing.
TEST_F(SamplingCudaTest, BadRowsGetMinusOneAndZeroRowsNothing) {
  const int64_t vocab = 1000;
  const float nan = std::nanf("");
  std::vector<SamplingRow> params = {
      ToSamplingRow({1.f, 0.9f, 10, 1}, 0), ToSamplingRow({-1.f, 1.f, 0, 1}, 0),
      ToSamplingRow({1.f, 0.f, 0, 1}, 0),   ToSamplingRow({1.f, nan, 0, 1}, 0),
      ToSamplingRow({1.f, 1.f, -3, 1}, 0),  ToSamplingRow({0.f, 1.f, 0, 1}, 0)};
  const int64_t rows = static_cast<int64_t>(params.size());
  const std::vector<float> logits = RandomLogits(rows * vocab, 5, 1.f);
  const std::vector<int32_t> got = Sample(gpu_.get(), logits, rows, vocab, params);
  ASSERT_EQ(got.size(), params.size());
  const std::vector<int32_t> first =
      Sample(cpu_.get(), logits, 1, vocab, {params[0]});  // CPU rejects the bad rows
  EXPECT_EQ(got[0], first.at(0));
  for (int64_t r = 1; r < 5; ++r) EXPECT_EQ(got[r], -1) << "row " << r;
  EXPECT_EQ(
      got[5],
      Sample(cpu_.get(), {logits.begin() + 5 * vocab, logits.end()}, 1, vocab, {params[5]}).at(0));

  Tensor l = *gpu_->Allocate({0, vocab}, DType::kF32);
  Tensor p = *gpu_->Allocate({0, kSamplingRowWords}, DType::kI64);
  Tensor ids = *gpu_->Allocate({0}, DType::kI32);
  EXPECT_TRUE(gpu_->SampleRows(l, p, nullptr, &ids).ok());
  Tensor wrong = *gpu_->Allocate({1, 3}, DType::kI64);
  Tensor one = *gpu_->Allocate({1}, DType::kI32);
  Tensor row = *gpu_->Allocate({1, vocab}, DType::kF32);
  EXPECT_EQ(gpu_->SampleRows(row, wrong, nullptr, &one).code(), absl::StatusCode::kInvalidArgument);
}

// Rows with penalties, logit_bias, banned tokens and min_p (greedy and sampled): the keys
// the device adjusts from the raw logits equal the host's ApplyLogitAdjustments.
TEST_F(SamplingCudaTest, AdjustedRowsAndMinPMatchTheCpu) {
  for (const int64_t vocab : {int64_t{1000}, int64_t{151936}}) {
    const int64_t rows = 24;
    for (uint64_t salt = 0; salt < 4; ++salt) {
      SCOPED_TRACE(::testing::Message() << "vocab " << vocab << " salt " << salt);
      std::mt19937 rng(static_cast<uint32_t>(vocab + salt));
      const std::vector<float> logits =
          RandomLogits(rows * vocab, static_cast<uint32_t>(salt), 2.f);
      std::vector<SamplingRow> params;
      std::vector<LogitAdjustment> adjust;
      for (int64_t r = 0; r < rows; ++r) {
        SamplingParams p = kMixed[r % kMixed.size()];
        p.seed = p.seed * 7919 + salt;
        p.min_p = (r % 3 == 0) ? 0.f : (r % 3 == 1 ? 0.05f : 0.3f);
        p.repetition_penalty = 1.f + 0.1f * static_cast<float>(r % 4);
        p.frequency_penalty = 0.25f * static_cast<float>(r % 5) - 0.5f;
        p.presence_penalty = r % 2 == 0 ? 0.4f : -0.3f;
        // Distinct tokens: the row's top few (to move the argmax) and random others.
        std::set<int32_t> tokens;
        for (int32_t t : TopIds(logits.data() + r * vocab, vocab, 3)) tokens.insert(t);
        while (static_cast<int64_t>(tokens.size()) < std::min<int64_t>(vocab, 3 + r * 5)) {
          tokens.insert(static_cast<int32_t>(rng() % vocab));
        }
        const int32_t begin = static_cast<int32_t>(adjust.size());
        int i = 0;
        for (int32_t t : tokens) {
          LogitAdjustment a{t, static_cast<int32_t>(rng() % 3), 0.f, kAdjustSeen};
          if (i % 4 == 1) a.bias = static_cast<float>(static_cast<int>(rng() % 21) - 10);
          if (i % 7 == 3) a.flags |= kAdjustBanned;
          adjust.push_back(a);
          ++i;
        }
        params.push_back(ToSamplingRow(p, static_cast<uint64_t>(r) + salt, begin,
                                       static_cast<int32_t>(adjust.size()) - begin));
      }
      ExpectCpuTokens(logits, rows, vocab, params, adjust);
    }
  }
}

// CountPendingTokens on the GPU: the CPU's entries byte for byte, rows with a pending entry
// whose token is among the others (counted there), is not (the pending entry becomes it),
// rows without one and rows without adjustments.
TEST_F(SamplingCudaTest, CountPendingTokensMatchesTheCpu) {
  std::mt19937 rng(5);
  const int64_t rows = 64;
  std::vector<SamplingRow> params;
  std::vector<LogitAdjustment> adjust;
  std::vector<int32_t> tokens;
  for (int64_t r = 0; r < rows; ++r) {
    std::set<int32_t> distinct;
    const int64_t count = r % 5 == 4 ? 0 : 1 + static_cast<int64_t>(rng() % 200);
    while (static_cast<int64_t>(distinct.size()) < count) distinct.insert(rng() % 1000);
    const int32_t begin = static_cast<int32_t>(adjust.size());
    for (int32_t t : distinct) {
      adjust.push_back({t, static_cast<int32_t>(rng() % 3), 0.f, kAdjustSeen});
    }
    const bool pending = count > 0 && r % 3 != 2;
    if (pending) adjust.back() = {adjust.back().token, 0, 0.f, kAdjustPending};
    // Half the rows draw a token their entries name, the others one they do not.
    int32_t token = 1000 + static_cast<int32_t>(rng() % 1000);
    if (count > 1 && r % 2 == 0) token = adjust[begin + rng() % (count - 1)].token;
    tokens.push_back(token);
    params.push_back(
        ToSamplingRow(SamplingParams{}, 0, begin, static_cast<int32_t>(adjust.size()) - begin));
  }
  const int64_t m = static_cast<int64_t>(adjust.size());
  std::vector<LogitAdjustment> want = adjust, got(m);
  for (Backend* b : {cpu_.get(), gpu_.get()}) {
    Tensor p = *b->Allocate({rows, kSamplingRowWords}, DType::kI64);
    Tensor a = *b->Allocate({m, kLogitAdjustmentWords}, DType::kI32);
    Tensor t = *b->Allocate({rows}, DType::kI32);
    ASSERT_TRUE(b->CopyFromHost(params.data(), DType::kI64, &p).ok());
    ASSERT_TRUE(b->CopyFromHost(adjust.data(), DType::kI32, &a).ok());
    ASSERT_TRUE(b->CopyFromHost(tokens.data(), DType::kI32, &t).ok());
    ASSERT_TRUE(b->CountPendingTokens(t, p, &a).ok());
    ASSERT_TRUE(b->CopyToHost(a, DType::kI32, b == cpu_.get() ? want.data() : got.data()).ok());
  }
  EXPECT_EQ(std::memcmp(got.data(), want.data(), m * sizeof(LogitAdjustment)), 0);
  EXPECT_NE(std::memcmp(want.data(), adjust.data(), m * sizeof(LogitAdjustment)), 0);
}

// LogprobRows against the CPU's (RowLogprobs in double): the sampled and named ids' values,
// and the top k ids in order with their values. Rows of random logits; of a few distinct
// values (ties within and across the GPU's 512-id slices, ordered by id); and masked to
// -inf but for a few ids (whole slices of -inf).
TEST_F(SamplingCudaTest, LogprobRowsMatchTheCpu) {
  enum class Kind { kRandom, kTies, kMasked };
  for (const Kind kind : {Kind::kRandom, Kind::kTies, Kind::kMasked}) {
    for (const int64_t vocab : {int64_t{7}, int64_t{1000}, int64_t{1537}, int64_t{151936}}) {
      for (const int64_t k : {int64_t{0}, int64_t{1}, int64_t{5}, int64_t{20}}) {
        SCOPED_TRACE(::testing::Message()
                     << "kind " << static_cast<int>(kind) << " vocab " << vocab << " k " << k);
        const int64_t rows = 9, m = 3;
        std::vector<float> logits =
            RandomLogits(rows * vocab, static_cast<uint32_t>(vocab + k), 3.f);
        logits[2] = logits[1];  // a tie: the lower id first
        if (kind == Kind::kTies) {
          for (float& l : logits) l = std::floor(l);
        } else if (kind == Kind::kMasked) {
          for (size_t i = 0; i < logits.size(); ++i) {
            const int64_t id = static_cast<int64_t>(i) % vocab;
            if (id % 97 != 3 && id % 499 != 5) logits[i] = -INFINITY;
          }
        }
        std::vector<int32_t> sampled(rows), named(rows * m);
        for (int64_t r = 0; r < rows; ++r) {
          sampled[r] = static_cast<int32_t>((r * 131) % vocab);
          for (int64_t j = 0; j < m; ++j)
            named[r * m + j] = j == 2 ? -1 : static_cast<int32_t>((r * 17 + j * 5) % vocab);
        }
        struct Out {
          std::vector<float> sampled, named, top;
          std::vector<int32_t> top_ids;
        };
        auto run = [&](Backend* b) {
          Tensor l = *b->Upload(logits, {rows, vocab});
          Tensor s = *b->Allocate({rows}, DType::kI32), n = *b->Allocate({rows, m}, DType::kI32);
          EXPECT_TRUE(b->CopyFromHost(sampled.data(), DType::kI32, &s).ok());
          EXPECT_TRUE(b->CopyFromHost(named.data(), DType::kI32, &n).ok());
          Tensor sl = *b->Allocate({rows}, DType::kF32), nl = *b->Allocate({rows, m}, DType::kF32);
          Tensor ti = *b->Allocate({rows, k}, DType::kI32),
                 tl = *b->Allocate({rows, k}, DType::kF32);
          const absl::Status st = b->LogprobRows(l, s, n, &sl, &nl, &ti, &tl);
          EXPECT_TRUE(st.ok()) << b->name() << ": " << st;
          Out o;
          o.sampled = *b->Download(sl);
          o.named = *b->Download(nl);
          if (k > 0) {
            o.top = *b->Download(tl);
            o.top_ids = *b->DownloadIndices(ti);
          }
          return o;
        };
        const Out got = run(gpu_.get()), want = run(cpu_.get());
        // -inf (a masked id) exactly, else within 1e-5.
        auto expect_close = [](float g, float w) {
          if (std::isinf(w)) {
            EXPECT_EQ(g, w);
          } else {
            EXPECT_NEAR(g, w, 1e-5);
          }
        };
        for (int64_t r = 0; r < rows; ++r) {
          SCOPED_TRACE(::testing::Message() << "row " << r);
          expect_close(got.sampled[r], want.sampled[r]);
          for (int64_t j = 0; j < m; ++j) expect_close(got.named[r * m + j], want.named[r * m + j]);
        }
        EXPECT_EQ(got.top_ids, want.top_ids);
        for (size_t i = 0; i < got.top.size(); ++i) {
          SCOPED_TRACE(::testing::Message() << "top " << i);
          expect_close(got.top[i], want.top[i]);
        }
      }
    }
  }
}

}  // namespace
}  // namespace dxs
