#!/bin/sh
# The runtime stage of deploy/container/Dockerfile: only the shared libraries the dxs
# binaries load (no compilers, no -dev packages), and the unprivileged user 10001 they
# run as. scripts/check-container.sh runs this same file in a Debian 12 chroot.
set -eu

# What `ldd` lists for dxs, dxs-router, dxs-attention and dxs-expert, by Debian package;
# their own dependencies (libgrpc29, libre2-9, libc-ares2, libnuma1, libgfortran5, ...)
# come along. prometheus-cpp's pull library serves /metrics on civetweb.
RUNTIME_PACKAGES="
  libgrpc++1.51
  libprotobuf32
  libabsl20220623
  libucx0
  libprometheus-cpp-core1.0
  libprometheus-cpp-pull1.0
  libcivetweb1
  libopenblas0-pthread
  libssl3
  zlib1g
"

export DEBIAN_FRONTEND=noninteractive
apt-get update -q
# shellcheck disable=SC2086  # one package per word
apt-get install -y -q --no-install-recommends $RUNTIME_PACKAGES
apt-get clean
rm -rf /var/lib/apt/lists/*

groupadd --gid 10001 dxs
useradd --uid 10001 --gid 10001 --home-dir /home/dxs --create-home --shell /usr/sbin/nologin dxs
# Where the manifests mount model checkpoints (an emptyDir or a volume over it).
install -d -o 10001 -g 10001 /models
