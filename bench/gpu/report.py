#!/usr/bin/env python3
"""Turns gpu_bench's and torch_baselines.py's JSON lines into the results section of
docs/gpu.md (between the markers) and PNG plots, and prints the summary table.

  report.py --dxs dxs.jsonl --torch torch.jsonl --doc docs/gpu.md --out OUTDIR
Writes OUTDIR/gpu.md (the document with its results section replaced) and OUTDIR/*.png.
"""
import argparse
import datetime
import json
import os

BEGIN, END = "<!-- results: begin (bench/gpu/report.py) -->", "<!-- results: end -->"


def rows(path, section):
    if not path or not os.path.exists(path):
        return []
    out = []
    with open(path) as f:
        for line in f:
            r = json.loads(line)
            if r.get("section") == section:
                out.append(r)
    return out


def plot(path, title, series, xlabel, ylabel):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(6, 4))
    for name, xs, ys in series:
        if xs:
            ax.plot(xs, ys, marker="o", label=name)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
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
    a = p.parse_args()
    dev = (rows(a.dxs, "device") or [{"name": "unknown GPU"}])[0]
    rates = (rows(a.dxs, "rates") or [{}])[0]
    copy, gemm = rates.get("copy_tbps", 0), rates.get("gemm_tflops", 0)
    lines = [BEGIN, "",
             f"Measured {datetime.date.today().isoformat()} on {dev['name']} "
             f"({dev.get('sms', '?')} SMs), one device call: dxs and every baseline in the "
             "same run. CUDA events, warm-up, medians, seeded random inputs.", "",
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
                [("dxs", [r["tokens"] for r in ffn], [r["us"] for r in ffn]),
                 ("torch._grouped_mm", sorted(tffn), [tffn[k]["us"] for k in sorted(tffn)])],
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
        series = []
        for ctx in sorted({r["context"] for r in att}):
            pts = [r for r in att if r["context"] == ctx]
            series.append((f"dxs ctx {ctx}", [r["batch"] for r in pts], [r["us"] for r in pts]))
            series.append((f"floor ctx {ctx}", [r["batch"] for r in pts],
                           [r["floor_us"] for r in pts]))
        if plot(os.path.join(a.out, "gpu_attention.png"), "Paged decode attention", series,
                "batch", "us"):
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
