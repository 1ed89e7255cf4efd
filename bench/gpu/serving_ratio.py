#!/usr/bin/env python3
"""The serving loop's decode rate over the engine's own decode step rate, from one run.

  serving_ratio.py STEP_JSONL CLUSTER_DECODE_TABLE

STEP_JSONL: gpu_bench --json (its "decode" rows: the graphed decode step at a batch, context
1024). CLUSTER_DECODE_TABLE: cluster_decode_bench.sh's table (cluster_decode.txt), whose
"single process (graphs...)" rows are `dxs bench --local` at a concurrency, overlap
scheduling on and off: label, concurrency, output tok/s. A ratio of 1 means the host adds
nothing to the engine's steps.
"""
import json
import re
import sys


def main():
    step = {}
    for line in open(sys.argv[1]):
        r = json.loads(line)
        if r.get("section") == "decode":
            step[int(r["batch"])] = float(r["tokens_per_s"])
    print("serving loop (dxs bench --local) / engine decode step (gpu_bench) at the same batch")
    print("%-28s %4s %10s %11s %6s" % ("run", "conc", "tok/s", "step tok/s", "ratio"))
    for line in open(sys.argv[2]):
        m = re.match(r"single process \(graphs(, --overlap-schedule off)?\)\s+(\d+)\s+(\S+)", line)
        if not m:
            continue
        c = int(m.group(2))
        label = "--overlap-schedule " + ("off" if m.group(1) else "on")
        try:
            got = float(m.group(3))
        except ValueError:
            print("%-28s %4d failed: %s" % (label, c, line.strip()))
            continue
        ref = step.get(c)
        print("%-28s %4d %10.1f %11s %6s" % (label, c, got, "%.1f" % ref if ref else "-",
                                             "%.2f" % (got / ref) if ref else "-"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
