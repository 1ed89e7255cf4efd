#!/bin/sh
# The cuda-libs stage of deploy/container/Dockerfile (the image's `cuda` target): gathers in
# PREFIX/cuda what the CUDA image adds to the CPU image, apart from the NVIDIA driver:
#   PREFIX/cuda/libdxs_cuda.so  the CUDA backend plugin (build-steps.sh put it there from a
#                               CUDA build of the binaries); the image puts it beside the
#                               binaries, where kernels/make_backend.cc looks for it
#   PREFIX/cuda/lib/            libcublas.so.13 and libcublasLt.so.13 from the nvidia-cublas
#                               wheel (pinned in scripts/setup.sh, installed --no-deps), which
#                               the plugin dlopens by name (kernels/cuda/cublas_loader.cc);
#                               and the CUDA runtime the libucx-cu13 wheel vendors
#                               (libcudart-<hash>.so.13.*), which UCX's memory hooks for GPU
#                               memory (ucx/libucm_cuda.so.0) link. The image copies these
#                               to /usr/local/lib/dxs, which ld.so.conf.d names.
# The driver's own libraries (libcuda.so.1, libnvidia-ml.so.1) are not in the image: the
# NVIDIA container toolkit mounts them from the node. The plugin links the CUDA runtime
# statically, which finds libcuda.so.1 at run time.
#
#   cuda-steps.sh SRC_DIR PREFIX       (after build-steps.sh SRC_DIR PREFIX)
#
# Environment: DXS_PY_VENV, the build stage's venv [/tmp/dxs-build-venv].
set -eu

[ $# -eq 2 ] || { echo "usage: cuda-steps.sh SRC_DIR PREFIX" >&2; exit 2; }
src=$1
prefix=$2
cd "$src"

if [ ! -f "$prefix/cuda/libdxs_cuda.so" ]; then
  echo "cuda-steps: no libdxs_cuda.so: the binaries are not a CUDA build. The cuda target" \
    "needs binaries built on Debian 12 with the CUDA 13 toolkit (scripts/build.sh leaves" \
    "libdxs_cuda.so beside them), given as DXS_PREBUILT_BIN (docs/deploy.md)" >&2
  exit 1
fi

echo "cuda-steps: [1/2] cuBLAS 13 (scripts/setup.sh, DXS_SETUP_CUBLAS=1)"
export DXS_PY_VENV="${DXS_PY_VENV:-/tmp/dxs-build-venv}"
# The build stage installed every Debian package already: this only adds the wheel.
DXS_SETUP_CUDA_HEADERS=0 DXS_SETUP_CUBLAS=1 scripts/setup.sh
py=$DXS_PY_VENV/bin/python3
site=$("$py" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
ucx_dir=$("$py" -c \
  "import importlib.util; print(list(importlib.util.find_spec('libucx').submodule_search_locations)[0])")

echo "cuda-steps: [2/2] gather into $prefix/cuda/lib"
install -d "$prefix/cuda/lib"
for l in libcublas.so.13 libcublasLt.so.13; do
  # A hard link where it can (600 MB that this stage's layer then holds once), else a copy.
  ln -f "$site/nvidia/cu13/lib/$l" "$prefix/cuda/lib/$l" 2>/dev/null ||
    cp -f "$site/nvidia/cu13/lib/$l" "$prefix/cuda/lib/$l"
  chmod 0644 "$prefix/cuda/lib/$l"
done
# auditwheel's name for it, which is also its SONAME; ldconfig indexes it under that name.
n=0
for l in "$ucx_dir"/../libucx_cu13.libs/libcudart-*.so.*; do
  [ -f "$l" ] || continue
  install -m 0644 "$l" "$prefix/cuda/lib/"
  n=$((n + 1))
done
[ "$n" -eq 1 ] || { echo "cuda-steps: expected one libcudart in libucx_cu13.libs, found $n" >&2; exit 1; }
ls -l "$prefix/cuda" "$prefix/cuda/lib"
