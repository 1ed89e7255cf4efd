// A real Prometheus server (Debian's /usr/bin/prometheus) scrapes a real cluster (router,
// 2 attention and 2 expert processes on loopback) every second while `dxs bench` loads it
// and then requests pinned to DP rank 0 leave DP rank 1 idle. Through Prometheus' HTTP API:
// every target is up, requests are counted, the dispatch latency histogram has samples,
// and over the idle window DP rank 1's empty-batch steps grow (all of its steps there are
// empty), as seen on the worker and in the router's cluster-wide view.
#include <grpcpp/grpcpp.h>

#include <atomic>
#include <cmath>
#include <fstream>
#include <optional>
#include <thread>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "dxs/v1/frontend.grpc.pb.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/disagg/metrics_util.h"
#include "tests/disagg/process_cluster.h"
#include "tests/model/test_util.h"

namespace dxs {
namespace {

using testing::ClusterSpec;
using testing::ProcessCluster;
using testing::TempDir;

constexpr char kPrometheus[] = "/usr/bin/prometheus";

// How long the test waits for Prometheus to have scraped what it needs (a generous bound on
// a 1 s scrape interval: every wait ends as soon as the data is there).
constexpr absl::Duration kScrapeTimeout = absl::Seconds(60);

// A Prometheus server on a free loopback port scraping `targets` every second; stopped
// (SIGTERM) when destroyed.
class PrometheusServer {
 public:
  ~PrometheusServer() { testing::Terminate(&process_); }

  absl::Status Start(const std::string& dir, const std::vector<std::string>& targets) {
    std::ofstream(dir + "/prometheus.yml") << "global:\n"
                                              "  scrape_interval: 1s\n"
                                              "  scrape_timeout: 1s\n"
                                              "  evaluation_interval: 1s\n"
                                              "scrape_configs:\n"
                                              "  - job_name: dxs\n"
                                              "    static_configs:\n"
                                              "      - targets: ['"
                                           << absl::StrJoin(targets, "', '") << "']\n";
    for (int attempt = 0; attempt < 3; ++attempt) {  // the free port may be taken meanwhile
      port_ = testing::FreeLoopbackPort();
      absl::StatusOr<testing::ChildProcess> p = testing::SpawnAndWait(
          {kPrometheus, "--config.file=" + dir + "/prometheus.yml",
           "--storage.tsdb.path=" + dir + "/data",
           absl::StrCat("--web.listen-address=127.0.0.1:", port_), "--log.level=info"},
          "prometheus", dir + "/prometheus.log", "Server is ready to receive web requests",
          absl::Seconds(30));
      if (p.ok()) {
        process_ = *p;
        return absl::OkStatus();
      }
      if (attempt == 2) return p.status();
    }
    return absl::InternalError("unreachable");
  }

  // An instant query at `time` (now when unset): the first result's value, or -1 when the
  // result is empty; an error for a failed query.
  absl::StatusOr<double> Query(const std::string& promql,
                               std::optional<absl::Time> time = std::nullopt) const {
    std::string path = "/api/v1/query?query=" + testing::UrlEncode(promql);
    if (time)
      path += absl::StrFormat("&time=%.3f", absl::ToDoubleSeconds(*time - absl::UnixEpoch()));
    const auto [status, body] = testing::HttpGet(port_, path);
    if (status != 200) {
      return absl::UnavailableError(absl::StrCat("GET ", path, ": HTTP ", status, " ", body));
    }
    const nlohmann::json j = nlohmann::json::parse(body, nullptr, false);
    if (!j.is_object() || j.value("status", "") != "success") {
      return absl::InternalError(absl::StrCat(promql, ": ", body));
    }
    const nlohmann::json& result = j["data"]["result"];
    if (!result.is_array() || result.empty()) return -1.0;
    return std::stod(result[0]["value"][1].get<std::string>());
  }

  // The number of series an instant query returns (0: no data).
  absl::StatusOr<size_t> QuerySeries(const std::string& promql) const {
    const auto [status, body] =
        testing::HttpGet(port_, "/api/v1/query?query=" + testing::UrlEncode(promql));
    const nlohmann::json j = nlohmann::json::parse(body, nullptr, false);
    if (status != 200 || !j.is_object() || j.value("status", "") != "success") {
      return absl::InternalError(absl::StrCat(promql, ": HTTP ", status, " ", body));
    }
    return j["data"]["result"].size();
  }

  // Polls `promql` until its value satisfies `ok` or `timeout` passes; the last value.
  template <typename Pred>
  double PollUntil(const std::string& promql, Pred ok, absl::Duration timeout) const {
    const absl::Time deadline = absl::Now() + timeout;
    double value = -1;
    while (true) {
      absl::StatusOr<double> v = Query(promql);
      if (v.ok()) value = *v;
      if ((v.ok() && ok(value)) || absl::Now() > deadline) return value;
      absl::SleepFor(absl::Milliseconds(250));
    }
  }

  // Polls until Prometheus holds a sample of each of `series` (selectors of one series)
  // stamped at or after `t`, so that instant queries at `t` see every scrape up to it;
  // false if that has not happened within `timeout`.
  bool WaitForSamplesAfter(const std::vector<std::string>& series, absl::Time t,
                           absl::Duration timeout) const {
    const double t_seconds = absl::ToDoubleSeconds(t - absl::UnixEpoch());
    const absl::Time deadline = absl::Now() + timeout;
    while (true) {
      bool all = true;
      for (const std::string& s : series) {
        absl::StatusOr<double> stamped = Query("timestamp(" + s + ")");
        all = all && stamped.ok() && *stamped >= t_seconds;
      }
      if (all) return true;
      if (absl::Now() > deadline) return false;
      absl::SleepFor(absl::Milliseconds(250));
    }
  }

  std::string log() const { return testing::ReadFile(process_.log_path); }

 private:
  testing::ChildProcess process_;
  int port_ = 0;
};

// Greedy requests pinned to DP rank 0, one after another, until `stop`.
void PinnedLoad(v1::Frontend::Stub* frontend, const std::atomic<bool>* stop,
                std::atomic<int>* num_ok) {
  for (int i = 0; !*stop; ++i) {
    v1::GenerateRequest req;
    for (int j = 0; j < 4; ++j)
      req.add_prompt_token_ids(3 + (11 + 17 * i + 97 * j) % 4000);  // < vocab
    req.mutable_sampling_params()->set_max_new_tokens(8);
    req.mutable_sampling_params()->set_temperature(0.f);
    req.mutable_sampling_params()->set_ignore_eos(true);
    req.set_data_parallel_rank(0);
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
    auto reader = frontend->Generate(&ctx, req);
    v1::GenerateResponse resp;
    while (reader->Read(&resp)) {
    }
    if (reader->Finish().ok()) ++*num_ok;
  }
}

TEST(Prometheus, ScrapesTheClusterAndSeesAnIdleRankRunEmptySteps) {
  if (access(kPrometheus, X_OK) != 0) GTEST_SKIP() << kPrometheus << " not installed";
  TempDir tmp;
  const std::string dir = testing::WritePreset(tmp, "default");
  ProcessCluster cluster(tmp.path());
  absl::Status started = cluster.Start(ClusterSpec{dir, 2, 2, {}});
  ASSERT_TRUE(started.ok()) << started << cluster.DumpLogs();
  const std::vector<std::string> targets = cluster.metrics_addresses();
  ASSERT_EQ(targets.size(), 5u) << cluster.DumpLogs();

  PrometheusServer prometheus;
  absl::Status prometheus_started = prometheus.Start(tmp.path(), targets);
  ASSERT_TRUE(prometheus_started.ok()) << prometheus_started;
  const double up = prometheus.PollUntil(
      "count(up == 1)", [](double v) { return v == 5; }, kScrapeTimeout);
  ASSERT_EQ(up, 5) << prometheus.log();

  // Load through the front door: dxs bench spreads it over both DP ranks (no warm-up: the
  // router's request count below is exactly these 16 and the pinned ones).
  const std::string bench =
      absl::StrCat(cluster.bin("dxs"), " bench --router ", cluster.router_address(),
                   " --concurrency 4 --requests 16 --warmup-requests 0 --prompt-len 8 "
                   "--output-len 8 --format json > ",
                   tmp.path(), "/bench.json 2>&1");
  ASSERT_EQ(std::system(bench.c_str()), 0) << testing::ReadFile(tmp.path() + "/bench.json");
  const absl::Time bench_end = absl::Now();

  // Then only DP rank 0 gets requests. Once a scrape after the bench is stored (window
  // start), DP rank 1 sits idle, taking part in every step with an empty batch.
  std::atomic<bool> stop{false};
  std::atomic<int> pinned_ok{0};
  std::thread pinned(PinnedLoad, cluster.frontend(), &stop, &pinned_ok);
  absl::Cleanup stop_pinned = [&] {
    stop = true;
    if (pinned.joinable()) pinned.join();
  };
  auto at = [&](const std::string& q, absl::Time t) { return prometheus.Query(q, t).value_or(-1); };
  const std::string empty1 = R"(dxs_empty_batch_steps_total{role="attention",rank="1"})";
  const std::string steps1 = R"(dxs_steps_total{role="attention",rank="1"})";
  const std::string cluster_empty1 =
      R"(dxs_cluster_empty_batch_steps_total{role="attention",rank="1"})";
  const std::string empty_ranks = R"(dxs_cluster_empty_ranks{role="attention"})";
  const std::vector<std::string> window_series = {empty1, steps1, cluster_empty1, empty_ranks};
  ASSERT_TRUE(prometheus.WaitForSamplesAfter(window_series, bench_end, kScrapeTimeout))
      << "no scrape after the bench within " << kScrapeTimeout << "\n"
      << prometheus.log();
  const absl::Time window_start = absl::Now();
  // Window end: the first time (tried every 250 ms) whose scrapes are all stored and show,
  // since the window start, DP rank 1's empty steps growing on the worker and in the
  // router's view, and the router counting it among the empty ranks.
  absl::Time window_end;
  bool grew = false;
  const absl::Time give_up = window_start + kScrapeTimeout;
  while (!grew && absl::Now() < give_up) {
    absl::SleepFor(absl::Milliseconds(250));
    window_end = absl::Now();
    if (!prometheus.WaitForSamplesAfter(window_series, window_end, give_up - absl::Now())) break;
    grew = at(empty1, window_end) > at(empty1, window_start) &&
           at(cluster_empty1, window_end) > at(cluster_empty1, window_start) &&
           at(empty_ranks, window_end) >= 1;
  }
  EXPECT_TRUE(grew) << "DP rank 1's empty steps did not show growing within " << kScrapeTimeout;
  std::move(stop_pinned).Invoke();
  EXPECT_GT(pinned_ok.load(), 0);

  // Requests are counted: the bench's 16 and the pinned ones, all OK.
  const double requests = prometheus.PollUntil(
      "sum(dxs_requests_total)", [&](double v) { return v >= 16 + pinned_ok; }, kScrapeTimeout);
  EXPECT_EQ(requests, 16 + pinned_ok.load());
  EXPECT_EQ(prometheus.Query(R"(sum(dxs_requests_total{code="OK"}))").value_or(-1), requests);
  EXPECT_EQ(prometheus.Query("sum(dxs_request_errors_total)").value_or(-1), 0);
  // Dispatch latency has samples on both DP ranks (empty dispatches count too).
  EXPECT_GT(prometheus.Query(R"(dxs_dispatch_latency_seconds_count{rank="0"})").value_or(-1), 0);
  EXPECT_GT(prometheus.Query(R"(dxs_dispatch_latency_seconds_count{rank="1"})").value_or(-1), 0);
  EXPECT_GT(prometheus.Query("sum(dxs_time_to_first_token_seconds_count)").value_or(-1), 0);
  EXPECT_GT(prometheus.Query("sum(dxs_tokens_received_total)").value_or(-1), 0);
  // The load-balancing series: the balance ratio (per dispatch and the router's), the
  // placement version and the expert copies per EP rank (16 experts, no replicas).
  EXPECT_GT(prometheus.Query(R"(dxs_ep_balance_ratio_count{rank="0"})").value_or(-1), 0);
  EXPECT_GT(prometheus.Query("dxs_cluster_ep_balance_ratio").value_or(-1), 0);
  EXPECT_GT(prometheus.Query("dxs_placement_version").value_or(-1), 0);
  EXPECT_EQ(prometheus.Query("sum(dxs_placement_experts)").value_or(-1), 16);
  EXPECT_EQ(prometheus.Query("sum(dxs_placement_replicas)").value_or(-1), 0);

  // Over the idle window, DP rank 1's empty-batch steps grew and were all of its steps.
  const double empty_grew = at(empty1, window_end) - at(empty1, window_start);
  EXPECT_GT(empty_grew, 0) << "empty steps " << at(empty1, window_start) << " -> "
                           << at(empty1, window_end);
  // (A scrape may fall between the two counters' updates of the one step in progress.)
  EXPECT_NEAR(at(steps1, window_end) - at(steps1, window_start), empty_grew, 1);
  // The router's cluster-wide view shows it too, from heartbeats.
  EXPECT_GT(at(cluster_empty1, window_end) - at(cluster_empty1, window_start), 0);
  EXPECT_GE(at(empty_ranks, window_end), 1);
  // increase() over a range that reaches back past the sample the window starts from (by
  // three scrape intervals), so that it holds that sample and the one at the window end.
  const double start_sample = at("timestamp(" + empty1 + ")", window_start);
  const int range_seconds =
      static_cast<int>(
          std::ceil(absl::ToDoubleSeconds(window_end - absl::UnixEpoch()) - start_sample)) +
      3;
  EXPECT_GT(at(absl::StrCat("increase(", empty1, "[", range_seconds, "s])"), window_end), 0)
      << "over " << range_seconds << " s";

  // Every panel of the Grafana dashboard returns data from this Prometheus, with the
  // dashboard's variables set to match everything (deploy/grafana/README.md); but the SMG
  // gateway's (queries on smg_* series): no gateway runs in this cluster.
  // deploy/k8s/validate.py checks their names against those smg exposes.
  std::ifstream dashboard_file(testing::SourceDir() + "/deploy/grafana/dxs-dashboard.json");
  ASSERT_TRUE(dashboard_file.good()) << "deploy/grafana/dxs-dashboard.json";
  const nlohmann::json dashboard = nlohmann::json::parse(dashboard_file);
  int num_queries = 0;
  for (const nlohmann::json& panel : dashboard.at("panels")) {
    if (!panel.contains("targets")) continue;
    for (const nlohmann::json& target : panel.at("targets")) {
      std::string expr = target.value("expr", "");
      if (expr.empty() || expr.find("smg_") != std::string::npos) continue;
      for (const char* var : {"$namespace", "$model"}) {
        for (size_t at_pos; (at_pos = expr.find(var)) != std::string::npos;) {
          expr.replace(at_pos, std::string(var).size(), ".*");
        }
      }
      ++num_queries;
      absl::StatusOr<size_t> series = prometheus.QuerySeries(expr);
      ASSERT_TRUE(series.ok()) << panel.value("title", "") << ": " << series.status();
      EXPECT_GT(*series, 0u) << "panel '" << panel.value("title", "") << "' has no data: " << expr;
    }
  }
  EXPECT_GE(num_queries, 10);

  if (HasFailure()) std::cerr << cluster.DumpLogs() << "\n--- prometheus ---\n" << prometheus.log();
}

}  // namespace
}  // namespace dxs
