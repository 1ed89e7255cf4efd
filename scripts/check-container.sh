#!/usr/bin/env bash
# Single quotes here hold text for dpkg-query and for shells inside the chroot.
# shellcheck disable=SC2016

# Checks deploy/container/Dockerfile without a container engine: debootstraps Debian 12
# (standing in for the debian:bookworm image), replays the Dockerfile's stages in chroots
# with deploy/container/chroot-build.py (the same RUN steps, COPYs, USER and WORKDIR an image
# build runs), then checks the runtime stage:
#   - it runs as a non-root user;
#   - it holds no compiler, no -dev package and nothing from the build stage but binaries;
#   - every shared library the binaries need is there (ldd);
#   - as that user, with only the runtime packages: `dxs help` and `dxs-router --help`
#     work, and a 2 DP x 2 EP cluster started through dxs-entrypoint (ranks taken from
#     POD_INDEX and from the pod-style HOSTNAME, as in Kubernetes) answers `dxs generate`
#     and `dxs status`, serves /metrics, keeps UCX inside UCX_TCP_PORT_RANGE (what the
#     NetworkPolicy opens), then stops on SIGTERM.
#
# Heavy (a Debian root, the build dependencies, minutes of downloads), so it is opt-in:
#   DXS_CHECK_CONTAINER=1 scripts/check-container.sh
# Needs root and a Debian mirror. Environment:
#   DXS_CONTAINER_WORK   work directory [/tmp/dxs-container-check]; the debootstrapped base
#                        is kept there and reused (DXS_CONTAINER_FRESH=1 makes it again)
#   DXS_DEBIAN_MIRROR    [http://deb.debian.org/debian]
#   DXS_PREBUILT_BIN     a directory with dxs, dxs-router, dxs-attention, dxs-expert built
#                        from this tree on Debian 12: the build stage then installs the
#                        dependencies and configures but does not compile (build-steps.sh),
#                        for machines too small to build twice
#   DXS_CHECK_KEEP=1     keep the stage roots afterwards (they are removed otherwise)
#   DXS_BUILD_CA_BUNDLE  a CA bundle for pip in the build stage [$PIP_CERT or
#                        $REQUESTS_CA_BUNDLE]: for machines behind a TLS-intercepting proxy
# Runs under `flock /tmp/dxs-build.lock`, like other heavy jobs on shared machines.
set -euo pipefail

if [ "${DXS_CHECK_CONTAINER:-0}" != 1 ]; then
  echo "check-container: skipped (set DXS_CHECK_CONTAINER=1 to run it; it needs root and minutes)"
  exit 0
fi
if [ "$(id -u)" -ne 0 ]; then
  echo "check-container: needs root (debootstrap, chroot, mount)" >&2
  exit 1
fi
if [ -z "${DXS_CHECK_CONTAINER_LOCKED:-}" ]; then
  exec env DXS_CHECK_CONTAINER_LOCKED=1 flock /tmp/dxs-build.lock "$0" "$@"
fi

repo=$(cd "$(dirname "$0")/.." && pwd)
work=${DXS_CONTAINER_WORK:-/tmp/dxs-container-check}
mirror=${DXS_DEBIAN_MIRROR:-http://deb.debian.org/debian}
builder=$repo/deploy/container/chroot-build.py
start=$(date +%s)
step() { echo "check-container: [$(($(date +%s) - start))s] $*"; }
fail() { echo "check-container: FAIL: $*" >&2; exit 1; }

mkdir -p "$work"
if [ "${DXS_CONTAINER_FRESH:-0}" = 1 ]; then rm -rf --one-file-system "$work/base"; fi
if [ ! -x "$work/base/bin/sh" ]; then
  if ! command -v debootstrap >/dev/null; then
    step "installing debootstrap"
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends debootstrap
  fi
  step "debootstrap --variant=minbase bookworm from $mirror"
  rm -rf --one-file-system "$work/base.tmp"
  debootstrap --variant=minbase bookworm "$work/base.tmp" "$mirror" >"$work/debootstrap.log" 2>&1 ||
    { tail -20 "$work/debootstrap.log" >&2; fail "debootstrap failed (log: $work/debootstrap.log)"; }
  rm -rf "$work/base.tmp/var/cache/apt/archives/"*.deb
  mv "$work/base.tmp" "$work/base"
else
  step "reusing the Debian 12 base in $work/base"
fi

build_args=(--dockerfile "$repo/deploy/container/Dockerfile" --context "$repo"
  --base "$work/base" --image debian:bookworm --work "$work")
# A machine behind a TLS-intercepting proxy trusts the proxy's CA through PIP_CERT (or
# REQUESTS_CA_BUNDLE); setup.sh's pip in the build stage needs the same bundle.
ca_bundle=${DXS_BUILD_CA_BUNDLE:-${PIP_CERT:-${REQUESTS_CA_BUNDLE:-}}}
if [ -n "$ca_bundle" ] && [ -f "$ca_bundle" ]; then
  build_args+=(--bind "$ca_bundle:/run/dxs-host-ca.pem:build" --env PIP_CERT=/run/dxs-host-ca.pem)
  step "build stage: pip trusts the host's CA bundle $ca_bundle"
fi
if [ -n "${DXS_PREBUILT_BIN:-}" ]; then
  prebuilt=$(cd "$DXS_PREBUILT_BIN" && pwd)
  for b in dxs dxs-router dxs-attention dxs-expert; do
    [ -x "$prebuilt/$b" ] || fail "DXS_PREBUILT_BIN=$prebuilt has no $b"
  done
  build_args+=(--bind "$prebuilt:/prebuilt:build" --env DXS_PREBUILT_BIN=/prebuilt)
  step "replaying the Dockerfile (build stage: dependencies and configure; binaries from $prebuilt)"
else
  step "replaying the Dockerfile (build stage compiles dxs)"
fi
# The full output goes to build.log; the steps are shown as they go.
if ! python3 "$builder" build "${build_args[@]}" 2>&1 | tee "$work/build.log" |
  grep --line-buffered -E '^(chroot-build|build-steps|setup:|-- dxs:)' | sed -u 's/^/  | /'; then
  tail -40 "$work/build.log" >&2
  fail "the Dockerfile replay failed (log: $work/build.log)"
fi
runtime=$work/stages/runtime
trap '[ "${DXS_CHECK_KEEP:-0}" = 1 ] || rm -rf --one-file-system "$work/stages"' EXIT

in_runtime() { python3 "$builder" run --stage "$runtime" "$@"; }

step "runtime stage: user"
user=$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["user"])' "$runtime.json")
case ${user%%:*} in 0 | root) fail "the runtime stage runs as root ($user)" ;; esac
echo "  USER $user: $(in_runtime -- id)"

step "runtime stage: packages"
chroot "$work/base" dpkg-query -W -f '${Package}\n' | sort >"$work/base.packages"
chroot "$runtime" dpkg-query -W -f '${Package}\n' | sort >"$work/runtime.packages"
added=$(comm -13 "$work/base.packages" "$work/runtime.packages" | tr '\n' ' ')
echo "  added to debian:bookworm: $added"
bad=$(comm -13 "$work/base.packages" "$work/runtime.packages" |
  grep -E -- '-dev$|^(gcc|g\+\+|cpp|clang|llvm|cmake|ninja-build|make|binutils|protobuf-compiler)' || true)
[ -z "$bad" ] || fail "build-only packages in the runtime stage: $bad"
for f in /usr/local/bin/dxs /usr/local/bin/dxs-router /usr/local/bin/dxs-attention \
  /usr/local/bin/dxs-expert /usr/local/bin/dxs-entrypoint; do
  [ -x "$runtime$f" ] || fail "$f missing from the runtime stage"
done
if [ -e "$runtime/src" ] || [ -e "$runtime/opt/dxs" ]; then
  fail "build stage files leaked into the runtime stage"
fi
du -sh --exclude=proc --exclude=sys --exclude=dev "$runtime" | awk '{print "  runtime root: " $1}'

step "runtime stage: shared libraries"
missing=$(in_runtime -- /bin/sh -c 'for b in /usr/local/bin/dxs*; do
  case $b in *entrypoint) continue;; esac; ldd "$b" | sed "s|^|$b: |"; done' | grep "not found" || true)
[ -z "$missing" ] || fail "missing shared libraries: $missing"
echo "  ldd: every library of dxs, dxs-router, dxs-attention, dxs-expert found"

step "runtime stage: binaries start as $user"
in_runtime -- dxs help >/dev/null || fail "dxs help"
in_runtime -- dxs-router --help >/dev/null || fail "dxs-router --help"
in_runtime -- /bin/sh -c 'test ! -w /usr/local/bin/dxs-router' || fail "the binaries are writable by $user"
echo "  dxs help, dxs-router --help: exit 0; binaries read-only to $user"

step "runtime stage: a 2 DP x 2 EP cluster through dxs-entrypoint, as $user"
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

step "OK: the Dockerfile's stages replayed and the runtime image works (work dir $work)"
