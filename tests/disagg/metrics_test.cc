// Prometheus metrics of a real cluster (router, 2 attention and 2 expert processes on
// loopback): every process serves /metrics that `promtool check metrics` accepts, the
// addresses are registered with the router, and the key series move: a DP rank that gets
// no requests counts empty-batch steps (and so does the router's cluster-wide view), the
// dispatch and combine histograms get samples, tokens dispatched equal tokens received,
// and the router counts requests by code with their latencies.
#include <grpcpp/grpcpp.h>

#include <thread>

#include "absl/strings/str_cat.h"
#include "dxs/v1/frontend.grpc.pb.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/disagg/metrics_util.h"
#include "tests/disagg/process_cluster.h"
#include "tests/model/test_util.h"

namespace dxs {
namespace {

using testing::ClusterSpec;
using testing::ParseSamples;
using testing::ProcessCluster;
using testing::SumOf;
using testing::TempDir;
using testing::Value;
using Samples = std::map<std::string, double>;

constexpr int kMaxNewTokens = 8;

// How long the test waits for a process's metrics to show what it expects (a generous
// bound: every wait ends as soon as they do).
constexpr absl::Duration kScrapeTimeout = absl::Seconds(30);

// One Generate through the router's front door, pinned to DP rank `rank`; the final status.
grpc::Status GeneratePinned(v1::Frontend::Stub* frontend, int rank,
                            const std::vector<uint32_t>& prompt) {
  v1::GenerateRequest req;
  for (uint32_t t : prompt) req.add_prompt_token_ids(t);
  req.mutable_sampling_params()->set_max_new_tokens(kMaxNewTokens);
  req.mutable_sampling_params()->set_temperature(0.f);
  req.mutable_sampling_params()->set_ignore_eos(true);
  req.set_data_parallel_rank(static_cast<uint32_t>(rank));
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
  auto reader = frontend->Generate(&ctx, req);
  v1::GenerateResponse resp;
  while (reader->Read(&resp)) {
  }
  return reader->Finish();
}

Samples MustScrape(const std::string& address) {
  absl::StatusOr<std::string> text = testing::Scrape(address);
  EXPECT_TRUE(text.ok()) << text.status();
  return text.ok() ? ParseSamples(*text) : Samples();
}

// Scrapes `address` until `done` holds; the last samples. A test failure, naming `what`,
// if it does not within kScrapeTimeout.
template <typename Pred>
Samples ScrapeUntil(const std::string& address, Pred done, const std::string& what) {
  const absl::Time deadline = absl::Now() + kScrapeTimeout;
  Samples s;
  while (true) {
    absl::StatusOr<std::string> text = testing::Scrape(address);
    if (text.ok()) s = ParseSamples(*text);
    if (text.ok() && done(s)) return s;
    if (absl::Now() > deadline) {
      ADD_FAILURE() << address << ": " << what << ", not within " << kScrapeTimeout
                    << (text.ok() ? "" : "; last scrape: " + text.status().ToString());
      return s;
    }
    absl::SleepFor(absl::Milliseconds(100));
  }
}

// Runs `dxs status --router ADDR --format json`; its stdout.
std::string DxsStatusJson(const ProcessCluster& cluster) {
  const std::string command = absl::StrCat(cluster.bin("dxs"), " status --router ",
                                           cluster.router_address(), " --format json 2>/dev/null");
  std::string out;
  if (FILE* pipe = popen(command.c_str(), "r")) {
    char buf[4096];
    for (size_t n; (n = std::fread(buf, 1, sizeof(buf), pipe)) > 0;) out.append(buf, n);
    pclose(pipe);
  }
  return out;
}

TEST(Metrics, EveryProcessServesCleanMetricsThatMove) {
  if (access(testing::kPromtool, X_OK) != 0) GTEST_SKIP() << testing::kPromtool << " missing";
  TempDir tmp;
  const std::string dir = testing::WritePreset(tmp, "default");
  ProcessCluster cluster(tmp.path());
  absl::Status started = cluster.Start(ClusterSpec{dir, 2, 2, {}});
  ASSERT_TRUE(started.ok()) << started << cluster.DumpLogs();

  // Every process printed its metrics address, and registered it (`dxs status` shows it).
  const std::vector<std::string> addresses = cluster.metrics_addresses();
  ASSERT_EQ(addresses.size(), 5u) << cluster.DumpLogs();
  for (const std::string& a : addresses) ASSERT_GT(testing::PortOf(a), 0) << cluster.DumpLogs();
  const nlohmann::json status = nlohmann::json::parse(DxsStatusJson(cluster), nullptr, false);
  ASSERT_TRUE(status.is_object()) << DxsStatusJson(cluster);
  int registered = 0;
  for (const nlohmann::json& w : status["workers"]) {
    const int rank = w["rank"].get<int>();
    const std::string want = w["role"] == "attention" ? cluster.attention_metrics_address(rank)
                                                      : cluster.expert_metrics_address(rank);
    EXPECT_EQ(w["metrics_address"].get<std::string>(), want) << w.dump();
    ++registered;
  }
  EXPECT_EQ(registered, 4);
  // The model as served: the default preset's f32 weights, the cluster's f32 wire.
  EXPECT_EQ(status["model"]["dtype"], "float32") << status.dump();
  EXPECT_EQ(status["model"]["checkpoint_dtype"], "float32") << status.dump();
  EXPECT_EQ(status["model"]["wire_dtype"], "float32") << status.dump();

  const std::string attention1 = cluster.attention_metrics_address(1);
  const Samples before = MustScrape(attention1);
  const std::string empty1 = R"(dxs_empty_batch_steps_total{role="attention",rank="1"})";
  const std::string steps1 = R"(dxs_steps_total{role="attention",rank="1"})";

  // Requests to DP rank 0 only; DP rank 1 takes part in every step with an empty batch.
  constexpr int kNumRequests = 4;
  std::vector<grpc::Status> results(kNumRequests);
  std::vector<std::thread> threads;
  for (int i = 0; i < kNumRequests; ++i) {
    threads.emplace_back([&, i] {
      std::vector<uint32_t> prompt;
      // Request 0's 24-token prompt: its prefill step has more tokens than the two-batch
      // overlap threshold (16), so every DP rank splits that step into two micro-batches.
      for (int j = 0; j < (i == 0 ? 24 : 3 + i); ++j) prompt.push_back(7 + 31 * i + 101 * j);
      results[i] = GeneratePinned(cluster.frontend(), 0, prompt);
    });
  }
  for (auto& t : threads) t.join();
  for (const grpc::Status& s : results) ASSERT_TRUE(s.ok()) << s.error_message();
  // dxs_cluster_empty_ranks covers the router's last 5 s only: read it now, while DP rank
  // 1's empty steps are recent, once the heartbeats have brought them to the router.
  const std::string router = cluster.router_metrics_address();
  const std::string cluster_empty_ranks = R"(dxs_cluster_empty_ranks{role="attention"})";
  const Samples recent = ScrapeUntil(
      router, [&](const Samples& s) { return Value(s, cluster_empty_ranks) >= 1; },
      "the router counts DP rank 1 among the empty ranks");
  // One refused request: an empty prompt is INVALID_ARGUMENT.
  EXPECT_EQ(GeneratePinned(cluster.frontend(), 0, {}).error_code(),
            grpc::StatusCode::INVALID_ARGUMENT);

  // promtool accepts every process's exposition as it is now.
  for (const std::string& address : addresses) {
    absl::StatusOr<std::string> text = testing::Scrape(address);
    ASSERT_TRUE(text.ok()) << text.status();
    const testing::PromtoolResult check = testing::CheckMetrics(*text);
    EXPECT_EQ(check.exit_code, 0) << address << ": " << check.output << "\n" << *text;
    EXPECT_EQ(check.output, "") << address << ":\n" << *text;
    EXPECT_NE(text->find("dxs_build_info{"), std::string::npos) << address;
  }

  // DP rank 1 had no request: all its new steps were empty ones.
  const Samples after1 = MustScrape(attention1);
  EXPECT_GT(Value(after1, empty1), Value(before, empty1));
  EXPECT_EQ(Value(after1, empty1) - Value(before, empty1),
            Value(after1, steps1) - Value(before, steps1));
  EXPECT_GT(Value(after1, R"(dxs_dispatch_latency_seconds_count{rank="1"})"), 0);
  // Both DP ranks split the long prompt's step, and only the same steps.
  const double overlapped1 = Value(after1, R"(dxs_overlapped_steps_total{rank="1"})");
  EXPECT_GT(overlapped1, 0);

  // DP rank 0 did the work: non-empty steps, dispatch and combine samples, KV cache gauges
  // (read once they show it idle: the caller can see a request's end before the step that
  // ended it has updated them).
  const Samples attention0 = ScrapeUntil(
      cluster.attention_metrics_address(0),
      [](const Samples& s) {
        return Value(s, R"(dxs_kv_cache_used_tokens{rank="0"})") == 0 &&
               Value(s, R"(dxs_queue_length{rank="0"})") == 0 &&
               Value(s, R"(dxs_running_requests{rank="0"})") == 0;
      },
      "DP rank 0 idle, with no KV cache used");
  EXPECT_GT(Value(attention0, R"(dxs_steps_total{role="attention",rank="0"})"),
            Value(attention0, R"(dxs_empty_batch_steps_total{role="attention",rank="0"})"));
  EXPECT_GT(Value(attention0, R"(dxs_dispatch_latency_seconds_count{rank="0"})"), 0);
  // Each dispatch with tokens observed its balance over the EP ranks, a ratio in (0, 1].
  EXPECT_GT(Value(attention0, R"(dxs_ep_balance_ratio_count{rank="0"})"), 0);
  EXPECT_LE(Value(attention0, R"(dxs_ep_balance_ratio_sum{rank="0"})"),
            Value(attention0, R"(dxs_ep_balance_ratio_count{rank="0"})"));
  EXPECT_GT(Value(attention0, R"(dxs_combine_latency_seconds_count{rank="0"})"), 0);
  EXPECT_GT(Value(attention0, R"(dxs_step_duration_seconds_count{role="attention",rank="0"})"), 0);
  EXPECT_EQ(Value(attention0, R"(dxs_overlapped_steps_total{rank="0"})"), overlapped1);
  EXPECT_GT(SumOf(attention0, "dxs_tokens_dispatched_total"), 0);
  EXPECT_EQ(SumOf(attention0, "dxs_tokens_dispatched_total"),
            SumOf(attention0, "dxs_tokens_combined_total"));
  EXPECT_EQ(Value(attention0, R"(dxs_kv_cache_capacity_tokens{rank="0"})"), 1 << 16);
  EXPECT_EQ(Value(attention0, R"(dxs_kv_cache_used_tokens{rank="0"})"), 0);
  EXPECT_EQ(Value(attention0, R"(dxs_queue_length{rank="0"})"), 0);
  EXPECT_EQ(Value(attention0, R"(dxs_running_requests{rank="0"})"), 0);

  // Expert ranks received exactly what the DP ranks dispatched, per expert and in total.
  const double dispatched = SumOf(attention0, "dxs_tokens_dispatched_total") +
                            SumOf(after1, "dxs_tokens_dispatched_total");
  double received = 0, per_expert = 0;
  for (int r = 0; r < 2; ++r) {
    const Samples e = MustScrape(cluster.expert_metrics_address(r));
    const std::string rank = std::to_string(r);
    EXPECT_GT(Value(e, R"(dxs_steps_total{role="expert",rank=")" + rank + R"("})"), 0);
    EXPECT_GE(Value(e, R"(dxs_empty_batch_steps_total{role="expert",rank=")" + rank + R"("})"), 0);
    EXPECT_GE(Value(e, R"(dxs_empty_layer_rounds_total{rank=")" + rank + R"("})"), 0);
    EXPECT_GT(Value(e, R"(dxs_expert_compute_seconds_count{rank=")" + rank + R"("})"), 0);
    received += Value(e, R"(dxs_tokens_received_total{rank=")" + rank + R"("})");
    per_expert += SumOf(e, "dxs_expert_tokens_total");
  }
  EXPECT_GT(received, 0);
  EXPECT_EQ(received, dispatched);

  // The data exchange's bytes, none in device memory on the CPU: what the DP ranks sent
  // (rows and pairs) is what the EP ranks received, and the other way for the combines,
  // in host memory (transfers) and through the DP ranks' mapped regions (the one-copy
  // exchange, which the processes of one host take) alike.
  auto bytes = [](const Samples& s, const std::string& role, int rank, const char* direction,
                  const char* memory) {
    return Value(s, "dxs_exchange_bytes_total{role=\"" + role + "\",rank=\"" +
                        std::to_string(rank) + "\",direction=\"" + direction + "\",memory=\"" +
                        memory + "\"}");
  };
  for (const char* memory : {"host", "mapped"}) {
    double dp_sent = 0, dp_received = 0, ep_sent = 0, ep_received = 0;
    for (int r = 0; r < 2; ++r) {
      const Samples a = r == 0 ? attention0 : after1;
      EXPECT_EQ(bytes(a, "attention", r, "send", "device"), 0);
      EXPECT_EQ(bytes(a, "attention", r, "recv", "device"), 0);
      dp_sent += bytes(a, "attention", r, "send", memory);
      dp_received += bytes(a, "attention", r, "recv", memory);
      const Samples e = MustScrape(cluster.expert_metrics_address(r));
      EXPECT_EQ(bytes(e, "expert", r, "send", "device"), 0);
      EXPECT_EQ(bytes(e, "expert", r, "recv", "device"), 0);
      ep_sent += bytes(e, "expert", r, "send", memory);
      ep_received += bytes(e, "expert", r, "recv", memory);
    }
    // Host: the statuses of mapped rounds at least; mapped: the rows of a step.
    EXPECT_GT(dp_sent + dp_received, 0) << memory;
    EXPECT_EQ(dp_sent, ep_received) << memory;
    EXPECT_EQ(dp_received, ep_sent) << memory;
  }
  EXPECT_GE(per_expert, received);  // a row routed to two experts of a rank counts twice

  // DP rank 0's MoE inputs were read where its model wrote them (f32 activations on the f32
  // wire, through the one-copy exchange) whenever an EP rank took every token of a layer,
  // as the decode steps' single tokens often are; DP rank 1's empty batches never are.
  EXPECT_GT(Value(attention0, R"(dxs_moe_in_place_total{rank="0",buffer="input"})"), 0);
  EXPECT_GE(Value(attention0, R"(dxs_moe_in_place_total{rank="0",buffer="output"})"), 0);
  EXPECT_EQ(Value(after1, R"(dxs_moe_in_place_total{rank="1",buffer="input"})"), 0);

  // The router: requests by code, latencies, and the cluster view from heartbeats.
  const Samples r = ScrapeUntil(
      router,
      [&](const Samples& s) {
        // The router's view comes with heartbeats (an expert sends one when it goes idle
        // after work): wait for the experts' token counts to reach it too.
        return Value(s, R"(dxs_cluster_empty_batch_steps_total{role="attention",rank="1"})") >=
                   Value(after1, empty1) &&
               Value(s, R"(dxs_workers{role="expert",state="ready"})") == 2 &&
               Value(s, R"(dxs_cluster_tokens_total{role="expert",rank="0"})") +
                       Value(s, R"(dxs_cluster_tokens_total{role="expert",rank="1"})") >
                   0;
      },
      "the cluster view with DP rank 1's empty steps, both experts ready and expert tokens");
  EXPECT_EQ(Value(r, R"(dxs_requests_total{code="OK"})"), kNumRequests);
  EXPECT_EQ(Value(r, R"(dxs_requests_total{code="INVALID_ARGUMENT"})"), 1);
  EXPECT_EQ(Value(r, R"(dxs_request_errors_total{code="INVALID_ARGUMENT"})"), 1);
  EXPECT_EQ(Value(r, R"(dxs_request_errors_total{code="UNAVAILABLE"})"), 0);
  EXPECT_EQ(Value(r, "dxs_time_to_first_token_seconds_count"), kNumRequests);
  EXPECT_EQ(Value(r, "dxs_request_duration_seconds_count"), kNumRequests);
  // One sample per token after the first (fewer if the worker sent several in one chunk).
  EXPECT_GT(Value(r, "dxs_inter_token_latency_seconds_count"), 0);
  EXPECT_LE(Value(r, "dxs_inter_token_latency_seconds_count"), kNumRequests * (kMaxNewTokens - 1));
  EXPECT_EQ(Value(r, "dxs_inflight_requests"), 0);
  EXPECT_GE(Value(r, R"(dxs_cluster_empty_batch_steps_total{role="attention",rank="1"})"),
            Value(after1, empty1));
  EXPECT_EQ(Value(r, R"(dxs_workers{role="attention",state="ready"})"), 2);
  EXPECT_EQ(Value(r, R"(dxs_workers{role="expert",state="ready"})"), 2);
  EXPECT_EQ(Value(r, R"(dxs_workers{role="expert",state="dead"})"), 0);
  EXPECT_GT(Value(r, "dxs_cluster_view_version"), 0);
  EXPECT_GE(Value(r, "dxs_ep_token_imbalance"), 1);
  EXPECT_GT(Value(r, "dxs_cluster_ep_balance_ratio"), 0);
  EXPECT_LE(Value(r, "dxs_cluster_ep_balance_ratio"), 1);
  // The placement: published, 16 experts in two blocks, no replicas (no
  // --num-redundant-experts).
  EXPECT_GT(Value(r, "dxs_placement_version"), 0);
  EXPECT_EQ(Value(r, R"(dxs_placement_experts{rank="0"})"), 8);
  EXPECT_EQ(Value(r, R"(dxs_placement_experts{rank="1"})"), 8);
  EXPECT_EQ(Value(r, R"(dxs_placement_replicas{rank="0"})"), 0);
  EXPECT_EQ(Value(r, R"(dxs_placement_replicas{rank="1"})"), 0);
  // Within the router's 5 s window DP rank 1's empty-step count grew; DP rank 0's did
  // not have to (read right after the requests, above).
  EXPECT_GE(Value(recent, cluster_empty_ranks), 1);
  EXPECT_GT(Value(r, R"(dxs_cluster_tokens_total{role="expert",rank="0"})") +
                Value(r, R"(dxs_cluster_tokens_total{role="expert",rank="1"})"),
            0);
  if (HasFailure()) std::cerr << cluster.DumpLogs();
}

}  // namespace
}  // namespace dxs
