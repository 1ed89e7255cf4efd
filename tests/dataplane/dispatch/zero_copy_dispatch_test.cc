// The zero-copy exchange between RemoteMoeExecutor and ExpertStepServer, on inproc and
// UCX: dispatch rows land in the expert's input slots, combines in the executor's targets
// or straight in `out`, and the results are bit for bit what the copying path computes,
// for one and two EP ranks, float32 and bf16 wires, growing and shrinking batches, empty
// batches and two micro-batches in flight; with float32 activations and with activations
// already in the wire dtype (bf16 x and out, which the exchange then never converts).
// Each case runs on both exchanges: "copy" (every row through the transport's transfers)
// and "mapped" (the one-copy exchange: the expert reads and answers in the DP rank's
// mapped region), which must give the same bits. On the mapped exchange, x and out may also
// be the region's staged buffers (RemoteMoeExecutor::StageBuffers, what the model uses):
// then the expert reads x and answers into out in place, with the same bits again.
#include <gtest/gtest.h>

#include <atomic>
#include <cstring>
#include <memory>
#include <numeric>
#include <string>
#include <thread>
#include <vector>

#include "absl/time/clock.h"
#include "common/dtype.h"
#include "common/model_config.h"
#include "dataplane/dispatch/dispatch_combine.h"
#include "dataplane/dispatch/placement.h"
#include "dataplane/dispatch/wire.h"
#include "dataplane/transport/transport.h"
#include "expert_service/expert_step_server.h"
#include "kernels/backend.h"
#include "kernels/tensor.h"

namespace dxs {
namespace {

constexpr int kNumExperts = 8;
constexpr int kTopK = 3;
constexpr int64_t kHidden = 64;

// Element i of a host tensor of float32 or bf16, as float32; and a store that rounds.
float Load(const Tensor& t, int64_t i) {
  return t.dtype() == DType::kF32 ? t.f32()[i]
                                  : Bf16ToFloat(static_cast<const uint16_t*>(t.raw())[i]);
}
void Store(Tensor* t, int64_t i, float v) {
  if (t->dtype() == DType::kF32) {
    t->f32()[i] = v;
  } else {
    static_cast<uint16_t*>(t->raw())[i] = FloatToBf16(v);
  }
}

// out[o] = (sum of out row o's pair weights, in pair order) * its row of x; rows with no
// pair are 0.
// x and out come in the slots' dtype: float32, or bf16 on a bf16 wire.
class ScaledCopyExperts final : public ExpertCompute {
 public:
  explicit ScaledCopyExperts(Backend* backend) : backend_(backend) {}
  bool Holds(int layer, int expert) const override { return expert >= 0 && expert < kNumExperts; }
  Backend* backend() const override { return backend_; }
  absl::Status Forward(int layer, const Tensor& x, const RoutedPairTensors& pairs,
                       Tensor* out) override {
    // Per row of out: its scale and its row of x (the CPU backend's pairs are host memory).
    std::vector<float> scale(out->rows(), 0.f);
    std::vector<int64_t> src(out->rows(), 0);
    for (int64_t p = 0; p < pairs.size(); ++p) {
      scale[pairs.rows.i32()[p]] += pairs.weights.f32()[p];
      src[pairs.rows.i32()[p]] = pairs.rows.i32()[p];
    }
    for (int64_t r = 0; r < out->rows(); ++r) {
      for (int64_t j = 0; j < kHidden; ++j) {
        Store(out, r * kHidden + j,
              scale[r] == 0.f ? 0.f : scale[r] * Load(x, src[r] * kHidden + j));
      }
    }
    return absl::OkStatus();
  }

 private:
  Backend* backend_;
};

// What the exchange must produce: per token, 0 + each rank's answer in ascending rank
// order, with the wire's rounding on the way out and back.
std::vector<float> Expected(const std::vector<float>& x, const std::vector<int32_t>& ids,
                            const std::vector<float>& weights, const Placement& placement,
                            DType wire) {
  auto round_trip = [wire](float v) {
    return wire == DType::kBF16 ? Bf16ToFloat(FloatToBf16(v)) : v;
  };
  const int64_t tokens = static_cast<int64_t>(ids.size()) / kTopK;
  std::vector<float> out(x.size(), 0.f);
  for (int64_t t = 0; t < tokens; ++t) {
    for (int r = 0; r < placement.num_ranks(); ++r) {
      float scale = 0.f;
      for (int k = 0; k < kTopK; ++k) {
        if (placement.owner(ids[t * kTopK + k]) == r) scale += weights[t * kTopK + k];
      }
      if (scale == 0.f) continue;
      for (int64_t j = 0; j < kHidden; ++j) {
        out[t * kHidden + j] += round_trip(scale * round_trip(x[t * kHidden + j]));
      }
    }
  }
  return out;
}

struct Batch {
  std::vector<float> x;
  std::vector<int32_t> ids;
  std::vector<float> weights;
};

Batch MakeBatch(int64_t tokens, int seed) {
  Batch b;
  for (int64_t i = 0; i < tokens * kHidden; ++i) {
    b.x.push_back(0.25f + 0.001f * static_cast<float>((i * 7919 + seed * 31) % 997));
  }
  for (int64_t t = 0; t < tokens; ++t) {
    for (int k = 0; k < kTopK; ++k) {
      b.ids.push_back(static_cast<int32_t>((t * 5 + k * 3 + seed) % kNumExperts));
      b.weights.push_back(0.1f + 0.05f * static_cast<float>((t + k + seed) % 7));
    }
  }
  return b;
}

class ZeroCopyTest : public ::testing::TestWithParam<std::tuple<std::string, DType, std::string>> {
 protected:
  // Peer 0 is the DP rank; peers 1.. the EP ranks, each served by its own thread.
  void Start(int num_ep) {
    const std::string& backend = std::get<0>(GetParam());
    if (backend == "inproc") {
      transports_ = MakeInprocTransportGroup(1 + num_ep);
    } else {
      for (int i = 0; i <= num_ep; ++i) {
        auto t = MakeUcxTransport();
        ASSERT_TRUE(t.ok()) << t.status();
        transports_.push_back(std::move(*t));
      }
    }
    for (int i = 0; i <= num_ep; ++i) ASSERT_TRUE(transports_[i]->SetSelf(i).ok());
    for (int i = 1; i <= num_ep; ++i) {
      ASSERT_TRUE(transports_[0]->Connect(i, transports_[i]->LocalAddress()).ok());
      ASSERT_TRUE(transports_[i]->Connect(0, transports_[0]->LocalAddress()).ok());
    }
    backend_ = MakeCpuBackend();
    experts_ = std::make_unique<ScaledCopyExperts>(backend_.get());
    ModelConfig config;
    config.hidden_size = kHidden;
    config.num_hidden_layers = 1;
    config.num_experts = kNumExperts;
    config.num_experts_per_tok = kTopK;
    std::vector<int> ep_peers;
    for (int i = 1; i <= num_ep; ++i) {
      servers_.push_back(std::make_unique<ExpertStepServer>(
          transports_[i].get(), std::vector<int>{0}, experts_.get(), config));
      ep_peers.push_back(i);
    }
    for (auto& server : servers_) {
      threads_.emplace_back([this, s = server.get()] {
        while (!stop_) (void)s->ServeRound(absl::Now() + absl::Milliseconds(20));
      });
    }
    placement_ = Placement::Contiguous(kNumExperts, num_ep);
    DispatchOptions options = DispatchOptionsForWire(std::get<1>(GetParam()), kDefaultStepTimeout);
    options.mapped_regions = mapped();
    executor_ = std::make_unique<RemoteMoeExecutor>(backend_.get(), transports_[0].get(), ep_peers,
                                                    placement_, kHidden, options);
  }

  void TearDown() override {
    stop_ = true;
    for (auto& t : threads_) t.join();
    executor_.reset();
    servers_.clear();
  }

  // Where the caller's x and out are: float32 backend tensors; host tensors in the wire
  // dtype; or the executor's staged buffers (in the wire dtype), where it has them.
  enum class InOut { kFloat32, kWireDType, kStaged };

  // One layer through the executor, checked bit for bit. In the wire dtype, out must be
  // the float32 answer rounded once.
  void RunAndCheck(int64_t tokens, int seed, InOut in_out = InOut::kFloat32) {
    Batch b = MakeBatch(tokens, seed);
    Tensor x = *backend_->Upload(b.x, {tokens, kHidden});
    Tensor out = *backend_->Allocate({tokens, kHidden});
    const bool in_wire_dtype = in_out != InOut::kFloat32;
    if (in_wire_dtype) {
      const bool staged =
          in_out == InOut::kStaged && executor_->StageBuffers(0, tokens, wire(), &x, &out);
      // Staged wherever a region can be: on the mapped exchange, for any rows.
      EXPECT_EQ(staged, in_out == InOut::kStaged && mapped() && tokens > 0);
      if (!staged) {
        x = AllocateHostTensor(wire(), {tokens, kHidden});
        out = AllocateHostTensor(wire(), {tokens, kHidden});
      }
      for (int64_t i = 0; i < tokens * kHidden; ++i) {
        Store(&x, i, b.x[i]);
        b.x[i] = Load(x, i);  // what the expert sees
      }
    }
    executor_->set_step(++step_);
    const auto [ids, weights] = Routing(b);
    absl::Status s = executor_->Run(0, x, ids, weights, &out);
    ASSERT_TRUE(s.ok()) << s;
    std::vector<float> want = Expected(b.x, b.ids, b.weights, placement_, wire());
    ASSERT_EQ(out.num_elements(), static_cast<int64_t>(want.size()));
    for (size_t i = 0; i < want.size(); ++i) {
      if (in_wire_dtype)
        want[i] = wire() == DType::kBF16 ? Bf16ToFloat(FloatToBf16(want[i])) : want[i];
      const float got_value = Load(out, static_cast<int64_t>(i));
      uint32_t g, w;
      std::memcpy(&g, &got_value, 4);
      std::memcpy(&w, &want[i], 4);
      ASSERT_EQ(g, w) << "tokens " << tokens << " element " << i;
    }
  }

  // The batch's routing as the model hands it over: [tokens, top_k] tensors.
  std::pair<Tensor, Tensor> Routing(const Batch& b) {
    const int64_t tokens = static_cast<int64_t>(b.ids.size()) / kTopK;
    return {backend_->UploadIndices(b.ids)->Reshape({tokens, kTopK}),
            *backend_->Upload(b.weights, {tokens, kTopK})};
  }

  DType wire() const { return std::get<1>(GetParam()); }
  bool mapped() const { return std::get<2>(GetParam()) == "mapped"; }
  int64_t RowsMapped() const {
    int64_t n = 0;
    for (const auto& s : servers_) n += s->counters().rows_mapped.load();
    return n;
  }
  // On the mapped exchange every combine was answered in place and no row went through
  // a transfer; on the copy exchange none.
  void ExpectExchange() const {
    const DispatchCounters& c = executor_->counters();
    if (mapped()) {
      EXPECT_EQ(c.combines_mapped.load(), c.combines_in_target.load());
      EXPECT_GT(RowsMapped(), 0);
      EXPECT_EQ(c.combines_into_out.load(), 0);
    } else {
      EXPECT_EQ(c.combines_mapped.load(), 0);
      EXPECT_EQ(RowsMapped(), 0);
    }
  }
  int64_t RoundsInPlace() const {
    int64_t n = 0;
    for (const auto& s : servers_) n += s->counters().rounds_in_place.load();
    return n;
  }
  int64_t Rounds() const {
    int64_t n = 0;
    for (const auto& s : servers_) n += s->counters().rounds.load();
    return n;
  }

  std::vector<std::unique_ptr<Transport>> transports_;
  std::unique_ptr<Backend> backend_;
  std::unique_ptr<ScaledCopyExperts> experts_;
  std::vector<std::unique_ptr<ExpertStepServer>> servers_;
  std::vector<std::thread> threads_;
  std::atomic<bool> stop_{false};
  Placement placement_ = Placement::Contiguous(kNumExperts, 1);
  std::unique_ptr<RemoteMoeExecutor> executor_;
  uint64_t step_ = 0;
};

TEST_P(ZeroCopyTest, OneRankLandsInPlace) {
  ASSERT_NO_FATAL_FAILURE(Start(1));
  // Growing batches miss the slots once each, then repeats and smaller ones fit.
  const int64_t sizes[] = {5, 64, 64, 300, 300, 0, 17, 300, 1, 0};
  int seed = 0;
  for (int64_t tokens : sizes) ASSERT_NO_FATAL_FAILURE(RunAndCheck(tokens, ++seed));
  const DispatchCounters& c = executor_->counters();
  // 5, 64 and 300 grew the slots (5 also set their dtype); everything else landed in
  // place, in the wire's dtype.
  EXPECT_GE(RoundsInPlace(), Rounds() - 3);
  ExpectExchange();
  if (mapped()) {
    // The answers are stored in the region, and summed from there into the output.
  } else if (wire() == DType::kF32) {
    // One rank holding every token: its combine is the output (empty batches excepted).
    EXPECT_GE(c.combines_into_out.load(), 6);
  } else {
    EXPECT_EQ(c.combines_into_out.load(), 0);  // bf16 rows are widened into a float32 out
  }
  EXPECT_EQ(c.combines_in_target.load(), static_cast<int64_t>(std::size(sizes)));
}

// Activations already in the wire dtype (bf16 x and out on a bf16 wire): rows go out
// from x and one rank's combine lands in out, both unconverted; with two ranks the sum is
// taken in float32 and rounded once.
TEST_P(ZeroCopyTest, ActivationsInTheWireDTypeCrossUnconverted) {
  ASSERT_NO_FATAL_FAILURE(Start(1));
  const int64_t sizes[] = {5, 64, 64, 300, 0, 17, 300};
  int seed = 0;
  for (int64_t tokens : sizes)
    ASSERT_NO_FATAL_FAILURE(RunAndCheck(tokens, ++seed, InOut::kWireDType));
  EXPECT_GE(RoundsInPlace(), Rounds() - 3);
  ExpectExchange();
  // Every non-empty batch on the copy exchange: the one rank's combine is the output.
  if (!mapped()) EXPECT_EQ(executor_->counters().combines_into_out.load(), 6);
}

TEST_P(ZeroCopyTest, ActivationsInTheWireDTypeSumOverRanksOnce) {
  ASSERT_NO_FATAL_FAILURE(Start(2));
  int seed = 0;
  for (int64_t tokens : {40, 40, 3, 0, 200, 200}) {
    ASSERT_NO_FATAL_FAILURE(RunAndCheck(tokens, ++seed, InOut::kWireDType));
  }
  EXPECT_GT(RoundsInPlace(), 0);
  ExpectExchange();
}

// x and out staged in the region: one rank holding every token reads x and answers into
// out in place, so nothing is packed and nothing copied, every non-empty batch.
TEST_P(ZeroCopyTest, StagedInputAndOutputCrossInPlace) {
  ASSERT_NO_FATAL_FAILURE(Start(1));
  const int64_t sizes[] = {5, 64, 64, 300, 0, 17, 300, 2};
  int seed = 0;
  for (int64_t tokens : sizes) ASSERT_NO_FATAL_FAILURE(RunAndCheck(tokens, ++seed, InOut::kStaged));
  const DispatchCounters& c = executor_->counters();
  ExpectExchange();
  EXPECT_EQ(c.dispatches_from_staged_x.load(), mapped() ? 7 : 0);
  EXPECT_EQ(c.combines_into_staged_out.load(), mapped() ? 7 : 0);
}

// Two ranks and staged buffers: every token here has experts on both ranks, so both read
// x in place; their answers are summed from the region into out (the staged out is not
// answered into when two ranks answer).
TEST_P(ZeroCopyTest, StagedInputSumsOverRanksOnce) {
  ASSERT_NO_FATAL_FAILURE(Start(2));
  int seed = 0;
  for (int64_t tokens : {40, 40, 3, 0, 200, 200, 7}) {
    ASSERT_NO_FATAL_FAILURE(RunAndCheck(tokens, ++seed, InOut::kStaged));
  }
  const DispatchCounters& c = executor_->counters();
  ExpectExchange();
  EXPECT_EQ(c.dispatches_from_staged_x.load(), mapped() ? 6 : 0);
  EXPECT_EQ(c.combines_into_staged_out.load(), 0);
}

// Three ranks, each taking some of the tokens: every rank's rows are packed, and the
// dispatch outgrows the room that staging left after x and out. The region is replaced
// (x and out stay in the old one, copied from and summed into there) and staged again.
TEST_P(ZeroCopyTest, StagedBuffersOutgrownByTheDispatch) {
  ASSERT_NO_FATAL_FAILURE(Start(3));
  int seed = 0;
  for (int64_t tokens : {40, 40, 100, 3, 100}) {
    ASSERT_NO_FATAL_FAILURE(RunAndCheck(tokens, ++seed, InOut::kStaged));
  }
  ExpectExchange();
}

TEST_P(ZeroCopyTest, TwoRanksSumInRankOrder) {
  ASSERT_NO_FATAL_FAILURE(Start(2));
  int seed = 0;
  for (int64_t tokens : {40, 40, 3, 0, 40, 200, 200}) {
    ASSERT_NO_FATAL_FAILURE(RunAndCheck(tokens, ++seed));
  }
  EXPECT_GT(RoundsInPlace(), 0);
  EXPECT_GT(executor_->counters().combines_in_target.load(), 0);
  ExpectExchange();
}

// Two micro-batches in flight: the second dispatch goes out before the first combine, so
// the expert holds a rank's two messages at once, one per slot.
TEST_P(ZeroCopyTest, TwoMicroBatchesInFlight) {
  ASSERT_NO_FATAL_FAILURE(Start(1));
  const int64_t tokens = 48;
  for (int round = 0; round < 4; ++round) {
    Batch b[2] = {MakeBatch(tokens, 2 * round), MakeBatch(tokens, 2 * round + 1)};
    Tensor x[2], out[2];
    std::unique_ptr<MoeHandle> handle[2];
    executor_->set_step(++step_);
    for (int m = 0; m < 2; ++m) {
      x[m] = *backend_->Upload(b[m].x, {tokens, kHidden});
      out[m] = *backend_->Allocate({tokens, kHidden});
      // Odd rounds on the f32 wire: each micro-batch's own staged buffers.
      Tensor staged_x, staged_out;
      if (round % 2 == 1 &&
          executor_->StageBuffers(m, tokens, DType::kF32, &staged_x, &staged_out)) {
        ASSERT_EQ(wire(), DType::kF32);
        ASSERT_TRUE(backend_->CopyFromHost(b[m].x.data(), DType::kF32, &staged_x).ok());
        x[m] = staged_x;
        out[m] = staged_out;
      }
      const auto [ids, weights] = Routing(b[m]);
      absl::StatusOr<std::unique_ptr<MoeHandle>> h =
          executor_->Dispatch(0, m, 2, x[m], ids, weights, &out[m]);
      ASSERT_TRUE(h.ok()) << h.status();
      handle[m] = std::move(*h);
    }
    // Combined in either order: each handle carries its own micro-batch.
    for (int m : {1, 0}) {
      absl::Status s = executor_->Combine(std::move(handle[m]), &out[m]);
      ASSERT_TRUE(s.ok()) << s;
      const std::vector<float> want = Expected(b[m].x, b[m].ids, b[m].weights, placement_, wire());
      EXPECT_TRUE(*backend_->Download(out[m]) == want) << "round " << round << " micro " << m;
    }
  }
  EXPECT_GE(RoundsInPlace(), Rounds() - 2);
  ExpectExchange();
  const bool staged = mapped() && wire() == DType::kF32;
  EXPECT_EQ(executor_->counters().combines_into_staged_out.load(), staged ? 4 : 0);
  // A handle combines once; a dropped one abandons its exchange.
  Batch b = MakeBatch(tokens, 99);
  Tensor x = *backend_->Upload(b.x, {tokens, kHidden}),
         out = *backend_->Allocate({tokens, kHidden});
  const auto [ids, weights] = Routing(b);
  executor_->set_step(++step_);
  absl::StatusOr<std::unique_ptr<MoeHandle>> dropped =
      executor_->Dispatch(0, 0, 1, x, ids, weights, &out);
  ASSERT_TRUE(dropped.ok());
  dropped->reset();
  EXPECT_EQ(executor_->Combine(nullptr, &out).code(), absl::StatusCode::kFailedPrecondition);
}

// An EP rank that cannot map the DP rank's region answers kRegionUnmappable: that step
// fails with UNAVAILABLE, and the rank's next rounds come by copy. The EP rank here is the
// test itself, on an inproc pair.
TEST(MappedExchange, AnUnmappableRankFailsOnceThenTakesCopies) {
  std::vector<std::unique_ptr<Transport>> transports = MakeInprocTransportGroup(2);
  std::unique_ptr<Backend> backend = MakeCpuBackend();
  DispatchOptions options;
  RemoteMoeExecutor executor(backend.get(), transports[0].get(), {1},
                             Placement::Contiguous(kNumExperts, 1), kHidden, options);
  const int64_t tokens = 4;
  Batch b = MakeBatch(tokens, 1);
  Tensor x = *backend->Upload(b.x, {tokens, kHidden});
  Tensor out = *backend->Allocate({tokens, kHidden});
  Tensor ids = backend->UploadIndices(b.ids)->Reshape({tokens, kTopK});
  Tensor weights = *backend->Upload(b.weights, {tokens, kTopK});
  // The EP rank's side of one round: the header, then the answer its kind asks for.
  auto serve = [&](bool* was_mapped) {
    absl::StatusOr<TransportMessage> m = transports[1]->Recv(0, absl::Now() + absl::Seconds(5));
    ASSERT_TRUE(m.ok()) << m.status();
    absl::StatusOr<WireHeader> h = WireHeader::Decode(m->header);
    ASSERT_TRUE(h.ok()) << h.status();
    *was_mapped = h->mapped();
    const size_t rows_bytes = static_cast<size_t>(h->num_rows) * kHidden * sizeof(float);
    std::vector<uint8_t> rows(rows_bytes), pairs(12 * h->num_pairs);
    int32_t status = kRegionUnmappable;
    std::vector<Transfer> group;
    if (h->mapped()) {
      group.push_back({Transfer::Kind::kSend, 0, &status, sizeof(status)});
    } else {
      group.push_back({Transfer::Kind::kRecv, 0, rows.data(), rows_bytes});
      group.push_back({Transfer::Kind::kRecv, 0, pairs.data(), pairs.size()});
      group.push_back({Transfer::Kind::kSend, 0, rows.data(), rows_bytes});
    }
    absl::StatusOr<ExchangeId> id =
        transports[1]->PostExchange(ExchangeTag(h->key()), group.data(), group.size());
    ASSERT_TRUE(id.ok()) << id.status();
    ASSERT_TRUE(transports[1]->WaitExchange(*id, absl::Now() + absl::Seconds(5)).ok());
  };
  bool mapped[2] = {false, true};
  for (int round = 0; round < 2; ++round) {
    std::thread ep([&] { serve(&mapped[round]); });
    executor.set_step(round + 1);
    absl::Status s = executor.Run(0, x, ids, weights, &out);
    ep.join();
    if (round == 0) {
      EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable) << s;
      EXPECT_NE(s.message().find("could not map"), std::string::npos) << s;
    } else {
      EXPECT_TRUE(s.ok()) << s;
    }
  }
  EXPECT_TRUE(mapped[0]);
  EXPECT_FALSE(mapped[1]);
  EXPECT_EQ(executor.counters().combines_mapped.load(), 0);
}

// --wire-dtype fp8: the rows leave as FP8 records and the experts compute on their values
// (dequantized into bf16, the answers' dtype), bit for bit what quantizing and dequantizing
// x on this backend gives; the answers come back bf16. One and two EP ranks, empty and
// growing batches; on the mapped exchange every record is written into the region and
// read there (the rows counted mapped are the rows dispatched), on the copy exchange none.
using Fp8DispatchTest = ZeroCopyTest;

TEST_P(Fp8DispatchTest, ExpertsComputeOnTheRecordsValues) {
  for (int num_ep : {1, 2}) {
    SCOPED_TRACE(::testing::Message() << num_ep << " EP ranks");
    ASSERT_NO_FATAL_FAILURE(Start(num_ep));
    int seed = 0;
    for (int64_t tokens : {40, 3, 0, 200, 64}) {
      Batch b = MakeBatch(tokens, ++seed);
      Tensor x = *backend_->Upload(b.x, {tokens, kHidden});
      Tensor out = *backend_->Allocate({tokens, kHidden});
      executor_->set_step(++step_);
      const auto [ids, weights] = Routing(b);
      absl::Status s = executor_->Run(0, x, ids, weights, &out);
      ASSERT_TRUE(s.ok()) << s;
      // What the experts must have seen: x quantized and dequantized here.
      std::vector<int32_t> all(static_cast<size_t>(tokens));
      std::iota(all.begin(), all.end(), 0);
      Tensor records = *backend_->Allocate({tokens, Fp8RecordBytes(kHidden)}, DType::kF8E4M3);
      ASSERT_TRUE(backend_->QuantizeRowsFp8(x, *backend_->UploadIndices(all), &records).ok());
      Tensor seen = *backend_->Allocate({tokens, kHidden});
      ASSERT_TRUE(backend_->DequantizeRowsFp8(records, &seen).ok());
      const std::vector<float> want =
          Expected(*backend_->Download(seen), b.ids, b.weights, placement_, DType::kBF16);
      const std::vector<float> got = *backend_->Download(out);
      ASSERT_EQ(got.size(), want.size());
      for (size_t i = 0; i < want.size(); ++i) {
        ASSERT_EQ(got[i], want[i]) << "tokens " << tokens << " element " << i;
      }
      if (tokens > 0) EXPECT_NE(*backend_->Download(seen), b.x) << "the records changed nothing";
    }
    ExpectExchange();
    if (mapped()) {
      int64_t dispatched = 0;
      for (const auto& n : executor_->counters().tokens_dispatched) dispatched += n.load();
      EXPECT_EQ(RowsMapped(), dispatched) << "every record through a region";
    }
    TearDown();
    stop_ = false;
    threads_.clear();
    transports_.clear();
  }
}

INSTANTIATE_TEST_SUITE_P(Backends, Fp8DispatchTest,
                         ::testing::Combine(::testing::Values("inproc", "ucx"),
                                            ::testing::Values(DType::kF8E4M3),
                                            ::testing::Values("copy", "mapped")),
                         [](const auto& info) {
                           return std::get<0>(info.param) + "_fp8_" + std::get<2>(info.param);
                         });

INSTANTIATE_TEST_SUITE_P(Backends, ZeroCopyTest,
                         ::testing::Combine(::testing::Values("inproc", "ucx"),
                                            ::testing::Values(DType::kF32, DType::kBF16),
                                            ::testing::Values("copy", "mapped")),
                         [](const auto& info) {
                           return std::get<0>(info.param) +
                                  (std::get<1>(info.param) == DType::kF32 ? "_f32_" : "_bf16_") +
                                  std::get<2>(info.param);
                         });

}  // namespace
}  // namespace dxs
