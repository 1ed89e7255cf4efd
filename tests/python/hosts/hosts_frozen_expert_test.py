#!/usr/bin/env python3
"""hosts_frozen_expert: an expert worker stopped with SIGSTOP (a process that hangs but holds
its connections), then continued with SIGCONT.

The cluster of hosts_equivalence (router, 2 attention and 3 expert ranks, each on its own
simulated host, and a client host). Expert rank 1 is frozen (hosts_lib.freeze) while
requests are in flight, then thawed.

What dxs does with the thawed process: it rejoins. Its router lease ran out while it was
frozen, so the router has its incarnation DEAD; on SIGCONT its next heartbeat is answered
NOT_FOUND (a stale incarnation) and it registers again, as a new incarnation of the same
rank, from the same process (worker/worker_membership.cc). Meanwhile its step thread
finishes the round it was frozen in and sends that round's combine: a late answer of the
stale incarnation. The attention ranks refuse it: their step failed (or ran again without
the rank) and cancelled its receives, and every round's data travels under a tag of its
(step, layer, micro-batch) with step numbers that only grow, so no later receive can match
it (dataplane/dispatch/wire.h ExchangeTag).

Promises, without replicas (HostsFrozenExpert):
- Detected within the step timeout (5 s): 8 in-flight streams (each as long as the context
  allows, each having streamed 2 tokens when the process is frozen) all end with
  UNAVAILABLE within 5 s of the SIGSTOP, as for a partition; a new request is refused with
  UNAVAILABLE within 5 s while it is frozen.
- After SIGCONT: rank 1 is READY again with a new incarnation within 60 s, from the same
  process (never restarted); the cluster serves again, and 24 requests (3 rounds of 8
  concurrent) all equal the single-process engine: the late answers corrupted nothing.
Promises, with every expert replicated (HostsFrozenExpertReplicas, `--elastic-ep
--num-redundant-experts 16`): 8 streams of requests one after another across the freeze,
the rank's DEAD and the placement without it, the thaw, its rejoin and rebalance, and 8
requests after that: 0 failed, every request's tokens equal the single-process engine's,
none lost or answered twice.
Figures printed for docs/benchmarks.md.

Skipped (exit 77) where the machine cannot make network namespaces.

    .venv/bin/python3 tests/python/hosts/hosts_frozen_expert_test.py --bin-dir build/bin
"""
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import hosts_cluster  # noqa: E402
import hosts_lib  # noqa: E402

IN_FLIGHT = 8
CONTEXT = 4096
VICTIM = 1
DETECT_BOUND_S = 5.0  # the step timeout, and the product's promise for a dead expert
REFUSE_BOUND_S = 5.0
RECOVER_BOUND_S = 60.0


def rejoined(c, before):
    def check():
        s = c.status()
        w = s and c.worker("expert", VICTIM, s)
        return (w and w["state"] == "READY" and w["incarnation"] != before["incarnation"]
                and c.experts_of(VICTIM, s) and time.monotonic())
    return check


class HostsFrozenExpert(hosts_cluster.ClusterTest):
    PREFIX = "dxs_hosts_frozen_expert_"

    def test_frozen_expert_fails_in_flight_then_rejoins_without_corruption(self):
        c = self.cluster
        proc = c.procs["expert%d" % VICTIM]
        before = c.worker("expert", VICTIM)
        spec = [{"prompt": [11 + i, 7, 300], "max_new_tokens": CONTEXT - 3, "ignore_eos": True}
                for i in range(IN_FLIGHT)]
        run = c.start_client(spec, timeout=300)
        try:
            hosts_lib.wait_for(
                lambda: sum(1 for n in run.snapshot_tokens().values() if n >= 2) == IN_FLIGHT,
                120, "2 tokens streamed on each of the %d requests" % IN_FLIGHT)
            c.hosts.freeze(proc)
            frozen_at = time.monotonic()
            run.wait_all(60)
        finally:
            run.kill()
        _, ends, _ = run.snapshot()
        first_fail = min(e["t"] for e in ends.values()) - frozen_at
        codes = {i: e["code"] for i, e in ends.items()}
        self.assertEqual(codes, {i: "UNAVAILABLE" for i in range(IN_FLIGHT)},
                         "in-flight requests: %s\n%s" % (ends, c.logs()))
        detect = max(e["t"] for e in ends.values()) - frozen_at
        self.assertLessEqual(detect, DETECT_BOUND_S, "in-flight requests failed too late")

        sent = time.monotonic()
        refused = c.generate_all([{"prompt": [5, 6, 7], "max_new_tokens": 4}], seconds=10)[0]
        self.assertEqual(refused["code"], "UNAVAILABLE", refused)
        self.assertLessEqual(refused["t"] - sent, REFUSE_BOUND_S, refused)
        w = c.worker("expert", VICTIM)
        self.assertEqual((w["state"], w["incarnation"]), ("DEAD", before["incarnation"]),
                         "%s\n%s" % (w, c.logs()))

        c.hosts.thaw(proc)
        thawed_at = time.monotonic()
        back_at = hosts_lib.wait_for(rejoined(c, before), RECOVER_BOUND_S,
                                     "rank %d READY again as a new incarnation" % VICTIM)
        self.assertTrue(proc.alive(), "the thawed expert exited:\n" + proc.log())
        probe = {"prompt": [1, 2, 3], "max_new_tokens": 8}

        def serves():
            end = c.generate_all([probe], seconds=10)[0]
            return end["code"] == "OK" and end
        first_ok = hosts_lib.wait_for(serves, RECOVER_BOUND_S, "a successful request after "
                                      "the thaw", interval=0.2)
        recover = first_ok["t"] - thawed_at
        after = [{"prompt": [40 + i, 2, 9, 17 + r], "max_new_tokens": 12}
                 for r in range(3) for i in range(IN_FLIGHT)]
        want = [hosts_cluster.reference_tokens(c.dxs, self.model, s["prompt"], s["max_new_tokens"])
                for s in after]
        for r in range(3):
            ends = c.generate_all(after[r * IN_FLIGHT:(r + 1) * IN_FLIGHT], seconds=120)
            for i in range(IN_FLIGHT):
                self.assertEqual(ends[i]["code"], "OK", "%s\n%s" % (ends[i], c.logs()))
                self.assertEqual(ends[i]["tokens"], want[r * IN_FLIGHT + i],
                                 "request %d of round %d after the thaw" % (i, r))
        self.assertIn("registering again", proc.log())
        self.assertTrue(proc.alive(), "the thawed expert exited")
        print("hosts_frozen_expert: %d in-flight requests failed UNAVAILABLE %.2f-%.2f s after "
              "SIGSTOP; refused while frozen in %.2f s; after SIGCONT rank %d READY as a new "
              "incarnation (%d -> %d, same pid) in %.2f s, first success %.2f s; %d requests "
              "after it equal the single-process engine"
              % (IN_FLIGHT, first_fail, detect,
                 refused["t"] - sent, VICTIM, before["incarnation"],
                 c.worker("expert", VICTIM)["incarnation"], back_at - thawed_at, recover,
                 len(after)), flush=True)


class HostsFrozenExpertReplicas(hosts_cluster.ClusterTest):
    PREFIX = "dxs_hosts_frozen_expert_r_"
    ROUTER_ARGS = ["--elastic-ep", "--num-redundant-experts", "16"]

    def test_no_request_fails_across_freeze_and_thaw_of_a_replicated_expert(self):
        c = self.cluster
        proc = c.procs["expert%d" % VICTIM]
        streams = [[{"prompt": [30 + s, 5 + j, 200 + s * 3 + j], "max_new_tokens": 8 + (s + j) % 9}
                    for j in range(2)] for s in range(IN_FLIGHT)]
        want = [[hosts_cluster.reference_tokens(c.dxs, self.model, r["prompt"],
                                                r["max_new_tokens"]) for r in reqs]
                for reqs in streams]
        before = c.worker("expert", VICTIM)
        load = c.start_load(streams, timeout=60)
        try:
            hosts_lib.wait_for(lambda: len(load.ok_after(0)) >= IN_FLIGHT, 60,
                               "%d requests served before the freeze" % IN_FLIGHT)
            c.hosts.freeze(proc)
            frozen_at = time.monotonic()

            def placed_without_victim():
                s = c.status()
                w = s and c.worker("expert", VICTIM, s)
                return (w and w["state"] == "DEAD" and not c.experts_of(VICTIM, s)
                        and time.monotonic())
            detected_at = hosts_lib.wait_for(placed_without_victim, 60,
                                             "rank %d DEAD and placed around" % VICTIM)
            hosts_lib.wait_for(lambda: len(load.ok_after(detected_at)) >= IN_FLIGHT, 60,
                               "%d requests served while frozen" % IN_FLIGHT)
            c.hosts.thaw(proc)
            thawed_at = time.monotonic()
            back_at = hosts_lib.wait_for(rejoined(c, before), RECOVER_BOUND_S,
                                         "rank %d back READY, holding experts" % VICTIM)
            hosts_lib.wait_for(lambda: len(load.ok_after(back_at)) >= IN_FLIGHT, 60,
                               "%d requests served after the rejoin" % IN_FLIGHT)
        finally:
            ends = load.stop()
        ok, failed = hosts_cluster.check_load_ends(ends, streams, want)
        stall = max([e["t"] - e["t0"] for e in ends
                     if e["t0"] <= detected_at and e["t"] >= frozen_at] or [0])
        print("hosts_frozen_expert_replicas: %d requests sent, %d failed %s; rank %d DEAD and "
              "placed around %.2f s after SIGSTOP (longest request across it %.2f s); after "
              "SIGCONT READY as a new incarnation, holding experts, in %.2f s; tokens equal the "
              "single-process engine in all %d OK requests"
              % (len(ends), len(failed), sorted(set(e["code"] for e in failed)), VICTIM,
                 detected_at - frozen_at, stall, back_at - thawed_at, len(ok)), flush=True)
        self.assertEqual(failed, [], "failed requests\n" + c.logs())
        self.assertLessEqual(detected_at - frozen_at, DETECT_BOUND_S + 5)
        self.assertTrue(proc.alive(), "the thawed expert exited")


if __name__ == "__main__":
    hosts_cluster.main()
