#!/usr/bin/env bash
# The test command: installs dependencies, builds everything, runs every test (ctest:
# unit, golden, disagg, gpu (skips without a GPU)), checks the Kubernetes manifests, and
# runs each fuzzer for ${DXS_FUZZ_SECONDS:-60} seconds on its seed corpus.
# Then builds the container image with podman and checks it (DXS_CHECK_CONTAINER=0: not).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
scripts/build.sh
ctest --test-dir "${DXS_BUILD_DIR:-build}" --output-on-failure -j "$(nproc)" ${DXS_CTEST_ARGS:-}
# Kubernetes manifests: render every overlay and validate offline (schemas, CRDs, PromQL).
scripts/check-deploy.sh
# The image: podman build on a debootstrapped Debian 12 base, its metadata, and a 2 x 2
# cluster from its file system in a chroot; then, where the build made the CUDA plugin
# (build/bin/libdxs_cuda.so, wherever the CUDA toolkit is installed), the CUDA image from
# the same layers plus cuBLAS, checked without a GPU. The binaries just built go into the
# images (DXS_PREBUILT_BIN), which keeps it to a few minutes on 2 cores;
# DXS_CHECK_CONTAINER=0 skips it.
if [ "${DXS_CHECK_CONTAINER:-1}" = 1 ]; then
  DXS_CHECK_CONTAINER=1 DXS_PREBUILT_BIN="${DXS_PREBUILT_BIN:-${DXS_BUILD_DIR:-build}/bin}" \
    scripts/check-container.sh
fi
if [ "${DXS_SKIP_FUZZ:-0}" != 1 ]; then
  scripts/fuzz.sh
fi
echo "run-tests: all tests passed"
