#include "tests/disagg/cluster_harness.h"

#include <numeric>

#include "gtest/gtest.h"

namespace dxs::testing {

InprocCluster::InprocCluster(const std::string& model_dir, int num_attention,
                             const Placement& placement, DType wire_dtype)
    : InprocCluster(model_dir, num_attention, placement, ClusterOptions{wire_dtype}) {}

InprocCluster::InprocCluster(const std::string& model_dir, int num_attention,
                             const Placement& placement, const ClusterOptions& options) {
  const DType wire_dtype = options.wire_dtype;
  auto make_backend = [&options]() {
    return options.backend_factory ? options.backend_factory() : MakeCpuBackend();
  };
  const int num_expert = placement.num_ranks();
  const int num_peers = num_attention + num_expert;
  if (options.transport == "ucx") {
    for (int i = 0; i < num_peers; ++i) {
      absl::StatusOr<std::unique_ptr<Transport>> t = MakeUcxTransport();
      EXPECT_TRUE(t.ok()) << t.status();
      transports_.push_back(std::move(*t));
    }
    // Attention ranks talk to every rank; expert ranks to the attention ranks.
    for (int a = 0; a < num_peers; ++a) {
      for (int b = 0; b < num_peers; ++b) {
        if (a == b || (a >= num_attention && b >= num_attention)) continue;
        EXPECT_TRUE(transports_[a]->Connect(b, transports_[b]->LocalAddress()).ok());
      }
    }
  } else {
    transports_ = MakeInprocTransportGroup(num_peers);
  }
  for (int i = 0; i < num_peers; ++i) EXPECT_TRUE(transports_[i]->SetSelf(i).ok());
  ModelConfig config = *LoadModelConfig(model_dir);
  std::unique_ptr<Checkpoint> ckpt = *Checkpoint::Open(model_dir);
  std::vector<int> dp_peers(num_attention), ep_peers(num_expert);
  std::iota(dp_peers.begin(), dp_peers.end(), 0);
  std::iota(ep_peers.begin(), ep_peers.end(), num_attention);
  for (int r = 0; r < num_expert; ++r) {
    auto ep = std::make_unique<EpRank>();
    ep->backend = make_backend();
    ExpertWeightMap w =
        *LoadExpertWeights(*ckpt, config, placement.experts_of(r), ep->backend.get());
    ep->shard = std::make_unique<ExpertShard>(config, std::move(w), ep->backend.get());
    ep->compute = std::make_unique<ShardCompute>(ep->shard.get());
    ep->server = std::make_unique<ExpertStepServer>(transports_[num_attention + r].get(), dp_peers,
                                                    ep->compute.get(), config);
    ep_.push_back(std::move(ep));
  }
  for (int r = 0; r < num_attention; ++r) {
    auto dp = std::make_unique<DpRank>();
    dp->backend = make_backend();
    dp->kv = std::make_unique<KvCache>(config, dp->backend.get(), 1 << 16);
    dp->scheduler = std::make_unique<Scheduler>(config, dp->kv.get(), SchedulerOptions{});
    DispatchOptions dispatch = DispatchOptionsForWire(wire_dtype, absl::Seconds(5));
    dispatch.mapped_regions = options.mapped_regions;
    dp->moe = std::make_unique<RemoteMoeExecutor>(dp->backend.get(), transports_[r].get(), ep_peers,
                                                  placement, config.hidden_size, dispatch);
    if (options.dispatch_observer != nullptr) dp->moe->set_observer(options.dispatch_observer);
    dp->model = std::make_unique<Qwen3MoeModel>(
        config, *LoadAttentionWeights(*ckpt, config, dp->backend.get()), dp->backend.get(),
        dp->moe.get());
    dp->loop = std::make_unique<AttentionStepLoop>(
        r, dp_peers, transports_[r].get(), dp->model.get(), dp->moe.get(), dp->scheduler.get(),
        dp->kv.get(), absl::Seconds(5));
    dp->loop->set_piecewise_decode(options.piecewise);
    dp->loop->set_overlap_schedule(options.overlap_schedule);
    dp_.push_back(std::move(dp));
  }
  for (int r = 0; r < num_expert; ++r) {
    ep_[r]->thread =
        std::thread([this, r, s = ep_[r]->server.get(), start = options.on_serve_thread_start] {
          if (start) start(r, s);
          while (!stop_) {
            absl::Status st = s->ServeRound(absl::Now() + absl::Milliseconds(20));
            if (!st.ok() && st.code() != absl::StatusCode::kDeadlineExceeded) {
              ADD_FAILURE() << "expert round: " << st;
            }
          }
        });
  }
  if (!options.held) released_.Notify();
  for (int r = 0; r < num_attention; ++r) {
    dp_[r]->thread = std::thread([this, r, d = dp_[r].get(), start = options.on_step_thread_start] {
      released_.WaitForNotification();
      if (start) start(r, d->loop.get());
      while (!stop_) {
        absl::StatusOr<bool> ran = d->loop->RunOnce(absl::Milliseconds(20));
        if (!ran.ok()) ADD_FAILURE() << "step loop: " << ran.status();
        if (ran.ok() && !*ran) ++d->idle_polls;
      }
    });
  }
}

void InprocCluster::Release() {
  if (!released_.HasBeenNotified()) released_.Notify();
}

InprocCluster::~InprocCluster() {
  stop_ = true;
  Release();
  for (auto& t : transports_) t->Wake();
  for (auto& dp : dp_) dp->thread.join();
  for (auto& ep : ep_) ep->thread.join();
}

absl::Status InprocCluster::Submit(int rank, uint64_t id, const GenerationRequest& r,
                                   std::shared_ptr<ResultSink> sink) {
  const int64_t vocab = dp_[rank]->model->config().vocab_size;
  TokenSink ts;
  ts.on_token = [sink, vocab](int32_t token, const float* logits) {
    std::lock_guard<std::mutex> lock(sink->mu);
    if (sink->tokens.empty()) sink->first_logits.assign(logits, logits + vocab);
    sink->tokens.push_back(token);
  };
  ts.on_logprobs = [sink](const TokenLogprobs& lp) {
    std::lock_guard<std::mutex> lock(sink->mu);
    sink->logprobs.push_back(lp);
  };
  ts.on_done = [sink](const absl::Status& s, FinishReason reason) {
    std::lock_guard<std::mutex> lock(sink->mu);
    sink->done = true;
    sink->status = s;
    sink->reason = reason;
  };
  absl::Status s = dp_[rank]->scheduler->Add(id, r, std::move(ts));
  dp_[rank]->loop->Wake();
  return s;
}

bool InprocCluster::Abort(int rank, uint64_t id) {
  const bool known = dp_[rank]->scheduler->Abort(id);
  dp_[rank]->loop->Wake();
  return known;
}

void InprocCluster::WakeAll() {
  for (auto& dp : dp_) dp->loop->Wake();
}

bool InprocCluster::WaitSinksDone(const std::vector<std::shared_ptr<ResultSink>>& sinks,
                                  absl::Time deadline) {
  const auto all_done = [&] {
    for (const auto& s : sinks) {
      std::lock_guard<std::mutex> lock(s->mu);
      if (!s->done) return false;
    }
    return true;
  };
  while (!all_done()) {
    if (absl::Now() >= deadline) return false;
    absl::SleepFor(absl::Milliseconds(5));
  }
  return true;
}

bool InprocCluster::WaitAllDone(const std::vector<std::shared_ptr<ResultSink>>& sinks,
                                absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  if (!WaitSinksDone(sinks, deadline)) return false;
  // The last token reaches its sink before every rank has counted the last step.
  std::vector<int64_t> idle_before;
  for (const auto& dp : dp_) idle_before.push_back(dp->idle_polls.load());
  const auto settled = [&] {
    const int64_t steps = dp_[0]->loop->counters().steps.load();
    for (size_t r = 0; r < dp_.size(); ++r) {
      if (dp_[r]->idle_polls.load() <= idle_before[r]) return false;
      if (dp_[r]->loop->counters().steps.load() != steps) return false;
    }
    for (const auto& ep : ep_) {
      if (ep->server->counters().steps.load() != steps) return false;
    }
    return true;
  };
  while (!settled()) {
    if (absl::Now() >= deadline) return false;
    absl::SleepFor(absl::Milliseconds(5));
  }
  return true;
}

}  // namespace dxs::testing
