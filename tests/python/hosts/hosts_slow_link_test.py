#!/usr/bin/env python3
"""hosts_slow_link: one expert host's link capped far below the others' (tc tbf): nothing
fails, and the per-EP-rank answer times name that rank as the straggler.

The cluster of hosts_equivalence (router, 2 attention and 3 expert ranks, each on its own
simulated host, and a client host). Expert rank 1's link is capped at 4 mbit/s both ways
(hosts_lib.limit_rate: a tbf qdisc on each end of its veth); the other links are uncapped
veths (several Gbit/s), so it is a small fraction of theirs. Load: 8 streams sending greedy
requests one after another, each with a 60 s deadline, before, during and after the cap.

Promises:
- Nothing fails: every request ends OK with the single-process engine's tokens (at least 16
  of them sent while the cap is on, and 8 after it is lifted), none lost or answered twice.
- The attention workers' new metrics show rank 1 as the straggler over the capped window
  (deltas of two scrapes of each attention worker, the window's requests in between):
  dxs_ep_slowest_rounds_total{ep_rank="1"} grew by more than half of all rounds' growth,
  and rank 1's mean dxs_ep_answer_seconds exceeds each other rank's.
Figures printed for docs/benchmarks.md (requests, the ranks' mean answer times and rank 1's
share of slowest rounds).

Skipped (exit 77) where the machine cannot make network namespaces.
"""
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import hosts_cluster  # noqa: E402
import hosts_lib  # noqa: E402

STREAMS = 8
SLOW = 1
RATE = "4mbit"


class HostsSlowLink(hosts_cluster.ClusterTest):
    PREFIX = "dxs_hosts_slow_link_"

    def straggler_counters(self):
        """Per EP rank, summed over the attention workers: (slowest rounds, answer seconds
        sum, answer count)."""
        c = self.cluster
        out = {r: [0.0, 0.0, 0.0] for r in range(c.n)}
        for h in c.attention_hosts:
            text = c.scrape(h)
            for r in range(c.n):
                labels = {"ep_rank": str(r)}
                for k, name in enumerate(("dxs_ep_slowest_rounds_total",
                                          "dxs_ep_answer_seconds_sum",
                                          "dxs_ep_answer_seconds_count")):
                    v = hosts_cluster.metric(text, name, labels)
                    self.assertIsNotNone(v, "%s{ep_rank=%d} missing on %s" % (name, r, h.ns))
                    out[r][k] += v
        return out

    def test_nothing_fails_and_the_slow_rank_is_named(self):
        c = self.cluster
        streams = [[{"prompt": [30 + s, 5 + j, 200 + s * 3 + j], "max_new_tokens": 8 + (s + j) % 9}
                    for j in range(2)] for s in range(STREAMS)]
        want = [[hosts_cluster.reference_tokens(c.dxs, self.model, r["prompt"],
                                                r["max_new_tokens"]) for r in reqs]
                for reqs in streams]
        load = c.start_load(streams, timeout=60)
        try:
            hosts_lib.wait_for(lambda: len(load.ok_after(0)) >= STREAMS, 60,
                               "%d requests served before the cap" % STREAMS)
            c.hosts.limit_rate(c.expert_hosts[SLOW].index, rate=RATE)
            capped_at = time.monotonic()
            before = self.straggler_counters()
            hosts_lib.wait_for(lambda: len(load.ok_after(capped_at)) >= 2 * STREAMS, 120,
                               "%d requests served under the cap" % (2 * STREAMS))
            after = self.straggler_counters()
            c.hosts.unlimit_rate(c.expert_hosts[SLOW].index)
            lifted_at = time.monotonic()
            hosts_lib.wait_for(lambda: len(load.ok_after(lifted_at)) >= STREAMS, 60,
                               "%d requests served after the cap" % STREAMS)
        finally:
            ends = load.stop()
        ok, failed = hosts_cluster.check_load_ends(ends, streams, want)
        self.assertEqual(failed, [], "failed requests\n" + c.logs())
        delta = {r: [after[r][k] - before[r][k] for k in range(3)] for r in range(c.n)}
        rounds = sum(d[0] for d in delta.values())
        self.assertGreater(rounds, 0, "no round with two or more EP ranks under the cap")
        share = delta[SLOW][0] / rounds
        mean = {r: (d[1] / d[2] if d[2] else 0.0) for r, d in delta.items()}
        during = [e for e in ends if e["t0"] >= capped_at and e["t"] <= lifted_at]
        print("hosts_slow_link: %d requests sent, %d failed; %d under the %s cap on EP rank %d "
              "(longest %.2f s); rank %d answered last in %.0f%% of %d rounds; mean answer "
              "time per EP rank under the cap: %s; tokens equal the single-process engine in "
              "all %d OK requests"
              % (len(ends), len(failed), len(during), RATE, SLOW,
                 max([e["t"] - e["t0"] for e in during] or [0]), SLOW, 100 * share, rounds,
                 ", ".join("%d: %.2f ms" % (r, 1e3 * m) for r, m in sorted(mean.items())),
                 len(ok)), flush=True)
        self.assertGreater(share, 0.5, "rank %d is not named the straggler: %s" % (SLOW, delta))
        for r in range(c.n):
            if r != SLOW:
                self.assertGreater(mean[SLOW], mean[r], "answer times: %s" % mean)


if __name__ == "__main__":
    hosts_cluster.main()
