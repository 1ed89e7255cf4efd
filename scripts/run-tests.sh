#!/usr/bin/env bash
# The test command: installs dependencies, builds everything, runs every test (ctest:
# unit, golden, gpu (skips without a GPU), ...) and then each fuzzer for
# ${DXS_FUZZ_SECONDS:-60} seconds on its seed corpus.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
scripts/build.sh
ctest --test-dir "${DXS_BUILD_DIR:-build}" --output-on-failure -j "$(nproc)" ${DXS_CTEST_ARGS:-}
if [ "${DXS_SKIP_FUZZ:-0}" != 1 ]; then
  scripts/fuzz.sh
fi
echo "run-tests: all tests passed"
