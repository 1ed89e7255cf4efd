#!/usr/bin/env bash
# Probe of UCX 1.22 (PyPI libucx-cu13) moving GPU memory between two processes of one GPU:
# which transports it finds, which protocol it picks, and ucx_perftest tag latency and
# bandwidth for cuda and host buffers at the exchange's sizes. Logs under $OUT.
#   bench/gpu/ucx_cuda_probe.sh UCX_DIR   (UCX_DIR holds libucx/{bin,lib} from the wheel)
set -uo pipefail
ucx=$1
OUT=${OUT:-/tmp/ucx-probe-out}
mkdir -p "$OUT"
export LD_LIBRARY_PATH="$ucx/libucx/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export UCX_MODULE_DIR="$ucx/libucx/lib/ucx"
perf="$ucx/libucx/bin/ucx_perftest"
log="$OUT/ucx_probe.log"
{
  "$ucx/libucx/bin/ucx_info" -v
  "$ucx/libucx/bin/ucx_info" -d | grep -E "Transport|Device|memory" | sort | uniq -c
} >"$log" 2>&1
port=13337
one() {  # one() TEST MEM SIZE ITERS [extra env]
  local test=$1 mem=$2 size=$3 iters=$4
  port=$((port + 1))
  "$perf" -p "$port" >/dev/null 2>&1 &
  local server=$!
  sleep 0.5
  local line
  line=$(env ${5:-} timeout 60 "$perf" 127.0.0.1 -p "$port" -t "$test" -m "$mem" -s "$size" \
           -n "$iters" -w $((iters / 10 + 1)) 2>&1 | tee -a "$log" | grep -E "^Final:" | tail -1)
  wait "$server" 2>/dev/null
  # Final: iters, typical/avg/overall latency (us) ..., bandwidth avg/overall (MB/s)
  echo "$test $mem $size $line"
}
{
  echo "--- protocol selection for cuda,cuda 2 MiB tag_lat"
  one tag_lat cuda,cuda 2097152 20 "UCX_PROTO_INFO=y"
} >>"$log" 2>&1
printf '%-8s %-10s %10s  %s\n' test mem bytes "Final: iters typ_lat avg_lat overall_lat(us) bw_avg bw_overall(MB/s) ..." >"$OUT/ucx_probe.txt"
for size in 8 14336 2097152 16777216 58720256; do
  iters=2000; [ "$size" -ge 2097152 ] && iters=200
  for mem in cuda,cuda host,host; do
    one tag_lat "$mem" "$size" "$iters" >>"$OUT/ucx_probe.txt"
  done
done
one tag_bw cuda,cuda 58720256 100 >>"$OUT/ucx_probe.txt"
one tag_bw host,host 58720256 100 >>"$OUT/ucx_probe.txt"
cat "$OUT/ucx_probe.txt"
