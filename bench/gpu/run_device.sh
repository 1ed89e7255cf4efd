#!/usr/bin/env bash
# One device call (../shared/DEVICE.md): the gpu-labelled tests, compute-sanitizer on the
# backend test, gpu_bench and the PyTorch / Hugging Face baselines, then docs/gpu.md's
# results and plots into $OUT. Builds nothing: the binaries come in .device/ (packed here
# by bench/gpu/bundle.sh). Prints a short table last; full logs are in $OUT (after bench and
# all: gpu.md, gpu_*.png and logs.tgz holding the rest, as only 8 files come back).
#   bench/gpu/run_device.sh [tests|memcheck|bench|cluster|exchange|ll|decode|gemv|gpus|gpus-decode|gpus-eplb|all]
#   (or several, comma-separated: fp8-decode,fp8,exchange,ll)
#   ll: gpu_ll_bench (the exchange's kernels alone), gpu_host_call_probe (which runtime calls
#   wait for a spinning kernel) and gpu_bench --low-latency (decode steps with the MoE over
#   it, beside local experts).
#                           [--quick]
#   gpus: what several GPUs of one host run (the NCCL and NVLink paths): the two-GPU cases of the
#   nccl and worker transport tests, gpu_ll_bench between GPUs 0 and 1 (NVLink), and the
#   PyTorch all-to-all baselines (bench/gpu/torch_all_to_all.py) over every GPU and over 2;
#   on one GPU the same programs on GPU 0 alone (a smoke run: the tests skip their
#   two-GPU cases, the baselines run one rank). Then gpu_exchange_bench with its two
#   processes on GPUs 0 and 1, and exchange_ranks_bench's 2 DP x 2 EP processes on GPUs 0-3
#   over nccl and ucx (on fewer GPUs, ucx on GPU 0), beside the all-to-all baselines
#   (bench/gpu/exchange_vs_torch.py prints the ratios).
#   gpus-decode: cluster_decode_bench.sh with 1 + 1 processes on
#   GPUs 0 and 1 and, with four GPUs, 2 + 2 on 0-3, at concurrency 1, 32 and 128 (decode
#   with a GPU per process; DXS_DECODE_LAYERS layers, 48 by default). gpus-eplb:
#   bench/eplb_bench.sh (1 attention + 4 expert ranks, EPLB off and on, the skewed model)
#   with the workers on the GPUs here (round the list).
#   memcheck: compute-sanitizer memcheck over every single-process gpu test binary, whole.
#   gemv: ab with DXS_CUDA_GEMV=off and auto, decode and FFN side by side.
#   ll-status: DXS_CUDA_LL_STATUS=kernel against copy (the stall test x100, the LL tests,
#   gpu_bench --low-latency --quick in interleaved rounds).
#   fp8: fp8_cuda_test, cuda_engine_test's FP8 cases and gpu_bench --fp8 [--quick].
#   fp8-decode: gpu_bench --fp8-decode [--quick], the whole model bf16 against FP8 projections.
#   decode-ab "ENV=v ..." "ENV=v ..." ...: gpu_bench --fp8-decode --quick at batch 1 and 8 (bf16
#   and FP8 in each process) under each set of environment settings, the first the baseline,
#   in DXS_AB_ROUNDS (2) rounds that keep the order (about 75 s a setting a round on an H100); then
#   decode_ab_summary.py's table (means over the rounds, changes against the first, ratios).
#   The A/B modes (decode-ab, decode-old-new, fp8-split, switch-ab) start no run that would
#   pass DXS_DEADLINE_S (560) from the call's start, so their tables come back inside the
#   device's 600 s; the summary names what was skipped.
#   l2-prefetch: decode-ab over DXS_CUDA_L2_PREFETCH (off, attention, all).
#   decode-old-new: decode-ab's runs over builds instead of settings: .device-old (or each name
#   in DXS_DECODE_BUILDS; "new" is .device; NAME:ENV=v,ENV=v runs a build under settings)
#   against .device, rounds alternating the order.
#   fp8-split: gpu_bench --fp8-decode --quick at batch 1 and 8 with the bf16 engine, then FP8
#   in all projections, in the attention's only and in the experts' only (--fp8-parts), in
#   DXS_AB_ROUNDS (2) rounds: which of FP8's kernels hold its step (about 2.5 minutes a round).
#   switch-ab "ENV=v ..." "ENV=v ..." ...: cuda_backend, fp8, moe_ops, dense_attention and
#   cuda_engine tests (or DXS_SWITCH_SUITES, space-separated) under each setting after the
#   first, then decode-ab over all of them.
#   old-new: .device-old/bin (an older commit's binaries) against .device/bin: gpu_bench --quick,
#   gpu_ll_bench and the serving loop, alternating, with new/old ratios.
#   serving-ratio: the serving loop (dxs bench --local, overlap on and off) at concurrency 1
#   and 32 against gpu_bench's decode step at batch 1 and 32, in one run.
#   bench/gpu/run_device.sh ab "ENV=v ..." "ENV=v ..." ...: gpu_bench --quick under each set of
#   environment settings (the first is the baseline), in DXS_AB_ROUNDS (2) interleaved
#   rounds; the decode and FFN rows side by side, medians over the rounds, ratios to the first.
set -uo pipefail
cd "$(dirname "$0")/../.."
what=${1:-all}
quick=${2:-}
# The call's start, for the A/B modes' deadline (below); the modes of a comma-separated list
# run as invocations of their own and inherit it.
export DXS_CALL_START=${DXS_CALL_START:-$(date +%s)}
# Several modes, comma-separated (fp8-decode,fp8,exchange,ll: what an H200 is asked for), run
# one after another in one call, each printing its own table; then everything they wrote goes
# into runs.tgz (8 files come back).
if [[ $what == *,* ]]; then
  OUT=${OUT:-/tmp/dxs-gpu-out}
  export OUT
  for mode in ${what//,/ }; do
    echo "== run_device.sh $mode $quick"
    bash "$0" "$mode" $quick
  done
  packed=$(cd "$OUT" && ls -A | grep -vxE 'runs\.tgz')
  [ -n "$packed" ] && (cd "$OUT" && tar czf runs.tgz $packed && rm -rf $packed)
  exit 0
fi
variants=()
if [ "$what" = ab ] || [ "$what" = decode-ab ] || [ "$what" = switch-ab ]; then
  shift; variants=("$@"); quick=
fi
# gemv: gemv.cu's decode-sized paths against the GEMM libraries (cuBLAS, CUTLASS).
if [ "$what" = gemv ]; then what=ab; variants=("DXS_CUDA_GEMV=off" "DXS_CUDA_GEMV=auto"); fi
OUT=${OUT:-/tmp/dxs-gpu-out}
mkdir -p "$OUT"
[ -f .device.tar.xz ] && tar xJf .device.tar.xz
source .device/env.sh
export DXS_SOURCE_DIR=$PWD DXS_BIN_DIR=$PWD/.device/bin
# Under compute-sanitizer, dense_attention_cuda_test runs FlashInfer's SM90 kernel without
# checking its values: with the tool attached they are wrong in some runs even when no kernel
# is instrumented (docs/gpu.md, "Known open problems"; the runs: docs/results/gpu-tests.md).
sanitize() { DXS_UNDER_COMPUTE_SANITIZER=1 "$@"; }
# A device call is killed at its limit (600 s) and then returns none of the summary printed
# last: the repeated runs of an A/B stop starting once they would pass DXS_DEADLINE_S (560 by
# default) from the call's start, and the summary says which were skipped. The start is the
# first invocation's (set at the top), kept across the comma-separated modes' own invocations.
deadline=${DXS_DEADLINE_S:-560}
# fits SECONDS LABEL: whether work of about SECONDS still ends before the deadline; if not,
# LABEL goes into the summary as skipped.
fits() {
  local used=$(($(date +%s) - DXS_CALL_START))
  ((used + $1 <= deadline)) && return 0
  summary+=("$2: skipped ($used s of the call gone, about $1 s more would pass ${deadline} s)")
  return 1
}
# One decode A/B run (decode-ab, decode-old-new): gpu_bench --fp8-decode --quick at batch 1
# and 8 from bin directory $1 under the settings $2 (words, may be empty) into log $3; $4
# labels its summary line and its rows. Its rows also go to $OUT/decode_ab.tsv under the
# setting's name $5 and round $6, for decode_ab_summary.py's means and ratios. About 75 s on
# an H100 (DXS_DECODE_RUN_S, 90, is what it is given against the deadline).
decode_run() {
  fits "${DXS_DECODE_RUN_S:-90}" "$4" || return 0
  # shellcheck disable=SC2086  # the settings are words
  env $2 timeout 150 "$1/gpu_bench" --fp8-decode --quick --decode-batches 1,8 >"$3" 2>&1
  summary+=("$4: rc=$?")
  echo "== $4"
  local rows
  rows=$(grep -E '^  (bf16|fp8) +[0-9]' "$3")
  [ -n "$rows" ] || return 0
  echo "$rows"
  awk -v s="$5" -v r="$6" 'BEGIN { OFS = "\t" } { print s, r, $1, $2, $3 }' <<<"$rows" \
    >>"$OUT/decode_ab.tsv"
}
# The A/B's table: each setting's means over the rounds and their change against the first.
decode_summary() {
  if [ ! -s "$OUT/decode_ab.tsv" ]; then
    summary+=("decode A/B: no run gave rows")
    return 0
  fi
  python3 bench/gpu/decode_ab_summary.py "$OUT/decode_ab.tsv" | tee "$OUT/decode_ab_summary.txt"
}
sanitizer=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
# The gpu-labelled test binaries; all but gpu_cluster_test run their GPU work in-process.
gpu_tests=(topk_softmax_cuda_test route_decode_cuda_test dense_attention_cuda_test moe_ops_cuda_test
           grouped_gemm_cuda_test fp8_cuda_test cuda_backend_test sampling_cuda_test cuda_engine_test
           ll_exchange_cuda_test low_latency_moe_cuda_test nccl_transport_test worker_transport_test
           gpu_cluster_test)
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm --format=csv >"$OUT/nvidia-smi.txt" 2>&1
summary=()
if [ "$what" = tests ] || [ "$what" = all ]; then
  for t in "${gpu_tests[@]}"; do
    [ -x ".device/bin/$t" ] || { summary+=("$t: not built"); continue; }
    timeout 300 ".device/bin/$t" >"$OUT/$t.log" 2>&1
    rc=$?
    summary+=("$t: rc=$rc $(grep -E '^\[  PASSED  \]|^\[  FAILED  \]|SKIPPED \]' "$OUT/$t.log" | tr '\n' ' ' | cut -c1-150)")
  done
  # dxs up --gpus 0: a 1 attention + 1 expert cluster on the GPU (time-sliced), its greedy
  # tokens against dxs run --device cuda on the same checkpoint.
  up_dir=$(mktemp -d)
  .device/bin/dxs gen-model --out "$up_dir/model" >/dev/null 2>&1
  port=$((20000 + RANDOM % 20000))
  .device/bin/dxs up --model "$up_dir/model" --attention 1 --experts 1 --gpus 0 --port "$port" \
    --log-dir "$up_dir/logs" >"$up_dir/up.log" 2>&1 &
  up_pid=$!
  for _ in $(seq 600); do grep -q "listening on" "$up_dir/up.log" && break; sleep 0.2; done
  prompt="--prompt-ids 5,6,7,8 --max-new-tokens 8 --format json"
  got=$(timeout 120 .device/bin/dxs generate --router "127.0.0.1:$port" $prompt 2>&1)
  want=$(timeout 120 .device/bin/dxs run --device cuda --model "$up_dir/model" $prompt 2>&1)
  tok() { python3 -c 'import json,sys; print(json.loads(sys.stdin.read())["tokens"])' 2>/dev/null; }
  g=$(echo "$got" | tok); w=$(echo "$want" | tok)
  kill "$up_pid" 2>/dev/null; wait "$up_pid" 2>/dev/null
  { echo "generate: $got"; echo "run: $want"; cat "$up_dir/up.log" "$up_dir"/logs/*.log; } \
    >"$OUT/dxs_up_gpus.log" 2>&1
  if [ -n "$g" ] && [ "$g" = "$w" ]; then
    summary+=("dxs up --gpus 0 (1+1 on one GPU): tokens equal dxs run --device cuda: $g")
  else
    summary+=("dxs up --gpus 0: MISMATCH or failure (cluster '$g', run '$w'; see dxs_up_gpus.log)")
  fi
  if [ -x "$sanitizer" ]; then
    sanitize timeout 300 "$sanitizer" --tool memcheck --error-exitcode 99 .device/bin/cuda_backend_test \
      >"$OUT/memcheck.log" 2>&1
    summary+=("memcheck cuda_backend_test: rc=$? $(grep -E 'ERROR SUMMARY' "$OUT/memcheck.log" | tail -1)")
    # The decode attention kernel (its split partials, counters and last-block merge) is
    # driven from dense_attention_cuda_test, whose CPU references make it long: its
    # small-decode cases only.
    sanitize timeout 300 "$sanitizer" --tool memcheck --error-exitcode 99 \
      .device/bin/dense_attention_cuda_test --gtest_filter='*SmallDecodeBatches*' \
      >"$OUT/memcheck_decode.log" 2>&1
    summary+=("memcheck decode attention: rc=$? $(grep -E 'ERROR SUMMARY' "$OUT/memcheck_decode.log" | tail -1)")
  else
    summary+=("memcheck: compute-sanitizer not found")
  fi
fi
if [ "$what" = memcheck ]; then
  # compute-sanitizer memcheck over every single-process gpu test binary, whole (no
  # filters), all at once: the sanitizer's cost is mostly host time and this machine has
  # the cores. gpu_cluster_test is left out: its GPU work runs in the service processes it
  # starts, which the other binaries' kernels already cover. Logs go into memcheck.tgz.
  pids=()
  names=()
  for t in "${gpu_tests[@]}"; do
    [ "$t" = gpu_cluster_test ] && continue
    [ -x ".device/bin/$t" ] || { summary+=("memcheck $t: not built"); continue; }
    sanitize timeout "${DXS_MEMCHECK_TIMEOUT:-480}" "$sanitizer" --tool memcheck --error-exitcode 99 \
      ".device/bin/$t" >"$OUT/memcheck_$t.log" 2>&1 &
    pids+=($!)
    names+=("$t")
  done
  for i in "${!pids[@]}"; do
    wait "${pids[$i]}"
    rc=$?
    log="$OUT/memcheck_${names[$i]}.log"
    summary+=("memcheck ${names[$i]}: rc=$rc $(grep -E 'ERROR SUMMARY' "$log" | tail -1) $(grep -E '^\[  PASSED  \]|^\[  FAILED  \]' "$log" | tr '\n' ' ')")
  done
  (cd "$OUT" && tar czf memcheck.tgz memcheck_*.log && rm -f memcheck_*.log)
fi
if [ "$what" = cluster ] || [ "$what" = exchange ] || [ "$what" = all ]; then
  # Between two processes on the one GPU: dxs's dispatch+combine round trip against the
  # interprocess-event ping-pong.
  if [ -x .device/bin/gpu_exchange_bench ]; then
    timeout 400 .device/bin/gpu_exchange_bench --json "$OUT/exchange.jsonl" \
      >"$OUT/gpu_exchange_bench.log" 2>&1
    summary+=("gpu_exchange_bench: rc=$?")
    tail -20 "$OUT/gpu_exchange_bench.log"
  fi
fi
if [ "$what" = ll ] || [ "$what" = exchange ] || [ "$what" = all ]; then
  # The low-latency exchange's round trip between two ranks of one process, beside the copy
  # floor (one GPU: HBM, not NVLink).
  if [ -x .device/bin/gpu_ll_bench ]; then
    timeout 120 .device/bin/gpu_ll_bench --json "$OUT/ll.jsonl" >"$OUT/gpu_ll_bench.log" 2>&1
    summary+=("gpu_ll_bench: rc=$?")
    cat "$OUT/gpu_ll_bench.log"
  fi
  # Which runtime calls hold later launches behind a spinning kernel (the one-process
  # ranks' hazard: expert_service/local_low_latency_experts.h).
  if [ -x .device/bin/gpu_host_call_probe ]; then
    CUDA_MODULE_LOADING=EAGER timeout 60 .device/bin/gpu_host_call_probe \
      --json "$OUT/host_calls.jsonl" >"$OUT/gpu_host_call_probe.log" 2>&1
    summary+=("gpu_host_call_probe: rc=$?")
    cat "$OUT/gpu_host_call_probe.log"
  fi
  # Decode steps whose MoE goes over it to expert ranks of this process (through the
  # Backend: LowLatencyMoeExecutor, ExpertShard::ForwardLowLatency), beside local experts.
  timeout 400 .device/bin/gpu_bench --low-latency --json "$OUT/decode_ll.jsonl" \
    >"$OUT/gpu_bench_ll.log" 2>&1
  summary+=("gpu_bench --low-latency: rc=$?")
  cat "$OUT/gpu_bench_ll.log"
fi
if [ "$what" = gpus ]; then
  num_gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')
  summary+=("GPUs here: $num_gpus")
  for t in nccl_transport_test worker_transport_test; do
    timeout 300 ".device/bin/$t" >"$OUT/$t.log" 2>&1
    summary+=("$t: rc=$? $(grep -E '^\[  PASSED  \]|^\[  FAILED  \]|^\[  SKIPPED \] [0-9]' "$OUT/$t.log" | tr '\n' ' ')")
  done
  devices=0,0
  [ "$num_gpus" -ge 2 ] && devices=0,1
  timeout 180 .device/bin/gpu_ll_bench --devices "$devices" --json "$OUT/ll_gpus.jsonl" \
    >"$OUT/gpu_ll_bench_gpus.log" 2>&1
  summary+=("gpu_ll_bench --devices $devices: rc=$?")
  cat "$OUT/gpu_ll_bench_gpus.log"
  timeout 240 .device/bin/gpu_exchange_bench --devices "$devices" --reps 100 \
    --json "$OUT/exchange_gpus.jsonl" >"$OUT/gpu_exchange_bench_gpus.log" 2>&1
  summary+=("gpu_exchange_bench --devices $devices: rc=$?")
  cat "$OUT/gpu_exchange_bench_gpus.log"
  # dxs's dispatch + combine over 2 DP x 2 EP processes: nccl and ucx on four
  # GPUs; on fewer, ucx with every rank on GPU 0 (time-sliced: a smoke run; nccl refuses two
  # ranks on one GPU).
  ranks_runs="ucx:0"
  [ "$num_gpus" -ge 4 ] && ranks_runs="nccl:0,1,2,3 ucx:0,1,2,3"
  for run in $ranks_runs; do
    tr=${run%%:*}
    timeout 240 .device/bin/exchange_ranks_bench --ranks 2x2 --device cuda --gpus "${run#*:}" \
      --transport "$tr" --reps 100 --json "$OUT/ranks_$tr.jsonl" >"$OUT/exchange_ranks_$tr.log" 2>&1
    summary+=("exchange_ranks_bench 2x2 $run: rc=$?")
    cat "$OUT/exchange_ranks_$tr.log"
  done
  worlds=$num_gpus
  [ "$num_gpus" -gt 2 ] && worlds="2 $num_gpus"
  for w in $worlds; do
    timeout 300 python3 bench/gpu/torch_all_to_all.py --world "$w" --json "$OUT/a2a_w$w.jsonl" \
      >"$OUT/torch_all_to_all_w$w.log" 2>&1
    summary+=("torch_all_to_all --world $w: rc=$?")
    cat "$OUT/torch_all_to_all_w$w.log"
  done
  python3 bench/gpu/exchange_vs_torch.py "$OUT"/ranks_*.jsonl "$OUT"/a2a_w*.jsonl \
    >"$OUT/exchange_vs_torch.txt" 2>&1
  summary+=("exchange_vs_torch: rc=$?")
  cat "$OUT/exchange_vs_torch.txt"
fi
if [ "$what" = gpus-decode ]; then
  num_gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')
  clusters="1x1@0"
  [ "$num_gpus" -ge 2 ] && clusters="1x1@0,1"
  [ "$num_gpus" -ge 4 ] && clusters="1x1@0,1 2x2@0,1,2,3"
  DXS_DECODE_CLUSTERS="$clusters" DXS_DECODE_CONCURRENCY="1 32 128" \
    timeout 560 bench/gpu/cluster_decode_bench.sh "${DXS_DECODE_LAYERS:-48}" \
    >"$OUT/cluster_decode_gpus.log" 2>&1
  summary+=("cluster_decode_bench ($clusters): rc=$?")
  cat "$OUT/cluster_decode_gpus.log"
fi
if [ "$what" = gpus-eplb ]; then
  gpu_list=$(nvidia-smi --query-gpu=index --format=csv,noheader 2>/dev/null | paste -sd, -)
  DXS_BIN_DIR=.device/bin DXS_BENCH_GPUS="$gpu_list" timeout 560 bash bench/eplb_bench.sh \
    >"$OUT/eplb_gpus.log" 2>&1
  summary+=("eplb_bench on GPUs $gpu_list: rc=$?")
  cat "$OUT/eplb_gpus.log"
fi
if [ "$what" = cluster ] || [ "$what" = decode ] || [ "$what" = all ]; then
  # Decode of the Qwen3-30B-A3B shape (DXS_DECODE_LAYERS layers, all 48 by default), 1 + 1
  # processes with and without piecewise graphs against one process.
  timeout 540 bench/gpu/cluster_decode_bench.sh "${DXS_DECODE_LAYERS:-48}" \
    >"$OUT/cluster_decode.out" 2>&1
  summary+=("cluster_decode_bench: rc=$?")
  cat "$OUT/cluster_decode.out"
fi
if [ "$what" = serving-ratio ]; then
  # The serving loop against the engine: `dxs bench --local` (overlap scheduling on and off;
  # 32-token prompts, 64 out) at concurrency 1 and 32 beside gpu_bench's graphed decode step
  # at batch 1 and 32 (context 1024), in one run; the ratio is serving tok/s over step tok/s.
  timeout 300 .device/bin/gpu_bench --quick --json "$OUT/step.jsonl" >"$OUT/gpu_bench_quick.log" 2>&1
  summary+=("gpu_bench --quick: rc=$?")
  OUT="$OUT" DXS_DECODE_CLUSTERS=none DXS_DECODE_CONCURRENCY="1 32" \
    timeout 400 bench/gpu/cluster_decode_bench.sh 48 >"$OUT/serving_loop.out" 2>&1
  summary+=("cluster_decode_bench (single process): rc=$?")
  python3 bench/gpu/serving_ratio.py "$OUT/step.jsonl" "$OUT/cluster_decode.txt" \
    >"$OUT/serving_ratio.txt" 2>&1
  summary+=("serving ratio: rc=$?")
  cat "$OUT/serving_loop.out" "$OUT/serving_ratio.txt"
fi
if [ "$what" = ll-status ]; then
  # DXS_CUDA_LL_STATUS's A/B: a low-latency rank's status read by a kernel (the default) or
  # by copies. Under each: the stall test 100 times in a row, the LL test binaries whole,
  # then gpu_bench --low-latency --quick in DXS_AB_ROUNDS (2) interleaved rounds.
  for v in kernel copy; do
    DXS_CUDA_LL_STATUS=$v timeout 200 .device/bin/low_latency_moe_cuda_test \
      --gtest_filter='*StatusReadsDoNotWaitBehindTheAttentionRanksCopies' --gtest_repeat=100 \
      >"$OUT/stall_$v.log" 2>&1
    summary+=("[$v] stall test x100: rc=$? $(grep -c '^\[       OK \]' "$OUT/stall_$v.log") OK, $(grep -c '^\[  FAILED  \] L' "$OUT/stall_$v.log") failed")
    for t in low_latency_moe_cuda_test ll_exchange_cuda_test; do
      DXS_CUDA_LL_STATUS=$v timeout 200 ".device/bin/$t" >"$OUT/${t}_$v.log" 2>&1
      summary+=("[$v] $t: rc=$? $(grep -E '^\[  PASSED  \]|^\[  FAILED  \] [0-9]' "$OUT/${t}_$v.log" | tr '\n' ' ')")
    done
  done
  for round in $(seq "${DXS_AB_ROUNDS:-2}"); do
    for v in kernel copy; do
      DXS_CUDA_LL_STATUS=$v timeout 200 .device/bin/gpu_bench --low-latency --quick \
        --json "$OUT/llab_${v}_$round.jsonl" >"$OUT/llab_${v}_$round.log" 2>&1
      summary+=("[$v] gpu_bench --low-latency --quick round $round: rc=$?")
    done
  done
  python3 - "$OUT" <<'PY'
import glob, json, statistics, sys
rows = {}
for v in ("kernel", "copy"):
    for path in sorted(glob.glob("%s/llab_%s_*.jsonl" % (sys.argv[1], v))):
        for line in open(path):
            r = json.loads(line)
            if r.get("section") == "decode-ll":
                key = (r["batch"], r["capacity"])
                rows.setdefault(key, {}).setdefault(v, []).append(r["ll_step_ms"])
print("LL decode step ms (gpu_bench --low-latency --quick), medians of the rounds")
print("%6s %9s %10s %10s %7s" % ("batch", "capacity", "kernel", "copy", "copy/k"))
for (b, c), d in sorted(rows.items()):
    k = statistics.median(d.get("kernel", [0])); cp = statistics.median(d.get("copy", [0]))
    print("%6d %9d %10.3f %10.3f %7.3f" % (b, c, k, cp, cp / k if k else 0))
PY
fi
if [ "$what" = fp8 ]; then
  # Block-scaled FP8 weights: the FP8 Linear test binary, the CUDA engine's FP8 cases (the
  # default-fp8 preset against the CPU engine; projections kept FP8), then gpu_bench --fp8
  # (FP8 Linear and the experts' grouped FFN beside bf16).
  timeout 200 .device/bin/fp8_cuda_test >"$OUT/fp8_cuda_test.log" 2>&1
  summary+=("fp8_cuda_test: rc=$? $(grep -E '^\[  PASSED  \]|^\[  FAILED  \]' "$OUT/fp8_cuda_test.log" | tr '\n' ' ')")
  timeout 300 .device/bin/cuda_engine_test --gtest_filter='*fp8*:*Fp8*' >"$OUT/cuda_engine_fp8.log" 2>&1
  summary+=("cuda_engine_test (fp8): rc=$? $(grep -E '^\[  PASSED  \]|^\[  FAILED  \]' "$OUT/cuda_engine_fp8.log" | tr '\n' ' ')")
  grep -E 'first-token logits' "$OUT/cuda_engine_fp8.log" | sort | uniq -c | sort -rn | head -5
  timeout 300 .device/bin/gpu_bench --fp8 $quick --json "$OUT/fp8.jsonl" \
    >"$OUT/gpu_bench_fp8.log" 2>&1
  summary+=("gpu_bench --fp8: rc=$?")
  sed -n '/\[fp8-linear\]/,$p' "$OUT/gpu_bench_fp8.log"
  # PyTorch's FP8 grouped GEMM (row-wise scales) and its bf16 one on the same FFN.
  timeout 300 python3 bench/gpu/torch_baselines.py --fp8 $quick --json "$OUT/torch_fp8.jsonl" \
    >"$OUT/torch_fp8.log" 2>&1
  summary+=("torch_baselines.py --fp8: rc=$?")
  cat "$OUT/torch_fp8.log"
fi
if [ "$what" = fp8-decode ]; then
  # The whole Qwen3-30B-A3B shape (48 layers) with bf16 weights, then with FP8 projections:
  # decode at batch 1, 32 (and 128 without --quick) and a 4096-token prefill, each against
  # its HBM floor, with the fp8 / bf16 ratios.
  timeout 500 .device/bin/gpu_bench --fp8-decode $quick --json "$OUT/fp8_decode.jsonl" \
    >"$OUT/gpu_bench_fp8_decode.log" 2>&1
  summary+=("gpu_bench --fp8-decode: rc=$?")
  sed -n '/\[decode-fp8\]/,$p' "$OUT/gpu_bench_fp8_decode.log"
fi
if [ "$what" = fp8-split ]; then
  for round in $(seq "${DXS_AB_ROUNDS:-2}"); do
    fits 160 "fp8-split round $round" || continue
    timeout 280 .device/bin/gpu_bench --fp8-decode --quick --decode-batches 1,8 \
      --fp8-parts all,attention,experts --json "$OUT/fp8_split_$round.jsonl" \
      >"$OUT/fp8_split_$round.log" 2>&1
    summary+=("fp8-split round $round: rc=$?")
    echo "== round $round"
    grep -E '^  (bf16|fp8[-ae]*) +[0-9]|/ bf16' "$OUT/fp8_split_$round.log"
  done
fi
if [ "$what" = decode-old-new ]; then
  # Code, not switches: gpu_bench --fp8-decode --quick --decode-batches 1,8 from each build in
  # DXS_DECODE_BUILDS ("old new" by default; "new" is .device, any other name X is .device-X,
  # unpacked from .device-X.tar.xz when it came), in DXS_AB_ROUNDS (2) rounds whose order
  # alternates, so that neither build always runs first.
  # A name may carry settings for its runs after a colon, commas between them
  # (new:DXS_CUDA_EXPERT_STAGING=bulk): a build's switch beside the builds.
  read -r -a builds <<<"${DXS_DECODE_BUILDS:-old new}"
  for spec in "${builds[@]}"; do
    b=${spec%%:*}
    [ "$b" != new ] && [ -f ".device-$b.tar.xz" ] && [ ! -d ".device-$b" ] && tar xJf ".device-$b.tar.xz"
  done
  for round in $(seq "${DXS_AB_ROUNDS:-2}"); do
    order=("${builds[@]}")
    [ $((round % 2)) = 0 ] && mapfile -t order < <(printf '%s\n' "${builds[@]}" | tac)
    for spec in "${order[@]}"; do
      b=${spec%%:*} settings=
      [ "$spec" != "$b" ] && settings=${spec#*:} && settings=${settings//,/ }
      dir=.device; [ "$b" != new ] && dir=".device-$b"
      decode_run "$dir/bin" "$settings" "$OUT/decode_old_new_$(printf %s "$spec" | tr -c 'A-Za-z0-9' _)_$round.log" \
        "decode-old-new [$spec] round $round" "$spec" "$round"
    done
  done
  decode_summary
fi
if [ "$what" = l2-prefetch ]; then
  what=decode-ab
  variants=("DXS_CUDA_L2_PREFETCH=off" "DXS_CUDA_L2_PREFETCH=attention" "DXS_CUDA_L2_PREFETCH=all")
fi
if [ "$what" = switch-ab ]; then
  # A switch's bits first: under each setting after the first, the kernel and engine suites
  # that compare with the CPU backend or with the default path bit for bit.
  for v in "${variants[@]:1}"; do
    for t in ${DXS_SWITCH_SUITES:-cuda_backend_test fp8_cuda_test moe_ops_cuda_test \
             dense_attention_cuda_test cuda_engine_test}; do
      fits 60 "$t [$v]" || continue
      log="$OUT/switch_${t}_$(echo "$v" | tr -c 'A-Za-z0-9' _).log"
      left=$((deadline - ($(date +%s) - DXS_CALL_START)))
      env $v timeout $((left < 300 ? left : 300)) ".device/bin/$t" >"$log" 2>&1
      summary+=("$t [$v]: rc=$? $(grep -E '^\[  PASSED  \]|^\[  FAILED  \]' "$log" | tr '\n' ' ')")
    done
  done
  what=decode-ab
fi
if [ "$what" = decode-ab ]; then
  # Each setting in its own process, bf16 and FP8 in each, the settings' order the same every
  # round (results/fp8.md's A/B tables).
  for round in $(seq "${DXS_AB_ROUNDS:-2}"); do
    for i in "${!variants[@]}"; do
      decode_run .device/bin "${variants[$i]}" "$OUT/decode_ab_${i}_$round.log" \
        "decode-ab [${variants[$i]}] round $round" "${variants[$i]:-default}" "$round"
    done
  done
  decode_summary
fi
if [ "$what" = old-new ]; then
  # A refactor's "unchanged within noise", on the GPU: the binaries of an older commit (in
  # .device-old/bin, packed as .device-old.tar.xz; see bench/gpu/README.md) against these,
  # in DXS_AB_ROUNDS (2) rounds that alternate which goes first: gpu_bench --quick and
  # gpu_ll_bench each round, then the serving loop once each (cluster_decode_bench.sh: the
  # single process and 1 attention + 1 expert process, piecewise graphs, concurrency 1 and
  # 32). Ratios are new against old (above 1: new is faster).
  [ -f .device-old.tar.xz ] && tar xJf .device-old.tar.xz
  declare -A bindir=([old]=.device-old/bin [new]=.device/bin)
  for round in $(seq "${DXS_AB_ROUNDS:-2}"); do
    order="old new"; [ $((round % 2)) = 0 ] && order="new old"
    for v in $order; do
      timeout 200 "${bindir[$v]}/gpu_bench" --quick --json "$OUT/on_${v}_$round.jsonl" \
        >"$OUT/on_gpu_bench_${v}_$round.log" 2>&1
      summary+=("[$v] gpu_bench --quick round $round: rc=$?")
      timeout 120 "${bindir[$v]}/gpu_ll_bench" --json "$OUT/on_ll_${v}_$round.jsonl" \
        >"$OUT/on_ll_${v}_$round.log" 2>&1
      summary+=("[$v] gpu_ll_bench round $round: rc=$?")
    done
  done
  for v in old new; do
    OUT="$OUT/serving_$v" DXS_BIN_DIR="${bindir[$v]}" DXS_DECODE_LOCAL=overlap \
      DXS_DECODE_MODES=piecewise DXS_DECODE_CONCURRENCY="1 32" \
      timeout 200 bench/gpu/cluster_decode_bench.sh 48 >"$OUT/serving_$v.out" 2>&1
    summary+=("[$v] serving: rc=$?")
  done
  python3 - "$OUT" <<'PY'
import glob, json, statistics, sys
out = sys.argv[1]
def rows(v):
    got = {}
    for path in sorted(glob.glob("%s/on_%s_*.jsonl" % (out, v))):
        for line in open(path):
            r = json.loads(line)
            if r.get("section") == "decode":
                got.setdefault("decode b%d tok/s" % r["batch"], []).append(r["tokens_per_s"])
            elif r.get("section") == "ffn":
                got.setdefault("ffn %d tokens us" % r["tokens"], []).append(r["us"])
            elif r.get("section") == "prefill":
                got.setdefault("prefill tok/s", []).append(r["tokens_per_s"])
    for path in sorted(glob.glob("%s/on_ll_%s_*.jsonl" % (out, v))):
        for line in open(path):
            r = json.loads(line)
            got.setdefault("ll h%d x %d us" % (r["hidden"], r["tokens"]), []).append(r["ll_us"])
    for line in open("%s/serving_%s/cluster_decode.txt" % (out, v)) if glob.glob(
            "%s/serving_%s/cluster_decode.txt" % (out, v)) else []:
        parts = line.rsplit(None, 4)
        if len(parts) == 5 and parts[2].replace(".", "").isdigit():
            name = "serve " + ("1+1" if "attn" in parts[0] else "local") + " c" + parts[1]
            got.setdefault(name + " tok/s", []).append(float(parts[2]))
    return {k: statistics.median(v) for k, v in got.items()}
old, new = rows("old"), rows("new")
print("old against new, medians of the rounds; ratio = new speed / old speed")
print("  %-24s %10s %10s %7s" % ("row", "old", "new", "ratio"))
for key in sorted(set(old) | set(new)):
    o, n = old.get(key), new.get(key)
    if o is None or n is None:
        print("  %-24s %10s %10s %7s" % (key, o or "-", n or "-", "-")); continue
    r = n / o if "tok/s" in key else o / n
    print("  %-24s %10.1f %10.1f %7.3f" % (key, o, n, r))
PY
fi
if [ "$what" = ab ]; then
  for round in $(seq "${DXS_AB_ROUNDS:-2}"); do
    for i in "${!variants[@]}"; do
      env ${variants[$i]} timeout 200 .device/bin/gpu_bench --quick \
        --json "$OUT/ab_${i}_$round.jsonl" >"$OUT/ab_${i}_$round.log" 2>&1
      summary+=("gpu_bench [${variants[$i]}] round $round: rc=$?")
    done
  done
  python3 - "$OUT" "${variants[@]}" <<'PY'
import glob, json, statistics, sys
out, variants = sys.argv[1], sys.argv[2:]
def rows(i):
    got = {}
    for path in sorted(glob.glob("%s/ab_%d_*.jsonl" % (out, i))):
        for line in open(path):
            r = json.loads(line)
            if r.get("section") == "decode":
                got.setdefault("decode b%d tok/s" % r["batch"], []).append(r["tokens_per_s"])
            elif r.get("section") == "ffn":
                got.setdefault("ffn %d tokens us" % r["tokens"], []).append(r["us"])
            elif r.get("section") == "prefill":
                got.setdefault("prefill tok/s", []).append(r["tokens_per_s"])
            elif r.get("section") == "attention":
                got.setdefault("attn b%d x %d us" % (r["batch"], r["context"]), []).append(r["us"])
    return {k: statistics.median(v) for k, v in got.items()}
table = [rows(i) for i in range(len(variants))]
print("A/B, gpu_bench --quick, medians of the rounds; ratio = speed against the first column")
for i, v in enumerate(variants):
    print("  [%d] %s" % (i, v or "(defaults)"))
for key in sorted(table[0]):
    cells = []
    for t in table:
        if key not in t:
            cells.append("-"); continue
        r = t[key] / table[0][key] if "tok/s" in key else table[0][key] / t[key]
        cells.append("%.1f (%.2fx)" % (t[key], r))
    print("  %-22s %s" % (key, "  ".join(cells)))
PY
fi
if [ "$what" = bench ] || [ "$what" = all ]; then
  timeout 420 .device/bin/gpu_bench $quick --json "$OUT/dxs.jsonl" >"$OUT/gpu_bench.log" 2>&1
  summary+=("gpu_bench: rc=$?")
  timeout 300 python3 bench/gpu/torch_baselines.py $quick --json "$OUT/torch.jsonl" \
    >"$OUT/torch.log" 2>&1
  summary+=("torch_baselines: rc=$?")
  python3 bench/gpu/report.py --dxs "$OUT/dxs.jsonl" --torch "$OUT/torch.jsonl" \
    --doc docs/gpu.md --out "$OUT" >"$OUT/report.txt" 2>&1
  summary+=("report: rc=$?")
  cat "$OUT/report.txt"
  # At most 8 files come back from $OUT: gpu.md and the plots stay loose, the rest (the JSON
  # lines, nvidia-smi.txt, report.txt, every log, and with `all` the tests' too) goes into
  # logs.tgz.
  packed=$(cd "$OUT" && ls -A | grep -vxE 'gpu\.md|gpu_[a-z0-9_]+\.png|logs\.tgz')
  if [ -n "$packed" ] && (cd "$OUT" && tar czf logs.tgz $packed); then
    (cd "$OUT" && rm -rf $packed)
    summary+=("logs: $OUT/logs.tgz ($(echo $packed | wc -w) files)")
  fi
fi
printf '%s\n' "${summary[@]}"
