#!/usr/bin/env python3
"""hosts_router_partition: the router's host cut off the network with streams flowing.

The cluster of hosts_equivalence (router on host 0, 2 attention and 3 expert ranks, each on
its own simulated host, and a client host). The bridge's port to the router's host goes down
(hosts_lib.partition: frames dropped, nothing closed), then comes back up.

What happens: the router is off the data path (dispatch and combine go straight between
attention and expert workers), but it is on the token path of a client's stream: a client
calls Frontend.Generate on the router, and the router relays each attention rank's tokens
to it (router/frontend/frontend_service.cc; design.md "One stream per attention rank").
So streams already flowing cannot finish: their tokens have no way to the client. The
client sees the connection die by its HTTP/2 keepalive (1 s pings, each answered within
1 s; dxs servers accept pings every second, common/grpc/server.h) and each stream ends with
UNAVAILABLE. Behind the partition the workers lose the router too: its leases run out (3 s),
it marks every worker DEAD and stops their requests; the workers keep their processes and,
on the heal, their next heartbeat is answered NOT_FOUND and they register again, as new
incarnations.

Promises:
- In flight: 8 streams (each as long as the context allows, each having streamed 2 tokens
  when the link goes down) all end with UNAVAILABLE within 5 s of the partition; none ends
  OK, none is left without an end.
- A new request sent during the partition (5 s deadline) fails, with UNAVAILABLE or
  DEADLINE_EXCEEDED, within 6 s.
- The partition lasts until the router has expired every worker's lease (its log says so).
- After the heal, requests succeed again within 60 s (each attempt has a 10 s deadline); 8
  concurrent requests then all equal the single-process engine; every worker is the same
  process as before, registered again under a new incarnation.
Figures printed for docs/benchmarks.md.

Skipped (exit 77) where the machine cannot make network namespaces.
"""
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import hosts_cluster  # noqa: E402
import hosts_lib  # noqa: E402

IN_FLIGHT = 8
CONTEXT = 4096
KEEPALIVE_MS = 1000
DETECT_BOUND_S = 5.0
NEW_REQUEST_BOUND_S = 6.0
RECOVER_BOUND_S = 60.0


class HostsRouterPartition(hosts_cluster.ClusterTest):
    PREFIX = "dxs_hosts_router_part_"

    def test_streams_end_unavailable_and_service_resumes_after_the_heal(self):
        c = self.cluster
        before = {(w["role"], w["rank"]): w["incarnation"] for w in c.status()["workers"]}
        spec = [{"prompt": [11 + i, 7, 300], "max_new_tokens": CONTEXT - 3, "ignore_eos": True}
                for i in range(IN_FLIGHT)]
        run = c.start_client(spec, timeout=300, keepalive_ms=KEEPALIVE_MS)
        try:
            hosts_lib.wait_for(
                lambda: sum(1 for n in run.snapshot_tokens().values() if n >= 2) == IN_FLIGHT,
                120, "2 tokens streamed on each of the %d requests" % IN_FLIGHT)
            c.hosts.partition(c.router_host.index)
            partitioned_at = time.monotonic()
            run.wait_all(60)
        finally:
            run.kill()
        _, ends, _ = run.snapshot()
        codes = {i: e["code"] for i, e in ends.items()}
        self.assertEqual(codes, {i: "UNAVAILABLE" for i in range(IN_FLIGHT)},
                         "in-flight requests: %s\n%s" % (ends, c.logs()))
        first = min(e["t"] for e in ends.values()) - partitioned_at
        detect = max(e["t"] for e in ends.values()) - partitioned_at
        self.assertLessEqual(detect, DETECT_BOUND_S, "in-flight requests failed too late")

        sent = time.monotonic()
        refused = c.generate_all([{"prompt": [5, 6, 7], "max_new_tokens": 4}], seconds=5,
                                 keepalive_ms=KEEPALIVE_MS)[0]
        self.assertIn(refused["code"], ("UNAVAILABLE", "DEADLINE_EXCEEDED"), refused)
        refuse = refused["t"] - sent
        self.assertLessEqual(refuse, NEW_REQUEST_BOUND_S, refused)

        # The partition outlasts every worker's lease (the router logs each expiry), so the
        # heal finds them all forgotten, as after any partition longer than the lease.
        hosts_lib.wait_for(lambda: c.procs["router"].log().count("expired ") >= c.m + c.n, 60,
                           "the router expiring all %d workers' leases" % (c.m + c.n))
        c.hosts.heal(c.router_host.index)
        healed_at = time.monotonic()
        probe = {"prompt": [1, 2, 3], "max_new_tokens": 8}
        attempts = []

        def serves():
            end = c.generate_all([probe], seconds=10, keepalive_ms=KEEPALIVE_MS)[0]
            attempts.append((round(end["t"] - healed_at, 2), end["code"]))
            return end["code"] == "OK" and end
        try:
            first_ok = hosts_lib.wait_for(serves, RECOVER_BOUND_S, "a successful request "
                                          "after the heal", interval=0.2)
        except AssertionError as e:
            raise AssertionError("%s; attempts (s after the heal, code): %s\n%s"
                                 % (e, attempts, c.logs())) from None
        recover = first_ok["t"] - healed_at
        after = [{"prompt": [40 + i, 2, 9, 17], "max_new_tokens": 12} for i in range(IN_FLIGHT)]
        want = [hosts_cluster.reference_tokens(c.dxs, self.model, s["prompt"], s["max_new_tokens"])
                for s in after]
        ends_after = c.generate_all(after, seconds=120)
        for i in range(IN_FLIGHT):
            self.assertEqual(ends_after[i]["code"], "OK", "%s\n%s" % (ends_after[i], c.logs()))
            self.assertEqual(ends_after[i]["tokens"], want[i], "request %d after the heal" % i)
        for name, p in c.procs.items():
            self.assertTrue(p.alive(), "%s exited:\n%s" % (name, p.log()))
        now = {(w["role"], w["rank"]): w for w in c.status()["workers"]}
        for key, inc in before.items():
            self.assertEqual(now[key]["state"], "READY", now[key])
            self.assertNotEqual(now[key]["incarnation"], inc,
                                "%s %d did not register again" % key)
        print("hosts_router_partition: %d in-flight streams ended UNAVAILABLE %.2f-%.2f s "
              "after the partition (client keepalive %d ms); a new request failed %s in %.2f "
              "s; serving again %.2f s after the heal (attempts: %s), every worker the same "
              "process under a new incarnation; %d requests after it equal the single-process "
              "engine" % (IN_FLIGHT, first, detect, KEEPALIVE_MS, refused["code"], refuse,
                          recover, attempts, IN_FLIGHT), flush=True)


if __name__ == "__main__":
    hosts_cluster.main()
