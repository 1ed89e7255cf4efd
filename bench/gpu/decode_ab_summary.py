#!/usr/bin/env python3
"""The table of a decode A/B (run_device.sh decode-ab and decode-old-new).

Reads the rows run_device.sh's decode_run appends to $OUT/decode_ab.tsv, one per gpu_bench
result line: setting, round, dtype, batch, tokens/s (tab-separated). Prints, for each setting in
the order first seen, each dtype and batch's mean tokens/s over the rounds that gave one, its
change against the first setting's mean, and the setting's FP8 / bf16 ratio at each batch: the
figures a closing note quotes, computed the same way every time.

    bench/gpu/decode_ab_summary.py $OUT/decode_ab.tsv
"""
import argparse
import collections
import statistics
import sys


def read_rows(path):
    """{setting: {(dtype, batch): [tok/s, ...]}} in the order settings first appear."""
    table = collections.OrderedDict()
    with open(path) as f:
        for n, line in enumerate(f, 1):
            line = line.rstrip("\n")
            if not line:
                continue
            fields = line.split("\t")
            if len(fields) != 5:
                raise ValueError("%s:%d: want 5 tab-separated fields, got %d" % (path, n, len(fields)))
            setting, _round, dtype, batch, tok_s = fields
            table.setdefault(setting, collections.defaultdict(list))[(dtype, int(batch))].append(
                float(tok_s))
    return table


def summarize(table):
    """The printed lines, columns aligned: one header, then one line a setting."""
    columns = sorted({key for cells in table.values() for key in cells},
                     key=lambda k: (k[1], k[0] != "bf16", k[0]))
    batches = sorted({b for _, b in columns})
    first = next(iter(table.values()), {})
    header = ["setting"] + ["%s b%d" % (d, b) for d, b in columns]
    header += ["fp8/bf16 b%d" % b for b in batches]
    rows = [header]
    for setting, cells in table.items():
        row = [setting]
        for key in columns:
            if not cells.get(key):
                row.append("-")
                continue
            mean = statistics.mean(cells[key])
            text = "%.1f (%d)" % (mean, len(cells[key]))
            if cells is not first and first.get(key):
                text += " %+.1f%%" % (100.0 * (mean / statistics.mean(first[key]) - 1.0))
            row.append(text)
        for b in batches:
            bf16, fp8 = cells.get(("bf16", b)), cells.get(("fp8", b))
            row.append("%.2f" % (statistics.mean(fp8) / statistics.mean(bf16))
                       if bf16 and fp8 else "-")
        rows.append(row)
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    return ["  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip() for r in rows]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("rows", help="decode_ab.tsv from run_device.sh")
    args = parser.parse_args()
    table = read_rows(args.rows)
    if not table:
        print("decode A/B: no rows in %s (every run failed?)" % args.rows)
        return 1
    print("decode A/B: tokens/s, mean over rounds (rounds), change against %s"
          % next(iter(table)))
    for line in summarize(table):
        print("  " + line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
