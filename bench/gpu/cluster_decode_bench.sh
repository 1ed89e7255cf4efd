#!/usr/bin/env bash
# Decode tokens/s of the Qwen3-30B-A3B shape cut to LAYERS layers (the full 48 do not fit
# the GPU machine's disk as a checkpoint), single process (`dxs bench --local --device
# cuda`) against 1 attention + 1 expert process on the same GPU (`dxs up --gpus 0`, rows
# over UCX cuda_ipc), in one run. The two processes time-slice the GPU (no MPS), so the
# cluster figure is a time-sliced one, not what two GPUs give. Prints a table; logs in $OUT.
#   bench/gpu/cluster_decode_bench.sh [LAYERS]   (default 4; binaries in .device/bin)
set -uo pipefail
layers=${1:-4}
OUT=${OUT:-/tmp/dxs-cluster-decode}
mkdir -p "$OUT"
bin=${DXS_BIN_DIR:-.device/bin}
work=$(mktemp -d)
trap 'kill $up 2>/dev/null; wait $up 2>/dev/null; rm -rf "$work"' EXIT
log="$OUT/cluster_decode.log"
"$bin/dxs" gen-model --preset qwen3-30b-a3b --layers "$layers" --out "$work/model" >>"$log" 2>&1 ||
  { echo "gen-model failed (see $log)"; exit 1; }
port=$((20000 + RANDOM % 20000))
"$bin/dxs" up --model "$work/model" --attention 1 --experts 1 --gpus 0 --wire-dtype bf16 \
  --port "$port" --log-dir "$work/logs" >"$work/up.log" 2>&1 &
up=$!
for _ in $(seq 1800); do grep -q "listening on" "$work/up.log" && break; sleep 0.2; done
grep -q "listening on" "$work/up.log" || { cat "$work/up.log" "$work"/logs/*.log >>"$log"; echo "dxs up did not come up (see $log)"; exit 1; }
row() {  # row LABEL C JSON
  python3 - "$1" "$2" "$3" <<'PY'
import json, sys
label, c, text = sys.argv[1], sys.argv[2], sys.argv[3]
try:
    j = json.loads(text.strip().splitlines()[-1])
    print(f"{label:<34} {c:>4} {j['output_tokens_per_second']:>10.1f} {j['itl_ms']['p50']:>9.2f} {len(j['errors'])}")
except Exception as e:
    print(f"{label:<34} {c:>4} failed: {e}")
PY
}
printf '%-34s %4s %10s %9s %s\n' "run (layers=$layers)" conc "tok/s" "itl_p50" errors >"$OUT/cluster_decode.txt"
for c in 1 32; do
  reqs=$((c * 2)); [ "$c" = 1 ] && reqs=4
  args="--concurrency $c --requests $reqs --prompt-len 32 --output-len 64 --format json"
  local_json=$(timeout 300 "$bin/dxs" bench --local "$work/model" --device cuda $args 2>>"$log")
  cluster_json=$(timeout 300 "$bin/dxs" bench --router "127.0.0.1:$port" $args 2>>"$log")
  echo "local c=$c: $local_json" >>"$log"; echo "cluster c=$c: $cluster_json" >>"$log"
  row "single process" "$c" "$local_json" >>"$OUT/cluster_decode.txt"
  row "1 attn + 1 expert, one GPU" "$c" "$cluster_json" >>"$OUT/cluster_decode.txt"
done
cat "$work/up.log" "$work"/logs/*.log >>"$log" 2>&1
cat "$OUT/cluster_decode.txt"
