#!/usr/bin/env python3
"""dxs's dispatch + combine over D DP x E EP processes (exchange_ranks_bench's JSON lines,
section "exchange_ranks") beside PyTorch's over the same number of GPUs in the same device
call (torch_all_to_all.py's, section "torch_all_to_all", world = D + E), per hidden size
and tokens per rank.

The layouts differ, which the table says: in dxs's, D ranks hold tokens and E ranks hold
the experts; in PyTorch's, every one of the D + E ranks holds tokens and experts. So the
PyTorch round trip moves (D + E) / D times the rows that dxs's does at the same tokens per
rank. user = PyTorch's dispatch + combine as its users write it (counts, host sync, two
all_to_all_single, index_add_); a2a = one all_to_all_single of equal splits.

Usage: exchange_vs_torch.py FILE... (JSON lines of both kinds, in any order)
"""
import json
import sys


def main(paths):
    dxs, torch = [], {}
    for path in paths:
        try:
            lines = open(path).read().splitlines()
        except OSError as e:
            print(f"exchange_vs_torch: {e}", file=sys.stderr)
            continue
        for line in lines:
            r = json.loads(line)
            if r.get("section") == "exchange_ranks":
                dxs.append(r)
            elif r.get("section") == "torch_all_to_all":
                torch[(r["world"], r["hidden"], r["tokens"])] = r
    if not dxs:
        print("exchange_vs_torch: no exchange_ranks rows", file=sys.stderr)
        return 1
    print("dxs dispatch + combine (exchange_ranks_bench) beside PyTorch over the same number of "
          "GPUs, same device call; us, medians; ratio < 1: dxs faster")
    print(f"{'layout':>12} {'transport':>9} {'hidden':>6} {'tok/rank':>8} {'dxs us':>9} "
          f"{'xfer us':>9} {'torch user':>10} {'torch a2a':>9} {'dxs/user':>8} {'dxs/a2a':>8}")
    for r in dxs:
        world = r["dp"] + r["ep"]
        t = torch.get((world, r["hidden"], r["tokens_per_dp_rank"]))
        where = "cpu" if r["memory"] == "host" else "gpus " + ",".join(map(str, sorted(set(r["gpus"]))))
        layout = f"{r['dp']}x{r['ep']} {where}"
        user = f"{t['user_us']:10.1f}" if t else f"{'-':>10}"
        a2a = f"{t['nccl_us']:9.1f}" if t else f"{'-':>9}"
        ru = f"{r['dxs_median_us'] / t['user_us']:8.2f}" if t else f"{'-':>8}"
        ra = f"{r['dxs_median_us'] / t['nccl_us']:8.2f}" if t else f"{'-':>8}"
        print(f"{layout:>12} {r['transport']:>9} {r['hidden']:>6} {r['tokens_per_dp_rank']:>8} "
              f"{r['dxs_median_us']:9.1f} {r['xfer_median_us']:9.1f} {user} {a2a} {ru} {ra}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
