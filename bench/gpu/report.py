#!/usr/bin/env python3
"""Turns gpu_bench's and torch_baselines.py's JSON lines into the results section of
docs/gpu.md (between the markers) and PNG plots, and prints the summary table.

  report.py --dxs dxs.jsonl --torch torch.jsonl --doc docs/gpu.md --out OUTDIR
Writes OUTDIR/gpu.md (the document with its results section replaced) and the plots
OUTDIR/gpu_{ffn,attention,prefill,decode}.png; the hardware line adds what
nvidia-smi.txt beside --dxs (or --smi) says.
"""
import argparse
import datetime
import json
import math
import os

BEGIN, END = "<!-- results: begin (bench/gpu/report.py) -->", "<!-- results: end -->"


def rows(path, section):
    """The records of one section; a missing file gives none, and a line cut short (a run
    that timed out mid-write) is skipped."""
    if not path or not os.path.exists(path):
        return []
    out = []
    with open(path) as f:
        for line in f:
            try:
                r = json.loads(line)
            except ValueError:
                continue
            if isinstance(r, dict) and r.get("section") == section:
                out.append(r)
    return out


def smi(path):
    """The first GPU of run_device.sh's nvidia-smi.txt (--query-gpu=name,memory.total,
    driver_version,clocks.sm --format=csv) as {column: value}, with "gpus" the row count;
    {} when the file is missing or holds no such table (nvidia-smi failed)."""
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        lines = [l.strip() for l in f if l.strip()]
    if len(lines) < 2 or not lines[0].lower().startswith("name"):
        return {}
    header = [h.strip().split(" ")[0].lower() for h in lines[0].split(",")]
    gpus = [[c.strip() for c in l.split(",")] for l in lines[1:]]
    gpus = [g for g in gpus if len(g) == len(header)]
    if not gpus:
        return {}
    first = dict(zip(header, gpus[0]))
    first["gpus"] = len(gpus)
    return first


def smi_text(info):
    """"; nvidia-smi: driver D, M MiB, SM clock C MHz" (the parts it has) or ""."""
    parts = []
    if info.get("driver_version"):
        parts.append(f"driver {info['driver_version']}")
    if info.get("memory.total"):
        parts.append(info["memory.total"])
    clock = info.get("clocks.current.sm") or info.get("clocks.sm")
    if clock:
        parts.append(f"SM clock {clock}")
    if info.get("gpus", 1) > 1:
        parts.append(f"first of {info['gpus']} GPUs")
    return "; nvidia-smi: " + ", ".join(parts) if parts else ""


# One look per method, the same in every plot: color, line style, marker.
OWN = {"color": "C0", "linestyle": "-", "marker": "o"}
ALT = {"color": "C2", "linestyle": "-.", "marker": "^"}
LIB = {"color": "C1", "linestyle": "-", "marker": "s"}
LIB2 = {"color": "C3", "linestyle": ":", "marker": "D"}
FLOOR = {"color": "0.35", "linestyle": "--", "marker": "x"}


def points(xs, ys):
    """The (x, y) pairs a log-log plot can show: both present, finite and positive."""
    out = []
    for x, y in zip(xs, ys):
        try:
            if x > 0 and y > 0 and math.isfinite(x) and math.isfinite(y):
                out.append((x, y))
        except TypeError:
            pass
    return out


def plot(path, title, series, xlabel, ylabel, panels=None, legend="best"):
    """Log-log lines. series: (name, xs, ys[, style]); or panels: (subtitle, series) for one
    subplot each; legend: where the legends go. A series without points is left out, a panel
    without series too; False (and no PNG) when matplotlib is missing or nothing is left."""
    drawn = []
    for subtitle, ser in (panels if panels is not None else [("", series)]):
        kept = []
        for s in ser:
            pts = points(s[1], s[2])
            if pts:
                kept.append((s[0], pts, s[3] if len(s) > 3 else {"marker": "o"}))
        if kept:
            drawn.append((subtitle, kept))
    if not drawn:
        return False
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.ticker import NullLocator
    except ImportError:
        return False
    cols = 1 if len(drawn) == 1 else 2
    nrows = (len(drawn) + cols - 1) // cols
    fig, axes = plt.subplots(nrows, cols, figsize=(6 if cols == 1 else 11, 4 * nrows),
                             squeeze=False)
    for i, (subtitle, kept) in enumerate(drawn):
        ax = axes[i // cols][i % cols]
        for name, pts, style in kept:
            ax.plot([x for x, _ in pts], [y for _, y in pts], label=name, **style)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        xs = sorted({x for _, pts, _ in kept for x, _ in pts})
        ax.set_xticks(xs, [f"{x:g}" for x in xs])
        ax.xaxis.set_minor_locator(NullLocator())
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.set_title(subtitle or title)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize="small", loc=legend)
    for j in range(len(drawn), nrows * cols):
        axes[j // cols][j % cols].set_visible(False)
    if len(drawn) > 1:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--dxs", required=True)
    p.add_argument("--torch", default="")
    p.add_argument("--doc", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--smi", default="",
                   help="nvidia-smi's CSV (default: nvidia-smi.txt beside --dxs)")
    a = p.parse_args()
    gpu = smi(a.smi or os.path.join(os.path.dirname(os.path.abspath(a.dxs)), "nvidia-smi.txt"))
    dev = (rows(a.dxs, "device") or [{"name": gpu.get("name", "unknown GPU")}])[0]
    rates = (rows(a.dxs, "rates") or [{}])[0]
    copy, gemm = rates.get("copy_tbps", 0), rates.get("gemm_tflops", 0)
    lines = [BEGIN, "",
             f"Measured {datetime.date.today().isoformat()} on {dev['name']} "
             f"({dev.get('sms', '?')} SMs{smi_text(gpu)}), one device call: dxs and every "
             "baseline in the same run. CUDA events, warm-up, medians, seeded random inputs.", "",
             f"Ceilings measured in the run: HBM copy {copy:.2f} TB/s (read + write), "
             f"bf16 GEMM 8192^3 {gemm:.0f} TFLOP/s (cuBLAS).", ""]
    summary = []
    ffn, tffn = rows(a.dxs, "ffn"), {r["tokens"]: r for r in rows(a.torch, "torch_ffn")}
    if ffn:
        lines += ["### Grouped expert FFN (128 experts, hidden 2048, inter 768, top-8)", "",
                  "| tokens | dxs (CUTLASS) us | dxs per-expert cuBLAS us | torch._grouped_mm us | vs torch | dxs TFLOP/s | dxs weights TB/s (of copy) |",
                  "| ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
        for r in ffn:
            t = tffn.get(r["tokens"])
            ratio = t["us"] / r["us"] if t else float("nan")
            lines.append(f"| {r['tokens']} | {r['us']:.1f} | {r.get('cublas_us', float('nan')):.1f} | "
                         f"{t['us'] if t else float('nan'):.1f} | "
                         f"{ratio:.2f}x | {r['tflops']:.1f} | {r['weights_tbps']:.2f} "
                         f"({100 * r['weights_tbps'] / copy if copy else 0:.0f}%) |")
            summary.append(f"ffn {r['tokens']:>6} tok: dxs {r['us']:8.1f} us, torch "
                           f"{t['us'] if t else float('nan'):8.1f} us, {ratio:5.2f}x")
        lines.append("")
        if plot(os.path.join(a.out, "gpu_ffn.png"), "Grouped expert FFN",
                [("dxs (CUTLASS)", [r["tokens"] for r in ffn], [r["us"] for r in ffn], OWN),
                 ("dxs per-expert cuBLAS", [r["tokens"] for r in ffn],
                  [r.get("cublas_us") for r in ffn], ALT),
                 ("torch._grouped_mm", sorted(tffn), [tffn[k]["us"] for k in sorted(tffn)],
                  LIB)],
                "tokens", "us"):
            lines += ["![grouped FFN](gpu/gpu_ffn.png)", ""]
    att = rows(a.dxs, "attention")
    if att:
        lines += ["### Paged decode attention (32 heads, 4 KV heads, d 128, bf16)", "",
                  "Per call inside a CUDA graph (32 calls over enough cache copies to miss the "
                  "L2), as a decode step runs it; \"1 call\" is one eager call between events, "
                  "launch included. FlashInfer: its batch prefill kernel (tensor cores, GQA "
                  "rows packed) with its own split-KV plan, measured the same way; it is what "
                  "dxs runs by default (DXS_CUDA_ATTENTION=auto) when the host gives the lengths (prefill, ForwardDecode's graphs); the own kernel column (no host lengths here) is decode_attention.cu's one kernel for at most 32 (sequence, kv head) pairs (batch 1 and 8; by default only up to 2048 positions), attention.cu's kernel and split merge elsewhere.", "",
                  "| batch | context | own kernel us | of floor | FlashInfer us | of floor | own vs FlashInfer | KV-read floor us | own kernel 1 call us |",
                  "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
        for r in att:
            fi = r.get("flashinfer_us", 0) or float("nan")
            lines.append(f"| {r['batch']} | {r['context']} | {r['us']:.1f} | "
                         f"{100 * r['floor_us'] / r['us']:.0f}% | {fi:.1f} | "
                         f"{100 * r['floor_us'] / fi:.0f}% | {fi / r['us']:.2f}x | "
                         f"{r['floor_us']:.1f} | {r.get('eager_us', float('nan')):.1f} |")
            summary.append(f"attention b{r['batch']:>3} ctx {r['context']:>5}: dxs {r['us']:7.1f} us, "
                           f"FlashInfer {fi:7.1f} us, floor {r['floor_us']:7.1f} us")
        worst = min(att, key=lambda r: r["floor_us"] / r["us"])
        summary.append(f"attention: worst {100 * worst['floor_us'] / worst['us']:.0f}% of the "
                       f"KV floor (batch {worst['batch']}, ctx {worst['context']})")
        lines.append("")
        panels = []
        for batch in sorted({r["batch"] for r in att}):
            pts = sorted((r for r in att if r["batch"] == batch), key=lambda r: r["context"])
            ctx = [r["context"] for r in pts]
            panels.append((f"batch {batch}", [
                ("own kernel", ctx, [r["us"] for r in pts], OWN),
                ("FlashInfer", ctx, [r.get("flashinfer_us") for r in pts], LIB),
                ("KV-read floor", ctx, [r.get("floor_us") for r in pts], FLOOR)]))
        if plot(os.path.join(a.out, "gpu_attention.png"), "Paged decode attention, per call",
                [], "context", "us", panels=panels):
            lines += ["![paged attention](gpu/gpu_attention.png)", ""]
    patt = rows(a.dxs, "prefill_attention")
    if patt:
        nan = float("nan")
        lines += ["### Prefill attention: one causal prompt (32 heads, 4 KV heads, d 128, bf16)", "",
                  "FlashInfer's kernels called directly: FA2 (its batch prefill kernel) and FA3 "
                  "(its SM90 kernel, sm_90 only); \"dxs default\" is the backend's own choice "
                  "(DXS_CUDA_PREFILL_SM90=auto: FA3 for these prompts on sm_90).", "",
                  "| prompt | own kernel us | own TFLOP/s | FlashInfer FA2 us | FA2 TFLOP/s | FA3 (sm90) us | FA3 TFLOP/s | FA3 vs FA2 | dxs default us | default vs own |",
                  "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
        for r in patt:
            fi = r.get("flashinfer_us", 0) or nan
            fa3 = r.get("sm90_us", 0) or nan
            # Runs before the FA3 column timed the backend's default as flashinfer_us.
            default = r.get("default_us", r.get("flashinfer_us", 0)) or nan
            lines.append(f"| {r['prompt']} | {r['us']:.1f} | {r['tflops']:.0f} | {fi:.1f} | "
                         f"{r.get('flashinfer_tflops', 0):.0f} | {fa3:.1f} | "
                         f"{r.get('sm90_tflops', 0):.0f} | {fi / fa3:.2f}x | {default:.1f} | "
                         f"{r['us'] / default:.2f}x |")
            summary.append(f"prefill attention {r['prompt']:>5}: dxs {r['us']:8.1f} us, "
                           f"FA2 {fi:8.1f} us, FA3 {fa3:8.1f} us")
        lines.append("")
        prompts = [r["prompt"] for r in patt]
        if plot(os.path.join(a.out, "gpu_prefill.png"), "Prefill attention, one causal prompt",
                [("own kernel", prompts, [r["us"] for r in patt], OWN),
                 ("FlashInfer FA2", prompts, [r.get("flashinfer_us") for r in patt], LIB),
                 ("FlashInfer FA3 (sm90)", prompts, [r.get("sm90_us") for r in patt], LIB2),
                 ("dxs default", prompts,
                  [r.get("default_us", r.get("flashinfer_us")) for r in patt], ALT)],
                "prompt tokens", "us"):
            lines += ["![prefill attention](gpu/gpu_prefill.png)", ""]
    dec, hf = rows(a.dxs, "decode"), {r["batch"]: r for r in rows(a.torch, "hf_decode")}
    if dec:
        layers = dec[0]["layers"]
        lines += [f"### Decode, Qwen3-30B-A3B shape ({layers} layers, random bf16), context 1024", "",
                  "| batch | dxs tokens/s (CUDA graphs) | step ms | eager step ms | HBM floor ms | of floor | HF ms/layer | dxs ms/layer | vs HF |",
                  "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
        for r in dec:
            h = hf.get(r["batch"])
            per_layer = r["step_ms"] / r["layers"]
            vs = h["ms_per_layer"] / per_layer if h else float("nan")
            lines.append(f"| {r['batch']} | {r['tokens_per_s']:.1f} | {r['step_ms']:.2f} | "
                         f"{r.get('eager_step_ms', float('nan')):.2f} | "
                         f"{r['floor_ms']:.2f} | {100 * r['floor_ms'] / r['step_ms']:.0f}% | "
                         f"{h['ms_per_layer'] if h else float('nan'):.2f} | {per_layer:.3f} | {vs:.0f}x |")
            summary.append(f"decode b{r['batch']:>3}: {r['tokens_per_s']:9.1f} tok/s, "
                           f"{100 * r['floor_ms'] / r['step_ms']:3.0f}% of floor, {vs:6.0f}x HF")
        lines.append("")
        # Hugging Face runs fewer layers; as in "vs HF", its time per layer times dxs's layers.
        batches = [r["batch"] for r in dec]
        if plot(os.path.join(a.out, "gpu_decode.png"),
                f"Decode step, Qwen3-30B-A3B shape ({layers} layers), context 1024",
                [("dxs (CUDA graphs)", batches, [r["step_ms"] for r in dec], OWN),
                 ("dxs eager", batches, [r.get("eager_step_ms") for r in dec], ALT),
                 (f"Hugging Face (ms/layer x {layers})", sorted(hf),
                  [(hf[b].get("ms_per_layer") or float("nan")) * layers for b in sorted(hf)], LIB),
                 ("HBM floor", batches, [r.get("floor_ms") for r in dec], FLOOR)],
                "batch", "step ms", legend="center left" if hf else "best"):
            lines += ["![decode step](gpu/gpu_decode.png)", ""]
    pre = rows(a.dxs, "prefill")
    if pre:
        r = pre[0]
        lines += [f"### Prefill: one {r['tokens']}-token prompt ({r['layers']} layers)", "",
                  f"{r['tokens_per_s']:.0f} tokens/s, {r['tflops']:.1f} TFLOP/s = "
                  f"{100 * r['tflops'] / gemm if gemm else 0:.0f}% of the measured GEMM rate.", ""]
        summary.append(f"prefill: {r['tokens_per_s']:.0f} tok/s, "
                       f"{100 * r['tflops'] / gemm if gemm else 0:.0f}% of GEMM rate")
    lines.append(END)
    with open(a.doc) as f:
        doc = f.read()
    if BEGIN in doc and END in doc:
        doc = doc[:doc.index(BEGIN)] + "\n".join(lines) + doc[doc.index(END) + len(END):]
    else:
        doc = doc.rstrip() + "\n\n" + "\n".join(lines) + "\n"
    with open(os.path.join(a.out, "gpu.md"), "w") as f:
        f.write(doc)
    print("\n".join(summary))


if __name__ == "__main__":
    main()
