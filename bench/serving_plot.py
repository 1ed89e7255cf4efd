#!/usr/bin/env python3
"""Plots `dxs bench --request-rate ... --format json` output (one JSON object per rate and
line, e.g. bench/gpu/serving_sweep.sh's serving_sweep.jsonl): output tokens/s, TTFT and
TPOT (p50 and p99) and goodput against the offered request rate, the SLO drawn in.
    python3 bench/serving_plot.py RESULTS.jsonl OUT.png [TITLE]
Needs matplotlib (not a dependency of the project: run it where the figures are made)."""
import json
import sys


def main():
    rows = [json.loads(line) for line in open(sys.argv[1]) if line.strip()]
    title = sys.argv[3] if len(sys.argv) > 3 else "dxs bench --request-rate"
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    # "inf" (every request at once) is drawn one step past the largest finite rate.
    finite = [r["request_rate"] for r in rows if r["request_rate"] != "inf"]
    top = max(finite) if finite else 1
    xs = [r["request_rate"] if r["request_rate"] != "inf" else top * 2 for r in rows]
    labels = [str(r["request_rate"]) for r in rows]
    fig, axes = plt.subplots(1, 4, figsize=(16, 3.6))
    def series(ax, key, name, slo=None):
        for q, style in (("p50", "o-"), ("p99", "s--")):
            ax.plot(xs, [r[key][q] for r in rows], style, label=q)
        if slo is not None:
            ax.axhline(slo, color="red", linewidth=0.8, label="SLO")
        ax.set_title(name)
        ax.legend()
    axes[0].plot(xs, [r["output_tokens_per_second"] for r in rows], "o-")
    axes[0].set_title("output tokens/s")
    series(axes[1], "ttft_ms", "TTFT ms", rows[0]["slo"]["ttft_ms"])
    series(axes[2], "tpot_ms", "TPOT ms", rows[0]["slo"]["tpot_ms"])
    axes[3].plot(xs, [r["requests_per_second"] for r in rows], "o-", label="served")
    axes[3].plot(xs, [r["goodput_requests_per_second"] for r in rows], "s--", label="goodput")
    axes[3].set_title("requests/s")
    axes[3].legend()
    for ax in axes:
        ax.set_xscale("log", base=2)
        ax.set_xticks(xs)
        ax.set_xticklabels(labels)
        ax.set_xlabel("offered request rate (req/s)")
        ax.set_ylim(bottom=0)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(sys.argv[2], dpi=90)


if __name__ == "__main__":
    main()
