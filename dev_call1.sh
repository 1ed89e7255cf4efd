#!/usr/bin/env bash
# Call 1: x staged in the one-row FP8 GEMV, the down GEMM on ping-pong tiles at prefill sizes.
export DXS_SWITCH_SUITES="fp8_cuda_test grouped_gemm_cuda_test moe_ops_cuda_test"
export DXS_AB_ROUNDS=2
bash bench/gpu/run_device.sh switch-ab "" DXS_CUDA_GEMV_FP8_STAGE_X=on DXS_CUDA_FP8_GROUPED_TILES=pingpong-short-k 2>&1 | tail -60
