#!/usr/bin/env python3
"""Writes the seed corpora for tests/fuzz: small valid and broken safetensors images and
config.json files. Standard library only; deterministic, so re-running it reproduces the
committed files exactly.

usage: scripts/make_fuzz_corpus.py [--out tests/fuzz/corpus]
"""

import argparse
import json
import pathlib
import shutil
import struct

SIZES = {"F32": 4, "F16": 2, "BF16": 2}


def image(header, data=b"", pad=True):
    """A safetensors image: u64 little-endian header length, header, data block."""
    text = header if isinstance(header, (bytes, str)) else json.dumps(header, separators=(",", ":"))
    if isinstance(text, str):
        text = text.encode()
    if pad:
        text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text + data


def f32(values):
    return struct.pack(f"<{len(values)}f", *values)


def f16(values):
    return struct.pack(f"<{len(values)}e", *values)


def bf16(values):
    out = b""
    for v in values:
        bits = struct.unpack("<I", struct.pack("<f", v))[0]
        bits += 0x7FFF + ((bits >> 16) & 1)  # round to nearest even
        out += struct.pack("<H", (bits >> 16) & 0xFFFF)
    return out


ENCODE = {"F32": f32, "F16": f16, "BF16": bf16}


def checkpoint(tensors, metadata=None):
    """tensors: list of (name, dtype, shape, values). Returns a valid image."""
    header = {}
    if metadata is not None:
        header["__metadata__"] = metadata
    data = b""
    for name, dtype, shape, values in tensors:
        blob = ENCODE[dtype](values)
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [len(data), len(data) + len(blob)]}
        data += blob
    return image(header, data)


def entry(dtype, shape, offsets):
    return {"dtype": dtype, "shape": shape, "data_offsets": offsets}


def safetensors_seeds():
    seeds = {}
    seeds["valid_all_dtypes"] = checkpoint(
        [
            ("model.embed_tokens.weight", "BF16", [4, 3], [0.5 * i - 2 for i in range(12)]),
            ("model.norm.weight", "F32", [3], [1.0, -2.5, 3.25]),
            ("model.layers.0.mlp.gate.weight", "F16", [2, 3], [1e-5, 65504.0, -0.0, 0.1, 2.0, -3.0]),
        ],
        metadata={"format": "pt"},
    )
    seeds["valid_scalar_and_empty"] = checkpoint(
        [("scalar", "F32", [], [42.0]), ("empty", "BF16", [0, 4], [])], metadata={"format": "pt"}
    )
    seeds["valid_no_metadata"] = checkpoint([("w", "F16", [2, 2], [1.0, 2.0, 3.0, 4.0])])
    seeds["valid_empty_header"] = image({})
    seeds["valid_null_metadata"] = image({"__metadata__": None})
    seeds["valid_unpadded_unaligned"] = image(
        {"a": entry("F32", [1], [0, 4]), "b": entry("BF16", [3], [4, 10])}, f32([1.5]) + bf16([1, 2, 3]), pad=False
    )
    seeds["valid_special_values"] = checkpoint(
        [("s", "F32", [4], [float("inf"), float("-inf"), float("nan"), 1e-45]),
         ("h", "F16", [3], [float("inf"), 6e-8, -6.1e-5])]
    )

    w = "model.norm.weight"

    def one(e, data_bytes):
        return image({w: e}, b"\0" * data_bytes)

    seeds["bad_short"] = b"\x08\0\0\0"
    seeds["bad_header_too_long"] = struct.pack("<Q", 4096) + b"{}"
    seeds["bad_header_absurd"] = struct.pack("<Q", 1 << 40) + b"{}"
    seeds["bad_not_json"] = image("{not json")
    seeds["bad_array_header"] = image("[1,2,3]")
    seeds["bad_entry_not_object"] = one([1, 2], 0)
    seeds["bad_missing_dtype"] = one({"shape": [1], "data_offsets": [0, 4]}, 4)
    seeds["bad_missing_shape"] = one({"dtype": "F32", "data_offsets": [0, 4]}, 4)
    seeds["bad_missing_offsets"] = one({"dtype": "F32", "shape": [1]}, 4)
    seeds["bad_dtype_i64"] = one(entry("I64", [1], [0, 8]), 8)
    seeds["bad_dtype_type"] = one(entry(7, [1], [0, 4]), 4)
    seeds["bad_negative_dim"] = one(entry("F32", [2, -1], [0, 8]), 8)
    seeds["bad_float_dim"] = one(entry("F32", [1.5], [0, 4]), 4)
    seeds["bad_shape_overflow"] = one(entry("F32", [1 << 32, 1 << 32, 4], [0, 4]), 4)
    seeds["bad_offsets_one"] = one(entry("F32", [1], [4]), 4)
    seeds["bad_offsets_descending"] = one(entry("F32", [1], [8, 4]), 8)
    seeds["bad_offsets_beyond"] = one(entry("F32", [20], [0, 80]), 64)
    seeds["bad_offsets_huge"] = one(entry("F32", [1], [2**64 - 4, 2**64 - 1]), 4)
    seeds["bad_length_mismatch"] = one(entry("BF16", [3], [0, 8]), 8)
    seeds["bad_overlap"] = image({"a": entry("F32", [4], [0, 16]), "b": entry("F32", [2], [8, 16])}, b"\0" * 16)
    seeds["bad_hole"] = image({"a": entry("F32", [1], [0, 4]), "b": entry("F32", [1], [8, 12])}, b"\0" * 12)
    seeds["bad_trailing"] = one(entry("F32", [1], [0, 4]), 12)
    seeds["bad_duplicate"] = image(
        '{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},"a":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}}',
        b"\0" * 8,
    )
    seeds["bad_metadata_value"] = image({"__metadata__": {"format": 1}})
    seeds["bad_metadata_type"] = image({"__metadata__": ["pt"]})
    seeds["bad_deep_nesting"] = image("{\"x\":" + "[" * 500 + "]" * 500 + "}")
    valid = seeds["valid_all_dtypes"]
    seeds["bad_truncated_half"] = valid[: len(valid) // 2]
    return seeds


QWEN3_30B_A3B = {
    "architectures": ["Qwen3MoeForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 151643,
    "decoder_sparse_step": 1,
    "eos_token_id": 151645,
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 2048,
    "initializer_range": 0.02,
    "intermediate_size": 6144,
    "max_position_embeddings": 40960,
    "max_window_layers": 48,
    "mlp_only_layers": [],
    "model_type": "qwen3_moe",
    "moe_intermediate_size": 768,
    "norm_topk_prob": True,
    "num_attention_heads": 32,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "num_hidden_layers": 48,
    "num_key_value_heads": 4,
    "output_router_logits": False,
    "rms_norm_eps": 1e-06,
    "rope_scaling": None,
    "rope_theta": 1000000.0,
    "router_aux_loss_coef": 0.001,
    "sliding_window": None,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.51.0",
    "use_cache": True,
    "use_sliding_window": False,
    "vocab_size": 151936,
}

SMALL = {
    "model_type": "qwen3_moe",
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 96,
    "moe_intermediate_size": 32,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "decoder_sparse_step": 2,
    "mlp_only_layers": [0],
    "norm_topk_prob": True,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "max_position_embeddings": 512,
    "hidden_act": "silu",
    "torch_dtype": "float32",
    "eos_token_id": [1, 2],
    "bos_token_id": 0,
}


def config_seeds():
    seeds = {}

    def dump(obj):
        return json.dumps(obj, indent=1).encode()

    def small(**changes):
        c = dict(SMALL)
        for k, v in changes.items():
            if v is KeyError:
                c.pop(k, None)
            else:
                c[k] = v
        return dump(c)

    seeds["valid_qwen3_30b_a3b"] = dump(QWEN3_30B_A3B)
    seeds["valid_small"] = dump(SMALL)
    seeds["valid_empty_object"] = b"{}"
    seeds["valid_v5_spelling"] = small(
        torch_dtype=KeyError, rope_theta=KeyError, dtype="bfloat16",
        rope_parameters={"rope_type": "default", "rope_theta": 1e6},
    )
    seeds["valid_v5_saved"] = small(
        torch_dtype=KeyError, rope_theta=KeyError, num_experts=KeyError, dtype="bfloat16",
        num_local_experts=8, pad_token_id=None, transformers_version="5.24.0",
        rope_parameters={"rope_theta": 1000000.0, "rope_type": "default"},
    )
    seeds["valid_no_head_dim"] = small(head_dim=KeyError, eos_token_id=3)
    seeds["valid_dense"] = small(num_experts=0, num_experts_per_tok=0, moe_intermediate_size=0)
    seeds["valid_rope_scaling_default"] = small(rope_scaling={"type": "default"})
    seeds["bad_not_json"] = b'{"hidden_size": '
    seeds["bad_array"] = b"[1, 2]"
    seeds["bad_type_hidden_size"] = small(hidden_size="64")
    seeds["bad_type_eos"] = small(eos_token_id=["a"])
    seeds["bad_rope_yarn"] = small(rope_scaling={"rope_type": "yarn", "factor": 4.0})
    seeds["bad_kv_heads"] = small(num_key_value_heads=3)
    seeds["bad_topk"] = small(num_experts_per_tok=9)
    seeds["bad_head_dim_odd"] = small(head_dim=15)
    seeds["bad_act"] = small(hidden_act="gelu")
    seeds["bad_model_type"] = small(model_type="qwen2")
    seeds["bad_eps"] = small(rms_norm_eps=0)
    seeds["bad_sparse_step"] = small(decoder_sparse_step=0)
    seeds["bad_mlp_only_range"] = small(mlp_only_layers=[4])
    seeds["bad_eos_range"] = small(eos_token_id=256)
    seeds["bad_huge_vocab"] = small(vocab_size=1 << 40)
    seeds["bad_int_overflow"] = small(num_experts=2**64 - 1)
    return seeds


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    root = pathlib.Path(__file__).resolve().parent.parent
    parser.add_argument("--out", type=pathlib.Path, default=root / "tests" / "fuzz" / "corpus")
    args = parser.parse_args()
    for kind, seeds in (("safetensors", safetensors_seeds()), ("config", config_seeds())):
        directory = args.out / kind
        if directory.exists():
            shutil.rmtree(directory)
        directory.mkdir(parents=True)
        suffix = ".safetensors" if kind == "safetensors" else ".json"
        for name, data in sorted(seeds.items()):
            assert len(data) < 4096, (kind, name, len(data))
            (directory / (name + suffix)).write_bytes(data)
        print(f"{directory}: {len(seeds)} files")


if __name__ == "__main__":
    main()
