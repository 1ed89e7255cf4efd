#!/usr/bin/env python3
"""FP8 checkpoints of `dxs gen-model --fp8` against Hugging Face transformers on the CPU.

For the presets default, odd and bf16-sharded: `dxs gen-model --fp8` writes the checkpoint
(F8_E4M3 weights with F32 128x128 block scales, weight_scale_inv). This test reads those
files itself, independently of dxs: the fp8 bytes are decoded through a table built here
from the e4m3fn bit formula and multiplied by their block's scale in float32 (numpy). The
dequantized weights go, with config.json minus its quantization_config, into a float32
checkpoint that transformers' Qwen3MoeForCausalLM loads (float32, CPU, eager attention), and
its greedy continuation and first-position logits must equal `dxs run` on the FP8 checkpoint
(CPU): the same tokens and logits within 1e-4 relative (max |diff| / max |ref|), the golden
tests' tolerance for float32. Both sides dequantize exactly alike (one float32 product per
weight), so the only difference left is the order of float32 arithmetic, as for the golden
tests.

transformers (5.x) also loads the fine-grained FP8 config itself: without a GPU it
dequantizes on load (fp8 x scale in float32, then the model's dtype). Where every quantized
dimension is a multiple of 128 or below 128 (presets default and bf16-sharded), that native
load must give the same tokens and logits too. transformers derives the block size as
dimension / number of scales, so it misreads partial blocks (odd: 144 rows in blocks of
128 and 16 read as 72 and 72); the official checkpoints have none, and for odd only the
numpy path is compared.

The checkpoint must also hold what the official FP8 checkpoints hold: every *_proj.weight
F8_E4M3 with a [ceil(out/128), ceil(in/128)] F32 scale whose block amax maps to 448, the
embeddings, norms, router gate and lm_head in the preset's dtype.

Needs torch, transformers and numpy (exit 77, skipped, without them; the native FP8 load
also accelerate):
    python3 tests/python/fp8_hf_test.py --bin-dir build/bin --source-dir .
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import unittest

try:
    import numpy as np
    import torch
    import transformers  # noqa: F401
    from transformers import Qwen3MoeForCausalLM
except ImportError as e:  # pragma: no cover
    print(f"skipped: {e}")
    sys.exit(77)

# The golden tests' prompts (tools/hf_reference.py), imported once torch is known present.
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tools"))
from hf_reference import prompts_for  # noqa: E402
from fp8_checkpoint import (dequantized_weights, read_checkpoint,  # noqa: E402
                            write_float32_reference)

try:
    import accelerate  # noqa: F401  (transformers' FP8 loader needs it)
    HAVE_ACCELERATE = True
except ImportError:
    HAVE_ACCELERATE = False

ARGS = None
PRESETS = ["default", "odd", "bf16-sharded"]
MAX_NEW_TOKENS = 16
TOLERANCE = 1e-4  # tests/model/golden_test.cc: float32 logits, relative to the largest


@torch.no_grad()
def hf_greedy(model, prompt, eos_ids):
    out = model(input_ids=torch.tensor([prompt]), use_cache=True)
    first = out.logits[0, -1].float()
    logits, past, tokens = first, out.past_key_values, []
    for _ in range(MAX_NEW_TOKENS):
        token = int(torch.argmax(logits))
        tokens.append(token)
        if token in eos_ids:
            break
        out = model(input_ids=torch.tensor([[token]]), past_key_values=past, use_cache=True)
        past, logits = out.past_key_values, out.logits[0, -1].float()
    return tokens, first.numpy()


def dxs(*args):
    return subprocess.run([os.path.join(ARGS.bin_dir, "dxs")] + list(args), check=True,
                          capture_output=True, text=True, timeout=600).stdout


class Fp8HfTest(unittest.TestCase):
    def check_preset(self, preset):
        with tempfile.TemporaryDirectory() as tmp:
            fp8_dir = os.path.join(tmp, "fp8")
            ref_dir = os.path.join(tmp, "ref")
            dxs("gen-model", "--preset", preset, "--fp8", "--out", fp8_dir)
            with open(os.path.join(fp8_dir, "config.json")) as f:
                config = json.load(f)
            q = config["quantization_config"]
            self.assertEqual((q["quant_method"], q["fmt"], q["activation_scheme"],
                              q["weight_block_size"]), ("fp8", "e4m3", "dynamic", [128, 128]))
            self.assertIn("model.layers.0.mlp.gate", q["modules_to_not_convert"])
            if not config["tie_word_embeddings"]:
                self.assertIn("lm_head", q["modules_to_not_convert"])
            raw = read_checkpoint(fp8_dir)
            stored = "BF16" if config["torch_dtype"] == "bfloat16" else "F32"
            quantized, native_ok = 0, True
            for name, (dtype, shape, data) in raw.items():
                if name.endswith("_scale_inv"):
                    continue
                if name.endswith("_proj.weight"):
                    self.assertEqual(dtype, "F8_E4M3", name)
                    s_dtype, s_shape, s_data = raw[name + "_scale_inv"]
                    self.assertEqual(s_dtype, "F32", name)
                    self.assertEqual(s_shape, [-(-shape[0] // 128), -(-shape[1] // 128)], name)
                    native_ok &= all(d < 128 or d % 128 == 0 for d in shape)
                    codes = np.frombuffer(data, dtype=np.uint8)
                    self.assertFalse(np.any((codes & 0x7F) == 0x7F), f"{name}: NaN code")
                    # amax / 448 scaling: some weight of every block is at +-448 (0x7e).
                    codes = codes.reshape(shape)
                    for br in range(s_shape[0]):
                        for bc in range(s_shape[1]):
                            block = codes[br * 128:(br + 1) * 128, bc * 128:(bc + 1) * 128]
                            self.assertTrue(np.any((block & 0x7F) == 0x7E), f"{name} block")
                    quantized += 1
                else:
                    self.assertEqual(dtype, stored, name)
            # Every F8 tensor is a *_proj.weight (checked above): each times its scales.
            weights = dequantized_weights(raw)
            self.assertGreater(quantized, 0)
            self.assertEqual(len(raw), len(weights) + quantized)

            write_float32_reference(fp8_dir, weights, ref_dir)
            model, info = Qwen3MoeForCausalLM.from_pretrained(
                ref_dir, dtype=torch.float32, attn_implementation="eager",
                output_loading_info=True)
            for key in ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs"):
                self.assertFalse(info.get(key), f"{preset}: {key}: {info.get(key)}")
            model.eval()
            models = [("numpy-dequantized", model)]
            if native_ok and HAVE_ACCELERATE:
                native, info = Qwen3MoeForCausalLM.from_pretrained(
                    fp8_dir, dtype=torch.float32, attn_implementation="eager",
                    output_loading_info=True)
                for key in ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs"):
                    self.assertFalse(info.get(key), f"{preset} native: {key}: {info.get(key)}")
                native.eval()
                models.append(("transformers fp8", native))
            eos = config["eos_token_id"]
            eos_ids = set(eos if isinstance(eos, list) else [eos])
            for prompt in prompts_for(config["vocab_size"], seed=len(preset) * 7919):
                out = json.loads(dxs("run", "--model", fp8_dir, "--prompt-ids",
                                     ",".join(map(str, prompt)), "--max-new-tokens",
                                     str(MAX_NEW_TOKENS), "--dump-logits", "--format", "json"))
                got = np.array(out["first_logits"], dtype=np.float64)
                for label, m in models:
                    tokens, first = hf_greedy(m, prompt, eos_ids)
                    rel = np.max(np.abs(got - first)) / np.max(np.abs(first))
                    what = f"{preset} {label}: prompt {len(prompt)}"
                    print(f"{what}: {tokens}, logits rel {rel:.2e}", file=sys.stderr)
                    self.assertLess(rel, TOLERANCE, what)
                    self.assertEqual(out["tokens"], tokens, what)

    def test_default(self):
        self.check_preset("default")

    def test_odd(self):
        self.check_preset("odd")

    def test_bf16_sharded(self):
        self.check_preset("bf16-sharded")


def main():
    global ARGS
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin-dir", required=True)
    ap.add_argument("--source-dir", default=".")
    ARGS, rest = ap.parse_known_args()
    unittest.main(argv=[sys.argv[0]] + rest)


if __name__ == "__main__":
    main()
