#!/usr/bin/env bash
# Decode tokens/s of the Qwen3-30B-A3B shape (LAYERS layers, default all 48), single
# process (`dxs bench --local --device cuda`, overlap scheduling on and off) against 1 attention + 1 expert process on the
# same GPU (`dxs up --gpus 0`, rows over UCX cuda_ipc), the cluster with piecewise CUDA
# graphs (dxs-attention --piecewise-graphs, the default) and without, and with piecewise
# graphs but --overlap-schedule false (the attention worker's overlap scheduling's A/B
# baseline), in one run. The
# model is an in-place directory (`dxs gen-model --in-place`: config.json and a recipe;
# every process makes its weights on the GPU), since the 61 GB checkpoint does not fit the
# machine's disk. The two processes time-slice the GPU (no MPS), so the cluster figures are
# time-sliced ones, not what two GPUs give. Concurrency 1 and 8 decode in one micro-batch
# (piecewise graphs apply); 32 is above the two-batch-overlap threshold (16 tokens), which
# runs eagerly either way. Prints a table; logs in $OUT.
#   bench/gpu/cluster_decode_bench.sh [LAYERS]   (default 48; binaries in .device/bin)
# Environment: DXS_DECODE_CLUSTERS, the clusters to run, each MxN@GPUS (M attention and N
# expert processes placed over those GPUs, `dxs up --gpus`), default "1x1@0"; on several
# GPUs e.g. "1x1@0,1 2x2@0,1,2,3" (the two- and four-GPU clusters: one process per GPU, no
# time slicing); "none" runs the single process alone. DXS_DECODE_CONCURRENCY, default "1 8 32".
# DXS_DECODE_LOCAL: both (default; the single process with overlap scheduling on and off),
# overlap (on only) or none. DXS_DECODE_MODES, the cluster runs, default
# "piecewise no-overlap eager". Each cluster also runs with --low-latency-capacity DXS_DECODE_LL_CAPACITY (0 leaves that run out; default 128 for a
# cluster over several GPUs, 0 on one): decode steps over the low-latency exchange (on one
# GPU the processes' spinning waits time-slice it, so there it means nothing for speed).
set -uo pipefail
layers=${1:-48}
OUT=${OUT:-/tmp/dxs-cluster-decode}
mkdir -p "$OUT"
bin=${DXS_BIN_DIR:-.device/bin}
work=$(mktemp -d)
up=
stop_cluster() {
  [ -n "$up" ] && { kill "$up" 2>/dev/null; wait "$up" 2>/dev/null; }
  up=
}
trap 'stop_cluster; rm -rf "$work"' EXIT
log="$OUT/cluster_decode.log"
"$bin/dxs" gen-model --preset qwen3-30b-a3b --layers "$layers" --in-place --out "$work/model" >>"$log" 2>&1 ||
  { echo "gen-model failed (see $log)"; exit 1; }
port=$((20000 + RANDOM % 20000))
start_cluster() {  # start_cluster PIECEWISE M N GPUS LOW_LATENCY_CAPACITY OVERLAP_SCHEDULE
  rm -rf "$work/logs"
  "$bin/dxs" up --model "$work/model" --attention "$2" --experts "$3" --gpus "$4" --wire-dtype bf16 \
    --piecewise-graphs "$1" --low-latency-capacity "$5" --overlap-schedule "$6" --port "$port" \
    --log-dir "$work/logs" >"$work/up.log" 2>&1 &
  up=$!
  for _ in $(seq 1800); do grep -q "listening on" "$work/up.log" && return 0; sleep 0.2; done
  cat "$work/up.log" "$work"/logs/*.log >>"$log"
  echo "dxs up did not come up (see $log)"
  return 1
}
row() {  # row LABEL C JSON
  python3 - "$1" "$2" "$3" <<'PY'
import json, sys
label, c, text = sys.argv[1], sys.argv[2], sys.argv[3]
try:
    j = json.loads(text.strip().splitlines()[-1])
    print(f"{label:<52} {c:>4} {j['output_tokens_per_second']:>10.1f} {j['itl_ms']['p50']:>9.2f} {len(j['errors'])}")
except Exception as e:
    print(f"{label:<52} {c:>4} failed: {e}")
PY
}
bench_args() {  # bench_args C
  local reqs=$(($1 * 2)); [ "$1" = 1 ] && reqs=8
  echo "--concurrency $1 --requests $reqs --prompt-len 32 --output-len 64 --format json"
}
table="$OUT/cluster_decode.txt"
printf '%-52s %4s %10s %9s %s\n' "run (layers=$layers)" conc "tok/s" "itl_p50" errors >"$table"
clusters=${DXS_DECODE_CLUSTERS:-1x1@0}
[ "$clusters" = none ] && clusters=  # the single process alone
concurrency=${DXS_DECODE_CONCURRENCY:-1 8 32}
for c in $concurrency; do
  [ "${DXS_DECODE_LOCAL:-both}" = none ] && break
  local_json=$(timeout 300 "$bin/dxs" bench --local "$work/model" --device cuda $(bench_args $c) 2>>"$log")
  echo "local c=$c: $local_json" >>"$log"
  row "single process (graphs)" "$c" "$local_json" >>"$table"
  [ "${DXS_DECODE_LOCAL:-both}" = overlap ] && continue
  # Overlap scheduling's A/B baseline: every step waits for its tokens.
  local_json=$(timeout 300 "$bin/dxs" bench --local "$work/model" --device cuda \
    --overlap-schedule off $(bench_args $c) 2>>"$log")
  echo "local no overlap c=$c: $local_json" >>"$log"
  row "single process (graphs, --overlap-schedule off)" "$c" "$local_json" >>"$table"
done
for cluster in $clusters; do
  shape=${cluster%@*} gpus=${cluster#*@}
  m=${shape%x*} n=${shape#*x}
  # The LL run by default only where the processes have GPUs of their own.
  ll_capacity=${DXS_DECODE_LL_CAPACITY:-}
  [ -z "$ll_capacity" ] && { case $gpus in *,*) ll_capacity=128 ;; *) ll_capacity=0 ;; esac; }
  modes=${DXS_DECODE_MODES:-piecewise no-overlap eager}
  [ "$ll_capacity" != 0 ] && modes="$modes low-latency"
  for mode in $modes; do
    piecewise=true capacity=0 overlap=true
    label="$m attn + $n expert on GPUs $gpus, piecewise graphs"
    [ $mode = no-overlap ] && overlap=false label="$label, --overlap-schedule false"
    [ $mode = eager ] && piecewise=false label="$m attn + $n expert on GPUs $gpus, eager"
    [ $mode = low-latency ] && capacity=$ll_capacity label="$m attn + $n expert on GPUs $gpus, LL cap $ll_capacity"
    start_cluster $piecewise "$m" "$n" "$gpus" "$capacity" "$overlap" || exit 1
    for c in $concurrency; do
      cluster_json=$(timeout 300 "$bin/dxs" bench --router "127.0.0.1:$port" $(bench_args $c) 2>>"$log")
      echo "cluster $mode c=$c: $cluster_json" >>"$log"
      row "$label" "$c" "$cluster_json" >>"$table"
    done
    cat "$work/up.log" "$work"/logs/*.log >>"$log" 2>&1
    stop_cluster
  done
done
cat "$table"
