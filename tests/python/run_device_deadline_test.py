#!/usr/bin/env python3
"""bench/gpu/run_device.sh's deadline: an A/B mode starts no decode run that would pass
DXS_DEADLINE_S from the call's start (DXS_CALL_START), names each one skipped in its summary,
and still prints its table from the runs that did start. Runs the script on a copy of its
tree with a stand-in gpu_bench that prints a decode A/B's rows (the script's own logic is
what is tested; no GPU). The clock does not decide the outcome: the call's start is given
either far in the past or now, with a deadline far from both."""
import argparse
import os
import shutil
import stat
import subprocess
import sys
import tempfile
import time

FAKE_GPU_BENCH = """#!/bin/sh
echo "  bf16       1        300.0       3.23         2.10      65%"
echo "  bf16       8        600.0      12.32         9.06      74%"
echo "  fp8        1        360.0       2.65         1.18      44%"
echo "  fp8        8        800.0       9.28         4.78      51%"
"""


def run_ab(tree, start, deadline):
    out = tempfile.mkdtemp(prefix="out-", dir=tree)
    env = dict(os.environ, OUT=out, DXS_CALL_START=str(start), DXS_DEADLINE_S=str(deadline),
               DXS_DECODE_RUN_S="90", DXS_AB_ROUNDS="2")
    proc = subprocess.run(["bash", os.path.join(tree, "bench/gpu/run_device.sh"), "decode-ab", "",
                           "DXS_X=on"], capture_output=True, text=True, env=env, timeout=300)
    return proc, out


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--source-dir", required=True)
    args = parser.parse_args()
    failures = []

    def check(cond, what):
        if not cond:
            failures.append(what)

    with tempfile.TemporaryDirectory() as tree:
        os.makedirs(os.path.join(tree, "bench/gpu"))
        for name in ("run_device.sh", "decode_ab_summary.py"):
            shutil.copy(os.path.join(args.source_dir, "bench/gpu", name),
                        os.path.join(tree, "bench/gpu", name))
        bindir = os.path.join(tree, ".device/bin")
        os.makedirs(bindir)
        open(os.path.join(tree, ".device/env.sh"), "w").close()
        fake = os.path.join(bindir, "gpu_bench")
        with open(fake, "w") as f:
            f.write(FAKE_GPU_BENCH)
        os.chmod(fake, os.stat(fake).st_mode | stat.S_IXUSR)
        now = int(time.time())

        # Started an hour before a 560 s deadline: every run is skipped, none starts, and the
        # summary says so for each of the four (two settings, two rounds).
        proc, out = run_ab(tree, now - 3600, 560)
        check(proc.returncode == 0, "late call: exit status %d (%s)" % (proc.returncode,
                                                                         proc.stderr[-400:]))
        skipped = [l for l in proc.stdout.splitlines() if "skipped" in l and "decode-ab [" in l]
        check(len(skipped) == 4, "late call: %d runs named skipped, want 4:\n%s" %
              (len(skipped), proc.stdout))
        check("would pass 560 s" in proc.stdout, "late call: the deadline not named")
        check("no run gave rows" in proc.stdout, "late call: no note that no run gave rows")
        check(not os.path.exists(os.path.join(out, "decode_ab.tsv")),
              "late call: rows written though every run was skipped")

        # Started now with a day to go: all four runs, the table, nothing skipped.
        proc, out = run_ab(tree, now, 86400)
        check(proc.returncode == 0, "early call: exit status %d" % proc.returncode)
        check("skipped" not in proc.stdout, "early call: a run skipped:\n%s" % proc.stdout)
        with open(os.path.join(out, "decode_ab.tsv")) as f:
            rows = f.read().splitlines()
        check(len(rows) == 16, "early call: %d rows, want 16 (4 runs x 4)" % len(rows))
        check("DXS_X=on" in proc.stdout and "fp8/bf16 b1" in proc.stdout,
              "early call: no summary table:\n%s" % proc.stdout)

    if failures:
        print("FAILED:\n" + "\n".join(failures))
        return 1
    print("run_device.sh deadline: skipped runs named, table from the runs that ran")
    return 0


if __name__ == "__main__":
    sys.exit(main())
