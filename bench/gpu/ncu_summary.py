#!/usr/bin/env python3
"""Summarises `ncu --csv --page raw` files from bench/gpu/profile_device.sh: per file, the
kernels in launch order (name, grid, registers, microseconds, DRAM bytes and the rate they
moved at), then the totals per kernel name. Lines of gpu_bench's own output that ncu's CSV
carries (not starting with a quote) are printed first, as they hold the timed figures. With
`--extra M1,M2,...` first (profile_device.sh passes its stall pass's own metrics), those of
them a file holds follow each kernel's line, by short name.
  ncu_summary.py [--extra METRICS] FILE.csv ..."""
import argparse
import csv
from collections import OrderedDict


def short(name, width=60):
    name = name.split("(")[0]
    return name if len(name) <= width else name[: width - 3] + "..."


def part_of(name):
    """A decode step's part a kernel belongs to, for the per-part line: the experts' grouped
    GEMMs (CUTLASS), the dense projections (cuBLAS/cuBLASLt's nvjet kernels, their split-k
    reduction, FP8 Linear's activation quantization), attention (FlashInfer), the lm_head
    (the vocabulary-wide nvjet GEMM) and the rest (norms, router, top-k, sort, the FFN's other
    passes). The router's GEMM (n = 128: nvjet "64x8" tiles) counts as the rest; the names
    are cuBLAS's picks at batch 32 and 128 (H100), and at up to 8 rows the projections and the
    lm_head are gemv.cu's kernels, all in the rest."""
    if "tss_384x32" in name or "tss_192x128" in name:
        return "lm_head"
    if "cutlass::device_kernel" in name:
        return "experts"
    if "tss_64x8" in name:
        return "rest"
    if "nvjet" in name or "splitKreduce" in name or "QuantizeActivationsFp8" in name:
        return "dense"
    if "flashinfer" in name:
        return "attention"
    return "rest"


def summarise(path, extra_metrics):
    with open(path) as f:
        lines = f.read().splitlines()
    rows = [l for l in lines if l.startswith('"')]
    others = [l for l in lines if l and not l.startswith('"') and not l.startswith("==PROF==")]
    print(f"### {path}")
    for l in others[-40:]:
        print("  " + l)
    if len(rows) < 3:
        print("  (no kernels profiled)")
        return
    table = list(csv.reader(rows))
    head, body = table[0], table[2:]  # the second row holds the units
    col = {n: i for i, n in enumerate(head)}

    def num(r, key):
        try:
            return float(r[col[key]].replace(",", ""))
        except (KeyError, ValueError):
            return 0.0

    # The metrics asked for beyond the table's columns (--extra): ncu's raw page also holds
    # every device attribute and launch parameter, which are not printed.
    extra = [n for n in extra_metrics if n in col]

    def extras(r):
        parts = []
        for n in extra:
            label = n.replace("smsp__average_warps_issue_stalled_", "stall_")
            label = label.replace("_per_issue_active.ratio", "").split(".")[0]
            parts.append(f"{label}={r[col[n]]}")
        return "      " + " ".join(parts)

    tunit = table[1][col["gpu__time_duration.sum"]]
    scale = {"ns": 1e-3, "nsecond": 1e-3, "us": 1.0, "usecond": 1.0, "ms": 1e3}.get(tunit, 1.0)
    bunit = table[1][col["dram__bytes_read.sum"]]
    bscale = {"byte": 1, "Kbyte": 1e3, "KB": 1e3, "Mbyte": 1e6, "MB": 1e6, "Gbyte": 1e9, "GB": 1e9}.get(bunit, 1)
    totals = OrderedDict()
    print(f"  {'kernel':60s} {'grid':>8s} {'regs':>5s} {'us':>9s} {'MB':>8s} {'TB/s':>6s}")
    total_us = 0.0
    for r in body:
        name = short(r[col["Kernel Name"]])
        us = num(r, "gpu__time_duration.sum") * scale
        mb = (num(r, "dram__bytes_read.sum") + num(r, "dram__bytes_write.sum")) * bscale / 1e6
        total_us += us
        t = totals.setdefault(name, [0, 0.0, 0.0])
        t[0] += 1
        t[1] += us
        t[2] += mb
        if len(body) <= 80:
            print(f"  {name:60s} {r[col['launch__grid_size']]:>8s} "
                  f"{r[col['launch__registers_per_thread']]:>5s} {us:9.1f} {mb:8.2f} "
                  f"{mb / us if us else 0:6.2f}")  # MB per us is TB/s
            if extra:
                print(extras(r))
    print(f"  -- {len(body)} kernels, {total_us:.1f} us in all; per name:")
    for name, (n, us, mb) in sorted(totals.items(), key=lambda kv: -kv[1][1]):
        print(f"  {name:60s} x{n:<4d} {us:9.1f} us {100 * us / total_us:5.1f}%  {mb:9.2f} MB")
    parts = OrderedDict((k, 0.0) for k in ("experts", "dense", "attention", "lm_head", "rest"))
    for r in body:
        parts[part_of(r[col["Kernel Name"]])] += num(r, "gpu__time_duration.sum") * scale
    print("  -- per part (us): " + ", ".join(f"{k} {v:.1f}" for k, v in parts.items()) +
          f"; all but the lm_head {total_us - parts['lm_head']:.1f}")


parser = argparse.ArgumentParser(description="Summarises ncu --csv --page raw files.")
parser.add_argument("--extra", default="", help="comma-separated metrics printed under each kernel")
parser.add_argument("files", nargs="*")
options = parser.parse_args()
for p in options.files:
    summarise(p, [m for m in options.extra.split(",") if m])
