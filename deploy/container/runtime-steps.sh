#!/bin/sh
# The runtime stage of deploy/container/Dockerfile: only the shared libraries the dxs
# binaries load (no compilers, no -dev packages), the Python that runs the SMG gateway's
# venv, and the unprivileged user 10001 they run as. scripts/check-container.sh runs this
# same file in a Debian 12 chroot.
set -eu

# What `ldd` lists for dxs, dxs-router, dxs-attention and dxs-expert, by Debian package;
# their own dependencies (libgrpc29, libre2-9, libc-ares2, libgfortran5, ...) come along.
# UCX is not among them: it is the libucx-cu13 wheel's 1.22, which the build stage installs
# into /opt/dxs/lib (libnuma1 is what its libucs needs). prometheus-cpp's pull library serves /metrics on civetweb.
# libzip4: dxs-router zips the model's tokenizer files for the gateway protocol's GetTokenizer.
# python3 (Debian's 3.11): the interpreter of the gateway's venv /opt/smg, which the build
# stage makes with the same python3 (build-steps.sh); smg's own library needs only libc.
RUNTIME_PACKAGES="
  libgrpc++1.51
  libprotobuf32
  libabsl20220623
  libnuma1
  libprometheus-cpp-core1.0
  libprometheus-cpp-pull1.0
  libcivetweb1
  libopenblas0-pthread
  libssl3
  libzip4
  zlib1g
  python3
"

export DEBIAN_FRONTEND=noninteractive
apt-get update -q
# shellcheck disable=SC2086  # one package per word
apt-get install -y -q --no-install-recommends $RUNTIME_PACKAGES
apt-get clean
rm -rf /var/lib/apt/lists/*

# UCX's libraries, copied from the build stage to /usr/local/lib/dxs (the Dockerfile).
echo /usr/local/lib/dxs >/etc/ld.so.conf.d/dxs.conf

groupadd --gid 10001 dxs
useradd --uid 10001 --gid 10001 --home-dir /home/dxs --create-home --shell /usr/sbin/nologin dxs
# Where the manifests mount model checkpoints (an emptyDir or a volume over it).
install -d -o 10001 -g 10001 /models
