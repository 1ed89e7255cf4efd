#!/usr/bin/env bash
# Serving benchmark (not a test): `dxs bench` against a local cluster started with `dxs up`
# at concurrency 1, 8 and 64, and, in the same run, the single-process engine on the same
# prompts (`dxs bench --local`). Prints output tokens/s and the cluster/single ratio.
#
# Each figure is the median of ROUNDS runs, cluster and single-process alternating, so a
# burst of load elsewhere on the machine hits both alike; the spread (min-max) is printed.
# Usage: bench/serving_bench.sh [M attention] [N experts]   (defaults 2 and 2)
# Environment: DXS_BENCH_REQUESTS (256), DXS_BENCH_PROMPT_LEN (32), DXS_BENCH_OUTPUT_LEN
# (32), DXS_BENCH_ROUNDS (3), DXS_BENCH_CONCURRENCY (the levels, "1 8 64"), DXS_UP_ARGS
# (extra `dxs up` flags, e.g. --overlap-min-tokens 0), DXS_BIN_DIR (build/bin: the binaries,
# e.g. another build to compare with).
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${DXS_BIN_DIR:-build/bin}
M=${1:-2}
N=${2:-2}
REQUESTS=${DXS_BENCH_REQUESTS:-256}
PROMPT=${DXS_BENCH_PROMPT_LEN:-32}
OUTPUT=${DXS_BENCH_OUTPUT_LEN:-32}
ROUNDS=${DXS_BENCH_ROUNDS:-3}
CONCURRENCY=${DXS_BENCH_CONCURRENCY:-1 8 64}
WORK=$(mktemp -d)
trap 'kill $UP 2>/dev/null; wait $UP 2>/dev/null; rm -rf "$WORK"' EXIT
"$BIN/dxs" gen-model --out "$WORK/model" >/dev/null
PORT=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
"$BIN/dxs" up --model "$WORK/model" --attention "$M" --experts "$N" --port "$PORT" \
  --log-dir "$WORK/logs" ${DXS_UP_ARGS:-} >"$WORK/up.log" 2>&1 &
UP=$!
for _ in $(seq 600); do grep -q "listening on" "$WORK/up.log" && break; sleep 0.1; done
grep -q "listening on" "$WORK/up.log" || { cat "$WORK/up.log"; exit 1; }
echo "serving_bench: $(nproc) cores ($(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs)),"\
     "cluster of $M attention + $N expert ranks on loopback (UCX), embedded model, float32;"\
     "$REQUESTS requests, prompt $PROMPT, output $OUTPUT tokens; median of $ROUNDS alternating runs"
printf '%-12s %24s %24s %8s\n' concurrency "cluster tok/s (min-max)" "single tok/s (min-max)" ratio
tps() { python3 -c 'import json,sys; print(json.load(sys.stdin)["output_tokens_per_second"])'; }
# "median min max" of the arguments.
stats() { python3 -c 'import sys,statistics as s; v=sorted(map(float,sys.argv[1:])); print(s.median(v), v[0], v[-1])' "$@"; }
for C in $CONCURRENCY; do
  common=(--concurrency "$C" --requests "$REQUESTS" --prompt-len "$PROMPT" --output-len "$OUTPUT" --format json)
  cluster=() single=()
  for _ in $(seq "$ROUNDS"); do
    cluster+=("$("$BIN/dxs" bench --router "127.0.0.1:$PORT" "${common[@]}" 2>/dev/null | tps)")
    single+=("$("$BIN/dxs" bench --local "$WORK/model" "${common[@]}" 2>/dev/null | tps)")
  done
  read -r cm cmin cmax <<<"$(stats "${cluster[@]}")"
  read -r sm smin smax <<<"$(stats "${single[@]}")"
  python3 -c "print('%-12s %8.1f (%6.0f-%6.0f) %8.1f (%6.0f-%6.0f) %7.2fx' % ($C, $cm, $cmin, $cmax, $sm, $smin, $smax, $cm / $sm))"
done
