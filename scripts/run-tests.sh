#!/usr/bin/env bash
# The test command: installs dependencies, builds everything, runs every test (ctest:
# unit, golden, disagg, gpu (skips without a GPU)), checks the Kubernetes manifests, and
# runs each fuzzer for ${DXS_FUZZ_SECONDS:-60} seconds on its seed corpus.
# DXS_CHECK_CONTAINER=1 also replays the container build in a debootstrapped root.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
scripts/build.sh
ctest --test-dir "${DXS_BUILD_DIR:-build}" --output-on-failure -j "$(nproc)" ${DXS_CTEST_ARGS:-}
# Kubernetes manifests: render every overlay and validate offline (schemas, CRDs, PromQL).
scripts/check-deploy.sh
# The container's build steps in a debootstrapped Debian 12 root (slow; opt-in).
if [ "${DXS_CHECK_CONTAINER:-0}" = 1 ]; then
  scripts/check-container.sh
fi
if [ "${DXS_SKIP_FUZZ:-0}" != 1 ]; then
  scripts/fuzz.sh
fi
echo "run-tests: all tests passed"
