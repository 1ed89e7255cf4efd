#!/usr/bin/env bash
# One device call: Nsight Compute (ncu --clock-control none, the card's own clocks) over
# gpu_bench's profile modes, so each missed target in docs/gpu.md has the kernel times
# that show what limits it. Builds nothing (the binaries come in .device/, packed by
# bench/gpu/bundle.sh). Per-kernel CSVs and a summary go to $OUT; the summary is printed.
#   bench/gpu/profile_device.sh [attention decode decode32 decode-fp8 prefill ...]
#   (decode, decode-fp8: the bf16 and the FP8 engine's decode step at DXS_PROFILE_BATCH rows, 1
#   by default, 2 layers, the FP8 one from gpu_bench --fp8-decode; prefill, prefill-fp8: a
#   4096-token prompt through one layer, bf16 (gpu_bench's [prefill]) and FP8 projections;
#   ffn-fp8: one bf16 and one FP8 grouped expert FFN call at DXS_PROFILE_TOKENS tokens, 16384
#   by default, from gpu_bench --fp8)
#   DXS_PROFILE_STALLS=1 adds the instructions issued, DRAM throughput and the main stall
#   reasons (per issued instruction) to every kernel: what holds a kernel that moves its bytes
#   below the copy rate (latency, the load queue, or its arithmetic).
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/dxs-gpu-out}
mkdir -p "$OUT"
[ -f .device.tar.xz ] && tar xJf .device.tar.xz
source .device/env.sh
ncu=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
metrics=gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum,launch__grid_size,launch__registers_per_thread,sm__warps_active.avg.pct_of_peak_sustained_active
# The stall pass is its own ncu run (ncu_<mode>_stalls.csv): a metric this ncu lacks fails
# only that run, not the kernel times.
stall=smsp__average_warps_issue_stalled
stall_metrics=smsp__inst_executed.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed
stall_metrics+=,${stall}_long_scoreboard_per_issue_active.ratio,${stall}_lg_throttle_per_issue_active.ratio
stall_metrics+=,${stall}_math_pipe_throttle_per_issue_active.ratio,${stall}_wait_per_issue_active.ratio
stall_metrics+=,${stall}_barrier_per_issue_active.ratio
stalls=$metrics,$stall_metrics
what=("$@")
[ ${#what[@]} -eq 0 ] && what=(attention decode prefill)
for w in "${what[@]}"; do
  case $w in
    attention) args=(--profile attention) ;;
    decode) args=(--profile decode --batch "${DXS_PROFILE_BATCH:-1}" --layers 2) ;;
    decode32) args=(--profile decode --batch 32 --layers 2) ;;
    decode-fp8) args=(--fp8-decode --profile decode --batch "${DXS_PROFILE_BATCH:-1}" --layers 2) ;;
    prefill) args=(--profile prefill --layers 1) ;;
    prefill-fp8) args=(--fp8-decode --profile prefill --layers 1) ;;
    ffn-fp8) args=(--fp8 --quick --profile ffn --batch "${DXS_PROFILE_TOKENS:-16384}") ;;
    *) echo "unknown profile $w"; continue ;;
  esac
  timeout 400 "$ncu" --clock-control none --profile-from-start off --csv --page raw \
    --metrics "$metrics" .device/bin/gpu_bench "${args[@]}" >"$OUT/ncu_$w.csv" 2>"$OUT/ncu_$w.log"
  echo "ncu $w: rc=$?"
  if [ "${DXS_PROFILE_STALLS:-0}" = 1 ]; then
    timeout 400 "$ncu" --clock-control none --profile-from-start off --csv --page raw \
      --metrics "$stalls" .device/bin/gpu_bench "${args[@]}" >"$OUT/ncu_${w}_stalls.csv" \
      2>"$OUT/ncu_${w}_stalls.log"
    echo "ncu $w (stalls): rc=$?"
  fi
done
python3 bench/gpu/ncu_summary.py --extra "$stall_metrics" "$OUT"/ncu_*.csv | tee "$OUT/ncu_summary.txt"
