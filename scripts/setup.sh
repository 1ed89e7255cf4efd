#!/usr/bin/env bash
# Installs every build and test dependency of dxs: Debian 12's packages, and a venv of PyPI
# wheels (below).
# Idempotent and non-interactive: packages already present are not touched.
set -euo pipefail

PACKAGES=(
  build-essential cmake ninja-build ccache pkg-config git
  libgrpc++-dev libprotobuf-dev protobuf-compiler protobuf-compiler-grpc
  libabsl-dev libcivetweb-dev prometheus-cpp-dev nlohmann-json3-dev
  libopenblas-dev libgtest-dev libgmock-dev libbenchmark-dev
  clang libclang-rt-14-dev clang-format
  prometheus python3 python3-venv openssl libssl-dev libzip-dev
  iproute2  # ip netns / tc: the simulated hosts of the `hosts` tests (tests/python/hosts)
)

missing=()
for p in "${PACKAGES[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done

# A virtualenv of the project's own (so the system Python is left alone) with
# - grpcio and its protoc, for the Python test client (tests/python), and grpcio-reflection
#   (the gateway test lists the router's services through reflection);
# - nvidia-cutlass, whose wheel carries the CUTLASS/CuTe C++ headers that the CUDA grouped
#   GEMM compiles against (CMake finds them through this venv's python; see
#   kernels/cuda/CMakeLists.txt). Pinned: CUTLASS's C++ API moves between releases. Without
#   its dependencies (cuda-python, scipy, ...): only the headers are used, never the Python.
# - flashinfer-python, whose wheel carries FlashInfer's header-only attention kernels and
#   the CCCL they compile against (kernels/cuda/flashinfer_attention.cu; the kernels used
#   do not include its fp16.h, which would need a newer boost than Debian's). Pinned,
#   without dependencies (torch...): headers only.
# - libucx-cu13, UCX 1.22 built with CUDA (its cuda_copy/cuda_ipc transports move GPU memory
#   between processes): the transport's UCX, headers and libraries, on every machine, GPU or
#   not (CMake finds it through this venv's python; see the top-level CMakeLists.txt). It
#   replaces Debian's UCX 1.13. Pinned, without dependencies.
# - nvidia-cublas (DXS_SETUP_CUBLAS=1 only): cuBLAS/cuBLASLt 13 (nvidia/cu13/lib/
#   libcublas.so.13, libcublasLt.so.13), which the CUDA plugin loads at run time
#   (kernels/cuda/cublas_loader.cc). A machine with the CUDA toolkit has them already; the
#   CUDA container image takes them from here (deploy/container/cuda-steps.sh). Pinned to the
#   release of the toolkit dxs is built and tested with, without dependencies (it has none).
# - smg-grpc-proto, whose wheel carries the .proto files of the gateway protocol
#   (sglang_scheduler.proto, common.proto) that the router serves beside dxs.v1 (CMake finds
#   them through this venv's python; see router/frontend/CMakeLists.txt). Pinned: the
#   protocol moves between releases. Without dependencies: only the .proto files are used.
# - smg, the Shepherd Model Gateway (Rust, with a Python launcher), which `dxs up
#   --gateway-port` starts in front of the router, and its launcher's dependencies; openai
#   (the client the gateway tests use) and tokenizers (Hugging Face's, which the tests use
#   to decode). Pinned, with their dependencies (DXS_SETUP_GATEWAY=0 skips them).
# Each is installed only when missing, so a second run changes nothing.
SMG_GRPC_PROTO_VERSION=0.4.28
SMG_VERSION=1.13.0
OPENAI_VERSION=3.60.0
TOKENIZERS_VERSION=0.23.3
UCX_VERSION=1.22.0
CUTLASS_VERSION=4.2.0.0
FLASHINFER_VERSION=0.7.4
CUBLAS_VERSION=13.1.0.3
setup_python() {
  local venv=${DXS_PY_VENV:-$(cd "$(dirname "$0")/.." && pwd)/.venv}
  local py="$venv/bin/python3"
  if [ ! -x "$py" ]; then
    echo "setup: creating $venv"
    python3 -m venv "$venv"
  fi
  if ! "$py" -c "import grpc, grpc_tools, grpc_reflection" 2>/dev/null; then
    echo "setup: installing grpcio, grpcio-tools and grpcio-reflection into $venv"
    "$py" -m pip install --quiet --disable-pip-version-check grpcio grpcio-tools \
      grpcio-reflection
  fi
  if [ "$("$py" -m pip show smg-grpc-proto 2>/dev/null | sed -n 's/^Version: //p')" != "$SMG_GRPC_PROTO_VERSION" ]; then
    echo "setup: installing smg-grpc-proto $SMG_GRPC_PROTO_VERSION (the gateway protocol's .proto files) into $venv"
    "$py" -m pip install --quiet --disable-pip-version-check --no-deps \
      "smg-grpc-proto==$SMG_GRPC_PROTO_VERSION"
  fi
  if [ "${DXS_SETUP_GATEWAY:-1}" != 0 ] &&
    { [ "$("$py" -m pip show smg 2>/dev/null | sed -n 's/^Version: //p')" != "$SMG_VERSION" ] ||
      [ "$("$py" -m pip show openai 2>/dev/null | sed -n 's/^Version: //p')" != "$OPENAI_VERSION" ] ||
      [ "$("$py" -m pip show tokenizers 2>/dev/null | sed -n 's/^Version: //p')" != "$TOKENIZERS_VERSION" ]; }; then
    echo "setup: installing smg $SMG_VERSION, openai $OPENAI_VERSION, tokenizers $TOKENIZERS_VERSION into $venv"
    "$py" -m pip install --quiet --disable-pip-version-check "smg==$SMG_VERSION" \
      "openai==$OPENAI_VERSION" "tokenizers==$TOKENIZERS_VERSION"
  fi
  if [ "$("$py" -m pip show libucx-cu13 2>/dev/null | sed -n 's/^Version: //p')" != "$UCX_VERSION" ]; then
    echo "setup: installing libucx-cu13 $UCX_VERSION (UCX with CUDA) into $venv"
    "$py" -m pip install --quiet --disable-pip-version-check --no-deps \
      "libucx-cu13==$UCX_VERSION"
  fi
  if [ "${DXS_SETUP_CUBLAS:-0}" = 1 ] &&
    [ "$("$py" -m pip show nvidia-cublas 2>/dev/null | sed -n 's/^Version: //p')" != "$CUBLAS_VERSION" ]; then
    echo "setup: installing nvidia-cublas $CUBLAS_VERSION (cuBLAS 13 run-time libraries) into $venv"
    "$py" -m pip install --quiet --disable-pip-version-check --no-deps \
      "nvidia-cublas==$CUBLAS_VERSION"
  fi
  # DXS_SETUP_CUDA_HEADERS=0 (a CPU-only build: the container) skips the two header wheels.
  [ "${DXS_SETUP_CUDA_HEADERS:-1}" = 0 ] && return 0
  if [ "$("$py" -m pip show nvidia-cutlass 2>/dev/null | sed -n 's/^Version: //p')" != "$CUTLASS_VERSION" ]; then
    echo "setup: installing nvidia-cutlass $CUTLASS_VERSION (CUTLASS headers) into $venv"
    "$py" -m pip install --quiet --disable-pip-version-check --no-deps \
      "nvidia-cutlass==$CUTLASS_VERSION"
  fi
  if [ "$("$py" -m pip show flashinfer-python 2>/dev/null | sed -n 's/^Version: //p')" != "$FLASHINFER_VERSION" ]; then
    echo "setup: installing flashinfer-python $FLASHINFER_VERSION (FlashInfer headers) into $venv"
    "$py" -m pip install --quiet --disable-pip-version-check --no-deps \
      "flashinfer-python==$FLASHINFER_VERSION"
  fi
}

if [ ${#missing[@]} -eq 0 ]; then
  echo "setup: all ${#PACKAGES[@]} packages present"
  setup_python
  exit 0
fi

SUDO=""
if [ "$(id -u)" -ne 0 ]; then
  if command -v sudo >/dev/null 2>&1; then SUDO="sudo"; else
    echo "setup: need root (or sudo) to install: ${missing[*]}" >&2
    exit 1
  fi
fi
echo "setup: installing ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -q
$SUDO apt-get install -y -q --no-install-recommends "${missing[@]}"
setup_python
