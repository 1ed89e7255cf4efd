#!/bin/sh
# The build stage of deploy/container/Dockerfile: installs the build dependencies with
# scripts/setup.sh and builds the four binaries with scripts/build.sh (CPU only), then
# installs them into PREFIX/bin (the CUDA plugin, when there is one, into PREFIX/cuda); and
# makes the SMG gateway's venv (smg, the version scripts/setup.sh pins) at DXS_SMG_VENV.
# scripts/check-container.sh runs this same file in a Debian 12 chroot, so the image build
# and the check cannot drift apart.
#
#   build-steps.sh SRC_DIR PREFIX
#
# Environment:
#   DXS_CMAKE_ARGS    [-DDXS_WITH_CUDA=OFF -DDXS_BUILD_TESTS=OFF -DDXS_BUILD_BENCH=OFF]
#   DXS_GIT_COMMIT    recorded in dxs_build_info{git_commit} (the image has no .git)
#   DXS_BUILD_TYPE    [Release]
#   DXS_BUILD_JOBS    parallel compile jobs [all cores]
#   DXS_SMG_VENV      where the gateway's venv goes [/opt/smg]: the runtime stage copies it
#                     to the same path (a venv does not move), with Debian's python3
#   DXS_PREBUILT_BIN  a directory holding dxs, dxs-router, dxs-attention and dxs-expert
#                     built from this tree on Debian 12: configure as usual but install
#                     these instead of compiling (check-container.sh on 2-core machines).
#                     With libdxs_cuda.so beside them (a CUDA build), that plugin is put
#                     aside in PREFIX/cuda for the image's cuda target (cuda-steps.sh).
set -eu

[ $# -eq 2 ] || { echo "usage: build-steps.sh SRC_DIR PREFIX" >&2; exit 2; }
src=$1
prefix=$2
binaries="dxs dxs-router dxs-attention dxs-expert"
targets="dxs dxs_router dxs_attention dxs_expert"  # CMake targets of those binaries
cd "$src"

echo "build-steps: [1/4] build dependencies (scripts/setup.sh)"
export DEBIAN_FRONTEND=noninteractive
# setup.sh also makes the test client's Python venv; keep it out of the source tree. CUDA
# is off here, so without the CUDA header wheels (CUTLASS, FlashInfer); and without the
# gateway and its test clients (DXS_SETUP_GATEWAY=0), which step 4 installs on its own.
# CMake finds UCX (the libucx-cu13 wheel) through the same venv.
export DXS_PY_VENV=/tmp/dxs-build-venv
DXS_SETUP_CUDA_HEADERS=0 DXS_SETUP_GATEWAY=0 scripts/setup.sh
rm -rf /var/lib/apt/lists/*

export DXS_BUILD_DIR=build-container
export DXS_BUILD_TYPE="${DXS_BUILD_TYPE:-Release}"
DXS_CMAKE_ARGS="${DXS_CMAKE_ARGS:--DDXS_WITH_CUDA=OFF -DDXS_BUILD_TESTS=OFF -DDXS_BUILD_BENCH=OFF}"
if [ -n "${DXS_GIT_COMMIT:-}" ]; then
  DXS_CMAKE_ARGS="$DXS_CMAKE_ARGS -DDXS_GIT_COMMIT=$DXS_GIT_COMMIT"
fi
export DXS_CMAKE_ARGS

if [ -n "${DXS_PREBUILT_BIN:-}" ]; then
  # Configure only (build.sh configures, then rebuild_cache re-runs CMake: no compiling),
  # which still proves the build dependencies are complete.
  echo "build-steps: [2/4] configure only ($DXS_CMAKE_ARGS); binaries from $DXS_PREBUILT_BIN"
  scripts/build.sh rebuild_cache
  # The targets a real build would compile exist (ninja fails on an unknown one).
  # shellcheck disable=SC2086  # one target per word
  ninja -C "$DXS_BUILD_DIR" -t query $targets >/dev/null
  bin_dir=$DXS_PREBUILT_BIN
else
  echo "build-steps: [2/4] configure and build ($DXS_CMAKE_ARGS)"
  # shellcheck disable=SC2086  # one target per word
  scripts/build.sh $targets
  bin_dir=$DXS_BUILD_DIR/bin
fi

echo "build-steps: [3/4] install into $prefix/bin and $prefix/lib"
for b in $binaries; do
  install -D -m 0755 "$bin_dir/$b" "$prefix/bin/$b"
done
ls -l "$prefix/bin"
# The CUDA backend plugin, where the binaries are a CUDA build (built with the CUDA toolkit
# present, which leaves libdxs_cuda.so beside them): put aside in $prefix/cuda for the
# Dockerfile's cuda target (cuda-steps.sh), not in $prefix/bin, which the CPU image copies.
if [ -f "$bin_dir/libdxs_cuda.so" ]; then
  install -D -m 0644 "$bin_dir/libdxs_cuda.so" "$prefix/cuda/libdxs_cuda.so"
  ls -l "$prefix/cuda"
fi
# UCX 1.22 comes from the libucx-cu13 wheel setup.sh put in the venv (not a Debian package):
# its libraries, and beside them in ucx/ the transport modules UCX loads at run time. The
# runtime stage copies $prefix/lib to /usr/local/lib/dxs, which ld.so.conf.d names.
ucx_dir=$("$DXS_PY_VENV/bin/python3" -c \
  "import importlib.util; print(list(importlib.util.find_spec('libucx').submodule_search_locations)[0])")
install -d "$prefix/lib/ucx"
for l in libucp libuct libucs libucm; do
  install -m 0644 "$ucx_dir/lib/$l.so.0" "$prefix/lib/$l.so.0"
done
for m in "$ucx_dir"/lib/ucx/libuc[tm]_*.so.0; do
  install -m 0644 "$m" "$prefix/lib/ucx/"
done
ls -l "$prefix/lib" "$prefix/lib/ucx"

# The SMG gateway (deploy/k8s/base/gateway.yaml runs `smg launch`): the smg wheel (a Rust
# binary behind a Python launcher; it needs grpcio, grpcio-health-checking, pyyaml and
# setproctitle) at the version scripts/setup.sh pins as SMG_VERSION, in a venv of its own on
# Debian's python3, which the runtime stage copies to the same path.
smg_venv=${DXS_SMG_VENV:-/opt/smg}
smg_version=$(sed -n 's/^SMG_VERSION=\([0-9][0-9.]*\)$/\1/p' scripts/setup.sh)
if [ -z "$smg_version" ]; then
  echo "build-steps: no SMG_VERSION=X.Y.Z line in scripts/setup.sh" >&2
  exit 1
fi
echo "build-steps: [4/4] the gateway: smg $smg_version into $smg_venv"
rm -rf "$smg_venv"
python3 -m venv "$smg_venv"
"$smg_venv/bin/pip" install --quiet --disable-pip-version-check --no-cache-dir "smg==$smg_version"
"$smg_venv/bin/smg" --help >/dev/null
"$smg_venv/bin/pip" show smg | sed -n 's/^\(Name\|Version\): /  /p'
