#!/usr/bin/env python3
"""The source tree keeps its layering, and only kernels/ asks which device a backend is.

docs/design.md ("Layering"): common/ < kernels/ < model/ and dataplane/ (neither includes the
other) < router/ < worker/ < the two services < tools/; a folder includes only folders below
it. A component that includes one above it (common/ reaching into dataplane/, say) makes the
lower one unusable without the upper and hides a cycle in waiting, so this reads every
#include of the product's sources and fails on one that points up or sideways.

Code outside kernels/ chooses a path by what a backend can do
(Backend::capabilities(), kernels/device_runtime.h), never by comparing Device values: a new
backend then states its capabilities instead of every caller learning its name. This fails on
a `Device::k...` compared (== or !=) outside kernels/ in the product's sources (tests and
benchmarks may name devices).
"""
import argparse
import pathlib
import re
import sys

# Folder -> rank; a folder may include folders of a lower rank, and its own.
LAYERS = {
    "common": 0,
    "kernels": 1,
    "model": 2,
    "dataplane": 2,
    "router": 3,
    "worker": 4,
    "attention_service": 5,
    "expert_service": 5,
    "tools": 6,
}
SOURCES = (".h", ".cc", ".cu", ".cuh")
INCLUDE = re.compile(r'^\s*#\s*include\s+"([a-z_]+)/', re.M)
DEVICE_COMPARE = re.compile(r"(==|!=)\s*Device::k\w+|Device::k\w+\s*(==|!=)")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--source-dir", required=True)
    root = pathlib.Path(parser.parse_args().source_dir)
    problems = []
    checked = 0
    for folder, rank in LAYERS.items():
        for path in sorted((root / folder).rglob("*")):
            if path.suffix not in SOURCES or not path.is_file():
                continue
            checked += 1
            text = path.read_text(errors="replace")
            rel = path.relative_to(root)
            for m in INCLUDE.finditer(text):
                target = m.group(1)
                if target not in LAYERS or target == folder:
                    continue
                if LAYERS[target] >= rank:
                    line = text.count("\n", 0, m.start()) + 1
                    problems.append(f"{rel}:{line}: {folder}/ includes {target}/, which is not "
                                    f"below it (docs/design.md, Layering)")
            if folder == "kernels":
                continue
            for m in DEVICE_COMPARE.finditer(text):
                line = text.count("\n", 0, m.start()) + 1
                problems.append(f"{rel}:{line}: compares a Device outside kernels/; ask the "
                                f"backend's capabilities() instead")
    if checked < 100:
        problems.append(f"only {checked} source files found under {root}: wrong --source-dir?")
    for p in problems:
        print(p)
    print(f"{checked} source files checked, {len(problems)} problems")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
