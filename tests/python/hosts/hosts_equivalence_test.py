#!/usr/bin/env python3
"""hosts_equivalence: a 2 attention x 3 expert cluster over simulated hosts equals the
single-process engine, and its exchange goes by copy.

Promises:
- A cluster of seven simulated hosts (hosts_lib: own network and IPC namespaces, one
  bridge): the router on host 0, attention ranks 0-1 on hosts 1-2, expert ranks 0-2 on
  hosts 3-5, the client on host 6; every process listens on and registers its host's
  address, and the data path is UCX between hosts (TCP: no shared memory in common).
- 32 concurrent greedy streams (distinct prompts of 3-40 tokens, 12-24 new tokens) all
  succeed, each with exactly the tokens `dxs run` (the single-process engine) gives for it.
- Both attention ranks took part, and the one-copy exchange fell back to copies: every
  worker counts exchange bytes under dxs_exchange_bytes_total{memory="host"} (the copy
  path; dataplane/transport/exchange_bytes.h) and none under memory="mapped", though
  --mapped-exchange is on (its default).
- Requests are bounded: 32, each with a 120 s deadline; the cluster must be ready within
  120 s.

Where the machine cannot make network namespaces (not root, no iproute2, no unshare), the
test prints why and exits 77, which ctest reports as skipped.

    .venv/bin/python3 tests/python/hosts/hosts_equivalence_test.py --bin-dir build/bin
"""
import os
import random
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import hosts_cluster  # noqa: E402

STREAMS = 32


class HostsEquivalence(hosts_cluster.ClusterTest):
    PREFIX = "dxs_hosts_equiv_"

    def test_concurrent_streams_equal_the_single_process_engine_by_copy(self):
        c = self.cluster
        rng = random.Random(43)
        spec = [{"prompt": [rng.randrange(3, 4096) for _ in range(rng.randint(3, 40))],
                 "max_new_tokens": rng.randint(12, 24)} for _ in range(STREAMS)]
        want = [hosts_cluster.reference_tokens(c.dxs, self.model, s["prompt"], s["max_new_tokens"])
                for s in spec]
        ends = c.generate_all(spec, seconds=120)
        failed = {i: (e["code"], e["details"]) for i, e in ends.items() if e["code"] != "OK"}
        self.assertEqual(failed, {}, "failed requests\n" + c.logs())
        for i in range(STREAMS):
            self.assertEqual(ends[i]["tokens"], want[i], "stream %d" % i)

        name = "dxs_exchange_bytes_total"
        for role, hosts in (("attention", c.attention_hosts), ("expert", c.expert_hosts)):
            for h in hosts:
                text = c.scrape(h)
                copied = hosts_cluster.metric(text, name, {"role": role, "memory": "host"})
                mapped = hosts_cluster.metric(text, name, {"role": role, "memory": "mapped"})
                where = "%s on %s (%s)" % (role, h.ns, h.ip)
                self.assertIsNotNone(copied, "%s: no %s{memory=\"host\"}" % (where, name))
                self.assertIsNotNone(mapped, "%s: no %s{memory=\"mapped\"}" % (where, name))
                self.assertGreater(copied, 0, "%s moved no bytes by copy" % where)
                self.assertEqual(mapped, 0, "%s mapped a peer's memory across hosts" % where)


if __name__ == "__main__":
    hosts_cluster.main()
