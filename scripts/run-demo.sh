#!/usr/bin/env bash
# The main job on the embedded default model: installs dependencies, builds, writes the
# built-in small Qwen3-MoE checkpoint, then generates from a prompt with the
# single-process runner.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
scripts/build.sh dxs
MODEL_DIR=${DXS_MODEL_DIR:-out/models/default}
[ -f "$MODEL_DIR/config.json" ] || build/bin/dxs gen-model --preset default --out "$MODEL_DIR"
build/bin/dxs run --model "$MODEL_DIR" --prompt-ids 9,41,7,300,12 --max-new-tokens 16 --format json
