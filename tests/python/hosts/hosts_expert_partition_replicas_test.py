#!/usr/bin/env python3
"""hosts_expert_partition_replicas: an expert host cut off the network while every expert
has a replica on another rank (elastic EP): no request fails.

The cluster of hosts_equivalence (router, 2 attention and 3 expert ranks, each on its own
simulated host, and a client host), the router started with `--elastic-ep
--num-redundant-experts 16`: every one of the 16 experts is held by two EP ranks. Load: 8
streams, each sending greedy requests (8-16 new tokens) one after another, each with a 60 s
deadline, until the test stops them. The bridge's port to expert rank 1's host goes down
(hosts_lib.partition: frames dropped, nothing closed) and later comes back up.

Promises:
- No request fails, before, during or after the partition: 0 requests end with an error
  (an attention rank whose step waits on the cut-off rank runs the step again once the
  router's view has the rank DEAD and a placement without it; router/control_plane/README.md,
  elastic EP), and every request's tokens equal the single-process engine's (`dxs run`).
  No request is lost or answered twice: every stream's requests end once each, in order.
- Detection: the router has rank 1 DEAD and a placement without it within 10 s of the
  partition (its lease is 3 s); requests sent after that succeed (at least 8 of them) while
  the link is still down.
- Recovery: after the heal, rank 1 registers again (a new incarnation, READY; its process
  never restarted) within 60 s and is rebalanced onto (holds experts again); 8 more
  requests sent after that succeed.
- Figures printed: requests sent, failed, the longest request during the partition (the
  stall), time to detect (partition to the placement without rank 1), time to recover (heal
  to rank 1 holding experts again).

Skipped (exit 77) where the machine cannot make network namespaces.

    .venv/bin/python3 tests/python/hosts/hosts_expert_partition_replicas_test.py --bin-dir build/bin
"""
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import hosts_cluster  # noqa: E402
import hosts_lib  # noqa: E402

STREAMS = 8
VICTIM = 1
DETECT_BOUND_S = 10.0
RECOVER_BOUND_S = 60.0


class HostsExpertPartitionReplicas(hosts_cluster.ClusterTest):
    PREFIX = "dxs_hosts_replicas_"
    ROUTER_ARGS = ["--elastic-ep", "--num-redundant-experts", "16"]

    def test_no_request_fails_while_a_replicated_expert_host_is_cut_off(self):
        c = self.cluster
        streams = [[{"prompt": [30 + s, 5 + j, 200 + s * 3 + j], "max_new_tokens": 8 + (s + j) % 9}
                    for j in range(2)] for s in range(STREAMS)]
        want = [[hosts_cluster.reference_tokens(c.dxs, self.model, r["prompt"],
                                                r["max_new_tokens"]) for r in reqs]
                for reqs in streams]
        before = c.worker("expert", VICTIM)
        self.assertEqual(before["state"], "READY", before)
        load = c.start_load(streams, timeout=60)
        try:
            hosts_lib.wait_for(lambda: len(load.ok_after(0)) >= STREAMS, 60,
                               "%d requests served before the partition" % STREAMS)
            c.hosts.partition(c.expert_hosts[VICTIM].index)
            partitioned_at = time.monotonic()

            def placed_without_victim():
                s = c.status()
                w = s and c.worker("expert", VICTIM, s)
                return (w and w["state"] == "DEAD" and not c.experts_of(VICTIM, s)
                        and time.monotonic())
            detected_at = hosts_lib.wait_for(placed_without_victim, 60,
                                             "rank %d DEAD and placed around" % VICTIM)
            detect = detected_at - partitioned_at
            hosts_lib.wait_for(lambda: len(load.ok_after(detected_at)) >= STREAMS, 60,
                               "%d requests served during the partition" % STREAMS)
            c.hosts.heal(c.expert_hosts[VICTIM].index)
            healed_at = time.monotonic()

            def rejoined():
                s = c.status()
                w = s and c.worker("expert", VICTIM, s)
                return (w and w["state"] == "READY" and w["incarnation"] != before["incarnation"]
                        and c.experts_of(VICTIM, s) and time.monotonic())
            rejoined_at = hosts_lib.wait_for(rejoined, RECOVER_BOUND_S,
                                             "rank %d back READY, holding experts" % VICTIM)
            recover = rejoined_at - healed_at
            hosts_lib.wait_for(lambda: len(load.ok_after(rejoined_at)) >= STREAMS, 60,
                               "%d requests served after the rejoin" % STREAMS)
        finally:
            ends = load.stop()
        ok, failed = hosts_cluster.check_load_ends(ends, streams, want)
        stall = max([e["t"] - e["t0"] for e in ends
                     if e["t0"] <= detected_at and e["t"] >= partitioned_at] or [0])
        print("hosts_expert_partition_replicas: %d requests sent, %d failed %s; rank %d DEAD "
              "and placed around %.2f s after the partition (longest request across it %.2f "
              "s); rejoined and holding experts %.2f s after the heal; tokens equal the "
              "single-process engine in all %d OK requests"
              % (len(ends), len(failed), sorted(set(e["code"] for e in failed)), VICTIM, detect,
                 stall, recover, len(ok)), flush=True)
        self.assertEqual(failed, [], "failed requests\n" + c.logs())
        self.assertLessEqual(detect, DETECT_BOUND_S)
        self.assertTrue(c.procs["expert%d" % VICTIM].alive(), "rank %d exited" % VICTIM)


if __name__ == "__main__":
    hosts_cluster.main()
