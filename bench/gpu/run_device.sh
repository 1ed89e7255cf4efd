#!/usr/bin/env bash
# One device call (../shared/DEVICE.md): the gpu-labelled tests, compute-sanitizer on the
# backend test, gpu_bench and the PyTorch / Hugging Face baselines, then docs/gpu.md's
# results and plots into $OUT. Builds nothing: the binaries come in .device/ (packed here
# by bench/gpu/bundle.sh). Prints a short table last; full logs are in $OUT.
#   bench/gpu/run_device.sh [tests|bench|all] [--quick]
set -uo pipefail
cd "$(dirname "$0")/../.."
what=${1:-all}
quick=${2:-}
OUT=${OUT:-/tmp/dxs-gpu-out}
mkdir -p "$OUT"
[ -f .device.tar.xz ] && tar xJf .device.tar.xz
source .device/env.sh
export DXS_SOURCE_DIR=$PWD DXS_BIN_DIR=$PWD/.device/bin
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm --format=csv >"$OUT/nvidia-smi.txt" 2>&1
summary=()
if [ "$what" != bench ]; then
  for t in topk_softmax_cuda_test dense_attention_cuda_test moe_ops_cuda_test \
           grouped_gemm_cuda_test cuda_backend_test sampling_cuda_test cuda_engine_test \
           nccl_transport_test; do
    [ -x ".device/bin/$t" ] || { summary+=("$t: not built"); continue; }
    timeout 300 ".device/bin/$t" >"$OUT/$t.log" 2>&1
    rc=$?
    summary+=("$t: rc=$rc $(grep -E '^\[  PASSED  \]|^\[  FAILED  \]|SKIPPED \]' "$OUT/$t.log" | tr '\n' ' ' | cut -c1-150)")
  done
  sanitizer=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
  if [ -x "$sanitizer" ]; then
    timeout 300 "$sanitizer" --tool memcheck --error-exitcode 99 .device/bin/cuda_backend_test \
      >"$OUT/memcheck.log" 2>&1
    summary+=("memcheck cuda_backend_test: rc=$? $(grep -E 'ERROR SUMMARY' "$OUT/memcheck.log" | tail -1)")
  else
    summary+=("memcheck: compute-sanitizer not found")
  fi
fi
if [ "$what" != tests ]; then
  timeout 420 .device/bin/gpu_bench $quick --json "$OUT/dxs.jsonl" >"$OUT/gpu_bench.log" 2>&1
  summary+=("gpu_bench: rc=$?")
  timeout 300 python3 bench/gpu/torch_baselines.py $quick --json "$OUT/torch.jsonl" \
    >"$OUT/torch.log" 2>&1
  summary+=("torch_baselines: rc=$?")
  python3 bench/gpu/report.py --dxs "$OUT/dxs.jsonl" --torch "$OUT/torch.jsonl" \
    --doc docs/gpu.md --out "$OUT" >"$OUT/report.txt" 2>&1
  summary+=("report: rc=$?")
  cat "$OUT/report.txt"
fi
printf '%s\n' "${summary[@]}"
