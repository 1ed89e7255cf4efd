#!/usr/bin/env bash
# The main job on the embedded default model: installs dependencies, builds, writes the
# built-in small Qwen3-MoE checkpoint, starts a local cluster (router, 2 attention and
# 2 expert workers on loopback) with the SMG gateway in front of it (`dxs up
# --gateway-port`), generates through the router's front door with `dxs generate`, then
# asks the gateway for an OpenAI chat completion over HTTP and prints its text, and stops
# the cluster.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
scripts/build.sh dxs
BIN=${DXS_BUILD_DIR:-build}/bin
MODEL_DIR=${DXS_MODEL_DIR:-out/models/default}
# A port the kernel has free now (dxs up binds it moments later).
free_port() {
  python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}
PORT=${DXS_PORT:-$(free_port)}
GATEWAY_PORT=${DXS_GATEWAY_PORT:-$(free_port)}
GATEWAY_METRICS_PORT=$(free_port)
# The default model is written once; again if an earlier run wrote it without the tokenizer
# files the gateway needs.
if [ ! -f "$MODEL_DIR/config.json" ] ||
  { [ -z "${DXS_MODEL_DIR:-}" ] && [ ! -f "$MODEL_DIR/tokenizer.json" ]; }; then
  "$BIN/dxs" gen-model --preset default --out "$MODEL_DIR"
fi
mkdir -p out
"$BIN/dxs" up --model "$MODEL_DIR" --attention 2 --experts 2 --port "$PORT" \
  --gateway-port "$GATEWAY_PORT" --gateway-metrics-port "$GATEWAY_METRICS_PORT" \
  --log-dir out/logs >out/up.log 2>&1 &
UP=$!
trap 'kill -TERM $UP 2>/dev/null; wait $UP 2>/dev/null || true' EXIT
# The cluster, then the gateway (it has registered the router and loaded the tokenizer once
# `dxs up` prints its line); at most 180 s, and only while `dxs up` runs.
deadline=$((SECONDS + 180))
until grep -q "gateway (OpenAI API) on" out/up.log; do
  kill -0 $UP 2>/dev/null || { cat out/up.log; echo "run-demo: dxs up exited"; exit 1; }
  [ $SECONDS -lt $deadline ] || { cat out/up.log; echo "run-demo: no gateway after 180 s"; exit 1; }
  sleep 0.2
done
cat out/up.log
"$BIN/dxs" generate --router "127.0.0.1:$PORT" --prompt-ids 9,41,7,300,12 \
  --max-new-tokens 16 --format json
"$BIN/dxs" status --router "127.0.0.1:$PORT"
# OpenAI's API through the gateway: the model is named after its directory ("default").
MODEL_NAME=$(basename "$MODEL_DIR")
echo "POST http://127.0.0.1:$GATEWAY_PORT/v1/chat/completions (model \"$MODEL_NAME\")"
curl -sS --fail-with-body --max-time 120 "http://127.0.0.1:$GATEWAY_PORT/v1/chat/completions" \
  -H 'content-type: application/json' \
  -d "{\"model\": \"$MODEL_NAME\", \"messages\": [{\"role\": \"user\", \"content\": \"Hello! Who are you?\"}], \"max_tokens\": 32, \"temperature\": 0}" \
  >out/chat.json || { cat out/chat.json; echo; echo "run-demo: the chat completion failed"; exit 1; }
python3 - out/chat.json <<'EOF'
import json, sys
reply = json.load(open(sys.argv[1]))
choice = reply["choices"][0]
print("assistant:", repr(choice["message"]["content"]))
print("finish_reason:", choice["finish_reason"], "usage:", json.dumps(reply["usage"]))
EOF
kill -TERM $UP
wait $UP || true
trap - EXIT
echo "run-demo: done"
