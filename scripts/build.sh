#!/usr/bin/env bash
# Configures (once) and builds dxs with Ninja into ${DXS_BUILD_DIR:-build}.
# Usage: scripts/build.sh [ninja targets...]   (default: everything)
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD_DIR=${DXS_BUILD_DIR:-build}
if [ ! -f "$BUILD_DIR/build.ninja" ]; then
  cmake -S . -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=${DXS_BUILD_TYPE:-RelWithDebInfo} ${DXS_CMAKE_ARGS:-}
fi
cmake --build "$BUILD_DIR" ${DXS_BUILD_JOBS:+-j "$DXS_BUILD_JOBS"} ${1:+--target "$@"}
