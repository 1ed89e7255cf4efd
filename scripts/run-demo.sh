#!/usr/bin/env bash
# The main job on the embedded default model: installs dependencies, builds, writes the
# built-in small Qwen3-MoE checkpoint, starts a local cluster (router, 2 attention and
# 2 expert workers on loopback) with `dxs up`, generates through the router's front door
# with `dxs generate`, and stops the cluster.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
scripts/build.sh dxs
BIN=${DXS_BUILD_DIR:-build}/bin
MODEL_DIR=${DXS_MODEL_DIR:-out/models/default}
PORT=${DXS_PORT:-50051}
[ -f "$MODEL_DIR/config.json" ] || "$BIN/dxs" gen-model --preset default --out "$MODEL_DIR"
mkdir -p out
"$BIN/dxs" up --model "$MODEL_DIR" --attention 2 --experts 2 --port "$PORT" \
  --log-dir out/logs >out/up.log 2>&1 &
UP=$!
trap 'kill -TERM $UP 2>/dev/null; wait $UP 2>/dev/null || true' EXIT
for _ in $(seq 600); do
  grep -q "listening on" out/up.log && break
  kill -0 $UP 2>/dev/null || { cat out/up.log; exit 1; }
  sleep 0.1
done
cat out/up.log
"$BIN/dxs" generate --router "127.0.0.1:$PORT" --prompt-ids 9,41,7,300,12 \
  --max-new-tokens 16 --format json
"$BIN/dxs" status --router "127.0.0.1:$PORT"
