#!/usr/bin/env python3
"""bench/gpu/decode_ab_summary.py: means over rounds, changes against the first setting and the
FP8 / bf16 ratios of a decode A/B, from the rows run_device.sh's decode_run writes."""
import argparse
import os
import subprocess
import sys
import tempfile

ROWS = [
    # setting, round, dtype, batch, tok/s: "old" first, two rounds; "new" two; "x" one round
    # without FP8 at batch 8 (a run that stopped).
    ("old", 1, "bf16", 1, 300.0), ("old", 1, "fp8", 1, 360.0), ("old", 1, "bf16", 8, 600.0),
    ("old", 1, "fp8", 8, 800.0), ("old", 2, "bf16", 1, 302.0), ("old", 2, "fp8", 1, 364.0),
    ("old", 2, "bf16", 8, 602.0), ("old", 2, "fp8", 8, 804.0),
    ("new", 1, "bf16", 1, 301.0), ("new", 1, "fp8", 1, 370.0), ("new", 1, "bf16", 8, 601.0),
    ("new", 1, "fp8", 8, 810.0), ("new", 2, "bf16", 1, 301.0), ("new", 2, "fp8", 1, 372.0),
    ("new", 2, "bf16", 8, 601.0), ("new", 2, "fp8", 8, 812.0),
    ("x", 1, "bf16", 1, 290.0), ("x", 1, "fp8", 1, 300.0), ("x", 1, "bf16", 8, 590.0),
]


def run(script, text):
    with tempfile.NamedTemporaryFile("w", suffix=".tsv", delete=False) as f:
        f.write(text)
    try:
        return subprocess.run([sys.executable, script, f.name], capture_output=True, text=True)
    finally:
        os.unlink(f.name)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--source-dir", required=True)
    args = parser.parse_args()
    script = os.path.join(args.source_dir, "bench/gpu/decode_ab_summary.py")
    failures = []

    def check(cond, what):
        if not cond:
            failures.append(what)

    out = run(script, "".join("%s\t%d\t%s\t%d\t%.1f\n" % r for r in ROWS))
    check(out.returncode == 0, "exit status %d: %s" % (out.returncode, out.stderr))
    lines = out.stdout.splitlines()
    check(lines and lines[0].endswith("change against old"), "the baseline is the first setting")
    table = {l.split()[0]: l.split() for l in lines[2:]}
    check(lines[1].split() == ["setting", "bf16", "b1", "fp8", "b1", "bf16", "b8", "fp8", "b8",
                               "fp8/bf16", "b1", "fp8/bf16", "b8"], "header: " + lines[1])
    # old: means 301.0, 362.0, 601.0, 802.0; ratios 362/301 = 1.20, 802/601 = 1.33.
    check(table.get("old") == ["old", "301.0", "(2)", "362.0", "(2)", "601.0", "(2)", "802.0",
                               "(2)", "1.20", "1.33"], "old: %s" % table.get("old"))
    # new: fp8 b1 371.0 is +2.5% of 362.0; fp8 b8 811.0 is +1.1% of 802.0.
    check(table.get("new") == ["new", "301.0", "(2)", "+0.0%", "371.0", "(2)", "+2.5%", "601.0",
                               "(2)", "+0.0%", "811.0", "(2)", "+1.1%", "1.23", "1.35"],
          "new: %s" % table.get("new"))
    # x: one round, no FP8 at batch 8, so no ratio there.
    check(table.get("x") == ["x", "290.0", "(1)", "-3.7%", "300.0", "(1)", "-17.1%", "590.0",
                             "(1)", "-1.8%", "-", "1.03", "-"], "x: %s" % table.get("x"))

    empty = run(script, "")
    check(empty.returncode == 1 and "no rows" in empty.stdout, "no rows: a message and status 1")
    bad = run(script, "old\t1\tbf16\n")
    check(bad.returncode != 0 and "want 5 tab-separated fields" in bad.stderr,
          "a short row names the file, line and fields")

    for f in failures:
        print("FAIL:", f)
    print("decode_ab_summary_test: %d failures" % len(failures))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
