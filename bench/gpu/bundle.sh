#!/usr/bin/env bash
# Packs the GPU tests and gpu_bench, built here, into .device/ for bench/gpu/run_device.sh
# on the GPU machine (../shared/tools/device-bundle.sh adds the shared libraries).
set -euo pipefail
cd "$(dirname "$0")/../.."
build=${DXS_BUILD_DIR:-build}
bins=()
for t in topk_softmax_cuda_test route_decode_cuda_test dense_attention_cuda_test moe_ops_cuda_test \
         grouped_gemm_cuda_test fp8_cuda_test cuda_backend_test sampling_cuda_test cuda_engine_test gpu_bench \
         nccl_transport_test worker_transport_test gpu_cluster_test gpu_exchange_bench exchange_ranks_bench gpu_ll_bench gpu_host_call_probe ll_exchange_cuda_test low_latency_moe_cuda_test dxs \
         dxs-router dxs-attention dxs-expert libdxs_cuda.so libdxs_nccl.so; do
  [ -e "$build/bin/$t" ] && bins+=("$build/bin/$t")
done
rm -rf .device
../shared/tools/device-bundle.sh .device "${bins[@]}"
# UCX is the libucx-cu13 wheel's 1.22 (ldd brought its libraries): its transport modules,
# cuda_ipc among them, replace the Debian ones device-bundle.sh copies.
ucx_dir=$(.venv/bin/python3 -c \
  "import importlib.util; print(list(importlib.util.find_spec('libucx').submodule_search_locations)[0])")
rm -f .device/ucx/*
cp -L "$ucx_dir"/lib/ucx/libuc[tm]_*.so.0 .device/ucx/
# Debug info off and one compressed archive: the carry limit is 64 MiB for everything.
strip --strip-debug .device/bin/* .device/lib/* 2>/dev/null || true
tar cf - .device | xz -T2 -6 >.device.tar.xz
du -h .device.tar.xz | awk '{print "archive: " $1 " (.device.tar.xz; carry it, run_device.sh unpacks it)"}'
