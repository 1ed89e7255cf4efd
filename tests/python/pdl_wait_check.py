#!/usr/bin/env python3
"""Every kernel launched with programmatic dependent launch waits for its predecessor first.

kernels/cuda/launch.cuh: a kernel passed to LaunchKernel may start while the kernel before it
in the stream still runs, so its body must begin with PdlWait() (griddepcontrol.wait); one
that read or wrote before it, or returned without it, would race its predecessor. No GPU can
show such a race reliably, so this reads the sources: for each LaunchKernel(NAME, ...) in
kernels/cuda (NAME a kernel, or a local `auto* var = Kernel<...>;`), the __global__ function
NAME's first statement must be PdlWait();. The one exception is a kernel that loads its
immutable weights before waiting (so they stream while the previous kernel finishes): its body
must say so in a `// pdl-early:` comment before PdlWait(), and must not return before it. It
also fails on a LaunchKernel whose kernel it cannot resolve, so a new launch form cannot slip
past unchecked.
"""
import argparse
import pathlib
import re
import sys

LAUNCH = re.compile(r"\bLaunchKernel\(\s*([A-Za-z_]\w*)")
ALIAS = re.compile(r"\bauto\s*\*?\s*([A-Za-z_]\w*)\s*=\s*&?\s*([A-Za-z_]\w*)\s*(?:<[^;]*>)?\s*;")
GLOBAL = re.compile(r"__global__\b[^{;]*?\b([A-Za-z_]\w*)\s*\(", re.S)


def kernel_bodies(text):
    """{kernel name: first statement of its body} for the __global__ definitions in text."""
    bodies = {}
    text = re.sub(r"__launch_bounds__\s*\([^)]*\)", "", text)
    for m in GLOBAL.finditer(text):
        # The parameter list may hold parentheses (attributes); the body is the first '{'
        # after the matching ')'.
        i, depth = m.end(), 1
        while depth:
            depth += {"(": 1, ")": -1}.get(text[i], 0)
            i += 1
        brace, semi = text.find("{", i), text.find(";", i)
        if brace < 0 or (0 <= semi < brace):
            continue  # a declaration
        body = text[brace + 1:]
        first = body.lstrip().split(";", 1)[0].strip() + ";"
        wait = body.find("PdlWait();")
        before = body[:wait] if wait >= 0 else ""
        if first != "PdlWait();" and "// pdl-early:" in before and not re.search(
                r"\breturn\b", before):
            first = "PdlWait();"  # weights only before the wait, reviewed and annotated
        bodies.setdefault(m.group(1), []).append(first)
    return bodies


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--source-dir", default=str(pathlib.Path(__file__).resolve().parents[2]))
    args = ap.parse_args()
    src = pathlib.Path(args.source_dir) / "kernels" / "cuda"
    files = sorted(list(src.glob("*.cu")) + list(src.glob("*.cuh")))
    texts = {f: f.read_text() for f in files}
    bodies = {}
    for text in texts.values():
        for name, firsts in kernel_bodies(text).items():
            bodies.setdefault(name, []).extend(firsts)
    problems, launched = [], 0
    for f, text in texts.items():
        if f.name == "launch.cuh":
            continue  # LaunchKernel's own definition
        aliases = {m.group(1): m.group(2) for m in ALIAS.finditer(text)}
        for m in LAUNCH.finditer(text):
            line = text.count("\n", 0, m.start()) + 1
            name = aliases.get(m.group(1), m.group(1))
            where = f"{f.name}:{line}"
            if name not in bodies:
                problems.append(f"{where}: LaunchKernel({m.group(1)}): no __global__ {name} found")
                continue
            launched += 1
            for first in bodies[name]:
                if first != "PdlWait();":
                    problems.append(f"{where}: {name} starts with `{first}`, not PdlWait();")
    if launched == 0:
        problems.append("no LaunchKernel call found: the check would check nothing")
    for p in problems:
        print(p)
    print(f"{launched} LaunchKernel calls checked, {len(problems)} problems")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
