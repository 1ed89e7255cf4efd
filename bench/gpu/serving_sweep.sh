#!/usr/bin/env bash
# The serving benchmark users run (SGLang's bench_serving, vLLM's benchmark_serving) on the
# H200: `dxs bench --request-rate` (Poisson arrivals, log-normal lengths around PROMPT in
# and OUTPUT out, seeded) against 1 attention + 1 expert process on GPU 0 (`dxs up --gpus
# 0`), the Qwen3-30B-A3B shape with LAYERS layers (in-place weights, as
# cluster_decode_bench.sh). The two processes time-slice the one GPU (no MPS): these are
# time-sliced figures, not what two GPUs give. Then the same arrivals against the
# single-process engine on the GPU (`dxs bench --local --device cuda`: LocalServer, its
# continuous batching). Prints one line per rate and target (throughput, TTFT, TPOT and ITL
# at p50 and p99, goodput under TTFT <= 1 s and TPOT <= 50 ms); the JSON lines go to
# $OUT/serving_sweep.jsonl (cluster), $OUT/serving_sweep_local.jsonl (single process) and
# $OUT/serving_sweep_local_no_overlap.jsonl (single process, --overlap-schedule off: the A/B
# baseline of overlap scheduling) for bench/serving_plot.py.
#   bench/gpu/serving_sweep.sh [LAYERS]   (default 48; binaries in .device/bin)
# Environment: DXS_SWEEP_RATES (default "1,2,4,8,inf"), DXS_SWEEP_REQUESTS (per rate, 32),
# DXS_SWEEP_PROMPT (1024), DXS_SWEEP_OUTPUT (256), DXS_SWEEP_SIGMA (0.4).
set -uo pipefail
layers=${1:-48}
OUT=${OUT:-/tmp/dxs-serving-sweep}
mkdir -p "$OUT"
bin=${DXS_BIN_DIR:-.device/bin}
work=$(mktemp -d)
up=
trap '[ -n "$up" ] && { kill "$up" 2>/dev/null; wait "$up" 2>/dev/null; }; rm -rf "$work"' EXIT
log="$OUT/serving_sweep.log"
"$bin/dxs" gen-model --preset qwen3-30b-a3b --layers "$layers" --in-place --out "$work/model" >>"$log" 2>&1 ||
  { echo "gen-model failed (see $log)"; exit 1; }
port=$((20000 + RANDOM % 20000))
"$bin/dxs" up --model "$work/model" --attention 1 --experts 1 --gpus 0 --port "$port" \
  --log-dir "$work/logs" >"$work/up.log" 2>&1 &
up=$!
for _ in $(seq 1800); do grep -q "listening on" "$work/up.log" && break; sleep 0.2; done
grep -q "listening on" "$work/up.log" || { cat "$work/up.log" >>"$log"; echo "dxs up did not come up (see $log)"; exit 1; }
timeout 1200 "$bin/dxs" bench --router "127.0.0.1:$port" --request-rate "${DXS_SWEEP_RATES:-1,2,4,8,inf}" \
  --requests "${DXS_SWEEP_REQUESTS:-32}" --prompt-len "${DXS_SWEEP_PROMPT:-1024}" \
  --output-len "${DXS_SWEEP_OUTPUT:-256}" --len-sigma "${DXS_SWEEP_SIGMA:-0.4}" --seed 1 \
  --format json >"$OUT/serving_sweep.jsonl" 2>>"$log"
echo "dxs bench rc=$?" >>"$log"
cat "$work/up.log" "$work"/logs/*.log >>"$log" 2>&1
kill "$up" 2>/dev/null; wait "$up" 2>/dev/null; up=  # the GPU to the single process
timeout 1200 "$bin/dxs" bench --local "$work/model" --device cuda --request-rate "${DXS_SWEEP_RATES:-1,2,4,8,inf}" \
  --requests "${DXS_SWEEP_REQUESTS:-32}" --prompt-len "${DXS_SWEEP_PROMPT:-1024}" \
  --output-len "${DXS_SWEEP_OUTPUT:-256}" --len-sigma "${DXS_SWEEP_SIGMA:-0.4}" --seed 1 \
  --format json >"$OUT/serving_sweep_local.jsonl" 2>>"$log"
echo "dxs bench --local rc=$?" >>"$log"
# The same without overlap scheduling: its A/B baseline.
timeout 1200 "$bin/dxs" bench --local "$work/model" --device cuda --overlap-schedule off \
  --request-rate "${DXS_SWEEP_RATES:-1,2,4,8,inf}" \
  --requests "${DXS_SWEEP_REQUESTS:-32}" --prompt-len "${DXS_SWEEP_PROMPT:-1024}" \
  --output-len "${DXS_SWEEP_OUTPUT:-256}" --len-sigma "${DXS_SWEEP_SIGMA:-0.4}" --seed 1 \
  --format json >"$OUT/serving_sweep_local_no_overlap.jsonl" 2>>"$log"
echo "dxs bench --local --overlap-schedule off rc=$?" >>"$log"
python3 - "$OUT/serving_sweep.jsonl" "$OUT/serving_sweep_local.jsonl" "$layers" \
  "$OUT/serving_sweep_local_no_overlap.jsonl" <<'PY'
import json, sys
print(f"serving sweep on one H200, {sys.argv[3]} layers: 1 attention + 1 expert (time-sliced), then the single process (overlap scheduling on, then off)")
print(f"{'target':>8} {'rate':>6} {'tok/s':>8} {'req/s':>6} {'TTFT p50/p99 ms':>18} {'TPOT p50/p99 ms':>16} {'ITL p50/p99 ms':>16} {'goodput':>8} errors")
for target, path in (("1+1", sys.argv[1]), ("single", sys.argv[2]), ("no-overlap", sys.argv[4])):
    for line in open(path):
        j = json.loads(line)
        print(f"{target:>8} {str(j['request_rate']):>6} {j['output_tokens_per_second']:>8.1f} {j['requests_per_second']:>6.2f} "
              f"{j['ttft_ms']['p50']:>8.1f}/{j['ttft_ms']['p99']:<9.1f} {j['tpot_ms']['p50']:>7.2f}/{j['tpot_ms']['p99']:<8.2f} "
              f"{j['itl_ms']['p50']:>7.2f}/{j['itl_ms']['p99']:<8.2f} {j['goodput_requests_per_second']:>8.2f} {j['errors'] or 'none'}")
PY
