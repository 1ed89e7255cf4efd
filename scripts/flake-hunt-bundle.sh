#!/usr/bin/env bash
# Packs what scripts/flake-hunt.sh needs to run the multi-process tests on another x86-64
# Linux machine that has CMake's ctest but not dxs's build dependencies (a many-core machine
# where `flake-hunt.sh -s SLOTS` runs several 2-core copies at once): the test and service
# binaries of build/bin (stripped), the build tree's CTest files, the shared libraries they
# load (UCX 1.22's transport modules included), and promtool and prometheus. One archive,
# .flake-bundle.tar.xz (ignored by git).
#
# On the other machine, from a copy of this checkout with the archive beside it:
#   source <(scripts/flake-hunt-bundle.sh --unpack) && scripts/flake-hunt.sh -s 8 -E python_
# --unpack extracts it into build/, links this checkout at the path the CTest files name,
# installs promtool and prometheus in /usr/bin (root), and prints the environment to source.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
build=${DXS_BUILD_DIR:-build}
archive=.flake-bundle.tar.xz

if [ "${1:-}" = --unpack ]; then
  tar xJf "$archive"
  src=$(cat .flake-bundle/source-dir)
  if [ "$src" != "$root" ]; then
    [ -e "$src" ] && [ "$(realpath "$src")" != "$root" ] && {
      echo "flake-hunt-bundle: $src exists and is not this checkout" >&2
      exit 1
    }
    mkdir -p "$(dirname "$src")"
    ln -sfn "$root" "$src"
  fi
  mkdir -p "$build"
  cp -a .flake-bundle/build/. "$build/"
  # The discovered test lists are newer than the binaries: ctest reads them as they are.
  find "$build" -name '*_tests.cmake' -exec touch {} +
  install -m 755 .flake-bundle/promtool .flake-bundle/prometheus /usr/bin/
  echo "export LD_LIBRARY_PATH=$root/.flake-bundle/lib\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}"
  echo "export UCX_MODULE_DIR=$root/.flake-bundle/ucx"
  exit 0
fi

rm -rf .flake-bundle
mkdir -p .flake-bundle/build/bin .flake-bundle/lib .flake-bundle/ucx
echo "$root" >.flake-bundle/source-dir
# Every binary a disagg test runs: the tests' own, and what they start.
bins=(dxs dxs-router dxs-attention dxs-expert ucx_echo_peer exchange_ranks_bench)
while read -r cmd; do bins+=("$(basename "$cmd")"); done < <(
  ctest --test-dir "$build" -N -V -L '^disagg$' | sed -n 's/^[0-9]*: Test command: \([^ ]*\).*/\1/p' |
    grep "/$build/bin/" | sort -u)
skip='linux-vdso|ld-linux|/libc\.so|/libm\.so|/libstdc\+\+|/libgcc_s|/libpthread|/libdl\.so|/librt\.so'
for b in $(printf '%s\n' "${bins[@]}" | sort -u); do
  strip -o ".flake-bundle/build/bin/$b" "$build/bin/$b"
  ldd "$build/bin/$b" | awk '$3 ~ /^\// {print $3}' | { grep -Ev "$skip" || true; } |
    while read -r l; do cp -Ln "$l" .flake-bundle/lib/ 2>/dev/null || true; done
done
ucx_dir=$(.venv/bin/python3 -c \
  "import importlib.util; print(list(importlib.util.find_spec('libucx').submodule_search_locations)[0])")
cp -L "$ucx_dir"/lib/ucx/libuc[tm]_*.so.0 .flake-bundle/ucx/
strip --strip-debug .flake-bundle/lib/* .flake-bundle/ucx/* 2>/dev/null || true
(cd "$build" && find . \( -name CTestTestfile.cmake -o -name '*_include.cmake' -o \
  -name '*_tests.cmake' \) -print0 | xargs -0 cp --parents -t "$root/.flake-bundle/build")
cp /usr/bin/promtool /usr/bin/prometheus .flake-bundle/
tar cf - .flake-bundle | xz -T2 -6 >"$archive"
du -h "$archive" | awk '{print "flake-hunt-bundle: " $1 " in " $2}'
