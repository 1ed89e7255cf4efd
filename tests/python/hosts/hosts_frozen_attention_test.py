#!/usr/bin/env python3
"""hosts_frozen_attention: an attention worker stopped with SIGSTOP under load.

The cluster of hosts_equivalence (router, 2 attention and 3 expert ranks, each on its own
simulated host, and a client host). Attention rank 0 is frozen (hosts_lib.freeze) while 8
long requests stream (ignore_eos, 400 new tokens, spread over both DP ranks by the router)
and 8 more streams send short requests one after another.

Promises:
- The frozen rank's in-flight streams end with UNAVAILABLE naming the lost attention rank
  within 5 s of the SIGSTOP (its lease, 3 s, then the router stops them).
- The router stops sending it requests: requests sent once it is DEAD all go to rank 1 and
  succeed.
- The other DP rank keeps serving: every request that rank 1 holds or is sent succeeds with
  the single-process engine's tokens; the lockstep step exchange and the expert ranks stop
  waiting for the frozen rank (no deadlock, no step timeout on rank 1).
- After SIGCONT rank 0 rejoins as a new incarnation of the same process (the router had
  stopped its requests; the thawed process, seeing itself DEAD, runs no step until it has
  registered again), and requests succeed on both ranks again: 4 requests pinned to rank 0
  (data_parallel_rank) beside the load, all with the single-process engine's tokens.
Figures printed for docs/benchmarks.md.

Skipped (exit 77) where the machine cannot make network namespaces.
"""
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import hosts_cluster  # noqa: E402
import hosts_lib  # noqa: E402

LONG = 8
STREAMS = 8
LONG_TOKENS = 400
DETECT_BOUND_S = 5.0


class HostsFrozenAttention(hosts_cluster.ClusterTest):
    PREFIX = "dxs_hosts_frozen_attn_"

    def test_the_other_dp_rank_keeps_serving(self):
        c = self.cluster
        proc = c.procs["attention0"]
        before = c.worker("attention", 0)
        long_spec = [{"prompt": [11 + i, 7, 300], "max_new_tokens": LONG_TOKENS,
                      "ignore_eos": True} for i in range(LONG)]
        long_want = [hosts_cluster.reference_tokens(c.dxs, self.model, s["prompt"],
                                                    s["max_new_tokens"], ignore_eos=True)
                     for s in long_spec]
        streams = [[{"prompt": [30 + s, 5 + j, 200 + s * 3 + j], "max_new_tokens": 8 + (s + j) % 9}
                    for j in range(2)] for s in range(STREAMS)]
        want = [[hosts_cluster.reference_tokens(c.dxs, self.model, r["prompt"],
                                                r["max_new_tokens"]) for r in reqs]
                for reqs in streams]
        run = c.start_client(long_spec, timeout=300)
        load = c.start_load(streams, timeout=60)
        try:
            hosts_lib.wait_for(
                lambda: sum(1 for n in run.snapshot_tokens().values() if n >= 2) == LONG,
                120, "2 tokens streamed on each of the %d long requests" % LONG)
            c.hosts.freeze(proc)
            frozen_at = time.monotonic()

            def dead():
                w = c.worker("attention", 0)
                return w and w["state"] == "DEAD" and time.monotonic()
            dead_at = hosts_lib.wait_for(dead, 60, "attention rank 0 DEAD")
            hosts_lib.wait_for(lambda: len(load.ok_after(dead_at)) >= 2 * STREAMS, 60,
                               "%d requests served by rank 1 while rank 0 is frozen"
                               % (2 * STREAMS))
            run.wait_all(120)
            c.hosts.thaw(proc)
            thawed_at = time.monotonic()

            def rejoined():
                w = c.worker("attention", 0)
                return (w and w["state"] == "READY" and w["incarnation"] != before["incarnation"]
                        and time.monotonic())
            back_at = hosts_lib.wait_for(rejoined, 60, "attention rank 0 READY again")
            hosts_lib.wait_for(lambda: len(load.ok_after(back_at)) >= 2 * STREAMS, 60,
                               "%d requests served after the rejoin" % (2 * STREAMS))
            # The rejoined rank serves again (its requests pinned to it), beside the load.
            pinned = [{"prompt": [60 + i, 4, 8], "max_new_tokens": 10, "dp_rank": 0}
                      for i in range(4)]
            pinned_want = [hosts_cluster.reference_tokens(c.dxs, self.model, p["prompt"],
                                                          p["max_new_tokens"]) for p in pinned]
            pinned_ends = c.generate_all(pinned, seconds=60)
        finally:
            run.kill()
            ends = load.stop()
        _, long_ends, _ = run.snapshot()
        lost = {i: e for i, e in long_ends.items() if e["code"] != "OK"}
        for i, e in lost.items():
            self.assertEqual(e["code"], "UNAVAILABLE", e)
            self.assertIn("attention rank 0", e["details"], e)
            self.assertLessEqual(e["t"] - frozen_at, DETECT_BOUND_S, e)
        for i, e in long_ends.items():
            if e["code"] == "OK":
                self.assertEqual(e["tokens"], long_want[i], "long request %d" % i)
        self.assertGreater(len(lost), 0, "no long request was on rank 0")
        self.assertLess(len(lost), LONG, "no long request was on rank 1")
        for i in range(len(pinned)):
            self.assertEqual(pinned_ends[i]["code"], "OK", pinned_ends[i])
            self.assertEqual(pinned_ends[i]["tokens"], pinned_want[i], "pinned request %d" % i)
        ok, failed = hosts_cluster.check_load_ends(ends, streams, want)
        # Short requests in flight on rank 0 when it froze fail like the long ones; none sent
        # after it was DEAD may fail.
        for e in failed:
            self.assertEqual(e["code"], "UNAVAILABLE", e)
            self.assertLess(e["t0"], dead_at, "a request sent after rank 0 was DEAD failed: %s"
                            % e)
        print("hosts_frozen_attention: %d requests sent (%d long, %d short), %d failed "
              "UNAVAILABLE (the frozen rank's, %.2f-%.2f s after SIGSTOP); rank 0 DEAD %.2f s "
              "after SIGSTOP; after SIGCONT READY as a new incarnation in %.2f s; tokens equal "
              "the single-process engine in all %d OK requests"
              % (LONG + len(ends), LONG, len(ends), len(lost) + len(failed),
                 min(e["t"] for e in list(lost.values()) + failed) - frozen_at,
                 max(e["t"] for e in list(lost.values()) + failed) - frozen_at,
                 dead_at - frozen_at, back_at - thawed_at,
                 len(ok) + LONG - len(lost)), flush=True)


if __name__ == "__main__":
    hosts_cluster.main()
