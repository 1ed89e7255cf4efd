#!/usr/bin/env bash
# Single quotes here hold text for dpkg-query and for shells inside the chroot.
# shellcheck disable=SC2016

# Builds deploy/container/Dockerfile with a real container engine and checks the image:
#   - `podman build --isolation chroot` (Debian's podman 4.3), FROM a Debian 12 root made
#     with debootstrap and brought in with `podman import` (standing in for debian:bookworm);
#   - the image's metadata: USER 10001, the entrypoint, the exposed ports (gRPC, metrics)
#     and the OCI labels;
#   - its file system (`podman export`): no compiler, no -dev package and nothing from the
#     build stage but binaries; every shared library the binaries need (ldd);
#   - run in a chroot (chroot-run.py; `podman run` cannot start containers where crun
#     refuses the machine's cgroups), as USER 10001 with the image's ENV and WORKDIR:
#     `dxs help` and `dxs-router --help` work, and a 2 DP x 2 EP cluster started through the
#     entrypoint (ranks taken from POD_INDEX and from the pod-style HOSTNAME, as in
#     Kubernetes) answers `dxs generate` and `dxs status`, serves /metrics on every
#     process, keeps UCX inside UCX_TCP_PORT_RANGE (what the NetworkPolicy opens), then
#     stops on SIGTERM.
#
#   DXS_CHECK_CONTAINER=1 scripts/check-container.sh
# scripts/run-tests.sh runs it with DXS_PREBUILT_BIN=build/bin: about 2 minutes on a 2-core
# VM (1.5 of them apt installing the build stage's dependencies; debootstrap adds half a
# minute the first time). Compiling inside the image as well takes far longer on such a
# machine, so that stays a manual run. Needs root, podman and debootstrap (installed when
# missing) and a Debian mirror. Environment:
#   DXS_CONTAINER_WORK   work directory [/tmp/dxs-container-check]; the debootstrapped base
#                        is kept there and reused (DXS_CONTAINER_FRESH=1 makes it again)
#   DXS_DEBIAN_MIRROR    [http://deb.debian.org/debian]
#   DXS_PREBUILT_BIN     a directory with dxs, dxs-router, dxs-attention, dxs-expert built
#                        from this tree on Debian 12, mounted into the build: the build
#                        stage then installs the dependencies and configures but does not
#                        compile (build-steps.sh), for machines too small to build twice
#   DXS_CHECK_KEEP=1     keep the image and the exported root afterwards
#   DXS_BUILD_CA_BUNDLE  a CA bundle for pip in the build stage [$PIP_CERT or
#                        $REQUESTS_CA_BUNDLE]: for machines behind a TLS-intercepting proxy
# Runs under `flock /tmp/dxs-build.lock`, like other heavy jobs on shared machines.
set -euo pipefail

if [ "${DXS_CHECK_CONTAINER:-0}" != 1 ]; then
  echo "check-container: skipped (set DXS_CHECK_CONTAINER=1 to run it; it needs root and minutes)"
  exit 0
fi
if [ "$(id -u)" -ne 0 ]; then
  echo "check-container: needs root (debootstrap, podman, chroot, mount)" >&2
  exit 1
fi
if [ -z "${DXS_CHECK_CONTAINER_LOCKED:-}" ]; then
  exec env DXS_CHECK_CONTAINER_LOCKED=1 flock /tmp/dxs-build.lock "$0" "$@"
fi

repo=$(cd "$(dirname "$0")/.." && pwd)
work=${DXS_CONTAINER_WORK:-/tmp/dxs-container-check}
mirror=${DXS_DEBIAN_MIRROR:-http://deb.debian.org/debian}
runner=$repo/deploy/container/chroot-run.py
base_image=localhost/dxs-check-base:bookworm
image=localhost/dxs:check
start=$(date +%s)
step() { echo "check-container: [$(($(date +%s) - start))s] $*"; }
fail() { echo "check-container: FAIL: $*" >&2; exit 1; }

for tool in podman debootstrap; do
  if ! command -v $tool >/dev/null; then
    step "installing $tool"
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends $tool
  fi
done

mkdir -p "$work"
if [ "${DXS_CONTAINER_FRESH:-0}" = 1 ]; then
  rm -rf --one-file-system "$work/base"
  podman image rm -f "$base_image" >/dev/null 2>&1 || true
fi
if [ ! -x "$work/base/bin/sh" ]; then
  step "debootstrap --variant=minbase bookworm from $mirror"
  rm -rf --one-file-system "$work/base.tmp"
  debootstrap --variant=minbase bookworm "$work/base.tmp" "$mirror" >"$work/debootstrap.log" 2>&1 ||
    { tail -20 "$work/debootstrap.log" >&2; fail "debootstrap failed (log: $work/debootstrap.log)"; }
  rm -rf "$work/base.tmp/var/cache/apt/archives/"*.deb
  mv "$work/base.tmp" "$work/base"
  podman image rm -f "$base_image" >/dev/null 2>&1 || true
else
  step "reusing the Debian 12 base in $work/base"
fi
if ! podman image exists "$base_image"; then
  step "podman import $work/base as $base_image"
  tar -C "$work/base" --numeric-owner -c . |
    podman import -q --change 'CMD ["/bin/bash"]' --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
      - "$base_image" >/dev/null
fi

version=$(sed -n 's/^project(dxs VERSION \([0-9.]*\).*/\1/p' "$repo/CMakeLists.txt")
commit=$(git -C "$repo" rev-parse --short=12 HEAD 2>/dev/null || echo unknown)
# --layers=false: no intermediate images left behind run after run (each run builds afresh,
# which is also what the timing below assumes).
build_args=(--isolation chroot --layers=false -f "$repo/deploy/container/Dockerfile"
  --ignorefile "$repo/deploy/container/Dockerfile.dockerignore"
  --build-arg "DEBIAN_IMAGE=$base_image" --build-arg "DXS_VERSION=$version"
  --build-arg "DXS_GIT_COMMIT=$commit" -t "$image")
# A machine behind a TLS-intercepting proxy trusts the proxy's CA through PIP_CERT (or
# REQUESTS_CA_BUNDLE); setup.sh's pip in the build stage needs the same bundle.
ca_bundle=${DXS_BUILD_CA_BUNDLE:-${PIP_CERT:-${REQUESTS_CA_BUNDLE:-}}}
if [ -n "$ca_bundle" ] && [ -f "$ca_bundle" ]; then
  build_args+=(-v "$ca_bundle:/run/dxs-host-ca.pem:ro" --build-arg PIP_CERT=/run/dxs-host-ca.pem)
  step "build stage: pip trusts the host's CA bundle $ca_bundle"
fi
if [ -n "${DXS_PREBUILT_BIN:-}" ]; then
  prebuilt=$(cd "$DXS_PREBUILT_BIN" && pwd)
  for b in dxs dxs-router dxs-attention dxs-expert; do
    [ -x "$prebuilt/$b" ] || fail "DXS_PREBUILT_BIN=$prebuilt has no $b"
  done
  build_args+=(-v "$prebuilt:/prebuilt:ro" --build-arg DXS_PREBUILT_BIN=/prebuilt)
  step "podman build (build stage: dependencies and configure; binaries from $prebuilt)"
else
  step "podman build (the build stage compiles dxs)"
fi
# The full output goes to build.log; the steps are shown as they go.
if ! podman build "${build_args[@]}" "$repo" 2>&1 | tee "$work/build.log" |
  grep --line-buffered -E '^(STEP |build-steps|setup:|-- dxs:|COMMIT|Successfully)' | sed -u 's/^/  | /'; then
  tail -40 "$work/build.log" >&2
  fail "podman build failed (log: $work/build.log)"
fi
podman image inspect "$image" >"$work/image.json"

step "image metadata"
meta() { python3 -c 'import json,sys; c=json.load(open(sys.argv[1]))[0]["Config"]; print(eval(sys.argv[2]))' "$work/image.json" "$1"; }
user=$(meta 'c.get("User", "")')
[ "$user" = "10001:10001" ] || fail "USER is '$user', not 10001:10001"
entrypoint=$(meta '" ".join(c.get("Entrypoint") or [])')
[ "$entrypoint" = /usr/local/bin/dxs-entrypoint ] || fail "ENTRYPOINT is '$entrypoint'"
ports=$(meta '" ".join(sorted(c.get("ExposedPorts") or {}))')
[ "$ports" = "50051/tcp 9100/tcp" ] || fail "exposed ports are '$ports', not 50051/tcp 9100/tcp"
labels=$(meta 'c.get("Labels") or {}')
for label in title description version revision; do
  meta "c.get('Labels', {}).get('org.opencontainers.image.$label', '')" | grep -q . ||
    fail "no label org.opencontainers.image.$label (labels: $labels)"
done
[ "$(meta "c['Labels']['org.opencontainers.image.version']")" = "$version" ] || fail "version label is not $version"
[ "$(meta "c['Labels']['org.opencontainers.image.revision']")" = "$commit" ] || fail "revision label is not $commit"
echo "  USER $user, ENTRYPOINT $entrypoint, CMD $(meta '" ".join(c.get("Cmd") or [])'), EXPOSE $ports"
echo "  labels: $labels"

step "podman export: the image's file system"
runtime=$work/rootfs
rm -rf --one-file-system "$runtime"
mkdir -p "$runtime"
container=$(podman create "$image")
podman export "$container" | tar -C "$runtime" --numeric-owner -x
podman rm "$container" >/dev/null
cleanup() {
  if [ "${DXS_CHECK_KEEP:-0}" != 1 ]; then
    rm -rf --one-file-system "$runtime"
    podman image rm -f "$image" >/dev/null 2>&1 || true
  fi
}
trap cleanup EXIT

in_runtime() { python3 "$runner" --root "$runtime" --image-config "$work/image.json" "$@"; }

step "image: user"
echo "  USER $user: $(in_runtime -- id)"

step "image: packages"
chroot "$work/base" dpkg-query -W -f '${Package}\n' | sort >"$work/base.packages"
chroot "$runtime" dpkg-query -W -f '${Package}\n' | sort >"$work/runtime.packages"
added=$(comm -13 "$work/base.packages" "$work/runtime.packages" | tr '\n' ' ')
echo "  added to debian:bookworm: $added"
bad=$(comm -13 "$work/base.packages" "$work/runtime.packages" |
  grep -E -- '-dev$|^(gcc|g\+\+|cpp|clang|llvm|cmake|ninja-build|make|binutils|protobuf-compiler)' || true)
[ -z "$bad" ] || fail "build-only packages in the image: $bad"
for f in /usr/local/bin/dxs /usr/local/bin/dxs-router /usr/local/bin/dxs-attention \
  /usr/local/bin/dxs-expert /usr/local/bin/dxs-entrypoint; do
  [ -x "$runtime$f" ] || fail "$f missing from the image"
done
if [ -e "$runtime/src" ] || [ -e "$runtime/opt/dxs" ]; then
  fail "build stage files leaked into the image"
fi
du -sh --exclude=proc --exclude=sys --exclude=dev "$runtime" | awk '{print "  image root: " $1}'

step "image: shared libraries"
missing=$(in_runtime -- /bin/sh -c 'for b in /usr/local/bin/dxs*; do
  case $b in *entrypoint) continue;; esac; ldd "$b" | sed "s|^|$b: |"; done' | grep "not found" || true)
[ -z "$missing" ] || fail "missing shared libraries: $missing"
echo "  ldd: every library of dxs, dxs-router, dxs-attention, dxs-expert found"

step "image: binaries start as $user"
in_runtime -- dxs help >/dev/null || fail "dxs help"
in_runtime -- dxs-entrypoint help >/dev/null || fail "dxs-entrypoint help (the image's CMD)"
in_runtime -- dxs-router --help >/dev/null || fail "dxs-router --help"
in_runtime -- /bin/sh -c 'test ! -w /usr/local/bin/dxs-router' || fail "the binaries are writable by $user"
echo "  dxs help, dxs-router --help, dxs-entrypoint help: exit 0; binaries read-only to $user"

step "image: a 2 DP x 2 EP cluster through dxs-entrypoint, as $user"
port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
# The UCX settings the Kubernetes pods get (deploy/k8s/base/cluster.env).
ucx_env=()
while IFS= read -r kv; do ucx_env+=(--env "$kv"); done < <(grep -E '^UCX_[A-Z_]+=' "$repo/deploy/k8s/base/cluster.env")
smoke='
set -eu
w=/tmp/dxs-smoke
rm -rf "$w" && mkdir -p "$w"
pids=""
workers=""
stop_all() {
  for p in $pids; do kill -TERM "$p" 2>/dev/null || true; done
  for p in $pids; do
    i=0
    while kill -0 "$p" 2>/dev/null && [ $i -lt 100 ]; do sleep 0.1; i=$((i + 1)); done
    if kill -0 "$p" 2>/dev/null; then echo "  pid $p ignored SIGTERM for 10 s"; kill -KILL "$p"; exit 1; fi
  done
}
trap stop_all EXIT
dxs gen-model --out "$w/model" >/dev/null
# As in the pods, but on loopback with kernel-chosen ports (DXS_*_PORT=0).
export DXS_MODEL_DIR="$w/model" DXS_ATTENTION_RANKS=2 DXS_EXPERT_RANKS=2 DXS_METRICS_PORT=0
export DXS_ROUTER_ADDR=127.0.0.1:$ROUTER_PORT DXS_ADVERTISE_HOST=127.0.0.1
DXS_ROUTER_LISTEN_HOST=127.0.0.1 DXS_GRPC_PORT=$ROUTER_PORT dxs-entrypoint router >"$w/router.log" 2>&1 &
pids="$pids $!"
for r in 0 1; do
  HOSTNAME=dxs-expert-$r DXS_GRPC_PORT=0 dxs-entrypoint expert >"$w/expert-$r.log" 2>&1 &
  pids="$pids $!"; workers="$workers $!"
  # A host name (like the FQDN of a pod, resolved through /etc/hosts) for the attention ranks.
  POD_INDEX=$r HOSTNAME=dxs-attention-x DXS_ADVERTISE_HOST=localhost DXS_GRPC_PORT=0 \
    dxs-entrypoint attention >"$w/attention-$r.log" 2>&1 &
  pids="$pids $!"; workers="$workers $!"
done
ok=0
for i in $(seq 1 120); do
  if dxs generate --router 127.0.0.1:$ROUTER_PORT --prompt-ids 1,2,3 --max-new-tokens 4 >"$w/generate.out" 2>&1; then ok=1; break; fi
  sleep 0.5
done
if [ $ok != 1 ]; then
  for f in "$w"/*.log "$w/generate.out"; do echo "== $f"; tail -5 "$f"; done
  exit 1
fi
echo "  dxs generate: $(tr "\n" " " <"$w/generate.out")"
dxs status --router 127.0.0.1:$ROUTER_PORT | sed "s/^/  status | /"
grep -h "^dxs-entrypoint: exec" "$w"/*.log | sed "s/^/  /"

# /metrics of every process (the port from its "metrics on HOST:PORT" line), over bash
# /dev/tcp since the image has no HTTP client.
for f in "$w"/*.log; do
  mport=$(sed -n "s/.*metrics on [^ ]*:\([0-9][0-9]*\).*/\1/p" "$f" | head -1)
  [ -n "$mport" ] || { echo "  no metrics address in $f"; exit 1; }
  bash -c "exec 3<>/dev/tcp/127.0.0.1/$mport; printf \"GET /metrics HTTP/1.0\r\n\r\n\" >&3; cat <&3" \
    >"${f%.log}.metrics"
  grep -q "^dxs_build_info{" "${f%.log}.metrics" || { echo "  no dxs_build_info from $f"; exit 1; }
  echo "  $(basename "$f" .log): /metrics on port $mport, $(grep -c "^dxs_" "${f%.log}.metrics") samples"
done

# UCX listens only inside UCX_TCP_PORT_RANGE (what the NetworkPolicy opens): every
# listening TCP port of a worker is its gRPC port, its metrics port, or in that range.
lo=${UCX_TCP_PORT_RANGE%-*}; hi=${UCX_TCP_PORT_RANGE#*-}
for p in $workers; do
  inodes=" $(ls -l /proc/$p/fd 2>/dev/null | sed -n "s/.*socket:\[\([0-9]*\)\].*/\1/p" | tr "\n" " ") "
  ports=""
  for hex in $(cat /proc/net/tcp /proc/net/tcp6 2>/dev/null |
    awk -v ino="$inodes" "\$4 == \"0A\" && index(ino, \" \" \$10 \" \") { split(\$2, a, \":\"); print a[2] }" | sort -u); do
    ports="$ports $(printf "%d" "0x$hex")"
  done
  in_range=0
  for port in $ports; do
    if [ "$port" -ge "$lo" ] && [ "$port" -le "$hi" ]; then in_range=$((in_range + 1)); continue; fi
    if grep -q -e "listening on [^ ]*:$port[ ,]" -e "metrics on [^ ]*:$port\$" "$w"/*.log; then continue; fi
    echo "  pid $p listens on $port: neither gRPC, metrics nor UCX_TCP_PORT_RANGE $UCX_TCP_PORT_RANGE"; exit 1
  done
  [ $in_range -gt 0 ] || { echo "  pid $p: no UCX listener in $UCX_TCP_PORT_RANGE (ports:$ports)"; exit 1; }
  echo "  worker pid $p listens on$ports (UCX: $in_range in $UCX_TCP_PORT_RANGE)"
done
'
in_runtime --env "ROUTER_PORT=$port" "${ucx_env[@]}" -- /bin/sh -c "$smoke" || fail "the cluster smoke test failed"
echo "  every process exited on SIGTERM (UCX env from cluster.env: ${ucx_env[*]})"

# The dashboard's metric names against what the binaries expose (a note, not a failure:
# the metrics are still being added).
python3 - "$repo/deploy/grafana/dxs-dashboard.json" "$runtime/tmp/dxs-smoke" <<'PY'
import glob, json, re, sys
exposed = set()
for f in glob.glob(sys.argv[2] + "/*.metrics"):
    exposed |= set(re.findall(r"^(dxs_[a-z0-9_]+)", open(f).read(), re.M))
dash = json.load(open(sys.argv[1]))
used = {m for p in dash["panels"] for t in p.get("targets", []) for m in re.findall(r"\b(dxs_[a-z0-9_]+)", t["expr"])}
missing = sorted(used - exposed)
print(f"  dashboard: {len(used)} series names used, {len(used) - len(missing)} exposed by these binaries"
      + (f"; not (yet) exposed: {', '.join(missing)}" if missing else ""))
PY

step "OK: podman built the image and it works (work dir $work)"
