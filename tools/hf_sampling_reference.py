#!/usr/bin/env python3
"""Reference outputs from Hugging Face transformers for dxs's sampling-feature golden tests.

For each small f32 checkpoint preset, this script asks `dxs gen-model` to write the seeded
random checkpoint, loads it with transformers' Qwen3MoeForCausalLM in float32 on the CPU
(eager attention), and decodes a few requests that use the OpenAI-style sampling features:
log-probabilities with top alternatives and named ids, the repetition, frequency and presence
penalties, logit_bias, min_new_tokens with stop ids and EOS, seeded sampling with top_k,
top_p and min_p, and prompt scoring (prompt logprobs). The result, with the checkpoint's
fingerprint and the library versions, goes to tests/golden/sampling-<preset>.json, which
tests/model/sampling_golden_test.cc holds dxs's LocalEngine to.

    pip install torch transformers safetensors numpy
    python3 tools/hf_sampling_reference.py --dxs build/bin/dxs --out tests/golden

Nothing here calls dxs's sampler. Each decoding step recomputes the raw logits with the HF
model (KV-cached) and then:
  * log-probabilities: torch.log_softmax (float64) of the RAW logits: the token's, the top 5
    (most likely first, equal ones by lower id; the 6th is recorded too, for ties) and the
    named ids';
  * adjustments, in dxs's (and vLLM's) order: logit_bias added (written out here, OpenAI's),
    transformers' MinNewTokensLengthLogitsProcessor over the config's EOS ids and the stop
    ids, transformers' RepetitionPenaltyLogitsProcessor over prompt + output, then OpenAI's
    frequency and presence penalties over the output (written out here);
  * greedy: argmax of the adjusted logits (torch.argmax: ties to the lower id);
  * sampling: transformers' TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper and
    MinPLogitsWarper, in generate()'s order; instead of torch.multinomial the token is drawn
    by inverse CDF with dxs's counter-based stream: u = SplitMix64 output number `draw` (the
    tokens the request sampled before) of the seed, (x >> 11) * 2^-53, written out below;
    the kept tokens in descending order of the warped logit (equal ones by lower id), and
    the first whose cumulative probability exceeds u.
transformers' top_p removes the tokens whose cumulative probability from the least likely
side is <= 1 - top_p; dxs keeps the smallest most-likely-first prefix whose mass reaches
top_p. In exact arithmetic both keep rank i iff the mass of the tokens above it is < top_p;
the script recomputes each kept set (top_k, top_p, min_p) the dxs way in float64, asserts
that it equals transformers', and asserts that every decision of a case (the cut of each
warper, the draw, a greedy argmax) is at least MARGIN away from flipping, so that dxs's
float32 logits (which differ from transformers' in the last bits) decide the same way.
(transformers' top_k also keeps tokens tied with the k-th, and its min_p compares
probabilities where dxs compares weights relative to the most likely: the same kept-set
assertion covers both.)

Cases, per preset (every one asks for logprobs, top_logprobs 5 and two named ids):
  logprobs                       plain greedy;
  penalties                      repetition 1.3, frequency 0.5, presence 0.4 on a prompt
                                 with a repeated motif: the first of a fixed series of such
                                 prompts on which they change the output (recorded);
  logit_bias                     -100 on the greedy first token, +5 on three others;
  min_new_tokens_stop            stop ids = greedy's 1st and 3rd tokens, min_new_tokens 3;
  min_new_tokens_eos             the config's last EOS id lifted to the top by logit_bias
                                 and greedy's 2nd token as a stop id, min_new_tokens 4; for
                                 both, the script checks that the output without the mask
                                 differs (recorded as tokens_without_mask);
  sampled                        temperature 0.8, top_k 50, top_p 0.9, min_p 0.05 and the
                                 penalties, the first seed from 1234567 that keeps MARGIN
                                 (kept_per_step records what each warper kept);
  prompt_logprobs                a 12-token prompt scored from position 3, max_new_tokens 0;
  prompt_logprobs_then_generate  the same with 4 greedy tokens.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import warnings

import numpy as np
import torch
import transformers
from transformers import Qwen3MoeForCausalLM
from transformers.generation.logits_process import (
    MinNewTokensLengthLogitsProcessor,
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

PRESETS = ["default", "odd"]  # the small float32 presets
TOP_N = 5
# The least distance of any decision from its threshold: a greedy pick's lead in (adjusted)
# logits; for sampling, the top_k and min_p cuts' in (temperature-scaled) logits and the
# top_p cut's and the draw's in probability. dxs's logits differ from transformers' by far
# less, so a case that keeps this margin decides the same way in both.
MARGIN = 1e-3

MASK64 = (1 << 64) - 1
GAMMA = 0x9E3779B97F4A7C15


def splitmix64_at(seed, i):
    """Output i (from 0) of the SplitMix64 stream seeded with `seed`."""
    z = (seed + (i + 1) * GAMMA) & MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
    return z ^ (z >> 31)


def uniform(seed, draw):
    """Uniform in [0, 1) from the output's top 53 bits."""
    return (splitmix64_at(seed, draw) >> 11) * 2.0**-53


def lcg_ids(length, state, vocab):
    """`length` ids in [3, vocab) (skipping pad/bos/eos) from a small LCG."""
    ids = []
    state &= 0xFFFFFFFF
    for _ in range(length):
        state = (state * 1103515245 + 12345) & 0x7FFFFFFF
        ids.append(3 + state % (vocab - 3))
    return ids


def f9(x):
    return float("%.9g" % x)


class Model:
    def __init__(self, model):
        self.model = model

    @torch.no_grad()
    def prefill(self, prompt):
        """Logits [len(prompt), vocab] (float32) and the KV cache."""
        out = self.model(input_ids=torch.tensor([prompt]), use_cache=True)
        return out.logits[0].float(), out.past_key_values

    @torch.no_grad()
    def step(self, token, past):
        out = self.model(input_ids=torch.tensor([[token]]), past_key_values=past, use_cache=True)
        return out.logits[0, -1].float(), out.past_key_values


def logprob_entry(raw, token, named):
    """log_softmax of the raw logits at `token` (-1: none), its top TOP_N and `named`."""
    lp = torch.log_softmax(raw.double(), dim=-1).numpy()
    vals = raw.numpy()
    order = np.lexsort((np.arange(len(vals)), -vals))[: TOP_N + 1]  # by logit desc, id asc
    return {
        "token": int(token),
        "logprob": f9(lp[token]) if token >= 0 else 0.0,
        "top": [[int(i), f9(lp[i])] for i in order[:TOP_N]],
        # The next one's, so that a tie at the 5th place can be told.
        "sixth": f9(lp[order[TOP_N]]),
        "named": [f9(lp[i]) for i in named],
    }


def adjust(raw, case, eos_ids, prompt, generated):
    """The raw logits with the request's adjustments (see the module docstring)."""
    s = case["sampling"]
    scores = raw.clone().unsqueeze(0)
    input_ids = torch.tensor([prompt + generated])
    if s["logit_bias"]:
        ids = torch.tensor([i for i, _ in s["logit_bias"]])
        scores[0, ids] += torch.tensor([b for _, b in s["logit_bias"]], dtype=torch.float32)
    if case["min_new_tokens"] > 0:
        banned = ([] if case["ignore_eos"] else eos_ids) + case["stop_token_ids"]
        scores = MinNewTokensLengthLogitsProcessor(len(prompt), case["min_new_tokens"], banned)(
            input_ids, scores)
    if s["repetition_penalty"] != 1.0:
        scores = RepetitionPenaltyLogitsProcessor(float(s["repetition_penalty"]))(input_ids, scores)
    if generated and (s["frequency_penalty"] or s["presence_penalty"]):
        counts = torch.bincount(torch.tensor(generated), minlength=scores.shape[-1]).float()
        scores = scores - s["frequency_penalty"] * counts
        scores = scores - s["presence_penalty"] * (counts > 0).float()
    return scores


def greedy_pick(scores):
    token = int(torch.argmax(scores[0]))
    top2 = torch.topk(scores[0], 2).values
    return token, float(top2[0] - top2[1])


def sample_pick(scores, s, input_ids, draw):
    """The token HF's warpers and the SplitMix64 draw give, and the decisions' margins."""
    t = TemperatureLogitsWarper(float(s["temperature"]))(input_ids, scores)
    x = t.clone()
    if s["top_k"] > 0:
        x = TopKLogitsWarper(s["top_k"])(input_ids, x)
    if s["top_p"] < 1.0:
        x = TopPLogitsWarper(float(s["top_p"]))(input_ids, x)
    if s["min_p"] > 0.0:
        x = MinPLogitsWarper(float(s["min_p"]))(input_ids, x)
    hf_kept = set(torch.nonzero(torch.isfinite(x[0])).flatten().tolist())

    # The same kept set the dxs way (kernels/sampling.h), in float64, with its margins.
    v = t[0].numpy()
    order = np.lexsort((np.arange(len(v)), -v))
    margins = {}
    keep = len(v)
    if s["top_k"] > 0:
        keep = min(s["top_k"], keep)
        margins["top_k"] = float(v[order[keep - 1]]) - float(v[order[keep]])
    w = np.exp(v[order].astype(np.float64) - float(v[order[0]]))
    stages = {"top_k": keep}
    if s["top_p"] < 1.0:
        mass = np.cumsum(w[:keep]) / w[:keep].sum()
        top_p = float(np.float32(s["top_p"]))  # dxs holds it as a float
        cut = int(np.argmax(mass >= top_p)) + 1 if mass[-1] >= top_p else keep
        margins["top_p"] = min(mass[cut - 1] - top_p, top_p - mass[cut - 2] if cut > 1 else 1.0)
        keep = cut
    stages["top_p"] = keep
    if s["min_p"] > 0.0:
        min_p = float(np.float32(s["min_p"]))
        cut = 1
        while cut < keep and w[cut] >= min_p:
            cut += 1
        # In logit units: log(weight / min_p), as a logit error would move it.
        margins["min_p"] = min(np.log(w[cut - 1] / min_p) if cut > 1 else 1.0,
                               np.log(min_p / w[cut]) if cut < keep else 1.0)
        keep = cut
    stages["min_p"] = keep
    if keep < stages["top_k"]:
        # A later cut decides: which of two nearly equal tokens is the k-th moves the top-k
        # mass by less than their (tiny) probability, far below any other margin.
        margins.pop("top_k", None)
    spec_kept = set(int(i) for i in order[:keep])
    assert spec_kept == hf_kept, (
        f"transformers kept {len(hf_kept)} tokens, the dxs rule {len(spec_kept)}")

    # The draw over transformers' warped distribution, most likely first.
    cand = [int(i) for i in order[:keep]]
    probs = torch.softmax(x[0].double(), dim=-1).numpy()[cand]
    cum = np.cumsum(probs) / probs.sum()
    u = uniform(s["seed"], draw)
    i = int(np.argmax(u < cum)) if u < cum[-1] else len(cand) - 1
    margins["draw"] = min(cum[i] - u, u - cum[i - 1] if i > 0 else 1.0)
    return cand[i], margins, stages


def finish_reason(token, case, eos_ids, n, max_new):
    if not case["ignore_eos"] and token in eos_ids:
        return "eos"
    if token in case["stop_token_ids"]:
        return "stop"
    if n >= max_new:
        return "length"
    return None


def run_case(m, case, eos_ids, use_mask=True):
    """Decodes `case`; returns (expected, report). With use_mask False, min_new_tokens is 0."""
    case = dict(case)
    if not use_mask:
        case["min_new_tokens"] = 0
    prompt = case["prompt_ids"]
    named = case["logprob_token_ids"]
    s = case["sampling"]
    logits, past = m.prefill(prompt)
    expected = {"prompt_logprobs": None}
    start = case["prompt_logprobs_start"]
    if start >= 0:
        first = max(start, 1)
        expected["prompt_logprobs"] = {
            "first_position": first,
            "positions": [logprob_entry(logits[q - 1], prompt[q], named)
                          for q in range(first, len(prompt))],
            "next": logprob_entry(logits[-1], -1, named),
        }
    raw = logits[-1]
    generated, entries, margins, stages = [], [], [], []
    reason = "length"
    while len(generated) < case["max_new_tokens"]:
        scores = adjust(raw, case, eos_ids, prompt, generated)
        if s["temperature"] == 0.0:
            token, lead = greedy_pick(scores)
            margins.append({"greedy": lead})
        else:
            token, mg, st = sample_pick(scores, s, torch.tensor([prompt + generated]),
                                        draw=len(generated))
            margins.append(mg)
            stages.append(st)
        entries.append(logprob_entry(raw, token, named))
        generated.append(token)
        r = finish_reason(token, case, eos_ids, len(generated), case["max_new_tokens"])
        if r:
            reason = r
            break
        raw, past = m.step(token, past)
    expected.update({"tokens": generated, "finish_reason": reason, "logprobs": entries})
    least = min([min(mg.values()) for mg in margins], default=1.0)
    return expected, {"least_margin": least, "stages": stages}


def request(name, prompt, max_new, named, **kw):
    sampling = {"temperature": 0.0, "top_p": 1.0, "top_k": 0, "seed": 0, "min_p": 0.0,
                "repetition_penalty": 1.0, "frequency_penalty": 0.0, "presence_penalty": 0.0,
                "logit_bias": []}
    sampling.update(kw.pop("sampling", {}))
    case = {"name": name, "prompt_ids": prompt, "max_new_tokens": max_new, "min_new_tokens": 0,
            "stop_token_ids": [], "ignore_eos": False, "logprobs": True,
            "top_logprobs": TOP_N, "logprob_token_ids": named, "prompt_logprobs_start": -1,
            "sampling": sampling}
    case.update(kw)
    return case


def build_cases(m, cfg, eos_ids, preset_seed):
    vocab = cfg.vocab_size
    named = [eos_ids[0], lcg_ids(1, preset_seed + 99, vocab)[0]]
    cases = []

    def add(case, check=None):
        expected, report = run_case(m, case, eos_ids)
        assert report["least_margin"] >= MARGIN, (
            f"{case['name']}: a decision is {report['least_margin']:.3g} from flipping; "
            "pick another prompt or seed")
        if check:
            check(expected)
        case["expected"] = expected
        case["least_margin"] = f9(report["least_margin"])
        if report["stages"]:
            case["kept_per_step"] = report["stages"]
        cases.append(case)
        print(f"  {case['name']}: {expected['tokens']} ({expected['finish_reason']}), "
              f"least margin {report['least_margin']:.3g}", file=sys.stderr)
        return expected

    # (a) Plain greedy with log-probabilities.
    plain_prompt = lcg_ids(9, preset_seed + 1, vocab)
    plain = add(request("logprobs", plain_prompt, 12, named))

    # (b) Repetition, frequency and presence penalties on a prompt with repeats: the first
    # of a few such prompts on which they change the greedy output.
    penalties = {"repetition_penalty": 1.3, "frequency_penalty": 0.5, "presence_penalty": 0.4}
    for k in range(32):
        motif = lcg_ids(3, preset_seed + 2 + 1000 * k, vocab)
        rep_prompt = motif * 3 + lcg_ids(2, preset_seed + 3 + 1000 * k, vocab) + motif
        unpenalized, _ = run_case(m, request("", rep_prompt, 12, named), eos_ids)
        penalized, report = run_case(m, request("", rep_prompt, 12, named, sampling=penalties),
                                     eos_ids)
        if penalized["tokens"] != unpenalized["tokens"] and report["least_margin"] >= MARGIN:
            break
    else:
        sys.exit("no prompt on which the penalties change the output")
    c = request("penalties", rep_prompt, 12, named, sampling=penalties)
    c["tokens_without_penalties"] = unpenalized["tokens"]
    add(c)

    # (c) logit_bias: -100 on the greedy first token, +5 on a few others.
    first = plain["tokens"][0]
    plain_first = plain["logprobs"][0]
    boosted = [plain_first["top"][3][0], named[1], lcg_ids(1, preset_seed + 4, vocab)[0]]
    bias = [[first, -100.0]] + [[t, 5.0] for t in boosted if t != first]

    def bias_matters(e):
        assert e["tokens"][0] != first, "the bias does not change the first token"
    add(request("logit_bias", plain_prompt, 8, named, sampling={"logit_bias": bias}),
        bias_matters)

    # (d) min_new_tokens: stop ids that greedy picks early, masked until 3 tokens; then EOS
    # (the config's last: every EOS id is masked) pushed to the top by logit_bias.
    def mask_matters(case):
        def check(e):
            unmasked, _ = run_case(m, case, eos_ids, use_mask=False)
            assert unmasked["tokens"] != e["tokens"], "the min_new_tokens mask changes nothing"
            case["tokens_without_mask"] = unmasked["tokens"]
        return check

    stop = [plain["tokens"][0], plain["tokens"][2]]
    c = request("min_new_tokens_stop", plain_prompt, 8, named, min_new_tokens=3,
                stop_token_ids=stop)
    add(c, mask_matters(c))
    eos = eos_ids[-1]
    first_raw = m.prefill(plain_prompt)[0][-1]
    lift = float(np.ceil(float(first_raw.max() - first_raw[eos]) + 2.0))  # EOS on top by ~2
    c = request("min_new_tokens_eos", plain_prompt, 8, named, min_new_tokens=4,
                stop_token_ids=[plain["tokens"][1]],
                sampling={"logit_bias": [[eos, lift]]})
    add(c, mask_matters(c))

    # (e) Seeded sampling with top_k, top_p, min_p and the penalties: the first seed from
    # a fixed one whose every decision is at least MARGIN from flipping.
    sampled_prompt = lcg_ids(6, preset_seed + 5, vocab)
    for seed in range(1234567, 1234567 + 64):
        c = request("sampled", sampled_prompt, 12, named,
                    sampling={"temperature": 0.8, "top_k": 50, "top_p": 0.9, "min_p": 0.05,
                              "seed": seed, "repetition_penalty": 1.2,
                              "frequency_penalty": 0.3, "presence_penalty": 0.2})
        if run_case(m, c, eos_ids)[1]["least_margin"] >= MARGIN:
            break
    else:
        sys.exit("no seed keeps the sampling decisions clear of their thresholds")
    add(c)

    # (f, g) Prompt scoring from position 3 of a 12-token prompt, alone and with 4 tokens.
    scored_prompt = lcg_ids(12, preset_seed + 6, vocab)
    add(request("prompt_logprobs", scored_prompt, 0, named, prompt_logprobs_start=3))
    add(request("prompt_logprobs_then_generate", scored_prompt, 4, named,
                prompt_logprobs_start=3))
    return cases


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dxs", default="build/bin/dxs", help="path to the dxs binary")
    ap.add_argument("--out", default="tests/golden", help="output directory")
    ap.add_argument("--presets", default=",".join(PRESETS))
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    torch.manual_seed(0)
    warnings.filterwarnings("ignore", category=FutureWarning)  # past_key_values' rename
    for preset in args.presets.split(","):
        with tempfile.TemporaryDirectory() as ckpt:
            subprocess.run([args.dxs, "gen-model", "--preset", preset, "--out", ckpt], check=True,
                           stdout=subprocess.DEVNULL)
            fingerprint = subprocess.run([args.dxs, "fingerprint", "--model", ckpt], check=True,
                                         capture_output=True, text=True).stdout.strip()
            model, info = Qwen3MoeForCausalLM.from_pretrained(
                ckpt, dtype=torch.float32, attn_implementation="eager",
                output_loading_info=True)
            bad = {k: v for k, v in info.items() if v}
            if bad:
                sys.exit(f"{preset}: checkpoint did not load cleanly: {bad}")
            model.eval()
            cfg = model.config
            eos = cfg.eos_token_id
            eos_ids = list(eos if isinstance(eos, list) else [eos])
            print(f"{preset}:", file=sys.stderr)
            cases = build_cases(Model(model), cfg, eos_ids, preset_seed=len(preset) * 7919)
        result = {
            "preset": preset,
            "fingerprint": fingerprint,
            "reference": "transformers.Qwen3MoeForCausalLM float32 CPU, eager attention; "
                         "tools/hf_sampling_reference.py",
            "transformers_version": transformers.__version__,
            "torch_version": torch.__version__,
            "eos_token_ids": eos_ids,
            "cases": cases,
        }
        path = os.path.join(args.out, f"sampling-{preset}.json")
        with open(path, "w") as f:
            json.dump(result, f, separators=(",", ":"))
            f.write("\n")
        print(f"wrote {path}", file=sys.stderr)


if __name__ == "__main__":
    main()
