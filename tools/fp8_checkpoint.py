"""Reads a `dxs gen-model --fp8` checkpoint without dxs: the safetensors files parsed here,
float8_e4m3fn decoded from its definition and each weight multiplied by its 128 x 128 block's
scale in float32 (the FP8 reference of tests/python/fp8_hf_test.py and tools/hf_reference.py's
FP8 presets). Needs numpy only.
"""
import json
import os
import shutil
import struct

import numpy as np

BLOCK = 128  # weight_block_size [128, 128]


def e4m3_table():
    """float8_e4m3fn from its definition: bias 7, 3 mantissa bits, 0x7f/0xff NaN."""
    table = np.zeros(256, dtype=np.float64)
    for code in range(256):
        s, e, m = code >> 7, (code >> 3) & 15, code & 7
        if e == 15 and m == 7:
            v = float("nan")
        elif e == 0:
            v = 2.0 ** -6 * (m / 8.0)
        else:
            v = 2.0 ** (e - 7) * (1.0 + m / 8.0)
        table[code] = -v if s else v
    return table.astype(np.float32)


E4M3 = e4m3_table()


def read_safetensors(path):
    """{name: (dtype string, shape, raw bytes)} of one file, parsed here (no safetensors lib)."""
    with open(path, "rb") as f:
        data = f.read()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    base = 8 + n
    out = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        b, e = entry["data_offsets"]
        out[name] = (entry["dtype"], entry["shape"], data[base + b:base + e])
    return out


def read_checkpoint(d):
    tensors = {}
    for f in sorted(os.listdir(d)):
        if f.endswith(".safetensors"):
            tensors.update(read_safetensors(os.path.join(d, f)))
    return tensors


def to_float32(dtype, shape, raw):
    if dtype == "F32":
        return np.frombuffer(raw, dtype="<f4").reshape(shape).copy()
    if dtype == "BF16":
        u = np.frombuffer(raw, dtype="<u2").astype(np.uint32) << 16
        return u.view(np.float32).reshape(shape).copy()
    if dtype == "F8_E4M3":
        return E4M3[np.frombuffer(raw, dtype=np.uint8)].reshape(shape)
    raise ValueError(f"unexpected dtype {dtype}")


def dequantize(q, scale):
    rows, cols = q.shape
    full = np.repeat(np.repeat(scale, BLOCK, axis=0), BLOCK, axis=1)[:rows, :cols]
    return (q * full).astype(np.float32)  # one float32 product per weight


def write_safetensors(path, tensors):
    header, blobs, offset = {}, [], 0
    for name, arr in tensors.items():
        b = np.ascontiguousarray(arr, dtype="<f4").tobytes()
        header[name] = {"dtype": "F32", "shape": list(arr.shape),
                        "data_offsets": [offset, offset + len(b)]}
        blobs.append(b)
        offset += len(b)
    text = json.dumps(header).encode()
    text += b" " * ((8 - len(text) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for b in blobs:
            f.write(b)


def dequantized_weights(raw):
    """{name: float32 array} of a checkpoint's tensors: each *_proj.weight in F8_E4M3 times its
    *_scale_inv blocks, every other tensor widened; the scales themselves dropped."""
    weights = {}
    for name, (dtype, shape, data) in raw.items():
        if name.endswith("_scale_inv"):
            continue
        if dtype == "F8_E4M3":
            s_dtype, s_shape, s_data = raw[name + "_scale_inv"]
            weights[name] = dequantize(to_float32(dtype, shape, data),
                                       to_float32(s_dtype, s_shape, s_data))
        else:
            weights[name] = to_float32(dtype, shape, data)
    return weights


def write_float32_reference(fp8_dir, weights, out_dir):
    """A float32 checkpoint of `weights` in out_dir, with fp8_dir's config less its
    quantization_config (and its tokenizer files): what transformers loads as the reference."""
    os.makedirs(out_dir)
    write_safetensors(os.path.join(out_dir, "model.safetensors"), weights)
    with open(os.path.join(fp8_dir, "config.json")) as f:
        config = json.load(f)
    config.pop("quantization_config", None)
    config["torch_dtype"] = "float32"
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config, f)
    for name in os.listdir(fp8_dir):
        if name.startswith("tokenizer") or name == "generation_config.json":
            shutil.copy(os.path.join(fp8_dir, name), out_dir)
