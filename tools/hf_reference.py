#!/usr/bin/env python3
"""Reference outputs from Hugging Face transformers for dxs's golden tests.

For each checkpoint preset, this script asks `dxs gen-model` to write the seeded random
checkpoint, loads it with transformers' Qwen3MoeForCausalLM in float32 on the CPU, and for
fixed prompts records the greedy continuation (KV-cached decode, stopping at EOS like
generate() does) and the logits of the first generated position. The result, with the
checkpoint's fingerprint and the library versions, goes to tests/golden/<preset>.json.
A preset named X-fp8 is `gen-model --preset X --fp8` (block-scaled FP8 weights); transformers
then runs its weights dequantized in float32 by tools/fp8_checkpoint.py (numpy), the same
reference as tests/python/fp8_hf_test.py, with X's prompts.

    pip install torch transformers safetensors numpy
    python3 tools/hf_reference.py --dxs build/bin/dxs --out tests/golden

The C++ tests regenerate the checkpoint with the same binary, check the fingerprint, and
compare against these files; they never need torch.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

import torch
import transformers
from transformers import Qwen3MoeForCausalLM

from fp8_checkpoint import dequantized_weights, read_checkpoint, write_float32_reference

PRESETS = ["default", "odd", "bf16-sharded", "default-fp8", "odd-fp8", "bf16-sharded-fp8"]
MAX_NEW_TOKENS = 16


def prompts_for(vocab_size, seed):
    """Three prompts of lengths 1, 7 and 23 with ids spread over the vocabulary."""
    state = seed & 0xFFFFFFFF
    out = []
    for length in (1, 7, 23):
        ids = []
        for _ in range(length):
            state = (state * 1103515245 + 12345) & 0x7FFFFFFF
            ids.append(3 + state % (vocab_size - 3))  # skip 0..2 (pad/bos/eos)
        out.append(ids)
    return out


@torch.no_grad()
def greedy(model, prompt, eos_ids, max_new_tokens):
    input_ids = torch.tensor([prompt], dtype=torch.long)
    out = model(input_ids=input_ids, use_cache=True)
    first_logits = out.logits[0, -1].float()
    past = out.past_key_values
    logits = first_logits
    tokens = []
    for _ in range(max_new_tokens):
        token = int(torch.argmax(logits))
        tokens.append(token)
        if token in eos_ids:
            break
        out = model(input_ids=torch.tensor([[token]]), past_key_values=past, use_cache=True)
        past = out.past_key_values
        logits = out.logits[0, -1].float()
    return tokens, first_logits.tolist()


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dxs", default="build/bin/dxs", help="path to the dxs binary")
    ap.add_argument("--out", default="tests/golden", help="output directory")
    ap.add_argument("--presets", default=",".join(PRESETS))
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    torch.manual_seed(0)
    for preset in args.presets.split(","):
        fp8 = preset.endswith("-fp8")
        base = preset[:-len("-fp8")] if fp8 else preset
        with tempfile.TemporaryDirectory() as tmp:
            ckpt = os.path.join(tmp, "checkpoint")
            subprocess.run([args.dxs, "gen-model", "--preset", base, "--out", ckpt] +
                           (["--fp8"] if fp8 else []), check=True)
            fingerprint = subprocess.run([args.dxs, "fingerprint", "--model", ckpt], check=True,
                                         capture_output=True, text=True).stdout.strip()
            load_dir = ckpt
            if fp8:
                load_dir = os.path.join(tmp, "float32")
                write_float32_reference(ckpt, dequantized_weights(read_checkpoint(ckpt)),
                                        load_dir)
            model, info = Qwen3MoeForCausalLM.from_pretrained(
                load_dir, dtype=torch.float32, attn_implementation="eager",
                output_loading_info=True)
            # Every tensor must come from the checkpoint: nothing freshly initialised.
            bad = {k: v for k, v in info.items() if v and k != "error_msgs" or
                   (k == "error_msgs" and v)}
            if bad:
                sys.exit(f"{preset}: checkpoint did not load cleanly: {bad}")
            model.eval()
            cfg = model.config
            eos = cfg.eos_token_id
            eos_ids = set(eos if isinstance(eos, list) else [eos])
            cases = []
            for prompt in prompts_for(cfg.vocab_size, seed=len(base) * 7919):
                tokens, first_logits = greedy(model, prompt, eos_ids, MAX_NEW_TOKENS)
                cases.append({
                    "prompt_ids": prompt,
                    "max_new_tokens": MAX_NEW_TOKENS,
                    "tokens": tokens,
                    "first_logits": [float("%.9g" % v) for v in first_logits],
                })
                print(f"{preset}: prompt {len(prompt)} tokens -> {tokens}", file=sys.stderr)
        result = {
            "preset": preset,
            "fingerprint": fingerprint,
            "reference": "transformers.Qwen3MoeForCausalLM float32 CPU, eager attention" +
                         (", FP8 weights dequantized in float32" if fp8 else ""),
            "transformers_version": transformers.__version__,
            "torch_version": torch.__version__,
            "cases": cases,
        }
        path = os.path.join(args.out, f"{preset}.json")
        with open(path, "w") as f:
            json.dump(result, f, separators=(",", ":"))
            f.write("\n")
        print(f"wrote {path}", file=sys.stderr)


if __name__ == "__main__":
    main()
