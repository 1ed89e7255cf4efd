#!/usr/bin/env bash
# Packs this working tree's gpu_bench and CUDA plugin as .device-NAME.tar.xz: one build of a
# code A/B (run_device.sh decode-old-new with DXS_DECODE_BUILDS naming it), beside the full
# bundle that bench/gpu/bundle.sh makes. Set the tree to the variant first (a checkout, or
# `git revert --no-commit REV`), run this, then put the tree back; the binaries use the
# libraries of the full bundle's .device/lib there.
#   bench/gpu/bundle_variant.sh NAME        (old, v1, ...; not "new", which is .device)
set -euo pipefail
cd "$(dirname "$0")/../.."
name=${1:?usage: bench/gpu/bundle_variant.sh NAME}
[[ $name =~ ^[A-Za-z0-9_-]+$ && $name != new ]] || { echo "bad name: $name" >&2; exit 2; }
scripts/build.sh gpu_bench dxs_cuda_plugin >/dev/null
bin=${DXS_BUILD_DIR:-build}/bin
dir=.device-$name
rm -rf "$dir" && mkdir -p "$dir/bin"
cp "$bin/gpu_bench" "$bin/libdxs_cuda.so" "$dir/bin/"
strip --strip-debug "$dir"/bin/*
tar cf - "$dir" | xz -T2 -6 >"$dir.tar.xz"
rm -rf "$dir"
du -h "$dir.tar.xz" | awk -v d="$dir" '{print "archive: " $1 " (" d ".tar.xz; carry it beside .device.tar.xz)"}'
