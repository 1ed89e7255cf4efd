#!/usr/bin/env bash
# The test command: installs dependencies, builds everything, then runs every stage:
#   ctest       unit, golden, disagg, gpu (skips without a GPU), ...
#   deploy      the Kubernetes manifests rendered and validated offline
#   container   the image built with podman and checked (DXS_CHECK_CONTAINER=0: skipped)
#   fuzz        each fuzzer for ${DXS_FUZZ_SECONDS:-60} s on its seed corpus (DXS_SKIP_FUZZ=1:
#               skipped)
# Every stage runs even when an earlier one failed (a stage that needs the build is not run
# when the build failed), a one-line verdict per stage is printed at the end, and the exit
# status is non-zero when any stage failed.
set -uo pipefail
cd "$(dirname "$0")/.."
build_dir=${DXS_BUILD_DIR:-build}

stages=() verdicts=()
failed=0
verdict() {  # NAME VERDICT
  stages+=("$1")
  verdicts+=("$2")
  case $2 in FAILED*) failed=1 ;; esac
}
# run_stage NAME COMMAND...: runs it, records "passed (Ns)" or "FAILED (exit E, Ns)".
run_stage() {
  local name=$1
  shift
  echo "run-tests: --- $name: $*"
  local start=$SECONDS rc=0
  "$@" || rc=$?
  if [ "$rc" -eq 0 ]; then
    verdict "$name" "passed ($((SECONDS - start)) s)"
  else
    verdict "$name" "FAILED (exit $rc, $((SECONDS - start)) s)"
  fi
  return "$rc"
}

print_verdicts() {
  echo
  echo "run-tests: verdicts"
  for i in "${!stages[@]}"; do
    printf 'run-tests:   %-10s %s\n' "${stages[$i]}" "${verdicts[$i]}"
  done
}

if ! run_stage setup scripts/setup.sh; then
  print_verdicts
  echo "run-tests: setup failed; nothing else can run" >&2
  exit 1
fi
built=1
run_stage build scripts/build.sh || built=0

if [ "$built" = 1 ]; then
  # shellcheck disable=SC2086  # DXS_CTEST_ARGS is a list of ctest arguments
  run_stage ctest ctest --test-dir "$build_dir" --output-on-failure -j "$(nproc)" \
    ${DXS_CTEST_ARGS:-}
else
  verdict ctest "FAILED (not run: the build failed)"
fi

# Kubernetes manifests: render every overlay and validate offline (schemas, CRDs, PromQL).
run_stage deploy scripts/check-deploy.sh

# The image: podman build on a debootstrapped Debian 12 base, its metadata, and a 2 x 2
# cluster from its file system in a chroot; then, where the build made the CUDA plugin
# (build/bin/libdxs_cuda.so, wherever the CUDA toolkit is installed), the CUDA image from
# the same layers plus cuBLAS, checked without a GPU. The binaries just built go into the
# images (DXS_PREBUILT_BIN), which keeps it to a few minutes on 2 cores.
if [ "${DXS_CHECK_CONTAINER:-1}" != 1 ]; then
  verdict container "skipped (DXS_CHECK_CONTAINER=${DXS_CHECK_CONTAINER})"
elif [ "$built" = 1 ]; then
  run_stage container env DXS_CHECK_CONTAINER=1 \
    DXS_PREBUILT_BIN="${DXS_PREBUILT_BIN:-$build_dir/bin}" scripts/check-container.sh
else
  verdict container "FAILED (not run: the build failed)"
fi

if [ "${DXS_SKIP_FUZZ:-0}" = 1 ]; then
  verdict fuzz "skipped (DXS_SKIP_FUZZ=1)"
else
  run_stage fuzz scripts/fuzz.sh
fi

print_verdicts
if [ "$failed" != 0 ]; then
  echo "run-tests: FAILED" >&2
  exit 1
fi
echo "run-tests: all tests passed"
