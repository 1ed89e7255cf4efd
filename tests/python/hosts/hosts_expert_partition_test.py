#!/usr/bin/env python3
"""hosts_expert_partition: an expert host cut off the network, without replicas.

The cluster of hosts_equivalence (router, 2 attention and 3 expert ranks, each on its own
simulated host, and a client host). The bridge's port to expert rank 1's host goes down:
frames to and from it are dropped, nothing is closed or reset (hosts_lib.partition).

Promises:
- In flight: 8 streams, each as long as the context allows (ignore_eos, prompt + new
  tokens = 4096) and each having streamed at least 2 tokens when the link goes down, all
  end with UNAVAILABLE within 5 s of the partition (the product's bound for a dead expert;
  measured from the moment `ip link set ... down` returned to the client's receipt of the
  error). None ends OK, none is left without an end.
- During the partition, a new request is refused with UNAVAILABLE within 5 s (the router
  knows the cluster is incomplete), not queued until its deadline.
- After the link is back up, the cluster serves again: new requests are sent one after
  another (each with a 10 s deadline) until one succeeds, within 60 s of the heal; then 8
  concurrent requests all succeed with the single-process engine's tokens.
- The test prints the figures: time to detect (partition to the last in-flight error) and
  time to recover (heal to the first success).

Skipped (exit 77) where the machine cannot make network namespaces.

    .venv/bin/python3 tests/python/hosts/hosts_expert_partition_test.py --bin-dir build/bin
"""
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import hosts_cluster  # noqa: E402
import hosts_lib  # noqa: E402

IN_FLIGHT = 8
CONTEXT = 4096
DETECT_BOUND_S = 5.0  # the product's promise for in-flight requests on a dead expert
REFUSE_BOUND_S = 5.0
RECOVER_BOUND_S = 60.0  # generous: re-registration takes a heartbeat or two


class HostsExpertPartition(hosts_cluster.ClusterTest):
    PREFIX = "dxs_hosts_partition_"

    def test_in_flight_requests_fail_unavailable_then_the_cluster_serves_again(self):
        c = self.cluster
        victim = c.expert_hosts[1]
        spec = [{"prompt": [11 + i, 7, 300], "max_new_tokens": CONTEXT - 3, "ignore_eos": True}
                for i in range(IN_FLIGHT)]
        run = c.start_client(spec, timeout=300)
        try:
            hosts_lib.wait_for(
                lambda: sum(1 for n in run.snapshot_tokens().values() if n >= 2) == IN_FLIGHT,
                120, "2 tokens streamed on each of the %d requests" % IN_FLIGHT)
            c.hosts.partition(victim.index)
            partitioned_at = time.monotonic()
            run.wait_all(60)
        finally:
            run.kill()
        _, ends, _ = run.snapshot()
        codes = {i: e["code"] for i, e in ends.items()}
        self.assertEqual(codes, {i: "UNAVAILABLE" for i in range(IN_FLIGHT)},
                         "in-flight requests: %s\n%s" % (ends, c.logs()))
        detect = max(e["t"] for e in ends.values()) - partitioned_at
        print("hosts_expert_partition: %d in-flight requests failed UNAVAILABLE %.2f-%.2f s "
              "after the partition" % (IN_FLIGHT, min(e["t"] for e in ends.values()) -
                                       partitioned_at, detect), flush=True)
        self.assertLessEqual(detect, DETECT_BOUND_S, "in-flight requests failed too late")

        # The partition is still there: a new request is refused, quickly.
        sent = time.monotonic()
        refused = c.generate_all([{"prompt": [5, 6, 7], "max_new_tokens": 4}], seconds=10)[0]
        self.assertEqual(refused["code"], "UNAVAILABLE", refused)
        self.assertLessEqual(refused["t"] - sent, REFUSE_BOUND_S, refused)

        c.hosts.heal(victim.index)
        healed_at = time.monotonic()
        probe = {"prompt": [1, 2, 3], "max_new_tokens": 8}
        attempts = []

        def serves():
            end = c.generate_all([probe], seconds=10)[0]
            attempts.append((round(end["t"] - healed_at, 2), end["code"]))
            return end["code"] == "OK" and end
        first_ok = hosts_lib.wait_for(serves, RECOVER_BOUND_S,
                                      "a successful request after the heal", interval=0.2)
        recover = first_ok["t"] - healed_at
        print("hosts_expert_partition: serving again %.2f s after the heal (%d attempts: %s)"
              % (recover, len(attempts), attempts), flush=True)

        after = [{"prompt": [40 + i, 2, 9, 17], "max_new_tokens": 12} for i in range(IN_FLIGHT)]
        want = [hosts_cluster.reference_tokens(c.dxs, self.model, s["prompt"], s["max_new_tokens"])
                for s in after]
        ends = c.generate_all(after, seconds=120)
        for i in range(IN_FLIGHT):
            self.assertEqual(ends[i]["code"], "OK", "%s\n%s" % (ends[i], c.logs()))
            self.assertEqual(ends[i]["tokens"], want[i], "request %d after the heal" % i)


if __name__ == "__main__":
    hosts_cluster.main()
