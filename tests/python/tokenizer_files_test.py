#!/usr/bin/env python3
"""The tokenizer files `dxs gen-model` writes, as Hugging Face `tokenizers` reads them.

For the presets default and odd (and the in-place qwen3-30b-a3b): tokenizer.json loads with
`tokenizers.Tokenizer.from_file`, holds exactly config.json's vocab_size ids, round-trips
text (non-ASCII, emoji, whitespace, newlines) exactly, and has the special tokens at the
config's ids; tokenizer_config.json's chat template renders Qwen3's format with jinja2 when
the virtualenv has it. The fingerprint is the golden one, with or without the files, and
an embedded default model cached without them gets them on its next use.

Run by ctest with the project's virtualenv (scripts/setup.sh creates it):
    .venv/bin/python3 tests/python/tokenizer_files_test.py --bin-dir build/bin --source-dir .
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import unittest

try:
    import tokenizers
except ImportError:
    tokenizers = None
try:
    import jinja2
except ImportError:
    jinja2 = None

ARGS = None
TEXTS = [
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog.",
    "  leading and trailing spaces  ",
    "line one\nline two\n\n\ttabbed\r\nwindows line",
    "héllo wörld — naïve café, 日本語のテキスト, Ελληνικά, русский",
    "emoji 😀👍🏽👩‍👩‍👧 and symbols ∑∫√ ™ ©",
    "numbers 1234567890 3.14159 -42",
    "code: def f(x):\n    return x ** 2  # square\n",
    "",
    " ",
    "\n",
]
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")


def dxs(*args, env=None):
    return subprocess.run([os.path.join(ARGS.bin_dir, "dxs")] + list(args), check=True,
                          capture_output=True, text=True, env=env, timeout=120).stdout


def read_json(path):
    with open(path, encoding="utf-8") as f:
        return json.load(f)


class TokenizerFilesTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.TemporaryDirectory(prefix="dxs-tokenizer-")

    @classmethod
    def tearDownClass(cls):
        cls.tmp.cleanup()

    def gen_model(self, preset, *extra):
        out = os.path.join(self.tmp.name, preset + "".join(extra))
        if not os.path.exists(os.path.join(out, "config.json")):
            dxs("gen-model", "--preset", preset, "--out", out, *extra)
        return out

    def check_tokenizer(self, model):
        config = read_json(os.path.join(model, "config.json"))
        tok = tokenizers.Tokenizer.from_file(os.path.join(model, "tokenizer.json"))
        vocab_size = config["vocab_size"]
        self.assertEqual(tok.get_vocab_size(), vocab_size)
        self.assertEqual(sorted(tok.get_vocab().values()), list(range(vocab_size)))
        for text in TEXTS:
            ids = tok.encode(text).ids
            self.assertTrue(all(0 <= i < vocab_size for i in ids))
            self.assertEqual(tok.decode(ids), text, "round trip of %r" % text)

        eos = config["eos_token_id"]
        eos = eos if isinstance(eos, list) else [eos]
        self.assertEqual(tok.token_to_id("<|im_end|>"), eos[0])
        for extra in eos[1:]:
            self.assertEqual(tok.token_to_id("<|eos_%d|>" % extra), extra)
        self.assertEqual(tok.token_to_id("<|endoftext|>"), config["bos_token_id"])
        for name in ("<|im_start|>", "<think>", "</think>"):
            self.assertIsNotNone(tok.token_to_id(name), name)
        # Special tokens are one id each in text, and decode back when kept.
        chat = "<|im_start|>user\nhi<|im_end|>\n<think>\n\n</think>\n\n"
        ids = tok.encode(chat).ids
        self.assertEqual(ids[0], tok.token_to_id("<|im_start|>"))
        self.assertIn(eos[0], ids)
        self.assertIn(tok.token_to_id("<think>"), ids)
        self.assertEqual(tok.decode(ids, skip_special_tokens=False), chat)
        # <think> is not special (Qwen3): it survives skip_special_tokens, <|im_end|> does not.
        self.assertEqual(tok.decode(ids), "user\nhi\n<think>\n\n</think>\n\n")

        gen = read_json(os.path.join(model, "generation_config.json"))
        self.assertEqual(gen["eos_token_id"], eos)
        self.assertEqual(gen["bos_token_id"], config["bos_token_id"])
        self.assertEqual(gen["pad_token_id"], tok.token_to_id("<|endoftext|>"))
        tok_config = read_json(os.path.join(model, "tokenizer_config.json"))
        self.assertEqual(tok_config["eos_token"], "<|im_end|>")
        self.assertEqual(tok_config["pad_token"], "<|endoftext|>")
        self.assertEqual(tok_config["model_max_length"], config["max_position_embeddings"])
        for id_text, entry in tok_config["added_tokens_decoder"].items():
            self.assertEqual(tok.token_to_id(entry["content"]), int(id_text))
        self.check_chat_template(tok_config["chat_template"])

    def check_chat_template(self, template):
        if jinja2 is None:
            print("jinja2 is not installed in this virtualenv: the chat template is not rendered",
                  file=sys.stderr)
            return
        t = jinja2.Environment().from_string(template)
        messages = [{"role": "system", "content": "Be brief."},
                    {"role": "user", "content": "Hi 😀"}]
        self.assertEqual(t.render(messages=messages, add_generation_prompt=False),
                         "<|im_start|>system\nBe brief.<|im_end|>\n"
                         "<|im_start|>user\nHi 😀<|im_end|>\n")
        self.assertEqual(t.render(messages=messages[1:], add_generation_prompt=True),
                         "<|im_start|>user\nHi 😀<|im_end|>\n<|im_start|>assistant\n")
        self.assertEqual(
            t.render(messages=messages[1:], add_generation_prompt=True, enable_thinking=False),
            "<|im_start|>user\nHi 😀<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n")
        parts = [{"role": "user", "content": [{"type": "text", "text": "a"},
                                              {"type": "text", "text": "b"}]}]
        self.assertEqual(t.render(messages=parts), "<|im_start|>user\nab<|im_end|>\n")

    def test_default(self):
        self.check_tokenizer(self.gen_model("default"))

    def test_odd(self):
        self.check_tokenizer(self.gen_model("odd"))

    def test_qwen3_30b_a3b_in_place(self):
        model = self.gen_model("qwen3-30b-a3b", "--in-place")
        self.check_tokenizer(model)
        tok = tokenizers.Tokenizer.from_file(os.path.join(model, "tokenizer.json"))
        self.assertEqual(tok.token_to_id("<|endoftext|>"), 151643)
        self.assertEqual(tok.token_to_id("<|im_end|>"), 151645)

    def test_fingerprint_is_golden_and_ignores_tokenizer_files(self):
        for preset in ("default", "odd"):
            model = self.gen_model(preset)
            golden = read_json(os.path.join(ARGS.source_dir, "tests", "golden", preset + ".json"))
            self.assertEqual(dxs("fingerprint", "--model", model).strip(), golden["fingerprint"])

    def test_cached_default_without_tokenizer_files_gets_them(self):
        cache = os.path.join(self.tmp.name, "cache")
        model = os.path.join(cache, "default")
        dxs("gen-model", "--preset", "default", "--out", model)
        fingerprint = dxs("fingerprint", "--model", model)
        with open(os.path.join(model, "tokenizer.json"), "rb") as f:
            expected = f.read()
        for name in TOKENIZER_FILES:
            os.remove(os.path.join(model, name))
        weights = os.path.join(model, "model.safetensors")
        mtime = os.stat(weights).st_mtime_ns
        env = dict(os.environ, DXS_CACHE_DIR=cache)
        dxs("run", "--prompt-ids", "5,6,7", "--max-new-tokens", "1", env=env)
        for name in TOKENIZER_FILES:
            self.assertTrue(os.path.exists(os.path.join(model, name)), name)
        with open(os.path.join(model, "tokenizer.json"), "rb") as f:
            self.assertEqual(f.read(), expected)
        self.assertEqual(os.stat(weights).st_mtime_ns, mtime)
        self.assertEqual(dxs("fingerprint", "--model", model), fingerprint)


def main():
    global ARGS
    parser = argparse.ArgumentParser()
    parser.add_argument("--bin-dir", required=True)
    parser.add_argument("--source-dir", required=True)
    ARGS, rest = parser.parse_known_args()
    if tokenizers is None:
        print("the Hugging Face tokenizers package is not installed: run scripts/setup.sh")
        sys.exit(77)
    unittest.main(argv=[sys.argv[0]] + rest, verbosity=2)


if __name__ == "__main__":
    main()
