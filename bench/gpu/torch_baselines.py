#!/usr/bin/env python3
"""PyTorch and Hugging Face baselines for bench/gpu_bench.cc, on the same GPU in the same
device call (bench/gpu/run_device.sh). Timing: CUDA events, warm-up, medians; seeded random
inputs. Writes one JSON object per figure (--json) and prints a table.

  ffn:    the grouped expert FFN as a PyTorch user writes it with torch._grouped_mm
          (gate_up, SiLU*mul, down) on Qwen3-30B-A3B expert shapes, random top-8 routing
  hf:     Hugging Face transformers' Qwen3MoeForCausalLM decode step per layer (random bf16
          weights of the Qwen3-30B-A3B shape, --hf-layers layers), context 1024
  fp8:    (--fp8: this alone) the same FFN in FP8 as a PyTorch user writes it with
          torch._scaled_grouped_mm: e4m3 weights with one scale per expert and output column,
          the rows (and silu * up) quantized per row in eager PyTorch. PyTorch's grouped FP8
          GEMM takes row-wise scales, not 128x128 blocks: the nearest PyTorch has to dxs's
          block-scaled FFN (gpu_bench --fp8).
"""
import argparse
import json
import statistics

import torch
import torch.nn.functional as F


def time_ms(fn, warmup=3, reps=20):
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        out.append(a.elapsed_time(b))
    return statistics.median(out)


def routed_rows(tokens, experts, hidden, top_k, g):
    """Random bf16 rows routed top-k of `experts` at random: the rows in expert order (one per
    pair), the pairs per expert and their cumulative offsets (int32), as _grouped_mm takes."""
    ids = torch.rand(tokens, experts, device="cuda", generator=g).topk(top_k, dim=1).indices
    x = torch.randn(tokens, hidden, device="cuda", generator=g).bfloat16()
    flat = ids.flatten()
    order = flat.argsort(stable=True)
    counts = torch.bincount(flat, minlength=experts)
    return x[order // top_k], counts, counts.cumsum(0).to(torch.int32)


def grouped_ffn(sizes, emit):
    experts, hidden, inter, top_k = 128, 2048, 768, 8
    g = torch.Generator(device="cuda").manual_seed(0)
    # Weights as a checkpoint stores them ([N, K] per expert), handed to _grouped_mm as
    # [G, K, N] views, the layout it takes.
    w_gate_up = (torch.rand(experts, 2 * inter, hidden, device="cuda", generator=g) - 0.5) * (
        2 * (3.0 / hidden) ** 0.5)
    w_down = (torch.rand(experts, hidden, inter, device="cuda", generator=g) - 0.5) * (
        2 * (3.0 / inter) ** 0.5)
    w_gate_up = w_gate_up.bfloat16().transpose(1, 2)
    w_down = w_down.bfloat16().transpose(1, 2)
    print("[ffn] torch._grouped_mm, 128 experts, hidden 2048, inter 768, top-8, bf16")
    for tokens in sizes:
        xs, counts, offs = routed_rows(tokens, experts, hidden, top_k, g)

        def ffn():
            h = torch._grouped_mm(xs, w_gate_up, offs=offs)
            gate, up = h[:, :inter], h[:, inter:]
            a = F.silu(gate) * up
            return torch._grouped_mm(a, w_down, offs=offs)

        ms = time_ms(ffn)
        flops = 2.0 * 3 * hidden * inter * tokens * top_k
        used = int((counts > 0).sum())
        wbytes = 3.0 * hidden * inter * 2 * used
        print(f"  {tokens:7d} {ms * 1e3:10.1f} us {flops / ms / 1e9:8.1f} TFLOP/s "
              f"{wbytes / ms / 1e9:6.2f} TB/s weights")
        emit({"section": "torch_ffn", "tokens": tokens, "us": ms * 1e3,
              "tflops": flops / ms / 1e9, "weights_tbps": wbytes / ms / 1e9})


def quantize_rows(x):
    """Per-row e4m3 quantization: (values, f32 scales [rows])."""
    amax = x.abs().amax(dim=1).float().clamp(min=1e-4)
    scale = amax / 448.0
    return (x.float() / scale[:, None]).to(torch.float8_e4m3fn), scale


def grouped_ffn_fp8(sizes, emit):
    experts, hidden, inter, top_k = 128, 2048, 768, 8
    g = torch.Generator(device="cuda").manual_seed(0)

    def weights(n, k):
        # [G, N, K] as stored, quantized per output column, handed over as [G, K, N] views
        # (column-major, the layout _scaled_grouped_mm takes).
        w = (torch.rand(experts, n, k, device="cuda", generator=g) - 0.5) * (2 * (3.0 / k) ** 0.5)
        scale = w.abs().amax(dim=2).clamp(min=1e-4) / 448.0  # [G, N]
        q = (w / scale[:, :, None]).to(torch.float8_e4m3fn)
        return q.transpose(1, 2), scale.float()

    w_gate_up, s_gate_up = weights(2 * inter, hidden)
    w_down, s_down = weights(hidden, inter)
    print("[ffn-fp8] torch._scaled_grouped_mm (row-wise scales), 128 experts, hidden 2048, "
          "inter 768, top-8")
    for tokens in sizes:
        xs, _, offs = routed_rows(tokens, experts, hidden, top_k, g)

        def ffn():
            q, sq = quantize_rows(xs)
            h = torch._scaled_grouped_mm(q, w_gate_up, sq, s_gate_up, offs=offs,
                                         out_dtype=torch.bfloat16)
            a = F.silu(h[:, :inter]) * h[:, inter:]
            qa, sa = quantize_rows(a)
            return torch._scaled_grouped_mm(qa, w_down, sa, s_down, offs=offs,
                                            out_dtype=torch.bfloat16)

        ms = time_ms(ffn)
        print(f"  {tokens:7d} {ms * 1e3:10.1f} us")
        emit({"section": "torch_ffn_fp8", "tokens": tokens, "us": ms * 1e3})


def hf_decode(layers, batches, emit):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
    cfg = Qwen3MoeConfig(vocab_size=151936, hidden_size=2048, num_hidden_layers=layers,
                         num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                         num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768,
                         intermediate_size=6144, max_position_embeddings=40960,
                         rope_theta=1e6, norm_topk_prob=True, tie_word_embeddings=False)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = Qwen3MoeForCausalLM._from_config(cfg, torch_dtype=torch.bfloat16).eval()
    ctx = 1024
    print(f"[hf] transformers Qwen3MoeForCausalLM, {layers} layers of the 30B-A3B shape, "
          f"context {ctx}")
    for batch in batches:
        ids = torch.randint(3, 150000, (batch, ctx), device="cuda")
        with torch.no_grad():
            out = model(input_ids=ids, use_cache=True)
            past = out.past_key_values
            step_ids = torch.randint(3, 150000, (batch, 1), device="cuda")

            def step():
                nonlocal past
                o = model(input_ids=step_ids, past_key_values=past, use_cache=True)
                past = o.past_key_values

            ms = time_ms(step, warmup=1, reps=5)
        print(f"  batch {batch:4d}: {ms:8.2f} ms per step, {ms / layers:7.2f} ms per layer")
        emit({"section": "hf_decode", "batch": batch, "layers": layers, "step_ms": ms,
              "ms_per_layer": ms / layers})
        del past
        torch.cuda.empty_cache()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--json", default="")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--hf-layers", type=int, default=2)
    p.add_argument("--fp8", action="store_true", help="the FP8 grouped FFN baseline alone")
    a = p.parse_args()
    sink = open(a.json, "w") if a.json else None

    def emit(row):
        if sink:
            sink.write(json.dumps(row) + "\n")
            sink.flush()

    print(f"torch {torch.__version__} on {torch.cuda.get_device_name()}")
    if a.fp8:
        sizes = [16, 1024, 16384] if a.quick else [16, 128, 1024, 4096, 16384]
        try:
            grouped_ffn(sizes, emit)
            grouped_ffn_fp8(sizes, emit)
        except Exception as e:  # noqa: BLE001 - PyTorch builds without it say so here
            print(f"[ffn-fp8] failed: {e!r}")
        return
    grouped_ffn([16, 1024] if a.quick else [16, 64, 256, 1024, 4096, 16384], emit)
    try:
        hf_decode(a.hf_layers, [1, 32] if a.quick else [1, 32, 128], emit)
    except Exception as e:  # noqa: BLE001 - the table says what failed
        print(f"[hf] failed: {e!r}")


if __name__ == "__main__":
    main()
