#!/usr/bin/env python3
"""hosts_router_restart: the router killed (SIGKILL) under load and started again on its
address.

The cluster of hosts_equivalence (router on host 0, 2 attention and 3 expert ranks, each on
its own simulated host, and a client host). Load: 8 streams sending short greedy requests
one after another (each with a 30 s deadline), and 4 long requests (ignore_eos, as long as
the context allows) streaming when the router is killed. A new router process is started
on the same address at once.

What happens: the router relays every stream, so the streams in flight end with
UNAVAILABLE; the attention workers see their router streams end and stop those requests
(their KV is freed). The workers keep running: their heartbeats and watches fail while no
router answers, then the new router answers NOT_FOUND and each registers again, under an
incarnation of the new router (which starts its incarnations, view and placement versions at
its start time's microseconds, above any of its predecessor's: cluster_registry.h).

Promises:
- In flight: the 4 long streams end with UNAVAILABLE within 5 s of the kill.
- No worker restarts: every worker process lives on; each is READY in the new router's view
  under a new incarnation.
- New requests succeed within 5 s of the new router answering.
- No request is answered twice or lost without an error: every stream's requests end once
  each, in order; every failed one failed UNAVAILABLE and was sent before the new router
  served its first request; every OK one equals the single-process engine's tokens.
- Afterwards no attention rank holds a request (the old router's were stopped).
Figures printed for docs/benchmarks.md.

Skipped (exit 77) where the machine cannot make network namespaces.
"""
import os
import signal
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import hosts_cluster  # noqa: E402
import hosts_lib  # noqa: E402

STREAMS = 8
LONG = 4
CONTEXT = 4096
DETECT_BOUND_S = 5.0
RECOVER_BOUND_S = 5.0


class HostsRouterRestart(hosts_cluster.ClusterTest):
    PREFIX = "dxs_hosts_router_restart_"

    def test_workers_register_again_and_service_resumes(self):
        c = self.cluster
        before = {(w["role"], w["rank"]): w["incarnation"] for w in c.status()["workers"]}
        pids = {name: p.pid for name, p in c.procs.items() if name != "router"}
        streams = [[{"prompt": [30 + s, 5 + j, 200 + s * 3 + j], "max_new_tokens": 8 + (s + j) % 9}
                    for j in range(2)] for s in range(STREAMS)]
        want = [[hosts_cluster.reference_tokens(c.dxs, self.model, r["prompt"],
                                                r["max_new_tokens"]) for r in reqs]
                for reqs in streams]
        long_spec = [{"prompt": [11 + i, 7, 300], "max_new_tokens": CONTEXT - 3,
                      "ignore_eos": True} for i in range(LONG)]
        long_run = c.start_client(long_spec, timeout=300)
        load = c.start_load(streams, timeout=30)
        try:
            hosts_lib.wait_for(
                lambda: sum(1 for n in long_run.snapshot_tokens().values() if n >= 2) == LONG
                and len(load.ok_after(0)) >= STREAMS,
                120, "the long requests streaming and %d short ones served" % STREAMS)
            old = c.procs["router"]
            os.kill(old.pid, signal.SIGKILL)
            killed_at = time.monotonic()
            old.popen.wait(timeout=30)
            c.start_router()
            hosts_lib.wait_for(lambda: c.status() is not None, 60, "the new router answering")
            back_at = time.monotonic()
            long_run.wait_all(60)
            first_ok = hosts_lib.wait_for(
                lambda: min([e["t"] for e in load.ok_after(back_at)] or [0]), 60,
                "a request served by the new router")
            hosts_lib.wait_for(lambda: len(load.ok_after(first_ok)) >= 2 * STREAMS, 60,
                               "%d requests served after the restart" % (2 * STREAMS))
        finally:
            long_run.kill()
            ends = load.stop()
        _, long_ends, _ = long_run.snapshot()
        for i, e in long_ends.items():
            self.assertEqual(e["code"], "UNAVAILABLE", e)
            self.assertLessEqual(e["t"] - killed_at, DETECT_BOUND_S, e)
        ok, failed = hosts_cluster.check_load_ends(ends, streams, want)
        for e in failed:
            self.assertEqual(e["code"], "UNAVAILABLE", e)
            self.assertLess(e["t0"], first_ok, "a request failed after service resumed: %s" % e)
        recover = first_ok - back_at
        self.assertLessEqual(recover, RECOVER_BOUND_S, "first success %.2f s after the new "
                             "router answered" % recover)
        for name, pid in pids.items():
            self.assertEqual(c.procs[name].pid, pid)
            self.assertTrue(c.procs[name].alive(), "%s exited:\n%s" % (name, c.procs[name].log()))
        # READY comes with each worker's next heartbeat after it registered again.
        s = hosts_lib.wait_for(
            lambda: (lambda st: st and len(st["workers"]) == c.m + c.n and all(
                w["state"] == "READY" for w in st["workers"]) and st)(c.status()),
            30, "every worker READY in the new router's view")
        for w in s["workers"]:
            self.assertGreater(w["incarnation"], before[(w["role"], w["rank"])], w)
        hosts_lib.wait_for(lambda: all(l["running"] == 0 and l["queued"] == 0
                                       for l in (c.status() or {"loads": [{"running": 1}]})["loads"]),
                           30, "no request left on any attention rank")
        print("hosts_router_restart: %d requests sent (%d long, %d short), %d failed "
              "UNAVAILABLE (in flight or sent while no router answered; long ones %.2f-%.2f s "
              "after SIGKILL); the new router answered %.2f s after the kill, first success "
              "%.2f s after that; no worker restarted, all READY under new incarnations; tokens "
              "equal the single-process engine in all %d OK requests"
              % (LONG + len(ends), LONG, len(ends), LONG + len(failed),
                 min(e["t"] for e in long_ends.values()) - killed_at,
                 max(e["t"] for e in long_ends.values()) - killed_at, back_at - killed_at,
                 recover, len(ok)), flush=True)


if __name__ == "__main__":
    hosts_cluster.main()
